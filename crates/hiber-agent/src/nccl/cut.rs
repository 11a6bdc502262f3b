//! What hiber asks for the cut: the report, the hold, the limits and the drain, the
//! teardown, and ending a communicator whose ranks are gone.

use super::*;

/// One communicator as a rank reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub key: u64,
    pub rank: c_int,
    pub nranks: c_int,
    /// All its ranks are in this process (`ncclCommInitAll`): rebuilt without hiber's help.
    pub local: bool,
    /// The UUID of its device; empty where it is not known.
    pub gpu: String,
    pub lanes: Vec<(Lane, u64)>,
}

/// Live communicators the agent made (status).
pub fn count() -> u64 {
    lock().comms.values().filter(|e| !e.failed).count() as u64
}

/// Whether hiber left the communicators torn down.
pub fn is_down() -> bool {
    lock().phase == Phase::Down
}

pub(super) fn reports(s: &State) -> Vec<Report> {
    s.comms
        .values()
        .filter(|e| !e.failed)
        .map(|e| Report {
            key: e.key(),
            rank: e.rank,
            nranks: e.nranks,
            local: matches!(e.origin(), Origin::All { .. }),
            gpu: (e.dev >= 0).then(|| crate::cuda::driver().and_then(|d| d.device_uuid(e.dev).ok())).flatten().unwrap_or_default(),
            lanes: e.lanes.iter().map(|(l, n)| (*l, *n)).collect(),
        })
        .collect()
}

/// The communicators, as they are (to plan a rebuild).
pub fn list() -> Vec<Report> {
    reports(&lock())
}

pub(super) fn wait_until(
    mut s: MutexGuard<'static, State>,
    deadline: Instant,
    done: impl Fn(&State) -> bool,
) -> Result<MutexGuard<'static, State>, MutexGuard<'static, State>> {
    while !done(&s) {
        if Instant::now() >= deadline {
            return Err(s);
        }
        s = wait(s);
    }
    Ok(s)
}

/// Stops every new submission and reports each communicator's counts, once no thread is
/// inside a group or a communicator's creation (so the counts are final).
pub fn hold(timeout: Duration) -> Result<Vec<Report>, String> {
    let deadline = Instant::now() + timeout;
    refuse_closed_gate()?;
    let mut s = lock();
    if s.phase != Phase::Open {
        return Err(format!("NCCL communicators are {:?} already", s.phase));
    }
    if let Some(why) = s.comms.values().filter(|e| !e.failed).find_map(|e| e.unsafe_use) {
        return Err(format!("an NCCL communicator used {why}, which hiber cannot rebuild yet"));
    }
    s.phase = Phase::Held;
    s.limits.clear();
    // A submission is counted before it enters NCCL (where it may wait for its peers), so
    // only threads inside a group (whose next calls still count) or making a communicator
    // keep the counts from being final.
    let s = match wait_until(s, deadline, |s| s.in_group == 0 && s.in_init == 0) {
        Ok(s) => s,
        Err(mut s) => {
            let busy = (s.in_group, s.in_init);
            reopen(&mut s);
            return Err(format!("NCCL calls still running after {} ms (threads in groups, making communicators: {busy:?})", timeout.as_millis()));
        }
    };
    let reals: Vec<(usize, Comm)> = s.comms.iter().filter(|(_, e)| !e.failed).map(|(h, e)| (*h, e.real() as Comm)).collect();
    // NCCL is asked without the lock (it may call its own exported API, the agent's).
    drop(s);
    let _inside = inside();
    // What was not known at creation (children, non-blocking communicators): ask NCCL now.
    let mut failed = None;
    let mut known = Vec::new();
    for (h, c) in reals {
        if real_async_error(c) == IN_PROGRESS {
            failed.get_or_insert("an NCCL communicator is still being created".to_string());
            continue;
        }
        let q = |which| real_query(c, which).map_err(|r| format!("asking NCCL for a communicator's {which}: error {r}"));
        match (q("count"), q("rank"), q("device")) {
            (Ok(n), Ok(r), Ok(d)) => known.push((h, n, r, d)),
            (Err(m), _, _) | (_, Err(m), _) | (_, _, Err(m)) => {
                failed.get_or_insert(m);
            }
        }
    }
    let mut s = lock();
    if let Some(m) = failed {
        reopen(&mut s);
        return Err(m);
    }
    for (h, n, r, d) in known {
        if let Some(e) = s.comms.get_mut(&h) {
            (e.nranks, e.rank, e.dev) = (n, r, d);
        }
    }
    s.held_at = s.comms.iter().flat_map(|(h, e)| e.lanes.iter().map(move |(l, n)| ((*h, *l), *n))).collect();
    Ok(reports(&s))
}

