//! Whether this is still the process that made something, or a child forked from it.
//!
//! A layer's connection or object made before a `fork` belongs to the parent: the child must
//! not use it (its descriptors and mappings are the parent's) nor drop it. Asking the kernel
//! for the process id on every call costs a system call (glibc no longer caches it: about
//! 0.2–0.5 µs, a third of a posted call through the proxy). A count of forks, raised in each
//! child by a `pthread_atfork` handler, answers from memory instead.
//!
//! What it cannot see: a child made by a raw `clone` system call without glibc's `fork`
//! (whose handlers then never run). `vfork` and `posix_spawn` children only exec or exit.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn forked() {
    // Async-signal-safe: an atomic add on a static.
    FORKS.fetch_add(1, Ordering::AcqRel);
}

/// The process (in fork generations) something was made in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Epoch(u64);

/// This process's epoch; from the first call on, every child forked counts as another.
pub fn epoch() -> Epoch {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a child handler that only makes an atomic add.
        unsafe { libc::pthread_atfork(None, None, Some(forked)) };
    });
    Epoch(FORKS.load(Ordering::Acquire))
}

impl Epoch {
    /// Whether this is still the process of the epoch (not a child forked since).
    pub fn is_current(self) -> bool {
        FORKS.load(Ordering::Acquire) == self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_is_another_process_and_its_parent_is_not() {
        let e = epoch();
        assert!(e.is_current());
        // SAFETY: the child only reads an atomic and exits, with no allocation or lock.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let code = if !e.is_current() && epoch().is_current() { 0 } else { 1 };
            // SAFETY: ends the child without running the test harness's exit handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked; `status` is a live int.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child saw itself as its parent");
        assert!(e.is_current(), "the parent is unchanged");
    }
}
