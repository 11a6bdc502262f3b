//! NCCL's entry points as the application calls them: each translates the synthetic handle,
//! counts the submission and passes it on, or waits while the communicators are cut.

use super::*;

macro_rules! collective {
    ($($name:ident($($arg:ident: $ty:ty),*) on $comm:ident, $lane:expr, $stream:ident;)*) => {$(
        /// # Safety
        /// Called by the application with the arguments nccl.h specifies.
        #[no_mangle]
        #[allow(non_snake_case)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> NcclResult {
            let Some(real) = real!(ident $name => unsafe extern "C" fn($($ty),*) -> NcclResult) else { return SYSTEM_ERROR };
            if nested() {
                // SAFETY: NCCL calling its own API: forwarded unchanged.
                return unsafe { real($($arg),*) };
            }
            let synthetic = $comm;
            let (c, _submission) = match submit($comm, $lane) {
                Ok(x) => x,
                Err(r) => return r,
            };
            // A graph replays the collective where no count sees it, on this communicator
            // even after it was rebuilt: such a communicator refuses the checkpoint.
            if is_synthetic(synthetic) && cuda::driver().is_some_and(|d| d.capturing($stream as usize)) {
                mark_unsafe(synthetic, "collectives captured into a CUDA graph");
            }
            let $comm = c;
            let _inside = inside();
            // SAFETY: the application's arguments, forwarded unchanged but for the real
            // communicator in place of the agent's handle.
            unsafe { real($($arg),*) }
        }
    )*};
}

collective! {
    ncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: Enum, op: Enum, comm: Comm, stream: Stream) on comm, Lane::Coll, stream;
    ncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: Enum, root: c_int, comm: Comm, stream: Stream) on comm, Lane::Coll, stream;
    ncclBcast(buff: *mut c_void, count: usize, datatype: Enum, root: c_int, comm: Comm, stream: Stream) on comm, Lane::Coll, stream;
    ncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: Enum, op: Enum, root: c_int, comm: Comm, stream: Stream) on comm, Lane::Coll, stream;
    ncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: Enum, op: Enum, comm: Comm, stream: Stream) on comm, Lane::Coll, stream;
    ncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: Enum, comm: Comm, stream: Stream) on comm, Lane::Coll, stream;
    ncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: Enum, comm: Comm, stream: Stream) on comm, Lane::Coll, stream;
    ncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: Enum, root: c_int, comm: Comm, stream: Stream) on comm, Lane::Coll, stream;
    ncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: Enum, root: c_int, comm: Comm, stream: Stream) on comm, Lane::Coll, stream;
    ncclSend(sendbuff: *const c_void, count: usize, datatype: Enum, peer: c_int, comm: Comm, stream: Stream) on comm, Lane::Send(peer), stream;
    ncclRecv(recvbuff: *mut c_void, count: usize, datatype: Enum, peer: c_int, comm: Comm, stream: Stream) on comm, Lane::Recv(peer), stream;
}

/// Calls that only name a communicator: translated, and waiting while it is torn down.
/// `$unsafe_use` marks communicators whose use the agent cannot replay.
macro_rules! translated {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty, on $comm:ident, $fail:expr, $unsafe_use:expr;)*) => {$(
        /// # Safety
        /// Called by the application with the arguments nccl.h specifies.
        #[no_mangle]
        #[allow(non_snake_case)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            let Some(real) = real!(ident $name => unsafe extern "C" fn($($ty),*) -> $ret) else { return $fail };
            if nested() {
                // SAFETY: NCCL calling its own API: forwarded unchanged.
                return unsafe { real($($arg),*) };
            }
            let synthetic = $comm;
            let ($comm, _in_use) = match real_of($comm) {
                Ok(c) => c,
                Err(_) => return $fail,
            };
            let why: Option<&'static str> = $unsafe_use;
            if let Some(why) = why {
                mark_unsafe(synthetic, why);
            }
            let _inside = inside();
            // SAFETY: the application's arguments, forwarded unchanged but for the real
            // communicator in place of the agent's handle.
            unsafe { real($($arg),*) }
        }
    )*};
}

