//! The agent engine: device memory moved by hiber itself, at PCIe speed, with the help of
//! the agent preloaded into the application (crate `hiber-agent`).
//!
//! Checkpoint, per process with an agent:
//! 1. **quiesce** — over the agent's control socket: the agent closes its gate (new CUDA
//!    work waits), waits for calls in flight, synchronizes its devices, and sends a file
//!    descriptor for every allocation it tracks. hiber imports each (a second reference to
//!    the same physical memory) and then either copies it on the device (a snapshot, when
//!    `--leave-running` and the GPU has room) or writes it to the image now. Only then does
//!    the agent unmap and release its references, keeping the address reservations, and
//!    close the connection. The driver engine then checkpoints the small remainder.
//! 2. **resume** (after the driver resumed the process): hiber hands each allocation back
//!    as a descriptor, the agent maps it at the same address and opens its gate.
//! 3. **finish** — snapshots are written to the image after the application runs again.
//!
//! Restore creates memory on the target GPU, streams the chunks into it (checking each
//! chunk's checksum), and hands it to the restored agent the same way.
//!
//! hiber, not the agent, moves the data: the application gains no threads, pinned memory
//! or file descriptors for it, and device data never lands in the CRIU image.

mod device;

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use hiber_wire::{socket, Reply, Request, Status};
use serde::{Deserialize, Serialize};

use super::cuda::{self, ffi, Gpu};
use super::{CaptureTarget, DeviceEngine, DeviceRestoreOptions, EngineError, RestoredPid};
use crate::image::FileEntry;
use crate::proctree::ProcessInfo;
use device::{DeviceMem, Gpus};

pub const ENGINE: &str = "agent";
const DEFAULT_QUIESCE_TIMEOUT_MS: u64 = 10_000;
/// Room left on a GPU beside a snapshot, for the driver's own needs.
const SNAPSHOT_MARGIN: u64 = 1 << 30;

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
    /// "device-snapshot": copied on the GPU and written after the application resumed;
    /// "direct": written before the agent released the memory.
    pub mode: String,
    pub chunk_bytes: u64,
    pub gpus: Vec<Gpu>,
    pub processes: Vec<AgentProcess>,
    /// Quiesce and handover, all processes.
    pub quiesce_seconds: f64,
    /// Device copy (snapshot mode) or writing the chunks (direct mode) before release.
    pub copy_seconds: f64,
}

fn passthrough(s: &Status) -> Passthrough {
    let kinds = [("small", s.small), ("pitch", s.pitch), ("async", s.stream_ordered), ("managed", s.managed), ("vmm_not_exportable", s.vmm_not_exportable)];
    Passthrough {
        calls: s.passthrough_calls,
        bytes: s.passthrough_bytes,
        kinds: kinds.into_iter().filter(|(_, n)| *n > 0).map(|(k, n)| (k.to_string(), n)).collect(),
    }
}

/// A process with an agent, found by `claim`.
#[derive(Debug, Clone)]
struct Target {
    name: String,
    ns_pid: i32,
    comm: String,
    status: Status,
}

/// One allocation hiber holds during a checkpoint.
struct Held {
    id: u64,
    /// The descriptor the agent sent: given back as it is.
    fd: OwnedFd,
    mem: DeviceMem,
    snapshot: Option<DeviceMem>,
    gpu: String,
}

#[derive(Default)]
struct State {
    targets: HashMap<i32, Target>,
    held: HashMap<i32, Vec<Held>>,
    /// Snapshots whose processes run again, waiting for `finish`.
    pending: Vec<(DeviceMem, String)>,
    written: Vec<FileEntry>,
    section: Option<Section>,
    dir: Option<PathBuf>,
}

pub struct AgentEngine {
    gpus: Arc<Gpus>,
    state: Mutex<State>,
    timeout_ms: u64,
}

fn fail(message: String, hint: Option<&str>) -> EngineError {
    EngineError::Failed { engine: ENGINE, message, hint: hint.map(String::from) }
}

/// The agent token in a process's environment, as `hiber run` set it.
fn agent_token(pid: i32) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let key = format!("{}=", hiber_wire::TOKEN_ENV);
    env.split(|b| *b == 0).find_map(|kv| kv.strip_prefix(key.as_bytes())).map(|v| String::from_utf8_lossy(v).into_owned())
}

/// One control connection to the agent of host process `pid`.
struct Conn {
    sock: OwnedFd,
    pid: i32,
}

