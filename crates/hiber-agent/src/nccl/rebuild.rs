//! The rebuild: a unique id per communicator, then every communicator made again (on a
//! thread of its own, bounded), the application's calls let through once every rank is back.

use super::*;

/// A fresh unique id (this process is rank 0 of the communicator that will use it).
pub fn unique_id() -> Result<UniqueId, String> {
    let Some(f) = real!("ncclGetUniqueId" => FnUniqueId) else { return Err("libnccl is not loaded".into()) };
    let mut id = UniqueId { internal: [0; 128] };
    let dev = lock().device();
    // SAFETY: a valid out-pointer.
    match on_device(dev, || unsafe { f(&mut id) }) {
        SUCCESS => Ok(id),
        r => Err(format!("ncclGetUniqueId: error {r}")),
    }
}

/// The unique id communicator `key` is rebuilt with.
/// Every rank of it in this process takes it: a process that drives several GPUs (XLA's)
/// holds several ranks of one communicator.
pub fn set_id(key: u64, id: UniqueId) -> Result<(), String> {
    let mut s = lock();
    let mut found = false;
    for e in s.comms.values_mut().filter(|e| e.key() == key && !e.failed) {
        e.next_id = Some(id);
        found = true;
    }
    if !found {
        return Err(format!("no NCCL communicator {key:016x}"));
    }
    Ok(())
}

/// What one communicator is rebuilt from.
pub(super) struct Plan {
    pub(super) handle: usize,
    pub(super) rank: c_int,
    pub(super) nranks: c_int,
    pub(super) dev: c_int,
    pub(super) id: UniqueId,
    /// Its own copy of the recorded config: the creation thread may outlive the record.
    pub(super) config: Option<Config>,
}

/// One `ncclCommInitAll` call to make again: its members (handle, index), and the call's
/// device count and list.
pub(super) type AllCall = (Vec<(usize, usize)>, c_int, Vec<c_int>);

/// Every communicator to make again.
pub(super) struct Creation {
    pub(super) all: Vec<AllCall>,
    pub(super) plans: Vec<Plan>,
}

/// Makes the communicators of `c` (on a thread of its own: creation is collective and
/// waits for every rank). Returns each one's handle and real communicator.
pub(super) fn create(c: Creation, d: &'static cuda::Driver, init: FnInitConfig, init_all: FnInitAll, deadline: Instant) -> Result<Vec<(usize, usize)>, String> {
    // NCCL's group end sets the thread's device back to the one current when the group
    // began: on this fresh thread that was device 0, so a rank on GPU 1 gained a primary
    // context on GPU 0 in its first rebuild (0.13 s of the pause and 518 MiB of device memory
    // on 2xH200, then checkpointed by the driver each time). The whole creation runs with a
    // device of its own communicators current.
    let home = c.plans.first().map(|p| p.dev).or_else(|| c.all.first().map(|(_, _, devs)| devs.first().copied().unwrap_or(0))).filter(|d| *d >= 0);
    on_device(home, || create_here(c, d, init, init_all, deadline))
}

pub(super) fn create_here(
    mut c: Creation,
    d: &'static cuda::Driver,
    init: FnInitConfig,
    init_all: FnInitAll,
    deadline: Instant,
) -> Result<Vec<(usize, usize)>, String> {
    let _inside = inside();
    let mut made: Vec<(usize, Comm)> = Vec::new();
    let mut first = None;
    // ncclCommInitAll's communicators, each call's as a whole.
    for (members, ndev, devs) in &c.all {
        let mut out: Vec<Comm> = vec![std::ptr::null_mut(); *ndev as usize];
        let list = if devs.is_empty() { std::ptr::null() } else { devs.as_ptr() };
        // SAFETY: `out` has room for `ndev` communicators and `list` is null or `ndev`
        // devices, as the application's call had them.
        match unsafe { init_all(out.as_mut_ptr(), *ndev, list) } {
            SUCCESS => {
                for (i, comm) in out.into_iter().enumerate() {
                    match members.iter().find(|(_, m)| *m == i) {
                        Some((h, _)) => made.push((*h, comm)),
                        // A member the application ended before the checkpoint: not its
                        // any more (nothing uses it, as before).
                        None if !comm.is_null() => {
                            let _ = real_abort(comm);
                        }
                        None => {}
                    }
                }
            }
            r => {
                first.get_or_insert(format!("ncclCommInitAll: error {r}"));
            }
        }
    }
    // The others in one group: NCCL creates them together, whatever their order elsewhere.
    let mut ranks_made = Vec::new();
    match real_group(false) {
        SUCCESS => {
            for p in &mut c.plans {
                let mut out: Comm = std::ptr::null_mut();
                let config = p.config.as_mut().map_or(std::ptr::null_mut(), |c| c.as_ptr());
                // NCCL takes the calling thread's current device.
                let r = d.with_device(p.dev, || {
                    // SAFETY: a valid out-pointer, the recorded size and rank, a fresh id,
                    // and a config copy (or null) that outlives the call.
                    unsafe { init(&mut out, p.nranks, p.id, p.rank, config) }
                });
                match r {
                    Ok(SUCCESS) | Ok(IN_PROGRESS) => ranks_made.push((p.handle, out)),
                    Ok(r) => {
                        first.get_or_insert(format!("ncclCommInitRankConfig: error {r}"));
                    }
                    Err(r) => {
                        first.get_or_insert(format!("making device {} current: CUDA error {r}", p.dev));
                    }
                }
            }
            let ended = real_group(true);
            if ended != SUCCESS && ended != IN_PROGRESS {
                first.get_or_insert(format!("ncclGroupEnd: error {ended}"));
            }
        }
        r => {
            first.get_or_insert(format!("ncclGroupStart: error {r}"));
        }
    }
    // Non-blocking communicators finish in the background.
    for (_, comm) in &ranks_made {
        loop {
            match real_async_error(*comm) {
                IN_PROGRESS if Instant::now() < deadline => std::thread::sleep(INIT_POLL),
                IN_PROGRESS => {
                    first.get_or_insert("NCCL communicators still being created after the timeout".into());
                    break;
                }
                SUCCESS => break,
                r => {
                    first.get_or_insert(format!("a rebuilt NCCL communicator failed: error {r}"));
                    break;
                }
            }
        }
    }
    made.extend(ranks_made);
    if let Some(m) = first {
        for (_, comm) in made {
            if !comm.is_null() {
                let _ = real_abort(comm);
            }
        }
        return Err(m);
    }
    Ok(made.into_iter().map(|(h, comm)| (h, comm as usize)).collect())
}