translated! {
    ncclCommRegister(comm: Comm, buff: *mut c_void, size: usize, handle: *mut *mut c_void) -> NcclResult, on comm, INVALID_ARGUMENT, Some("registered buffers (ncclCommRegister)");
    ncclCommDeregister(comm: Comm, handle: *mut c_void) -> NcclResult, on comm, INVALID_ARGUMENT, None;
    ncclCommWindowRegister(comm: Comm, buff: *mut c_void, size: usize, win: *mut *mut c_void, flags: c_int) -> NcclResult, on comm, INVALID_ARGUMENT, Some("windows (ncclCommWindowRegister)");
    ncclCommWindowDeregister(comm: Comm, win: *mut c_void) -> NcclResult, on comm, INVALID_ARGUMENT, None;
    ncclRedOpCreatePreMulSum(op: *mut Enum, scalar: *mut c_void, datatype: Enum, residence: Enum, comm: Comm) -> NcclResult, on comm, INVALID_ARGUMENT, None;
    ncclRedOpDestroy(op: Enum, comm: Comm) -> NcclResult, on comm, INVALID_ARGUMENT, None;
    ncclDevCommCreate(comm: Comm, reqs: *const c_void, out: *mut c_void) -> NcclResult, on comm, INVALID_ARGUMENT, Some("the device API (ncclDevCommCreate)");
    ncclDevCommDestroy(comm: Comm, dev_comm: *const c_void) -> NcclResult, on comm, INVALID_ARGUMENT, None;
    ncclGinBarrierCreateRequirement(comm: Comm, team: Team, n: c_int, out_handle: *mut c_void, out_req: *mut c_void) -> NcclResult, on comm, INVALID_ARGUMENT, None;
    ncclTeamWorld(comm: Comm) -> Team, on comm, Team::default(), None;
    ncclTeamLsa(comm: Comm) -> Team, on comm, Team::default(), None;
    ncclTeamRail(comm: Comm) -> Team, on comm, Team::default(), None;
    ncclTeamRankToWorld(comm: Comm, team: Team, rank: c_int) -> c_int, on comm, -1, None;
    ncclTeamRankToLsa(comm: Comm, team: Team, rank: c_int) -> c_int, on comm, -1, None;
    ncclCommRevoke(comm: Comm, flags: c_int) -> NcclResult, on comm, INVALID_ARGUMENT, None;
}

pub(super) fn mark_unsafe(c: Comm, why: &'static str) {
    let Some(h) = seq_of(c) else { return };
    if let Some(e) = lock().comms.get_mut(&h) {
        e.unsafe_use.get_or_insert(why);
    }
}

/// # Safety
/// Called as ncclGroupStart.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclGroupStart() -> NcclResult {
    if nested() {
        return real_group(false);
    }
    let depth = DEPTH.get();
    if depth == 0 {
        let mut s = lock();
        while !(s.phase == Phase::Open || (s.phase == Phase::Held && s.behind())) {
            s = wait(s);
        }
        s.in_group += 1;
    }
    DEPTH.set(depth + 1);
    let r = {
        let _inside = inside();
        real_group(false)
    };
    if r != SUCCESS {
        leave_group();
    }
    r
}

pub(super) fn leave_group() {
    let depth = DEPTH.get();
    if depth == 0 {
        // An unmatched end: NCCL answers it; no group of this thread to leave.
        return;
    }
    DEPTH.set(depth - 1);
    if depth == 1 {
        let mut s = lock();
        s.in_group = s.in_group.saturating_sub(1);
        CHANGED.notify_all();
    }
}

/// # Safety
/// Called as ncclGroupEnd.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclGroupEnd() -> NcclResult {
    if nested() {
        return real_group(true);
    }
    let r = {
        let _inside = inside();
        real_group(true)
    };
    leave_group();
    r
}

