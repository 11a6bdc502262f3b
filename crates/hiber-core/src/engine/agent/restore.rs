//! The agent engine's restore: the device memory of every allocation is created and loaded
//! (each chunk checked) from the moment the restore opens, beside CRIU, then handed to each
//! restored process's agent.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hiber_wire::agent::{Reply, Request};

use std::os::fd::AsFd;

use super::device::{self, DeviceMem, Gpus};
use super::{chunk_prefix, connect, cuda_fail, fail, recovered_name, Section};
use crate::engine::layer::Conn;
use crate::engine::{EngineError, RestoreSession, RestoredPid};

/// Device memory of each process (by namespace PID), loaded and checked: allocation ids
/// and the memory to hand over.
type LoadedMemory = HashMap<i32, Vec<(u64, DeviceMem)>>;

/// What the loader thread answers: the memory, and the seconds it took to create it and to
/// load it.
type Loading = std::thread::JoinHandle<Result<(LoadedMemory, f64, f64, device::LoadTimes), EngineError>>;

/// Creates the memory of every allocation of an image on its (mapped) GPU and streams the
/// chunks into it, checking each.
struct Loader {
    gpus: Arc<Gpus>,
    section: Section,
    /// Processes whose agents make their memory (namespace PIDs): not loaded ahead.
    made_by_agents: Vec<i32>,
    map: BTreeMap<String, String>,
    image_dir: PathBuf,
    checksums: HashMap<String, String>,
    stop: Arc<AtomicBool>,
}

