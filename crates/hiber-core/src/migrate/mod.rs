//! Moving a running job to another host's hiber (`hiber migrate JOB --to ADDR`, received
//! by `hiber serve`, see [`serve`]).
//!
//! A migration is a checkpoint whose coordinator is the target: the checkpoint runs its
//! phases as ever, and at [`Phase::Committed`] (the image complete, the tree still frozen
//! inside CRIU's post-dump step) [`Handover`] sends the image over an authenticated,
//! encrypted connection ([`crate::secure`]) and makes it durable meanwhile, while the target
//! restores it and holds it stopped ([`wire`] has the exchange). Until the target says so,
//! any failure (this hiber killed too) fails the barrier and CRIU resumes the tree as if
//! nothing had happened. Then CRIU stops the tree, the image goes on the job's record, and
//! only then is the target told to run its copy: the job runs in one place at most, and its
//! image is kept until it runs somewhere.
//!
//! Everything that can be checked before the job stops is: the token (both ways), the name
//! at the target, its room for the image.
//!
//! Not yet: pre-copy rounds (the job is stopped for the whole copy), streaming without a
//! staging directory on either side, and moving a job's own network namespace (its
//! addresses) with it.

pub mod serve;
pub mod wire;

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::checkpoint::{checkpoint_with, CheckpointError, CheckpointReport, CheckpointRequest};
use crate::coordinator::{BarrierError, Coordinator, Phase};
use crate::jobs::{JobError, JobState, Registry};
use crate::secure::{Channel, SecureError, Token};
use crate::Context;
use wire::{LogStream, Msg};

/// What to move where.
#[derive(Debug, Clone)]
pub struct MigrateRequest {
    pub job: String,
    /// The target's `hiber serve` address (HOST:PORT).
    pub to: String,
    pub token: Token,
    /// The job's name at the target (default: its name here).
    pub name: Option<String>,
    /// Keep the image here, rather than in a staging directory removed afterwards.
    pub keep_image: Option<PathBuf>,
    /// How long to wait for the target at each step (its restore included).
    pub timeout: Duration,
}

