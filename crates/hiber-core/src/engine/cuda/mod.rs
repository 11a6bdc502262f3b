//! The driver engine: CUDA state through the driver's own checkpoint API
//! (`cuCheckpointProcess*`, driver 570+; GPU remapping needs CUDA 13.0 / driver 580).
//!
//! Checkpoint: lock every CUDA process of the tree in parallel (with a timeout), then
//! checkpoint them in parallel; the driver moves device memory into each process's host
//! memory and drops its device handles, so CRIU dumps it like any process. Restore: after
//! CRIU restored the tree, restore (optionally onto other GPUs) and unlock each process.
//! `resume` undoes whatever state a failed checkpoint left: CHECKPOINTED → restore →
//! LOCKED → unlock → RUNNING.
//!
//! No thread of a process but the driver's restore thread may run while its device state is
//! away: libcuda's own threads in an XLA process read device mappings on their own, and
//! died of SIGSEGV 1.6 to 6.6 s after the driver's checkpoint whenever the process ran
//! meanwhile (`bench/probes/jax_gap.sh`). With hiber's CRIU (scripts/criu-patches/0004), unless
//! `HIBER_DEVICE_IN_FREEZE=0`, the checkpoint is taken inside CRIU's freeze, with only the restore threads running
//! ([`CheckpointSession::checkpoint_frozen`]), and the state given back before CRIU lets a
//! tree that runs on go ([`CheckpointSession::resume_frozen`]), as CRIU's own CUDA plugin
//! does. Otherwise, or where the driver names no restore thread, the process is
//! checkpointed before the dump.

pub(crate) mod ffi;
pub(crate) mod gpumap;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use super::CuError;
use super::{CheckpointOptions, CheckpointSession, DeviceEngine, DeviceRestoreOptions, EngineError, EngineKind, RestoreSession, RestoredPid};
use crate::image::ImageSink;
use crate::proctree::ProcessInfo;
pub use ffi::{CuUuid, GpuPair};
pub use gpumap::{parse_gpu_map, resolve_gpu_map, visible_gpus, GpuMapError};
pub use hiber_cuda_sys::abi_layout;

pub const ENGINE: &str = "cuda";
/// The shape of [`Section`]; 1 since the first images.
const SECTION_VERSION: u32 = 1;
/// cuDriverGetVersion of the first driver with the checkpoint API (CUDA 12.8).
pub const MIN_DRIVER: i32 = 12080;
/// First driver whose restore takes GPU pairs (CUDA 13.0).
pub const REMAP_DRIVER: i32 = 13000;
const DEFAULT_LOCK_TIMEOUT_MS: u32 = 10_000;
/// Head-room kept free on a GPU beyond what the image's processes used.
const RESTORE_MARGIN_BYTES: u64 = 256 << 20;
/// `CUprocessState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessState {
    Running,
    Locked,
    Checkpointed,
    Failed,
    Unknown(i32),
}

impl From<i32> for ProcessState {
    fn from(v: i32) -> Self {
        match v {
            0 => ProcessState::Running,
            1 => ProcessState::Locked,
            2 => ProcessState::Checkpointed,
            3 => ProcessState::Failed,
            o => ProcessState::Unknown(o),
        }
    }
}

/// A GPU of this machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    pub index: u32,
    /// "GPU-xxxxxxxx-xxxx-...", as NVML and nvidia-smi print it.
    pub uuid: String,
    pub name: String,
    pub memory_total: u64,
    #[serde(default)]
    pub memory_free: u64,
}

/// The driver calls the engine makes: the seam that lets the engine's logic (ordering,
/// parallelism, rollback) be tested without a GPU.
pub trait CheckpointApi: Send + Sync {
    fn driver_version(&self) -> i32;
    fn state(&self, pid: i32) -> Result<ProcessState, CuError>;
    fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), CuError>;
    fn checkpoint(&self, pid: i32) -> Result<(), CuError>;
    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), CuError>;
    fn unlock(&self, pid: i32) -> Result<(), CuError>;
    /// GPUs with their processes' memory use: (host pid, bytes) per GPU.
    fn gpus(&self) -> Vec<(Gpu, Vec<(i32, u64)>)>;
    /// The thread that carries out the driver's restore in `pid`, where the driver says.
    fn restore_thread(&self, _pid: i32) -> Result<Option<i32>, CuError> {
        Ok(None)
    }
    /// Whether the process still exists (one that died mid-checkpoint needs no undo).
    fn alive(&self, pid: i32) -> bool {
        crate::proctree::alive(pid)
    }
}

