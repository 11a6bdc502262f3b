//! The checkpoint pipeline: discover → quiesce devices → capture devices → CRIU dump →
//! finish the image while the tree is still frozen → resume or let CRIU stop the tree.
//!
//! Every step that changes the application is journaled and undone on failure, so a failed
//! checkpoint leaves the application running as it was and no partial image behind.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::criu::{CriuError, DumpOptions};
use crate::engine::{CaptureTarget, DeviceEngine, EngineError};
use crate::image::{DeviceSection, FileEntry, ImageError, ImageWriter, Manifest, Source, FORMAT, MAGIC};
use crate::jobs::Job;
use crate::journal::{Claim, Entry, Journal, Phase};
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
    #[error("process {pid} ({comm}) has a controlling terminal")]
    Terminal { pid: i32, comm: String },
    #[error("not enough space for the image in {dir}: about {needed} MiB needed, {available} MiB available", needed = .needed >> 20, available = .available >> 20)]
    NoSpace { dir: PathBuf, needed: u64, available: u64 },
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("{0}")]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Criu(#[from] CriuError),
    #[error("journal: {0}")]
    Journal(std::io::Error),
    /// Undoing failed: device state may still be locked or checkpointed.
    #[error("could not bring the application's devices back to running: {0}")]
    Resume(EngineError),
}

