//! The agent engine's checkpoint: quiesce each process through its agent, take its device
//! memory, copy it where the application does not need it (hiber's memory on the same GPU,
//! the host staging area) or write it, release, and after the dump hand it back and write
//! the copies.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use hiber_wire::agent::{Reply, Request};
use hiber_wire::socket;

use super::device::{self, DeviceMem, Gpus, Place, GRANULE};
use super::{chunk_prefix, connect, cuda_fail, fail, nccl, passthrough, AgentProcess, Allocation, Mode, Placed, Section, Target};
use crate::coordinator::Coordinator;
use crate::engine::cuda::{self, ffi, ffi::Staging};
use crate::engine::layer::Conn;
use crate::engine::{CheckpointOptions, CheckpointSession, EngineError};
use crate::image::{FileEntry, ImageSink};
use crate::proctree::ProcessInfo;

/// Room left on a GPU beside hiber's copies, for the driver's own needs.
const SNAPSHOT_MARGIN: u64 = 1 << 30;
/// Host memory a staging area leaves to everything else: a tenth of the machine, and at
/// least this much.
const HOST_RESERVE_MIN: u64 = 2 << 30;

/// What hiber took from one process.
struct Taken {
    held: Vec<Held>,
    /// Allocations of other processes it had open through the agent's CUDA IPC.
    imports: u64,
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

/// Holds every process's copy until all of them are quiesced (a checkpoint of several
/// processes): one that has memory of another open through the agent's CUDA IPC could,
/// running on, write that memory after it was copied.
struct AllQuiesced {
    /// Processes arrived, and whether one failed before it could.
    state: Mutex<(usize, bool)>,
    cv: std::sync::Condvar,
    n: usize,
}

impl AllQuiesced {
    fn new(n: usize) -> AllQuiesced {
        AllQuiesced { state: Mutex::new((0, false)), cv: std::sync::Condvar::new(), n }
    }

    /// Waits for the others; `false` when one of them failed.
    fn arrive(&self) -> bool {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        g.0 += 1;
        self.cv.notify_all();
        while g.0 < self.n && !g.1 {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        !g.1
    }

    fn fail(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.cv.notify_all();
    }
}

/// Fails the barrier when a process's take ends before it arrived.
struct ArriveOrFail<'a> {
    barrier: Option<&'a AllQuiesced>,
    arrived: std::cell::Cell<bool>,
}

impl ArriveOrFail<'_> {
    fn arrive(&self) -> bool {
        self.arrived.set(true);
        self.barrier.is_none_or(AllQuiesced::arrive)
    }
}

impl Drop for ArriveOrFail<'_> {
    fn drop(&mut self) {
        if let (Some(b), false) = (self.barrier, self.arrived.get()) {
            b.fail();
        }
    }
}

/// One allocation hiber holds during a checkpoint.
struct Held {
    id: u64,
    /// The descriptor the agent sent: given back as it is.
    fd: OwnedFd,
    mem: DeviceMem,
    gpu: String,
}

/// Hands `held` back over `conn`.
fn load_on(conn: &Conn, held: &[Held]) -> Result<(), EngineError> {
    for h in held {
        conn.call::<Reply>(&Request::Load { id: h.id }, Some(&h.fd))?;
    }
    Ok(())
}

/// Hands `held` back over `conn` and opens the agent's gate.
fn give_back_on(conn: &Conn, held: &[Held]) -> Result<(), EngineError> {
    load_on(conn, held)?;
    conn.call::<Reply>(&Request::Resume, None).map(|_| ())
}

/// The agent's share of one checkpoint: the processes it claimed and the memory hiber
/// holds for them until it hands it back.
pub(super) struct AgentCheckpoint {
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
    /// The processes whose agents keep NCCL communicators, cut together before the others
    /// quiesce; and whether their communicators are torn down now.
    nccl: Vec<nccl::Rank>,
    nccl_down: bool,
    /// What `prepare` took, while the application ran.
    staging_seconds: f64,
    /// With `--leave-running`: holds a reference to what the agents release until they have
    /// it back, so that a hiber killed meanwhile does not free it (`hiber recover`).
    keeper: Option<crate::keeper::Keeper>,
}