struct RealApi {
    cuda: ffi::CudaLib,
    nvml: Option<ffi::Nvml>,
}

impl RealApi {
    fn err(&self, code: i32) -> CuError {
        CuError { code, name: self.cuda.error_name(code) }
    }
}

impl CheckpointApi for RealApi {
    fn driver_version(&self) -> i32 {
        self.cuda.driver_version()
    }
    fn state(&self, pid: i32) -> Result<ProcessState, CuError> {
        self.cuda.get_state(pid).map(ProcessState::from).map_err(|c| self.err(c))
    }
    fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), CuError> {
        self.cuda.lock(pid, timeout_ms).map_err(|c| self.err(c))
    }
    fn checkpoint(&self, pid: i32) -> Result<(), CuError> {
        self.cuda.checkpoint(pid).map_err(|c| self.err(c))
    }
    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), CuError> {
        self.cuda.restore(pid, pairs).map_err(|c| self.err(c))
    }
    fn unlock(&self, pid: i32) -> Result<(), CuError> {
        self.cuda.unlock(pid).map_err(|c| self.err(c))
    }
    fn restore_thread(&self, pid: i32) -> Result<Option<i32>, CuError> {
        self.cuda.restore_thread(pid).map_err(|c| self.err(c))
    }
    fn gpus(&self) -> Vec<(Gpu, Vec<(i32, u64)>)> {
        let Some(nvml) = &self.nvml else { return Vec::new() };
        nvml.gpus()
            .into_iter()
            .map(|g| {
                let procs = g.processes.iter().map(|&(p, b)| (p as i32, b)).collect();
                (Gpu { index: g.index, uuid: g.uuid, name: g.name, memory_total: g.memory.total, memory_free: g.memory.free }, procs)
            })
            .collect()
    }
}

/// This machine's GPUs as NVML lists them (empty without NVML).
pub fn nvml_gpus() -> Vec<Gpu> {
    let Some(nvml) = ffi::Nvml::load() else { return Vec::new() };
    nvml.gpus().into_iter().map(|g| Gpu { index: g.index, uuid: g.uuid, name: g.name, memory_total: g.memory.total, memory_free: g.memory.free }).collect()
}

/// What `hiber doctor` reports about the NVIDIA driver.
#[derive(Debug, Clone)]
pub struct Probe {
    pub driver: Option<i32>,
    pub driver_release: Option<String>,
    pub checkpoint_api: bool,
    pub gpus: Vec<Gpu>,
    pub problem: Option<String>,
}

impl Probe {
    pub fn summary(&self) -> String {
        match (&self.problem, self.driver) {
            (Some(p), _) => p.clone(),
            (None, Some(v)) => {
                let gpus: Vec<String> = self.gpus.iter().map(|g| format!("{}: {} {} ({} MiB)", g.index, g.name, g.uuid, g.memory_total >> 20)).collect();
                format!(
                    "driver {} (CUDA {}.{}), checkpoint API {}{}; {}",
                    self.driver_release.as_deref().unwrap_or("?"),
                    v / 1000,
                    (v % 1000) / 10,
                    if self.checkpoint_api { "present" } else { "absent (needs driver 570+)" },
                    if v >= REMAP_DRIVER { ", GPU remapping" } else { "" },
                    if gpus.is_empty() { "no GPUs listed".into() } else { gpus.join("; ") }
                )
            }
            (None, None) => "no NVIDIA driver".into(),
        }
    }
}

