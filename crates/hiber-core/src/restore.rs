//! The restore pipeline: verify the image → check what it needs here (files, devices) →
//! CRIU restore under a job shim → restore device state → record the job.
//!
//! Everything that can be checked is checked before CRIU starts, because a half-restored
//! GPU process cannot always be saved.

use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::engine::{self, DeviceRestoreOptions, EngineError, RestoredPid};
use crate::image::{Image, ImageError};
use crate::jobs::{Job, JobError, Registry};
use crate::launch::{self, LaunchError, Started};
use crate::proctree::{self, TreeError};
use crate::{sys, Context};

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Job(#[from] JobError),
    #[error("{path} is missing (process {pid} had it open when checkpointed)")]
    MissingFile { path: String, pid: i32 },
    #[error("the image holds {engine} device state, and this machine has no {engine} engine")]
    EngineUnavailable { engine: String },
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
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl RestoreError {
    pub fn hint(&self) -> Option<String> {
        Some(match self {
            RestoreError::Image(ImageError::NotFound(_)) => "list images with `hiber ls`".into(),
            RestoreError::Image(e) if e.is_invalid_image() => "the image cannot be trusted; checkpoint again".into(),
            RestoreError::Job(JobError::Exists(_)) => "pick another --name, or `hiber rm` the old job".into(),
            RestoreError::MissingFile { .. } => "put the file back where it was (same path), then restore again".into(),
            RestoreError::EngineUnavailable { engine } if engine == "cuda" => {
                "restore on a machine with an NVIDIA GPU and driver 570 or newer (`hiber doctor` says what this one has)".into()
            }
            RestoreError::Engine(e) => return e.hint().map(String::from),
            RestoreError::Criu { hint, log, .. } => match (hint, log) {
                (Some(h), _) => h.clone(),
                (None, Some(l)) => format!("CRIU's log: {l}"),
                (None, None) => return None,
            },
            RestoreError::NotRoot => "run hiber as root".into(),
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
/// the ones CRIU carries in the image (deleted files) and not the root's stdout/stderr,
/// which the new job replaces with its own logs.
fn required_files(image: &Image) -> Vec<(String, i32)> {
    let replaced: BTreeSet<&str> = [&image.manifest.source.stdout, &image.manifest.source.stderr].into_iter().flatten().map(String::as_str).collect();
    let mut out = Vec::new();
    for p in &image.manifest.processes {
        for f in &p.fds {
            if f.is_regular_file() && f.is_path() && !f.target.ends_with(" (deleted)") && !replaced.contains(f.target.as_str()) {
                out.push((f.target.clone(), p.ns_pid));
            }
        }
    }
    out
}

pub fn restore(ctx: &Context, req: &RestoreRequest) -> Result<RestoreReport, RestoreError> {
    let started = Instant::now();
    if sys::geteuid() != 0 {
        return Err(RestoreError::NotRoot);
    }
    let image = Image::open(&req.image)?;
    ctx.phase("verifying every file of the image");
    // Device memory chunks are checked as they stream to the GPU.
    image.verify_except(Some(engine::agent::ENGINE))?;
    let verify = started.elapsed();

    for (path, pid) in required_files(&image) {
        if !Path::new(&path).exists() {
            return Err(RestoreError::MissingFile { path, pid });
        }
    }
    for section in &image.manifest.devices {
        let engine = engine::for_section(&ctx.engines, &section.engine).ok_or_else(|| RestoreError::EngineUnavailable { engine: section.engine.clone() })?;
        engine.check_restore(&section.state, &req.devices)?;
    }

    let registry = Registry::new(&ctx.state);
    let base = image.manifest.source.job.clone().unwrap_or_else(|| image.manifest.processes[0].comm.clone());
    let name = match &req.name {
        Some(n) => n.clone(),
        None => registry.free_name(&base),
    };
    let job_dir = registry.create_dir(&name)?;
    let result = restore_into_job(ctx, &image, &registry, &name, &job_dir, req, started, verify);
    if result.is_err() {
        let _ = registry.remove(&name);
    }
    result
}

#[allow(clippy::too_many_arguments)]
fn restore_into_job(
    ctx: &Context,
    image: &Image,
    registry: &Registry,
    name: &str,
    job_dir: &Path,
    req: &RestoreRequest,
    started: Instant,
    verify: Duration,
) -> Result<RestoreReport, RestoreError> {
    let (stdout, stderr) = registry.open_logs(name)?;
    let src = &image.manifest.source;
    let mut inherit: Vec<(String, i32)> = Vec::new();
    for (path, file) in [(&src.stdout, &stdout), (&src.stderr, &stderr)] {
        if let Some(p) = path {
            let key = p.trim_start_matches('/').to_string();
            if !inherit.iter().any(|(k, _)| *k == key) {
                inherit.push((key, file.as_raw_fd()));
            }
        }
    }
    let work = ctx.criu_work_dir("restore")?;
    let criu_dir = image.criu_dir();
    let criu_start = Instant::now();
    ctx.phase("restoring process state (CRIU)");
    let task = launch::RestoreTask {
        criu: ctx.criu.path().to_path_buf(),
        images_dir: criu_dir,
        work_dir: work.clone(),
        inherit,
        external_mounts: src.mount_namespace,
        isolate_net: req.isolate_net,
    };
    let root = match launch::spawn_shim(job_dir, &launch::ShimTask::Restore(task))? {
        Started::Running { pid } => pid,
        Started::Failed { message, hint, log } => {
            // The shim ran CRIU and reports its error as text; hints that need the image are made here.
            let e = crate::criu::CriuError::Reported { message, log: log.map(PathBuf::from) };
            let hint = hint.or_else(|| restore_hint(image, &e));
            return Err(RestoreError::Criu { message: e.to_string(), hint, log: e.log().map(|l| l.display().to_string()) });
        }
    };
    let criu = criu_start.elapsed();
    let _ = std::fs::remove_dir_all(&work);
    match finish_restored_tree(ctx, image, registry, name, req, root) {
        Ok((job, devices)) => Ok(RestoreReport { job, verify, criu, devices, total: started.elapsed() }),
        Err(e) => {
            // The tree cannot run without its device state or its record: stop all of it,
            // and let its shim record the exit before the job directory goes.
            stop_tree(root, image.manifest.source.pid_namespace);
            let start = Instant::now();
            while !registry.has_exit(name) && start.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e)
        }
    }
}

/// After CRIU restored the tree: device state, then the job record.
fn finish_restored_tree(
    ctx: &Context,
    image: &Image,
    registry: &Registry,
    name: &str,
    req: &RestoreRequest,
    root: i32,
) -> Result<(Job, Duration), RestoreError> {
    let devices_start = Instant::now();
    if !image.manifest.devices.is_empty() {
        ctx.phase("restoring GPU state");
        let tree = proctree::discover_tree(root)?;
        let pids: Vec<RestoredPid> = tree.iter().map(|p| RestoredPid { ns_pid: p.ns_pid, pid: p.pid }).collect();
        let mut opts = req.devices.clone();
        opts.image_dir = image.dir.clone();
        opts.checksums = image.manifest.files.iter().map(|f| (f.path.clone(), f.blake3.clone())).collect();
        // Engines that quiesced first (the agent, before the driver) resume last.
        for section in image.manifest.devices.iter().rev() {
            let engine = engine::for_section(&ctx.engines, &section.engine).expect("checked before restore");
            engine.restore(&section.state, &pids, &opts)?;
        }
    }
    let devices = devices_start.elapsed();
    let st = proctree::stat(root)?;
    let job = Job {
        name: name.to_string(),
        pid: root,
        start_time: st.start_time,
        command: image.manifest.processes[0].cmdline.clone(),
        created: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        restored_from: Some(image.dir.display().to_string()),
        checkpointed_to: None,
    };
    registry.save(&job)?;
    Ok((job, devices))
}

/// SIGKILLs a restored tree: its root, which takes a PID namespace down with it, or else
/// every process of it.
fn stop_tree(root: i32, pid_namespace: bool) {
    let pids = if pid_namespace { vec![root] } else { proctree::discover_tree(root).map(|t| t.iter().map(|p| p.pid).collect()).unwrap_or_else(|_| vec![root]) };
    for pid in pids {
        let _ = sys::kill(pid, libc::SIGKILL);
    }
}

fn restore_hint(image: &Image, e: &crate::criu::CriuError) -> Option<String> {
    let src = &image.manifest.source;
    if e.to_string().contains("Address already in use") {
        return Some(
            "a socket address of the image is taken, most likely by the original, which still runs; stop it first, or restore the copy with --isolate-net (its own network namespace, loopback only)"
                .into(),
        );
    }
    if !src.pid_namespace && e.to_string().contains("already") {
        return Some(format!("the process was not started by `hiber run`, so it must get its old PIDs back; stop the original (pid {}) first", src.pid));
    }
    e.log().map(|l| format!("CRIU's log: {}", l.display()))
}