#[derive(Debug)]
pub struct MigrateReport {
    pub name: String,
    /// The job's root at the target, as the target's host numbers it.
    pub pid: i32,
    pub checkpoint: CheckpointReport,
    /// From the start of CRIU's dump (the tree frozen) until the target let it run.
    pub stopped: Duration,
    /// Bytes sent: the image and the logs.
    pub sent_bytes: u64,
    pub image_kept: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error(transparent)]
    Job(#[from] JobError),
    #[error("job '{0}' is not running")]
    NotRunning(String),
    #[error(transparent)]
    Secure(#[from] SecureError),
    #[error("the target refused the job: {reason}")]
    Refused { reason: String, hint: Option<String> },
    #[error("{0}")]
    Checkpoint(#[from] CheckpointError),
    /// The target did not confirm, after the source handed the job over: the job may run
    /// there; here the tree is gone, and its image kept.
    #[error("the target did not confirm that the job runs there ({reason}); the job is stopped here and its image kept at {}", image.display())]
    InDoubt { reason: String, image: PathBuf },
    #[error("talking to the target: {0}")]
    Io(#[from] std::io::Error),
}

impl MigrateError {
    pub fn hint(&self) -> Option<String> {
        match self {
            MigrateError::Job(_) | MigrateError::NotRunning(_) => Some("`hiber ls` lists jobs".into()),
            MigrateError::Secure(e) => e.hint(),
            MigrateError::Refused { hint, .. } => hint.clone(),
            MigrateError::Checkpoint(e) => e.hint(),
            MigrateError::InDoubt { image, .. } => {
                Some(format!("`hiber ls` on the target tells whether it runs there; if it does not, `hiber restore {}` here", image.display()))
            }
            MigrateError::Io(_) => Some("the job runs on here; check the target's `hiber serve` and try again".into()),
        }
    }
}

/// Moves job `req.job` to the target: see the module's documentation. On any error but
/// [`MigrateError::InDoubt`] the job runs on here as before.
pub fn migrate(ctx: &Context, req: &MigrateRequest) -> Result<MigrateReport, MigrateError> {
    let registry = Registry::new(&ctx.state);
    let job = registry.load(&req.job)?;
    if registry.state(&job) != JobState::Running {
        return Err(MigrateError::NotRunning(job.name));
    }
    let name = req.name.clone().unwrap_or_else(|| job.name.clone());
    crate::jobs::validate_name(&name)?;
    // What the image will hold, about (as the local space check counts it).
    let tree = crate::proctree::discover_tree(job.pid).map_err(CheckpointError::from)?;
    let bytes = crate::checkpoint::image_estimate(&tree);
    ctx.phase("connecting to the target");
    let mut channel = Channel::connect(&req.to, &req.token, req.timeout)?;
    let hello = Msg::Hello { version: wire::VERSION, job: job.name.clone(), name: name.clone(), bytes, hiber: env!("CARGO_PKG_VERSION").into() };
    wire::send(&mut channel, &hello)?;
    match wire::recv(&mut channel)? {
        Msg::Accepted => {}
        Msg::Refused { reason, hint } => return Err(MigrateError::Refused { reason, hint }),
        other => return Err(unexpected(&other)),
    }
    // Staged on disk, not fsynced at the commit (see `ImageWriter::transient`); made durable
    // while the target restores. /dev/shm was tried, and gained nothing on the benchmark's
    // machine (bench/results/2026-11-28-migrate-cpu.md).
    let on_disk = ctx.state.root().join("migrations");
    let dest = match &req.keep_image {
        Some(d) => d.clone(),
        None => {
            ctx.state.ensure(&on_disk)?;
            let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string().replace(':', "");
            on_disk.join(format!("{}-{}", job.name, stamp.trim_end_matches('Z')))
        }
    };
    let handover = Handover {
        channel: Mutex::new(Some(channel)),
        dest: dest.clone(),
        logs: [registry.stdout_of(&job.name), registry.stderr_of(&job.name)],
        outcome: Mutex::new(Outcome::Pending),
        inject: crate::coordinator::from_env(),
        frozen: Mutex::new(None),
        sent: Mutex::new(0),
    };
    let creq = CheckpointRequest {
        pid: job.pid,
        job: Some(job.clone()),
        dest: dest.clone(),
        leave_running: false,
        parent: None,
        compress: None,
        transient: req.keep_image.is_none(),
    };
    let checkpointed = checkpoint_with(ctx, &creq, &handover);
    let outcome = std::mem::replace(&mut *handover.outcome.lock().unwrap_or_else(|e| e.into_inner()), Outcome::Pending);
    let checkpoint = match checkpointed {
        Ok(r) => r,
        // The undo failed too: what is left to do is `hiber recover`'s, as for a checkpoint.
        Err(e @ CheckpointError::Resume { .. }) => return Err(e.into()),
        Err(e) => {
            // The tree runs on here (the checkpoint undid its steps); the target, told so or
            // not, kills the copy it holds.
            return Err(match outcome {
                Outcome::Failed(reason) => MigrateError::Refused { reason, hint: Some("the job runs on here; see the target's log".into()) },
                _ => e.into(),
            });
        }
    };
    let Some(mut channel) = handover.channel.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return Err(MigrateError::Io(std::io::Error::other("the connection to the target is gone")));
    };
    let sent_bytes = *handover.sent.lock().unwrap_or_else(|e| e.into_inner());
    let frozen = *handover.frozen.lock().unwrap_or_else(|e| e.into_inner());
    // The image is complete and durable, the target holds its copy stopped, and CRIU has
    // stopped the tree here. The image goes on record before the target is told to run its
    // copy: whatever happens from here (this hiber killed, the connection lost), the job runs
    // in one place at most, and its image is kept until it runs.
    if !matches!(outcome, Outcome::Ready) || crate::proctree::is_same_process(job.pid, job.start_time) {
        // Not ready there, or the tree still here: the target drops its copy.
        let _ = wire::send(&mut channel, &Msg::Abort { reason: "the source's tree did not stop".into() });
        return Err(MigrateError::Io(std::io::Error::other("the source's tree did not stop as it should; the target was told to drop its copy")));
    }
    let mut job = job;
    job.checkpointed(&dest, false);
    if let Err(e) = registry.save(&job) {
        let _ = wire::send(&mut channel, &Msg::Abort { reason: format!("the source cannot record its image: {e}") });
        return Err(MigrateError::InDoubt { reason: format!("cannot record the image in the job ({e}); the target was told to drop its copy"), image: dest });
    }
    if std::env::var("HIBER_MIGRATE_PAUSE_AT").is_ok_and(|v| v == "commit") {
        // For tests: held here for ever (a test kills this hiber).
        eprintln!("hiber: paused before Commit (HIBER_MIGRATE_PAUSE_AT)");
        loop {
            std::thread::park();
        }
    }
    let answer = wire::send(&mut channel, &Msg::Commit).and_then(|()| {
        if drop_at("running") {
            channel.shutdown();
        }
        wire::recv(&mut channel)
    });
    let stopped = frozen.map(|t| t.elapsed()).unwrap_or_default();
    match answer {
        Ok(Msg::Running { name, pid }) => {
            // CRIU has killed the tree here; once its shim recorded that, the job goes.
            let start = Instant::now();
            while !registry.has_exit(&job.name) && start.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Err(e) = registry.remove(&job.name) {
                tracing::warn!(error = %e, "the job moved, but its record here could not be removed");
            }
            let image_kept = if req.keep_image.is_some() {
                Some(dest)
            } else {
                let _ = std::fs::remove_dir_all(&dest);
                None
            };
            Ok(MigrateReport { name, pid, checkpoint, stopped, sent_bytes, image_kept })
        }
        Ok(Msg::Failed { reason }) => Err(MigrateError::InDoubt { reason: format!("the target failed after the hand-over: {reason}"), image: dest }),
        Ok(other) => Err(MigrateError::InDoubt { reason: format!("unexpected message from the target: {other:?}"), image: dest }),
        Err(e) => Err(MigrateError::InDoubt { reason: format!("the connection to the target: {e}"), image: dest }),
    }
}

fn unexpected(msg: &Msg) -> MigrateError {
    MigrateError::Io(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("unexpected message from the target: {msg:?}")))
}

enum Outcome {
    Pending,
    /// The target failed before the hand-over: the tree resumes here.
    Failed(String),
    /// The target holds its copy stopped, waiting for `Commit`.
    Ready,
}

/// The checkpoint's coordinator on the source: passes every phase, and at `Committed` hands
/// the image to the target (see the module's documentation). Also fails the barrier named
/// in `$HIBER_FAIL_AT`, and drops the connection at the step named in
/// `$HIBER_MIGRATE_DROP_AT` (`sending`, `ready`, `running`), for fault-injection tests.
struct Handover {
    channel: Mutex<Option<Channel>>,
    dest: PathBuf,
    logs: [PathBuf; 2],
    outcome: Mutex<Outcome>,
    inject: crate::coordinator::Local,
    frozen: Mutex<Option<Instant>>,
    sent: Mutex<u64>,
}

/// Whether `$HIBER_MIGRATE_DROP_AT` names `step` (fault injection, both sides).
fn drop_at(step: &str) -> bool {
    std::env::var("HIBER_MIGRATE_DROP_AT").is_ok_and(|v| v == step)
}

impl Handover {
    fn set(&self, o: Outcome) {
        *self.outcome.lock().unwrap_or_else(|e| e.into_inner()) = o;
    }

    /// Sends the image and the logs, and waits for the target to hold the restored tree.
    fn send_image(&self, ch: &mut Channel) -> Result<(), String> {
        let files = crate::image::list_files(&self.dest).map_err(|e| e.to_string())?;
        let manifest = [crate::image::MANIFEST_FILE, crate::image::MANIFEST_SUM_FILE];
        // The manifest last: a target sees the image whole or not at all.
        let ordered = files.iter().filter(|f| !manifest.contains(&f.as_str())).chain(files.iter().filter(|f| manifest.contains(&f.as_str())));
        let mut sent = 0u64;
        for (i, rel) in ordered.enumerate() {
            let path = self.dest.join(rel);
            let mut f = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let size = f.metadata().map_err(|e| e.to_string())?.len();
            wire::send(ch, &Msg::File { path: rel.clone(), size }).map_err(|e| e.to_string())?;
            if i == 1 && drop_at("sending") {
                ch.shutdown();
            }
            wire::copy_exact(&mut f, ch, size).map_err(|e| e.to_string())?;
            sent += size;
        }
        for (stream, path) in [LogStream::Stdout, LogStream::Stderr].into_iter().zip(&self.logs) {
            let Ok(mut f) = std::fs::File::open(path) else { continue };
            let size = f.metadata().map_err(|e| e.to_string())?.len();
            wire::send(ch, &Msg::Log { stream, size }).map_err(|e| e.to_string())?;
            wire::copy_exact(&mut f, ch, size).map_err(|e| e.to_string())?;
            sent += size;
        }
        wire::send(ch, &Msg::Sent).map_err(|e| e.to_string())?;
        *self.sent.lock().unwrap_or_else(|e| e.into_inner()) = sent;
        if drop_at("ready") {
            ch.shutdown();
        }
        // The image is made durable here while the target verifies and restores its copy:
        // it is the job's only copy from the moment the tree is stopped.
        let dest = self.dest.clone();
        let durable = std::thread::spawn(move || crate::image::make_durable(&dest));
        let ready = match wire::recv(ch).map_err(|e| format!("the connection to the target: {e}"))? {
            Msg::Ready => Ok(()),
            Msg::Failed { reason } => Err(format!("the target: {reason}")),
            other => Err(format!("unexpected message from the target: {other:?}")),
        };
        let synced = durable.join().map_err(|_| "making the image durable failed".to_string())?;
        ready?;
        synced.map_err(|e| format!("cannot make the image durable: {e}"))
    }

    /// At `Committed`, the tree frozen: sends the image and waits until the target holds its
    /// copy stopped. Then the barrier passes and CRIU stops the tree; `Commit` is sent only
    /// after that, outside the freeze (see [`migrate`]). Until then a failure here, or this
    /// hiber killed, makes CRIU resume the tree, and the target drops its copy.
    fn hand_over(&self) -> Result<(), BarrierError> {
        let mut guard = self.channel.lock().unwrap_or_else(|e| e.into_inner());
        let Some(ch) = guard.as_mut() else { return Err(BarrierError("the connection to the target is gone".into())) };
        if let Err(reason) = self.send_image(ch) {
            let _ = wire::send(ch, &Msg::Abort { reason: reason.clone() });
            self.set(Outcome::Failed(reason.clone()));
            return Err(BarrierError(reason));
        }
        self.set(Outcome::Ready);
        Ok(())
    }
}

impl Coordinator for Handover {
    fn barrier(&self, phase: Phase) -> Result<(), BarrierError> {
        self.inject.barrier(phase)?;
        match phase {
            // The dump comes next: the tree is stopped from here until the target runs it.
            Phase::Captured => {
                *self.frozen.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
                Ok(())
            }
            Phase::Committed => self.hand_over(),
            _ => Ok(()),
        }
    }

    fn fail(&self, why: &str) {
        if let Some(ch) = self.channel.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            let _ = wire::send(ch, &Msg::Abort { reason: why.to_string() });
        }
    }
}
