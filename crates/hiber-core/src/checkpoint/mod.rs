//! The checkpoint pipeline, as a session of phases ([`session::Checkpoint`]):
//! prepare → quiesce → capture → dump → commit → resume (or abort, the undo).
//!
//! - **prepare** finds the tree, refuses what cannot be checkpointed (a terminal from
//!   outside the tree, a full disk, and what CRIU would refuse in the middle of the dump:
//!   see [`preflight`]), opens the image sink and the journal, and opens each engine's
//!   session: nothing of the application is touched yet;
//! - **quiesce** stops device work; **capture** moves device state where the dump takes
//!   it; **dump** has CRIU dump (and, when the checkpoint stops the application, freeze)
//!   the tree;
//! - **commit** finishes the image: when the application is being stopped, inside CRIU's
//!   post-dump notification, while the tree is still frozen, so that a failure resumes the
//!   tree instead of stopping it; with `--leave-running`, after the application resumed;
//! - **resume** brings devices back to running (the normal end of `--leave-running`), and
//!   **abort** is the same undo after a failure.
//!
//! The journal is advanced at every phase, and a [`Coordinator`] may hold the session at a
//! barrier after each (jobs of several hibers: `hiber coordinate`). Every step that changes the
//! application is undone on failure, so a failed checkpoint leaves the application running
//! as it was and no partial image behind.

pub(crate) mod preflight;
mod session;
pub mod stage;
mod terminal;