pub fn probe() -> Probe {
    let cuda = match ffi::CudaLib::load() {
        Ok(c) => c,
        Err(e) => {
            return Probe {
                driver: None,
                driver_release: None,
                checkpoint_api: false,
                gpus: Vec::new(),
                problem: Some(match e {
                    ffi::LoadError::NoLibrary(why) => format!("no NVIDIA driver ({why}); CPU checkpoints only"),
                    ffi::LoadError::MissingSymbol(s) => format!("libcuda.so.1 lacks {s}"),
                    ffi::LoadError::Init(r) => format!("libcuda.so.1 failed to initialize (CUresult {r}): no usable GPU?"),
                }),
            }
        }
    };
    let nvml = ffi::Nvml::load();
    let driver_release = nvml.as_ref().and_then(|n| n.driver_version());
    let checkpoint_api = cuda.has_checkpoint_api() && cuda.driver_version() >= MIN_DRIVER;
    let api = RealApi { cuda, nvml };
    Probe { driver: Some(api.driver_version()), driver_release, checkpoint_api, gpus: api.gpus().into_iter().map(|(g, _)| g).collect(), problem: None }
}

/// The driver engine as hiber knows it without loading libcuda.
pub struct Kind;
pub static KIND: Kind = Kind;

impl EngineKind for Kind {
    fn name(&self) -> &'static str {
        ENGINE
    }

    fn section_version(&self) -> u32 {
        SECTION_VERSION
    }

    fn load(&self) -> Option<Box<dyn DeviceEngine>> {
        DriverEngine::load().map(|e| Box::new(e) as Box<dyn DeviceEngine>)
    }

    fn describe(&self, section: &serde_json::Value) -> Vec<String> {
        describe(section)
    }

    fn unavailable_hint(&self) -> &'static str {
        "restore on a machine with an NVIDIA GPU and driver 570 or newer (`hiber doctor` says what this one has)"
    }
}

/// One CUDA process as recorded in an image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CudaProcess {
    /// PID inside the job's namespace: what the restored process will have.
    pub ns_pid: i32,
    pub pid: i32,
    pub comm: String,
    /// UUIDs of the GPUs where it held memory.
    pub gpus: Vec<String>,
    /// Device memory it held, per NVML, when checkpointed.
    pub memory_bytes: u64,
}

/// The engine's manifest section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Section {
    pub driver_version: i32,
    /// Every GPU of the machine at checkpoint time.
    pub gpus: Vec<Gpu>,
    pub processes: Vec<CudaProcess>,
    /// Seconds the driver took to checkpoint all of them.
    pub checkpoint_seconds: f64,
}

#[derive(Clone)]
pub struct DriverEngine {
    api: Arc<dyn CheckpointApi>,
    lock_timeout_ms: u32,
}

impl DriverEngine {
    /// The engine, when this machine has a driver with the checkpoint API.
    pub fn load() -> Option<DriverEngine> {
        let cuda = ffi::CudaLib::load().ok()?;
        if !cuda.has_checkpoint_api() || cuda.driver_version() < MIN_DRIVER {
            return None;
        }
        Some(DriverEngine::with_api(Arc::new(RealApi { cuda, nvml: ffi::Nvml::load() })))
    }

    pub fn with_api(api: Arc<dyn CheckpointApi>) -> DriverEngine {
        let lock_timeout_ms = std::env::var("HIBER_CUDA_LOCK_TIMEOUT_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_LOCK_TIMEOUT_MS);
        DriverEngine { api, lock_timeout_ms }
    }

    fn fail(message: String, hint: Option<&str>) -> EngineError {
        EngineError::failed(ENGINE, message, hint)
    }

    fn driver_fail(what: &str, pid: i32, e: &CuError) -> EngineError {
        let hint = match e.code {
            801 => "the driver cannot checkpoint something this process uses (managed/UVM memory, CUDA IPC, MPS or MIG); see `hiber doctor`",
            600 | 909 => "work already submitted to the GPU did not finish within the lock timeout; the process keeps running. Retry, or raise HIBER_CUDA_LOCK_TIMEOUT_MS",
            401 => "the process is in the wrong CUDA state for this step (another checkpoint under way? `hiber recover` undoes an interrupted one)",
            304 => "the driver could not reach the process (hiber must run as root, in the process's PID namespace or above)",
            2 => "not enough GPU memory",
            _ => "",
        };
        EngineError::Cuda {
            engine: ENGINE,
            what: format!("{what} of process {pid} failed"),
            result: e.clone(),
            hint: (!hint.is_empty()).then(|| hint.to_string()),
        }
    }

    /// `driver_fail`, unless the process is gone: the driver's error for it (it answers
    /// CUDA_ERROR_OPERATING_SYSTEM) would hide that it ended.
    fn step_fail(&self, what: &str, pid: i32, e: &CuError) -> EngineError {
        if self.api.alive(pid) {
            return Self::driver_fail(what, pid, e);
        }
        Self::fail(
            format!("process {pid} ended during the checkpoint (its driver {what} failed: {e})"),
            Some("the job's other processes are given back as they were, and no image is written; the job's launcher decides what follows"),
        )
    }

    /// Runs `f` for every pid on its own thread; all are attempted, the first error wins.
    fn parallel(&self, pids: &[i32], f: impl Fn(i32) -> Result<(), EngineError> + Sync) -> Result<(), EngineError> {
        let results: Vec<Result<(), EngineError>> = std::thread::scope(|s| {
            let handles: Vec<_> = pids
                .iter()
                .map(|&pid| {
                    let f = &f;
                    s.spawn(move || f(pid))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Self::fail("a driver call panicked".into(), None)))).collect()
        });
        results.into_iter().collect()
    }

