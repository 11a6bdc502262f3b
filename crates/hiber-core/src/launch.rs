//! Starting a job's tree under a detached shim.
//!
//! A job's root runs as the init of its own PID namespace and leads its own session there,
//! with stdin from /dev/null and stdout/stderr appended to the job's log files: that is
//! what lets CRIU restore it while the original still runs, several times side by side.
//! It also gets its own mount namespace, with a /proc of its PID namespace: the CUDA
//! driver looks itself up under /proc/<getpid()> and fails (CUDA_ERROR_OPERATING_SYSTEM)
//! with the host's /proc. Every other mount is the host's, which CRIU treats as external
//! (bind-mounted back on restore). The job's files are opened inside the namespace, so
//! that CRIU finds their mounts there.
//!
//! The root's parent is a small shim that records the root's exit status in the job
//! directory. `hiber restore` uses the same shim, which then becomes the parent of the
//! restored tree. The shim is hiber itself, executed afresh (`hiber __shim`) rather than
//! forked: by the time hiber starts a shim it may have threads (blake3's pool after
//! verifying an image, a GPU driver's), and a forked copy of a multi-threaded process may
//! only make async-signal-safe calls until it execs. A freshly executed shim is
//! single-threaded, so it may fork and run ordinary Rust (CRIU's RPC, say).
//!
//! The protocol: [`spawn_shim`] runs `/proc/self/exe __shim` with a pipe on its stdin and
//! another on its stdout, writes one JSON [`ShimTask`] (with the job directory) to the
//! first and closes it, and reads one JSON line, a [`Started`], from the second. The
//! program must hand `__shim` ([`SHIM_COMMAND`]) to [`shim_main`]: hiber's CLI does.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde::{Deserialize, Serialize};

use crate::criu::{Criu, RestoreOptions};
use crate::jobs;
use crate::sys::{self, Fork};

/// The argument that makes hiber a job's shim (see [`shim_main`]).
pub const SHIM_COMMAND: &str = "__shim";

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{step}: {source}")]
    Io { step: &'static str, source: std::io::Error },
    #[error("{0}")]
    Start(String),
    #[error("the job's shim exited before reporting")]
    ShimVanished,
}

/// A shim's report once the job's root is running (or could not be started).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Started {
    Running { pid: i32 },
    Failed { message: String, hint: Option<String>, log: Option<String> },
}

/// What a shim starts as its child, the job's root.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShimTask {
    /// A command, as the init of new PID and mount namespaces (`hiber run`).
    Run(Command),
    /// A CRIU image, restored as the shim's child (`hiber restore`).
    Restore(RestoreTask),
}

/// What a shim passes to [`Criu::restore`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RestoreTask {
    /// The CRIU binary.
    #[serde(with = "wire_path")]
    pub criu: PathBuf,
    #[serde(with = "wire_path")]
    pub images_dir: PathBuf,
    #[serde(with = "wire_path")]
    pub work_dir: PathBuf,
    /// `(key, fd)` as in [`RestoreOptions::inherit`]: descriptors of hiber's, which the
    /// shim inherits under the same numbers (0, 1 and 2 cannot be passed).
    pub inherit: Vec<(String, RawFd)>,
    /// See [`RestoreOptions::external_mounts`].
    pub external_mounts: bool,
    /// Restore into a new network namespace with only loopback up.
    pub isolate_net: bool,
    /// See [`RestoreOptions::leave_stopped`].
    #[serde(default)]
    pub leave_stopped: bool,
    /// A descriptor of hiber's that the shim keeps open for as long as it lives and hands
    /// to nobody: the restore's lock (`restore.lock`, see [`jobs::RestoreMarker`]), which
    /// so stays held while hiber or the shim runs.
    #[serde(default)]
    pub hold: Option<RawFd>,
    /// A socket of hiber's: at CRIU's post-restore notification (every process and socket
    /// made, the network still locked, nothing resumed) the shim sends one byte on it and
    /// waits for hiber's answer, which hiber gives once the restore's
    /// [`Phase::SocketsRestored`](crate::coordinator::Phase::SocketsRestored) barrier passed:
    /// `g` goes on; anything else, or hiber gone, makes CRIU undo the restore.
    #[serde(default)]
    pub post_restore: Option<RawFd>,
}

/// The shim's byte at CRIU's post-restore, and hiber's answers.
pub const POST_RESTORE_REACHED: u8 = b'r';
pub const POST_RESTORE_GO: u8 = b'g';
pub const POST_RESTORE_UNDO: u8 = b'n';

