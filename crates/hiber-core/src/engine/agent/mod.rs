//! The agent engine: device memory moved by hiber itself, at PCIe speed, with the help of
//! the agent preloaded into the application (crate `hiber-agent`).
//!
//! Checkpoint, per process with an agent:
//! 1. **quiesce** — over the agent's control socket: the agent closes its gate (new CUDA
//!    work waits), waits for calls in flight, synchronizes its devices, and sends a file
//!    descriptor for every allocation it tracks. hiber imports each (a second reference to
//!    the same physical memory). Then, chunk by chunk, with `--leave-running` it copies the
//!    memory to where the application does not need it: hiber's own memory on the same GPU
//!    while that has room (device bandwidth), else a page-locked staging area in host
//!    memory, made ready before the quiesce (PCIe bandwidth); what fits in neither, and
//!    everything of a stopping checkpoint, is written to the image now. Only then does the
//!    agent unmap and release its references, keeping the address reservations, and close
//!    the connection. The driver engine then checkpoints the small remainder.
//! 2. **resume** (after the driver resumed the process): hiber hands each allocation back
//!    as a descriptor, the agent maps it at the same address and opens its gate.
//! 3. **finish** — the copies are written to the image after the application runs again.
//!
//! Restore creates memory on the target GPU, streams the chunks into it (checking each
//! chunk's checksum), and hands it to the restored agent the same way.
//!
//! hiber, not the agent, moves the data: the application gains no threads or pinned memory
//! for it, and device data never lands in the CRIU image. (The agent keeps one descriptor
//! per allocation hiber handed back, until the next checkpoint: see the agent's memory.rs.)

mod device;

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Instant;

use hiber_wire::{socket, Reply, Request, Status};
use serde::{Deserialize, Serialize};

use super::cuda::{self, ffi, Gpu};
use super::layer::Conn;
use super::{CheckpointOptions, CheckpointSession, CuError, DeviceEngine, DeviceRestoreOptions, EngineError, EngineKind, RestoreSession, RestoredPid};
use crate::image::{FileEntry, ImageSink};
use crate::proctree::ProcessInfo;
use device::{DeviceMem, Gpus, Place};
use ffi::Staging;

pub const ENGINE: &str = "agent";
/// The shape of [`Section`]: 1 for the first agent images; 2 added [`Mode::Staged`] and
/// [`Placed`] (images of version 1 read as before).
const SECTION_VERSION: u32 = 2;
const DEFAULT_QUIESCE_TIMEOUT_MS: u64 = 10_000;
/// Room left on a GPU beside hiber's copies, for the driver's own needs.
const SNAPSHOT_MARGIN: u64 = 1 << 30;
/// The granularity of hiber's device memory (cuMemCreate's on current GPUs).
const GRANULE: u64 = 2 << 20;
/// Host memory a staging area leaves to everything else: a tenth of the machine, and at
/// least this much.
const HOST_RESERVE_MIN: u64 = 2 << 30;

/// The agent as hiber knows it without loading libcuda.
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
        AgentEngine::load().map(|e| Box::new(e) as Box<dyn DeviceEngine>)
    }

    fn describe(&self, section: &serde_json::Value) -> Vec<String> {
        describe(section)
    }

    /// Preloads the agent into jobs on a machine with an NVIDIA GPU, when the library is
    /// beside the hiber binary (`HIBER_AGENT_LIB` overrides where).
    fn launch_env(&self, job_dir: &Path) -> Vec<(String, String)> {
        agent_env(job_dir).unwrap_or_default()
    }

    fn streamed_dir(&self) -> Option<&'static str> {
        Some(ENGINE)
    }

    fn unavailable_hint(&self) -> &'static str {
        "restore on a machine with an NVIDIA GPU and a driver with the VMM API (`hiber doctor` says what this one has)"
    }
}

/// The environment that preloads the agent, with a fresh token naming its socket.
fn agent_env(job_dir: &Path) -> Option<Vec<(String, String)>> {
    if !Path::new("/dev/nvidiactl").exists() {
        return None;
    }
    let lib = super::layer::library("HIBER_AGENT_LIB", "libhiber_agent.so")?;
    if !lib.exists() {
        tracing::warn!(lib = %lib.display(), "the agent library is missing; the job runs without the agent (GPU memory goes the driver's slower way)");
        return None;
    }
    let token = super::layer::token()?;
    Some(vec![
        super::layer::preload(&lib),
        (hiber_wire::TOKEN_ENV.into(), token),
        (hiber_wire::LOG_ENV.into(), job_dir.join("agent.log").display().to_string()),
    ])
}

/// How the device memory reached the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Copied on the GPU and written after the application resumed.
    DeviceSnapshot,
    /// Written before the agent released the memory.
    Direct,
    /// Copied on the GPU where it had room and to page-locked host memory for the rest
    /// (and written before the release where neither had room), then written after the
    /// application resumed: [`Section::placed`] says how much went where.
    Staged,
}

impl Mode {
    /// The mode that names where the bytes went.
    fn of(p: &Placed) -> Mode {
        match (p.device, p.host, p.direct) {
            (_, 0, 0) if p.device > 0 => Mode::DeviceSnapshot,
            (0, 0, _) => Mode::Direct,
            _ => Mode::Staged,
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::DeviceSnapshot => "device-snapshot",
            Mode::Direct => "direct",
            Mode::Staged => "staged",
        })
    }
}

/// Device bytes by where they were while the application was stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placed {
    /// Copied to hiber's memory on the same GPU.
    pub device: u64,
    /// Copied to the page-locked staging area in host memory.
    pub host: u64,
    /// Written to the image before the release.
    pub direct: u64,
}

impl Placed {
    fn add(&mut self, o: &Placed) {
        self.device += o.device;
        self.host += o.host;
        self.direct += o.direct;
    }
}