    /// Brings one process from any state back to RUNNING.
    fn resume_one(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), EngineError> {
        let state = self.api.state(pid).map_err(|e| Self::driver_fail("state query", pid, &e))?;
        match state {
            ProcessState::Running => return Ok(()),
            ProcessState::Checkpointed => self.api.restore(pid, pairs).map_err(|e| Self::driver_fail("restore", pid, &e))?,
            ProcessState::Locked => {}
            other => return Err(Self::fail(format!("process {pid} is in CUDA state {other:?} and cannot be resumed"), None)),
        }
        self.api.unlock(pid).map_err(|e| Self::driver_fail("unlock", pid, &e))
    }

    /// Restores and unlocks a process that CRIU left stopped, with only the driver's restore
    /// thread running, as CRIU's own CUDA plugin does: until the driver has mapped the
    /// process's device and UVM memory again, any other thread that touches it would die
    /// of SIGSEGV (one of XLA's does, at once). A process that runs is resumed as it is.
    fn resume_restored(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), EngineError> {
        if !crate::proctree::is_stopped(pid) {
            return self.resume_one(pid, pairs);
        }
        // Where the driver names no restore thread, or it cannot be run alone, the process
        // is restored running, as before this was done (most programs touch no device
        // memory from a thread of their own while they wait for CUDA).
        let alone = match self.api.restore_thread(pid) {
            Ok(Some(tid)) => crate::sys::ptrace::RunningThread::start(tid).map_err(|e| format!("cannot run its restore thread {tid} alone: {e}")),
            Ok(None) => Err("the driver names no restore thread".to_string()),
            Err(e) => Err(format!("restore thread query: {e}")),
        };
        let running = match alone {
            Ok(r) => r,
            Err(why) => {
                tracing::warn!(pid, %why, "restoring the CUDA state of a running process");
                crate::sys::kill(pid, libc::SIGCONT).map_err(|e| Self::fail(format!("cannot continue process {pid}: {e}"), None))?;
                return self.resume_one(pid, pairs);
            }
        };
        let resumed = self.resume_one(pid, pairs);
        let stopped = running.stop();
        resumed?;
        stopped.map_err(|e| Self::fail(format!("cannot stop the driver's restore thread of process {pid} again: {e}"), None))
    }

    fn section(value: &serde_json::Value) -> Result<Section, EngineError> {
        serde_json::from_value(value.clone()).map_err(|e| Self::fail(format!("unreadable cuda section in the manifest: {e}"), None))
    }

    /// This machine's GPUs, and the user's map resolved against them (old UUID -> new;
    /// empty when the image's GPUs are used as they are).
    fn resolve(&self, section: &Section, opts: &DeviceRestoreOptions) -> Result<(Vec<Gpu>, BTreeMap<String, String>), EngineError> {
        let here: Vec<Gpu> = self.api.gpus().into_iter().map(|(g, _)| g).collect();
        let used: Vec<&str> = section.processes.iter().flat_map(|p| p.gpus.iter().map(String::as_str)).collect();
        let map = resolve_gpu_map(&opts.gpu_map, &section.gpus, &here, &used).map_err(|e| Self::fail(e.to_string(), e.hint()))?;
        Ok((here, map))
    }

