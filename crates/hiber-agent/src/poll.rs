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
//! timeout of 500 ms whose return address lies in the NCCL library the agent wraps (its
//! address range, noted when the agent first resolves an NCCL entry point) also waits on an
//! eventfd of the agent's; while the agent tears communicators down ([`waking`]), that
//! eventfd is readable, the poll returns as if it had timed out, and NCCL's loop finds its
//! abort flag. Nothing is written to NCCL's descriptors. Every other call goes to glibc's
//! `poll` after one comparison of its timeout; the path takes no lock.
//!
//! Should the eventfd stop being the agent's (the application closed its number, or put
//! another file there), the waking turns itself off rather than let NCCL's threads spin.
//! `HIBER_NCCL_WAKE=0` in the application's environment turns it off from the start (the
//! teardown then waits as NCCL alone does).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};

/// The timeout of NCCL's proxy threads' polls, in milliseconds.
const NCCL_POLL_MS: c_int = 500;
/// Descriptors a poll may have on the stack (NCCL 2.28.9's largest is a proxy's 73
/// connections and its listening socket); a larger one is copied to the heap.
const STACK_FDS: usize = 255;

type PollFn = unsafe extern "C" fn(*mut libc::pollfd, libc::nfds_t, c_int) -> c_int;

/// glibc's `poll`, resolved when the agent is loaded.
static REAL_POLL: AtomicUsize = AtomicUsize::new(0);

extern "C" fn resolve_at_load() {
    if let Some(dlsym) = crate::cuda::real_dlsym() {
        // SAFETY: glibc's dlsym, called from the agent: RTLD_NEXT finds the definition
        // after the agent's, the C library's.
        let p = unsafe { dlsym(libc::RTLD_NEXT, c"poll".as_ptr()) } as usize;
        // Never the agent's own, which would call itself.
        if p != 0 && object_range(p) != object_range(poll as *const () as usize) {
            REAL_POLL.store(p, Ordering::Release);
        }
    }
}

#[used]
#[link_section = ".init_array"]
static RESOLVE_AT_LOAD: extern "C" fn() = resolve_at_load;

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
    match REAL_POLL.load(Ordering::Acquire) {
        // SAFETY: glibc's poll (its signature is PollFn), with the caller's own arguments.
        p if p != 0 => unsafe { std::mem::transmute::<usize, PollFn>(p)(fds, n, timeout) },
        _ => {
            let ts = (timeout >= 0).then(|| libc::timespec { tv_sec: (timeout / 1000).into(), tv_nsec: ((timeout % 1000) * 1_000_000).into() });
            let tp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
            // SAFETY: the caller's own array and count (poll's contract); no signal mask,
            // as poll.
            unsafe { libc::ppoll(fds, n, tp, std::ptr::null()) }
        }
    }
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
    let wake = match (n > 0 && from_nccl(caller as usize)).then(wake_fd) {
        Some(Some(fd)) => fd,
        // SAFETY: the caller's own arguments.
        _ => return unsafe { plain_poll(fds, n, timeout) },
    };
    let n = n as usize;
    let mut stack = [libc::pollfd { fd: -1, events: 0, revents: 0 }; STACK_FDS + 1];
    let mut heap = Vec::new();
    let all: &mut [libc::pollfd] = if n <= STACK_FDS {
        &mut stack[..n + 1]
    } else {
        heap.resize(n + 1, libc::pollfd { fd: -1, events: 0, revents: 0 });
        &mut heap[..]
    };
    // SAFETY: poll's contract: `fds` holds `n` entries (n > 0, so it is not null).
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
    let ours = all[n].revents;
    if ours != 0 && !WAKING.load(Ordering::Acquire) {
        unexpected(ours);
    } else if ours == 0 {
        UNEXPECTED.store(0, Ordering::Relaxed);
    }
    r - c_int::from(ours != 0)
}

/// The address range of the NCCL library the agent wraps: `[lo, hi)`, both 0 until known.
static NCCL_LO: AtomicUsize = AtomicUsize::new(0);
static NCCL_HI: AtomicUsize = AtomicUsize::new(0);

/// Notes the range of the library that holds `entry`, an NCCL entry point (once).
pub(crate) fn note_nccl(entry: usize) {
    if NCCL_HI.load(Ordering::Acquire) != 0 {
        return;
    }
    if let Some((lo, hi)) = object_range(entry) {
        NCCL_LO.store(lo, Ordering::Relaxed);
        NCCL_HI.store(hi, Ordering::Release);
    }
}