impl AgentCheckpoint {
    pub(super) fn new(gpus: Arc<Gpus>, timeout_ms: u64, opts: CheckpointOptions, targets: Vec<Target>) -> AgentCheckpoint {
        let nccl = targets.iter().filter(|t| t.status.nccl > 0).map(|t| nccl::Rank { pid: t.pid, name: t.name.clone() }).collect();
        AgentCheckpoint {
            staging: None,
            gpus,
            timeout_ms,
            opts,
            pids: targets.iter().map(|t| t.pid).collect(),
            targets,
            held: HashMap::new(),
            saving: Mutex::new(()),
            device_room: Mutex::new(HashMap::new()),
            host_used: AtomicUsize::new(0),
            copies: HashMap::new(),
            pending: Copies::default(),
            written: Vec::new(),
            section: None,
            nccl,
            nccl_down: false,
            staging_seconds: 0.0,
            keeper: None,
        }
    }

    /// Gives the keeper a reference to each allocation of `held` (process `pid`), before
    /// the agent lets its own go. Without a keeper, or if it fails, the checkpoint goes on
    /// as before: hiber then holds the only reference until the hand-back.
    fn keep(&self, pid: i32, held: &[Held]) {
        let Some(k) = &self.keeper else { return };
        let Some(start) = k.start_of(pid) else { return };
        // Inside the pause: a keeper that does not answer at once is not waited for.
        let kept = crate::keeper::Conn::open(pid, start, crate::keeper::IN_PAUSE).and_then(|c| held.iter().try_for_each(|h| c.hold(h.id, h.fd.as_fd())));
        if let Err(e) = kept {
            tracing::warn!(pid, error = %e, "the keeper could not take all of this process's memory: a hiber killed before the hand-back would lose what it lacks");
        }
    }

    /// Process `pid` has its memory back: the keeper lets its references go.
    fn unkeep(&self, pid: i32) {
        let Some(k) = &self.keeper else { return };
        let Some(start) = k.start_of(pid) else { return };
        if let Err(e) = crate::keeper::Conn::open(pid, start, crate::keeper::IN_PAUSE).and_then(|c| c.done()) {
            tracing::debug!(pid, error = %e, "the keeper did not take the end of its hold");
        }
    }