/// Waits (bounded) for the calls that already hold a real communicator (a watchdog polling
/// for errors) to end, once the reals were taken from the record: new calls no longer get
/// them, and such calls return at once. `false` when some still held one after
/// [`DOWN_WAIT`]: the reals taken must then be left as they are (leaked), since ending one
/// would free what such a call is using.
pub(super) fn quiet(s: MutexGuard<'static, State>) -> (MutexGuard<'static, State>, bool) {
    match wait_until(s, Instant::now() + DOWN_WAIT, |s| s.in_use == 0) {
        Ok(s) => (s, true),
        Err(s) => {
            log(&format!(
                "{} NCCL calls still held a communicator after {} s: the communicators taken from them are left, not ended",
                s.in_use,
                DOWN_WAIT.as_secs()
            ));
            (s, false)
        }
    }
}

/// Ends the real communicators `reals` once nothing uses them (`calm`, from [`quiet`]);
/// otherwise leaves them, and says so.
///
/// The aborts go in one NCCL group, so NCCL tears the communicators down at
/// `ncclGroupEnd`, each on a thread of its own (2.28.9 `group.cc`, `asyncJobLaunch`): one
/// after the other, each teardown waited for its proxy's threads, which look at the abort
/// flag only between 500 ms polls (`proxy.cc`).
pub(super) fn end_all(reals: Vec<(usize, usize)>, dev: Option<c_int>, calm: bool) -> Result<(), String> {
    if !calm {
        return Err(format!(
            "{} NCCL communicators were still in use by the application's calls after {} s, and are left as they are",
            reals.len(),
            DOWN_WAIT.as_secs()
        ));
    }
    if reals.is_empty() {
        return Ok(());
    }
    let _inside = inside();
    // NCCL's proxy threads notice the abort flag only when their polls return.
    let _waking = crate::poll::waking();
    let first = on_device(dev, || {
        let grouped = real_group(false) == SUCCESS;
        let mut first = None;
        for (h, c) in &reals {
            let r = real_abort(*c as Comm);
            if r != SUCCESS {
                first.get_or_insert(format!("tearing down NCCL communicator {h}: error {r}"));
            }
        }
        if grouped {
            let r = real_group(true);
            if r != SUCCESS {
                first.get_or_insert(format!("tearing down {} NCCL communicators: error {r}", reals.len()));
            }
        }
        first
    });
    first.map_or(Ok(()), Err)
}

/// Runs `f` (NCCL calls of the agent's own thread) with `dev`'s primary context current.
/// NCCL sets the calling thread's device back after its work (`cudaSetDevice`, which since
/// CUDA 12 makes that device's primary context); on a thread with no context current that
/// is device 0. A rank on GPU 1 thus gained a context on GPU 0 in its first teardown or
/// rebuild (0.13 s of the pause and 518 MiB of GPU 0 on 2xH200), which the driver then
/// checkpointed and restored each time (about 270 MiB more through host memory and CRIU).
pub(super) fn on_device<T>(dev: Option<c_int>, f: impl FnOnce() -> T) -> T {
    // A context that cannot be made current leaves the thread as it is, as before.
    let _current = dev.zip(cuda::driver()).and_then(|(dev, d)| d.enter(dev).ok());
    f()
}

pub(super) fn reopen(s: &mut State) {
    s.phase = Phase::Open;
    s.limits.clear();
    s.held_at.clear();
    CHANGED.notify_all();
}

/// The agent's own NCCL calls (teardown, creation) make gated driver calls, on its thread
/// and on NCCL's: with the gate closed they would wait for ever.
pub(super) fn refuse_closed_gate() -> Result<(), String> {
    if crate::gate::is_closed() {
        return Err("the application's CUDA calls are held (its memory is not back yet)".into());
    }
    Ok(())
}