impl Loader {
    fn run(self) -> Result<(LoadedMemory, f64, f64, device::LoadTimes), EngineError> {
        let t0 = Instant::now();
        let mut loaded: LoadedMemory = HashMap::new();
        let mut jobs = Vec::new();
        for p in self.section.processes.iter().filter(|p| !p.allocations.is_empty() && !self.made_by_agents.contains(&p.ns_pid)) {
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
        let times = device::load(&self.gpus, &jobs, &self.image_dir, Some(&self.checksums), Some(&self.stop))
            .map_err(|e| fail(format!("loading device memory: {e}"), Some("the image cannot be trusted; checkpoint again")))?;
        drop(jobs);
        Ok((loaded, (t1 - t0).as_secs_f64(), t1.elapsed().as_secs_f64(), times))
    }
}

/// The agent's share of one restore, checked against this machine's GPUs: its device
/// memory loads from the moment the restore opens, beside CRIU.
pub(super) struct AgentRestore {
    gpus: Arc<Gpus>,
    section: Section,
    loading: Option<Loading>,
    stop: Arc<AtomicBool>,
    timeout_ms: u64,
    made_by_agents: Vec<i32>,
    image_dir: PathBuf,
    checksums: HashMap<String, String>,
}

impl AgentRestore {
    /// Starts loading the section's device memory on its own thread (`map`: old GPU UUID →
    /// new), while the rest of the restore goes on.
    pub(super) fn start(
        gpus: Arc<Gpus>,
        section: Section,
        map: BTreeMap<String, String>,
        made_by_agents: Vec<i32>,
        image_dir: PathBuf,
        checksums: HashMap<String, String>,
        timeout_ms: u64,
    ) -> Result<AgentRestore, EngineError> {
        let stop = Arc::new(AtomicBool::new(false));
        let loader = Loader {
            gpus: gpus.clone(),
            section: section.clone(),
            made_by_agents: made_by_agents.clone(),
            map,
            image_dir: image_dir.clone(),
            checksums: checksums.clone(),
            stop: stop.clone(),
        };
        let loading = std::thread::Builder::new()
            .name("hiber-agent-load".into())
            .spawn(move || loader.run())
            .map_err(|e| fail(format!("starting the device memory loader: {e}"), None))?;
        Ok(AgentRestore { gpus, section, loading: Some(loading), stop, timeout_ms, made_by_agents, image_dir, checksums })
    }
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

impl AgentRestore {
    /// Has the agent make each allocation's memory (on its own device ordinal, which the
    /// driver's restore moved to the mapped GPU), fills it from the image, and hands it back.
    fn fill_agent_memory(&self, conn: &Conn, p: &super::AgentProcess) -> Result<(), EngineError> {
        for a in &p.allocations {
            let (fd, size) = match conn.send(&Request::Create { id: a.id }, None).and_then(|()| conn.recv::<Reply>())? {
                (Reply::Alloc { size, .. }, Some(fd)) => (fd, size),
                (Reply::Err(m), _) => return Err(fail(format!("agent of process {}: {m}", conn.pid), None)),
                (other, _) => return Err(fail(format!("agent of process {}: unexpected {other:?}", conn.pid), None)),
            };
            if size != a.size {
                return Err(fail(format!("agent of process {} made {size} bytes for allocation {}, which had {}", conn.pid, a.id, a.size), None));
            }
            let mem = DeviceMem::import(&self.gpus, fd.as_fd(), size).map_err(|e| cuda_fail(&self.gpus, "importing the agent's memory", e))?;
            device::load(&self.gpus, &[(&mem, chunk_prefix(p.ns_pid, a.id))], &self.image_dir, Some(&self.checksums), None)
                .map_err(|e| fail(format!("loading device memory: {e}"), Some("the image cannot be trusted; checkpoint again")))?;
            drop(mem);
            conn.call::<Reply>(&Request::Load { id: a.id }, Some(&fd))?;
        }
        tracing::info!(pid = conn.pid, allocations = p.allocations.len(), "device memory made by the agent, on a GPU the process could not see before");
        Ok(())
    }
}

impl RestoreSession for AgentRestore {
    fn restore(&mut self, pids: &[RestoredPid], peers: &dyn crate::coordinator::Coordinator) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let handle = self.loading.take().ok_or_else(|| fail("device memory restored twice", None))?;
        let (mut loaded, create_s, load_s, times) = handle.join().unwrap_or_else(|_| Err(fail("the device memory loader panicked", None)))?;
        let waited_s = t0.elapsed().as_secs_f64();
        // Where the load's time went (thread-seconds): what bounds the restore's rate.
        tracing::info!(
            create_s,
            load_s,
            gbps = times.bytes as f64 / load_s.max(1e-9) / 1e9,
            threads = times.threads,
            read_thread_s = times.read_s,
            verify_thread_s = times.verify_s,
            copy_thread_s = times.copy_s,
            "agent device memory loaded"
        );
        // Every process gets its memory before any resumes: one that opened memory of
        // another through CUDA IPC maps it again as it resumes (hiber-agent's `ipc`).
        let mut to_resume = Vec::new();
        for p in self.section.processes.iter().filter(|p| !p.allocations.is_empty() || p.ipc_imports > 0) {
            let now = pids
                .iter()
                .find(|r| r.ns_pid == p.ns_pid)
                .ok_or_else(|| fail(format!("restored tree has no process with namespace PID {} ({})", p.ns_pid, p.comm), None))?;
            let name = recovered_name(now.pid).ok_or_else(|| fail(format!("process {} has no agent token in its environment", now.pid), None))?;
            let t2 = Instant::now();
            let mems = loaded.remove(&p.ns_pid).unwrap_or_default();
            let conn = connect(now.pid, &name)?;
            if self.made_by_agents.contains(&p.ns_pid) {
                self.fill_agent_memory(&conn, p)?;
            }
            for (id, m) in &mems {
                let fd = m.export_fd().map_err(|e| cuda_fail(&self.gpus, "exporting device memory", e))?;
                conn.call::<Reply>(&Request::Load { id: *id }, Some(&fd))?;
            }
            tracing::info!(pid = now.pid, create_s, load_s, waited_s, handover_s = t2.elapsed().as_secs_f64(), bytes = p.bytes, "agent memory restored");
            to_resume.push(conn);
        }
        // Every process is resumed, whichever fails: a failure leaves only that one waiting.
        let mut first = None;
        for conn in to_resume {
            if let Err(e) = conn.call::<Reply>(&Request::Resume, None) {
                first.get_or_insert(e);
            }
        }
        if let Some(e) = first {
            return Err(e);
        }
        // The ranks of an NCCL job build their communicators again, all at once.
        let all: Vec<i32> = pids.iter().map(|r| r.pid).collect();
        super::nccl::rebuild(&super::nccl_down(&all), self.timeout_ms, peers)
    }
}
