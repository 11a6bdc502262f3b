//! CRIU, driven through its RPC interface (`criu swrk`), never through its text output.
//!
//! Each request runs in its own `criu swrk` child connected over a `SOCK_SEQPACKET` pair.
//! CRIU's notifications ("post-dump", "pre-resume", ...) are answered by a callback, which
//! is how hiber finishes an image while the tree is still frozen: if the callback fails,
//! CRIU resumes the tree instead of killing it.

mod client;

pub use client::{Criu, CriuError, CriuVersion, DumpOptions, RestoreOptions};

/// Types generated from CRIU's `images/rpc.proto`, and the parts of its image files hiber
/// reads (`stats.proto`, `files.proto`).
#[allow(clippy::all)]
pub mod rpc {
    include!(concat!(env!("OUT_DIR"), "/_.rs"));
}

/// What CRIU measured of one dump (its `stats-dump` file).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DumpStats {
    /// From the freeze of the tree until CRIU let it go (resumed, or stopped for good).
    pub frozen: std::time::Duration,
    /// Draining the processes' memory into pipes, and writing those to the image.
    pub memdump: std::time::Duration,
    pub memwrite: std::time::Duration,
    /// Memory written to the image.
    pub bytes_written: u64,
}

/// Reads the `stats-dump` CRIU leaves in a dump's work directory: the image header (two
/// 32-bit magics), then one entry as a 32-bit length and a `stats_entry` message. `None`
/// when it is not there or not readable (the figures are a report, never a reason to fail).
pub fn read_dump_stats(work_dir: &std::path::Path) -> Option<DumpStats> {
    use prost::Message;
    let bytes = std::fs::read(work_dir.join("stats-dump")).ok()?;
    let len = u32::from_le_bytes(bytes.get(8..12)?.try_into().ok()?) as usize;
    let entry = rpc::StatsEntry::decode(bytes.get(12..12 + len)?).ok()?;
    let d = entry.dump?;
    let us = |v: Option<u32>| std::time::Duration::from_micros(u64::from(v.unwrap_or(0)));
    Some(DumpStats {
        frozen: us(d.frozen_time),
        memdump: us(d.memdump_time),
        memwrite: us(d.memwrite_time),
        bytes_written: d.pages_written.unwrap_or(0) * crate::sys::page_size() as u64,
    })
}

/// The local addresses of the TCP sockets of an image (`files.img` in CRIU's images
/// directory): listening, connected or only bound, each of which a restore binds again.
/// A file of CRIU's format is its header (two 32-bit magics), then entries, each a 32-bit
/// length and a `file_entry` message.
pub fn tcp_addresses(images_dir: &std::path::Path) -> std::io::Result<Vec<std::net::SocketAddr>> {
    use prost::Message;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
    const INETSK: u32 = 4;
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("files.img: {what}"));
    let bytes = std::fs::read(images_dir.join("files.img"))?;
    let mut at = 8;
    let mut out = Vec::new();
    while at < bytes.len() {
        let len = bytes.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize).ok_or_else(|| bad("a torn entry"))?;
        let body = bytes.get(at + 4..at + 4 + len).ok_or_else(|| bad("a torn entry"))?;
        at += 4 + len;
        let entry = rpc::FileEntry::decode(body).map_err(|e| bad(&e.to_string()))?;
        let Some(sk) = entry.isk.filter(|_| entry.r#type == Some(INETSK)) else { continue };
        let port = sk.src_port.unwrap_or(0);
        if sk.proto != Some(libc::IPPROTO_TCP as u32) || port == 0 || port > u32::from(u16::MAX) {
            continue;
        }
        // The kernel's bytes, in words as CRIU copied them from memory (little-endian here).
        let raw: Vec<u8> = sk.src_addr.iter().flat_map(|w| w.to_le_bytes()).collect();
        let ip = match (sk.family.map(|f| f as i32), raw.len()) {
            (Some(libc::AF_INET), 4) => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&raw[..]).unwrap())),
            (Some(libc::AF_INET6), 16) => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&raw[..]).unwrap())),
            (Some(libc::AF_INET), 0) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            (Some(libc::AF_INET6), 0) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            _ => continue,
        };
        out.push(SocketAddr::new(ip, port as u16));
    }
    Ok(out)
}

/// The oldest CRIU that works on current kernels (3.x fails on kernels after 6.12).
pub const MIN_VERSION: (i32, i32) = (4, 0);