impl State {
    /// A device this process's communicators use (the first one known), for the agent's own
    /// NCCL calls.
    pub(super) fn device(&self) -> Option<c_int> {
        self.comms.values().map(|e| e.dev).find(|d| *d >= 0)
    }

    /// The first lane that went past where the cut puts it (its limit, or its count when
    /// the hold began): a group let in to catch up on one lane can add to others.
    pub(super) fn overshoot(&self) -> Option<String> {
        self.comms.iter().find_map(|(h, e)| {
            e.lanes.iter().find_map(|(lane, &n)| {
                let cut = self.limits.get(&(*h, *lane)).or_else(|| self.held_at.get(&(*h, *lane))).copied().unwrap_or(0);
                (n > cut).then(|| format!("communicator {:016x} lane {lane} reached {n}, past the cut at {cut}", e.key()))
            })
        })
    }
}

/// Raises the limit of `lane` on communicator `key` (hold first).
pub fn limit(key: u64, lane: Lane, n: u64) -> Result<(), String> {
    let mut s = lock();
    if s.phase != Phase::Held {
        return Err("limit without hold".into());
    }
    let h = s.comms.iter().find(|(_, e)| e.key() == key && !e.failed).map(|(h, _)| *h).ok_or_else(|| format!("no NCCL communicator {key:016x}"))?;
    if n < s.count(h, lane) {
        return Err(format!("communicator {key:016x} lane {lane} is past {n} already"));
    }
    s.limits.insert((h, lane), n);
    CHANGED.notify_all();
    Ok(())
}

/// Lets the held ranks reach their limits, then waits for the device to finish the work:
/// afterwards no collective of this process is in flight. Every wait is bounded; a lane
/// that went past the cut fails the drain (the ranks cannot all reach one point then).
pub fn drain(timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let s = lock();
    if s.phase != Phase::Held {
        return Err("drain without hold".into());
    }
    let s = wait_until(s, deadline, |s| !s.behind() && s.in_group == 0 && s.in_call == 0);
    let (reals, devices): (Vec<Comm>, Vec<c_int>) = match s {
        Ok(s) => {
            if let Some(m) = s.overshoot() {
                return Err(m);
            }
            // A call in flight at the hold may have registered a buffer, made a window or
            // captured a collective since: the hold checked before it.
            let live = || s.comms.values().filter(|e| !e.failed);
            if let Some(why) = live().find_map(|e| e.unsafe_use) {
                return Err(format!("an NCCL communicator used {why}, which hiber cannot rebuild yet"));
            }
            (live().map(|e| e.real() as Comm).collect(), live().map(|e| e.dev).filter(|d| *d >= 0).collect())
        }
        Err(s) => {
            let short: Vec<String> = s
                .limits
                .iter()
                .filter(|(&(h, lane), &limit)| s.count(h, lane) < limit)
                .map(|(&(h, lane), &limit)| format!("{lane} {}/{limit}", s.count(h, lane)))
                .collect();
            return Err(format!("ranks did not reach the cut within {} ms (short: {})", timeout.as_millis(), short.join(", ")));
        }
    };
    // Non-blocking communicators may still be taking work in.
    {
        let _inside = inside();
        for c in reals {
            while real_async_error(c) == IN_PROGRESS {
                if Instant::now() >= deadline {
                    return Err("an NCCL communicator still had work in progress at the timeout".into());
                }
                std::thread::sleep(INIT_POLL);
            }
        }
    }
    let Some(d) = cuda::driver() else { return Err("libcuda is not loaded".into()) };
    let mut devices = devices;
    devices.sort_unstable();
    devices.dedup();
    // A kernel waiting for a peer that never comes (a cut gone wrong) must not hold the
    // control thread: the wait runs on a thread of its own, left to finish by itself.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("hiber-nccl-sync".into())
        .spawn(move || {
            let r = devices.iter().try_for_each(|&dev| d.synchronize_device(dev).map_err(|r| format!("synchronizing device {dev}: CUDA error {r}")));
            let _ = tx.send(r);
        })
        .map_err(|e| format!("cannot start a thread to wait for the device: {e}"))?;
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(r) => r,
        Err(_) => Err(format!("collectives still running on the device after {} ms", timeout.as_millis())),
    }
}