/// Ends the group like `ncclGroupEnd` (estimating its time instead of launching it).
///
/// # Safety
/// Called as ncclGroupSimulateEnd.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclGroupSimulateEnd(info: *mut c_void) -> NcclResult {
    let Some(real) = real!("ncclGroupSimulateEnd" => unsafe extern "C" fn(*mut c_void) -> NcclResult) else { return SYSTEM_ERROR };
    if nested() {
        // SAFETY: NCCL calling its own API: forwarded unchanged.
        return unsafe { real(info) };
    }
    let r = {
        let _inside = inside();
        // SAFETY: the application's argument, forwarded unchanged.
        unsafe { real(info) }
    };
    leave_group();
    r
}

/// # Safety
/// Called as ncclCommInitRank.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommInitRank(comm: *mut Comm, nranks: c_int, id: UniqueId, rank: c_int) -> NcclResult {
    // SAFETY: as ncclCommInitRankConfig with the default config.
    unsafe { ncclCommInitRankConfig(comm, nranks, id, rank, std::ptr::null_mut()) }
}

/// # Safety
/// Called as ncclCommInitRankConfig.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommInitRankConfig(comm: *mut Comm, nranks: c_int, id: UniqueId, rank: c_int, config: *mut c_void) -> NcclResult {
    let Some(real) = real!("ncclCommInitRankConfig" => FnInitConfig) else { return SYSTEM_ERROR };
    if nested() || comm.is_null() {
        // SAFETY: NCCL calling its own API (or a null out-pointer NCCL refuses itself).
        return unsafe { real(comm, nranks, id, rank, config) };
    }
    // SAFETY: `config` is null or the application's ncclConfig_t (nccl.h), valid for the call.
    let record = unsafe { Config::capture(config) };
    begin_init();
    let r = {
        let _inside = inside();
        // SAFETY: the application's arguments, forwarded unchanged.
        unsafe { real(comm, nranks, id, rank, config) }
    };
    let r = adopt(comm, r, name_of(&[b"init", &id.internal]), rank, nranks, Origin::Ranks { config: record });
    end_init();
    r
}

/// # Safety
/// Called as ncclCommInitRankScalable.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    comm: *mut Comm,
    nranks: c_int,
    rank: c_int,
    n_ids: c_int,
    ids: *mut UniqueId,
    config: *mut c_void,
) -> NcclResult {
    type F = unsafe extern "C" fn(*mut Comm, c_int, c_int, c_int, *mut UniqueId, *mut c_void) -> NcclResult;
    let Some(real) = real!("ncclCommInitRankScalable" => F) else { return SYSTEM_ERROR };
    if nested() || comm.is_null() || ids.is_null() || n_ids < 1 {
        // SAFETY: NCCL calling its own API (or arguments NCCL refuses itself).
        return unsafe { real(comm, nranks, rank, n_ids, ids, config) };
    }
    // SAFETY: `ids` holds `n_ids` ≥ 1 ids (nccl.h); the first names the communicator.
    let first = unsafe { *ids };
    // SAFETY: `config` is null or the application's ncclConfig_t, valid for the call.
    let record = unsafe { Config::capture(config) };
    begin_init();
    let r = {
        let _inside = inside();
        // SAFETY: the application's arguments, forwarded unchanged.
        unsafe { real(comm, nranks, rank, n_ids, ids, config) }
    };
    let r = adopt(comm, r, name_of(&[b"init", &first.internal]), rank, nranks, Origin::Ranks { config: record });
    end_init();
    r
}