    /// The driver's GPU pairs, from a resolved map: none for an empty map, else the whole
    /// permutation (see `gpumap::complete`), even for a process whose
    /// `CUDA_VISIBLE_DEVICES` hid some of the GPUs: driver 580 refuses the pairs of the GPUs
    /// such a process could see alone (CUDA_ERROR_INVALID_VALUE, for a job started with
    /// `CUDA_VISIBLE_DEVICES=1` and mapped 1=0 on 2×H200) and restores it with all of them.
    fn pairs(&self, map: &BTreeMap<String, String>) -> Result<Vec<GpuPair>, EngineError> {
        if map.is_empty() {
            return Ok(Vec::new());
        }
        if self.api.driver_version() < REMAP_DRIVER {
            return Err(Self::fail(
                format!("restoring onto other GPUs needs CUDA 13.0 (driver 580) or newer; this driver is {}", self.api.driver_version()),
                Some("restore without --gpu-map on the same GPUs, or upgrade the driver"),
            ));
        }
        map.iter()
            .map(|(old, new)| Ok(GpuPair { old_uuid: gpumap::uuid_bytes(old)?, new_uuid: gpumap::uuid_bytes(new)? }))
            .collect::<Result<_, GpuMapError>>()
            .map_err(|e| Self::fail(e.to_string(), None))
    }
}

impl DeviceEngine for DriverEngine {
    fn kind(&self) -> &'static dyn EngineKind {
        &KIND
    }

    fn begin_checkpoint(&self, tree: &[ProcessInfo], opts: CheckpointOptions) -> Result<Option<Box<dyn CheckpointSession>>, EngineError> {
        let mut pids = Vec::new();
        // Only processes that hold the NVIDIA device files can have CUDA state; asking the
        // driver about others costs time and answers nothing useful.
        for p in tree.iter().filter(|p| p.holds_device("/dev/nvidia")) {
            match self.api.state(p.pid) {
                Ok(ProcessState::Running) => pids.push(p.pid),
                Ok(state) => {
                    return Err(Self::fail(
                        format!("process {} ({}) is in CUDA state {:?}, not running", p.pid, p.comm, state),
                        Some("another checkpoint may be under way; `hiber recover` undoes an interrupted one"),
                    ))
                }
                // The driver does not know it as a CUDA process (NVML-only users, say).
                Err(e) => tracing::debug!(pid = p.pid, error = %e, "not a CUDA process"),
            }
        }
        if pids.is_empty() {
            return Ok(None);
        }
        // NVML lists a process on every GPU it has a context on.
        let mut gpus_of: BTreeMap<i32, usize> = BTreeMap::new();
        for (_, procs) in self.api.gpus() {
            for (pid, _) in procs.into_iter().filter(|(p, _)| pids.contains(p)) {
                *gpus_of.entry(pid).or_default() += 1;
            }
        }
        let several = gpus_of.into_iter().filter(|(_, n)| *n > 1).collect();
        Ok(Some(Box::new(DriverCheckpoint { engine: self.clone(), pids, several, in_freeze: opts.in_freeze, frozen: Vec::new(), section: None })))
    }

    fn recover(&self, pids: &[i32], _gone: &[i32], _dirs: &[&Path]) -> Result<(), EngineError> {
        self.parallel(pids, |pid| self.resume_one(pid, &[]))
    }

    fn begin_restore(&self, value: &serde_json::Value, opts: &DeviceRestoreOptions) -> Result<Box<dyn RestoreSession>, EngineError> {
        let section = Self::section(value)?;
        let (here, map) = self.resolve(&section, opts)?;
        let pairs = self.pairs(&map)?;
        // Memory each target GPU must take.
        let mut need: BTreeMap<String, u64> = BTreeMap::new();
        for p in &section.processes {
            for old in &p.gpus {
                let target = map.get(old).cloned().unwrap_or_else(|| old.clone());
                *need.entry(target).or_default() += p.memory_bytes / p.gpus.len().max(1) as u64;
            }
        }
        for (uuid, bytes) in need {
            let gpu = here.iter().find(|g| g.uuid == uuid).expect("resolve_gpu_map checked presence");
            if gpu.memory_free < bytes + RESTORE_MARGIN_BYTES {
                return Err(Self::fail(
                    format!(
                        "GPU {} ({}) has {} MiB free; the image needs {} MiB there",
                        gpu.index,
                        gpu.uuid,
                        gpu.memory_free >> 20,
                        (bytes + RESTORE_MARGIN_BYTES) >> 20
                    ),
                    Some("free GPU memory (stop other jobs) or map the GPUs elsewhere with --gpu-map OLD=NEW"),
                ));
            }
        }
        Ok(Box::new(DriverRestore { engine: self.clone(), section, pairs }))
    }
}

