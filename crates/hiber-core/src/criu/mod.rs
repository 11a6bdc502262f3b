//! CRIU, driven through its RPC interface (`criu swrk`), never through its text output.
//!
//! Each request runs in its own `criu swrk` child connected over a `SOCK_SEQPACKET` pair.
//! CRIU's notifications ("post-dump", "pre-resume", ...) are answered by a callback, which
//! is how hiber finishes an image while the tree is still frozen: if the callback fails,
//! CRIU resumes the tree instead of killing it.

mod client;

pub use client::{Criu, CriuError, CriuVersion, DumpOptions, RestoreOptions};

/// Types generated from CRIU's `images/rpc.proto` (and the statistics of `stats.proto`).
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

/// The oldest CRIU that works on current kernels (3.x fails on kernels after 6.12).
pub const MIN_VERSION: (i32, i32) = (4, 0);
