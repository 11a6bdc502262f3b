//! The gate every intercepted call of a preloaded layer (the CUDA agent, the OpenCL
//! layer) passes: open while the application runs, closed while hiber checkpoints it.
//!
//! A call counts itself in before it checks the gate, so once [`close`] has seen every
//! count at zero no application thread is inside the driver through an intercepted entry
//! point, and none can enter until [`open`]. Threads that arrive while it is closed wait.
//!
//! The call path is on every intercepted call (a launch-heavy OpenCL program makes millions),
//! so it has no locked instruction: each thread counts itself in a slot of its own, with
//! plain stores, and checks the gate after a compiler fence only. The rare [`close`] pays
//! instead: after it marks the gate closed it has the kernel run a memory barrier on every
//! CPU (`membarrier(MEMBARRIER_CMD_GLOBAL)`, an RCU grace period, milliseconds), so that
//! either a thread's count is visible to it or that thread sees the gate closed (the two
//! stores and two loads of Dekker's algorithm, with the fences made asymmetric). Where the
//! kernel refuses membarrier (a seccomp filter, `nohz_full`), every call fences instead.
//!
//! Nothing here takes a lock: threads held at a closed gate, and the closer, poll (a gate
//! is closed for the seconds of a checkpoint), so that a child forked at any moment, with
//! only the forking thread, finds no lock held by a thread it does not have. A fork handler
//! makes the child forget the parent's other threads' calls and a gate closed on the parent.

use std::cell::Cell;
use std::sync::atomic::{compiler_fence, fence, AtomicBool, AtomicPtr, AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

static CLOSED: AtomicBool = AtomicBool::new(false);
/// Held by the one [`close`] or [`open`] under way (a flag, not a lock: see above).
static CLOSING: AtomicBool = AtomicBool::new(false);
/// How often a closer waiting for calls looks again (and a held thread, at first).
const POLL: Duration = Duration::from_micros(200);
/// The longest a thread held at a closed gate sleeps between looks.
const HELD_POLL_MAX: Duration = Duration::from_millis(2);

/// Calls in flight of one thread (only that thread writes it), or of the threads that reach
/// the gate while their thread-locals are being destroyed ([`SHARED`], atomically).
struct Slot {
    /// Calls counted in: those that passed, and one checking the gate. The closer reads it.
    inside: AtomicUsize,
    /// Calls that passed the gate and have not ended; read only by the thread itself, to
    /// tell a call made inside another (unused on [`SHARED`]).
    passed: AtomicUsize,
    /// A living thread owns it; a thread that ended leaves it to the next new one.
    taken: AtomicBool,
    next: AtomicPtr<Slot>,
}

/// Every slot ever made, as a list that only grows (to the most threads alive at once:
/// slots are reused).
static SLOTS: AtomicPtr<Slot> = AtomicPtr::new(std::ptr::null_mut());
static SHARED: Slot =
    Slot { inside: AtomicUsize::new(0), passed: AtomicUsize::new(0), taken: AtomicBool::new(true), next: AtomicPtr::new(std::ptr::null_mut()) };

fn slots() -> impl Iterator<Item = &'static Slot> {
    let mut p = SLOTS.load(Ordering::Acquire);
    std::iter::from_fn(move || {
        // SAFETY: the list holds only leaked slots, never freed.
        let s: &'static Slot = unsafe { p.as_ref()? };
        p = s.next.load(Ordering::Acquire);
        Some(s)
    })
}

/// A thread's hold on its slot, given back when the thread ends.
struct Owner(&'static Slot);

impl Drop for Owner {
    fn drop(&mut self) {
        // Calls made later in the thread's exit (other thread-locals' destructors, pthread
        // keys' ones) must not count in a slot that a new thread may take: they find no slot
        // of their own, and [`take_slot`] gives them the shared one.
        let _ = MINE.try_with(|m| m.set(None));
        self.0.taken.store(false, Ordering::Release);
    }
}

thread_local! {
    static MINE: Cell<Option<&'static Slot>> = const { Cell::new(None) };
    static OWNER: Cell<Option<Owner>> = const { Cell::new(None) };
}

/// This thread's slot: a free one, or a new one (leaked, and added to the list).
fn take_slot() -> &'static Slot {
    register_at_fork();
    let slot = match slots().find(|s| s.taken.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed).is_ok()) {
        Some(s) => s,
        None => {
            let s: &'static Slot = Box::leak(Box::new(Slot {
                inside: AtomicUsize::new(0),
                passed: AtomicUsize::new(0),
                taken: AtomicBool::new(true),
                next: AtomicPtr::new(std::ptr::null_mut()),
            }));
            let mut head = SLOTS.load(Ordering::Acquire);
            loop {
                s.next.store(head, Ordering::Relaxed);
                match SLOTS.compare_exchange_weak(head, s as *const Slot as *mut Slot, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => break s,
                    Err(now) => head = now,
                }
            }
        }
    };
    // Registered for the thread's end; a thread whose thread-locals are being destroyed
    // uses SHARED.
    if OWNER.try_with(|o| o.set(Some(Owner(slot)))).is_err() {
        slot.taken.store(false, Ordering::Release);
        return &SHARED;
    }
    let _ = MINE.try_with(|m| m.set(Some(slot)));
    slot
}