    /// Quiesces one process and takes its memory; on error the process is as before.
    /// On error, what hiber still holds and could not hand back at once comes with it, for
    /// [`CheckpointSession::resume`] to hand back (or save for `hiber recover`).
    fn take(&self, t: &Target, sink: &dyn ImageSink, barrier: Option<&AllQuiesced>) -> Result<Taken, (EngineError, Vec<Held>)> {
        let pid = t.pid;
        let asked = Instant::now();
        let gate = ArriveOrFail { barrier, arrived: std::cell::Cell::new(false) };
        let conn = connect(pid, &t.name).map_err(|e| (e, Vec::new()))?;
        // The agent bounds its wait for calls in flight; a kernel still running when it
        // synchronizes is bounded here. Timing out closes the connection, and the agent,
        // finding no one to hand its memory to, opens its gate again.
        let _ = socket::set_recv_timeout(&conn.sock, Some(std::time::Duration::from_millis(self.timeout_ms + 500)));
        conn.send(&Request::Quiesce { timeout_ms: self.timeout_ms }, None).map_err(|e| (e, Vec::new()))?;
        let mut held = Vec::new();
        let mut imports = t.status.agent_ipc;
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
                    (Reply::Done { count }, _) if count == held.len() as u64 => {
                        // With its gate closed, what it has open of other processes' memory
                        // no longer changes: that is what its image records.
                        if let Reply::Status(st) = conn.call::<Reply>(&Request::Status, None)? {
                            imports = st.agent_ipc;
                        }
                        break;
                    }
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
            if !gate.arrive() {
                return Err(fail("another process of the job could not quiesce", Some("the application keeps running; see that process's error")));
            }
            let quiesced = Instant::now();
            let mems: Vec<(&DeviceMem, String)> = held.iter().map(|h| (&h.mem, chunk_prefix(t.ns_pid, h.id))).collect();
            let mut all = device::chunks(&mems);
            // Fingerprinted where they are, so that what the parent image holds already is
            // neither copied nor written, and the next checkpoint can tell the same of this.
            match device::fingerprints(&self.gpus, &all) {
                Ok(fps) => all.iter_mut().zip(fps).for_each(|(c, fp)| c.fp = fp),
                Err(e) => tracing::warn!(pid, error = %e, "no fingerprints; unchanged chunks are found by copying them"),
            }
            // Memory never written (most of a pool reserved up front) needs no copy.
            for c in all.iter_mut().filter(|c| c.fp.is_some() && c.fp == super::fingerprint::of_zeros(c.len)) {
                c.at = Place::Zero;
            }
            let fingerprinted = Instant::now();
            let in_parent = |c: &device::Chunk| c.at != Place::Zero && c.fp.as_deref().is_some_and(|fp| sink.parent_fingerprint(fp));
            let unchanged: u64 = all.iter().filter(|c| in_parent(c)).map(|c| c.len as u64).sum();
            let zeros: u64 = all.iter().filter(|c| c.at == Place::Zero).map(|c| c.len as u64).sum();
            let (copies, direct, placed) = if self.opts.leave_running { self.place(all, sink)? } else { (Copies::default(), all, Placed::default()) };
            let mut placed = placed;
            placed.unchanged = unchanged;
            placed.zeros = zeros;
            // A stopping checkpoint shares the unchanged chunks now (`save`), or writes them.
            placed.direct = direct.iter().filter(|c| c.at != Place::Zero && !in_parent(c)).map(|c| c.len as u64).sum();
            let copied = Instant::now();
            let written = if direct.is_empty() {
                Vec::new()
            } else {
                // One process's memory at a time: each save runs its own pinned buffers and
                // workers, and the disk is the limit anyway.
                let _one = self.saving.lock().unwrap_or_else(|e| e.into_inner());
                device::save(&self.gpus, &direct, None, sink).map_err(|e| fail(format!("writing device memory: {e}"), None))?
            };
            let released = Instant::now();
            self.keep(pid, &held);
            conn.call::<Reply>(&Request::Release, None)?;
            conn.wait_closed();
            tracing::info!(
                pid,
                device_mib = placed.device >> 20,
                host_mib = placed.host >> 20,
                direct_mib = placed.direct >> 20,
                unchanged_mib = placed.unchanged >> 20,
                zeros_mib = placed.zeros >> 20,
                quiesce_s = (quiesced - asked).as_secs_f64(),
                fingerprint_s = (fingerprinted - quiesced).as_secs_f64(),
                copy_s = (copied - fingerprinted).as_secs_f64(),
                direct_s = (released - copied).as_secs_f64(),
                release_s = released.elapsed().as_secs_f64(),
                "device memory taken"
            );
            Ok((written, copies, placed))
        })();
        // A take that failed before its quiesce releases the others now, not after its undo.
        drop(gate);
        match taken {
            Ok((written, copies, placed)) => Ok(Taken { held, imports, written, copies, placed }),
            // After a timeout the agent is still busy and released nothing: it opens its
            // gate itself once it finds the connection closed, and hiber's references go.
            Err(e) if timed_out => Err((e, Vec::new())),
            // Otherwise the agent gets back whatever it released and opens its gate; if
            // even that fails, the memory stays with the session for resume.
            Err(e) => match give_back_on(&conn, &held) {
                Ok(()) => {
                    self.unkeep(pid);
                    Err((e, Vec::new()))
                }
                Err(_) => Err((e, held)),
            },
        }
    }
}

