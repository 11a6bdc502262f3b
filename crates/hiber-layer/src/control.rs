//! A layer's control thread: started in a process the first time the application uses what
//! the layer stands in front of, it listens on the abstract socket named after the job's
//! token and the process's PID, and serves hiber's connections one at a time
//! (`hiber_wire::socket::serve`). A process that never gets there has no thread and no
//! socket; a child forked after its parent started one gets its own when it gets there.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, Ordering};

use hiber_wire::socket;

/// How a layer's control thread is named and found.
pub struct Spec {
    /// The environment variable holding the job's token (`hiber run` sets it); without it
    /// no thread is started (the layer only stands in front of the calls).
    pub token_env: &'static str,
    /// The abstract socket's name for a token and a PID.
    pub socket_name: fn(&str, i32) -> String,
    /// The thread's name.
    pub thread: &'static str,
    /// The layer's log.
    pub log: fn(&str),
    /// What a process without a control thread means for its checkpoints, for the log.
    pub without: &'static str,
}

/// One layer's control thread in this process.
pub struct ControlThread {
    /// The PID that started it (a forked child has another).
    started_in: AtomicI32,
    /// The listening socket's descriptor, owned by the thread, or -1.
    listener: AtomicI32,
}

impl ControlThread {
    pub const fn new() -> ControlThread {
        ControlThread { started_in: AtomicI32::new(0), listener: AtomicI32::new(-1) }
    }

    /// Starts the thread once per process: it runs `serve` on the listening socket.
    pub fn start(&self, spec: &Spec, serve: impl FnOnce(OwnedFd) + Send + 'static) {
        let pid = std::process::id() as i32;
        if self.started_in.swap(pid, Ordering::SeqCst) == pid {
            return;
        }
        let Ok(token) = std::env::var(spec.token_env) else { return };
        let name = (spec.socket_name)(&token, pid);
        let listener = match socket::listen(&name) {
            Ok(l) => l,
            Err(e) => {
                (spec.log)(&format!("pid {pid}: cannot listen on @{name}: {e}; {}", spec.without));
                return;
            }
        };
        self.listener.store(listener.as_raw_fd(), Ordering::SeqCst);
        if let Err(e) = std::thread::Builder::new().name(spec.thread.into()).spawn(move || serve(listener)) {
            // The listener was dropped (closed) with the closure.
            self.listener.store(-1, Ordering::SeqCst);
            (spec.log)(&format!("pid {pid}: cannot start the control thread: {e}; {}", spec.without));
        }
    }

    /// Whether this process started it.
    pub fn started(&self) -> bool {
        self.started_in.load(Ordering::SeqCst) == std::process::id() as i32
    }

    /// In a forked child (from a fork handler): closes the parent's listening socket, whose
    /// thread did not come along.
    pub fn forget_listener(&self) {
        let fd = self.listener.swap(-1, Ordering::SeqCst);
        if fd >= 0 {
            // SAFETY: `fd` is the parent's listening socket; in the child no thread owns it
            // (the control thread exists only in the parent), so it is closed once, here.
            unsafe { libc::close(fd) };
        }
    }
}

impl Default for ControlThread {
    fn default() -> Self {
        ControlThread::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    fn name(token: &str, pid: i32) -> String {
        format!("hiber-layer-test.{token}.{pid}")
    }

    fn spec(token_env: &'static str) -> Spec {
        Spec { token_env, socket_name: name, thread: "hiber-test", log: |_| {}, without: "no control" }
    }

    #[test]
    fn starts_once_with_a_token_and_serves_its_socket() {
        static CONTROL: ControlThread = ControlThread::new();
        let token = format!("t{}", std::process::id());
        std::env::set_var("HIBER_LAYER_TEST_TOKEN_A", &token);
        let (tx, rx) = mpsc::channel();
        let tx2 = tx.clone();
        CONTROL.start(&spec("HIBER_LAYER_TEST_TOKEN_A"), move |l| {
            let c = socket::accept(&l).unwrap();
            tx.send(std::thread::current().name().map(str::to_string)).unwrap();
            drop(c);
            std::thread::park();
        });
        assert!(CONTROL.started());
        // A second start in the same process does nothing.
        CONTROL.start(&spec("HIBER_LAYER_TEST_TOKEN_A"), move |_| tx2.send(Some("second".into())).unwrap());
        let _c = socket::connect(&name(&token, std::process::id() as i32)).expect("the socket listens");
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap().as_deref(), Some("hiber-test"));
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "one thread only");
    }

    #[test]
    fn without_a_token_no_thread_and_no_socket() {
        static CONTROL: ControlThread = ControlThread::new();
        CONTROL.start(&spec("HIBER_LAYER_TEST_TOKEN_UNSET"), |_| panic!("no thread without a token"));
        assert!(CONTROL.started(), "marked, so that it is not tried again");
        assert_eq!(CONTROL.listener.load(Ordering::SeqCst), -1);
    }
}