impl Conn {
    fn open(pid: i32, name: &str) -> Result<Conn, EngineError> {
        let name = name.to_string();
        let sock = crate::sys::in_network_namespace_of(pid, move || socket::connect(&name))
            .and_then(|r| r)
            .map_err(|e| fail(format!("cannot reach the agent of process {pid}: {e}"), None))?;
        Ok(Conn { sock, pid })
    }

    fn send(&self, r: &Request, fd: Option<&OwnedFd>) -> Result<(), EngineError> {
        socket::send(&self.sock, &r.encode(), fd.map(|f| f.as_raw_fd())).map_err(|e| fail(format!("agent of process {}: {e}", self.pid), None))
    }

    fn recv(&self) -> Result<(Reply, Option<OwnedFd>), EngineError> {
        match socket::recv(&self.sock) {
            Ok(Some((msg, fd))) => Ok((Reply::parse(&msg).map_err(|e| fail(format!("agent of process {}: {e}", self.pid), None))?, fd)),
            Ok(None) => Err(fail(format!("the agent of process {} closed the connection", self.pid), None)),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Err(fail(
                format!("the agent of process {} could not quiesce it: device work still running after the timeout; the application keeps running", self.pid),
                Some("retry later, or raise HIBER_AGENT_QUIESCE_TIMEOUT_MS"),
            )),
            Err(e) => Err(fail(format!("agent of process {}: {e}", self.pid), None)),
        }
    }

    fn call(&self, r: &Request, fd: Option<&OwnedFd>) -> Result<Reply, EngineError> {
        self.send(r, fd)?;
        let reply = self.recv()?.0;
        if let Reply::Err(m) = &reply {
            return Err(fail(format!("agent of process {}: {m}", self.pid), None));
        }
        Ok(reply)
    }

    /// Waits for the agent to close its end (it does after `release`).
    fn wait_closed(&self) {
        while let Ok(Some(_)) = socket::recv(&self.sock) {}
    }
}

impl AgentEngine {
    /// The engine, when libcuda with the VMM API is here.
    pub fn load() -> Option<AgentEngine> {
        let lib = ffi::CudaLib::load().ok()?;
        // One timeout for "work in flight must finish": the agent's own, else the driver lock's.
        let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse().ok());
        let timeout_ms = env("HIBER_AGENT_QUIESCE_TIMEOUT_MS").or_else(|| env("HIBER_CUDA_LOCK_TIMEOUT_MS")).unwrap_or(DEFAULT_QUIESCE_TIMEOUT_MS);
        Some(AgentEngine { gpus: Arc::new(Gpus::new(lib)), state: Mutex::new(State::default()), timeout_ms })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn cuda_fail(&self, what: &str, e: ffi::CuResult) -> EngineError {
        fail(format!("{what}: {}", self.gpus.cuda.error_name(e)), None)
    }

