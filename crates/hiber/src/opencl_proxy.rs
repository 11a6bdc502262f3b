//! `hiber __opencl-proxy`: the OpenCL proxy of a state directory's jobs in proxy mode
//! (`hiber run --opencl=proxy`).
//!
//! `--listen SOCK --jobs DIR` is the listener, one per state directory (`STATE/opencl-proxy.sock`,
//! a path that stays right for a restored job's processes whatever the job's new name),
//! started by the first `hiber run` or restore that needs it, in a process group of its own
//! and outside every job's process tree, so CRIU never dumps it. Each process that connects
//! gets a proxy process of its own (`--serve`, the connection on its stdin), which loads the
//! ICD loader and the vendors with that process's environment and working directory (hiber's
//! preload and variables left out) and runs its calls, until the process disconnects (a
//! checkpoint released every real object) or dies. The listener ends once no job in proxy
//! mode is left and no proxy process runs.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use hiber_core::jobs::{JobError, JobState, Registry};
use hiber_core::state::StateDir;
use hiber_opencl::remote::server::Dispatcher;

#[derive(clap::Args)]
pub struct Args {
    /// Listen on this socket: each connecting process gets a proxy process of its own.
    #[arg(long, requires = "jobs")]
    listen: Option<PathBuf>,
    /// The state directory's jobs: the listener ends once none in proxy mode is left.
    #[arg(long)]
    jobs: Option<PathBuf>,
    /// Serve the one process connected on stdin.
    #[arg(long, conflicts_with = "listen")]
    serve: bool,
}

/// How long a job marked for the proxy counts as starting (or being restored) before its
/// record is there.
const UNRECORDED_LIMIT: Duration = Duration::from_secs(600);

pub fn main(args: Args) -> i32 {
    let r = match (&args.listen, &args.jobs, args.serve) {
        (Some(sock), Some(jobs), false) => listen(sock, jobs),
        (None, _, true) => serve(),
        _ => Err(std::io::Error::other("give --listen SOCK --jobs DIR, or --serve")),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("hiber opencl-proxy: {e}");
            1
        }
    }
}

/// A proxy process, the PID of the process it serves, and that process's job directory.
struct Worker {
    child: Child,
    client: i32,
    job_dir: Option<PathBuf>,
}

fn listen(sock: &Path, jobs: &Path) -> std::io::Result<()> {
    let listener = UnixListener::bind(sock)?;
    std::fs::set_permissions(sock, std::fs::Permissions::from_mode(0o600))?;
    listener.set_nonblocking(true)?;
    let exe = std::env::current_exe()?;
    let mut workers: Vec<Worker> = Vec::new();
    let mut checked = std::time::Instant::now();
    eprintln!("hiber opencl-proxy: listening on {} (pid {})", sock.display(), std::process::id());
    loop {
        match listener.accept() {
            Ok((stream, _)) => match spawn_worker(&exe, stream) {
                Ok(w) => workers.push(w),
                Err(e) => eprintln!("hiber opencl-proxy: cannot start a proxy process: {e}"),
            },
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e),
        }
        workers.retain_mut(|w| match w.child.try_wait() {
            Ok(None) => true,
            Ok(Some(status)) => {
                if !status.success() {
                    // Its process's OpenCL calls fail from now on: `hiber ls` says so.
                    let why = format!("the OpenCL proxy of process {} ended ({status})", w.client);
                    eprintln!("hiber opencl-proxy: {why}");
                    if let Some(dir) = &w.job_dir {
                        let _ = std::fs::write(hiber_core::engine::opencl::proxy_broken_file(dir), why + "\n");
                    }
                }
                false
            }
            Err(_) => false,
        });
        if workers.is_empty() && checked.elapsed() > Duration::from_secs(1) {
            checked = std::time::Instant::now();
            if !any_proxy_job(jobs) && end_if_unneeded(sock, jobs)? {
                eprintln!("hiber opencl-proxy: no job in proxy mode is left");
                return Ok(());
            }
        }
    }
}

/// Under the starters' lock: ends (removes the socket) if still no job needs the listener.
fn end_if_unneeded(sock: &Path, jobs: &Path) -> std::io::Result<bool> {
    let root = jobs.parent().unwrap_or(jobs);
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(root.join("opencl-proxy.lock"))?;
    hiber_core::sys::flock(&lock, true)?;
    if any_proxy_job(jobs) {
        return Ok(false);
    }
    let _ = std::fs::remove_file(sock);
    Ok(true)
}

