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
//! chunk's checksum) while CRIU restores the processes, and hands it to the restored agent
//! the same way.
//!
//! `checkpoint.rs` holds the checkpoint session (placement of the copies, the staging
//! area), `restore.rs` the restore session (the loader), `device.rs` hiber's device memory
//! and the threads that move chunks.
//!
//! hiber, not the agent, moves the data: the application gains no threads or pinned memory
//! for it, and device data never lands in the CRIU image. (The agent keeps one descriptor
//! per allocation hiber handed back, until the next checkpoint: see the agent's memory.rs.)

mod checkpoint;
mod device;
pub mod fingerprint;
pub mod nccl;
mod restore;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use hiber_wire::agent::{Reply, Request, Status};
use serde::{Deserialize, Serialize};

use super::cuda::{self, ffi, Gpu};
use super::layer::Conn;
use super::{CheckpointOptions, CheckpointSession, CuError, DeviceEngine, DeviceRestoreOptions, EngineError, EngineKind, RestoreSession};
use crate::proctree::ProcessInfo;
use device::{DeviceMem, Gpus};

pub const ENGINE: &str = "agent";
/// The shape of [`Section`]: 1 for the first agent images; 2 added [`Mode::Staged`] and
/// [`Placed`] (images of version 1 read as before).
const SECTION_VERSION: u32 = 2;
const DEFAULT_QUIESCE_TIMEOUT_MS: u64 = 10_000;
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
    let mut env = vec![
        super::layer::preload(&lib),
        (hiber_wire::agent::TOKEN_ENV.into(), token),
        (hiber_wire::agent::LOG_ENV.into(), job_dir.join("agent.log").display().to_string()),
    ];
    // NCCL's RAS service (2.24 and newer) outlives every communicator: its thread starts
    // with the first one and ends at exit (ras.cc, 2.28.9), keeping a listening socket on a
    // random port of the bootstrap interface, one for the `ncclras` client on
    // 127.0.0.1:28028, and connections to the other ranks'. So the agent's teardown leaves
    // them in the image, and on 2×H200 4 of 14 restores of NCCL jobs' --leave-running
    // images failed in CRIU binding a rank's listening socket ("Address already in use",
    // beside TCP_LISTEN sockets on 192.0.2.2 and 127.0.0.1:28028). RAS only answers that
    // client and changes nothing a job computes; a user who sets the variable keeps it.
    if std::env::var_os("NCCL_RAS_ENABLE").is_none() {
        env.push(("NCCL_RAS_ENABLE".into(), "0".into()));
    }
    Some(env)
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
    /// Found unchanged since the parent image by its fingerprint on the GPU, and so neither
    /// copied nor written: the image shares the parent's chunks.
    #[serde(default)]
    pub unchanged: u64,
    /// Found to be zeros (memory never written) by its fingerprint, and so not copied:
    /// written as sparse files.
    #[serde(default)]
    pub zeros: u64,
}