pub use preflight::Undumpable;
pub use session::Checkpoint;

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::coordinator::{self, BarrierError, Coordinator, Phase, Tracked};
use crate::criu::CriuError;
use crate::engine::EngineError;
use crate::image::ImageError;
use crate::jobs::{Job, Registry};
use crate::lock::{self, LockError, OpLock};
use crate::proctree::{self, ProcessInfo, TreeError};
use crate::{sys, Context};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Tree(#[from] TreeError),
    #[error("process {pid} is a kernel thread; only user processes can be checkpointed")]
    KernelThread { pid: i32 },
    #[error("process {pid} is hiber itself or one of its ancestors")]
    OwnLineage { pid: i32 },
    #[error("hiber may not trace process {pid}: {reason}")]
    NotPermitted { pid: i32, reason: String },
    /// A controlling terminal that is not a pty whose both ends the tree holds.
    #[error("process {pid} ({comm}) has a controlling terminal from outside the tree ({tty})")]
    Terminal { pid: i32, comm: String, tty: String },
    #[error("process {pid} ({comm}) holds {what}")]
    Undumpable { pid: i32, comm: String, what: Undumpable },
    #[error("process {pid}: CRIU needs `{tool}` {why}, which is not installed")]
    MissingTool { pid: i32, tool: &'static str, why: &'static str },
    #[error("not enough space for the image in {dir}: about {needed} MiB needed, {available} MiB available", needed = .needed >> 20, available = .available >> 20)]
    NoSpace { dir: PathBuf, needed: u64, available: u64 },
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("the parent image cannot be used: {source}")]
    Parent { path: PathBuf, source: ImageError },
    #[error("{0}")]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Criu(#[from] CriuError),
    #[error(transparent)]
    Barrier(#[from] BarrierError),
    /// Another hiber works on the same job or tree (a second checkpoint, say).
    #[error(transparent)]
    Busy(#[from] LockError),
    #[error("process {pid} ({comm}) ended during the checkpoint; an image without it would hold device state with no process to go back into")]
    Exited { pid: i32, comm: String },
    #[error("journal: {0}")]
    Journal(std::io::Error),
    /// Undoing failed: device state may still be locked or checkpointed.
    #[error("could not bring the application's devices back to running{}: {source}", after.as_ref().map(|a| format!(" after the checkpoint failed ({a})")).unwrap_or_default())]
    Resume { source: EngineError, after: Option<String> },
}

impl CheckpointError {
    pub fn hint(&self) -> Option<String> {
        Some(match self {
            CheckpointError::Tree(TreeError::NoSuchProcess(_)) => "check the PID, or use a job name from `hiber ls`".into(),
            CheckpointError::NotPermitted { .. } => "run hiber as root (CRIU must ptrace every process of the tree)".into(),
            CheckpointError::Terminal { .. } => "CRIU restores a terminal only where the tree holds both its ends (a pty it opened itself); start the program with `hiber run -- CMD` (no terminal, logs to files), or detach it from its terminal (setsid, nohup with redirects) before starting it".into(),
            CheckpointError::NoSpace { .. } => "free some space or choose another --out".into(),
            CheckpointError::Undumpable { what, .. } => what.hint(),
            CheckpointError::MissingTool { tool: "ip", .. } => "install iproute2 (`hiber doctor` checks for it)".into(),
            CheckpointError::MissingTool { tool, .. } => format!("install {tool} (`hiber doctor` checks for it)"),
            CheckpointError::Image(ImageError::OutputExists(_)) => "choose another --out, or `hiber rm` the old image".into(),
            CheckpointError::Parent { .. } => "name an image from `hiber ls` with --parent, or checkpoint in full with --no-parent".into(),
            CheckpointError::Engine(e) => return e.hint().map(String::from),
            CheckpointError::Exited { .. } => "see the job's log for why that process ended, then checkpoint again".into(),
            CheckpointError::Resume { .. } => "the journal keeps what is left to undo: run `hiber recover` to retry".into(),
            CheckpointError::Busy(LockError::Held { .. }) => "wait for it to finish, then checkpoint again".into(),
            CheckpointError::Criu(e) => match e.errno() {
                Some(libc::ENOSPC) => "the disk filled up during the dump; free some space or choose another --out".into(),
                _ => match e.log() {
                    Some(log) => format!("CRIU's log: {}", log.display()),
                    None => return None,
                },
            },
            _ => return None,
        })
    }
}

/// What to checkpoint and how.
#[derive(Debug, Clone)]
pub struct CheckpointRequest {
    pub pid: i32,
    pub job: Option<Job>,
    pub dest: PathBuf,
    pub leave_running: bool,
    /// An earlier image whose device data this one shares where it has not changed.
    pub parent: Option<PathBuf>,
    /// zstd level for device data chunks; `None` stores them as they are.
    pub compress: Option<i32>,
    /// The image is only a transfer buffer (a migration's): not fsynced at its commit (see
    /// [`crate::image::ImageWriter::transient`]).
    pub transient: bool,
}

#[derive(Debug, Clone)]
pub struct CheckpointReport {
    pub image: PathBuf,
    pub processes: usize,
    /// Time device engines took to quiesce and capture.
    pub devices: Duration,
    /// Time from the start of the CRIU dump until the image was durable and in place.
    pub dump: Duration,
    pub total: Duration,
    pub image_bytes: u64,
    /// Of `image_bytes`, shared with the parent image rather than written.
    pub shared_bytes: u64,
    /// With `--leave-running`: from the first process touched until every one ran again.
    pub paused: Option<Duration>,
    /// CRIU's own figures of the dump.
    pub criu: Option<crate::criu::DumpStats>,
    /// How long each step inside the pause took, in order (engine quiesce, capture, CRIU's
    /// dump, engine resume).
    pub steps: Vec<(String, Duration)>,
    /// CRIU wrote into a staging area in memory (`--leave-running`; see [`stage`]).
    pub criu_staged: bool,
}

/// Refuses targets that cannot or must not be checkpointed, before anything is touched.
pub fn preflight(pid: i32) -> Result<Vec<ProcessInfo>, CheckpointError> {
    let root = proctree::read_process(pid)?;
    if root.kernel_thread {
        return Err(CheckpointError::KernelThread { pid });
    }
    if proctree::ancestors_of(sys::getpid()).contains(&pid) {
        return Err(CheckpointError::OwnLineage { pid });
    }
    if sys::geteuid() != 0 {
        return Err(CheckpointError::NotPermitted { pid, reason: "hiber is not running as root".into() });
    }
    let tree = proctree::discover_tree(pid)?;
    if let Some(t) = terminal::outside_terminal(&tree) {
        return Err(CheckpointError::Terminal { pid: t.pid, comm: t.comm, tty: t.tty });
    }
    Ok(tree)
}

/// Refuses early when the image cannot fit. `HIBER_NO_SPACE_CHECK=1` skips this (the dump
/// then fails, safely, when the disk fills).
fn check_space(dest: &Path, tree: &[ProcessInfo]) -> Result<(), CheckpointError> {
    if std::env::var_os("HIBER_NO_SPACE_CHECK").is_some_and(|v| v == "1") {
        return Ok(());
    }
    let dir = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let needed = image_estimate(tree);
    room_for(dir, needed).map_err(|available| CheckpointError::NoSpace { dir: dir.to_path_buf(), needed, available })
}

/// About what an image of `tree` holds: its processes' private memory, and some.
pub fn image_estimate(tree: &[ProcessInfo]) -> u64 {
    tree.iter().map(|p| p.anon_bytes).sum::<u64>() + (16 << 20)
}

/// Whether the filesystem of `dir` (or of its nearest existing ancestor) has `bytes` free;
/// `Err` with what it has. A filesystem that cannot be asked passes.
pub fn room_for(dir: &Path, bytes: u64) -> Result<(), u64> {
    let probe = dir.ancestors().find(|a| a.exists()).unwrap_or(Path::new("/"));
    match sys::available_bytes(probe) {
        Ok(available) if available < bytes => Err(available),
        _ => Ok(()),
    }
}

/// CRIU's name for the file open as `fd` in `pid`, as an external file:
/// `file[MNT_ID:INODE]` (hex). The job's logs are dumped so: a restore hands the new copy
/// logs of its own, opened in hiber's mount namespace, which a later dump of that copy
/// could not resolve in the copy's namespace by path ("Can't lookup mount").
pub(crate) fn log_file_id(pid: i32, fd: i32) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).ok()?;
    let mnt_id: u64 = info.lines().find_map(|l| l.strip_prefix("mnt_id:")).and_then(|v| v.trim().parse().ok())?;
    let ino = std::fs::metadata(format!("/proc/{pid}/fd/{fd}")).ok()?.ino();
    Some(format!("file[{mnt_id:x}:{ino:x}]"))
}