/// Lets the application's NCCL calls through again: undoes a hold (before any teardown),
/// or ends a teardown once every communicator is rebuilt (hiber opens no rank before every
/// rank's rebuild succeeded, so that none submits work a peer never joins).
pub fn open() -> Result<(), String> {
    let mut s = lock();
    if s.phase == Phase::Down && s.comms.values().any(|e| e.real() == 0 && !e.failed) {
        return Err("NCCL communicators are torn down; rebuild them".into());
    }
    reopen(&mut s);
    Ok(())
}

/// Ends the session of a hiber that went away: a hold does not outlive it.
pub fn release_hold() {
    let mut s = lock();
    if s.phase == Phase::Held {
        reopen(&mut s);
    }
}

/// Tears every communicator down (after drain, on every rank): NCCL frees its memory, peer
/// mappings, threads and sockets. Always ends torn down; the first error is reported.
/// While torn down, it ends what a rebuild made (hiber undoing a rebuild that failed on
/// another rank).
pub fn down() -> Result<(), String> {
    refuse_closed_gate()?;
    let started = Instant::now();
    let (reals, calm, in_flight, dev): (Vec<(usize, usize)>, bool, usize, Option<c_int>) = {
        let mut s = lock();
        if s.phase == Phase::Open {
            return Err("teardown without hold".into());
        }
        s.phase = Phase::Down;
        s.limits.clear();
        s.held_at.clear();
        // Children before parents, the order a teardown without NCCL's groups needs (they
        // may share the parent's resources). In a group they go at once: NCCL counts the
        // users of shared resources (2.28.9 init.cc), and the last one frees them.
        let reals = s.comms.iter().rev().map(|(h, e)| (*h, e.take_real())).filter(|(_, r)| *r != 0).collect();
        // Calls that already hold a real communicator (a watchdog polling for errors) end
        // first; new ones wait until the rebuild. Bounded: such calls return at once.
        let in_flight = s.in_use;
        let dev = s.device();
        let (_s, calm) = quiet(s);
        (reals, calm, in_flight, dev)
    };
    let quiet_for = started.elapsed();
    let ended = end_all(reals, dev, calm);
    // A slow teardown says where its time went (the first one of a job took 0.13 s against
    // NCCL's own 0.014 s on 2xH200 while it made a context on device 0: see `on_device`).
    if started.elapsed() > Duration::from_millis(30) {
        log(&format!(
            "NCCL teardown took {} ms: {} ms waiting for {in_flight} call(s) in flight, {} ms in NCCL's aborts",
            started.elapsed().as_millis(),
            quiet_for.as_millis(),
            (started.elapsed() - quiet_for).as_millis()
        ));
    }
    ended
}

/// Ends torn-down communicator `key` for good (hiber found one of its ranks' processes
/// gone, so it cannot be rebuilt): what a rebuild made is ended, and its calls fail with
/// `ncclRemoteError`, as after a peer's death in NCCL (PyTorch's watchdog then aborts the
/// process group), instead of waiting for a rebuild that cannot come. The agent's other
/// communicators are rebuilt and opened as usual.
pub fn fail(key: u64) -> Result<(), String> {
    refuse_closed_gate()?;
    let (stale, calm, dev) = {
        let mut s = lock();
        if s.phase != Phase::Down {
            return Err("only torn-down communicators can be ended".into());
        }
        let mut found = false;
        let mut stale = Vec::new();
        for (h, e) in s.comms.iter_mut().filter(|(_, e)| e.key() == key && !e.failed) {
            found = true;
            e.failed = true;
            match e.take_real() {
                0 => {}
                r => stale.push((*h, r)),
            }
        }
        if !found {
            return Err(format!("no NCCL communicator {key:016x}"));
        }
        // Calls waiting on it see it failed.
        CHANGED.notify_all();
        let dev = s.device();
        let (_s, calm) = quiet(s);
        (stale, calm, dev)
    };
    end_all(stale, dev, calm)
}