impl AgentCheckpoint {
    /// Copies each chunk of `all` (a process's memory, on its GPUs) to hiber's memory on
    /// the same GPU while that has room, else to the staging area while that has room.
    /// Returns the copies, the chunks that fit in neither (to be written before the
    /// release), and the bytes copied each way. A chunk whose fingerprint the parent image
    /// holds is not copied: the image shares the parent's ([`Place::Parent`]).
    fn place(&self, all: Vec<device::Chunk>, sink: &dyn ImageSink) -> Result<(Copies, Vec<device::Chunk>, Placed), EngineError> {
        // Zeros and what the parent holds stay where they are; the rest is copied.
        let (nowhere, all): (Vec<device::Chunk>, Vec<device::Chunk>) =
            all.into_iter().partition(|c| c.at == Place::Zero || c.fp.as_deref().is_some_and(|fp| sink.parent_fingerprint(fp)));
        let mut want: BTreeMap<i32, u64> = BTreeMap::new();
        for c in &all {
            if let Place::Gpu { dev, .. } = c.at {
                *want.entry(dev).or_default() += c.len as u64;
            }
        }
        // One arena per GPU, as large as this process needs and the GPU's room allows.
        let made = Instant::now();
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
        tracing::debug!(
            arenas = arenas.len(),
            mib = arenas.iter().map(|a| a.size).sum::<u64>() >> 20,
            seconds = made.elapsed().as_secs_f64(),
            "copy arenas made"
        );
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
        let mut chunks: Vec<device::Chunk> = from.into_iter().zip(to).map(|(c, at)| device::Chunk { at, ..c }).collect();
        chunks.extend(nowhere.into_iter().map(|c| if c.at == Place::Zero { c } else { device::Chunk { at: Place::Parent, ..c } }));
        Ok((Copies { chunks, arenas }, direct, placed))
    }

