//! NCCL's proxy threads, woken for a teardown.
//!
//! Each NCCL proxy has a service thread and a UDS service thread, and both sleep in
//! `poll(fds, n, 500)` between requests (NCCL 2.28.9, `proxy.cc`). An abort sets the
//! communicator's abort flag and joins them, but they look at the flag only when their poll
//! returns: a teardown waited up to half a second for that, 0.06–0.58 s on 2×H200
//! (`bench/probes/results/2026-11-25-h200x2-nccl-teardown.txt`), inside the application's
//! pause.
//!
//! So the agent exports `poll` (and glibc's fortified `__poll_chk`). A call with NCCL's
//! timeout of 500 ms whose return address lies in the NCCL library the agent wraps also
//! waits on an eventfd of the agent's; while the agent tears communicators down
//! ([`waking`]), that eventfd is readable, the poll returns as if it had timed out, and
//! NCCL's loop finds its abort flag. Nothing is written to NCCL's descriptors. Every other
//! call goes to the kernel after one comparison of its timeout (`ppoll`, which is how
//! glibc implements `poll` where the kernel has no `poll` call).
//!
//! `HIBER_NCCL_WAKE=0` in the application's environment turns the waking off (the
//! teardown then waits as NCCL alone does).

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// The timeout of NCCL's proxy threads' polls, in milliseconds.
const NCCL_POLL_MS: c_int = 500;
/// NCCL's largest poll (a proxy's connections and its listening socket: 73 + 1 in
/// 2.28.9); a larger one is passed through unwoken.
const MAX_FDS: usize = 255;

/// `poll(2)`, for every caller.
///
/// # Safety
/// Called as poll(2).
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn poll(_fds: *mut libc::pollfd, _n: libc::nfds_t, _timeout: c_int) -> c_int {
    core::arch::naked_asm!(
        "cmp edx, {ms}",
        "jne {plain}",
        "mov rcx, [rsp]",
        "jmp {hooked}",
        ms = const NCCL_POLL_MS,
        plain = sym plain_poll,
        hooked = sym hooked_poll,
    )
}

/// See the x86_64 version.
///
/// # Safety
/// Called as poll(2).
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn poll(_fds: *mut libc::pollfd, _n: libc::nfds_t, _timeout: c_int) -> c_int {
    core::arch::naked_asm!(
        "cmp w2, #{ms}",
        "b.eq 1f",
        "b {plain}",
        "1:",
        "mov x3, x30",
        "b {hooked}",
        ms = const NCCL_POLL_MS,
        plain = sym plain_poll,
        hooked = sym hooked_poll,
    )
}

/// glibc's `__poll_chk`, which `poll` becomes in a program built with `_FORTIFY_SOURCE`
/// when the size of the array is known: `fdslen` is that size in bytes.
///
/// # Safety
/// Called as glibc's __poll_chk.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn __poll_chk(_fds: *mut libc::pollfd, _n: libc::nfds_t, _timeout: c_int, _fdslen: usize) -> c_int {
    core::arch::naked_asm!(
        "cmp edx, {ms}",
        "jne {plain}",
        "mov r8, [rsp]",
        "jmp {hooked}",
        ms = const NCCL_POLL_MS,
        plain = sym plain_poll_chk,
        hooked = sym hooked_poll_chk,
    )
}

/// See the x86_64 version.
///
/// # Safety
/// Called as glibc's __poll_chk.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn __poll_chk(_fds: *mut libc::pollfd, _n: libc::nfds_t, _timeout: c_int, _fdslen: usize) -> c_int {
    core::arch::naked_asm!(
        "cmp w2, #{ms}",
        "b.eq 1f",
        "b {plain}",
        "1:",
        "mov x4, x30",
        "b {hooked}",
        ms = const NCCL_POLL_MS,
        plain = sym plain_poll_chk,
        hooked = sym hooked_poll_chk,
    )
}

extern "C" {
    /// glibc's report of a fortified call's overflow: prints it and aborts.
    fn __chk_fail() -> !;
}

unsafe extern "C" fn plain_poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    let ts = (timeout >= 0).then(|| libc::timespec { tv_sec: (timeout / 1000).into(), tv_nsec: ((timeout % 1000) * 1_000_000).into() });
    let tp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: the caller's own array and count (poll's contract); no signal mask, as poll.
    unsafe { libc::ppoll(fds, n, tp, std::ptr::null()) }
}

