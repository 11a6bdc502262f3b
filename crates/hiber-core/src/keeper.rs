//! The keeper: a small process (`hiber __keep`) that holds the descriptors of what a
//! checkpoint took from a job while hiber alone has it, so that a hiber killed then does
//! not take it along.
//!
//! With `--leave-running` the agent releases its device memory to hiber (the descriptor of
//! each allocation) and gets it back after the dump; the copies are written only once the
//! job runs again. Between release and hand-back, hiber held the only reference: a SIGKILL
//! there freed the job's memory. The driver frees an allocation only once every reference
//! to it is gone, its shareable descriptors included, so a descriptor kept open by another
//! process keeps the memory; `hiber recover` takes it back from the keeper and hands it to
//! the agent as it is.
//!
//! One keeper per checkpoint, started before the pause, listening on one abstract socket per
//! process (`hiber-keep-PID-START`). A connection carries one request and one descriptor at
//! a time ([`hiber_wire::socket`]): `hold ID` with a descriptor (answered `ok`), `take ID`
//! (answered `fd` with the descriptor, or `none`), `done` (the process has its memory back:
//! its descriptors go, answered `ok`). Only root and the keeper's own user may connect, and
//! hiber talks only to a keeper run by root or its own user (the names can be guessed from
//! /proc; another user's socket of that name is refused). The keeper exits once every
//! process is done or gone (it checks every two seconds): memory of a process that ended is
//! of no use to anyone; and once hiber is gone while it holds nothing (hiber killed before
//! the agents released anything).

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hiber_wire::socket;

/// The hidden subcommand that runs [`main`].
pub const KEEP_COMMAND: &str = "__keep";

/// How often the keeper looks for processes that are gone.
const WATCH: Duration = Duration::from_secs(2);
/// How long hiber waits for the keeper to start.
const START: Duration = Duration::from_secs(5);
/// How long hiber waits for an answer inside the job's pause.
pub const IN_PAUSE: Duration = Duration::from_secs(1);
/// How long `hiber recover` waits for an answer.
pub const AT_REST: Duration = Duration::from_secs(10);

/// The socket the keeper listens on for process `pid` (started at `start`).
pub fn name(pid: i32, start: u64) -> String {
    format!("hiber-keep-{pid}-{start}")
}

/// A keeper this hiber started.
pub struct Keeper {
    child: Child,
    targets: Vec<(i32, u64)>,
}

impl Keeper {
    /// Starts `exe __keep PID:START...` and waits until it listens. It runs in a process
    /// group of its own: a ^C meant for hiber does not reach it.
    pub fn start(exe: &std::path::Path, targets: &[(i32, u64)]) -> io::Result<Keeper> {
        use std::os::unix::process::CommandExt;
        let mut child = Command::new(exe)
            .arg(KEEP_COMMAND)
            .args(targets.iter().map(|(pid, start)| format!("{pid}:{start}")))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()?;
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::other("no pipe from the keeper"));
        };
        // Its first line, within START: a keeper that hangs must not hold the checkpoint.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = tx.send(BufReader::new(stdout).read_line(&mut line).map(|_| line));
        });
        let line = match rx.recv_timeout(START) {
            Ok(Ok(line)) => line,
            Ok(Err(e)) => format!("reading its answer: {e}"),
            Err(_) => format!("no answer in {} s", START.as_secs()),
        };
        if line.trim() != "ready" {
            let _ = child.kill();
            let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
            return Err(io::Error::other(format!("the keeper did not start: {} ({status})", line.trim())));
        }
        Ok(Keeper { child, targets: targets.to_vec() })
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The start time this keeper knows `pid` by.
    pub fn start_of(&self, pid: i32) -> Option<u64> {
        self.targets.iter().find(|(p, _)| *p == pid).map(|(_, s)| *s)
    }
}