/// What the agent of one process tracked and left to the driver.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Passthrough {
    pub calls: u64,
    pub bytes: u64,
    pub kinds: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Allocation {
    pub id: u64,
    pub size: u64,
    pub gpu: String,
    pub files: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentProcess {
    pub ns_pid: i32,
    pub comm: String,
    /// Device bytes the agent handed to hiber.
    pub bytes: u64,
    pub allocations: Vec<Allocation>,
    pub passthrough: Passthrough,
}

/// The engine's manifest section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Section {
    pub mode: Mode,
    pub chunk_bytes: u64,
    pub gpus: Vec<Gpu>,
    pub processes: Vec<AgentProcess>,
    /// Quiesce and handover, all processes.
    pub quiesce_seconds: f64,
    /// Copies (device and host) and chunks written before the release.
    pub copy_seconds: f64,
    /// Where the bytes went (absent in version 1 sections).
    #[serde(default)]
    pub placed: Placed,
    /// Making the staging area ready in host memory, while the application still ran.
    #[serde(default)]
    pub staging_seconds: f64,
}

/// Where allocation `id` of the process with namespace PID `ns_pid` lives in an image: its
/// chunk files are this prefix plus `.NNNNN`.
pub fn chunk_prefix(ns_pid: i32, id: u64) -> String {
    format!("{ENGINE}/{ns_pid}/{id}")
}

fn passthrough(s: &Status) -> Passthrough {
    let kinds = [("small", s.small), ("pitch", s.pitch), ("async", s.stream_ordered), ("managed", s.managed), ("vmm_not_exportable", s.vmm_not_exportable)];
    Passthrough {
        calls: s.passthrough_calls,
        bytes: s.passthrough_bytes,
        kinds: kinds.into_iter().filter(|(_, n)| *n > 0).map(|(k, n)| (k.to_string(), n)).collect(),
    }
}

/// A process with an agent, found when a checkpoint opens.
#[derive(Debug, Clone)]
struct Target {
    pid: i32,
    name: String,
    ns_pid: i32,
    comm: String,
    status: Status,
}

/// What hiber took from one process.
struct Taken {
    held: Vec<Held>,
    /// Chunks written before the release.
    written: Vec<FileEntry>,
    copies: Copies,
    placed: Placed,
}

/// Chunks copied to hiber's device memory (`arenas`) or to the staging area, to be written
/// once the application runs again.
#[derive(Default)]
struct Copies {
    chunks: Vec<device::Chunk>,
    arenas: Vec<DeviceMem>,
}

/// One allocation hiber holds during a checkpoint.
struct Held {
    id: u64,
    /// The descriptor the agent sent: given back as it is.
    fd: OwnedFd,
    mem: DeviceMem,
    gpu: String,
}

pub struct AgentEngine {
    gpus: Arc<Gpus>,
    timeout_ms: u64,
}

fn fail(message: impl Into<String>, hint: Option<&str>) -> EngineError {
    EngineError::failed(ENGINE, message, hint)
}

fn cuda_fail(gpus: &Gpus, what: &str, code: ffi::CuResult) -> EngineError {
    EngineError::Cuda { engine: ENGINE, what: what.into(), result: CuError { code, name: gpus.cuda.error_name(code) }, hint: None }
}

/// What a process shares with other processes or GPUs, as its agent counted it: state no
/// checkpoint of one process can take (and the driver cannot always undo its checkpoint of).
fn shared_state(s: &Status) -> Option<String> {
    if s.ipc_imports > 0 {
        Some(format!("has {} allocations of another process open through CUDA IPC (cuIpcOpenMemHandle)", s.ipc_imports))
    } else if s.shared_imports > 0 {
        Some(format!("imported {} allocations of another process (cuMemImportFromShareableHandle)", s.shared_imports))
    } else {
        // Peer access within the process (which PyTorch enables for copies between GPUs)
        // is the process's own state; it is counted, not refused.
        None
    }
}

/// The agent token in a process's environment, as `hiber run` set it.
fn agent_token(pid: i32) -> Option<String> {
    crate::proctree::env_var(pid, hiber_wire::TOKEN_ENV)
}

/// A control connection to the agent of host process `pid`.
fn connect(pid: i32, name: &str) -> Result<Conn, EngineError> {
    Conn::open(ENGINE, "agent", ("device work still running after the timeout", "retry later, or raise HIBER_AGENT_QUIESCE_TIMEOUT_MS"), pid, name)
}

/// Hands `held` back over `conn` and opens the agent's gate.
fn give_back_on(conn: &Conn, held: &[Held]) -> Result<(), EngineError> {
    for h in held {
        conn.call::<Reply>(&Request::Load { id: h.id }, Some(&h.fd))?;
    }
    conn.call::<Reply>(&Request::Resume, None).map(|_| ())
}

/// Hands `held` back to the agent of `pid` and opens its gate.
fn give_back(pid: i32, name: &str, held: &[Held]) -> Result<(), EngineError> {
    give_back_on(&connect(pid, name)?, held)
}