/// glibc's check: the array must hold `n` entries.
fn check_len(n: libc::nfds_t, fdslen: usize) {
    if (fdslen / std::mem::size_of::<libc::pollfd>()) < n as usize {
        // SAFETY: glibc's own reaction to this overflow; it does not return.
        unsafe { __chk_fail() }
    }
}

unsafe extern "C" fn plain_poll_chk(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int, fdslen: usize) -> c_int {
    check_len(n, fdslen);
    // SAFETY: the caller's own arguments.
    unsafe { plain_poll(fds, n, timeout) }
}

unsafe extern "C" fn hooked_poll_chk(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int, fdslen: usize, caller: *const c_void) -> c_int {
    check_len(n, fdslen);
    // SAFETY: the caller's own arguments and return address.
    unsafe { hooked_poll(fds, n, timeout, caller) }
}

unsafe extern "C" fn hooked_poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int, caller: *const c_void) -> c_int {
    let wake = match (n as usize <= MAX_FDS && from_nccl(caller)).then(wake_fd) {
        Some(Some(fd)) => fd,
        // SAFETY: the caller's own arguments.
        _ => return unsafe { plain_poll(fds, n, timeout) },
    };
    let n = n as usize;
    let mut all = [libc::pollfd { fd: -1, events: 0, revents: 0 }; MAX_FDS + 1];
    // SAFETY: poll's contract: `fds` holds `n` entries (n <= MAX_FDS was checked).
    let theirs = unsafe { std::slice::from_raw_parts_mut(fds, n) };
    all[..n].copy_from_slice(theirs);
    all[n] = libc::pollfd { fd: wake, events: libc::POLLIN, revents: 0 };
    // SAFETY: `all` holds n + 1 entries.
    let r = unsafe { plain_poll(all.as_mut_ptr(), (n + 1) as libc::nfds_t, timeout) };
    if r < 0 {
        return r;
    }
    for (t, a) in theirs.iter_mut().zip(&all[..n]) {
        t.revents = a.revents;
    }
    r - c_int::from(all[n].revents != 0)
}

thread_local! {
    /// The return address of this thread's last poll found to come from NCCL (a proxy
    /// thread polls from one place, so dladdr runs once per thread).
    static NCCL_CALLER: Cell<usize> = const { Cell::new(0) };
}

/// Whether `caller` lies in the library that holds the NCCL the agent wraps.
fn from_nccl(caller: *const c_void) -> bool {
    if NCCL_CALLER.with(Cell::get) == caller as usize {
        return true;
    }
    let base = crate::nccl::library_base();
    let ours = base != 0 && object_base(caller) == base;
    if ours {
        NCCL_CALLER.with(|c| c.set(caller as usize));
    }
    ours
}

/// The load address of the object that contains `p` (0 when none does).
pub(crate) fn object_base(p: *const c_void) -> usize {
    // SAFETY: dladdr only reads the loader's tables; Dl_info is plain data.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(p, &mut info) == 0 {
            return 0;
        }
        info.dli_fbase as usize
    }
}

/// This process's eventfd and its PID (a forked child makes its own): `pid << 32 | fd`.
static WAKE: AtomicU64 = AtomicU64::new(0);
/// 0 unread, 1 on, 2 off (`HIBER_NCCL_WAKE=0`).
static ENABLED: AtomicU8 = AtomicU8::new(0);

fn enabled() -> bool {
    match ENABLED.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var_os("HIBER_NCCL_WAKE").is_none_or(|v| v != "0");
            ENABLED.store(if on { 1 } else { 2 }, Ordering::Relaxed);
            on
        }
        v => v == 1,
    }
}

/// The eventfd that NCCL's polls also wait on, made on first use.
fn wake_fd() -> Option<c_int> {
    if !enabled() {
        return None;
    }
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u32 as u64;
    let cur = WAKE.load(Ordering::Acquire);
    if cur != 0 && cur >> 32 == pid {
        return Some(cur as u32 as c_int);
    }
    // SAFETY: creates a new descriptor; nothing else is touched.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return None;
    }
    match WAKE.compare_exchange(cur, pid << 32 | fd as u32 as u64, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => Some(fd),
        Err(won) => {
            crate::close_fd(fd);
            (won >> 32 == pid).then_some(won as u32 as c_int)
        }
    }
}

/// While alive, NCCL's proxy threads' polls return at once (the eventfd stays readable), so
/// that a teardown does not wait for them to time out.
pub(crate) struct Waking(Option<c_int>);

