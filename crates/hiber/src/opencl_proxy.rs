//! `hiber __opencl-proxy`: a job's OpenCL proxy (proxy mode, `hiber run --opencl=proxy`).
//!
//! `--listen SOCK --job-dir DIR` is the job's listener, started by `hiber run` (or by the
//! restore that made the job) in a process group of its own and outside the job's process
//! tree, so CRIU never dumps it. Each process of the job whose layer connects gets a proxy
//! process of its own (`--serve`, the connection on its stdin), which loads the ICD loader
//! and the vendors with that process's environment (hiber's preload and control variables
//! left out) and runs its calls, until the process disconnects (a checkpoint released every
//! real object) or dies. The listener ends once the job has.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hiber_opencl::remote::server::Dispatcher;

#[derive(clap::Args)]
pub struct Args {
    /// Listen on this socket: each connecting process gets a proxy process of its own.
    #[arg(long, requires = "job_dir")]
    listen: Option<PathBuf>,
    /// The job the listener serves: it ends once the job has.
    #[arg(long)]
    job_dir: Option<PathBuf>,
    /// Serve the one process connected on stdin.
    #[arg(long, conflicts_with = "listen")]
    serve: bool,
}

/// How long a listener waits for its job to be recorded (a restore records it last).
const UNRECORDED_LIMIT: Duration = Duration::from_secs(600);

pub fn main(args: Args) -> i32 {
    let r = match (&args.listen, &args.job_dir, args.serve) {
        (Some(sock), Some(dir), false) => listen(sock, dir),
        (None, _, true) => serve(),
        _ => Err(std::io::Error::other("give --listen SOCK --job-dir DIR, or --serve")),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("hiber opencl-proxy: {e}");
            1
        }
    }
}

fn listen(sock: &Path, job_dir: &Path) -> std::io::Result<()> {
    let listener = UnixListener::bind(sock)?;
    std::fs::set_permissions(sock, std::fs::Permissions::from_mode(0o600))?;
    listener.set_nonblocking(true)?;
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    // Each proxy process, and the PID of the process it serves.
    let mut workers: Vec<(Child, i32)> = Vec::new();
    eprintln!("hiber opencl-proxy: listening on {} for {}", sock.display(), job_dir.display());
    loop {
        match listener.accept() {
            Ok((stream, _)) => match spawn_worker(&exe, stream) {
                Ok(w) => workers.push(w),
                Err(e) => eprintln!("hiber opencl-proxy: cannot start a proxy process: {e}"),
            },
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e),
        }
        workers.retain_mut(|(c, client)| match c.try_wait() {
            Ok(None) => true,
            Ok(Some(status)) => {
                if !status.success() {
                    // Its process's OpenCL calls fail from now on: `hiber ls` says so.
                    let why = format!("the OpenCL proxy of process {client} ended ({status})");
                    eprintln!("hiber opencl-proxy: {why}");
                    let _ = std::fs::write(hiber_core::engine::opencl::proxy_broken_file(job_dir), why + "\n");
                }
                false
            }
            Err(_) => false,
        });
        if job_ended(job_dir, started) {
            let _ = std::fs::remove_file(sock);
            eprintln!("hiber opencl-proxy: the job ended");
            return Ok(());
        }
    }
}

/// Starts a proxy process for the process connected on `stream`, with its environment.
fn spawn_worker(exe: &Path, stream: UnixStream) -> std::io::Result<(Child, i32)> {
    let peer = peer_pid(&stream)?;
    let env = client_env(peer)?;
    let fd: OwnedFd = stream.into();
    let child =
        Command::new(exe).arg("__opencl-proxy").arg("--serve").env_clear().envs(env).stdin(Stdio::from(fd)).stdout(Stdio::null()).process_group(0).spawn()?;
    Ok((child, peer))
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

/// Whether the job the listener serves is gone: its directory removed, its recorded root
/// dead, or never recorded in time.
fn job_ended(job_dir: &Path, started: Instant) -> bool {
    if !job_dir.is_dir() {
        return true;
    }
    let Ok(text) = std::fs::read(job_dir.join("job.json")) else {
        return started.elapsed() > UNRECORDED_LIMIT;
    };
    let Ok(job) = serde_json::from_slice::<serde_json::Value>(&text) else { return false };
    let (Some(pid), Some(start)) = (job["pid"].as_i64(), job["start_time"].as_u64()) else { return false };
    !hiber_core::proctree::stat(pid as i32).is_ok_and(|s| s.start_time == start)
}

/// One process's proxy: its calls until it disconnects or dies.
fn serve() -> std::io::Result<()> {
    let fd = std::io::stdin().as_fd().try_clone_to_owned()?;
    let stream = UnixStream::from(fd);
    let dispatcher = Arc::new(Dispatcher::new());
    hiber_layer::channel::serve(stream, Arc::new(Handler(dispatcher)))
}

struct Handler(Arc<Dispatcher>);

impl hiber_layer::channel::Handler for Handler {
    fn handle(&self, req: &[u8], answer: &mut Vec<u8>, notifier: &hiber_layer::channel::Notifier) {
        let n = notifier.clone();
        self.0.handle(
            req,
            answer,
            Arc::new(move |msg: &[u8]| {
                let _ = n.notify(msg);
            }),
        );
    }
}