impl AgentEngine {
    /// The engine, when libcuda with the VMM API is here.
    pub fn load() -> Option<AgentEngine> {
        let lib = ffi::CudaLib::load().ok()?;
        // One timeout for "work in flight must finish": the agent's own, else the driver lock's.
        let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse().ok());
        let timeout_ms = env("HIBER_AGENT_QUIESCE_TIMEOUT_MS").or_else(|| env("HIBER_CUDA_LOCK_TIMEOUT_MS")).unwrap_or(DEFAULT_QUIESCE_TIMEOUT_MS);
        Some(AgentEngine { gpus: Arc::new(Gpus::new(lib)), timeout_ms })
    }

    /// After a hiber died mid-checkpoint: whatever the agent of `pid` released is loaded
    /// back from the chunks that hiber wrote before it let the agent release (direct mode
    /// always writes first), and the gate opens.
    fn recover_one(&self, pid: i32, dirs: &[&Path]) -> Result<(), EngineError> {
        let Some(name) = recovered_name(pid) else { return Ok(()) };
        // No agent answering: it never started (no CUDA), so there is nothing to undo.
        let Ok(conn) = connect(pid, &name) else { return Ok(()) };
        let ns_pid = crate::proctree::read_process(pid).map(|p| p.ns_pid).unwrap_or(pid);
        conn.send(&Request::List, None)?;
        let mut released = Vec::new();
        loop {
            match conn.recv::<Reply>()?.0 {
                Reply::Evacuated { id, size, gpu } => released.push((id, size, gpu)),
                Reply::Done { .. } => break,
                other => return Err(fail(format!("agent of process {pid}: unexpected {other:?}"), None)),
            }
        }
        for (id, size, gpu) in released {
            let prefix = chunk_prefix(ns_pid, id);
            let dir = dirs.iter().find(|d| d.join(format!("{prefix}.00000")).exists()).ok_or_else(|| {
                fail(
                    format!("the device memory of process {pid} (allocation {id}, {} MiB) was only in the hiber that died; it is lost", size >> 20),
                    Some("the application cannot continue on the GPU; stop it and restore an earlier image"),
                )
            })?;
            // A finished image has checksums for the chunks; a partial one does not yet.
            let image = crate::image::Image::open(dir).ok();
            let sums: Option<HashMap<String, String>> = image.map(|i| i.manifest.files.iter().map(|f| (f.path.clone(), f.blake3.clone())).collect());
            let dev = self.gpus.ordinal(&gpu).map_err(|e| cuda_fail(&self.gpus, "listing GPUs", e))?.ok_or_else(|| fail(format!("no GPU {gpu} here"), None))?;
            let mem = DeviceMem::create(&self.gpus, size, dev, true).map_err(|e| cuda_fail(&self.gpus, "allocating device memory", e))?;
            device::load(&self.gpus, &[(&mem, prefix)], dir, sums.as_ref(), None).map_err(|e| fail(format!("loading device memory back: {e}"), None))?;
            let fd = mem.export_fd().map_err(|e| cuda_fail(&self.gpus, "exporting device memory", e))?;
            conn.call::<Reply>(&Request::Load { id }, Some(&fd))?;
        }
        conn.call::<Reply>(&Request::Resume, None).map(|_| ())
    }
}

