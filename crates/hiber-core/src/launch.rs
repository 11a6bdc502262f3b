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
//! The root's parent is a small shim (a forked hiber, detached from the caller's session)
//! that records the root's exit status in the job directory. `hiber restore` uses the same
//! shim, which then becomes the parent of the restored tree.

use std::ffi::CString;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::jobs;
use crate::sys::{self, Fork};

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

/// Forks a detached shim that runs `start` (which must leave the tree's root as the
/// shim's child and return its PID), reports the outcome to the caller, then waits for
/// the root and records its exit status in `job_dir`.
///
/// The shim keeps only standard descriptors (on /dev/null), its report pipe and `keep`
/// (what `start` needs): none that hiber's caller leaked, so the caller sees EOF on its
/// pipes when hiber exits. The caller should be single-threaded; idle worker threads
/// (blake3's pool after verifying an image) hold no lock the child takes.
pub fn spawn_shim(job_dir: &Path, keep: &[RawFd], start: impl FnOnce() -> Started) -> Result<Started, LaunchError> {
    let io = |step| move |source| LaunchError::Io { step, source };
    let devnull = File::options().read(true).write(true).open("/dev/null").map_err(io("open /dev/null"))?;
    let (rd, wr) = sys::pipe().map_err(io("pipe"))?;
    match sys::fork().map_err(io("fork"))? {
        Fork::Child => {
            drop(rd);
            let code = run_shim(job_dir, &devnull, wr, keep, start);
            sys::exit_now(code)
        }
        Fork::Parent(middle) => {
            drop(wr);
            // The middle process exits as soon as the shim is forked, so the shim is
            // adopted by init (or a subreaper) and outlives this hiber.
            let _ = sys::waitpid(middle);
            let mut line = String::new();
            BufReader::new(File::from(rd)).read_line(&mut line).map_err(io("read shim report"))?;
            serde_json::from_str(&line).map_err(|_| LaunchError::ShimVanished)
        }
    }
}

fn run_shim(job_dir: &Path, devnull: &File, wr: OwnedFd, keep: &[RawFd], start: impl FnOnce() -> Started) -> i32 {
    if sys::setsid().is_err() {
        return 1;
    }
    for fd in 0..3 {
        let _ = sys::dup2(devnull.as_raw_fd(), fd);
    }
    let mut kept = keep.to_vec();
    kept.push(wr.as_raw_fd());
    sys::close_from_except(3, &kept);
    match sys::fork() {
        Ok(Fork::Parent(_)) => return 0,
        Ok(Fork::Child) => {}
        Err(_) => return 1,
    }
    let report = start();
    let mut wr = File::from(wr);
    let _ = writeln!(wr, "{}", serde_json::to_string(&report).expect("report serializes"));
    drop(wr);
    if let Started::Running { pid } = report {
        // Record the exit before reaping: while the root is a zombie the job still counts
        // as running, so nobody sees it gone with no exit status.
        if let Ok(status) = sys::wait_exited_keep_zombie(pid) {
            let _ = jobs::write_exit(job_dir, status);
        }
        let _ = sys::waitpid(pid);
    }
    0
}

/// What `start_in_namespace` needs, prepared before forking.
pub struct Command {
    argv: Vec<CString>,
    cwd: CString,
    stdout: CString,
    stderr: CString,
    env: Vec<(CString, CString)>,
}

impl Command {
    /// Sets `key=value` in the job's environment.
    pub fn env(mut self, key: &str, value: &str) -> Result<Command, LaunchError> {
        let c = |s: &str| CString::new(s).map_err(|_| LaunchError::Start(format!("environment variable {key} contains a NUL byte")));
        self.env.push((c(key)?, c(value)?));
        Ok(self)
    }

    /// `stdout` and `stderr` are files the job appends to (they should exist).
    pub fn new(argv: &[String], cwd: &Path, stdout: &Path, stderr: &Path) -> Result<Command, LaunchError> {
        let bad = |what: &str| LaunchError::Start(format!("{what} contains a NUL byte"));
        if argv.is_empty() {
            return Err(LaunchError::Start("no command given".into()));
        }
        let argv = argv.iter().map(|a| CString::new(a.as_bytes()).map_err(|_| bad("the command"))).collect::<Result<_, _>>()?;
        let path = |p: &Path, what: &str| CString::new(p.as_os_str().as_encoded_bytes()).map_err(|_| bad(what));
        Ok(Command {
            argv,
            cwd: path(cwd, "the working directory")?,
            stdout: path(stdout, "the log path")?,
            stderr: path(stderr, "the log path")?,
            env: Vec::new(),
        })
    }
}

/// Runs inside the shim: makes a PID namespace and starts `cmd` as its init. Returns once
/// the command has been exec'd (or failed to be).
pub fn start_in_namespace(cmd: Command) -> Started {
    let failed = |message: String| Started::Failed { message, hint: None, log: None };
    if let Err(e) = sys::unshare_pid_and_mount_namespaces() {
        return Started::Failed {
            message: format!("cannot create PID and mount namespaces: {e}"),
            hint: Some("hiber run needs root (or CAP_SYS_ADMIN)".into()),
            log: None,
        };
    }
    let (err_rd, err_wr) = match sys::pipe() {
        Ok(p) => p,
        Err(e) => return failed(format!("pipe: {e}")),
    };
    match sys::fork() {
        Err(e) => failed(format!("fork: {e}")),
        Ok(Fork::Child) => {
            drop(err_rd);
            let e = exec_job(&cmd, err_wr.as_raw_fd());
            let code = e.raw_os_error().unwrap_or(libc::EINVAL);
            let _ = File::from(err_wr).write_all(&code.to_ne_bytes());
            sys::exit_now(127)
        }
        Ok(Fork::Parent(pid)) => {
            drop(err_wr);
            let mut buf = [0u8; 4];
            // EOF (the pipe closed on exec) means the command is running.
            match File::from(err_rd).read_exact(&mut buf) {
                Err(_) => Started::Running { pid },
                Ok(()) => {
                    let _ = sys::waitpid(pid);
                    let err = std::io::Error::from_raw_os_error(i32::from_ne_bytes(buf));
                    let prog = cmd.argv[0].to_string_lossy();
                    Started::Failed {
                        message: format!("cannot run '{prog}': {err}"),
                        hint: Some("check the command name and that it is executable".into()),
                        log: None,
                    }
                }
            }
        }
    }
}

/// In the namespace's init: own session, a /proc of its own, stdio opened inside the
/// mount namespace, working directory, then exec.
fn exec_job(cmd: &Command, keep: RawFd) -> std::io::Error {
    if let Err(e) = sys::setsid() {
        return e;
    }
    if let Err(e) = sys::mount_private_proc() {
        return e;
    }
    let open = |path: &std::ffi::CStr, write: bool| sys::open_for_stdio(path, write);
    let fds = match (open(c"/dev/null", false), open(&cmd.stdout, true), open(&cmd.stderr, true)) {
        (Ok(a), Ok(b), Ok(c)) => [a, b, c],
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return e,
    };
    for (to, from) in fds.iter().enumerate() {
        if let Err(e) = sys::dup2(*from, to as RawFd) {
            return e;
        }
    }
    if let Err(e) = sys::chdir(&cmd.cwd) {
        return e;
    }
    // Nothing the caller of hiber leaked (a terminal's pipes, say) reaches the job; the
    // exec-error pipe is close-on-exec and survives until the exec itself.
    sys::close_from_except(3, &[keep]);
    for (k, v) in &cmd.env {
        if let Err(e) = sys::setenv(k, v) {
            return e;
        }
    }
    sys::execvp(&cmd.argv)
}