/// # Safety
/// Called as ncclCommInitAll.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommInitAll(comms: *mut Comm, ndev: c_int, devlist: *const c_int) -> NcclResult {
    let Some(real) = real!("ncclCommInitAll" => FnInitAll) else { return SYSTEM_ERROR };
    if nested() || comms.is_null() || ndev < 1 {
        // SAFETY: NCCL calling its own API (or arguments NCCL refuses itself).
        return unsafe { real(comms, ndev, devlist) };
    }
    begin_init();
    let r = {
        let _inside = inside();
        // SAFETY: the application's arguments, forwarded unchanged.
        unsafe { real(comms, ndev, devlist) }
    };
    let devs: Vec<c_int> = if devlist.is_null() {
        Vec::new()
    } else {
        // SAFETY: a non-null devlist holds `ndev` device ordinals (nccl.h).
        unsafe { std::slice::from_raw_parts(devlist, ndev as usize) }.to_vec()
    };
    // As in `adopt`: only the communicators of a loaded libnccl.so get the agent's handles.
    if r == SUCCESS && libnccl().is_some() {
        let mut s = lock();
        let group = s.next_all_group;
        s.next_all_group += 1;
        for i in 0..ndev as usize {
            // SAFETY: NCCL filled `ndev` communicators into the application's array.
            let slot = unsafe { comms.add(i) };
            // SAFETY: as above; `slot` is within the array.
            let real_comm = unsafe { *slot };
            let key = name_of(&[b"all", &std::process::id().to_le_bytes(), &group.to_le_bytes(), &i.to_le_bytes()]);
            let origin = Origin::All { group, index: i, ndev, devs: devs.clone() };
            let h = s.register(real_comm, key, i as c_int, ndev, origin);
            // SAFETY: as above.
            unsafe { *slot = h };
        }
    }
    end_init();
    r
}

/// Records the communicator NCCL just wrote to `*comm` and gives the application the
/// agent's handle in its place.
///
/// Only communicators of a dynamically loaded `libnccl.so` get the agent's handles: an NCCL
/// carried inside another library may call its own functions directly, and must never see
/// one (its jobs keep NCCL's own handles, and hiber refuses to checkpoint them).
pub(super) fn adopt(comm: *mut Comm, r: NcclResult, key: u64, rank: c_int, nranks: c_int, origin: Origin) -> NcclResult {
    if (r != SUCCESS && r != IN_PROGRESS) || libnccl().is_none() {
        return r;
    }
    // SAFETY: `comm` is the application's non-null out-pointer, which NCCL filled in.
    let real_comm = unsafe { *comm };
    if real_comm.is_null() {
        return r;
    }
    // Ready now (a blocking creation): its size, rank and device are known at once, so a
    // communicator made while hiber holds the others is complete when it is torn down.
    let known = (r == SUCCESS && real_async_error(real_comm) == SUCCESS).then(|| {
        let _inside = inside();
        (real_query(real_comm, "count"), real_query(real_comm, "rank"), real_query(real_comm, "device"))
    });
    let mut s = lock();
    let h = s.register(real_comm, key, rank, nranks, origin);
    if let Some((Ok(n), Ok(rk), Ok(d))) = known {
        if let Some(e) = seq_of(h).and_then(|seq| s.comms.get_mut(&seq)) {
            (e.nranks, e.rank, e.dev) = (n, rk, d);
        }
    }
    // SAFETY: as above.
    unsafe { *comm = h };
    r
}

/// A child of `parent` (split or shrink): the key follows from the parent's and the child's
/// place among its siblings, alike on every rank that made it.
/// `record` is the child's config as the application gave it; without one, the child
/// has its parent's (as NCCL gives it), which its rebuild keeps.
pub(super) fn adopt_child(parent: Comm, newcomm: *mut Comm, r: NcclResult, how: &[u8], record: Option<Config>) -> NcclResult {
    let (key, record) = {
        let Some(h) = seq_of(parent) else { return r };
        let mut s = lock();
        let Some(p) = s.comms.get_mut(&h) else { return r };
        p.children += 1;
        let inherited = match p.origin() {
            Origin::Ranks { config } => config.clone(),
            Origin::All { .. } => None,
        };
        (name_of(&[b"child", &p.key().to_le_bytes(), &p.children.to_le_bytes(), how]), record.or(inherited))
    };
    if newcomm.is_null() {
        return r;
    }
    adopt(newcomm, r, key, -1, -1, Origin::Ranks { config: record })
}