/// The driver's share of one checkpoint: the CUDA processes it claimed.
struct DriverCheckpoint {
    engine: DriverEngine,
    pids: Vec<i32>,
    /// Claimed processes on several GPUs, and on how many.
    several: Vec<(i32, usize)>,
    /// CRIU lets the checkpoint happen while it holds the tree.
    in_freeze: bool,
    /// The processes checkpointed inside CRIU's freeze, each with the driver's restore
    /// thread, which runs alone meanwhile.
    frozen: Vec<(i32, i32)>,
    /// The section as captured, for the time the checkpoint inside the freeze adds.
    section: Option<Section>,
}

impl CheckpointSession for DriverCheckpoint {
    fn pids(&self) -> &[i32] {
        &self.pids
    }

    fn releases_device_files(&self) -> bool {
        true
    }

    fn on_several_gpus(&self) -> Vec<(i32, usize)> {
        self.several.clone()
    }

    /// Locks every process in parallel: ranks that wait on each other must all be locked
    /// within one timeout.
    fn quiesce(&mut self, _sink: &dyn ImageSink, _peers: &dyn crate::coordinator::Coordinator) -> Result<(), EngineError> {
        let (e, timeout) = (&self.engine, self.engine.lock_timeout_ms);
        e.parallel(&self.pids, |pid| e.api.lock(pid, timeout).map_err(|err| e.step_fail("lock", pid, &err)))
    }

    fn capture(&mut self, tree: &[ProcessInfo]) -> Result<serde_json::Value, EngineError> {
        let e = &self.engine;
        // Ask NVML before the checkpoint releases the memory.
        let gpus = e.api.gpus();
        let mut per_pid: BTreeMap<i32, (Vec<String>, u64)> = BTreeMap::new();
        for (gpu, procs) in &gpus {
            for &(pid, bytes) in procs {
                let entry = per_pid.entry(pid).or_default();
                entry.0.push(gpu.uuid.clone());
                entry.1 += bytes;
            }
        }
        // With a CRIU that holds the tree for it, a process whose restore thread the driver
        // names is checkpointed inside the freeze (`checkpoint_frozen`); others now.
        if self.in_freeze {
            self.frozen = self
                .pids
                .iter()
                .filter_map(|&pid| match e.api.restore_thread(pid) {
                    Ok(Some(tid)) => Some((pid, tid)),
                    Ok(None) => None,
                    Err(err) => {
                        tracing::warn!(pid, error = %err, "restore thread query failed; checkpointing the process before the dump");
                        None
                    }
                })
                .collect();
        }
        let now: Vec<i32> = self.pids.iter().copied().filter(|p| !self.frozen.iter().any(|(f, _)| f == p)).collect();
        let start = Instant::now();
        e.parallel(&now, |pid| e.api.checkpoint(pid).map_err(|err| e.step_fail("checkpoint", pid, &err)))?;
        let checkpoint_seconds = start.elapsed().as_secs_f64();
        let processes = self
            .pids
            .iter()
            .map(|&pid| {
                let info = tree.iter().find(|p| p.pid == pid);
                let (gpus_used, memory_bytes) = per_pid.get(&pid).cloned().unwrap_or_default();
                CudaProcess {
                    ns_pid: info.map(|p| p.ns_pid).unwrap_or(pid),
                    pid,
                    comm: info.map(|p| p.comm.clone()).unwrap_or_default(),
                    gpus: gpus_used,
                    memory_bytes,
                }
            })
            .collect();
        let section = Section { driver_version: e.api.driver_version(), gpus: gpus.into_iter().map(|(g, _)| g).collect(), processes, checkpoint_seconds };
        let value = serde_json::to_value(&section).expect("section serializes");
        self.section = Some(section);
        Ok(value)
    }