fn my_slot() -> &'static Slot {
    match MINE.try_with(Cell::get) {
        Ok(Some(s)) => s,
        Ok(None) => take_slot(),
        Err(_) => &SHARED,
    }
}

/// 0: the fork handler is not registered; 1: being registered; 2: registered.
static AT_FORK: AtomicU8 = AtomicU8::new(0);

/// Registers [`after_fork_in_child`] once, and returns only once it is registered: before
/// any thread counts in and before any gate closes, so that every child forked while a call
/// was in flight or the gate was closed runs it.
fn register_at_fork() {
    match AT_FORK.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            // SAFETY: registers a handler that only stores to atomics and reads a
            // thread-local of this module, which is async-signal-safe and cannot unwind.
            unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
            AT_FORK.store(2, Ordering::Release);
        }
        Err(_) => {
            // Registration takes microseconds. Bounded all the same: in a child forked
            // while another thread registered, that thread is gone and never finishes.
            for _ in 0..10_000 {
                if AT_FORK.load(Ordering::Acquire) == 2 {
                    break;
                }
                std::thread::yield_now();
            }
        }
    }
}

/// In the child of a fork only the forking thread lives on: the other threads' calls in
/// flight are not the child's, nor is a gate that hiber closed on the parent (the child has
/// no hiber connection of its own yet), nor a close under way.
extern "C" fn after_fork_in_child() {
    let mine = MINE.try_with(Cell::get).ok().flatten();
    for s in slots() {
        if mine.is_some_and(|m| std::ptr::eq(m, s)) {
            continue;
        }
        s.inside.store(0, Ordering::Relaxed);
        s.passed.store(0, Ordering::Relaxed);
        s.taken.store(false, Ordering::Relaxed);
    }
    // The shared slot's calls are the other threads' (a forking thread in its exit that
    // counts there is not inside a call: fork is no intercepted call).
    SHARED.inside.store(0, Ordering::Relaxed);
    CLOSED.store(false, Ordering::SeqCst);
    CLOSING.store(false, Ordering::SeqCst);
}

const MEMBARRIER_CMD_QUERY: libc::c_int = 0;
const MEMBARRIER_CMD_GLOBAL: libc::c_int = 1;
/// 0: not known yet; 1: `close` runs membarrier, calls need a compiler fence only; 2: calls
/// fence themselves.
static MODE: AtomicU8 = AtomicU8::new(0);

fn membarrier(cmd: libc::c_int) -> libc::c_long {
    // SAFETY: membarrier(2) takes a command and flags and touches no memory of ours.
    unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_uint) }
}

fn asymmetric() -> bool {
    match MODE.load(Ordering::Acquire) {
        1 => true,
        2 => false,
        _ => {
            let q = membarrier(MEMBARRIER_CMD_QUERY);
            let mode = if q >= 0 && q & MEMBARRIER_CMD_GLOBAL as libc::c_long != 0 { 1 } else { 2 };
            // Every thread computes the same answer; the first store wins, the rest agree.
            let _ = MODE.compare_exchange(0, mode, Ordering::AcqRel, Ordering::Acquire);
            MODE.load(Ordering::Acquire) == 1
        }
    }
}