/// # Safety
/// Called as ncclCommSplit.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommSplit(comm: Comm, color: c_int, key: c_int, newcomm: *mut Comm, config: *mut c_void) -> NcclResult {
    type F = unsafe extern "C" fn(Comm, c_int, c_int, *mut Comm, *mut c_void) -> NcclResult;
    let Some(real) = real!("ncclCommSplit" => F) else { return SYSTEM_ERROR };
    if nested() {
        // SAFETY: NCCL calling its own API: forwarded unchanged.
        return unsafe { real(comm, color, key, newcomm, config) };
    }
    // SAFETY: `config` is null or the application's ncclConfig_t.
    let record = unsafe { Config::capture(config) };
    // A split is a collective on the parent; the child is adopted before the submission
    // ends, so a cut that waits for it finds the child too.
    let (c, submission) = match submit(comm, Lane::Coll) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let r = {
        let _inside = inside();
        // SAFETY: the application's arguments, with the real parent.
        unsafe { real(c, color, key, newcomm, config) }
    };
    let r = adopt_child(comm, newcomm, r, &color.to_le_bytes(), record);
    drop(submission);
    r
}

/// # Safety
/// Called as ncclCommShrink.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommShrink(
    comm: Comm,
    exclude: *mut c_int,
    n_exclude: c_int,
    newcomm: *mut Comm,
    config: *mut c_void,
    flags: c_int,
) -> NcclResult {
    type F = unsafe extern "C" fn(Comm, *mut c_int, c_int, *mut Comm, *mut c_void, c_int) -> NcclResult;
    let Some(real) = real!("ncclCommShrink" => F) else { return SYSTEM_ERROR };
    if nested() {
        // SAFETY: NCCL calling its own API: forwarded unchanged.
        return unsafe { real(comm, exclude, n_exclude, newcomm, config, flags) };
    }
    // SAFETY: `config` is null or the application's ncclConfig_t.
    let record = unsafe { Config::capture(config) };
    let (c, submission) = match submit(comm, Lane::Coll) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let r = {
        let _inside = inside();
        // SAFETY: the application's arguments, with the real parent.
        unsafe { real(c, exclude, n_exclude, newcomm, config, flags) }
    };
    let r = adopt_child(comm, newcomm, r, b"shrink", record);
    drop(submission);
    r
}

/// Ends a communicator the application is done with (`ncclCommDestroy`, `ncclCommAbort`).
pub(super) fn end(comm: Comm, name: &str) -> NcclResult {
    let f = if name == "abort" { real!("ncclCommAbort" => FnComm) } else { real!("ncclCommDestroy" => FnComm) };
    let Some(f) = f else { return SYSTEM_ERROR };
    let h = match seq_of(comm) {
        Some(h) if !nested() => h,
        // SAFETY: a communicator the agent did not make, forwarded unchanged.
        _ => return unsafe { f(comm) },
    };
    let real_comm = {
        // Not while hiber holds or rebuilds the communicators: every rank's must be there
        // for the rebuild, and this one is ended once it is rebuilt. One ended for good
        // (`fail`) goes at once: the others may wait long for their rebuild.
        let mut s = lock();
        while s.phase != Phase::Open && s.comms.get(&h).is_some_and(|e| !e.failed) {
            s = wait(s);
        }
        let Some(e) = s.comms.remove(&h) else { return INVALID_ARGUMENT };
        let real = e.take_real();
        // The application's handle goes with it (the object, once `e` lets go too).
        release_handle(comm);
        real
    };
    if real_comm == 0 {
        // Torn down by hiber already: nothing left to end.
        return SUCCESS;
    }
    let _inside = inside();
    // SAFETY: the real communicator, which the application ends.
    unsafe { f(real_comm as Comm) }
}