/// Whether `caller` lies in the NCCL library the agent wraps (two loads, no lock).
fn from_nccl(caller: usize) -> bool {
    let hi = NCCL_HI.load(Ordering::Acquire);
    hi != 0 && (NCCL_LO.load(Ordering::Relaxed)..hi).contains(&caller)
}

/// The range that its loadable segments span, of the object that maps address `p`.
fn object_range(p: usize) -> Option<(usize, usize)> {
    struct Search {
        p: usize,
        found: Option<(usize, usize)>,
    }
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _size: libc::size_t, data: *mut c_void) -> c_int {
        // SAFETY: dl_iterate_phdr passes a valid info for the call, and `data` is the
        // Search given below.
        let (info, search) = unsafe { (&*info, &mut *data.cast::<Search>()) };
        if info.dlpi_phdr.is_null() {
            return 0;
        }
        // SAFETY: dlpi_phdr points to dlpi_phnum program headers.
        let headers = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
        let spans = headers.iter().filter(|h| h.p_type == libc::PT_LOAD).map(|h| {
            let lo = info.dlpi_addr as usize + h.p_vaddr as usize;
            (lo, lo + h.p_memsz as usize)
        });
        if !spans.clone().any(|(lo, hi)| (lo..hi).contains(&search.p)) {
            return 0;
        }
        search.found = spans.reduce(|(a, b), (lo, hi)| (a.min(lo), b.max(hi)));
        1
    }
    let mut search = Search { p, found: None };
    // SAFETY: the callback only reads what the loader passes it and writes the Search,
    // which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), (&mut search as *mut Search).cast()) };
    search.found
}

/// This process's eventfd and its PID (a forked child makes its own): `pid << 32 | fd`.
static WAKE: AtomicU64 = AtomicU64::new(0);
/// 0 unread, 1 on, 2 off (`HIBER_NCCL_WAKE=0`, or the eventfd was lost).
static ENABLED: AtomicU8 = AtomicU8::new(0);
/// Whether a teardown keeps the eventfd readable now.
static WAKING: AtomicBool = AtomicBool::new(false);
/// NCCL polls in a row that found the eventfd ready with no teardown under way.
static UNEXPECTED: AtomicU32 = AtomicU32::new(0);

/// The eventfd answered `revents` with no teardown under way: closed (its number now free,
/// or another file's), or ready for someone else. A few such answers happen at the end of a
/// teardown; more in a row, or an invalid descriptor, turn the waking off for good.
fn unexpected(revents: i16) {
    let lost = revents & (libc::POLLNVAL | libc::POLLERR | libc::POLLHUP) != 0;
    if lost || UNEXPECTED.fetch_add(1, Ordering::Relaxed) >= 100 {
        ENABLED.store(2, Ordering::Relaxed);
    }
}

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
        WAKING.store(true, Ordering::Release);
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
            WAKING.store(false, Ordering::Release);
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
        assert_ne!(REAL_POLL.load(Ordering::Acquire), 0, "glibc's poll, resolved at load");
        assert!(!from_nccl(in_lib), "no NCCL noted yet");
        note_nccl(in_lib);
        assert!(from_nccl(in_lib) && from_nccl(libc::getppid as *const () as usize));
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
        // A poll too large for the stack is woken the same way.
        let mut many = vec![libc::pollfd { fd: -1, events: libc::POLLIN, revents: 0 }; 600];
        many[599] = libc::pollfd { fd: r, events: libc::POLLIN, revents: 0 };
        {
            let _waking = waking();
            // SAFETY: a live array of 600 entries.
            let n = unsafe { hooked_poll(many.as_mut_ptr(), 600, NCCL_POLL_MS, in_lib as *const c_void) };
            assert_eq!((n, many[599].revents), (1, libc::POLLIN), "the pipe still holds a byte");
        }
        // SAFETY: reads the byte into a live buffer.
        assert_eq!(unsafe { libc::read(r, b.as_mut_ptr().cast(), 1) }, 1);

        // The application closes the agent's eventfd: the next NCCL poll finds it invalid
        // and returns once, as a timeout; the waking turns off for good (no spin), and the
        // polls after wait out their timeout as without the agent.
        let fd = wake_fd().unwrap();
        crate::close_fd(fd);
        let (n, rev, took) = poll_from(in_lib, r);
        assert_eq!((n, rev), (0, 0));
        assert!(took < Duration::from_millis(100), "the closed descriptor answered at once: {took:?}");
        assert!(wake_fd().is_none(), "waking is off");
        let (n, _, took) = poll_from(in_lib, r);
        assert_eq!(n, 0);
        assert!(took >= Duration::from_millis(490), "{took:?}");
        crate::close_fd(r);
        crate::close_fd(w);
    }
}