impl DeviceEngine for AgentEngine {
    fn kind(&self) -> &'static dyn EngineKind {
        &KIND
    }

    fn begin_checkpoint(&self, tree: &[ProcessInfo], opts: CheckpointOptions) -> Result<Option<Box<dyn CheckpointSession>>, EngineError> {
        let mut targets = Vec::new();
        for p in tree.iter().filter(|p| p.holds_device("/dev/nvidia")) {
            let Some(token) = agent_token(p.pid) else { continue };
            let name = hiber_wire::socket_name(&token, p.ns_pid);
            let status = match connect(p.pid, &name).and_then(|c| c.call::<Reply>(&Request::Status, None)) {
                Ok(Reply::Status(s)) => s,
                Ok(_) | Err(_) => {
                    tracing::debug!(pid = p.pid, "no agent answers; the driver engine covers it");
                    continue;
                }
            };
            if status.gate_closed || status.evacuated > 0 {
                return Err(fail(
                    format!("the agent of process {} ({}) is in the middle of a checkpoint", p.pid, p.comm),
                    Some("another checkpoint may be under way; `hiber recover` undoes an interrupted one"),
                ));
            }
            if let Some(what) = shared_state(&status) {
                return Err(fail(
                    format!("process {} ({}) {what}, which the driver cannot checkpoint", p.pid, p.comm),
                    Some("jobs whose processes share GPU memory (torch.multiprocessing CUDA tensors, NCCL) cannot be checkpointed yet"),
                ));
            }
            targets.push(Target { pid: p.pid, name, ns_pid: p.ns_pid, comm: p.comm.clone(), status });
        }
        if targets.is_empty() {
            return Ok(None);
        }
        let pids = targets.iter().map(|t| t.pid).collect();
        Ok(Some(Box::new(AgentCheckpoint {
            gpus: self.gpus.clone(),
            timeout_ms: self.timeout_ms,
            opts,
            pids,
            targets,
            held: HashMap::new(),
            saving: Mutex::new(()),
            device_room: Mutex::new(HashMap::new()),
            staging: None,
            host_used: AtomicUsize::new(0),
            copies: HashMap::new(),
            pending: Copies::default(),
            written: Vec::new(),
            section: None,
        })))
    }

    fn recover(&self, pids: &[i32], dirs: &[&Path]) -> Result<(), EngineError> {
        super::layer::each(pids, |pid| self.recover_one(pid, dirs))
    }

    fn begin_restore(&self, value: &serde_json::Value, opts: &DeviceRestoreOptions) -> Result<Box<dyn RestoreSession>, EngineError> {
        let section = section(value)?;
        let here = cuda::nvml_gpus();
        let map = gpu_map(&section, &here, opts)?;
        let mut need: BTreeMap<String, u64> = BTreeMap::new();
        for a in section.processes.iter().flat_map(|p| &p.allocations) {
            *need.entry(map.get(&a.gpu).cloned().unwrap_or_else(|| a.gpu.clone())).or_default() += a.size;
        }
        for (uuid, bytes) in need {
            let Some(g) = here.iter().find(|g| g.uuid == uuid) else { continue };
            if g.memory_free < bytes {
                return Err(fail(
                    format!(
                        "GPU {} ({}) has {} MiB free; the agent's share of the image needs {} MiB there",
                        g.index,
                        g.uuid,
                        g.memory_free >> 20,
                        bytes >> 20
                    ),
                    Some("free GPU memory (stop other jobs) or map the GPUs elsewhere with --gpu-map OLD=NEW"),
                ));
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let loader = Loader {
            gpus: self.gpus.clone(),
            section: section.clone(),
            map,
            image_dir: opts.image_dir.clone(),
            checksums: opts.checksums.clone(),
            stop: stop.clone(),
        };
        // The device memory is loaded while CRIU restores the processes.
        let loading = std::thread::Builder::new()
            .name("hiber-agent-load".into())
            .spawn(move || loader.run())
            .map_err(|e| fail(format!("starting the device memory loader: {e}"), None))?;
        Ok(Box::new(AgentRestore { gpus: self.gpus.clone(), section, loading: Some(loading), stop }))
    }
}

/// The agent's share of one checkpoint: the processes it claimed and the memory hiber
/// holds for them until it hands it back.
struct AgentCheckpoint {
    /// Before `gpus`: the staging area is unregistered while the library is surely loaded.
    staging: Option<Staging>,
    gpus: Arc<Gpus>,
    timeout_ms: u64,
    opts: CheckpointOptions,
    pids: Vec<i32>,
    targets: Vec<Target>,
    held: HashMap<i32, Vec<Held>>,
    /// Held while a process's memory is written: one at a time.
    saving: Mutex<()>,
    /// Bytes each GPU can still take of hiber's copies (`--leave-running` only).
    device_room: Mutex<HashMap<i32, u64>>,
    /// Bytes of the staging area handed out.
    host_used: AtomicUsize,
    /// Copies by process, until it runs again.
    copies: HashMap<i32, Copies>,
    /// Copies whose processes run again, waiting for `finish`.
    pending: Copies,
    written: Vec<FileEntry>,
    section: Option<Section>,
}

impl AgentCheckpoint {
    /// Quiesces one process and takes its memory; on error the process is as before.
    /// On error, what hiber still holds and could not hand back at once comes with it, for
    /// [`CheckpointSession::resume`] to hand back (or save for `hiber recover`).
    fn take(&self, t: &Target, sink: &dyn ImageSink) -> Result<Taken, (EngineError, Vec<Held>)> {
        let pid = t.pid;
        let conn = connect(pid, &t.name).map_err(|e| (e, Vec::new()))?;
        // The agent bounds its wait for calls in flight; a kernel still running when it
        // synchronizes is bounded here. Timing out closes the connection, and the agent,
        // finding no one to hand its memory to, opens its gate again.
        let _ = socket::set_recv_timeout(&conn.sock, Some(std::time::Duration::from_millis(self.timeout_ms + 500)));
        conn.send(&Request::Quiesce { timeout_ms: self.timeout_ms }, None).map_err(|e| (e, Vec::new()))?;
        let mut held = Vec::new();
        let mut timed_out = false;
        let taken = (|| {
            loop {
                let msg = conn.recv::<Reply>().inspect_err(|_| timed_out = true)?;
                match msg {
                    (Reply::Alloc { id, size, .. }, Some(fd)) => {
                        let mem =
                            DeviceMem::import(&self.gpus, fd.as_fd(), size).map_err(|e| cuda_fail(&self.gpus, "importing device memory from the agent", e))?;
                        let gpu = self.gpus.uuid(mem.dev).map_err(|e| cuda_fail(&self.gpus, "device UUID", e))?;
                        held.push(Held { id, fd, mem, gpu });
                    }
                    (Reply::Done { count }, _) if count == held.len() as u64 => break,
                    (Reply::Err(m), _) => {
                        return Err(fail(
                            format!("agent of process {pid} could not quiesce: {m}"),
                            Some("the application keeps running; retry, or raise HIBER_AGENT_QUIESCE_TIMEOUT_MS"),
                        ))
                    }
                    (other, _) => return Err(fail(format!("agent of process {pid}: unexpected {other:?}"), None)),
                }
            }
            let _ = socket::set_recv_timeout(&conn.sock, None);
            let quiesced = Instant::now();
            let mems: Vec<(&DeviceMem, String)> = held.iter().map(|h| (&h.mem, chunk_prefix(t.ns_pid, h.id))).collect();
            let all = device::chunks(&mems);
            let (copies, direct, placed) = if self.opts.leave_running { self.place(all)? } else { (Copies::default(), all, Placed::default()) };
            let mut placed = placed;
            placed.direct = direct.iter().map(|c| c.len as u64).sum();
            let copied = Instant::now();
            let written = if direct.is_empty() {
                Vec::new()
            } else {
                // One process's memory at a time: each save runs its own pinned buffers and
                // workers, and the disk is the limit anyway.
                let _one = self.saving.lock().unwrap_or_else(|e| e.into_inner());
                device::save(&self.gpus, &direct, None, sink).map_err(|e| fail(format!("writing device memory: {e}"), None))?
            };
            tracing::info!(
                pid,
                device_mib = placed.device >> 20,
                host_mib = placed.host >> 20,
                direct_mib = placed.direct >> 20,
                copy_s = (copied - quiesced).as_secs_f64(),
                direct_s = copied.elapsed().as_secs_f64(),
                "device memory taken"
            );
            conn.call::<Reply>(&Request::Release, None)?;
            conn.wait_closed();
            Ok((written, copies, placed))
        })();
        match taken {
            Ok((written, copies, placed)) => Ok(Taken { held, written, copies, placed }),
            // After a timeout the agent is still busy and released nothing: it opens its
            // gate itself once it finds the connection closed, and hiber's references go.
            Err(e) if timed_out => Err((e, Vec::new())),
            // Otherwise the agent gets back whatever it released and opens its gate; if
            // even that fails, the memory stays with the session for resume.
            Err(e) => match give_back_on(&conn, &held) {
                Ok(()) => Err((e, Vec::new())),
                Err(_) => Err((e, held)),
            },
        }
    }
}

impl AgentCheckpoint {
    /// Copies each chunk of `all` (a process's memory, on its GPUs) to hiber's memory on
    /// the same GPU while that has room, else to the staging area while that has room.
    /// Returns the copies, the chunks that fit in neither (to be written before the
    /// release), and the bytes copied each way.
    fn place(&self, all: Vec<device::Chunk>) -> Result<(Copies, Vec<device::Chunk>, Placed), EngineError> {
        let mut want: BTreeMap<i32, u64> = BTreeMap::new();
        for c in &all {
            if let Place::Gpu { dev, .. } = c.at {
                *want.entry(dev).or_default() += c.len as u64;
            }
        }
        // One arena per GPU, as large as this process needs and the GPU's room allows.
        let mut arenas: Vec<DeviceMem> = Vec::new();
        let mut next: HashMap<i32, (usize, u64)> = HashMap::new();
        for (dev, bytes) in want {
            let take = {
                let mut room = self.device_room.lock().unwrap_or_else(|e| e.into_inner());
                let r = room.entry(dev).or_default();
                let take = (*r).min(bytes.next_multiple_of(GRANULE)) / GRANULE * GRANULE;
                *r -= take;
                take
            };
            if take == 0 {
                continue;
            }
            match DeviceMem::create(&self.gpus, take, dev, false) {
                Ok(m) => {
                    next.insert(dev, (arenas.len(), 0));
                    arenas.push(m);
                }
                // The GPU's free memory shrank since it was measured: the host takes it.
                Err(e) => tracing::debug!(dev, bytes = take, error = %self.gpus.cuda.error_name(e), "no copy on the GPU"),
            }
        }
        let host_len = self.staging.as_ref().map_or(0, |s| s.size());
        let (mut from, mut to, mut direct) = (Vec::new(), Vec::new(), Vec::new());
        let mut placed = Placed::default();
        for c in all {
            let Place::Gpu { dev, .. } = c.at else { continue };
            let len = c.len as u64;
            if let Some((i, used)) = next.get_mut(&dev).filter(|(i, used)| *used + len <= arenas[*i].size) {
                to.push(Place::Gpu { dev, va: arenas[*i].va + *used });
                *used += len;
                placed.device += len;
                from.push(c);
                continue;
            }
            let span = c.len.next_multiple_of(4096);
            match self.host_used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| (u + span <= host_len).then_some(u + span)) {
                Ok(off) => {
                    to.push(Place::Host { off });
                    placed.host += len;
                    from.push(c);
                }
                Err(_) => direct.push(c),
            }
        }
        device::stage(&self.gpus, &from, &to, self.staging.as_ref()).map_err(|e| fail(format!("copying device memory: {e}"), None))?;
        let chunks = from.into_iter().zip(to).map(|(c, at)| device::Chunk { at, ..c }).collect();
        Ok((Copies { chunks, arenas }, direct, placed))
    }

    /// Makes room for the copies a `--leave-running` checkpoint makes: measures each GPU's
    /// room, and when the GPUs lack room for all of `total` device bytes, prepares a
    /// page-locked staging area in host memory for the rest (while the application still
    /// runs: it takes about 0.07 s per GiB). Host memory too small is said, and what fits
    /// in neither is written before the release, as a stopping checkpoint does.
    fn prepare_copies(&mut self, total: u64, pids: &[i32]) {
        let mut room = HashMap::new();
        for d in 0..self.gpus.cuda.device_count().unwrap_or(0) {
            room.insert(d, self.gpus.free_bytes(d).map_or(0, |f| f.saturating_sub(SNAPSHOT_MARGIN)));
        }
        let need = host_need(total, &room, self.held_by_gpu(pids).as_ref());
        *self.device_room.lock().unwrap_or_else(|e| e.into_inner()) = room;
        if need == 0 {
            return;
        }
        let budget = match crate::sys::host_memory() {
            Ok((available, all)) => available
                .saturating_sub((all / 10).max(HOST_RESERVE_MIN))
                .min(crate::sys::cgroup_memory_left().unwrap_or(u64::MAX).saturating_sub(HOST_RESERVE_MIN)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the host's free memory; device memory without room on the GPU is written before the job resumes");
                0
            }
        };
        // `HIBER_HOST_STAGING_MIB` caps the staging area (0: none), for a host whose memory
        // is meant for other things.
        let cap = std::env::var("HIBER_HOST_STAGING_MIB").ok().and_then(|v| v.parse::<u64>().ok()).map_or(u64::MAX, |mib| mib.saturating_mul(1 << 20));
        let len = need.min(budget / device::CHUNK * device::CHUNK).min(cap);
        if len < need && cap == u64::MAX {
            tracing::warn!(
                "host memory is too small to stage {} MiB of device memory ({} MiB can be spared); the rest is written to the image before the job resumes",
                need >> 20,
                len >> 20
            );
        }
        if len == 0 {
            return;
        }
        let start = Instant::now();
        let threads = std::thread::available_parallelism().map_or(8, |n| n.get()).min(16);
        match self.gpus.cuda.staging(len as usize, threads) {
            Ok(s) => {
                tracing::info!(mib = len >> 20, seconds = start.elapsed().as_secs_f64(), "host staging area ready");
                self.staging = Some(s);
            }
            Err(e) => tracing::warn!("no staging area in host memory ({e}); device memory without room on the GPU is written before the job resumes"),
        }
    }
}