/// # Safety
/// Called as ncclCommDestroy.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommDestroy(comm: Comm) -> NcclResult {
    end(comm, "destroy")
}

/// # Safety
/// Called as ncclCommAbort.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommAbort(comm: Comm) -> NcclResult {
    end(comm, "abort")
}

/// # Safety
/// Called as ncclCommFinalize.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommFinalize(comm: Comm) -> NcclResult {
    let Some(f) = real!("ncclCommFinalize" => FnComm) else { return SYSTEM_ERROR };
    if nested() {
        // SAFETY: NCCL calling its own API: forwarded unchanged.
        return unsafe { f(comm) };
    }
    match real_of(comm) {
        Ok((c, _in_use)) => {
            let _inside = inside();
            // SAFETY: the real communicator.
            unsafe { f(c) }
        }
        Err(r) => r,
    }
}

/// Answered from the record while the communicator is torn down, so that a watchdog
/// thread polling it (PyTorch's) does not stop.
pub(super) fn recorded(comm: Comm, pick: fn(&Entry) -> c_int) -> Option<Result<c_int, NcclResult>> {
    if nested() {
        return None;
    }
    let h = seq_of(comm)?;
    let s = lock();
    match s.comms.get(&h) {
        None => Some(Err(INVALID_ARGUMENT)),
        Some(e) if e.real() == 0 => Some(Ok(pick(e))),
        Some(_) => None,
    }
}

/// # Safety
/// Called as ncclCommGetAsyncError.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommGetAsyncError(comm: Comm, err: *mut NcclResult) -> NcclResult {
    let Some(f) = real!("ncclCommGetAsyncError" => FnAsyncError) else { return SYSTEM_ERROR };
    match recorded(comm, |e| if e.failed { REMOTE_ERROR } else { SUCCESS }) {
        Some(Ok(v)) if !err.is_null() => {
            // SAFETY: the application's non-null out-pointer.
            unsafe { *err = v };
            SUCCESS
        }
        Some(Ok(_)) => INVALID_ARGUMENT,
        Some(Err(r)) => r,
        None => match real_of(comm) {
            // SAFETY: the real communicator and the application's out-pointer.
            Ok((c, _in_use)) => unsafe { f(c, err) },
            Err(r) => r,
        },
    }
}

pub(super) fn query(comm: Comm, out: *mut c_int, which: &str, pick: fn(&Entry) -> c_int) -> NcclResult {
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    let v = match recorded(comm, pick) {
        Some(v) => v,
        None => real_of(comm).and_then(|(c, _in_use)| real_query(c, which)),
    };
    match v {
        Ok(v) => {
            // SAFETY: the application's non-null out-pointer.
            unsafe { *out = v };
            SUCCESS
        }
        Err(r) => r,
    }
}

/// # Safety
/// Called as ncclCommCount.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommCount(comm: Comm, count: *mut c_int) -> NcclResult {
    query(comm, count, "count", |e| e.nranks)
}

/// # Safety
/// Called as ncclCommUserRank.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommUserRank(comm: Comm, rank: *mut c_int) -> NcclResult {
    query(comm, rank, "rank", |e| e.rank)
}

/// # Safety
/// Called as ncclCommCuDevice.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclCommCuDevice(comm: Comm, dev: *mut c_int) -> NcclResult {
    query(comm, dev, "device", |e| e.dev)
}

/// # Safety
/// Called as ncclGetLastError.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn ncclGetLastError(comm: Comm) -> *const c_char {
    let Some(f) = real!("ncclGetLastError" => unsafe extern "C" fn(Comm) -> *const c_char) else { return c"".as_ptr() };
    let held = if comm.is_null() { None } else { real_of(comm).ok() };
    let c = held.as_ref().map_or(std::ptr::null_mut(), |(c, _)| *c);
    // SAFETY: the real communicator, or null (NCCL's last error of the thread).
    unsafe { f(c) }
}