pub(crate) fn waking() -> Waking {
    let fd = wake_fd();
    if let Some(fd) = fd {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to this process's eventfd.
        let _ = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    }
    Waking(fd)
}

impl Drop for Waking {
    fn drop(&mut self) {
        if let Some(fd) = self.0 {
            let mut v: u64 = 0;
            // SAFETY: reads 8 bytes into a live u64 (resets the counter; non-blocking).
            let _ = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A pipe's read end, registered for input, and its write end.
    fn pipe() -> (c_int, c_int) {
        let mut fds = [0; 2];
        // SAFETY: a two-element array for pipe(2).
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        (fds[0], fds[1])
    }

    /// Polls `fd` for input with NCCL's timeout as if called from `caller`, giving the
    /// result, the revents and how long it took.
    fn poll_from(caller: usize, fd: c_int) -> (c_int, i16, Duration) {
        let mut p = [libc::pollfd { fd, events: libc::POLLIN, revents: -1 }, libc::pollfd { fd: -1, events: libc::POLLIN, revents: -1 }];
        let t = Instant::now();
        // SAFETY: a live two-entry array.
        let r = unsafe { hooked_poll(p.as_mut_ptr(), 2, NCCL_POLL_MS, caller as *const c_void) };
        assert_eq!(p[1].revents, 0, "an ignored entry reports nothing");
        (r, p[0].revents, t.elapsed())
    }

    /// One test, as the wake and NCCL's address are per process.
    #[test]
    fn polls_from_nccl_wake_for_a_teardown_and_others_do_not() {
        // Stand-in for NCCL's library: the C library, whose `getpid` is a caller inside it.
        let in_lib = libc::getpid as *const () as usize;
        crate::nccl::set_library_base_for_tests(object_base(in_lib as *const c_void));
        let elsewhere = polls_from_nccl_wake_for_a_teardown_and_others_do_not as *const () as usize;
        let (r, w) = pipe();

        // Not waking: NCCL's poll times out after its 500 ms, as without the agent.
        let (n, rev, took) = poll_from(in_lib, r);
        assert_eq!((n, rev), (0, 0));
        assert!(took >= Duration::from_millis(490), "{took:?}");

        {
            let _waking = waking();
            // NCCL's poll returns at once, as a timeout; another library's does not wake.
            let (n, rev, took) = poll_from(in_lib, r);
            assert_eq!((n, rev), (0, 0));
            assert!(took < Duration::from_millis(100), "{took:?}");
            let (n, _, took) = poll_from(elsewhere, r);
            assert_eq!(n, 0);
            assert!(took >= Duration::from_millis(490), "{took:?}");
            // Its own descriptors' events come through, counted without the eventfd's.
            // SAFETY: one byte from a live buffer to the pipe.
            assert_eq!(unsafe { libc::write(w, b"x".as_ptr().cast(), 1) }, 1);
            let (n, rev, _) = poll_from(in_lib, r);
            assert_eq!((n, rev), (1, libc::POLLIN));
        }
        // Once the teardown is over, NCCL's polls sleep again (an event still wakes them).
        let (n, rev, _) = poll_from(in_lib, r);
        assert_eq!((n, rev), (1, libc::POLLIN));
        let mut b = [0u8; 1];
        // SAFETY: reads the one byte into a live buffer.
        assert_eq!(unsafe { libc::read(r, b.as_mut_ptr().cast(), 1) }, 1);
        let t = Instant::now();
        let (n, _, _) = poll_from(in_lib, r);
        assert_eq!(n, 0);
        assert!(t.elapsed() >= Duration::from_millis(490));

        // The exported symbols: glibc's poll semantics (timeout, readiness), and the
        // fortified check of the array's length.
        let mut p = [libc::pollfd { fd: r, events: libc::POLLIN, revents: 0 }];
        // SAFETY: a live one-entry array.
        assert_eq!(unsafe { poll(p.as_mut_ptr(), 1, 20) }, 0);
        // SAFETY: as above.
        assert_eq!(unsafe { libc::write(w, b"y".as_ptr().cast(), 1) }, 1);
        // SAFETY: a live one-entry array, its size in bytes.
        assert_eq!(unsafe { __poll_chk(p.as_mut_ptr(), 1, -1, std::mem::size_of_val(&p)) }, 1);
        assert_eq!(p[0].revents, libc::POLLIN);
        crate::close_fd(r);
        crate::close_fd(w);
    }
}