    /// Makes room for the copies a `--leave-running` checkpoint makes: measures each GPU's
    /// room, and when the GPUs lack room for all of `total` device bytes (`held` on each
    /// GPU, when known: see [`host_need`]), prepares a page-locked staging area in host
    /// memory for the rest (while the application still runs: 0.1-0.25 s per GiB measured
    /// on an H100 machine). Host memory too small is said, and what fits in neither is
    /// written before the release, as a stopping checkpoint does.
    fn prepare_copies(&mut self, total: u64, held: Option<HashMap<i32, u64>>) {
        let mut room = HashMap::new();
        for d in 0..self.gpus.cuda.device_count().unwrap_or(0) {
            room.insert(d, self.gpus.free_bytes(d).map_or(0, |f| f.saturating_sub(SNAPSHOT_MARGIN)));
        }
        let need = host_need(total, &room, held.as_ref());
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

    /// What each GPU holds of the job's memory that will need a copy: neither zeros (memory
    /// never written, most of a pool reserved up front) nor held by the parent image, as the
    /// job runs now, with room to change more before the pause (a quarter more, and 2 GiB);
    /// so that a job whose pool is mostly untouched, or whose weights did not change, gets a
    /// staging area for what it must copy, not for all its memory (pinning takes 0.1-0.25 s
    /// per GiB: 16 s for a full H100). `None` when that cannot be told: then the copies are
    /// sized for everything.
    ///
    /// The agents hand hiber their allocations without stopping the job (`peek`); hiber
    /// fingerprints them where they are and lets them go. What it reads is a glimpse, not a
    /// checkpoint: the pause fingerprints again, and a chunk that changed since, beyond the
    /// room left for it, is written before the job resumes.
    fn to_copy(&self, busy: &[Target], sink: &dyn ImageSink) -> Option<HashMap<i32, u64>> {
        if busy.is_empty() || !super::fingerprint::enabled() {
            return None;
        }
        let start = Instant::now();
        let mut copy: HashMap<i32, u64> = HashMap::new();
        let mut whole: HashMap<i32, u64> = HashMap::new();
        for t in busy {
            let mems = match self.peek(t) {
                Ok(m) => m,
                Err(e) => {
                    tracing::debug!(pid = t.pid, error = %e, "could not look at the job's memory before the pause; copies sized for all of it");
                    return None;
                }
            };
            let named: Vec<(&DeviceMem, String)> = mems.iter().map(|m| (m, String::new())).collect();
            let chunks = device::chunks(&named);
            let fps = device::fingerprints(&self.gpus, &chunks).ok()?;
            for (c, fp) in chunks.iter().zip(fps) {
                let Place::Gpu { dev, .. } = c.at else { continue };
                *whole.entry(dev).or_default() += c.len as u64;
                let copied = fp.is_none_or(|fp| !sink.parent_fingerprint(&fp) && Some(fp) != super::fingerprint::of_zeros(c.len));
                if copied {
                    *copy.entry(dev).or_default() += c.len as u64;
                }
            }
        }
        let estimate: HashMap<i32, u64> = whole.iter().map(|(d, &all)| (*d, all.min(copy.get(d).map_or(0, |&c| c + c / 4) + (2 << 30)))).collect();
        tracing::info!(
            to_copy_mib = copy.values().sum::<u64>() >> 20,
            of_mib = whole.values().sum::<u64>() >> 20,
            seconds = start.elapsed().as_secs_f64(),
            "to copy, as the job ran before the pause"
        );
        Some(estimate)
    }

    /// The job's memory in process `t`, as its agent hands it over without stopping it.
    fn peek(&self, t: &Target) -> Result<Vec<DeviceMem>, EngineError> {
        let conn = connect(t.pid, &t.name)?;
        let _ = socket::set_recv_timeout(&conn.sock, Some(std::time::Duration::from_secs(5)));
        conn.send(&Request::Peek, None)?;
        let mut mems = Vec::new();
        loop {
            match conn.recv::<Reply>()? {
                (Reply::Alloc { size, .. }, Some(fd)) => {
                    mems.push(DeviceMem::import(&self.gpus, fd.as_fd(), size).map_err(|e| cuda_fail(&self.gpus, "importing device memory from the agent", e))?)
                }
                (Reply::Done { count }, _) if count == mems.len() as u64 => return Ok(mems),
                (Reply::Err(m), _) => return Err(fail(format!("agent of process {}: {m}", t.pid), None)),
                (other, _) => return Err(fail(format!("agent of process {}: unexpected {other:?}", t.pid), None)),
            }
        }
    }

    /// Starts the keeper for the processes `pids` (this hiber's own binary, `hiber __keep`),
    /// while the application runs.
    fn start_keeper(&mut self, pids: &[i32]) {
        let targets: Vec<(i32, u64)> = pids.iter().filter_map(|&pid| crate::proctree::stat(pid).ok().map(|s| (pid, s.start_time))).collect();
        if targets.is_empty() {
            return;
        }
        // hiber's own binary, also when it was replaced on disk since it started.
        match crate::keeper::Keeper::start(std::path::Path::new("/proc/self/exe"), &targets) {
            Ok(k) => self.keeper = Some(k),
            Err(e) => tracing::warn!(error = %e, "no keeper: a hiber killed between the release and the hand-back would lose the job's device memory"),
        }
    }

    /// Loads the fingerprint kernel on each GPU where the processes `pids` hold memory (on
    /// every GPU when NVML cannot say).
    fn warm_fingerprints(&self, pids: &[i32]) {
        if pids.is_empty() || !super::fingerprint::enabled() {
            return;
        }
        let devs: Vec<i32> = match self.held_by_gpu(pids) {
            Some(held) => held.into_iter().filter(|&(_, b)| b > 0).map(|(d, _)| d).collect(),
            None => (0..self.gpus.cuda.device_count().unwrap_or(0)).collect(),
        };
        for d in devs {
            self.gpus.fingerprint_kernel(d);
        }
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
/// processes hold on each GPU as NVML accounts it, and `total` what their agents track.
///
/// NVML does not count memory a process imported, and the memory hiber hands back after a
/// `--leave-running` checkpoint is imported: from the second checkpoint of a job on, NVML
/// sees its contexts and little else (on an H100, a job holding 77 GiB got no staging area
/// at its second checkpoint and wrote its memory before it resumed). Where NVML accounts
/// less than `total`, the whole `total` is set against the least room among the GPUs NVML
/// sees the job on (against every GPU without NVML): more than needed when the job spans
/// GPUs, never less.
fn host_need(total: u64, room: &HashMap<i32, u64>, held: Option<&HashMap<i32, u64>>) -> u64 {
    let over = |bytes: u64, room: u64| match bytes.saturating_sub(room) {
        0 => 0,
        n => n + device::CHUNK,
    };
    let need = match held {
        Some(held) if held.values().sum::<u64>() >= total => held.iter().map(|(d, &bytes)| over(bytes, room.get(d).copied().unwrap_or(0))).sum(),
        _ => {
            let on: Vec<i32> = match held {
                Some(held) => held.iter().filter(|(_, &b)| b > 0).map(|(&d, _)| d).collect(),
                None => room.keys().copied().collect(),
            };
            let least = on.iter().map(|d| room.get(d).copied().unwrap_or(0)).min().unwrap_or(0);
            match over(total, least) {
                0 => 0,
                n => n + device::CHUNK * (on.len().max(1) as u64 - 1),
            }
        }
    };
    need.next_multiple_of(device::CHUNK)
}

impl CheckpointSession for AgentCheckpoint {
    fn pids(&self) -> &[i32] {
        &self.pids
    }

    fn restores_peer_access(&self) -> bool {
        true
    }

    fn stateful(&self) -> Vec<i32> {
        self.targets.iter().filter(|t| t.busy()).map(|t| t.pid).collect()
    }

    fn prepare(&mut self, sink: &dyn ImageSink) {
        // hiber holds one descriptor per allocation (PyTorch's expandable segments make
        // hundreds), from its look before the pause on. Raised here, not at load, so that
        // jobs hiber starts keep their limit.
        crate::sys::raise_open_files_limit();
        let staging_start = Instant::now();
        let busy: Vec<Target> = self.targets.iter().filter(|t| t.busy()).cloned().collect();
        let pids: Vec<i32> = busy.iter().map(|t| t.pid).collect();
        // The driver compiles the fingerprint kernel for each GPU the job uses (tens of
        // milliseconds, once per hiber).
        self.warm_fingerprints(&pids);
        // Copies let the application run again before the data reaches the disk.
        if self.opts.leave_running {
            self.start_keeper(&pids);
            let (total, held) = match self.to_copy(&busy, sink) {
                Some(copy) => (copy.values().sum(), Some(copy)),
                None => (busy.iter().map(|t| t.status.tracked_bytes).sum(), self.held_by_gpu(&pids)),
            };
            self.prepare_copies(total, held);
        }
        self.staging_seconds = staging_start.elapsed().as_secs_f64();
    }

    fn quiesce(&mut self, sink: &dyn ImageSink, peers: &dyn Coordinator) -> Result<(), EngineError> {
        crate::sys::raise_open_files_limit();
        let busy: Vec<Target> = self.targets.iter().filter(|t| t.busy()).cloned().collect();
        let staging_seconds = self.staging_seconds;
        let start = Instant::now();
        // Ranks of an NCCL job first stop at one point of their collectives, all of them,
        // and let their communicators go: only then can each quiesce on its own.
        if !self.nccl.is_empty() {
            if let Err((e, down)) = nccl::cut(&self.nccl, self.timeout_ms, peers, std::env::var(nccl::NET_OPT_IN).is_ok_and(|v| v == "1")) {
                self.nccl_down = down;
                return Err(e);
            }
            self.nccl_down = true;
        }
        // The processes of a job are quiesced together: ranks that wait on each other
        // must all stop at once, and the copies overlap.
        // Memory is copied once every process is quiesced: one may have opened another's
        // (legacy CUDA IPC through the agent, perhaps since hiber first asked) and would
        // write it after its copy.
        let barrier = (busy.len() > 1).then(|| AllQuiesced::new(busy.len()));
        let results: Vec<Result<Taken, (EngineError, Vec<Held>)>> = std::thread::scope(|s| {
            let this = &*self;
            let barrier = barrier.as_ref();
            let handles: Vec<_> = busy
                .iter()
                .map(|t| {
                    let spawned = std::thread::Builder::new().name("hiber-quiesce".into()).spawn_scoped(s, move || this.take(t, sink, barrier));
                    // A process never taken must not leave the others waiting for it.
                    if let (Err(_), Some(b)) = (&spawned, barrier) {
                        b.fail();
                    }
                    spawned
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| Err((fail("a quiesce thread panicked", None), Vec::new()))),
                    Err(e) => Err((fail(format!("cannot start a thread to quiesce a process: {e}"), None), Vec::new())),
                })
                .collect()
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
        let machine = cuda::nvml_gpus();
        let mut processes = Vec::new();
        let mut placed = Placed::default();
        for t in &self.targets {
            let Some((_, Taken { held, imports, written, copies, placed: p })) = done.iter_mut().find(|(pid, _)| *pid == t.pid) else {
                // An agent that tracked nothing: recorded for what it left to the driver.
                processes.push(AgentProcess {
                    ns_pid: t.ns_pid,
                    comm: t.comm.clone(),
                    bytes: 0,
                    allocations: Vec::new(),
                    passthrough: passthrough(&t.status),
                    visible: Vec::new(),
                    ipc_imports: 0,
                });
                continue;
            };
            self.written.append(written);
            let used: Vec<&str> = held.iter().map(|h| h.gpu.as_str()).collect();
            let visible = super::visible_subset(t.pid, &machine, &used);
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
                visible,
                ipc_imports: *imports,
            });
            self.held.insert(t.pid, std::mem::take(held));
            self.copies.insert(t.pid, std::mem::take(copies));
            placed.add(p);
        }
        self.section = Some(Section {
            mode: Mode::of(&placed),
            chunk_bytes: device::CHUNK,
            gpus: machine,
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

    fn resume(&mut self, sink: &dyn ImageSink, peers: &dyn Coordinator) -> Result<(), EngineError> {
        let mut first = None;
        let mut not_back = Vec::new();
        let start = Instant::now();
        // Every process gets its memory back before any resumes: one that opened memory of
        // another through CUDA IPC maps it again as it resumes (hiber-agent's `ipc`).
        let mut to_resume: Vec<(i32, Conn)> = Vec::new();
        for t in &self.targets {
            if !crate::proctree::alive(t.pid) {
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
                    let mut r = connect(t.pid, &t.name).and_then(|c| load_on(&c, &held).map(|()| Some(c)));
                    if let Err(e) = r {
                        // hiber holds the only reference and is about to fail: put the memory
                        // where `hiber recover` looks for it (in direct mode it is there already).
                        let mems: Vec<(&DeviceMem, String)> = held.iter().map(|h| (&h.mem, chunk_prefix(t.ns_pid, h.id))).collect();
                        let missing: Vec<device::Chunk> = device::chunks(&mems).into_iter().filter(|c| !sink.has_file(&c.rel)).collect();
                        r = Err(match device::save(&self.gpus, &missing, None, sink) {
                            Ok(_) => e,
                            Err(x) => fail(format!("{e}; and saving the memory for `hiber recover` failed too: {x}"), None),
                        });
                    }
                    if let Some(c) = self.copies.remove(&t.pid) {
                        self.pending.chunks.extend(c.chunks);
                        self.pending.arenas.extend(c.arenas);
                    }
                    r
                }
                // Nothing held (an undo before the handover): open the gate.
                None => Ok(connect(t.pid, &t.name).ok()),
            };
            match r {
                Ok(Some(conn)) => to_resume.push((t.pid, conn)),
                Ok(None) => {}
                Err(e) => {
                    not_back.push(t.pid);
                    first.get_or_insert(e);
                }
            }
        }
        let loaded = start.elapsed().as_secs_f64();
        for (pid, conn) in to_resume {
            if let Err(e) = conn.call::<Reply>(&Request::Resume, None) {
                not_back.push(pid);
                first.get_or_insert(e);
            }
        }
        tracing::info!(load_s = loaded, resume_s = start.elapsed().as_secs_f64() - loaded, "device memory handed back");
        // The keeper lets go of what is back where it belongs (or whose process is gone),
        // and keeps what `hiber recover` may still need; before the rebuild, which may take
        // up to the quiesce timeout.
        for t in self.targets.iter().filter(|t| !not_back.contains(&t.pid)) {
            self.unkeep(t.pid);
        }
        // Every rank runs again (its gate open, its NCCL calls waiting): now the
        // communicators can be built again, by all ranks at once.
        // (A rank whose memory is not back cannot take part: the others would wait for it,
        // so all stay torn down, for `hiber recover`.)
        // A rank that died during the checkpoint is passed too: the rebuild sees it gone and
        // has the others' calls fail rather than wait for it.
        if self.nccl_down && !self.nccl.iter().any(|r| not_back.contains(&r.pid)) {
            match nccl::rebuild(&self.nccl, self.timeout_ms, peers) {
                Ok(()) => self.nccl_down = false,
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    fn collectives(&self) -> Vec<i32> {
        self.nccl.iter().map(|r| r.pid).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_copy_waits_for_every_quiesce_and_a_failure_releases_them() {
        let all = AllQuiesced::new(3);
        let arrived = std::thread::scope(|s| {
            let waiting: Vec<_> = (0..2).map(|_| s.spawn(|| ArriveOrFail { barrier: Some(&all), arrived: false.into() }.arrive())).collect();
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(waiting.iter().all(|h| !h.is_finished()), "nobody copies before the third is quiesced");
            assert!(ArriveOrFail { barrier: Some(&all), arrived: false.into() }.arrive());
            waiting.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        assert_eq!(arrived, vec![true, true]);

        let some = AllQuiesced::new(2);
        let failed = std::thread::scope(|s| {
            let waiting = s.spawn(|| ArriveOrFail { barrier: Some(&some), arrived: false.into() }.arrive());
            // The other process's take ends before its quiesce: its guard fails the barrier.
            drop(ArriveOrFail { barrier: Some(&some), arrived: false.into() });
            waiting.join().unwrap()
        });
        assert!(!failed, "a failed quiesce releases the others, who give up");
        assert!(ArriveOrFail { barrier: None, arrived: false.into() }.arrive(), "no barrier: nothing to wait for");
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
        // Unknown placement: against the least room of all GPUs, in whole chunks (a chunk
        // left over on each GPU).
        assert_eq!(host_need(71 * G, &room, None), 41 * G + 2 * c);
        assert_eq!(host_need(30 * G, &room, None), 0);
        assert_eq!(host_need(G, &HashMap::new(), None), G + c);
        assert_eq!(host_need(G + 5, &HashMap::new(), None) % c, 0);
        // NVML sees the job's context on GPU 0 but not the memory hiber handed back at an
        // earlier checkpoint (imported): the agents' total against GPU 0's room, not the
        // roomier GPU 1's, where the job is not.
        assert_eq!(host_need(47 * G, &room, Some(&[(0, G / 2), (1, 0)].into())), 17 * G + c);
        // Seen on both: against the lesser room, with a chunk for each GPU.
        assert_eq!(host_need(100 * G, &room, Some(&[(0, G), (1, G)].into())), 70 * G + 2 * c);
        assert_eq!(host_need(20 * G, &room, Some(&[(0, G / 2)].into())), 0);
    }
}
