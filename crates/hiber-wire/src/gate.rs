//! The gate every intercepted call of a preloaded layer (the CUDA agent, the OpenCL
//! layer) passes: open while the application runs, closed while hiber checkpoints it.
//!
//! A call counts itself in before it checks the gate, so once [`close`] has seen the count
//! at zero no application thread is inside the driver through an intercepted entry point,
//! and none can enter until [`open`]. Threads that arrive while it is closed wait.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

static CLOSED: AtomicBool = AtomicBool::new(false);
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
static LOCK: Mutex<()> = Mutex::new(());
static CHANGED: Condvar = Condvar::new();

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// An application thread inside the driver.
pub struct Pass(());

impl Drop for Pass {
    fn drop(&mut self) {
        if IN_FLIGHT.fetch_sub(1, Ordering::SeqCst) == 1 && CLOSED.load(Ordering::SeqCst) {
            let _g = lock();
            CHANGED.notify_all();
        }
    }
}

/// Waits while the gate is closed, then counts the caller in until the `Pass` drops.
pub fn enter() -> Pass {
    loop {
        IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        if !CLOSED.load(Ordering::SeqCst) {
            return Pass(());
        }
        drop(Pass(()));
        let mut g = lock();
        while CLOSED.load(Ordering::SeqCst) {
            g = CHANGED.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Closes the gate and waits until no call is in flight. On timeout the gate opens again
/// and the number of calls still inside is returned.
pub fn close(timeout: Duration) -> Result<(), usize> {
    let deadline = Instant::now().checked_add(timeout).unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365));
    let mut g = lock();
    CLOSED.store(true, Ordering::SeqCst);
    loop {
        let n = IN_FLIGHT.load(Ordering::SeqCst);
        if n == 0 {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            CLOSED.store(false, Ordering::SeqCst);
            CHANGED.notify_all();
            return Err(n);
        }
        // Short waits: a thread that leaves between the load and the wait is seen next time.
        g = CHANGED.wait_timeout(g, left.min(Duration::from_millis(5))).unwrap_or_else(|e| e.into_inner()).0;
    }
}

pub fn open() {
    let _g = lock();
    CLOSED.store(false, Ordering::SeqCst);
    CHANGED.notify_all();
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
    }
}