/// The outcome of a creation thread, or that nobody waits for it any more.
#[derive(Default)]
pub(super) struct Outcome {
    pub(super) made: Option<Result<Vec<(usize, usize)>, String>>,
    pub(super) abandoned: bool,
}

/// Builds every communicator again (every rank at once: creation is collective); the
/// application's NCCL calls still wait until hiber [`open`]s every rank. Bounded by
/// `timeout`: a rank that never comes leaves the others torn down (their creation thread
/// waits on in NCCL, and ends what it makes when it is done), not the control thread stuck.
/// What an earlier rebuild made and nobody opened is ended first.
pub fn rebuild(timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    refuse_closed_gate()?;
    let Some(init) = real!("ncclCommInitRankConfig" => FnInitConfig) else { return Err("libnccl is not loaded".into()) };
    let Some(init_all) = real!("ncclCommInitAll" => FnInitAll) else { return Err("libnccl is not loaded".into()) };
    let Some(d) = cuda::driver() else { return Err("libcuda is not loaded".into()) };
    let (creation, stale, calm, dev) = {
        let mut s = lock();
        if s.phase != Phase::Down {
            return Err("rebuild of communicators that are not torn down".into());
        }
        if let Some(e) = s.comms.values().find(|e| !e.failed && matches!(e.origin(), Origin::Ranks { .. }) && e.next_id.is_none()) {
            return Err(format!("no unique id for NCCL communicator {:016x}", e.key()));
        }
        let mut all: BTreeMap<u64, AllCall> = BTreeMap::new();
        let mut plans = Vec::new();
        let mut stale = Vec::new();
        for (h, e) in s.comms.iter_mut().filter(|(_, e)| !e.failed) {
            match e.take_real() {
                0 => {}
                r => stale.push((*h, r)),
            }
            match &e.obj.origin {
                Origin::All { group, index, ndev, devs } => all.entry(*group).or_insert_with(|| (Vec::new(), *ndev, devs.clone())).0.push((*h, *index)),
                Origin::Ranks { config } => {
                    let Some(id) = e.next_id.take() else { continue };
                    plans.push(Plan { handle: *h, rank: e.rank, nranks: e.nranks, dev: e.dev, id, config: config.clone() });
                }
            }
        }
        let dev = s.device();
        let (_s, calm) = quiet(s);
        (Creation { all: all.into_values().collect(), plans }, stale, calm, dev)
    };
    // Made by an earlier rebuild nobody opened: ended before new ones are made (or left,
    // when a call still holds one).
    if let Err(m) = end_all(stale, dev, calm) {
        log(&m);
    }
    let outcome = std::sync::Arc::new((Mutex::new(Outcome::default()), Condvar::new()));
    let theirs = outcome.clone();
    std::thread::Builder::new()
        .name("hiber-nccl-init".into())
        .spawn(move || {
            let made = create(creation, d, init, init_all, deadline);
            let (slot, ready) = &*theirs;
            let mut o = slot.lock().unwrap_or_else(|e| e.into_inner());
            if o.abandoned {
                // Made after the rebuild gave up: nobody will use them (ended on their
                // device, as every call of the agent's own threads: see `on_device`).
                let _inside = inside();
                on_device(dev, || {
                    for (_, c) in made.into_iter().flatten() {
                        let _ = real_abort(c as Comm);
                    }
                });
                return;
            }
            o.made = Some(made);
            ready.notify_all();
        })
        .map_err(|e| format!("cannot start a thread to make the communicators: {e}"))?;
    let made = {
        let (slot, ready) = &*outcome;
        let mut o = slot.lock().unwrap_or_else(|e| e.into_inner());
        while o.made.is_none() && Instant::now() < deadline {
            o = ready.wait_timeout(o, deadline.saturating_duration_since(Instant::now())).unwrap_or_else(|e| e.into_inner()).0;
        }
        match o.made.take() {
            Some(r) => r?,
            None => {
                o.abandoned = true;
                return Err(format!("NCCL communicators not made within {} ms (a rank did not join)", timeout.as_millis()));
            }
        }
    };
    let mut s = lock();
    for (h, c) in made {
        match s.comms.get_mut(&h) {
            Some(e) => e.set_real(c),
            None => log("a rebuilt NCCL communicator has no handle any more"),
        }
    }
    Ok(())
}