impl AgentCheckpoint {
    /// Device memory the processes `pids` hold on each GPU (by CUDA ordinal), as NVML
    /// accounts it; `None` where NVML cannot say.
    fn held_by_gpu(&self, pids: &[i32]) -> Option<HashMap<i32, u64>> {
        let nvml = ffi::Nvml::load()?;
        let gpus = nvml.gpus();
        let mut out = HashMap::new();
        for d in 0..self.gpus.cuda.device_count().ok()? {
            let uuid = self.gpus.uuid(d).ok()?;
            let g = gpus.iter().find(|g| g.uuid == uuid)?;
            // NVML answers u64::MAX where it cannot account a process's memory.
            let held: u64 = g.processes.iter().filter(|(pid, _)| pids.contains(&(*pid as i32))).map(|(_, bytes)| *bytes).filter(|&b| b != u64::MAX).sum();
            out.insert(d, held);
        }
        out.values().any(|&b| b > 0).then_some(out)
    }

    /// Takes the staging area down with a context current (the driver unregisters host
    /// memory in one), before the memory goes.
    fn drop_staging(&mut self) {
        if let Some(s) = self.staging.take() {
            let _ = self.gpus.enter(0);
            drop(s);
        }
    }
}

impl Drop for AgentCheckpoint {
    fn drop(&mut self) {
        self.drop_staging();
    }
}

