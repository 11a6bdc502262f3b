//! `sys::close_from_except`, in a process of its own: closing descriptors is sound only
//! where nothing else owns them, which a test harness's threads cannot promise. This is a
//! plain program (`harness = false`) whose only thread is `main`.

use std::os::fd::{IntoRawFd, RawFd};

use hiber_core::sys;

fn is_open(fd: RawFd) -> bool {
    // SAFETY: F_GETFD only asks whether a descriptor number is open.
    unsafe { libc::fcntl(fd, libc::F_GETFD) != -1 }
}

fn main() {
    assert_eq!(sys::thread_count().unwrap(), 1, "a harness-less test runs on one thread");
    // Raw numbers: no object owns them, so nothing uses or closes them after the call.
    let fds: Vec<RawFd> = (0..4).map(|_| std::fs::File::open("/dev/null").unwrap().into_raw_fd()).collect();
    let keep = fds[1];
    // SAFETY: this process has one thread, and no object of it owns a descriptor above 2:
    // those of `fds` are raw, and the rest are whatever the test runner leaked to it.
    unsafe { sys::close_from_except(3, &[keep]) };
    assert!((0..3).all(is_open), "standard descriptors stay open");
    assert!(is_open(keep), "the kept descriptor stays open");
    for fd in fds.iter().filter(|&&fd| fd != keep) {
        assert!(!is_open(*fd), "descriptor {fd} was closed");
    }
    assert_eq!(std::fs::read_dir("/proc/self/fd").unwrap().count(), 5, "0, 1, 2, the kept one and read_dir's own");
    println!("test close_from_except_keeps_only_what_it_is_told ... ok");
}