/// An application thread inside the driver (ends on the thread that entered).
pub struct Pass(&'static Slot, std::marker::PhantomData<*const ()>);

fn count_in(s: &'static Slot) {
    if std::ptr::eq(s, &SHARED) {
        s.inside.fetch_add(1, Ordering::SeqCst);
    } else {
        // Only this thread writes its slot: no read-modify-write needed.
        s.inside.store(s.inside.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

fn count_out(s: &'static Slot) {
    if std::ptr::eq(s, &SHARED) {
        // Saturating: a fork handler may have zeroed it under a pass.
        let _ = s.inside.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| Some(n.saturating_sub(1)));
    } else {
        s.inside.store(s.inside.load(Ordering::Relaxed).saturating_sub(1), Ordering::Release);
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        let s = self.0;
        // Not passed first, then counted out: a signal handler's call in between waits,
        // where the other order would let it pass uncounted.
        if !std::ptr::eq(s, &SHARED) {
            s.passed.store(s.passed.load(Ordering::Relaxed).saturating_sub(1), Ordering::Relaxed);
        }
        count_out(s);
    }
}

/// The call counted in `slot` has passed the gate.
fn passed(slot: &'static Slot) -> Pass {
    if !std::ptr::eq(slot, &SHARED) {
        slot.passed.store(slot.passed.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
    Pass(slot, std::marker::PhantomData)
}

/// Waits while the gate is closed, then counts the caller in until the `Pass` drops.
pub fn enter() -> Pass {
    let slot = my_slot();
    // A call made inside another that passed the gate (an application callback the driver
    // runs): the outer one is counted, so the gate cannot close under it, and waiting would
    // only keep it from closing. The thread's own slot counts its calls that passed, apart
    // from the count the closer reads: that one also holds a call still checking the gate,
    // and a signal handler's call made while its thread checks must wait like any other
    // (the checking call may be about to see the gate closed). One thread-local access per
    // call. The shared slot counts other threads too, so there every call waits (a callback
    // in a thread's exit, with the gate closed, makes that close time out: the checkpoint
    // fails, and the application runs on).
    if !std::ptr::eq(slot, &SHARED) && slot.passed.load(Ordering::Relaxed) > 0 {
        count_in(slot);
        return passed(slot);
    }
    loop {
        count_in(slot);
        // Between the count and the check: the closer's membarrier stands for the fence.
        // Asked each time: a close that found membarrier refused makes every call fence.
        if asymmetric() {
            compiler_fence(Ordering::SeqCst);
        } else {
            fence(Ordering::SeqCst);
        }
        if !CLOSED.load(Ordering::Relaxed) {
            return passed(slot);
        }
        count_out(slot);
        // Many threads may wait here for the seconds of a checkpoint: each backs off to
        // HELD_POLL_MAX, so they cost little, and resume within that once the gate opens.
        let mut pause = POLL;
        while CLOSED.load(Ordering::SeqCst) {
            std::thread::sleep(pause);
            pause = (pause * 2).min(HELD_POLL_MAX);
        }
    }
}

/// The calls in flight, counted once the gate is marked closed and every CPU fenced.
fn in_flight() -> usize {
    fence(Ordering::SeqCst);
    SHARED.inside.load(Ordering::SeqCst) + slots().map(|s| s.inside.load(Ordering::Acquire)).sum::<usize>()
}

/// Holds [`CLOSING`] until dropped.
struct Closing;

impl Closing {
    fn take() -> Closing {
        while CLOSING.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            std::thread::sleep(POLL);
        }
        Closing
    }
}

impl Drop for Closing {
    fn drop(&mut self) {
        CLOSING.store(false, Ordering::Release);
    }
}

/// Closes the gate and waits until no call is in flight. On timeout the gate opens again
/// and the number of calls still inside is returned.
pub fn close(timeout: Duration) -> Result<(), usize> {
    register_at_fork();
    let deadline = Instant::now().checked_add(timeout).unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365));
    let _closing = Closing::take();
    CLOSED.store(true, Ordering::SeqCst);
    // After this, every thread either made its count visible or will see the gate closed.
    if asymmetric() && membarrier(MEMBARRIER_CMD_GLOBAL) != 0 {
        // Refused now though it was offered: make every call fence from here on, and wait
        // out the calls that checked the gate without one (they were already inside).
        MODE.store(2, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
    }
    loop {
        let n = in_flight();
        if n == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            CLOSED.store(false, Ordering::SeqCst);
            return Err(n);
        }
        std::thread::sleep(POLL);
    }
}

pub fn open() {
    let _closing = Closing::take();
    CLOSED.store(false, Ordering::SeqCst);
}

pub fn is_closed() -> bool {
    CLOSED.load(Ordering::SeqCst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    // One test: the gate is process-wide.
    #[test]
    fn close_waits_for_calls_in_flight_and_holds_new_ones() {
        let inside = enter();
        let t = std::thread::spawn(|| close(Duration::from_millis(50)));
        assert_eq!(t.join().unwrap(), Err(1), "a call in flight makes close time out");
        assert!(!is_closed(), "a timed-out close opens the gate again");

        let done = Arc::new(AtomicU64::new(0));
        let closer = std::thread::spawn(|| close(Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(20));
        drop(inside);
        assert_eq!(closer.join().unwrap(), Ok(()));
        let d = done.clone();
        let caller = std::thread::spawn(move || {
            let _p = enter();
            d.store(1, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(done.load(Ordering::SeqCst), 0, "a new call waits at the closed gate");
        open();
        caller.join().unwrap();
        assert_eq!(done.load(Ordering::SeqCst), 1);

        // Many threads calling all the time, the gate closed and opened under them: while
        // it is closed, none is inside (each says so in a counter of its own making).
        let inside_now = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let callers: Vec<_> = (0..4)
            .map(|_| {
                let (inside_now, stop) = (inside_now.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut calls = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let p = enter();
                        inside_now.fetch_add(1, Ordering::SeqCst);
                        std::hint::spin_loop();
                        inside_now.fetch_sub(1, Ordering::SeqCst);
                        drop(p);
                        calls += 1;
                    }
                    calls
                })
            })
            .collect();
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(2));
            assert_eq!(close(Duration::from_secs(5)), Ok(()));
            for _ in 0..200 {
                assert_eq!(inside_now.load(Ordering::SeqCst), 0, "a call got past the closed gate");
            }
            open();
        }
        stop.store(true, Ordering::Relaxed);
        let calls: u64 = callers.into_iter().map(|t| t.join().unwrap()).sum();
        assert!(calls > 0);
        // A call made inside another while the gate closes goes through (the outer one
        // holds the close back anyway), and the close succeeds once both end.
        let outer = enter();
        let closer = std::thread::spawn(|| close(Duration::from_secs(5)));
        while !is_closed() {
            std::thread::yield_now();
        }
        let inner = enter();
        drop(inner);
        drop(outer);
        assert_eq!(closer.join().unwrap(), Ok(()));
        open();

        // A call made while its thread is still checking the gate (a signal handler's, run
        // between the thread's count and its check) is no call inside another: with the
        // gate closed it waits, and the close times out on the checking call's count.
        let checked = Arc::new(AtomicBool::new(false));
        let (closing, c) = (Arc::new(AtomicBool::new(false)), checked.clone());
        let closed_and_back = Arc::new(AtomicBool::new(false));
        let (cl, back) = (closing.clone(), closed_and_back.clone());
        let checker = std::thread::spawn(move || {
            let slot = my_slot();
            count_in(slot); // where a signal finds the thread
            cl.store(true, Ordering::SeqCst);
            // Not for ever: a thread not scheduled while the gate was closed goes on.
            while !is_closed() && !back.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            let p = enter();
            let passed_closed = is_closed();
            drop(p);
            count_out(slot);
            c.store(true, Ordering::SeqCst);
            passed_closed
        });
        while !closing.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        let closed = close(Duration::from_millis(300));
        closed_and_back.store(true, Ordering::SeqCst);
        assert_eq!(closed, Err(1), "the checking call's count holds the close");
        assert!(!checker.join().unwrap(), "a call made while its thread checked passed a closed gate");
        assert!(checked.load(Ordering::SeqCst));
        assert_eq!(close(Duration::from_secs(1)), Ok(()));
        open();

        // A child forked while another thread is inside a call has none in flight itself,
        // and can close its own gate.
        let held = Arc::new(AtomicBool::new(true));
        let entered = Arc::new(AtomicBool::new(false));
        let (h, e) = (held.clone(), entered.clone());
        let holder = std::thread::spawn(move || {
            let _p = enter();
            e.store(true, Ordering::SeqCst);
            while h.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        while !entered.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        // SAFETY: the child only closes the gate and exits, without unwinding.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = if close(Duration::from_millis(200)).is_ok() { 0 } else { 1 };
            // SAFETY: ends the child at once, as a forked test child must.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child's gate closed: status {status}");
        assert_eq!(close(Duration::from_millis(50)), Err(1), "the parent's call is still in flight");
        held.store(false, Ordering::SeqCst);
        holder.join().unwrap();

        // A child forked while the gate is closed (hiber checkpointing the parent) runs.
        assert_eq!(close(Duration::from_secs(1)), Ok(()));
        // SAFETY: the child only passes the gate and exits, without unwinding.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = if is_closed() {
                1
            } else {
                drop(enter());
                0
            };
            // SAFETY: ends the child at once, as a forked test child must.
            unsafe { libc::_exit(code) };
        }
        // SAFETY: waits for the child just forked.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child's gate is open: status {status}");
        assert!(is_closed(), "the parent's stays closed");
        open();

        // Threads that ended leave their slots to new ones.
        let before = slots().count();
        for _ in 0..20 {
            std::thread::spawn(|| drop(enter())).join().unwrap();
        }
        assert!(slots().count() <= before + 1, "slots reused: {} after {before}", slots().count());
    }
}