/// Whether a job in proxy mode lives (or is starting, or being restored).
fn any_proxy_job(jobs: &Path) -> bool {
    let registry = Registry::new(&StateDir::at(jobs.parent().unwrap_or(jobs)));
    let Ok(dir) = std::fs::read_dir(jobs) else { return false };
    dir.flatten().any(|e| {
        let Ok(marked) = std::fs::metadata(hiber_core::engine::opencl::proxy_marker(&e.path())).and_then(|m| m.modified()) else { return false };
        match registry.load(&e.file_name().to_string_lossy()) {
            Ok(job) => matches!(registry.state(&job), JobState::Running | JobState::Restoring { .. } | JobState::InterruptedRestore),
            // Starting (not recorded yet): counts for a while.
            Err(JobError::NotFound(_)) => marked.elapsed().is_ok_and(|age| age < UNRECORDED_LIMIT),
            Err(_) => true,
        }
    })
}

/// Starts a proxy process for the process connected on `stream`, with its environment and
/// working directory.
fn spawn_worker(exe: &Path, stream: UnixStream) -> std::io::Result<Worker> {
    let peer = peer_pid(&stream)?;
    let env = client_env(peer)?;
    let cwd = std::fs::read_link(format!("/proc/{peer}/cwd")).unwrap_or_else(|_| PathBuf::from("/"));
    // The layer logs into its job's directory: the job a broken proxy is reported for.
    let job_dir = std::fs::read(format!("/proc/{peer}/environ"))
        .ok()
        .and_then(|raw| {
            raw.split(|b| *b == 0).find_map(|kv| kv.strip_prefix(b"HIBER_OPENCL_LOG=").map(|v| PathBuf::from(String::from_utf8_lossy(v).into_owned())))
        })
        .and_then(|log| log.parent().map(Path::to_path_buf));
    let fd: OwnedFd = stream.into();
    // The proxy's own settings come from the listener's environment, not the application's.
    let own = [hiber_opencl::remote::server::PINNED_ENV, hiber_layer::channel::STATS_ENV].into_iter().filter_map(|k| std::env::var_os(k).map(|v| (k, v)));
    let child = Command::new(exe)
        .arg("__opencl-proxy")
        .arg("--serve")
        .env_clear()
        .envs(env)
        .envs(own)
        .current_dir(if cwd.is_dir() { cwd } else { PathBuf::from("/") })
        .stdin(Stdio::from(fd))
        .stdout(Stdio::null())
        .process_group(0)
        .spawn()?;
    Ok(Worker { child, client: peer, job_dir })
}

fn peer_pid(stream: &UnixStream) -> std::io::Result<i32> {
    let cred = hiber_wire::socket::peer_cred(stream.as_fd())?;
    Ok(cred.pid)
}

/// The connecting process's environment, but hiber's preload and its own variables: the
/// vendors read theirs (`POCL_DEVICES`, `CUDA_VISIBLE_DEVICES`, ...) as in the application.
fn client_env(pid: i32) -> std::io::Result<HashMap<String, String>> {
    let raw = std::fs::read(format!("/proc/{pid}/environ"))?;
    Ok(raw
        .split(|b| *b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok()?.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .filter(|(k, _)| k != "LD_PRELOAD" && !k.starts_with("HIBER_"))
        .collect())
}

/// One process's proxy: its calls until it disconnects or dies.
fn serve() -> std::io::Result<()> {
    let fd = std::io::stdin().as_fd().try_clone_to_owned()?;
    let stream = UnixStream::from(fd);
    // The process it serves, whose memory its bulk transfers read and write directly.
    let dispatcher = Dispatcher::new().with_peer(peer_pid(&stream)?);
    let handler = Handler { dispatcher, notify: std::sync::OnceLock::new() };
    hiber_layer::channel::serve(stream, Arc::new(handler))
}

struct Handler {
    dispatcher: Dispatcher,
    /// The connection's notifier as the dispatcher takes it, made once (not per call).
    notify: std::sync::OnceLock<hiber_opencl::remote::server::Notifier>,
}

impl hiber_layer::channel::Handler for Handler {
    fn handle(&self, req: &[u8], answer: &mut Vec<u8>, notifier: &hiber_layer::channel::Notifier) {
        let notify = self.notify.get_or_init(|| {
            let n = notifier.clone();
            Arc::new(move |msg: &[u8]| {
                let _ = n.notify(msg);
            })
        });
        self.dispatcher.handle(req, answer, notify.clone());
    }
}