    fn frozen_threads(&self) -> Vec<i32> {
        self.frozen.iter().map(|&(_, tid)| tid).collect()
    }

    fn checkpoint_frozen(&mut self) -> Result<Option<serde_json::Value>, EngineError> {
        if self.frozen.is_empty() {
            return Ok(None);
        }
        let e = &self.engine;
        let pids: Vec<i32> = self.frozen.iter().map(|&(pid, _)| pid).collect();
        let start = Instant::now();
        e.parallel(&pids, |pid| e.api.checkpoint(pid).map_err(|err| e.step_fail("checkpoint", pid, &err)))?;
        let Some(section) = self.section.as_mut() else { return Ok(None) };
        section.checkpoint_seconds += start.elapsed().as_secs_f64();
        Ok(Some(serde_json::to_value(&*section).expect("section serializes")))
    }

    /// Restores the device state, and leaves the processes locked as quiesce had them: the
    /// resume after CRIU unlocks them, and a dump made again (CRIU's staging area was too
    /// small) checkpoints them again.
    fn resume_frozen(&mut self) -> Result<(), EngineError> {
        let e = &self.engine;
        let alive: Vec<i32> = self.frozen.iter().map(|&(pid, _)| pid).filter(|&p| e.api.alive(p)).collect();
        e.parallel(&alive, |pid| match e.api.state(pid) {
            Ok(ProcessState::Checkpointed) => e.api.restore(pid, &[]).map_err(|err| e.step_fail("restore", pid, &err)),
            Ok(_) => Ok(()),
            Err(err) => Err(e.step_fail("state query", pid, &err)),
        })
    }

    fn resume(&mut self, _sink: &dyn ImageSink, _peers: &dyn crate::coordinator::Coordinator) -> Result<(), EngineError> {
        let e = &self.engine;
        // A process that died during the checkpoint has nothing left to undo.
        let alive: Vec<i32> = self.pids.iter().copied().filter(|&p| e.api.alive(p)).collect();
        e.parallel(&alive, |pid| e.resume_one(pid, &[]))
    }
}

/// The driver's share of one restore: the section, and the GPU pairs it was checked with
/// (the same for every process).
struct DriverRestore {
    engine: DriverEngine,
    section: Section,
    pairs: Vec<GpuPair>,
}

impl RestoreSession for DriverRestore {
    fn restore(&mut self, pids: &[RestoredPid], _peers: &dyn crate::coordinator::Coordinator) -> Result<(), EngineError> {
        let mut targets = Vec::new();
        for p in &self.section.processes {
            let now = pids
                .iter()
                .find(|r| r.ns_pid == p.ns_pid)
                .ok_or_else(|| DriverEngine::fail(format!("restored tree has no process with namespace PID {} ({})", p.ns_pid, p.comm), None))?;
            targets.push(now.pid);
        }
        let (e, pairs) = (&self.engine, &self.pairs);
        e.parallel(&targets, |pid| e.resume_restored(pid, pairs))
    }

    fn wants_stopped_tree(&self) -> bool {
        !self.section.processes.is_empty()
    }
}

/// Lines for `hiber inspect`; works without a driver.
pub fn describe(value: &serde_json::Value) -> Vec<String> {
    let Ok(s) = serde_json::from_value::<Section>(value.clone()) else { return vec!["(unreadable cuda section)".into()] };
    let mut out = vec![format!("driver CUDA {}.{}, device checkpoint {:.2}s", s.driver_version / 1000, (s.driver_version % 1000) / 10, s.checkpoint_seconds)];
    for g in &s.gpus {
        out.push(format!("gpu {}: {} {} ({} MiB)", g.index, g.name, g.uuid, g.memory_total >> 20));
    }
    for p in &s.processes {
        out.push(format!("process {} ({}): {} MiB of device memory on {}", p.ns_pid, p.comm, p.memory_bytes >> 20, p.gpus.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests;