/// Bytes of host staging a `--leave-running` checkpoint needs, in whole chunks: on each GPU,
/// what the job holds there beyond the GPU's `room` for hiber's copies, plus a chunk (chunks
/// are placed whole, so a GPU's copy may leave up to one unused). `held` is what the job's
/// processes hold on each GPU; without it, the job's `total` is set against the GPU with
/// the most room (more than needed when the job spans GPUs, never less).
fn host_need(total: u64, room: &HashMap<i32, u64>, held: Option<&HashMap<i32, u64>>) -> u64 {
    let over = |bytes: u64, room: u64| match bytes.saturating_sub(room) {
        0 => 0,
        n => n + device::CHUNK,
    };
    let need = match held {
        Some(held) => held.iter().map(|(d, &bytes)| over(bytes, room.get(d).copied().unwrap_or(0))).sum(),
        None => over(total, room.values().copied().max().unwrap_or(0)),
    };
    need.next_multiple_of(device::CHUNK)
}

impl CheckpointSession for AgentCheckpoint {
    fn pids(&self) -> &[i32] {
        &self.pids
    }

    fn quiesce(&mut self, sink: &dyn ImageSink) -> Result<(), EngineError> {
        // hiber holds one descriptor per allocation (PyTorch's expandable segments make
        // hundreds). Raised here, not at load, so that jobs hiber starts keep their limit.
        crate::sys::raise_open_files_limit();
        let staging_start = Instant::now();
        let busy: Vec<Target> = self.targets.iter().filter(|t| t.status.tracked > 0).cloned().collect();
        // Copies let the application run again before the data reaches the disk.
        if self.opts.leave_running {
            let pids: Vec<i32> = busy.iter().map(|t| t.pid).collect();
            self.prepare_copies(busy.iter().map(|t| t.status.tracked_bytes).sum(), &pids);
        }
        let staging_seconds = staging_start.elapsed().as_secs_f64();
        let start = Instant::now();
        // The processes of a job are quiesced together: ranks that wait on each other
        // must all stop at once, and the copies overlap.
        let results: Vec<Result<Taken, (EngineError, Vec<Held>)>> = std::thread::scope(|s| {
            let this = &*self;
            let handles: Vec<_> = busy.iter().map(|t| s.spawn(move || this.take(t, sink))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err((fail("a quiesce thread panicked", None), Vec::new())))).collect()
        });
        let mut done = Vec::new();
        let mut first_error = None;
        for (t, r) in busy.iter().zip(results) {
            match r {
                Ok(taken) => done.push((t.pid, taken)),
                Err((e, kept)) => {
                    if !kept.is_empty() {
                        self.held.insert(t.pid, kept);
                    }
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            // The processes that were quiesced are resumed by the undo that follows, which
            // hands their memory back, or saves it for `hiber recover` if it cannot.
            for (pid, taken) in done {
                self.held.insert(pid, taken.held);
                self.copies.insert(pid, taken.copies);
            }
            return Err(e);
        }
        let copy_seconds = start.elapsed().as_secs_f64();
        let mut processes = Vec::new();
        let mut placed = Placed::default();
        for t in &self.targets {
            let Some((_, Taken { held, written, copies, placed: p })) = done.iter_mut().find(|(pid, _)| *pid == t.pid) else {
                // An agent that tracked nothing: recorded for what it left to the driver.
                processes.push(AgentProcess { ns_pid: t.ns_pid, comm: t.comm.clone(), bytes: 0, allocations: Vec::new(), passthrough: passthrough(&t.status) });
                continue;
            };
            self.written.append(written);
            processes.push(AgentProcess {
                ns_pid: t.ns_pid,
                comm: t.comm.clone(),
                bytes: held.iter().map(|h| h.mem.size).sum(),
                allocations: held
                    .iter()
                    .map(|h| Allocation {
                        id: h.id,
                        size: h.mem.size,
                        gpu: h.gpu.clone(),
                        files: device::chunk_files(&chunk_prefix(t.ns_pid, h.id), h.mem.size),
                    })
                    .collect(),
                passthrough: passthrough(&t.status),
            });
            self.held.insert(t.pid, std::mem::take(held));
            self.copies.insert(t.pid, std::mem::take(copies));
            placed.add(p);
        }
        self.section = Some(Section {
            mode: Mode::of(&placed),
            chunk_bytes: device::CHUNK,
            gpus: cuda::nvml_gpus(),
            processes,
            quiesce_seconds: start.elapsed().as_secs_f64(),
            copy_seconds,
            placed,
            staging_seconds,
        });
        Ok(())
    }

    fn capture(&mut self, _tree: &[ProcessInfo]) -> Result<serde_json::Value, EngineError> {
        let section = self.section.as_ref().ok_or_else(|| fail("capture before quiesce", None))?;
        Ok(serde_json::to_value(section).expect("section serializes"))
    }

    fn resume(&mut self, sink: &dyn ImageSink) -> Result<(), EngineError> {
        let mut first = None;
        for t in &self.targets {
            if !crate::proctree::exists(t.pid) {
                // It died during the checkpoint: nothing to hand back to, nothing to undo.
                // Its copies are still written: the image holds the memory it had.
                self.held.remove(&t.pid);
                if let Some(c) = self.copies.remove(&t.pid) {
                    self.pending.chunks.extend(c.chunks);
                    self.pending.arenas.extend(c.arenas);
                }
                continue;
            }
            let r = match self.held.remove(&t.pid) {
                Some(held) => {
                    let mut r = give_back(t.pid, &t.name, &held);
                    if r.is_err() {
                        // hiber holds the only reference and is about to fail: put the memory
                        // where `hiber recover` looks for it (in direct mode it is there already).
                        let mems: Vec<(&DeviceMem, String)> = held.iter().map(|h| (&h.mem, chunk_prefix(t.ns_pid, h.id))).collect();
                        let missing: Vec<device::Chunk> = device::chunks(&mems).into_iter().filter(|c| !sink.has_file(&c.rel)).collect();
                        if let Err(e) = device::save(&self.gpus, &missing, None, sink) {
                            r = r.map_err(|x| fail(format!("{x}; and saving the memory for `hiber recover` failed too: {e}"), None));
                        }
                    }
                    if let Some(c) = self.copies.remove(&t.pid) {
                        self.pending.chunks.extend(c.chunks);
                        self.pending.arenas.extend(c.arenas);
                    }
                    r
                }
                // Nothing held (an undo before the handover): open the gate.
                None => match connect(t.pid, &t.name) {
                    Ok(c) => c.call::<Reply>(&Request::Resume, None).map(|_| ()),
                    Err(_) => Ok(()),
                },
            };
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    fn finish(&mut self, sink: &dyn ImageSink) -> Result<Vec<FileEntry>, EngineError> {
        let pending = std::mem::take(&mut self.pending);
        let mut written = std::mem::take(&mut self.written);
        if !pending.chunks.is_empty() {
            written
                .extend(device::save(&self.gpus, &pending.chunks, self.staging.as_ref(), sink).map_err(|e| fail(format!("writing device memory: {e}"), None))?);
        }
        // The copies go as soon as they are on disk: GPU and host memory back to the job.
        drop(pending);
        self.drop_staging();
        Ok(written)
    }
}

/// Device memory of each process (by namespace PID), loaded and checked: allocation ids
/// and the memory to hand over.
type LoadedMemory = HashMap<i32, Vec<(u64, DeviceMem)>>;

/// What the loader thread answers: the memory, and the seconds it took to create it and to
/// load it.
type Loading = std::thread::JoinHandle<Result<(LoadedMemory, f64, f64), EngineError>>;

/// Creates the memory of every allocation of an image on its (mapped) GPU and streams the
/// chunks into it, checking each.
struct Loader {
    gpus: Arc<Gpus>,
    section: Section,
    map: BTreeMap<String, String>,
    image_dir: PathBuf,
    checksums: HashMap<String, String>,
    stop: Arc<AtomicBool>,
}

impl Loader {
    fn run(self) -> Result<(LoadedMemory, f64, f64), EngineError> {
        let t0 = Instant::now();
        let mut loaded: LoadedMemory = HashMap::new();
        let mut jobs = Vec::new();
        for p in self.section.processes.iter().filter(|p| !p.allocations.is_empty()) {
            let mut mems = Vec::new();
            for a in &p.allocations {
                let uuid = self.map.get(&a.gpu).cloned().unwrap_or_else(|| a.gpu.clone());
                let dev =
                    self.gpus.ordinal(&uuid).map_err(|e| cuda_fail(&self.gpus, "listing GPUs", e))?.ok_or_else(|| fail(format!("no GPU {uuid} here"), None))?;
                let mem = DeviceMem::create(&self.gpus, a.size, dev, true).map_err(|e| cuda_fail(&self.gpus, "allocating device memory", e))?;
                mems.push((a.id, mem));
            }
            loaded.insert(p.ns_pid, mems);
        }
        for p in self.section.processes.iter() {
            for (id, m) in loaded.get(&p.ns_pid).into_iter().flatten() {
                jobs.push((m, chunk_prefix(p.ns_pid, *id)));
            }
        }
        let t1 = Instant::now();
        device::load(&self.gpus, &jobs, &self.image_dir, Some(&self.checksums), Some(&self.stop))
            .map_err(|e| fail(format!("loading device memory: {e}"), Some("the image cannot be trusted; checkpoint again")))?;
        drop(jobs);
        Ok((loaded, (t1 - t0).as_secs_f64(), t1.elapsed().as_secs_f64()))
    }
}

/// The agent's share of one restore, checked against this machine's GPUs: its device
/// memory loads from the moment the restore opens, beside CRIU.
struct AgentRestore {
    gpus: Arc<Gpus>,
    section: Section,
    loading: Option<Loading>,
    stop: Arc<AtomicBool>,
}

impl Drop for AgentRestore {
    fn drop(&mut self) {
        // A restore that failed elsewhere: the loader stops at its next chunk and frees the
        // memory it made.
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.loading.take() {
            let _ = h.join();
        }
    }
}

impl RestoreSession for AgentRestore {
    fn restore(&mut self, pids: &[RestoredPid]) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let handle = self.loading.take().ok_or_else(|| fail("device memory restored twice", None))?;
        let (mut loaded, create_s, load_s) = handle.join().unwrap_or_else(|_| Err(fail("the device memory loader panicked", None)))?;
        let waited_s = t0.elapsed().as_secs_f64();
        for p in self.section.processes.iter().filter(|p| !p.allocations.is_empty()) {
            let now = pids
                .iter()
                .find(|r| r.ns_pid == p.ns_pid)
                .ok_or_else(|| fail(format!("restored tree has no process with namespace PID {} ({})", p.ns_pid, p.comm), None))?;
            let name = recovered_name(now.pid).ok_or_else(|| fail(format!("process {} has no agent token in its environment", now.pid), None))?;
            let t2 = Instant::now();
            let mems = loaded.remove(&p.ns_pid).unwrap_or_default();
            let conn = connect(now.pid, &name)?;
            for (id, m) in &mems {
                let fd = m.export_fd().map_err(|e| cuda_fail(&self.gpus, "exporting device memory", e))?;
                conn.call::<Reply>(&Request::Load { id: *id }, Some(&fd))?;
            }
            conn.call::<Reply>(&Request::Resume, None)?;
            tracing::info!(pid = now.pid, create_s, load_s, waited_s, handover_s = t2.elapsed().as_secs_f64(), bytes = p.bytes, "agent memory restored");
        }
        Ok(())
    }
}

/// The agent's socket name for a process, from its environment and namespace PID.
fn recovered_name(pid: i32) -> Option<String> {
    let token = agent_token(pid)?;
    let ns_pid = crate::proctree::read_process(pid).ok()?.ns_pid;
    Some(hiber_wire::socket_name(&token, ns_pid))
}

/// The user's `--gpu-map` resolved for the GPUs the section's allocations used (old UUID →
/// new; empty when they stay where they were).
fn gpu_map(section: &Section, here: &[Gpu], opts: &DeviceRestoreOptions) -> Result<BTreeMap<String, String>, EngineError> {
    let used: Vec<&str> = section.processes.iter().flat_map(|p| p.allocations.iter().map(|a| a.gpu.as_str())).collect();
    cuda::resolve_gpu_map(&opts.gpu_map, &section.gpus, here, &used).map_err(|e| fail(e.to_string(), e.hint()))
}

fn section(value: &serde_json::Value) -> Result<Section, EngineError> {
    serde_json::from_value(value.clone()).map_err(|e| fail(format!("unreadable agent section in the manifest: {e}"), None))
}

/// Lines for `hiber inspect`; works without a driver.
pub fn describe(value: &serde_json::Value) -> Vec<String> {
    let Ok(s) = serde_json::from_value::<Section>(value.clone()) else { return vec!["(unreadable agent section)".into()] };
    let mut out = vec![format!("agent: {} mode, quiesce and handover {:.2}s", s.mode, s.quiesce_seconds)];
    let p = &s.placed;
    if p.device + p.host + p.direct > 0 {
        out.push(format!(
            "agent: while the job was stopped: {} MiB copied on the GPU, {} MiB to host memory (staging area ready in {:.2}s), {} MiB written to the image",
            p.device >> 20,
            p.host >> 20,
            s.staging_seconds,
            p.direct >> 20
        ));
    }
    for p in &s.processes {
        out.push(format!(
            "agent: process {} ({}): {} MiB of device memory in {} allocations moved by the agent",
            p.ns_pid,
            p.comm,
            p.bytes >> 20,
            p.allocations.len()
        ));
        if p.passthrough.calls > 0 {
            let kinds: Vec<String> = p.passthrough.kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
            out.push(format!(
                "agent: process {}: {} MiB in {} allocations left to the driver path ({})",
                p.ns_pid,
                p.passthrough.bytes >> 20,
                p.passthrough.calls,
                kinds.join(", ")
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharing_between_processes_is_named() {
        assert_eq!(shared_state(&Status::default()), None);
        assert!(shared_state(&Status { ipc_imports: 2, ..Status::default() }).unwrap().contains("cuIpcOpenMemHandle"));
        assert!(shared_state(&Status { shared_imports: 1, ..Status::default() }).unwrap().contains("cuMemImportFromShareableHandle"));
        assert_eq!(shared_state(&Status { peer_access: 1, ..Status::default() }), None, "peer access within one process is its own state");
    }

    #[test]
    fn host_staging_is_sized_per_gpu() {
        const G: u64 = 1 << 30;
        let c = device::CHUNK;
        let room: HashMap<i32, u64> = [(0, 30 * G), (1, 70 * G)].into();
        // Everything fits: nothing staged.
        assert_eq!(host_need(20 * G, &room, Some(&[(0, 20 * G)].into())), 0);
        // The job fills GPU 0; GPU 1's room does not help it.
        assert_eq!(host_need(47 * G, &room, Some(&[(0, 47 * G), (1, 0)].into())), 17 * G + c);
        // Both GPUs over.
        assert_eq!(host_need(180 * G, &room, Some(&[(0, 90 * G), (1, 90 * G)].into())), 60 * G + 20 * G + 2 * c);
        // Unknown placement: against the roomiest GPU, in whole chunks.
        assert_eq!(host_need(71 * G, &room, None), G + c);
        assert_eq!(host_need(70 * G, &room, None), 0);
        assert_eq!(host_need(G, &HashMap::new(), None), G + c);
        assert_eq!(host_need(G + 5, &HashMap::new(), None) % c, 0);
    }

    #[test]
    fn mode_names_where_the_bytes_went() {
        let p = |device, host, direct| Placed { device, host, direct };
        assert_eq!(Mode::of(&p(5, 0, 0)), Mode::DeviceSnapshot);
        assert_eq!(Mode::of(&p(0, 0, 5)), Mode::Direct);
        assert_eq!(Mode::of(&p(0, 0, 0)), Mode::Direct, "nothing tracked: nothing staged");
        assert_eq!(Mode::of(&p(0, 5, 0)), Mode::Staged);
        assert_eq!(Mode::of(&p(5, 5, 0)), Mode::Staged);
        assert_eq!(Mode::of(&p(5, 0, 5)), Mode::Staged);
    }

    #[test]
    fn version_1_sections_still_read() {
        let v1 = serde_json::json!({"mode": "direct", "chunk_bytes": 1, "gpus": [], "processes": [], "quiesce_seconds": 0.5, "copy_seconds": 0.25});
        let s: Section = serde_json::from_value(v1).unwrap();
        assert_eq!((s.mode, s.placed, s.staging_seconds), (Mode::Direct, Placed::default(), 0.0));
        assert_eq!(describe(&serde_json::to_value(&s).unwrap()), vec!["agent: direct mode, quiesce and handover 0.50s"]);
        let staged = Section { mode: Mode::Staged, placed: Placed { device: 1 << 30, host: 3 << 30, direct: 0 }, staging_seconds: 0.75, ..s };
        let lines = describe(&serde_json::to_value(&staged).unwrap());
        assert_eq!(lines[0], "agent: staged mode, quiesce and handover 0.50s");
        assert!(lines[1].contains("1024 MiB copied on the GPU, 3072 MiB to host memory (staging area ready in 0.75s), 0 MiB written"), "{}", lines[1]);
    }

    #[test]
    fn mode_keeps_its_manifest_spelling() {
        assert_eq!(serde_json::to_value(Mode::DeviceSnapshot).unwrap(), "device-snapshot");
        assert_eq!(serde_json::from_value::<Mode>("direct".into()).unwrap(), Mode::Direct);
        assert!(serde_json::from_value::<Mode>("sideways".into()).is_err());
        assert_eq!(Mode::DeviceSnapshot.to_string(), "device-snapshot");
        assert_eq!(serde_json::to_value(Mode::Staged).unwrap(), "staged");
    }

    #[test]
    fn chunk_prefix_names_process_and_allocation() {
        assert_eq!(chunk_prefix(7, 3), "agent/7/3");
        assert_eq!(device::chunk_files(&chunk_prefix(7, 3), 1), vec!["agent/7/3.00000"]);
    }
}
