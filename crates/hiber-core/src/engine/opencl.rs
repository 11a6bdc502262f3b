//! The OpenCL engine: OpenCL state moved by record and replay, with the help of the
//! layer preloaded into the application (crate `hiber-opencl`).
//!
//! Checkpoint, per process whose layer saw OpenCL calls:
//! 1. **prepare** ([`DeviceEngine::begin_checkpoint`]): the layer's status. A process that
//!    used a feature hiber cannot re-create (shared virtual memory, pipes, interop, ...),
//!    or holds a memory object mapped, is refused here, before anything is stopped.
//! 2. **quiesce**: the layer closes its gate, drains every queue (bounded by the timeout),
//!    and sends each memory object's bytes in a memfd. hiber writes them to the image as
//!    checksummed chunks, durable before the layer releases every real OpenCL object and
//!    closes the connection (so a hiber killed from then on leaves them for `hiber
//!    recover`): the platform keeps no object of the application when CRIU dumps it.
//! 3. **resume** (the undo, or `--leave-running`'s end): the layer re-creates every object
//!    from its record (`replay`), hiber writes the bytes back (`load`), the gate opens.
//!
//! Restore: CRIU brings the process back with its gate still closed; the layer replays on
//! the device it had, or on the one `--opencl-device` names, and hiber streams the chunks
//! back (checking each), then opens the gate.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hiber_wire::opencl::{MemKind, Reply, Request, Status};
use hiber_wire::socket;
use serde::{Deserialize, Serialize};

use super::layer::Conn;
use super::{CheckpointOptions, CheckpointSession, DeviceEngine, DeviceRestoreOptions, EngineError, EngineKind, RestoreSession, RestoredPid};
use crate::image::chunks::{self, CHUNK};
use crate::image::{FileEntry, ImageSink};
use crate::proctree::ProcessInfo;

pub const ENGINE: &str = "opencl";
const SECTION_VERSION: u32 = 1;
const DEFAULT_TIMEOUT_MS: u64 = 10_000;

pub struct Kind;
pub static KIND: Kind = Kind;

impl EngineKind for Kind {
    fn name(&self) -> &'static str {
        ENGINE
    }

    fn section_version(&self) -> u32 {
        SECTION_VERSION
    }

    /// Always here: the engine talks to layers, not to a platform of its own.
    fn load(&self) -> Option<Box<dyn DeviceEngine>> {
        let timeout_ms = std::env::var("HIBER_OPENCL_TIMEOUT_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_TIMEOUT_MS);
        Some(Box::new(OpenClEngine { timeout_ms }))
    }

    fn describe(&self, section: &serde_json::Value) -> Vec<String> {
        describe(section)
    }

    /// Preloads the layer into jobs on a machine with an OpenCL ICD loader, when the
    /// library is beside the hiber binary (`HIBER_OPENCL_LIB` overrides where).
    fn launch_env(&self, job_dir: &Path) -> Vec<(String, String)> {
        layer_env(job_dir).unwrap_or_default()
    }

    fn streamed_dir(&self) -> Option<&'static str> {
        Some(ENGINE)
    }

    fn unavailable_hint(&self) -> &'static str {
        "every hiber has the OpenCL engine; this should not happen"
    }
}

/// Whether this machine has an OpenCL ICD loader with vendors to load.
fn icd_here() -> bool {
    std::env::var_os("OCL_ICD_VENDORS").is_some() || std::env::var_os("OCL_ICD_FILENAMES").is_some() || Path::new("/etc/OpenCL/vendors").is_dir()
}