impl CheckpointError {
    pub fn hint(&self) -> Option<String> {
        Some(match self {
            CheckpointError::Tree(TreeError::NoSuchProcess(_)) => "check the PID, or use a job name from `hiber ls`".into(),
            CheckpointError::NotPermitted { .. } => "run hiber as root (CRIU must ptrace every process of the tree)".into(),
            CheckpointError::Terminal { .. } => "CRIU can restore a terminal only into the same terminal session; start the program with `hiber run -- CMD` (no terminal, logs to files), or detach it from its terminal (setsid, nohup with redirects) before starting it".into(),
            CheckpointError::NoSpace { .. } => "free some space or choose another --out".into(),
            CheckpointError::Image(ImageError::OutputExists(_)) => "choose another --out, or `hiber rm` the old image".into(),
            CheckpointError::Engine(e) => return e.hint().map(String::from),
            CheckpointError::Resume(_) => "the journal keeps what is left to undo: run `hiber recover` to retry".into(),
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
    if let Some(p) = tree.iter().find(|p| p.tty_nr != 0) {
        return Err(CheckpointError::Terminal { pid: p.pid, comm: p.comm.clone() });
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
    // The nearest existing ancestor tells which filesystem the image lands on.
    let probe = dir.ancestors().find(|a| a.exists()).unwrap_or(Path::new("/"));
    let needed: u64 = tree.iter().map(|p| p.anon_bytes).sum::<u64>() + (16 << 20);
    match sys::available_bytes(probe) {
        Ok(available) if available < needed => Err(CheckpointError::NoSpace { dir: dir.to_path_buf(), needed, available }),
        _ => Ok(()),
    }
}

/// Whether `pid` lives in a mount namespace other than hiber's.
fn own_mount_namespace(pid: i32) -> bool {
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/mnt")).ok();
    matches!((ns(&pid.to_string()), ns("self")), (Some(a), Some(b)) if a != b)
}

pub fn checkpoint(ctx: &Context, req: &CheckpointRequest) -> Result<CheckpointReport, CheckpointError> {
    let started = Instant::now();
    let tree = preflight(req.pid)?;
    check_space(&req.dest, &tree)?;
    let mut writer = ImageWriter::create(&req.dest)?;
    let me = proctree::stat(sys::getpid())?;
    let mut journal = Journal::begin(
        &ctx.state,
        Entry {
            hiber_pid: sys::getpid(),
            hiber_start_time: me.start_time,
            root_pid: req.pid,
            tmp_dir: writer.tmp_dir().to_path_buf(),
            dest: req.dest.clone(),
            leave_running: req.leave_running,
            claims: Vec::new(),
            phase: Phase::Started,
        },
    )
    .map_err(CheckpointError::Journal)?;

    let mut claims: Vec<(&dyn DeviceEngine, Vec<i32>)> = Vec::new();
    for engine in &ctx.engines {
        let pids = match engine.claim(&tree) {
            Ok(p) => p,
            Err(e) => {
                journal.finish();
                return Err(e.into());
            }
        };
        if !pids.is_empty() {
            claims.push((engine.as_ref(), pids));
        }
    }
    journal
        .update(|e| e.claims = claims.iter().map(|(en, pids)| Claim { engine: en.name().into(), pids: pids.clone() }).collect())
        .map_err(CheckpointError::Journal)?;

    let result = run_steps(ctx, req, &tree, &claims, &mut writer, &mut journal, started);
    if result.is_err() || req.leave_running {
        // Undo, or (with --leave-running) the normal end: devices back to running. Every
        // engine is tried; if any fails, the journal stays for `hiber recover`.
        if !claims.is_empty() {
            ctx.phase("resuming GPU processes");
        }
        let mut failed = None;
        for (engine, pids) in claims.iter().rev() {
            if let Err(e) = engine.resume(pids) {
                tracing::error!(engine = engine.name(), error = %e, "could not resume device state");
                failed.get_or_insert(e);
            }
        }
        if let Some(e) = failed {
            // The journal stays for `hiber recover`, and so does the partial image: device
            // memory an engine could not hand back may be there.
            writer.keep_partial();
            return Err(CheckpointError::Resume(e));
        }
    }
    let result = match result {
        Ok(Steps::Committed(report)) => Ok(report),
        // With --leave-running the application runs again already; the image is finished
        // now, off its critical path. A failure here costs the image, not the application.
        Ok(Steps::Pending { manifest, devices, dump_start }) => {
            ctx.phase("finishing the image (device memory, checksums, fsync)");
            let committed = finish_engines(&claims).and_then(|known| writer.commit(*manifest, &known).map_err(CheckpointError::from));
            committed.map(|()| {
                let _ = journal.update(|e| e.phase = Phase::Committed);
                report(req, &tree, devices, dump_start.elapsed(), started)
            })
        }
        Err(e) => Err(e),
    };
    journal.finish();
    result
}

/// How `run_steps` ended: the image committed while the tree was frozen, or (with
/// `--leave-running`) still to be finished once the application runs again.
enum Steps {
    Committed(CheckpointReport),
    Pending { manifest: Box<Manifest>, devices: Duration, dump_start: Instant },
}

/// Lets every engine write what it still holds; returns the entries of files they wrote.
fn finish_engines(claims: &[(&dyn DeviceEngine, Vec<i32>)]) -> Result<Vec<FileEntry>, CheckpointError> {
    let mut known = Vec::new();
    for (engine, _) in claims {
        known.extend(engine.finish()?);
    }
    Ok(known)
}

fn report(req: &CheckpointRequest, tree: &[ProcessInfo], devices: Duration, dump: Duration, started: Instant) -> CheckpointReport {
    let image_bytes = crate::image::Image::open(&req.dest).map(|i| i.total_bytes()).unwrap_or(0);
    CheckpointReport { image: req.dest.clone(), processes: tree.len(), devices, dump, total: started.elapsed(), image_bytes }
}

fn run_steps(
    ctx: &Context,
    req: &CheckpointRequest,
    tree: &[ProcessInfo],
    claims: &[(&dyn DeviceEngine, Vec<i32>)],
    writer: &mut ImageWriter,
    journal: &mut Journal,
    started: Instant,
) -> Result<Steps, CheckpointError> {
    let devices_start = Instant::now();
    if !claims.is_empty() {
        ctx.phase("quiescing GPU processes");
    }
    for (engine, pids) in claims {
        let dir = writer.tmp_dir().join(engine.name());
        engine.quiesce(pids, &CaptureTarget { dir: &dir, leave_running: req.leave_running })?;
    }
    journal.update(|e| e.phase = Phase::DevicesQuiesced).map_err(CheckpointError::Journal)?;
    let mut sections = Vec::new();
    if !claims.is_empty() {
        ctx.phase("checkpointing GPU state");
    }
    for (engine, pids) in claims {
        let dir = writer.tmp_dir().join(engine.name());
        let state = engine.capture(pids, tree, &dir)?;
        sections.push(DeviceSection { engine: engine.name().into(), state });
    }
    let devices = devices_start.elapsed();
    journal.update(|e| e.phase = Phase::Dumping).map_err(CheckpointError::Journal)?;

    let work = ctx.criu_work_dir("dump").map_err(CheckpointError::Journal)?;
    let (kernel, host) = sys::uname();
    let root = &tree[0];
    let std_path = |fd: i32| root.fds.iter().find(|f| f.fd == fd && f.is_regular_file()).map(|f| f.target.clone());
    let mut manifest = Manifest {
        magic: MAGIC.into(),
        format: FORMAT,
        created: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        host,
        kernel,
        criu_version: ctx.criu_version.to_string(),
        hiber_version: env!("CARGO_PKG_VERSION").into(),
        source: Source {
            job: req.job.as_ref().map(|j| j.name.clone()),
            pid: req.pid,
            leave_running: req.leave_running,
            pid_namespace: root.ns_pid == 1 && root.pid != 1,
            mount_namespace: own_mount_namespace(req.pid),
            stdout: std_path(1),
            stderr: std_path(2),
        },
        processes: tree.to_vec(),
        devices: sections,
        frozen_seconds: 0.0,
        files: Vec::new(),
    };
    let dump_start = Instant::now();
    let mut commit_error: Option<ImageError> = None;
    let criu_dir = writer.criu_dir();
    let opts = DumpOptions {
        pid: req.pid,
        images_dir: &criu_dir,
        work_dir: &work,
        leave_running: req.leave_running,
        external_mounts: manifest.source.mount_namespace,
    };
    ctx.phase("dumping process state (CRIU)");
    let dumped = ctx.criu.dump(&opts, &mut |script| {
        if script != "post-dump" || req.leave_running {
            return Ok(());
        }
        ctx.phase("finishing the image (checksums, fsync) while the tree is frozen");
        // The tree is still frozen: finish the image now, and let CRIU resume the tree
        // rather than stop it if that fails.
        manifest.frozen_seconds = dump_start.elapsed().as_secs_f64();
        let known = match finish_engines(claims) {
            Ok(k) => k,
            Err(e) => return Err(e.to_string()),
        };
        match writer.commit(manifest.clone(), &known) {
            Ok(()) => {
                let _ = journal.update(|e| e.phase = Phase::Committed);
                Ok(())
            }
            Err(e) => {
                let msg = e.to_string();
                commit_error = Some(e);
                Err(msg)
            }
        }
    });
    if let Some(e) = commit_error {
        return Err(e.into());
    }
    if let Err(e) = dumped {
        // CRIU failed after accepting the finished image (or hiber lost it): the tree runs
        // on, so an image in place would be a checkpoint that did not happen.
        if writer.is_committed() {
            let _ = std::fs::remove_dir_all(&req.dest);
        }
        return Err(e.into());
    }
    let _ = std::fs::remove_dir_all(&work);
    if req.leave_running {
        manifest.frozen_seconds = dump_start.elapsed().as_secs_f64();
        return Ok(Steps::Pending { manifest: Box::new(manifest), devices, dump_start });
    }
    Ok(Steps::Committed(report(req, tree, devices, dump_start.elapsed(), started)))
}