impl Placed {
    fn add(&mut self, o: &Placed) {
        self.device += o.device;
        self.host += o.host;
        self.direct += o.direct;
        self.unchanged += o.unchanged;
        self.zeros += o.zeros;
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
    /// UUIDs of the GPUs it could see, from its `CUDA_VISIBLE_DEVICES`, where that hid some
    /// of the machine's; empty when it saw them all (or it is not known).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub visible: Vec<String>,
    /// Allocations of other processes it had open through the agent's CUDA IPC: mapped
    /// again from their exporters as it resumes.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ipc_imports: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The GPUs process `pid` can see where its `CUDA_VISIBLE_DEVICES` hides some of
/// `machine`'s and still shows every GPU it `used`; else empty (all, or not known).
pub(super) fn visible_subset(pid: i32, machine: &[Gpu], used: &[&str]) -> Vec<String> {
    let Some(value) = crate::proctree::env_var(pid, "CUDA_VISIBLE_DEVICES") else { return Vec::new() };
    let visible = cuda::visible_gpus(Some(&value), machine);
    if visible.len() >= machine.len() || !used.iter().all(|u| visible.iter().any(|v| v == u)) {
        return Vec::new();
    }
    visible
}

/// The processes (namespace PIDs) whose memory `map` moves onto a GPU their
/// `CUDA_VISIBLE_DEVICES` hid from them. The driver's restore moves such a process (with the
/// whole permutation), but memory hiber makes on that GPU cannot be mapped into it: on
/// 2×H200, a job started with `CUDA_VISIBLE_DEVICES=1` and restored with `--gpu-map 1=0` got
/// CUDA_ERROR_NOT_INITIALIZED importing it. Their agents make the memory themselves, once
/// restored, on the device ordinal they knew it on, and hiber fills it.
fn moved_out_of_sight(section: &Section, map: &BTreeMap<String, String>) -> Vec<i32> {
    section
        .processes
        .iter()
        .filter(|p| !p.visible.is_empty() && p.allocations.iter().any(|a| !p.visible.contains(map.get(&a.gpu).unwrap_or(&a.gpu))))
        .map(|p| p.ns_pid)
        .collect()
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

impl Target {
    /// Whether the checkpoint quiesces it: it has memory to hand over, or memory of
    /// another process open that it must let go of (and map again afterwards).
    fn busy(&self) -> bool {
        self.status.tracked > 0 || self.status.agent_ipc > 0
    }
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
    crate::proctree::env_var(pid, hiber_wire::agent::TOKEN_ENV)
}

/// A control connection to the agent of host process `pid`.
fn connect(pid: i32, name: &str) -> Result<Conn, EngineError> {
    Conn::open(ENGINE, "agent", ("device work still running after the timeout", "retry later, or raise HIBER_AGENT_QUIESCE_TIMEOUT_MS"), pid, name)
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
    /// always writes first). Returns the connection on which to open its gate once every
    /// process has its memory.
    fn recover_one(&self, pid: i32, dirs: &[&Path]) -> Result<Option<Conn>, EngineError> {
        let Some(name) = recovered_name(pid) else { return Ok(None) };
        // No agent answering: it never started (no CUDA), so there is nothing to undo.
        let Ok(conn) = connect(pid, &name) else { return Ok(None) };
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
        // The keeper of a `--leave-running` checkpoint holds the very allocations the agent
        // released: handed back as they are, nothing to load.
        let keeper = crate::proctree::stat(pid).ok().and_then(|s| crate::keeper::Conn::open(pid, s.start_time, crate::keeper::AT_REST).ok());
        for (id, size, gpu) in released {
            let mut unanswered = None;
            match keeper.as_ref().map(|k| k.take(id)) {
                Some(Ok(Some(fd))) => {
                    conn.call::<Reply>(&Request::Load { id }, Some(&fd))?;
                    continue;
                }
                Some(Err(e)) => unanswered = Some(e),
                Some(Ok(None)) | None => {}
            }
            let prefix = chunk_prefix(ns_pid, id);
            let dir = dirs.iter().find(|d| d.join(format!("{prefix}.00000")).exists()).ok_or_else(|| match &unanswered {
                // It may still hold it: nothing is lost yet.
                Some(e) => fail(
                    format!("the keeper of process {pid}'s device memory did not hand back allocation {id} ({e})"),
                    Some("the application waits at the agent's gate; run `hiber recover` again"),
                ),
                None => fail(
                    format!("the device memory of process {pid} (allocation {id}, {} MiB) was only in the hiber that died; it is lost", size >> 20),
                    Some("the application cannot continue on the GPU; stop it and restore an earlier image"),
                ),
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
        if let Some(k) = keeper {
            let _ = k.done();
        }
        Ok(Some(conn))
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
            let name = hiber_wire::agent::socket_name(&token, p.ns_pid);
            let status = match connect(p.pid, &name).and_then(|c| c.call::<Reply>(&Request::Status, None)) {
                Ok(Reply::Status(s)) => s,
                Ok(_) | Err(_) => {
                    tracing::debug!(pid = p.pid, "no agent answers; the driver engine covers it");
                    continue;
                }
            };
            if status.gate_closed || status.evacuated > 0 || status.nccl_down {
                return Err(fail(
                    format!("the agent of process {} ({}) is in the middle of a checkpoint", p.pid, p.comm),
                    Some("another checkpoint may be under way; `hiber recover` undoes an interrupted one"),
                ));
            }
            // A rank of an NCCL job imports its peers' buffers; they go with its
            // communicators, before its memory is taken (the agent checks again then).
            if let Some(what) = shared_state(&status).filter(|_| status.nccl == 0) {
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
        Ok(Some(Box::new(checkpoint::AgentCheckpoint::new(self.gpus.clone(), self.timeout_ms, opts, targets))))
    }

    fn recover(&self, pids: &[i32], gone: &[i32], dirs: &[&Path]) -> Result<(), EngineError> {
        // Every process gets its memory back before any resumes (memory opened through
        // CUDA IPC is mapped again from its exporter as the importer resumes).
        let mut to_resume = Vec::new();
        let loaded = super::layer::each(pids, |pid| {
            to_resume.extend(self.recover_one(pid, dirs)?);
            Ok(())
        });
        let loaded = to_resume.into_iter().fold(loaded, |r, conn| r.and(conn.call::<Reply>(&Request::Resume, None).map(|_| ())));
        // Communicators torn down by the hiber that died are built again once every rank
        // has its memory back.
        // Processes of the job that are gone go with them: the communicators they were
        // ranks of cannot be rebuilt, and their calls on the others fail instead of waiting.
        let mut ranks = nccl_down(pids);
        ranks.extend(gone.iter().map(|&pid| nccl::Rank { pid, name: String::new() }));
        // Alone: a communicator with ranks in another hiber's job cannot be built again here.
        let rebuilt = nccl::rebuild(&ranks, self.timeout_ms, &crate::coordinator::Local::default());
        loaded.and(rebuilt)
    }

    fn begin_restore(&self, value: &serde_json::Value, opts: &DeviceRestoreOptions) -> Result<Box<dyn RestoreSession>, EngineError> {
        let section = section(value)?;
        let here = cuda::nvml_gpus();
        let map = gpu_map(&section, &here, opts)?;
        let made_by_agents = moved_out_of_sight(&section, &map);
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
        // The device memory is loaded while CRIU restores the processes.
        let r = restore::AgentRestore::start(self.gpus.clone(), section, map, made_by_agents, opts.image_dir.clone(), opts.checksums.clone(), self.timeout_ms)?;
        Ok(Box::new(r))
    }
}

/// The agent's socket name for a process, from its environment and namespace PID.
/// The processes among `pids` whose agents have NCCL communicators torn down.
fn nccl_down(pids: &[i32]) -> Vec<nccl::Rank> {
    pids.iter()
        .filter_map(|&pid| {
            let name = recovered_name(pid)?;
            match connect(pid, &name).and_then(|c| c.call::<Reply>(&Request::Status, None)) {
                Ok(Reply::Status(s)) if s.nccl_down => Some(nccl::Rank { pid, name }),
                _ => None,
            }
        })
        .collect()
}

fn recovered_name(pid: i32) -> Option<String> {
    let token = agent_token(pid)?;
    let ns_pid = crate::proctree::read_process(pid).ok()?.ns_pid;
    Some(hiber_wire::agent::socket_name(&token, ns_pid))
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
    if p.zeros > 0 {
        out.push(format!("agent: {} MiB of zeros (never written, found on the GPU), not copied", p.zeros >> 20));
    }
    if p.unchanged > 0 {
        out.push(format!("agent: {} MiB unchanged since the parent image (fingerprinted on the GPU), shared with it", p.unchanged >> 20));
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

    const A: &str = "GPU-11111111-2222-3333-4444-555555555555";
    const B: &str = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";

    fn two_gpus() -> Vec<Gpu> {
        [A, B]
            .iter()
            .enumerate()
            .map(|(i, u)| Gpu { index: i as u32, uuid: u.to_string(), name: "NVIDIA H200".into(), memory_total: 1 << 40, memory_free: 1 << 40 })
            .collect()
    }

    fn process_on(gpu: &str, visible: &[&str]) -> AgentProcess {
        AgentProcess {
            ns_pid: 7,
            comm: "counter".into(),
            bytes: 1 << 30,
            allocations: vec![Allocation { id: 1, size: 1 << 30, gpu: gpu.into(), files: Vec::new() }],
            passthrough: Passthrough::default(),
            visible: visible.iter().map(|v| v.to_string()).collect(),
            ipc_imports: 0,
        }
    }

    #[test]
    fn memory_moved_out_of_a_process_sight_is_made_by_its_agent() {
        let section = |p: AgentProcess| Section {
            mode: Mode::Direct,
            chunk_bytes: 1,
            gpus: two_gpus(),
            processes: vec![p],
            quiesce_seconds: 0.0,
            copy_seconds: 0.0,
            placed: Placed::default(),
            staging_seconds: 0.0,
        };
        let swap: BTreeMap<String, String> = [(A.to_string(), B.to_string()), (B.to_string(), A.to_string())].into();
        // Started with CUDA_VISIBLE_DEVICES=1: it saw B alone.
        let p = process_on(B, &[B]);
        let ns_pid = p.ns_pid;
        assert_eq!(moved_out_of_sight(&section(p), &swap), vec![ns_pid]);
        assert!(moved_out_of_sight(&section(process_on(B, &[B])), &BTreeMap::new()).is_empty(), "in place");
        assert!(moved_out_of_sight(&section(process_on(B, &[])), &swap).is_empty(), "it saw every GPU");
    }

    #[test]
    fn the_visible_gpus_are_recorded_only_where_some_were_hidden() {
        let machine = two_gpus();
        let spawn = |cvd: Option<&str>| {
            use std::io::BufRead;
            // The shell says so once it runs, and so has the environment it was given; it
            // then waits on its stdin (not exec'ing anything, whose exec would race the read).
            let mut c = std::process::Command::new("sh");
            c.args(["-c", "echo ready; read x"]).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
            if let Some(v) = cvd {
                c.env("CUDA_VISIBLE_DEVICES", v);
            } else {
                c.env_remove("CUDA_VISIBLE_DEVICES");
            }
            let mut child = c.spawn().unwrap();
            let mut line = String::new();
            std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
            assert_eq!(line, "ready\n");
            child
        };
        for (cvd, used, want) in [(Some("1"), B, vec![B.to_string()]), (None, A, vec![]), (Some("0,1"), A, vec![]), (Some("1"), A, vec![])] {
            let mut child = spawn(cvd);
            let got = visible_subset(child.id() as i32, &machine, &[used]);
            child.kill().unwrap();
            child.wait().unwrap();
            assert_eq!(got, want, "CUDA_VISIBLE_DEVICES={cvd:?}, used {used}");
        }
    }

    #[test]
    fn mode_names_where_the_bytes_went() {
        let p = |device, host, direct| Placed { device, host, direct, unchanged: 0, zeros: 0 };
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
        let staged =
            Section { mode: Mode::Staged, placed: Placed { device: 1 << 30, host: 3 << 30, direct: 0, unchanged: 0, zeros: 0 }, staging_seconds: 0.75, ..s };
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