/// What `hiber doctor` says of OpenCL: whether jobs get the layer, and why not.
pub fn probe() -> (bool, String) {
    if !icd_here() {
        return (false, "no OpenCL ICD loader vendors (/etc/OpenCL/vendors); OpenCL jobs run without the layer".into());
    }
    match super::layer::library("HIBER_OPENCL_LIB", "libhiber_opencl.so") {
        Some(lib) if lib.exists() => {
            let icds = registered_icds();
            let mode = match default_mode() {
                Mode::Proxy => "in proxy mode: a platform that keeps device files open is registered",
                Mode::Inline => "inline: only platforms that keep no device files open are registered",
            };
            (true, format!("jobs get the OpenCL layer ({}), {mode} ({})", lib.display(), icds.join(", ")))
        }
        Some(lib) => (false, format!("the OpenCL layer is missing ({}); build it with scripts/setup.sh", lib.display())),
        None => (false, "cannot tell where the OpenCL layer is".into()),
    }
}

/// How a job's OpenCL calls reach the platform.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The layer calls the ICD loader in the application's own process.
    Inline,
    /// The layer sends every call to a proxy process beside the job (CheCL's design): the
    /// application never loads the vendor's library, so a platform that keeps device files
    /// open (NVIDIA's) leaves none in it for CRIU.
    Proxy,
}

/// The ICD libraries registered here (`OCL_ICD_FILENAMES`, the `.icd` files of
/// `OCL_ICD_VENDORS` or `/etc/OpenCL/vendors`).
pub fn registered_icds() -> Vec<String> {
    if let Some(names) = std::env::var_os("OCL_ICD_FILENAMES") {
        return names.to_string_lossy().split(':').filter(|s| !s.is_empty()).map(String::from).collect();
    }
    let vendors = std::env::var_os("OCL_ICD_VENDORS").map_or_else(|| PathBuf::from("/etc/OpenCL/vendors"), PathBuf::from);
    let files: Vec<PathBuf> = if vendors.is_dir() {
        std::fs::read_dir(&vendors).map(|d| d.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "icd")).collect()).unwrap_or_default()
    } else {
        vec![vendors]
    };
    files.iter().filter_map(|f| std::fs::read_to_string(f).ok()).map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
}

/// Whether an ICD library is a GPU vendor's whose platform keeps device files open in the
/// process that loads it (NVIDIA's keeps `/dev/nvidia-uvm` and others even with every object
/// released, #13); CPU platforms such as PoCL's keep none.
fn holds_device_files(icd: &str) -> bool {
    let lib = icd.rsplit('/').next().unwrap_or(icd).to_ascii_lowercase();
    ["nvidia", "amdocl", "igdrcl", "intel-opencl", "rusticl", "mali"].iter().any(|v| lib.contains(v))
}

/// The mode `hiber run` gives jobs unless told: the proxy where a registered platform keeps
/// device files open (the inline layer could not checkpoint such a job at all), the inline
/// layer elsewhere (no process beside the job, no round trip per call).
pub fn default_mode() -> Mode {
    if registered_icds().iter().any(|i| holds_device_files(i)) {
        Mode::Proxy
    } else {
        Mode::Inline
    }
}

/// Where a job's proxy listener records that a proxy process of the job died while its
/// process ran.
pub fn proxy_broken_file(job_dir: &Path) -> PathBuf {
    job_dir.join("opencl-proxy.broken")
}

/// What `hiber ls` says of a running job whose OpenCL proxy died, if one did.
pub fn proxy_problem(job_dir: &Path) -> Option<String> {
    std::fs::read_to_string(proxy_broken_file(job_dir)).ok().map(|s| s.trim().to_string())
}

/// In a job's directory: the job's processes reach the platform through the proxy (its
/// time: when the job was marked so).
pub fn proxy_marker(job_dir: &Path) -> PathBuf {
    job_dir.join("opencl-proxy")
}

/// The proxy listener's socket for the jobs under `jobs_dir` (the state directory's
/// `jobs/`): one per state directory, `STATE/opencl-proxy.sock`, so the path a job's
/// environment names stays right for every process it starts after a restore under
/// another name.
pub fn proxy_socket(jobs_dir: &Path) -> PathBuf {
    jobs_dir.parent().unwrap_or(jobs_dir).join("opencl-proxy.sock")
}

