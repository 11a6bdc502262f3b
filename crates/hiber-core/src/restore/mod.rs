//! The restore pipeline, in phases: prepare (verify the image, check what it needs here:
//! files, and each engine opens a restore session that checks devices and memory) →
//! CRIU restore under a job shim → restore device state (engines in reverse order) →
//! record the job. A [`Coordinator`] may hold it at a barrier after each phase.
//!
//! Everything that can be checked is checked before CRIU starts, because a half-restored
//! GPU process cannot always be saved.

use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::coordinator::{self, BarrierError, Coordinator, Phase, Tracked};
use crate::engine::{self, DeviceRestoreOptions, EngineError, RestoreSession, RestoredPid};
use crate::image::{trust, Image, ImageError};
use crate::jobs::{Job, JobError, Registry};
use crate::launch::{self, LaunchError, Started};
use crate::proctree::{self, TreeError};
use crate::{sys, Context};

pub mod interrupted;

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Job(#[from] JobError),
    #[error("{path} is missing (process {pid} had it open when checkpointed)")]
    MissingFile { path: String, pid: i32 },
    #[error("the image holds {engine} device state, and this machine has no {engine} engine")]
    EngineUnavailable { engine: String, hint: &'static str },
    #[error("the image holds device state of engine '{engine}', which this hiber does not know")]
    UnknownEngine { engine: String },
    #[error(transparent)]
    Barrier(#[from] BarrierError),
    #[error("{0}")]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Launch(#[from] LaunchError),
    #[error("{message}")]
    Criu { message: String, hint: Option<String>, log: Option<String> },
    #[error(transparent)]
    Tree(#[from] TreeError),
    #[error("restore needs root (CRIU restores PIDs, namespaces and credentials)")]
    NotRoot,
    /// The restored tree ended by itself before its restore was complete.
    #[error("the restored process {how} before its device state was restored{}", last_words.as_ref().map(|w| format!("; its last words: {w}")).unwrap_or_default())]
    DiedEarly { how: String, last_words: Option<String>, cause: Box<RestoreError> },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl RestoreError {
    pub fn hint(&self) -> Option<String> {
        Some(match self {
            RestoreError::Image(ImageError::NotFound(_)) => "list images with `hiber ls`".into(),
            RestoreError::Image(ImageError::Untrusted { .. }) => {
                "make root its owner and let nobody else write it (chown -R root: IMAGE; chmod -R go-w IMAGE), or, if you trust who wrote it, restore a private copy with --trust-image".into()
            }
            RestoreError::Image(e) if e.is_invalid_image() => "the image cannot be trusted; checkpoint again".into(),
            RestoreError::Job(JobError::Exists(_)) => "pick another --name, or `hiber rm` the old job".into(),
            RestoreError::MissingFile { .. } => "put the file back where it was (same path), then restore again".into(),
            RestoreError::EngineUnavailable { hint, .. } => hint.to_string(),
            RestoreError::UnknownEngine { .. } => "restore it with the hiber that wrote it, or a newer one".into(),
            RestoreError::Engine(e) => return e.hint().map(String::from),
            RestoreError::Criu { hint, log, .. } => match (hint, log) {
                (Some(h), _) => h.clone(),
                (None, Some(l)) => format!("CRIU's log: {l}"),
                (None, None) => return None,
            },
            RestoreError::NotRoot => "run hiber as root".into(),
            RestoreError::DiedEarly { cause, .. } => match cause.hint() {
                Some(h) => h,
                None => format!("the image is unchanged; after that hiber saw: {cause}"),
            },
            _ => return None,
        })
    }
}

#[derive(Debug, Clone)]
pub struct RestoreRequest {
    pub image: PathBuf,
    pub name: Option<String>,
    pub devices: DeviceRestoreOptions,
    /// Restore into a new network namespace with only loopback: for a copy that must not
    /// clash with the original's sockets (the CUDA driver's abstract unix socket, say).
    pub isolate_net: bool,
    /// Restore an image that fails the ownership and mode checks of [`trust`] (another
    /// user could have written it), from a private copy that is verified and restored.
    pub trust_image: bool,
    /// CRIU leaves the restored tree stopped, and it runs only once the
    /// [`Phase::ProcessesRestored`] barrier passes (a migration's target waits there for
    /// the source to hand the job over).
    pub hold_stopped: bool,
}

#[derive(Debug, Clone)]
pub struct RestoreReport {
    pub job: Job,
    pub verify: Duration,
    pub criu: Duration,
    pub devices: Duration,
    pub total: Duration,
}

/// Files the tree had open that a restore needs to find in place: regular files, not
/// the ones CRIU carries in the image (deleted files, and files on the job's own mounts:
/// its /dev/shm, its /proc) and not the root's stdout/stderr, which the new job replaces
/// with its own logs.
fn required_files(image: &Image) -> Vec<(String, i32)> {
    let replaced: BTreeSet<&str> = [&image.manifest.source.stdout, &image.manifest.source.stderr].into_iter().flatten().map(String::as_str).collect();
    let mut out = Vec::new();
    for p in &image.manifest.processes {
        for f in &p.fds {
            if f.is_regular_file() && f.is_path() && !f.own_mount && !f.target.ends_with(" (deleted)") && !replaced.contains(f.target.as_str()) {
                out.push((f.target.clone(), p.ns_pid));
            }
        }
    }
    out
}

/// Restores with every phase run back to back (`HIBER_FAIL_AT` may name a phase whose
/// barrier fails, for fault-injection tests).
pub fn restore(ctx: &Context, req: &RestoreRequest) -> Result<RestoreReport, RestoreError> {
    restore_with(ctx, req, &coordinator::from_env())
}

/// An engine's restore session.
type Engaged = Box<dyn RestoreSession>;

/// Restores, holding at `coord`'s barrier after each phase.
pub fn restore_with(ctx: &Context, req: &RestoreRequest, coord: &dyn Coordinator) -> Result<RestoreReport, RestoreError> {
    let coord = Tracked::new(coord);
    let result = restore_tracked(ctx, req, &coord);
    if let Err(e) = &result {
        // The others abort at once rather than wait for this one at the next phase.
        coord.fail(&e.to_string());
    }
    result
}

fn restore_tracked(ctx: &Context, req: &RestoreRequest, coord: &Tracked<'_>) -> Result<RestoreReport, RestoreError> {
    let started = Instant::now();
    // The private copy of an untrusted image, if one was made, goes once the restore ends.
    let (image, mut sessions, _copy) = prepare(ctx, req)?;
    let verify = started.elapsed();
    coord.barrier(Phase::RestorePrepared)?;
    let registry = Registry::new(&ctx.state);
    let base = image.manifest.source.job.clone().unwrap_or_else(|| image.manifest.processes[0].comm.clone());
    let name = match &req.name {
        Some(n) => n.clone(),
        None => registry.free_name(&base),
    };
    // `HIBER_RESTORE_STOPPED=1` takes the stopped-tree path with any image, for tests.
    let leave_stopped =
        req.hold_stopped || sessions.iter().any(|s| s.wants_stopped_tree()) || std::env::var_os("HIBER_RESTORE_STOPPED").is_some_and(|v| v == "1");
    // The job is on record as being restored from the moment its name is taken, before
    // anything starts: should this hiber be killed from here on, `hiber ls` lists the job
    // and `hiber recover` settles it ([`interrupted`]).
    let marker = crate::jobs::RestoreMarker {
        hiber_pid: sys::getpid(),
        hiber_start_time: proctree::stat(sys::getpid())?.start_time,
        image: req.image.display().to_string(),
        command: image.manifest.processes[0].cmdline.clone(),
        created: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        devices: image.manifest.devices.iter().map(|d| d.engine.clone()).collect(),
        leave_stopped,
        coordinated: coord.is_shared(),
        private_copy: image.dir != req.image,
    };
    let (dir, restore_lock) = registry.create_restoring(&name, &marker)?;
    let helpers = sessions.iter_mut().try_for_each(|s| s.job_dir(&dir));
    if let Err(e) = helpers {
        let _ = registry.remove(&name);
        return Err(e.into());
    }
    let job = JobTarget { registry: &registry, name: &name, dir: &dir, restore_lock: &restore_lock, leave_stopped };
    let result = restore_into_job(ctx, &image, &mut sessions, &job, req, coord).map(|(job, criu, devices)| RestoreReport {
        job,
        verify,
        criu,
        devices,
        total: started.elapsed(),
    });
    match &result {
        Ok(_) => {
            // The job is recorded and runs; a marker left behind only makes `hiber recover`
            // adopt it once this hiber is gone.
            if let Err(e) = registry.finish_restore(&name) {
                tracing::warn!(error = %e, "could not mark the restore complete");
            }
        }
        Err(_) => {
            let _ = registry.remove(&name);
        }
    }
    result
}

/// Prepare: the image verified, this machine checked, and every engine's session open.
/// Nothing is started yet.
fn prepare(ctx: &Context, req: &RestoreRequest) -> Result<(Image, Vec<Engaged>, Option<PrivateCopy>), RestoreError> {
    if sys::geteuid() != 0 {
        return Err(RestoreError::NotRoot);
    }
    let copy = match trust::check(&req.image) {
        Ok(()) => None,
        Err(ImageError::Untrusted { .. }) if req.trust_image => Some(PrivateCopy::make(ctx, &req.image)?),
        Err(e) => return Err(e.into()),
    };
    let image = Image::open(copy.as_ref().map_or(&req.image, |c| &c.dir))?;
    ctx.phase("verifying every file of the image");
    // Files an engine streams (device memory chunks) are checked on their way, once.
    let streamed: Vec<&str> = image.manifest.devices.iter().filter_map(|d| engine::kind(&d.engine)?.streamed_dir()).collect();
    image.verify_except(&streamed)?;
    for (path, pid) in required_files(&image) {
        if !Path::new(&path).exists() {
            return Err(RestoreError::MissingFile { path, pid });
        }
    }
    let mut opts = req.devices.clone();
    opts.image_dir = image.dir.clone();
    opts.checksums = image.manifest.files.iter().map(|f| (f.path.clone(), f.blake3.clone())).collect();
    let mut sessions = Vec::new();
    for section in &image.manifest.devices {
        let kind = engine::kind(&section.engine).ok_or_else(|| RestoreError::UnknownEngine { engine: section.engine.clone() })?;
        engine::check_section_version(kind, section.version)?;
        let engine = engine::for_section(&ctx.engines, &section.engine)
            .ok_or_else(|| RestoreError::EngineUnavailable { engine: section.engine.clone(), hint: kind.unavailable_hint() })?;
        sessions.push(engine.begin_restore(&section.state, &opts)?);
    }
    Ok((image, sessions, copy))
}

/// A private copy of an image that failed [`trust::check`], made because the user said to
/// trust it: hiber verifies the copy, which nobody else can change, and CRIU reads it.
/// Removed when dropped.
struct PrivateCopy {
    dir: PathBuf,
}

impl PrivateCopy {
    fn make(ctx: &Context, image: &Path) -> Result<PrivateCopy, RestoreError> {
        let parent = trust::copies_dir(&ctx.state);
        ctx.state.ensure(&parent)?;
        trust::sweep_copies(&ctx.state);
        ctx.phase("copying the untrusted image into a private directory");
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let copy = PrivateCopy { dir: parent.join(format!("{}-{n}", crate::state::hiber_tag()?)) };
        trust::private_copy(image, &copy.dir)?;
        Ok(copy)
    }
}

impl Drop for PrivateCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The job a restore creates.
struct JobTarget<'a> {
    registry: &'a Registry,
    name: &'a str,
    dir: &'a Path,
    /// Held while the restore runs, and by the job's shim (see [`interrupted`]).
    restore_lock: &'a std::fs::File,
    /// CRIU leaves the tree stopped, for the device state to be restored first.
    leave_stopped: bool,
}

/// CRIU restores the tree under the job's shim, then the devices are restored. Returns the
/// job and the time CRIU and the devices took.
fn restore_into_job(
    ctx: &Context,
    image: &Image,
    sessions: &mut [Engaged],
    job: &JobTarget<'_>,
    req: &RestoreRequest,
    coord: &Tracked<'_>,
) -> Result<(Job, Duration, Duration), RestoreError> {
    let (stdout, stderr) = job.registry.open_logs(job.name)?;
    let src = &image.manifest.source;
    let mut inherit: Vec<(String, i32)> = Vec::new();
    for (key, file) in src.log_keys().into_iter().zip([&stdout, &stderr]) {
        if let Some(key) = key {
            if !inherit.iter().any(|(k, _)| *k == key) {
                inherit.push((key, file.as_raw_fd()));
            }
        }
    }
    let work = ctx.criu_work_dir("restore")?;
    let criu_dir = image.criu_dir();
    let leave_stopped = job.leave_stopped;
    let criu_start = Instant::now();
    // In this network namespace, the job's sockets get their addresses back.
    let closed = if req.isolate_net { ClosedPorts::default() } else { free_ports_of(&criu_dir) };
    ctx.phase("restoring process state (CRIU)");
    // With other participants, CRIU holds the made processes at its post-restore
    // notification until the SocketsRestored barrier passes (see `hold_post_restore`).
    // Alone, the barrier comes once CRIU is done: a hiber killed meanwhile then leaves a
    // tree that `hiber recover` adopts, which a hold would have undone.
    let shared = coord.is_shared();
    let (ours, theirs) = if shared { sys::seqpacket_pair().map(|(a, b)| (Some(a), Some(b)))? } else { (None, None) };
    let task = launch::RestoreTask {
        criu: ctx.criu.path().to_path_buf(),
        images_dir: criu_dir,
        work_dir: work.clone(),
        inherit,
        external_mounts: src.mount_namespace,
        isolate_net: req.isolate_net,
        leave_stopped,
        hold: Some(job.restore_lock.as_raw_fd()),
        post_restore: theirs.as_ref().map(|t| t.as_raw_fd()),
    };
    let task = launch::ShimTask::Restore(task);
    let (started, held) = std::thread::scope(|s| {
        let shim = s.spawn(|| launch::spawn_shim(job.dir, &task));
        let held = match ours {
            Some(sock) => hold_post_restore(sock, || shim.is_finished(), coord),
            None => Ok(()),
        };
        (shim.join(), held)
    });
    drop(theirs);
    let started = started.map_err(|_| RestoreError::Io(std::io::Error::other("the thread that started the restore's shim panicked")))?;
    // The barrier's failure is the cause of CRIU's ("post-restore script failed").
    if let Err(e) = held {
        if let Ok(Started::Running { pid }) = started {
            stop_tree(pid, src.pid_namespace);
        }
        return Err(e);
    }
    let root = match started? {
        Started::Running { pid } => pid,
        Started::Failed { message, hint, log } => {
            // The shim ran CRIU and reports its error as text; hints that need the image are made here.
            let e = crate::criu::CriuError::Reported { message, log: log.map(PathBuf::from) };
            let hint = hint.or_else(|| closed.hint(&e)).or_else(|| restore_hint(image, &e));
            return Err(RestoreError::Criu { message: e.to_string(), hint, log: e.log().map(|l| l.display().to_string()) });
        }
    };
    let criu = criu_start.elapsed();
    let _ = std::fs::remove_dir_all(&work);
    let devices_start = Instant::now();
    let alone = if shared { Ok(()) } else { coord.barrier(Phase::SocketsRestored) };
    let finished = alone
        .and_then(|()| coord.barrier(Phase::ProcessesRestored))
        .map_err(RestoreError::from)
        .and_then(|()| restore_devices(ctx, sessions, root, leave_stopped, coord))
        // Where the other participants' ranks build NCCL communicators again, this one
        // passes those phases too, with nothing to say if it has no rank.
        .and_then(|()| coord.catch_up(&Phase::NCCL_REBUILD).map_err(RestoreError::from))
        // Recorded before the last barrier: a participant that cannot record its job fails
        // there, with every other one, rather than after they were told to go on.
        .and_then(|()| record_job(image, &req.image, job, root))
        .and_then(|j| coord.barrier(Phase::DevicesRestored).map(|()| j).map_err(RestoreError::from));
    match finished {
        Ok(j) => Ok((j, criu, devices_start.elapsed())),
        Err(e) => {
            // A tree that ended by itself is reported as such (the error it caused is only a
            // symptom), with the last line it wrote to stderr.
            let died = job.registry.exit_status(job.name);
            // The tree cannot run without its device state or its record: stop all of it,
            // and let its shim record the exit before the job directory goes.
            stop_tree(root, image.manifest.source.pid_namespace);
            let start = Instant::now();
            while !job.registry.has_exit(job.name) && start.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(match died {
                Some(status) => RestoreError::DiedEarly { how: died_how(status), last_words: job.registry.last_stderr_line(job.name), cause: Box::new(e) },
                None => e,
            })
        }
    }
}

/// While the shim runs CRIU: once CRIU has made every process and socket and holds them
/// (its post-restore notification; the shim says so on `sock`), passes the restore's
/// [`Phase::SocketsRestored`] barrier and tells the shim to go on, or to have CRIU undo the
/// restore. With other participants, none unlocks its network or resumes its processes
/// before every one has made its ends of the connections between them: a window probe (sent
/// as CRIU takes a socket out of repair mode) or a write to a host whose end is not made yet
/// is answered with a reset, which broke Open MPI jobs restored across two hosts. Returns
/// at once where the shim ended (`done`) without reaching that point.
fn hold_post_restore(sock: std::os::fd::OwnedFd, done: impl Fn() -> bool, coord: &dyn Coordinator) -> Result<(), RestoreError> {
    use std::io::{Read, Write};
    let mut sock = std::os::unix::net::UnixStream::from(sock);
    sock.set_read_timeout(Some(Duration::from_millis(50)))?;
    let mut byte = [0u8; 1];
    loop {
        match sock.read(&mut byte) {
            Ok(1) if byte[0] == launch::POST_RESTORE_REACHED => break,
            Ok(_) => return Ok(()),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted) => {
                if done() {
                    return Ok(());
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    let passed = coord.barrier(Phase::SocketsRestored);
    let word = if passed.is_ok() { launch::POST_RESTORE_GO } else { launch::POST_RESTORE_UNDO };
    // A shim that cannot hear it has CRIU undo the restore (it reads EOF once hiber's
    // end closes), and reports that.
    let _ = sock.write_all(&[word]);
    passed.map_err(RestoreError::from)
}

/// The closed connections on the addresses of an image's TCP sockets that a restore could
/// not end (see [`free_ports_of`]).
#[derive(Default)]
struct ClosedPorts {
    left: Vec<std::net::SocketAddr>,
    why: String,
}

impl ClosedPorts {
    /// Where CRIU could not bind an address and such a connection holds one, the hint says so.
    fn hint(&self, e: &crate::criu::CriuError) -> Option<String> {
        let taken = e.errno() == Some(libc::EADDRINUSE) || e.to_string().contains("Address already in use");
        let first = self.left.first().filter(|_| taken)?;
        Some(format!(
            "{first} is held by a connection the job closed, which the kernel keeps for up to a minute (TIME_WAIT) and hiber could not end ({}): restore again in a minute, or restore with --isolate-net",
            self.why
        ))
    }
}

/// A program that closed a connection first left it in TIME_WAIT on its own address, where
/// it stays for a minute (in FIN_WAIT, CLOSING or LAST_ACK while its closing handshake
/// goes on: a failed restore that killed its copy leaves those). A restore in place within
/// that minute binds the address again, and where the connection was made without
/// `SO_REUSEADDR` (Open MPI's TCP transport, a server that does not ask for it), it holds
/// the port and CRIU fails with "Address already in use". Connections on the image's TCP
/// addresses that no program holds any more are the job's own past (or another program's,
/// on a port the job had first): they are ended, as `ss -K` would. Nothing else is touched,
/// and nothing here fails the restore: what is left is reported, and named in the hint if
/// CRIU then fails on it.
fn free_ports_of(criu_dir: &Path) -> ClosedPorts {
    let addrs = match crate::criu::tcp_addresses(criu_dir) {
        Ok(a) if a.is_empty() => return ClosedPorts::default(),
        Ok(a) => a,
        Err(e) => {
            tracing::warn!("cannot read the image's sockets to free their ports: {e}");
            return ClosedPorts::default();
        }
    };
    let held = crate::sockdiag::SockDiag::open().and_then(|mut d| {
        let held: Vec<_> = d.closed()?.into_iter().filter(|c| addrs.iter().any(|a| crate::sockdiag::contend(*a, c.local))).collect();
        Ok((d, held))
    });
    let (mut diag, held) = match held {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!("cannot list this host's closed connections (sock_diag): {e}");
            return ClosedPorts::default();
        }
    };
    let mut left = ClosedPorts::default();
    for c in &held {
        match diag.destroy(c) {
            Ok(()) => tracing::info!("ended a closed connection ({}) on {} to {}, which held an address of the image", c.state, c.local, c.remote),
            Err(e) => {
                left.why = if e.raw_os_error() == Some(libc::EOPNOTSUPP) { "this kernel has no CONFIG_INET_DIAG_DESTROY".into() } else { e.to_string() };
                left.left.push(c.local);
            }
        }
    }
    if let Some(first) = left.left.first() {
        tracing::warn!("{} closed connection(s) hold addresses of the image ({first} first) and could not be ended: {}", left.left.len(), left.why);
    }
    left
}

/// After CRIU restored the tree: each engine restores its device state, in reverse order
/// (engines that quiesced first, the agent before the driver, resume last).
/// CRIU left the tree stopped when `stopped`: the sessions that want it so (the driver's)
/// restore first, then the tree is continued, then the others (the agent's, which talk to a
/// thread of the process) restore.
fn restore_devices(ctx: &Context, sessions: &mut [Engaged], root: i32, stopped: bool, coord: &dyn Coordinator) -> Result<(), RestoreError> {
    if sessions.is_empty() && !stopped {
        return Ok(());
    }
    if !sessions.is_empty() {
        ctx.phase("restoring GPU state");
    }
    let tree = proctree::discover_tree(root)?;
    let pids: Vec<RestoredPid> = tree.iter().map(|p| RestoredPid { ns_pid: p.ns_pid, pid: p.pid }).collect();
    if stopped {
        // CRIU sends SIGSTOP as it lets the processes go; each thread enters the stop on
        // its own, a moment later.
        let start = Instant::now();
        while !tree.iter().all(|p| proctree::all_threads_stopped(p.pid)) {
            if start.elapsed() > Duration::from_secs(10) {
                return Err(RestoreError::Io(std::io::Error::other("the restored processes did not stop within 10 s")));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    for s in sessions.iter_mut().rev().filter(|s| s.wants_stopped_tree()) {
        s.restore(&pids, coord)?;
    }
    if stopped {
        for p in &tree {
            sys::kill(p.pid, libc::SIGCONT)?;
        }
    }
    for s in sessions.iter_mut().rev().filter(|s| !s.wants_stopped_tree()) {
        s.restore(&pids, coord)?;
    }
    Ok(())
}

/// The restored tree becomes a job of the registry.
/// `source` is the image as the user named it; `image` may be a private copy of it.
fn record_job(image: &Image, source: &Path, job: &JobTarget<'_>, root: i32) -> Result<Job, RestoreError> {
    let st = proctree::stat(root)?;
    let record = Job {
        name: job.name.to_string(),
        pid: root,
        start_time: st.start_time,
        command: image.manifest.processes[0].cmdline.clone(),
        created: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        restored_from: Some(source.display().to_string()),
        checkpointed_to: None,
        // Its first checkpoint shares what has not changed with the image it came from;
        // not with an untrusted one, whose private copy is gone once the restore ends.
        last_image: (image.dir == source).then(|| image.dir.display().to_string()),
    };
    job.registry.save(&record)?;
    Ok(record)
}

fn died_how(status: sys::ExitStatus) -> String {
    match status {
        sys::ExitStatus::Code(c) => format!("exited with status {c}"),
        sys::ExitStatus::Signal(s) => format!("was killed by signal {s}"),
    }
}

/// SIGKILLs a restored tree: its root, which takes a PID namespace down with it, or else
/// every process of it.
fn stop_tree(root: i32, pid_namespace: bool) {
    let pids = if pid_namespace { vec![root] } else { proctree::discover_tree(root).map(|t| t.iter().map(|p| p.pid).collect()).unwrap_or_else(|_| vec![root]) };
    for pid in pids {
        let _ = sys::kill(pid, libc::SIGKILL);
    }
}

/// A hint for a failed CRIU restore: from the errno CRIU reported where it did, else from
/// its message (CRIU reports a taken socket address or PID only in words).
fn restore_hint(image: &Image, e: &crate::criu::CriuError) -> Option<String> {
    let src = &image.manifest.source;
    let text = e.to_string();
    if e.errno() == Some(libc::EADDRINUSE) || text.contains("Address already in use") {
        return Some(
            "a socket address of the image is taken: by the original, if it still runs, or by another job (CUDA names a socket after its job's PID namespace number, which the kernel reuses); stop that first, or restore the copy with --isolate-net (its own network namespace, loopback only)"
                .into(),
        );
    }
    if text.contains("mnt-v2: Failed to open_tree") && text.contains("/: Not a directory") {
        return Some("the image was dumped by a CRIU without hiber's patch 0005, whose path of a bind-mounted file cannot be restored: run scripts/setup.sh, then checkpoint the job again".into());
    }
    if text.contains("mnt-v2: Can't stat mountpoint") || text.contains("mnt-v2: Failed to open_tree") {
        return Some(
            "a job sees this host's mounts, and one it had when checkpointed is gone or changed (a network namespace under /run/netns, say): mount it again where it was, then restore"
                .into(),
        );
    }
    if text.contains("Unable to open dev/ptmx with specified index") {
        return Some(
            "a pseudo-terminal of the image has its number taken on this host: by the original, if it still runs (mpirun gives its ranks terminals), or by any program since; CRIU restores a terminal under its old number, and this job used the host's /dev/pts (run with --host-pts, or started by an older hiber); restore once the number is free"
                .into(),
        );
    }
    if !src.pid_namespace && (e.errno() == Some(libc::EEXIST) || text.contains("already")) {
        return Some(format!("the process was not started by `hiber run`, so it must get its old PIDs back; stop the original (pid {}) first", src.pid));
    }
    e.log().map(|l| format!("CRIU's log: {}", l.display()))
}
