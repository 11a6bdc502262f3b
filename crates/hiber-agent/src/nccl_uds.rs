//! Waking NCCL's UDS proxy threads once their communicators are aborted.
//!
//! Every NCCL proxy (one per communicator, or one shared by a parent and the children
//! split with its resources) runs a thread serving a datagram socket bound to the abstract
//! name `tmp/nccl-socket-<rank>-<hash>`. The thread polls the socket with a 500 ms timeout
//! and looks at its proxy's stop and abort flags only when the poll returns; an aborted
//! communicator's teardown joins it. So each teardown waited up to half a second for
//! nothing (NCCL 2.28.9, `proxy.cc` `ncclProxyServiceUDS` and `init.cc` `commFree`; the
//! same in 2.29). An empty datagram sent once the flags are set ends the poll, and the
//! thread leaves before it reads the datagram.
//!
//! A proxy whose flags are *not* set would read the datagram as a request and fail it, so
//! the caller wakes only when it aborts every communicator of the process, and [`wake`]
//! only when the process has no more such sockets than communicators being aborted.

use std::collections::HashSet;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// How NCCL names the sockets in `/proc/net/unix` (abstract: `@`, then the name, its NUL
/// padding shown as `@`).
const PREFIX: &str = "@tmp/nccl-socket-";

/// Sends an empty datagram to each of this process's NCCL UDS sockets, if there are at
/// most `aborted` of them and the job did not turn it off ([`hiber_wire::NCCL_WAKE_ENV`]);
/// returns how many it woke.
pub fn wake(aborted: usize) -> usize {
    if std::env::var_os(hiber_wire::NCCL_WAKE_ENV).is_some_and(|v| v == "0") {
        return 0;
    }
    let names = own_sockets();
    if names.is_empty() || names.len() > aborted {
        return 0;
    }
    let Ok(sock) = UnixDatagram::unbound() else { return 0 };
    // A full socket queue means its thread is awake already.
    let _ = sock.set_nonblocking(true);
    names.iter().filter(|n| SocketAddr::from_abstract_name(n).and_then(|a| sock.send_to_addr(&[], &a)).is_ok()).count()
}

/// The abstract names of the NCCL UDS sockets among this process's open files.
fn own_sockets() -> Vec<Vec<u8>> {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else { return Vec::new() };
    let inodes: HashSet<u64> = fds
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok())
        .collect();
    let table = std::fs::read_to_string("/proc/self/net/unix").unwrap_or_default();
    table.lines().skip(1).filter_map(|l| nccl_name(l, &inodes)).collect()
}

/// The abstract name (without its leading NUL) in one line of `/proc/net/unix`
/// (`Num RefCount Protocol Flags Type St Inode Path`), when it is an NCCL UDS socket whose
/// inode is in `inodes`.
fn nccl_name(line: &str, inodes: &HashSet<u64>) -> Option<Vec<u8>> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let (inode, path) = (f.get(6)?.parse::<u64>().ok()?, *f.get(7)?);
    if !path.starts_with(PREFIX) || !inodes.contains(&inode) {
        return None;
    }
    Some(path.bytes().skip(1).map(|b| if b == b'@' { 0 } else { b }).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// NCCL's binding: the whole `sun_path`, `/tmp/...` with its first byte set to NUL.
    fn nccl_like(rank: u32, hash: u64) -> Vec<u8> {
        let mut name = format!("tmp/nccl-socket-{rank}-{hash:x}").into_bytes();
        name.resize(107, 0);
        name
    }

    #[test]
    fn a_line_names_only_an_nccl_socket_of_this_process() {
        let own: HashSet<u64> = [42].into();
        let padded = format!("{PREFIX}0-1f{}", "@".repeat(90));
        let line = |inode: u64, path: &str| format!("0000000000000000: 00000002 00000000 00000000 0002 01 {inode} {path}");
        let name = nccl_name(&line(42, &padded), &own).expect("an NCCL socket of this process");
        assert_eq!(&name[..18], b"tmp/nccl-socket-0-");
        assert_eq!(name.len(), padded.len() - 1);
        assert!(name[20..].iter().all(|b| *b == 0), "the padding is NULs");
        assert_eq!(nccl_name(&line(43, &padded), &own), None, "another process's socket");
        assert_eq!(nccl_name(&line(42, "@other"), &own), None);
        assert_eq!(nccl_name(&line(42, ""), &own), None, "an unnamed socket");
    }

    #[test]
    fn an_nccl_socket_of_this_process_gets_an_empty_datagram() {
        let name = nccl_like(std::process::id(), 0x5eed_u64 << 20 | u64::from(std::process::id()));
        let sock = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(own_sockets().contains(&name), "found in /proc/self/net/unix");
        // More sockets than communicators being aborted: one may belong to a live proxy.
        assert_eq!(wake(0), 0);
        let woken = wake(usize::MAX);
        assert!(woken >= 1);
        let mut buf = [0u8; 8];
        assert_eq!(sock.recv(&mut buf).unwrap(), 0, "an empty datagram arrived");
    }
}