impl Drop for Keeper {
    /// Reaps it once every process was done; one that still holds something (a hand-back
    /// that failed) is left running for `hiber recover`.
    fn drop(&mut self) {
        let until = Instant::now() + Duration::from_secs(1);
        while Instant::now() < until {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// One connection to the keeper of `pid`.
pub struct Conn {
    sock: OwnedFd,
}

impl Conn {
    /// Connects to the keeper of `pid`, which must run as root or as this process's user;
    /// each answer is awaited at most `timeout`.
    pub fn open(pid: i32, start: u64, timeout: Duration) -> io::Result<Conn> {
        let sock = socket::connect(&name(pid, start))?;
        // SAFETY: geteuid has no preconditions.
        let own = unsafe { libc::geteuid() };
        match socket::peer_uid(&sock)? {
            uid if uid == 0 || uid == own => {}
            uid => {
                return Err(io::Error::new(io::ErrorKind::PermissionDenied, format!("the socket {} belongs to uid {uid}, not to a keeper", name(pid, start))))
            }
        }
        socket::set_recv_timeout(&sock, Some(timeout))?;
        Ok(Conn { sock })
    }

    fn call(&self, msg: &str, fd: Option<BorrowedFd<'_>>) -> io::Result<(String, Option<OwnedFd>)> {
        socket::send(&self.sock, msg, fd.map(|f| f.as_raw_fd()))?;
        socket::recv(&self.sock)?.ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "the keeper closed the connection"))
    }

    /// Gives the keeper a reference to allocation `id`.
    pub fn hold(&self, id: u64, fd: BorrowedFd<'_>) -> io::Result<()> {
        match self.call(&format!("hold {id}"), Some(fd))?.0.as_str() {
            "ok" => Ok(()),
            other => Err(io::Error::other(format!("the keeper answered {other:?}"))),
        }
    }

    /// The keeper's reference to allocation `id`, if it has one.
    pub fn take(&self, id: u64) -> io::Result<Option<OwnedFd>> {
        match self.call(&format!("take {id}"), None)? {
            (m, Some(fd)) if m == "fd" => Ok(Some(fd)),
            (m, None) if m == "none" => Ok(None),
            (other, _) => Err(io::Error::other(format!("the keeper answered {other:?}"))),
        }
    }

    /// The process has its memory back: the keeper lets its references go.
    pub fn done(&self) -> io::Result<()> {
        match self.call("done", None)?.0.as_str() {
            "ok" => Ok(()),
            other => Err(io::Error::other(format!("the keeper answered {other:?}"))),
        }
    }
}

/// What the keeper holds, by process; a process leaves once it is done or gone.
type Held = Arc<Mutex<HashMap<i32, HashMap<u64, OwnedFd>>>>;

/// The keeper's main: `hiber __keep PID:START...`. Returns its exit status.
pub fn main(args: &[String]) -> i32 {
    let mut targets = Vec::new();
    for a in args {
        match a.split_once(':').and_then(|(p, s)| Some((p.parse::<i32>().ok()?, s.parse::<u64>().ok()?))) {
            Some(t) => targets.push(t),
            None => {
                println!("bad target {a:?}");
                return 2;
            }
        }
    }
    crate::sys::raise_open_files_limit();
    let mut listeners = Vec::new();
    for &(pid, start) in &targets {
        match socket::listen(&name(pid, start)) {
            Ok(l) => listeners.push((pid, start, l)),
            Err(e) => {
                println!("cannot listen for process {pid}: {e}");
                return 1;
            }
        }
    }
    let held: Held = Arc::new(Mutex::new(targets.iter().map(|&(pid, _)| (pid, HashMap::new())).collect()));
    // SAFETY: getppid has no preconditions.
    let hiber = unsafe { libc::getppid() };
    println!("ready");
    // Nothing more goes to hiber's pipe, which may be gone with hiber.
    for (pid, _, listener) in listeners {
        let held = held.clone();
        std::thread::spawn(move || loop {
            let Ok(conn) = socket::accept(&listener) else {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            };
            // SAFETY: getuid has no preconditions.
            let own = unsafe { libc::getuid() };
            if socket::peer_uid(&conn).is_ok_and(|uid| uid == 0 || uid == own) {
                // A connection left open (a hiber killed mid-hold) must not keep out the next.
                let held = held.clone();
                std::thread::spawn(move || serve(pid, &conn, &held));
            }
        });
    }
    loop {
        std::thread::sleep(WATCH);
        let mut h = held.lock().unwrap_or_else(|e| e.into_inner());
        h.retain(|pid, _| {
            let start = targets.iter().find(|(p, _)| p == pid).map(|(_, s)| *s);
            crate::proctree::stat(*pid).is_ok_and(|s| Some(s.start_time) == start) && crate::proctree::alive(*pid)
        });
        // SAFETY: getppid has no preconditions.
        let orphaned = unsafe { libc::getppid() } != hiber;
        if h.is_empty() || (orphaned && h.values().all(HashMap::is_empty)) {
            return 0;
        }
    }
}

/// One connection for process `pid`, until it closes.
fn serve(pid: i32, conn: &OwnedFd, held: &Held) {
    while let Ok(Some((msg, fd))) = socket::recv(conn) {
        let mut h = held.lock().unwrap_or_else(|e| e.into_inner());
        let reply = match (msg.split_once(' '), fd) {
            (Some(("hold", id)), Some(fd)) => match (id.parse::<u64>(), h.get_mut(&pid)) {
                (Ok(id), Some(mine)) => {
                    mine.insert(id, fd);
                    socket::send(conn, "ok", None)
                }
                _ => socket::send(conn, "refused", None),
            },
            (Some(("take", id)), None) => match id.parse::<u64>().ok().and_then(|id| h.get(&pid)?.get(&id)) {
                Some(fd) => socket::send(conn, "fd", Some(fd.as_raw_fd())),
                None => socket::send(conn, "none", None),
            },
            _ if msg == "done" => {
                h.remove(&pid);
                let r = socket::send(conn, "ok", None);
                if h.is_empty() {
                    std::process::exit(0);
                }
                r
            }
            _ => socket::send(conn, "refused", None),
        };
        drop(h);
        if reply.is_err() {
            return;
        }
    }
}