    /// Quiesces one process and takes its memory; on error the process is as before.
    fn take(&self, pid: i32, t: &Target, target: &CaptureTarget<'_>, snapshot: bool) -> Result<(Vec<Held>, Vec<FileEntry>), EngineError> {
        let conn = Conn::open(pid, &t.name)?;
        // The agent bounds its wait for calls in flight; a kernel still running when it
        // synchronizes is bounded here. Timing out closes the connection, and the agent,
        // finding no one to hand its memory to, opens its gate again.
        let _ = socket::set_recv_timeout(&conn.sock, Some(std::time::Duration::from_millis(self.timeout_ms + 500)));
        conn.send(&Request::Quiesce { timeout_ms: self.timeout_ms }, None)?;
        let mut held = Vec::new();
        let mut timed_out = false;
        let taken = (|| {
            loop {
                let msg = conn.recv().inspect_err(|_| timed_out = true)?;
                match msg {
                    (Reply::Alloc { id, size, .. }, Some(fd)) => {
                        let mem = DeviceMem::import(&self.gpus, fd.as_fd(), size).map_err(|e| self.cuda_fail("importing device memory from the agent", e))?;
                        let gpu = self.gpus.uuid(mem.dev).map_err(|e| self.cuda_fail("device UUID", e))?;
                        held.push(Held { id, fd, mem, snapshot: None, gpu });
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
            let written = if snapshot {
                for h in held.iter_mut() {
                    h.snapshot = Some(h.mem.snapshot().map_err(|e| self.cuda_fail("copying device memory", e))?);
                }
                Vec::new()
            } else {
                let mems: Vec<(&DeviceMem, String)> = held.iter().map(|h| (&h.mem, format!("{ENGINE}/{}/{}", t.ns_pid, h.id))).collect();
                device::save(&self.gpus, &mems, target.dir.parent().unwrap_or(target.dir)).map_err(|e| fail(format!("writing device memory: {e}"), None))?
            };
            conn.call(&Request::Release, None)?;
            conn.wait_closed();
            Ok(written)
        })();
        match taken {
            Ok(written) => Ok((held, written)),
            Err(e) => {
                // The agent gets back whatever it released and opens its gate. After a
                // timeout it is still busy; it opens the gate itself once it finds the
                // connection closed.
                if !timed_out {
                    let _ = Self::give_back_on(&conn, &held);
                }
                Err(e)
            }
        }
    }

    /// After a hiber died mid-checkpoint: whatever the agent of `pid` released is loaded
    /// back from the chunks that hiber wrote before it let the agent release (direct mode
    /// always writes first), and the gate opens.
    fn recover_one(&self, pid: i32, dirs: &[&Path]) -> Result<(), EngineError> {
        let Some(name) = recovered_name(pid) else { return Ok(()) };
        // No agent answering: it never started (no CUDA), so there is nothing to undo.
        let Ok(conn) = Conn::open(pid, &name) else { return Ok(()) };
        let ns_pid = crate::proctree::read_process(pid).map(|p| p.ns_pid).unwrap_or(pid);
        conn.send(&Request::List, None)?;
        let mut released = Vec::new();
        loop {
            match conn.recv()?.0 {
                Reply::Evacuated { id, size, gpu } => released.push((id, size, gpu)),
                Reply::Done { .. } => break,
                other => return Err(fail(format!("agent of process {pid}: unexpected {other:?}"), None)),
            }
        }
        for (id, size, gpu) in released {
            let prefix = format!("{ENGINE}/{ns_pid}/{id}");
            let dir = dirs.iter().find(|d| d.join(format!("{prefix}.00000")).exists()).ok_or_else(|| {
                fail(
                    format!("the device memory of process {pid} (allocation {id}, {} MiB) was only in the hiber that died; it is lost", size >> 20),
                    Some("the application cannot continue on the GPU; stop it and restore an earlier image"),
                )
            })?;
            // A finished image has checksums for the chunks; a partial one does not yet.
            let image = crate::image::Image::open(dir).ok();
            let sums: Option<HashMap<String, String>> = image.map(|i| i.manifest.files.iter().map(|f| (f.path.clone(), f.blake3.clone())).collect());
            let dev = self.gpus.ordinal(&gpu).map_err(|e| self.cuda_fail("listing GPUs", e))?.ok_or_else(|| fail(format!("no GPU {gpu} here"), None))?;
            let mem = DeviceMem::create(&self.gpus, size, dev, true).map_err(|e| self.cuda_fail("allocating device memory", e))?;
            device::load(&self.gpus, &[(&mem, prefix)], dir, sums.as_ref()).map_err(|e| fail(format!("loading device memory back: {e}"), None))?;
            let fd = mem.export_fd().map_err(|e| self.cuda_fail("exporting device memory", e))?;
            conn.call(&Request::Load { id }, Some(&fd))?;
        }
        conn.call(&Request::Resume, None).map(|_| ())
    }

    /// Hands `held` back over `conn` and opens the agent's gate.
    fn give_back_on(conn: &Conn, held: &[Held]) -> Result<(), EngineError> {
        for h in held {
            conn.call(&Request::Load { id: h.id }, Some(&h.fd))?;
        }
        conn.call(&Request::Resume, None).map(|_| ())
    }

    /// Hands `held` back to the agent of `pid` and opens its gate.
    fn give_back(&self, pid: i32, name: &str, held: &[Held]) -> Result<(), EngineError> {
        Self::give_back_on(&Conn::open(pid, name)?, held)
    }
}

impl DeviceEngine for AgentEngine {
    fn name(&self) -> &'static str {
        ENGINE
    }

    fn claim(&self, tree: &[ProcessInfo]) -> Result<Vec<i32>, EngineError> {
        let mut pids = Vec::new();
        let mut st = self.state();
        for p in tree.iter().filter(|p| p.uses_nvidia) {
            let Some(token) = agent_token(p.pid) else { continue };
            let name = hiber_wire::socket_name(&token, p.ns_pid);
            let status = match Conn::open(p.pid, &name).and_then(|c| c.call(&Request::Status, None)) {
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
            st.targets.insert(p.pid, Target { name, ns_pid: p.ns_pid, comm: p.comm.clone(), status });
            pids.push(p.pid);
        }
        Ok(pids)
    }

    fn quiesce(&self, pids: &[i32], target: &CaptureTarget<'_>) -> Result<(), EngineError> {
        // hiber holds one descriptor per allocation (PyTorch's expandable segments make
        // hundreds). Raised here, not at load, so that jobs hiber starts keep their limit.
        crate::sys::raise_open_files_limit();
        let start = Instant::now();
        let targets: Vec<(i32, Target)> = {
            let st = self.state();
            pids.iter().filter_map(|p| st.targets.get(p).map(|t| (*p, t.clone()))).filter(|(_, t)| t.status.tracked > 0).collect()
        };
        // A device snapshot lets the application run again before the data reaches the
        // disk; it needs room on the GPU beside the memory it copies.
        let snapshot = target.leave_running && {
            let total: u64 = targets.iter().map(|(_, t)| t.status.tracked_bytes).sum();
            (0..self.gpus.cuda.device_count().unwrap_or(0)).all(|d| self.gpus.free_bytes(d).map(|f| f >= total + SNAPSHOT_MARGIN).unwrap_or(false))
        };
        let mut done: Vec<(i32, Target, Vec<Held>)> = Vec::new();
        let mut written = Vec::new();
        for (pid, t) in targets {
            match self.take(pid, &t, target, snapshot) {
                Ok((held, w)) => {
                    written.extend(w);
                    done.push((pid, t, held));
                }
                Err(e) => {
                    for (pid, t, held) in &done {
                        let _ = self.give_back(*pid, &t.name, held);
                    }
                    return Err(e);
                }
            }
        }
        let copy_seconds = start.elapsed().as_secs_f64();
        let mut st = self.state();
        st.dir = Some(target.dir.to_path_buf());
        st.written = written;
        let mut processes = Vec::new();
        for (pid, t, held) in done {
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
                        files: device::chunk_files(&format!("{ENGINE}/{}/{}", t.ns_pid, h.id), h.mem.size),
                    })
                    .collect(),
                passthrough: passthrough(&t.status),
            });
            st.held.insert(pid, held);
        }
        // Processes with an agent that tracked nothing: recorded for what they left to the driver.
        for t in st.targets.iter().filter(|(p, t)| pids.contains(p) && t.status.tracked == 0).map(|(_, t)| t) {
            processes.push(AgentProcess { ns_pid: t.ns_pid, comm: t.comm.clone(), bytes: 0, allocations: Vec::new(), passthrough: passthrough(&t.status) });
        }
        st.section = Some(Section {
            mode: if snapshot { "device-snapshot" } else { "direct" }.into(),
            chunk_bytes: device::CHUNK,
            gpus: cuda::nvml_gpus(),
            processes,
            quiesce_seconds: start.elapsed().as_secs_f64(),
            copy_seconds,
        });
        Ok(())
    }

    fn capture(&self, _pids: &[i32], _tree: &[ProcessInfo], _dir: &Path) -> Result<serde_json::Value, EngineError> {
        let st = self.state();
        let section = st.section.as_ref().ok_or_else(|| fail("capture before quiesce".into(), None))?;
        Ok(serde_json::to_value(section).expect("section serializes"))
    }

    fn resume(&self, pids: &[i32]) -> Result<(), EngineError> {
        let mut first = None;
        for &pid in pids {
            let (held, name) = {
                let mut st = self.state();
                (st.held.remove(&pid), st.targets.get(&pid).map(|t| t.name.clone()))
            };
            let name = match name.or_else(|| recovered_name(pid)) {
                Some(n) => n,
                None => continue,
            };
            let r = match held {
                Some(held) => {
                    let mut r = self.give_back(pid, &name, &held);
                    let mut st = self.state();
                    let ns_pid = st.targets.get(&pid).map(|t| t.ns_pid).unwrap_or(pid);
                    if r.is_err() {
                        // hiber holds the only reference and is about to fail: put the memory
                        // where `hiber recover` looks for it (in direct mode it is there already).
                        if let Some(dir) = st.dir.clone() {
                            let image = dir.parent().unwrap_or(&dir).to_path_buf();
                            let mems: Vec<(&DeviceMem, String)> = held
                                .iter()
                                .map(|h| (&h.mem, format!("{ENGINE}/{ns_pid}/{}", h.id)))
                                .filter(|(_, p)| !image.join(format!("{p}.00000")).exists())
                                .collect();
                            if let Err(e) = device::save(&self.gpus, &mems, &image) {
                                r = r.map_err(|x| fail(format!("{x}; and saving the memory for `hiber recover` failed too: {e}"), None));
                            }
                        }
                    }
                    for h in held {
                        if let Some(s) = h.snapshot {
                            st.pending.push((s, format!("{ENGINE}/{ns_pid}/{}", h.id)));
                        }
                    }
                    r
                }
                // Nothing held (an undo before the handover, or `hiber recover`): open the gate.
                None => match Conn::open(pid, &name) {
                    Ok(c) => c.call(&Request::Resume, None).map(|_| ()),
                    Err(_) => Ok(()),
                },
            };
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    fn recover(&self, pids: &[i32], dirs: &[&Path]) -> Result<(), EngineError> {
        let mut first = None;
        for &pid in pids {
            if let Err(e) = self.recover_one(pid, dirs) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    fn finish(&self) -> Result<Vec<FileEntry>, EngineError> {
        let (pending, dir, mut written) = {
            let mut st = self.state();
            (std::mem::take(&mut st.pending), st.dir.clone(), std::mem::take(&mut st.written))
        };
        if !pending.is_empty() {
            let dir = dir.ok_or_else(|| fail("finish before quiesce".into(), None))?;
            let mems: Vec<(&DeviceMem, String)> = pending.iter().map(|(m, p)| (m, p.clone())).collect();
            written.extend(device::save(&self.gpus, &mems, dir.parent().unwrap_or(&dir)).map_err(|e| fail(format!("writing device memory: {e}"), None))?);
        }
        Ok(written)
    }

    fn check_restore(&self, value: &serde_json::Value, opts: &DeviceRestoreOptions) -> Result<(), EngineError> {
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
        Ok(())
    }

    fn restore(&self, value: &serde_json::Value, pids: &[RestoredPid], opts: &DeviceRestoreOptions) -> Result<(), EngineError> {
        let section = section(value)?;
        let map = gpu_map(&section, &cuda::nvml_gpus(), opts)?;
        for p in section.processes.iter().filter(|p| !p.allocations.is_empty()) {
            let now = pids
                .iter()
                .find(|r| r.ns_pid == p.ns_pid)
                .ok_or_else(|| fail(format!("restored tree has no process with namespace PID {} ({})", p.ns_pid, p.comm), None))?;
            let name = recovered_name(now.pid).ok_or_else(|| fail(format!("process {} has no agent token in its environment", now.pid), None))?;
            let t0 = Instant::now();
            let mut mems = Vec::new();
            for a in &p.allocations {
                let uuid = map.get(&a.gpu).cloned().unwrap_or_else(|| a.gpu.clone());
                let dev = self.gpus.ordinal(&uuid).map_err(|e| self.cuda_fail("listing GPUs", e))?.ok_or_else(|| fail(format!("no GPU {uuid} here"), None))?;
                let mem = DeviceMem::create(&self.gpus, a.size, dev, true).map_err(|e| self.cuda_fail("allocating device memory", e))?;
                mems.push((a.id, mem));
            }
            let jobs: Vec<(&DeviceMem, String)> = mems.iter().map(|(id, m)| (m, format!("{ENGINE}/{}/{id}", p.ns_pid))).collect();
            let t1 = Instant::now();
            device::load(&self.gpus, &jobs, &opts.image_dir, Some(&opts.checksums))
                .map_err(|e| fail(format!("loading device memory: {e}"), Some("the image cannot be trusted; checkpoint again")))?;
            let t2 = Instant::now();
            let conn = Conn::open(now.pid, &name)?;
            for (id, m) in &mems {
                let fd = m.export_fd().map_err(|e| self.cuda_fail("exporting device memory", e))?;
                conn.call(&Request::Load { id: *id }, Some(&fd))?;
            }
            conn.call(&Request::Resume, None)?;
            tracing::info!(
                pid = now.pid,
                create_s = (t1 - t0).as_secs_f64(),
                load_s = (t2 - t1).as_secs_f64(),
                handover_s = t2.elapsed().as_secs_f64(),
                bytes = p.bytes,
                "agent memory restored"
            );
        }
        Ok(())
    }

    fn describe(&self, value: &serde_json::Value) -> Vec<String> {
        describe(value)
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