/// Marks the job in `job_dir` (a directory of the state's `jobs/`) as one in proxy mode and
/// makes sure the state directory's OpenCL proxy listens: `hiber __opencl-proxy` (this
/// executable), in a process group of its own and outside every job's process tree, so
/// CRIU never dumps it. It serves each process that connects with a proxy process of its
/// own, and ends once no job in proxy mode is left. Returns its socket.
pub fn start_proxy(job_dir: &Path) -> std::io::Result<PathBuf> {
    let jobs = job_dir.parent().ok_or_else(|| std::io::Error::other("a job directory has a parent"))?;
    let root = jobs.parent().unwrap_or(jobs);
    std::fs::write(proxy_marker(job_dir), b"")?;
    let sock = proxy_socket(jobs);
    // One starter at a time, and never while the listener decides to end (it takes the lock
    // too): a socket that answers belongs to a listener that will see this job.
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).mode(0o600).open(root.join("opencl-proxy.lock"))?;
    crate::sys::flock(&lock, true)?;
    if std::os::unix::net::UnixStream::connect(&sock).is_ok() {
        return Ok(sock);
    }
    let _ = std::fs::remove_file(&sock);
    let log = root.join("opencl-proxy.log");
    let mut child = std::process::Command::new("/proc/self/exe")
        .arg("__opencl-proxy")
        .arg("--listen")
        .arg(&sock)
        .arg("--jobs")
        .arg(jobs)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::OpenOptions::new().create(true).append(true).mode(0o600).open(&log)?)
        // Out of hiber's process group: a Ctrl-C meant for hiber does not reach it.
        .process_group(0)
        .spawn()?;
    // It outlives this hiber (then reparented to init); ready once it answers.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        if let Some(status) = child.try_wait()? {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let last = text.lines().last().unwrap_or("no word from it").to_string();
            return Err(std::io::Error::other(format!("the OpenCL proxy ended ({status}): {last}")));
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            return Err(std::io::Error::other("the OpenCL proxy did not listen within 10 s"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(sock)
}

fn layer_env(job_dir: &Path) -> Option<Vec<(String, String)>> {
    if !icd_here() {
        return None;
    }
    let lib = super::layer::library("HIBER_OPENCL_LIB", "libhiber_opencl.so")?;
    if !lib.exists() {
        tracing::warn!(lib = %lib.display(), "the OpenCL layer library is missing; OpenCL jobs run without it (hiber cannot checkpoint their OpenCL state)");
        return None;
    }
    let token = super::layer::token()?;
    Some(vec![
        super::layer::preload(&lib),
        (hiber_wire::opencl::TOKEN_ENV.into(), token),
        (hiber_wire::opencl::LOG_ENV.into(), job_dir.join("opencl.log").display().to_string()),
    ])
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClDevice {
    /// `cpu`, `gpu` or `other`.
    pub kind: String,
    /// "PLATFORM / DEVICE".
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClMem {
    pub id: u64,
    pub size: u64,
    /// `buffer` or `image`.
    pub kind: String,
    pub files: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClObjects {
    pub contexts: u64,
    pub queues: u64,
    pub programs: u64,
    pub kernels: u64,
    pub samplers: u64,
    pub events: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClProcess {
    pub ns_pid: i32,
    pub comm: String,
    pub devices: Vec<ClDevice>,
    pub objects: ClObjects,
    pub bytes: u64,
    pub mems: Vec<ClMem>,
    /// The layer sent the platform's calls to the job's proxy (proxy mode): the restore
    /// starts a proxy for the new job.
    #[serde(default)]
    pub proxy: bool,
}

/// The engine's manifest section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Section {
    pub chunk_bytes: u64,
    pub processes: Vec<ClProcess>,
    /// Gate, drain and reading the memory objects, all processes.
    pub quiesce_seconds: f64,
    /// Of that, writing the memory objects' bytes into the image (absent in images made
    /// before it was measured).
    #[serde(default)]
    pub save_seconds: f64,
}

/// Where memory object `id` of the process with namespace PID `ns_pid` lives in an image.
pub fn chunk_prefix(ns_pid: i32, id: u64) -> String {
    format!("{ENGINE}/{ns_pid}/{id}")
}

fn fail(message: impl Into<String>, hint: Option<&str>) -> EngineError {
    EngineError::failed(ENGINE, message, hint)
}

fn connect(pid: i32, name: &str) -> Result<Conn, EngineError> {
    Conn::open(ENGINE, "OpenCL layer", ("its queues did not drain in time", "retry later, or raise HIBER_OPENCL_TIMEOUT_MS"), pid, name)
}

/// The layer's socket name for host process `pid`, from its environment and namespace PID.
fn layer_name(pid: i32) -> Option<String> {
    let token = crate::proctree::env_var(pid, hiber_wire::opencl::TOKEN_ENV)?;
    let ns_pid = crate::proctree::read_process(pid).ok()?.ns_pid;
    Some(hiber_wire::opencl::socket_name(&token, ns_pid))
}

pub struct OpenClEngine {
    timeout_ms: u64,
}

struct Target {
    pid: i32,
    ns_pid: i32,
    comm: String,
    name: String,
    status: Status,
}

/// A memory object's bytes as the layer sent them.
struct HeldMem {
    id: u64,
    size: u64,
    kind: MemKind,
    fd: OwnedFd,
}

impl OpenClEngine {
    /// `hiber recover` of one process: a layer that released its objects re-creates them,
    /// and gets its bytes back from the image hiber was writing.
    fn recover_one(&self, pid: i32, dirs: &[&Path]) -> Result<(), EngineError> {
        let Some(name) = layer_name(pid) else { return Ok(()) };
        let Ok(conn) = connect(pid, &name) else { return Ok(()) };
        let status = match conn.call::<Reply>(&Request::Status, None)? {
            Reply::Status(s) => s,
            other => return Err(fail(format!("OpenCL layer of process {pid}: unexpected {other:?}"), None)),
        };
        if !status.released && status.pending == 0 {
            return conn.call::<Reply>(&Request::Resume, None).map(|_| ());
        }
        let ns_pid = crate::proctree::read_process(pid).map(|p| p.ns_pid).unwrap_or(pid);
        let dir = dirs.iter().find(|d| d.join(ENGINE).join(ns_pid.to_string()).is_dir()).ok_or_else(|| {
            fail(
                format!("the OpenCL memory objects of process {pid} were only in the hiber that died; they are lost"),
                Some("stop the application and restore an earlier image"),
            )
        })?;
        let image = crate::image::Image::open(dir).ok();
        let sums: Option<HashMap<String, String>> = image.map(|i| i.manifest.files.iter().map(|f| (f.path.clone(), f.blake3.clone())).collect());
        conn.call::<Reply>(&Request::Replay { device: None, proxy: None }, None)?;
        let prefix = format!("{ENGINE}/{ns_pid}/");
        let mut ids: Vec<(u64, u64)> = Vec::new();
        for e in std::fs::read_dir(dir.join(ENGINE).join(ns_pid.to_string())).map_err(|e| fail(format!("{}: {e}", dir.display()), None))?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some((id, _)) = name.split_once('.') else { continue };
            let Ok(id) = id.parse::<u64>() else { continue };
            let len = e.metadata().map(|m| m.len()).unwrap_or(0);
            match ids.iter_mut().find(|(i, _)| *i == id) {
                Some((_, size)) => *size += len,
                None => ids.push((id, len)),
            }
        }
        for (id, size) in ids {
            let fd = load_chunks(dir, &format!("{prefix}{id}"), size, sums.as_ref())?;
            conn.call::<Reply>(&Request::Load { id }, Some(&fd))?;
        }
        conn.call::<Reply>(&Request::Resume, None).map(|_| ())
    }
}

impl DeviceEngine for OpenClEngine {
    fn kind(&self) -> &'static dyn EngineKind {
        &KIND
    }

    fn begin_checkpoint(&self, tree: &[ProcessInfo], _opts: CheckpointOptions) -> Result<Option<Box<dyn CheckpointSession>>, EngineError> {
        let mut targets = Vec::new();
        for p in tree {
            let Some(token) = crate::proctree::env_var(p.pid, hiber_wire::opencl::TOKEN_ENV) else { continue };
            let name = hiber_wire::opencl::socket_name(&token, p.ns_pid);
            // No layer answers: the process never called OpenCL.
            let Ok(conn) = connect(p.pid, &name) else { continue };
            // One that answers wrong cannot be trusted to release its objects.
            let status = match conn.call::<Reply>(&Request::Status, None)? {
                Reply::Status(s) => s,
                other => return Err(fail(format!("OpenCL layer of process {} ({}): unexpected {other:?}", p.pid, p.comm), None)),
            };
            if !status.active {
                continue;
            }
            if !status.refused.is_empty() {
                return Err(fail(
                    format!("process {} ({}) used {}, which hiber cannot checkpoint", p.pid, p.comm, status.refused.join(", ")),
                    Some("run the job with `hiber run --no-opencl` (then only a CPU platform such as PoCL can be checkpointed, by CRIU alone)"),
                ));
            }
            if status.mapped > 0 {
                return Err(fail(
                    format!("process {} ({}) holds {} OpenCL memory objects mapped (clEnqueueMapBuffer/clEnqueueMapImage)", p.pid, p.comm, status.mapped),
                    Some("checkpoint it when its memory objects are unmapped"),
                ));
            }
            if status.gate_closed || status.released || status.pending > 0 {
                return Err(fail(
                    format!("the OpenCL layer of process {} ({}) is in the middle of a checkpoint", p.pid, p.comm),
                    Some("another checkpoint may be under way; `hiber recover` undoes an interrupted one"),
                ));
            }
            targets.push(Target { pid: p.pid, ns_pid: p.ns_pid, comm: p.comm.clone(), name, status });
        }
        if targets.is_empty() {
            return Ok(None);
        }
        Ok(Some(Box::new(OpenClCheckpoint {
            timeout_ms: self.timeout_ms,
            pids: targets.iter().map(|t| t.pid).collect(),
            targets,
            held: HashMap::new(),
            released: Vec::new(),
            written: Vec::new(),
            section: None,
        })))
    }

    fn recover(&self, pids: &[i32], _gone: &[i32], dirs: &[&Path]) -> Result<(), EngineError> {
        super::layer::each(pids, |pid| self.recover_one(pid, dirs))
    }

    fn begin_restore(&self, value: &serde_json::Value, opts: &DeviceRestoreOptions) -> Result<Box<dyn RestoreSession>, EngineError> {
        let section = section(value)?;
        if let Some(d) = &opts.opencl_device {
            let ok = matches!(d.as_str(), "cpu" | "gpu") || d.split_once(':').is_some_and(|(p, x)| p.parse::<u32>().is_ok() && x.parse::<u32>().is_ok());
            if !ok {
                return Err(fail(format!("--opencl-device {d}: not a device"), Some("say cpu, gpu, or PLATFORM:DEVICE as `clinfo -l` numbers them")));
            }
        }
        Ok(Box::new(OpenClRestore {
            section,
            device: opts.opencl_device.clone(),
            image_dir: opts.image_dir.clone(),
            checksums: opts.checksums.clone(),
            proxy: None,
        }))
    }
}

struct OpenClCheckpoint {
    timeout_ms: u64,
    pids: Vec<i32>,
    targets: Vec<Target>,
    /// The bytes of each process's memory objects, until the session ends.
    held: HashMap<i32, Vec<HeldMem>>,
    /// Processes whose layer released its objects (they need a replay to run again).
    released: Vec<i32>,
    written: Vec<FileEntry>,
    section: Option<Section>,
}

/// Writes one memory object's bytes as chunks.
fn save(sink: &dyn ImageSink, prefix: &str, m: &HeldMem) -> Result<Vec<FileEntry>, EngineError> {
    let map = crate::sys::Mapping::new(m.fd.as_fd(), m.size as usize, false).map_err(|e| fail(format!("reading memory object {}: {e}", m.id), None))?;
    let data = map.as_slice();
    let items: Vec<(String, &[u8])> = chunks::chunk_files(prefix, m.size)
        .into_iter()
        .enumerate()
        .map(|(k, rel)| {
            let off = k * CHUNK as usize;
            (rel, &data[off..(off + CHUNK as usize).min(data.len())])
        })
        .collect();
    chunks::write_many(sink, &items).map_err(|e| fail(format!("writing OpenCL memory: {e}"), None))
}

/// A memfd holding the `size` bytes of chunks `prefix.NNNNN`, each checked.
fn load_chunks(dir: &Path, prefix: &str, size: u64, sums: Option<&HashMap<String, String>>) -> Result<OwnedFd, EngineError> {
    let io = |e: std::io::Error| fail(format!("memory for OpenCL object {prefix}: {e}"), None);
    let fd = crate::sys::memfd(c"hiber-opencl", size).map_err(io)?;
    let mut map = crate::sys::Mapping::new(fd.as_fd(), size as usize, true).map_err(io)?;
    let data = map.as_mut_slice();
    for (k, rel) in chunks::chunk_files(prefix, size).into_iter().enumerate() {
        let off = k * CHUNK as usize;
        let end = (off + CHUNK as usize).min(data.len());
        chunks::read(dir, &rel, &mut data[off..end], sums)
            .map_err(|e| fail(format!("loading OpenCL memory: {e}"), Some("the image cannot be trusted; checkpoint again")))?;
    }
    Ok(fd)
}

impl OpenClCheckpoint {
    /// Quiesces one process and takes its memory objects' bytes; on error the layer has
    /// reopened its gate (it does when the connection ends before `release`).
    fn take(&self, t: &Target) -> Result<(Vec<ClDevice>, Vec<HeldMem>, Conn), EngineError> {
        let conn = connect(t.pid, &t.name)?;
        // The layer bounds its own waits by the timeout; reading the memory objects into
        // memfds takes what it takes, so each message may take longer.
        let _ = socket::set_recv_timeout(&conn.sock, Some(Duration::from_millis(self.timeout_ms + 60_000)));
        conn.send(&Request::Quiesce { timeout_ms: self.timeout_ms }, None)?;
        let mut devices = Vec::new();
        let mut mems = Vec::new();
        loop {
            match conn.recv::<Reply>()? {
                (Reply::Device { kind, name }, _) => devices.push(ClDevice { kind, name }),
                (Reply::Mem { id, size, kind }, Some(fd)) => mems.push(HeldMem { id, size, kind, fd }),
                (Reply::Mem { id, .. }, None) => {
                    return Err(fail(format!("OpenCL layer of process {}: memory object {id} came without its bytes", t.pid), None))
                }
                (Reply::Done { .. }, _) => break,
                (Reply::Err(m), _) => return Err(fail(format!("process {} ({}): {m}; it keeps running", t.pid, t.comm), None)),
                (other, _) => return Err(fail(format!("OpenCL layer of process {}: unexpected {other:?}", t.pid), None)),
            }
        }
        let _ = socket::set_recv_timeout(&conn.sock, None);
        Ok((devices, mems, conn))
    }
}

impl CheckpointSession for OpenClCheckpoint {
    fn pids(&self) -> &[i32] {
        &self.pids
    }

    fn quiesce(&mut self, sink: &dyn ImageSink, _peers: &dyn crate::coordinator::Coordinator) -> Result<(), EngineError> {
        let start = Instant::now();
        let mut saving = Duration::ZERO;
        let mut processes = Vec::new();
        for t in &self.targets {
            let (devices, mems, conn) = self.take(t)?;
            // Durable before the layer lets go of the real objects, with --leave-running
            // too: a hiber killed between the release and the replay leaves the bytes where
            // `hiber recover` finds them, never only in its own memory.
            let t0 = Instant::now();
            for m in &mems {
                self.written.extend(save(sink, &chunk_prefix(t.ns_pid, m.id), m)?);
            }
            saving += t0.elapsed();
            let s = &t.status;
            processes.push(ClProcess {
                ns_pid: t.ns_pid,
                comm: t.comm.clone(),
                devices,
                objects: ClObjects { contexts: s.contexts, queues: s.queues, programs: s.programs, kernels: s.kernels, samplers: s.samplers, events: s.events },
                bytes: mems.iter().map(|m| m.size).sum(),
                mems: mems
                    .iter()
                    .map(|m| ClMem { id: m.id, size: m.size, kind: m.kind.to_string(), files: chunks::chunk_files(&chunk_prefix(t.ns_pid, m.id), m.size) })
                    .collect(),
                proxy: s.proxy,
            });
            self.held.insert(t.pid, mems);
            conn.call::<Reply>(&Request::Release, None)?;
            self.released.push(t.pid);
            conn.wait_closed();
        }
        self.section = Some(Section { chunk_bytes: CHUNK, processes, quiesce_seconds: start.elapsed().as_secs_f64(), save_seconds: saving.as_secs_f64() });
        Ok(())
    }

    fn capture(&mut self, _tree: &[ProcessInfo]) -> Result<serde_json::Value, EngineError> {
        let section = self.section.as_ref().ok_or_else(|| fail("capture before quiesce", None))?;
        Ok(serde_json::to_value(section).expect("section serializes"))
    }

    fn resume(&mut self, _sink: &dyn ImageSink, _peers: &dyn crate::coordinator::Coordinator) -> Result<(), EngineError> {
        let mut first = None;
        for t in &self.targets {
            if !self.released.contains(&t.pid) || !crate::proctree::alive(t.pid) {
                // Never released (its layer reopened its gate when the connection ended),
                // or gone: nothing to undo.
                continue;
            }
            let held = self.held.get(&t.pid).map(Vec::as_slice).unwrap_or_default();
            let r = (|| {
                let conn = connect(t.pid, &t.name)?;
                conn.call::<Reply>(&Request::Replay { device: None, proxy: None }, None)?;
                for m in held {
                    conn.call::<Reply>(&Request::Load { id: m.id }, Some(&m.fd))?;
                }
                conn.call::<Reply>(&Request::Resume, None).map(|_| ())
            })();
            if let Err(e) = r {
                // The bytes are in the partial image already, for `hiber recover`.
                first.get_or_insert(e);
            } else {
                self.released.retain(|p| *p != t.pid);
            }
        }
        first.map_or(Ok(()), Err)
    }

    fn finish(&mut self, _sink: &dyn ImageSink) -> Result<Vec<FileEntry>, EngineError> {
        self.held.clear();
        Ok(std::mem::take(&mut self.written))
    }
}

struct OpenClRestore {
    section: Section,
    device: Option<String>,
    image_dir: PathBuf,
    checksums: HashMap<String, String>,
    /// The new job's proxy, when its processes ran in proxy mode.
    proxy: Option<PathBuf>,
}

impl RestoreSession for OpenClRestore {
    fn job_dir(&mut self, dir: &Path) -> Result<(), EngineError> {
        if self.section.processes.iter().any(|p| p.proxy) {
            let sock = start_proxy(dir).map_err(|e| fail(format!("cannot start the job's OpenCL proxy: {e}"), None))?;
            self.proxy = Some(sock);
        }
        Ok(())
    }

    fn restore(&mut self, pids: &[RestoredPid], _peers: &dyn crate::coordinator::Coordinator) -> Result<(), EngineError> {
        for p in &self.section.processes {
            let now = pids
                .iter()
                .find(|r| r.ns_pid == p.ns_pid)
                .ok_or_else(|| fail(format!("restored tree has no process with namespace PID {} ({})", p.ns_pid, p.comm), None))?;
            let name = layer_name(now.pid).ok_or_else(|| fail(format!("process {} has no OpenCL layer token in its environment", now.pid), None))?;
            let t0 = Instant::now();
            let conn = connect(now.pid, &name)?;
            let proxy = self.proxy.as_ref().filter(|_| p.proxy).map(|s| s.display().to_string());
            conn.call::<Reply>(&Request::Replay { device: self.device.clone(), proxy }, None).map_err(|e| match e {
                EngineError::Failed { message, .. } if self.device.is_none() => {
                    fail(message, Some("move it to a device here with --opencl-device cpu, gpu or PLATFORM:DEVICE"))
                }
                e => e,
            })?;
            for m in &p.mems {
                let fd = load_chunks(&self.image_dir, &chunk_prefix(p.ns_pid, m.id), m.size, Some(&self.checksums))?;
                conn.call::<Reply>(&Request::Load { id: m.id }, Some(&fd))?;
            }
            conn.call::<Reply>(&Request::Resume, None)?;
            tracing::info!(pid = now.pid, seconds = t0.elapsed().as_secs_f64(), bytes = p.bytes, device = ?self.device, "OpenCL objects re-created");
        }
        Ok(())
    }
}

fn section(value: &serde_json::Value) -> Result<Section, EngineError> {
    serde_json::from_value(value.clone()).map_err(|e| fail(format!("unreadable manifest section: {e}"), Some("the image was written by an incompatible hiber")))
}

pub fn describe(value: &serde_json::Value) -> Vec<String> {
    let Ok(s) = section(value) else { return vec!["unreadable OpenCL section".into()] };
    let mut out = Vec::new();
    for p in &s.processes {
        let o = &p.objects;
        out.push(format!(
            "process {} ({}): {} contexts, {} queues, {} programs, {} kernels, {} samplers, {} events; {} memory objects, {} bytes",
            p.ns_pid,
            p.comm,
            o.contexts,
            o.queues,
            o.programs,
            o.kernels,
            o.samplers,
            o.events,
            p.mems.len(),
            p.bytes
        ));
        for d in &p.devices {
            out.push(format!("  on {} device {}", d.kind, d.name));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describe_names_objects_and_devices() {
        let s = Section {
            chunk_bytes: CHUNK,
            quiesce_seconds: 0.1,
            save_seconds: 0.05,
            processes: vec![ClProcess {
                ns_pid: 2,
                comm: "stencil".into(),
                devices: vec![ClDevice { kind: "cpu".into(), name: "Portable Computing Language / pthread".into() }],
                objects: ClObjects { contexts: 1, queues: 2, programs: 1, kernels: 3, samplers: 0, events: 4 },
                bytes: 8192,
                mems: vec![ClMem { id: 5, size: 8192, kind: "buffer".into(), files: chunks::chunk_files(&chunk_prefix(2, 5), 8192) }],
                proxy: false,
            }],
        };
        let lines = describe(&serde_json::to_value(&s).unwrap());
        assert!(lines[0].contains("2 queues") && lines[0].contains("1 memory objects, 8192 bytes"), "{lines:?}");
        assert!(lines[1].contains("cpu device Portable Computing Language / pthread"), "{lines:?}");
        assert_eq!(s.processes[0].mems[0].files, ["opencl/2/5.00000"]);
    }
}