impl ShimTask {
    /// The descriptors the shim must inherit.
    fn fds(&self) -> Vec<RawFd> {
        match self {
            ShimTask::Run(c) => c.hold.into_iter().collect(),
            ShimTask::Restore(r) => r.inherit.iter().map(|(_, fd)| *fd).chain(r.hold).chain(r.post_restore).collect(),
        }
    }
}

/// What hiber writes on a shim's stdin.
#[derive(Serialize, Deserialize)]
struct Request {
    #[serde(with = "wire_path")]
    job_dir: PathBuf,
    task: ShimTask,
    /// The hiber that asked: (PID, start time).
    #[serde(default)]
    hiber: Option<(i32, u64)>,
}

/// Starts a detached shim (hiber executed again, see the module's doc) that starts `task`
/// as its child, reports the outcome, then waits for that child and records its exit
/// status in `job_dir`.
///
/// The shim keeps only standard descriptors (on /dev/null), its report pipe and the
/// task's descriptors: none that hiber's caller leaked, so the caller sees EOF on its
/// pipes when hiber exits. Safe to call with threads running: the child that std forks
/// only clears close-on-exec on the task's descriptors before it execs.
pub fn spawn_shim(job_dir: &Path, task: &ShimTask) -> Result<Started, LaunchError> {
    let io = |step| move |source| LaunchError::Io { step, source };
    let keep = task.fds();
    if let Some(fd) = keep.iter().find(|&&fd| fd < 3) {
        return Err(LaunchError::Start(format!("descriptor {fd} cannot be passed to a job's shim (0 to 2 are its standard ones)")));
    }
    let me = sys::getpid();
    let hiber = crate::proctree::stat(me).ok().map(|s| (me, s.start_time));
    let request = serde_json::to_vec(&Request { job_dir: job_dir.to_path_buf(), task: task.clone(), hiber }).expect("a shim request serializes");
    // The running executable itself, even if its path was replaced since it started: the
    // shim speaks this hiber's protocol.
    let mut cmd = std::process::Command::new("/proc/self/exe");
    if let Some(arg0) = std::env::args_os().next() {
        cmd.arg0(arg0);
    }
    cmd.arg(SHIM_COMMAND).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    // SAFETY: the closure runs in the forked child before exec and calls only fcntl, which
    // is async-signal-safe; it allocates nothing (`keep` was built before the fork). The
    // descriptors are hiber's own, open until `spawn` returns; only the child's copies
    // lose close-on-exec, so no other child of hiber inherits them.
    unsafe {
        cmd.pre_exec(move || {
            for fd in &keep {
                sys::clear_cloexec(*fd)?;
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(io("start the job's shim"))?;
    let (mut stdin, stdout) = (child.stdin.take().expect("stdin is piped"), child.stdout.take().expect("stdout is piped"));
    // A shim that fails before reading all of it still reports why (or vanishes).
    let _ = stdin.write_all(&request);
    drop(stdin);
    // This child exits as soon as it has forked the shim proper, which is adopted by init
    // (or a subreaper) and outlives this hiber.
    let _ = child.wait();
    let mut line = String::new();
    let mut reader = BufReader::new(stdout);
    reader.read_line(&mut line).map_err(io("read the shim's report"))?;
    // The shim closes its end right after the report: waiting for that (briefly) means that
    // once hiber returns, the shim holds nothing of hiber's, as `hiber run`'s callers see.
    let _ = sys::wait_hangup(reader.get_ref().as_fd(), std::time::Duration::from_secs(2));
    serde_json::from_str(&line).map_err(|_| LaunchError::ShimVanished)
}

/// The shim's side of [`spawn_shim`], for the program's `__shim` command: reads the
/// request from `input` (the process's stdin), reports on stdout, and returns the exit
/// code. It detaches first (new session, /dev/null on 0 to 2, no other descriptor but
/// what the task needs) and forks once, so that the process hiber waits for exits and the
/// shim proper is adopted by init. It refuses to run in a process with more than one
/// thread: call it before starting any.
///
/// # Safety
///
/// Call it first thing in a process started by [`spawn_shim`]: it closes every
/// descriptor above 2 but the task's, so nothing else of the process may own one.
pub unsafe fn shim_main(mut input: impl Read) -> i32 {
    let mut text = Vec::new();
    let request = input.read_to_end(&mut text).map_err(|e| e.to_string()).and_then(|_| serde_json::from_slice::<Request>(&text).map_err(|e| e.to_string()));
    // The report pipe is stdout: moved off 1 (to a close-on-exec number above 2) before
    // /dev/null takes its place.
    let mut report = match std::io::stdout().as_fd().try_clone_to_owned() {
        Ok(fd) => File::from(fd),
        Err(_) => return 1,
    };
    let failed = |message: String| Started::Failed { message, hint: None, log: None };
    let request = match request {
        Ok(r) => r,
        Err(e) => {
            send(&mut report, &failed(format!("the job's shim got a bad request: {e}")));
            return 1;
        }
    };
    if sys::thread_count().ok() != Some(1) {
        send(&mut report, &failed("the job's shim must be single-threaded".into()));
        return 1;
    }
    if let Err(e) = detach(&request.task, report.as_fd()) {
        send(&mut report, &failed(format!("the job's shim cannot detach: {e}")));
        return 1;
    }
    // SAFETY: this process has one thread (checked above; nothing since started one), so
    // the child may run ordinary Rust.
    match unsafe { sys::fork() } {
        Ok(Fork::Parent(_)) => return 0,
        Ok(Fork::Child) => {}
        Err(e) => {
            send(&mut report, &failed(format!("the job's shim cannot fork: {e}")));
            return 1;
        }
    }
    let stopped = matches!(&request.task, ShimTask::Restore(t) if t.leave_stopped);
    let started = match request.task {
        ShimTask::Run(cmd) => {
            let mut start_time = 0;
            // SAFETY: a child forked from a single-threaded process has one thread too.
            let started = unsafe { start_in_namespace(&cmd, &mut start_time) };
            let started = recorded_run(&request.job_dir, cmd.argv.clone(), start_time, started);
            // Recorded (or failed): the start's lock has nothing left to guard.
            if let Some(fd) = cmd.hold {
                // SAFETY: `fd` is the start's lock hiber passed this shim under this number
                // (kept by `detach`), which nothing else here owns or uses: closed once.
                drop(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
            }
            started
        }
        ShimTask::Restore(task) => recorded(&request.job_dir, restore(task)),
    };
    send(&mut report, &started);
    drop(report);
    if let (Started::Running { pid }, true, Some(hiber)) = (&started, stopped, request.hiber) {
        watch_stopped_tree(*pid, hiber);
    }
    if let Started::Running { pid } = started {
        // Record the exit before reaping: while the root is a zombie the job still counts
        // as running, so nobody sees it gone with no exit status.
        if let Ok(status) = sys::wait_exited_keep_zombie(pid) {
            let _ = jobs::write_exit(&request.job_dir, status);
        }
        let _ = sys::waitpid(pid);
    }
    0
}

/// A tree CRIU left stopped waits for hiber to restore its device state and continue it.
/// Should hiber go away first (killed, say), the tree can never run as it should: the
/// shim kills it, and records its end as for any job, rather than leave it stopped forever.
fn watch_stopped_tree(root: i32, (hiber_pid, hiber_start): (i32, u64)) {
    let poll = std::time::Duration::from_millis(50);
    // CRIU queued the SIGSTOP as it let the tree go: the root stops a moment later.
    let start = std::time::Instant::now();
    while !crate::proctree::is_stopped(root) {
        if start.elapsed() > std::time::Duration::from_secs(10) || !crate::proctree::alive(root) {
            return;
        }
        std::thread::sleep(poll);
    }
    while crate::proctree::is_stopped(root) {
        if !crate::proctree::is_same_process(hiber_pid, hiber_start) {
            let _ = sys::kill(root, libc::SIGKILL);
            return;
        }
        std::thread::sleep(poll);
    }
}

fn send(report: &mut File, started: &Started) {
    let _ = writeln!(report, "{}", serde_json::to_string(started).expect("a report serializes"));
}

/// Own session, /dev/null on 0 to 2, and no descriptor above them but `report` and the
/// task's.
fn detach(task: &ShimTask, report: BorrowedFd<'_>) -> std::io::Result<()> {
    sys::setsid()?;
    let devnull = File::options().read(true).write(true).open("/dev/null")?;
    for fd in 0..3 {
        sys::replace_stdio(devnull.as_fd(), fd)?;
    }
    drop(devnull);
    let mut keep = task.fds();
    for fd in &keep {
        // Open across the exec only to get here; CRIU gets copies of its own.
        sys::set_cloexec(*fd)?;
    }
    keep.push(report.as_raw_fd());
    // SAFETY: the only object of this freshly executed process that owns a descriptor
    // above 2 is `report` (kept); the task's descriptors are raw numbers (kept too), and
    // the rest are whatever hiber's caller leaked to hiber, which nothing here uses.
    unsafe { sys::close_from_except(3, &keep) };
    Ok(())
}

/// Inside a restore's shim: the restored root is recorded in the job's directory before
/// hiber hears of it, so that a tree whose hiber is killed meanwhile is still found there
/// (`restore::interrupted`). A tree that cannot be recorded is killed: it would run with
/// nobody knowing of it.
fn recorded(job_dir: &Path, started: Started) -> Started {
    let Started::Running { pid } = started else { return started };
    match jobs::write_restored_root(job_dir, pid) {
        Ok(_) => started,
        Err(e) => {
            let _ = sys::kill(pid, libc::SIGKILL);
            let _ = sys::waitpid(pid);
            Started::Failed { message: format!("cannot record the restored tree in the job's directory: {e}"), hint: None, log: None }
        }
    }
}

/// Inside the shim of a job `hiber run` starts: the job is recorded (`job.json`) before
/// hiber hears of it, so that a job whose hiber is killed meanwhile is a job like any other.
/// A job that cannot be recorded is killed: it would run with nobody knowing of it.
fn recorded_run(job_dir: &Path, argv: Vec<String>, start_time: u64, started: Started) -> Started {
    let Started::Running { pid } = started else { return started };
    let job = jobs::Job {
        name: job_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        pid,
        start_time,
        command: argv,
        created: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        restored_from: None,
        checkpointed_to: None,
        last_image: None,
    };
    match jobs::write_record(job_dir, &job) {
        Ok(()) => {
            jobs::clear_start(job_dir);
            started
        }
        Err(e) => {
            let _ = sys::kill(pid, libc::SIGKILL);
            let _ = sys::waitpid(pid);
            Started::Failed { message: format!("cannot record the job in its directory: {e}"), hint: None, log: None }
        }
    }
}

/// Inside the shim: CRIU restores the image as the shim's child.
fn restore(task: RestoreTask) -> Started {
    // CRIU, and so the restored tree, inherit the shim's network namespace.
    if task.isolate_net {
        if let Err(e) = sys::unshare_network_namespace() {
            return Started::Failed { message: format!("cannot create a network namespace: {e}"), hint: None, log: None };
        }
    }
    let opts = RestoreOptions {
        images_dir: &task.images_dir,
        work_dir: &task.work_dir,
        inherit: task.inherit,
        external_mounts: task.external_mounts,
        leave_stopped: task.leave_stopped,
    };
    let mut on_notify = |script: &str| match (script, task.post_restore) {
        ("post-restore", Some(fd)) => hold_at_post_restore(fd),
        _ => Ok(()),
    };
    let restored = Criu::at(task.criu).restore(&opts, &mut on_notify);
    if let Some(fd) = task.post_restore {
        // SAFETY: the post-restore socket was inherited for this restore alone, and nothing
        // else of the shim owns it: closed here, the shim keeps only what its job needs.
        drop(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
    }
    match restored {
        Ok(pid) => Started::Running { pid },
        // Hints that need the image are made by the caller, from the message and the log.
        Err(e) => Started::Failed { message: e.to_string(), hint: None, log: e.log().map(|l| l.display().to_string()) },
    }
}

/// Inside the shim, at CRIU's post-restore: tells hiber on `fd` and waits for its word.
fn hold_at_post_restore(fd: RawFd) -> Result<(), String> {
    // SAFETY: `fd` is the task's post-restore socket, which the shim inherited and keeps
    // open for as long as it runs; the copy made here is closed when this returns.
    let mut sock = File::from(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }.try_clone_to_owned().map_err(|e| format!("post-restore socket: {e}"))?);
    sock.write_all(&[POST_RESTORE_REACHED]).map_err(|e| format!("cannot tell hiber that the processes are made: {e}"))?;
    let mut word = [0u8; 1];
    match sock.read(&mut word) {
        Ok(1) if word[0] == POST_RESTORE_GO => Ok(()),
        Ok(1) => Err("the restore's other participants did not all make their processes".into()),
        Ok(_) => Err("hiber went away while CRIU held the restored processes".into()),
        Err(e) => Err(format!("waiting for hiber at post-restore: {e}")),
    }
}

/// A command to start as a job: what [`ShimTask::Run`] carries.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Command {
    argv: Vec<String>,
    #[serde(with = "wire_path")]
    cwd: PathBuf,
    #[serde(with = "wire_path")]
    stdout: PathBuf,
    #[serde(with = "wire_path")]
    stderr: PathBuf,
    env: Vec<(String, String)>,
    /// Let the job create io_uring instances (see [`io_uring_filter`]).
    #[serde(default)]
    allow_io_uring: bool,
    /// PID namespace numbers the job must not get (see `named_in_a_cuda_socket`).
    #[serde(default)]
    avoid_namespaces: Vec<u64>,
    /// Give the job a `/dev/shm` of its own ([`sys::private_dev_shm`]).
    #[serde(default = "yes")]
    private_shm: bool,
    /// Give the job an IPC namespace of its own (see [`Command::host_ipc`]).
    #[serde(default = "yes")]
    private_ipc: bool,
    /// Give the job a `/dev/pts` of its own ([`sys::private_dev_pts`]).
    #[serde(default = "yes")]
    private_pts: bool,
    /// See [`Command::hold`].
    #[serde(default)]
    hold: Option<RawFd>,
}

fn yes() -> bool {
    true
}

/// The seccomp program that keeps a job off io_uring: `io_uring_setup`, `io_uring_enter`
/// and `io_uring_register` fail with ENOSYS, as on a kernel without io_uring, and every
/// other system call passes.
///
/// CRIU cannot dump an io_uring instance, and libuv (in Node.js, and in libtorch's TCPStore,
/// which torchrun's launcher runs) opens one for every event loop whatever `UV_USE_IO_URING`
/// says (libuv 1.50 and newer). Every user of io_uring falls back to other system calls when
/// the kernel lacks it (libuv to epoll; Docker's default seccomp profile refuses io_uring
/// too, with EPERM), so what the job computes does not change.
///
/// Six instructions, written out rather than built with a filter compiler: the calls have
/// the numbers 425 to 427 in every system call table Linux has (they came after the tables
/// were unified), so one program serves every architecture and ABI a job may use (32-bit
/// programs included, which a compiler's architecture check would kill), with the x32 bit
/// masked off.
pub fn io_uring_filter() -> Vec<libc::sock_filter> {
    const IO_URING_SETUP: u32 = 425;
    const IO_URING_REGISTER: u32 = 427;
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    let stmt = |code: u32, k: u32| libc::sock_filter { code: code as u16, jt: 0, jf: 0, k };
    let jump = |code: u32, k: u32, jt: u8, jf: u8| libc::sock_filter { code: code as u16, jt, jf, k };
    vec![
        // A = seccomp_data.nr, the x32 bit cleared.
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
        stmt(libc::BPF_ALU | libc::BPF_AND | libc::BPF_K, !X32_SYSCALL_BIT),
        // Below io_uring_setup: allow (skip 2); else go on.
        jump(libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K, IO_URING_SETUP, 0, 2),
        // Above io_uring_register: allow (skip 1); else refuse.
        jump(libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K, IO_URING_REGISTER, 1, 0),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
    ]
}

impl Command {
    /// A descriptor of hiber's that the job's shim keeps open for as long as it lives and
    /// hands to nobody: the lock of the job's start (see `Registry::create_dir`), which so
    /// stays held while hiber or the shim runs.
    pub fn hold(mut self, fd: RawFd) -> Command {
        self.hold = Some(fd);
        self
    }

    /// Lets the job use io_uring; it cannot be checkpointed while it holds an instance.
    pub fn allow_io_uring(mut self, allow: bool) -> Command {
        self.allow_io_uring = allow;
        self
    }

    /// Leaves the job the host's `/dev/shm` (`host`), or gives it one of its own, which its
    /// images carry: Python's spawned processes share named semaphores there, which CRIU
    /// can dump only from a tmpfs of the job's own.
    pub fn host_shm(mut self, host: bool) -> Command {
        self.private_shm = !host;
        self
    }

    /// Leaves the job the host's IPC namespace (`host`), or gives it one of its own, as
    /// containers have. CRIU dumps SysV shared memory, semaphores and message queues only
    /// with the IPC namespace that holds them, which must then be the job's: a job in the
    /// host's cannot be checkpointed while it holds any.
    pub fn host_ipc(mut self, host: bool) -> Command {
        self.private_ipc = !host;
        self
    }

    /// Leaves the job the host's `/dev/pts` (`host`), or gives it one of its own: the
    /// terminals it opens are then numbered there, and a restore, which gives each its old
    /// number, finds it free whatever the host opened since. With its own, the job cannot
    /// open the host's terminals by their path.
    pub fn host_pts(mut self, host: bool) -> Command {
        self.private_pts = !host;
        self
    }

    /// Keeps the job out of PID namespaces with these numbers: those the CUDA sockets of
    /// images here are named after, which their restores bind again.
    pub fn avoid_pid_namespaces(mut self, numbers: Vec<u64>) -> Command {
        self.avoid_namespaces = numbers;
        self
    }

    /// Sets `key=value` in the job's environment.
    pub fn env(mut self, key: &str, value: &str) -> Result<Command, LaunchError> {
        if key.contains('\0') || value.contains('\0') {
            return Err(LaunchError::Start(format!("environment variable {key} contains a NUL byte")));
        }
        self.env.push((key.to_string(), value.to_string()));
        Ok(self)
    }

    /// `stdout` and `stderr` are files the job appends to (they should exist).
    pub fn new(argv: &[String], cwd: &Path, stdout: &Path, stderr: &Path) -> Result<Command, LaunchError> {
        let cmd = Command {
            argv: argv.to_vec(),
            cwd: cwd.to_path_buf(),
            stdout: stdout.to_path_buf(),
            stderr: stderr.to_path_buf(),
            env: Vec::new(),
            allow_io_uring: false,
            avoid_namespaces: Vec::new(),
            private_shm: true,
            private_ipc: true,
            private_pts: true,
            hold: None,
        };
        cmd.prepare().map_err(LaunchError::Start)?;
        Ok(cmd)
    }

    /// The C strings `exec_job` needs.
    fn prepare(&self) -> Result<Exec, String> {
        let bad = |what: &str| format!("{what} contains a NUL byte");
        if self.argv.is_empty() {
            return Err("no command given".into());
        }
        let c = |s: &str, what: &str| CString::new(s).map_err(|_| bad(what));
        let path = |p: &Path, what: &str| CString::new(p.as_os_str().as_encoded_bytes()).map_err(|_| bad(what));
        Ok(Exec {
            argv: self.argv.iter().map(|a| c(a, "the command")).collect::<Result<_, _>>()?,
            cwd: path(&self.cwd, "the working directory")?,
            stdout: path(&self.stdout, "the log path")?,
            stderr: path(&self.stderr, "the log path")?,
            env: self.env.iter().map(|(k, v)| Ok((c(k, "an environment variable")?, c(v, "an environment variable")?))).collect::<Result<_, String>>()?,
            seccomp: if self.allow_io_uring { None } else { Some(io_uring_filter()) },
        })
    }
}

/// A [`Command`] as exec needs it, prepared before forking.
struct Exec {
    argv: Vec<CString>,
    cwd: CString,
    stdout: CString,
    stderr: CString,
    env: Vec<(CString, CString)>,
    /// Installed last before exec.
    seccomp: Option<Vec<libc::sock_filter>>,
}

/// Runs inside the shim: makes a PID namespace and starts `cmd` as its init. Returns once
/// the command has been exec'd (or failed to be), with the init's start time (read before
/// the job mounts its own /proc over the shim's, where the init's PID means nothing).
///
/// # Safety
///
/// The calling process must be single-threaded: it forks, and the child runs ordinary
/// Rust until it execs.
unsafe fn start_in_namespace(cmd: &Command, start_time: &mut u64) -> Started {
    let failed = |message: String| Started::Failed { message, hint: None, log: None };
    let exec = match cmd.prepare() {
        Ok(e) => e,
        Err(message) => return failed(message),
    };
    if let Err(e) = sys::unshare_job_namespaces(cmd.private_ipc) {
        return Started::Failed {
            message: format!("cannot create the job's namespaces (PID, mount{}): {e}", if cmd.private_ipc { ", IPC" } else { "" }),
            hint: Some("hiber run needs root (or CAP_SYS_ADMIN)".into()),
            log: None,
        };
    }
    // Other checkpoints' staging areas, mounted on the host right now, are not the job's.
    crate::checkpoint::stage::detach_all_here();
    if cmd.private_shm {
        if let Err(e) = sys::private_dev_shm() {
            return Started::Failed {
                message: format!("cannot give the job a /dev/shm of its own: {e}"),
                hint: Some("`hiber run --host-shm` leaves it the host's (its images then cannot hold named semaphores)".into()),
                log: None,
            };
        }
    }
    if cmd.private_pts {
        if let Err(e) = sys::private_dev_pts() {
            return Started::Failed {
                message: format!("cannot give the job a /dev/pts of its own: {e}"),
                hint: Some("`hiber run --host-pts` leaves it the host's (its terminals then restore only where their numbers are free)".into()),
                log: None,
            };
        }
    }
    // Namespaces refused for their number (see `named_in_a_cuda_socket`), kept until the
    // job's init exists, so that it cannot be given their numbers again.
    let mut refused: Vec<File> = Vec::new();
    loop {
        let (err_rd, err_wr) = match sys::pipe() {
            Ok(p) => p,
            Err(e) => return failed(format!("pipe: {e}")),
        };
        let (go_rd, go_wr) = match sys::pipe() {
            Ok(p) => p,
            Err(e) => return failed(format!("pipe: {e}")),
        };
        // SAFETY: the caller is single-threaded (this function's contract).
        match unsafe { sys::fork() } {
            Err(e) => return failed(format!("fork: {e}")),
            Ok(Fork::Child) => {
                drop(err_rd);
                drop(go_wr);
                // The shim first looks at the namespace this init made: go on or leave.
                let mut go = [0u8; 1];
                if File::from(go_rd).read_exact(&mut go).is_err() || go[0] != b'g' {
                    sys::exit_now(0)
                }
                // SAFETY: this child of a single-threaded process has one thread, and
                // execs or exits right after.
                let e = unsafe { exec_job(&exec, err_wr.as_raw_fd()) };
                let code = e.raw_os_error().unwrap_or(libc::EINVAL);
                let _ = File::from(err_wr).write_all(&code.to_ne_bytes());
                sys::exit_now(127)
            }
            Ok(Fork::Parent(pid)) => {
                drop(err_wr);
                drop(go_rd);
                let mut go_wr = File::from(go_wr);
                // Bounded: the numbers to avoid, and as many again for live sockets.
                if refused.len() < cmd.avoid_namespaces.len() + 16 && named_in_a_cuda_socket(pid, &cmd.avoid_namespaces) {
                    match File::open(format!("/proc/{pid}/ns/pid")) {
                        Ok(ns) => refused.push(ns),
                        Err(e) => return failed(format!("cannot hold PID namespace of {pid}: {e}")),
                    }
                    let _ = go_wr.write_all(b"n");
                    let _ = sys::waitpid(pid);
                    if let Err(e) = sys::renew_pid_namespace_for_children() {
                        return failed(format!("cannot create a PID namespace: {e}"));
                    }
                    continue;
                }
                *start_time = crate::proctree::stat(pid).map(|s| s.start_time).unwrap_or(0);
                if let Err(e) = go_wr.write_all(b"g") {
                    let _ = sys::waitpid(pid);
                    return failed(format!("cannot start the job's init: {e}"));
                }
                drop(go_wr);
                let mut buf = [0u8; 4];
                // EOF (the pipe closed on exec) means the command is running.
                return match File::from(err_rd).read_exact(&mut buf) {
                    Err(_) => Started::Running { pid },
                    Ok(()) => {
                        let _ = sys::waitpid(pid);
                        let err = std::io::Error::from_raw_os_error(i32::from_ne_bytes(buf));
                        let prog = exec.argv[0].to_string_lossy();
                        Started::Failed {
                            message: format!("cannot run '{prog}': {err}"),
                            hint: Some("check the command name and that it is executable".into()),
                            log: None,
                        }
                    }
                };
            }
        }
    }
}

/// Whether the PID namespace of `init` (just forked into it) has a number that a CUDA
/// socket here is named after, or one of `avoid` (those of images here).
///
/// The driver binds an abstract unix socket named `cuda-uvmfd-NS-PID` in every CUDA
/// process, NS being the inode number of its PID namespace. A restored job keeps the names
/// of the namespace it was checkpointed in, and the kernel hands that number out again once
/// the namespace is gone: a new job given it fails at its first CUDA call
/// (CUDA_ERROR_OPERATING_SYSTEM), as two jobs of the GPU suite did beside restored ones; and
/// the restore of an image whose names a running job holds fails in CRIU.
fn named_in_a_cuda_socket(init: i32, avoid: &[u64]) -> bool {
    let Ok(ns) = sys::pid_namespace_of(init) else { return false };
    if avoid.contains(&ns) {
        return true;
    }
    let names = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    names.lines().any(|l| l.split_whitespace().nth(7).and_then(crate::proctree::cuda_socket_namespace) == Some(ns))
}

/// In the namespace's init: own session, a /proc of its own, stdio opened inside the
/// mount namespace, working directory, then exec.
///
/// # Safety
///
/// The process must be single-threaded, and must exec or exit when this returns: it
/// changes the environment and closes every descriptor above 2 but `keep`.
unsafe fn exec_job(cmd: &Exec, keep: RawFd) -> std::io::Error {
    if let Err(e) = sys::setsid() {
        return e;
    }
    if let Err(e) = sys::mount_private_proc() {
        return e;
    }
    let open = |path: &CStr, write: bool| sys::open_for_stdio(path, write);
    let fds = match (open(c"/dev/null", false), open(&cmd.stdout, true), open(&cmd.stderr, true)) {
        (Ok(a), Ok(b), Ok(c)) => [a, b, c],
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return e,
    };
    for (to, from) in fds.iter().enumerate() {
        if let Err(e) = sys::replace_stdio(from.as_fd(), to as RawFd) {
            return e;
        }
    }
    drop(fds);
    if let Err(e) = sys::chdir(&cmd.cwd) {
        return e;
    }
    // hiber ignores SIGPIPE (Rust's runtime does), and an ignored signal stays ignored
    // across exec: the job gets the default back, so `yes | head` ends as anywhere else.
    if let Err(e) = sys::default_sigpipe() {
        return e;
    }
    // Nothing the caller of hiber leaked (a terminal's pipes, say) reaches the job; the
    // exec-error pipe is close-on-exec and survives until the exec itself.
    // SAFETY: the process execs or exits next (this function's contract), and no object
    // that it uses until then owns a descriptor above 2 but `keep`.
    unsafe { sys::close_from_except(3, &[keep]) };
    for (k, v) in &cmd.env {
        // SAFETY: the process is single-threaded (this function's contract): nothing reads
        // the environment meanwhile.
        if let Err(e) = unsafe { sys::setenv(k, v) } {
            return e;
        }
    }
    if let Some(program) = &cmd.seccomp {
        if let Err(e) = sys::install_seccomp_filter(program) {
            return e;
        }
    }
    sys::execvp(&cmd.argv)
}

/// Paths on the wire: a JSON string when they are UTF-8 (nearly always), else their bytes.
mod wire_path {
    use std::ffi::OsString;
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    use std::path::{Path, PathBuf};

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(path: &Path, s: S) -> Result<S::Ok, S::Error> {
        match path.to_str() {
            Some(text) => s.serialize_str(text),
            None => s.serialize_bytes(path.as_os_str().as_bytes()),
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Wire {
        Text(String),
        Bytes(Vec<u8>),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<PathBuf, D::Error> {
        Ok(match Wire::deserialize(d)? {
            Wire::Text(text) => PathBuf::from(text),
            Wire::Bytes(bytes) => PathBuf::from(OsString::from_vec(bytes)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_any_path() {
        let odd = PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(b"/tmp/\xff\xfe".to_vec()));
        let cmd = Command::new(&["sleep".into(), "1".into()], &odd, Path::new("/j/stdout.log"), Path::new("/j/stderr.log")).unwrap().env("A", "b c").unwrap();
        let text = serde_json::to_string(&Request { job_dir: "/j".into(), task: ShimTask::Run(cmd), hiber: None }).unwrap();
        assert!(text.contains(r#""job_dir":"/j""#) && text.contains(r#""argv":["sleep","1"]"#), "{text}");
        let back: Request = serde_json::from_str(&text).unwrap();
        let ShimTask::Run(cmd) = back.task else { panic!("a run task") };
        assert_eq!(cmd.cwd, odd);
        assert_eq!(cmd.env, vec![("A".to_string(), "b c".to_string())]);

        let task = ShimTask::Restore(RestoreTask {
            criu: "/usr/local/sbin/criu".into(),
            images_dir: "/i/criu".into(),
            work_dir: "/w".into(),
            inherit: vec![("tmp/out".into(), 7)],
            external_mounts: true,
            isolate_net: false,
            leave_stopped: false,
            hold: Some(9),
            post_restore: Some(10),
        });
        let back: ShimTask = serde_json::from_str(&serde_json::to_string(&task).unwrap()).unwrap();
        assert_eq!(back.fds(), vec![7, 9, 10], "the restore's lock and its post-restore socket are inherited too");
    }

    #[test]
    fn commands_with_nul_bytes_are_refused() {
        let log = Path::new("/j/log");
        assert!(Command::new(&["a\0b".into()], Path::new("/"), log, log).is_err());
        assert!(Command::new(&[], Path::new("/"), log, log).is_err());
        assert!(Command::new(&["a".into()], Path::new("/"), log, log).unwrap().env("K", "v\0").is_err());
    }

    #[test]
    fn standard_descriptors_cannot_be_passed() {
        let task = ShimTask::Restore(RestoreTask {
            criu: "/nonexistent".into(),
            images_dir: "/nonexistent".into(),
            work_dir: "/nonexistent".into(),
            inherit: vec![("k".into(), 1)],
            external_mounts: false,
            isolate_net: false,
            leave_stopped: false,
            hold: None,
            post_restore: None,
        });
        assert!(matches!(spawn_shim(Path::new("/nonexistent"), &task), Err(LaunchError::Start(_))));
    }
}