/// Whether the tree rooted at `tree[0]` lives in a network namespace of its own that has
/// no interface but loopback (a copy restored with `--isolate-net`) and whose sockets all
/// belong to the tree: nothing outside the frozen tree can send or receive there, so the
/// dump needs no network lock (which CRIU takes with iptables or nftables, tools a machine
/// may not have).
pub(crate) fn loopback_only_network(tree: &[ProcessInfo]) -> bool {
    let root = tree[0].pid;
    if !proctree::has_own_namespace(root, "net") {
        return false;
    }
    let theirs = proctree::namespace(&root.to_string(), "net");
    let dev = std::fs::read_to_string(format!("/proc/{root}/net/dev")).unwrap_or_default();
    // Two header lines, then one line per interface: "  lo: 1234 ...".
    let interfaces: Vec<&str> = dev.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
    if interfaces != ["lo"] {
        return false;
    }
    // Others in the namespace (the job's shim is) must hold no socket.
    let Ok(procs) = std::fs::read_dir("/proc") else { return false };
    procs.flatten().filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok()).filter(|p| !tree.iter().any(|t| t.pid == *p)).all(|p| {
        proctree::namespace(&p.to_string(), "net") != theirs
            || std::fs::read_dir(format!("/proc/{p}/fd"))
                .map(|fds| !fds.flatten().any(|f| std::fs::read_link(f.path()).is_ok_and(|t| t.to_string_lossy().starts_with("socket:"))))
                .unwrap_or(false)
    })
}

/// One checkpoint of a tree at a time: the lock of the job (or of the tree's root, for a
/// tree that is no job), taken before anything is touched. A second checkpoint is refused
/// at once and leaves the application to the first.
fn lock_target(ctx: &Context, req: &CheckpointRequest) -> Result<OpLock, CheckpointError> {
    Ok(match &req.job {
        Some(job) => lock::lock_job(&Registry::new(&ctx.state), &job.name, "checkpointed")?,
        None => lock::lock_pid(&ctx.state, req.pid, "checkpointed")?,
    })
}

/// Checkpoints with every phase run back to back (`HIBER_FAIL_AT` may name a phase whose
/// barrier fails, for fault-injection tests).
/// Where a checkpoint of `job` (or of the tree at `pid`, no job's) goes unless told: the
/// state directory's `images/NAME-TIME`.
pub fn default_image_path(state: &crate::state::StateDir, job: Option<&crate::jobs::Job>, pid: i32) -> PathBuf {
    let base = job.map(|j| j.name.clone()).unwrap_or_else(|| format!("pid{pid}"));
    let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string().replace(':', "");
    state.images().join(format!("{base}-{}", stamp.trim_end_matches('Z')))
}

pub fn checkpoint(ctx: &Context, req: &CheckpointRequest) -> Result<CheckpointReport, CheckpointError> {
    checkpoint_with(ctx, req, &coordinator::from_env())
}

/// Checkpoints, holding at `coord`'s barrier after each phase.
pub fn checkpoint_with(ctx: &Context, req: &CheckpointRequest, coord: &dyn Coordinator) -> Result<CheckpointReport, CheckpointError> {
    let coord = &Tracked::new(coord);
    // Held to the end, released however this returns.
    let _lock = match lock_target(ctx, req) {
        Ok(l) => l,
        Err(e) => {
            coord.fail(&e.to_string());
            return Err(e);
        }
    };
    let mut c = match Checkpoint::prepare(ctx, req) {
        Ok(c) => c,
        Err(e) => {
            coord.fail(&e.to_string());
            return Err(e);
        }
    };
    if coord.is_shared() {
        if let Err(e) = c.coordinated() {
            coord.fail(&e.to_string());
            c.abort(&e, coord)?;
            return Err(e);
        }
    }
    let steps = (|| {
        coord.barrier(Phase::Prepared)?;
        c.quiesce(coord)?;
        coord.barrier(Phase::Quiesced)?;
        c.capture()?;
        coord.barrier(Phase::Captured)?;
        c.dump(coord)
    })();
    if let Err(e) = steps {
        // The others abort at once, and undo with this one (their NCCL ranks and this
        // one's are built again together).
        coord.fail(&e.to_string());
        c.abort(&e, coord)?;
        return Err(e);
    }
    if req.leave_running {
        // The application runs again first; the image is finished off its critical path.
        // A failure from here on costs the image, not the application.
        if let Err(e) = c.resume(coord) {
            coord.fail(&e.to_string());
            return Err(e);
        }
        // From here the application runs: whatever fails, nothing is left to undo.
        if let Err(e) = c.commit() {
            coord.fail(&e.to_string());
            c.close();
            return Err(e);
        }
        // Another participant that could not commit makes this image part of a cut that
        // did not happen: it goes.
        if let Err(e) = coord.barrier(Phase::Committed) {
            let _ = std::fs::remove_dir_all(&req.dest);
            c.close();
            return Err(e.into());
        }
    }
    Ok(c.finish())
}
