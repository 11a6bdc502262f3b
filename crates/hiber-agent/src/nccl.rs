//! NCCL communicators that outlive a checkpoint.
//!
//! A communicator holds what neither the driver nor CRIU can take: peer memory mapped from
//! other processes, proxy threads, sockets. So the agent exports NCCL's API itself
//! (PyTorch links `libnccl.so.2` dynamically, so a preloaded library stands in front of it)
//! and hands the application *synthetic* `ncclComm_t`s, small integers, behind which the
//! real communicator can be torn down before a checkpoint and built again after it (with
//! `--leave-running`, after a failed checkpoint, or in a restored process), from a record
//! of how it was made and a fresh unique id that hiber passes between the ranks.
//!
//! **The cut.** Ranks wait on each other inside collectives, so they cannot simply be
//! stopped one by one. Every communicator counts what each rank submitted on each *lane*:
//! its collectives, and its sends to and receives from each peer. hiber asks every rank to
//! *hold* (no new submission; the counts it reports are final), raises each lane's limit to
//! what the furthest rank reached (a receive to what the peer sent, and so on), lets the
//! ranks that are behind *drain* up to the limits, and only then tears the communicators
//! down, when every rank has submitted the same work and the device has finished it.
//! A submission is an ungrouped call or a whole `ncclGroupStart`..`ncclGroupEnd`: the hold
//! applies at the outermost `ncclGroupStart`, never inside a group, so a group is never cut.
//!
//! The limit is only ever a *count*, which needs every rank to call collectives of one
//! communicator in the same order (as NCCL itself requires).
//!
//! Programs that resolve NCCL with `dlsym` (XLA's NCCL stub `dlopen`s `libnccl.so.2` and
//! looks up each entry point, so JAX reaches NCCL so) can get the agent's exports too, with
//! `HIBER_NCCL_DLSYM=1`: the agent's `dlsym` then answers `nccl*` names that NCCL defines
//! with the agent's export of the same name ([`redirect_dlsym`]). It is off by default
//! until such a process is verified to survive its checkpoint (see `dlsym_redirect_on`);
//! without it hiber refuses them, as it does programs that link NCCL statically.
//!
//! Not covered: registered buffers, windows and the device API (the handles they return
//! would not survive a rebuild): a communicator that used them refuses the checkpoint.
//! Programs that link NCCL statically bypass the agent; hiber sees their NCCL sockets and
//! refuses them.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{cuda, log};

pub type NcclResult = c_int;
pub const SUCCESS: NcclResult = 0;
const SYSTEM_ERROR: NcclResult = 2;
const INVALID_ARGUMENT: NcclResult = 4;
const INVALID_USAGE: NcclResult = 5;
const REMOTE_ERROR: NcclResult = 6;
const IN_PROGRESS: NcclResult = 7;

/// `ncclComm_t`: the real one (NCCL's pointer) or a synthetic one (the agent's handle).
pub type Comm = *mut c_void;
/// `ncclDataType_t`, `ncclRedOp_t`: C enums.
type Enum = c_int;
type Stream = *mut c_void;

/// `ncclUniqueId`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [u8; 128],
}

/// `ncclTeam_t` (device API), returned by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Team {
    n_ranks: c_int,
    rank: c_int,
    stride: c_int,
}

/// Synthetic handles are 1..=MAX_HANDLE; anything larger is a real communicator the agent
/// did not make (passed through untouched).
const MAX_HANDLE: usize = 0xffff;
/// How often the agent looks at a communicator that initializes in the background.
const INIT_POLL: Duration = Duration::from_millis(1);
/// How long a teardown waits for calls that hold a communicator.
const DOWN_WAIT: Duration = Duration::from_secs(5);

// ---- the real library ----------------------------------------------------------------

static LIBNCCL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// The application's NCCL, once loaded (the agent never loads it).
fn libnccl() -> Option<*mut c_void> {
    let h = LIBNCCL.load(Ordering::Acquire);
    if !h.is_null() {
        return Some(h);
    }
    for name in [c"libnccl.so.2", c"libnccl.so"] {
        // SAFETY: RTLD_NOLOAD only returns a handle to an already loaded library.
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if !h.is_null() {
            LIBNCCL.store(h, Ordering::Release);
            return Some(h);
        }
    }
    None
}

/// The answer of the agent's dlsym export to an `nccl*` name whose definition `found`
/// glibc found in `handle`: the agent's own export of that name when it has one (every
/// entry point that takes or makes a communicator), so that a program that looks NCCL up
/// by name gets the agent's synthetic handles as one linked against it does; else `found`.
/// The library looked in becomes the one the agent calls, if none is known yet (NCCL
/// inside a larger library that the program opened by path).
///
/// # Safety
/// `symbol` is NUL-terminated and `handle` is what the program passed to dlsym.
pub unsafe fn redirect_dlsym(handle: *mut c_void, symbol: *const c_char, found: *mut c_void) -> *mut c_void {
    if !dlsym_redirect_on() || cuda::in_agent(found) {
        return found;
    }
    let Some(real) = cuda::real_dlsym() else { return found };
    let ours = match agent_handle() {
        // SAFETY: `symbol` is NUL-terminated (the caller's contract); the agent's handle is
        // live.
        Some(h) => unsafe { real(h, symbol) },
        None => std::ptr::null_mut(),
    };
    if ours.is_null() || !cuda::in_agent(ours) {
        return found;
    }
    if handle != libc::RTLD_DEFAULT && handle != libc::RTLD_NEXT {
        let _ = LIBNCCL.compare_exchange(std::ptr::null_mut(), handle, Ordering::AcqRel, Ordering::Acquire);
    }
    ours
}

/// Whether `nccl*` lookups by name are answered with the agent's entry points: only with
/// `HIBER_NCCL_DLSYM=1`, for now. XLA's process on two GPUs died at its checkpoint because
/// libcuda's own threads ran while its device state was away; hiber's checkpoint inside
/// CRIU's freeze (`HIBER_DEVICE_IN_FREEZE=1`, experimental) prevents that, and with both
/// the process survived its checkpoint once (2×H200, #41). Until the GPU suite has passed
/// with them, such a job is refused before anything stops and runs on.
fn dlsym_redirect_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("HIBER_NCCL_DLSYM").is_some_and(|v| v == "1"))
}

/// A handle to the agent's own library, for looking up its exports by name.
fn agent_handle() -> Option<*mut c_void> {
    static HANDLE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
    let h = HANDLE.load(Ordering::Acquire);
    if !h.is_null() {
        return Some(h);
    }
    // SAFETY: dladdr only reads the loader's tables; Dl_info is plain data. RTLD_NOLOAD
    // only returns a handle to an object already loaded (the agent itself), kept for good.
    let h = unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(agent_handle as *const c_void, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        libc::dlopen(info.dli_fname, libc::RTLD_LAZY | libc::RTLD_NOLOAD)
    };
    if h.is_null() {
        return None;
    }
    HANDLE.store(h, Ordering::Release);
    Some(h)
}

/// NCCL's own `name` (never the agent's export of it), resolved once into `slot`: in the
/// loaded `libnccl.so`, else the next definition after the agent (a library that carries
/// NCCL inside it and exports its names); 0 when there is none.
fn resolve(slot: &AtomicUsize, name: &CStr) -> usize {
    let p = slot.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    let Some(dlsym) = cuda::real_dlsym() else { return 0 };
    let p = match libnccl() {
        // SAFETY: `h` is a live dlopen handle and `name` is NUL-terminated.
        Some(h) => (unsafe { dlsym(h, name.as_ptr()) }) as usize,
        // SAFETY: RTLD_NEXT from the agent's own code (glibc's dlsym, called directly, sees
        // the agent as the caller): the first definition loaded after the agent.
        None => (unsafe { dlsym(libc::RTLD_NEXT, name.as_ptr()) }) as usize,
    };
    slot.store(p, Ordering::Relaxed);
    if p != 0 {
        // Where NCCL's proxy threads poll from (see poll.rs); noted here, outside any poll.
        crate::poll::note_nccl(p);
    }
    p
}

macro_rules! real {
    (ident $name:ident => $ty:ty) => {
        real!(@ concat!(stringify!($name), "\0") => $ty)
    };
    ($name:literal => $ty:ty) => {
        real!(@ concat!($name, "\0") => $ty)
    };
    (@ $name:expr => $ty:ty) => {{
        static REAL: AtomicUsize = AtomicUsize::new(0);
        // SAFETY: the bytes are a name and the one NUL `concat!` appends.
        let name = unsafe { CStr::from_bytes_with_nul_unchecked($name.as_bytes()) };
        match resolve(&REAL, name) {
            0 => None,
            // SAFETY: the non-zero address is NCCL's entry point of this name, whose
            // nccl.h signature `$ty` is.
            p => Some(unsafe { std::mem::transmute::<usize, $ty>(p) }),
        }
    }};
}

type FnComm = unsafe extern "C" fn(Comm) -> NcclResult;
type FnAsyncError = unsafe extern "C" fn(Comm, *mut NcclResult) -> NcclResult;
type FnCommInt = unsafe extern "C" fn(Comm, *mut c_int) -> NcclResult;
type FnInitConfig = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut c_void) -> NcclResult;
type FnInitAll = unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> NcclResult;
type FnUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type FnGroup = unsafe extern "C" fn() -> NcclResult;

fn real_abort(c: Comm) -> NcclResult {
    match real!("ncclCommAbort" => FnComm) {
        // SAFETY: `c` is a live real communicator the agent recorded.
        Some(f) => unsafe { f(c) },
        None => SYSTEM_ERROR,
    }
}

fn real_async_error(c: Comm) -> NcclResult {
    let mut e = SUCCESS;
    match real!("ncclCommGetAsyncError" => FnAsyncError) {
        // SAFETY: a live real communicator and a valid out-pointer.
        Some(f) => match unsafe { f(c, &mut e) } {
            SUCCESS => e,
            r => r,
        },
        None => SYSTEM_ERROR,
    }
}

fn real_query(c: Comm, which: &str) -> Result<c_int, NcclResult> {
    let f = match which {
        "count" => real!("ncclCommCount" => FnCommInt),
        "rank" => real!("ncclCommUserRank" => FnCommInt),
        _ => real!("ncclCommCuDevice" => FnCommInt),
    };
    let Some(f) = f else { return Err(SYSTEM_ERROR) };
    let mut v: c_int = -1;
    // SAFETY: a live real communicator and a valid out-pointer.
    match unsafe { f(c, &mut v) } {
        SUCCESS => Ok(v),
        r => Err(r),
    }
}

fn real_group(end: bool) -> NcclResult {
    let f = if end { real!("ncclGroupEnd" => FnGroup) } else { real!("ncclGroupStart" => FnGroup) };
    match f {
        // SAFETY: no arguments.
        Some(f) => unsafe { f() },
        None => SYSTEM_ERROR,
    }
}

// ---- what the agent records ---------------------------------------------------------

pub use hiber_wire::agent::Lane;

/// A copy of the application's `ncclConfig_t`, with the strings it points to.
#[derive(Clone)]
struct Config {
    bytes: Vec<u64>,
    net_name: Option<CString>,
    comm_name: Option<CString>,
}

/// `ncclConfig_t`'s first fields (stable since NCCL 2.14): size, magic, version, then at
/// byte 32 `const char *netName` and at byte 48 `const char *commName`.
const CONFIG_NET_NAME: usize = 32 / 8;
const CONFIG_COMM_NAME: usize = 48 / 8;
const CONFIG_MAX: usize = 1024;

impl Config {
    /// Copies `*p` (the application may free its config and strings after the call).
    ///
    /// # Safety
    /// `p` is null or points to an `ncclConfig_t` whose `size` field is its size.
    unsafe fn capture(p: *const c_void) -> Option<Config> {
        if p.is_null() {
            return None;
        }
        // SAFETY: an ncclConfig_t starts with its size (a size_t).
        let size = unsafe { *(p as *const usize) };
        if !(56..=CONFIG_MAX).contains(&size) {
            return None;
        }
        let mut bytes = vec![0u64; size.div_ceil(8)];
        // SAFETY: `size` bytes are readable at `p` (the struct's own size), and `bytes` has
        // room for them.
        unsafe { std::ptr::copy_nonoverlapping(p as *const u8, bytes.as_mut_ptr() as *mut u8, size) };
        let string = |at: usize| {
            let s = bytes[at] as *const c_char;
            // SAFETY: a non-null netName/commName is a NUL-terminated string (nccl.h).
            (!s.is_null()).then(|| unsafe { CStr::from_ptr(s) }.to_owned())
        };
        let (net_name, comm_name) = (string(CONFIG_NET_NAME), string(CONFIG_COMM_NAME));
        Some(Config { bytes, net_name, comm_name })
    }

    /// The copy, its string pointers pointing at the agent's own copies.
    fn as_ptr(&mut self) -> *mut c_void {
        self.bytes[CONFIG_NET_NAME] = self.net_name.as_ref().map_or(0, |s| s.as_ptr() as u64);
        self.bytes[CONFIG_COMM_NAME] = self.comm_name.as_ref().map_or(0, |s| s.as_ptr() as u64);
        self.bytes.as_mut_ptr() as *mut c_void
    }
}

/// How a communicator was made, so it can be made again.
enum Origin {
    /// Made from a unique id every rank shares (`ncclCommInitRank*`, or derived from a
    /// parent: split, shrink): rebuilt with `ncclCommInitRankConfig` and a fresh id.
    Ranks { config: Option<Config> },
    /// One of `ncclCommInitAll`'s communicators (all ranks in this process): rebuilt
    /// together, by `ncclCommInitAll` again.
    All { group: u64, index: usize, ndev: c_int, devs: Vec<c_int> },
}

struct Entry {
    /// 0 while torn down.
    real: usize,
    /// The same on every rank: derived from the unique id, or from the parent's key.
    key: u64,
    rank: c_int,
    nranks: c_int,
    dev: c_int,
    origin: Origin,
    lanes: BTreeMap<Lane, u64>,
    /// Splits and shrinks made from it, which derive their keys from it.
    children: u64,
    /// Why it cannot be rebuilt, when it used something the agent does not replay.
    unsafe_use: Option<&'static str>,
    /// The unique id of its next rebuild (from hiber).
    next_id: Option<UniqueId>,
    /// Torn down for good (a rank's process is gone): its calls fail as after a peer's
    /// death in NCCL, and no cut or rebuild counts it.
    failed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Open,
    /// No submission beyond the limits.
    Held,
    /// Communicators torn down: every call on them waits.
    Down,
}

struct State {
    phase: Phase,
    comms: BTreeMap<usize, Entry>,
    next_handle: usize,
    next_all_group: u64,
    /// Threads inside a group, inside a submission, inside a communicator's creation.
    in_group: usize,
    in_call: usize,
    in_init: usize,
    /// Threads in other calls on a real communicator.
    in_use: usize,
    /// Lane limits while held; a lane not listed may not grow.
    limits: BTreeMap<(usize, Lane), u64>,
    /// Every lane's count when the hold began: what a lane without a limit must still have.
    held_at: BTreeMap<(usize, Lane), u64>,
}

impl State {
    /// No communicator yet, nothing held.
    const fn new() -> State {
        State {
            phase: Phase::Open,
            comms: BTreeMap::new(),
            next_handle: 1,
            next_all_group: 0,
            in_group: 0,
            in_call: 0,
            in_init: 0,
            in_use: 0,
            limits: BTreeMap::new(),
            held_at: BTreeMap::new(),
        }
    }
}

static STATE: Mutex<State> = Mutex::new(State::new());
static CHANGED: Condvar = Condvar::new();

thread_local! {
    /// The thread's depth of NCCL groups.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Set while the thread runs NCCL's own code (an application call the agent forwarded,
    /// or the agent's control thread calling NCCL): NCCL's calls to its own exported API
    /// come back to the agent's exports and must go straight through, uncounted.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// The thread runs NCCL's code until this drops.
pub struct Inside(bool);

pub fn inside() -> Inside {
    Inside(INSIDE.replace(true))
}

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.set(self.0);
    }
}

fn nested() -> bool {
    INSIDE.get()
}

fn lock() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

fn wait(g: MutexGuard<'static, State>) -> MutexGuard<'static, State> {
    CHANGED.wait_timeout(g, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0
}

/// A 64-bit name for bytes every rank holds alike (FNV-1a: an identifier, not a checksum).
fn name_of(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.iter() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl State {
    fn count(&self, h: usize, lane: Lane) -> u64 {
        self.comms.get(&h).and_then(|e| e.lanes.get(&lane)).copied().unwrap_or(0)
    }

    /// Whether a submission on `lane` of `h` may go ahead now.
    fn admits(&self, h: usize, lane: Lane) -> bool {
        match self.phase {
            Phase::Open => true,
            Phase::Down => false,
            Phase::Held => {
                let n = self.count(h, lane);
                n < self.limits.get(&(h, lane)).copied().unwrap_or(n)
            }
        }
    }

    /// Whether some lane is still short of its limit (a group may be how it gets there).
    fn behind(&self) -> bool {
        self.limits.iter().any(|(&(h, lane), &limit)| self.count(h, lane) < limit)
    }

    fn register(&mut self, real: Comm, key: u64, rank: c_int, nranks: c_int, origin: Origin) -> Option<Comm> {
        if self.next_handle > MAX_HANDLE {
            return None;
        }
        let h = self.next_handle;
        self.next_handle += 1;
        let entry = Entry {
            real: real as usize,
            key,
            rank,
            nranks,
            dev: -1,
            origin,
            lanes: BTreeMap::new(),
            children: 0,
            unsafe_use: None,
            next_id: None,
            failed: false,
        };
        self.comms.insert(h, entry);
        Some(h as Comm)
    }
}

/// A call holding a real communicator the agent made: [`down`] waits for it before tearing
/// any down. Calls on communicators the agent did not make are not counted (nothing of
/// theirs is torn down).
struct InUse(bool);

impl Drop for InUse {
    fn drop(&mut self) {
        if !self.0 {
            return;
        }
        let mut s = lock();
        s.in_use -= 1;
        if s.phase != Phase::Open {
            CHANGED.notify_all();
        }
    }
}

/// The real communicator behind `c` (waiting while communicators are torn down), in use
/// until the guard drops.
fn real_of(c: Comm) -> Result<(Comm, InUse), NcclResult> {
    let h = c as usize;
    if !is_synthetic(c) {
        return Ok((c, InUse(false)));
    }
    let mut s = lock();
    loop {
        match s.comms.get(&h) {
            None => return Err(INVALID_ARGUMENT),
            Some(e) if e.failed => return Err(REMOTE_ERROR),
            Some(e) if e.real != 0 => {
                let real = e.real as Comm;
                s.in_use += 1;
                return Ok((real, InUse(true)));
            }
            Some(_) if s.phase == Phase::Down => s = wait(s),
            Some(_) => return Err(INVALID_USAGE),
        }
    }
}

/// A submission on its way into NCCL: counted, and left when it returns.
struct Submission;

impl Drop for Submission {
    fn drop(&mut self) {
        let mut s = lock();
        s.in_call -= 1;
        if s.phase != Phase::Open {
            CHANGED.notify_all();
        }
    }
}

/// Counts a submission on `lane` of `c` (waiting first, outside a group, while the lane is
/// at its limit) and returns the real communicator.
fn submit(c: Comm, lane: Lane) -> Result<(Comm, Submission), NcclResult> {
    let h = c as usize;
    let mut s = lock();
    if !is_synthetic(c) {
        s.in_call += 1;
        return Ok((c, Submission));
    }
    if s.comms.get(&h).is_some_and(|e| e.failed) {
        return Err(REMOTE_ERROR);
    }
    if DEPTH.get() == 0 {
        while s.comms.get(&h).is_some_and(|e| !e.failed) && !s.admits(h, lane) {
            s = wait(s);
        }
    }
    let e = s.comms.get_mut(&h).ok_or(INVALID_ARGUMENT)?;
    if e.real == 0 {
        return Err(if e.failed { REMOTE_ERROR } else { INVALID_USAGE });
    }
    *e.lanes.entry(lane).or_default() += 1;
    let real = e.real as Comm;
    s.in_call += 1;
    Ok((real, Submission))
}

/// Waits until communicators may be created (not while hiber holds or rebuilds them).
fn begin_init() {
    let mut s = lock();
    if DEPTH.get() == 0 {
        while s.phase != Phase::Open {
            s = wait(s);
        }
    }
    s.in_init += 1;
}

fn end_init() {
    let mut s = lock();
    s.in_init -= 1;
    CHANGED.notify_all();
}

// ---- the exported API -----------------------------------------------------------------

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

/// One of the agent's handles (not a communicator NCCL made for another library).
fn is_synthetic(c: Comm) -> bool {
    (1..=MAX_HANDLE).contains(&(c as usize))
}

fn mark_unsafe(c: Comm, why: &'static str) {
    if let Some(e) = lock().comms.get_mut(&(c as usize)) {
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

fn leave_group() {
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
            match s.register(real_comm, key, i as c_int, ndev, origin) {
                // SAFETY: as above.
                Some(h) => unsafe { *slot = h },
                None => log("more NCCL communicators than the agent can name; later ones are not checkpointable"),
            }
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
fn adopt(comm: *mut Comm, r: NcclResult, key: u64, rank: c_int, nranks: c_int, origin: Origin) -> NcclResult {
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
    match s.register(real_comm, key, rank, nranks, origin) {
        Some(h) => {
            if let Some((Ok(n), Ok(rk), Ok(d))) = known {
                if let Some(e) = s.comms.get_mut(&(h as usize)) {
                    (e.nranks, e.rank, e.dev) = (n, rk, d);
                }
            }
            // SAFETY: as above.
            unsafe { *comm = h }
        }
        None => log("more NCCL communicators than the agent can name; later ones are not checkpointable"),
    }
    r
}

/// A child of `parent` (split or shrink): the key follows from the parent's and the child's
/// place among its siblings, alike on every rank that made it.
/// `record` is the child's config as the application gave it; without one, the child
/// has its parent's (as NCCL gives it), which its rebuild keeps.
fn adopt_child(parent: Comm, newcomm: *mut Comm, r: NcclResult, how: &[u8], record: Option<Config>) -> NcclResult {
    let (key, record) = {
        let mut s = lock();
        let Some(p) = s.comms.get_mut(&(parent as usize)) else { return r };
        p.children += 1;
        let inherited = match &p.origin {
            Origin::Ranks { config } => config.clone(),
            Origin::All { .. } => None,
        };
        (name_of(&[b"child", &p.key.to_le_bytes(), &p.children.to_le_bytes(), how]), record.or(inherited))
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
fn end(comm: Comm, name: &str) -> NcclResult {
    let h = comm as usize;
    let f = if name == "abort" { real!("ncclCommAbort" => FnComm) } else { real!("ncclCommDestroy" => FnComm) };
    let Some(f) = f else { return SYSTEM_ERROR };
    if nested() || !is_synthetic(comm) {
        // SAFETY: a communicator the agent did not make, forwarded unchanged.
        return unsafe { f(comm) };
    }
    let real_comm = {
        // Not while hiber holds or rebuilds the communicators: every rank's must be there
        // for the rebuild, and this one is ended once it is rebuilt. One ended for good
        // (`fail`) goes at once: the others may wait long for their rebuild.
        let mut s = lock();
        while s.phase != Phase::Open && s.comms.get(&h).is_some_and(|e| !e.failed) {
            s = wait(s);
        }
        match s.comms.remove(&h) {
            Some(e) => e.real,
            None => return INVALID_ARGUMENT,
        }
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
fn recorded(comm: Comm, pick: fn(&Entry) -> c_int) -> Option<Result<c_int, NcclResult>> {
    let h = comm as usize;
    if nested() || !is_synthetic(comm) {
        return None;
    }
    let s = lock();
    match s.comms.get(&h) {
        None => Some(Err(INVALID_ARGUMENT)),
        Some(e) if e.real == 0 => Some(Ok(pick(e))),
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

fn query(comm: Comm, out: *mut c_int, which: &str, pick: fn(&Entry) -> c_int) -> NcclResult {
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

// ---- what hiber asks --------------------------------------------------------------------

/// One communicator as a rank reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub key: u64,
    pub rank: c_int,
    pub nranks: c_int,
    /// All its ranks are in this process (`ncclCommInitAll`): rebuilt without hiber's help.
    pub local: bool,
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

fn reports(s: &State) -> Vec<Report> {
    s.comms
        .values()
        .filter(|e| !e.failed)
        .map(|e| Report {
            key: e.key,
            rank: e.rank,
            nranks: e.nranks,
            local: matches!(e.origin, Origin::All { .. }),
            lanes: e.lanes.iter().map(|(l, n)| (*l, *n)).collect(),
        })
        .collect()
}

/// The communicators, as they are (to plan a rebuild).
pub fn list() -> Vec<Report> {
    reports(&lock())
}

fn wait_until(
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
    let reals: Vec<(usize, Comm)> = s.comms.iter().filter(|(_, e)| !e.failed).map(|(h, e)| (*h, e.real as Comm)).collect();
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
fn quiet(s: MutexGuard<'static, State>) -> (MutexGuard<'static, State>, bool) {
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
fn end_all(reals: Vec<(usize, usize)>, dev: Option<c_int>, calm: bool) -> Result<(), String> {
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
fn on_device<T>(dev: Option<c_int>, f: impl FnOnce() -> T) -> T {
    // A context that cannot be made current leaves the thread as it is, as before.
    let _current = dev.zip(cuda::driver()).and_then(|(dev, d)| d.enter(dev).ok());
    f()
}

fn reopen(s: &mut State) {
    s.phase = Phase::Open;
    s.limits.clear();
    s.held_at.clear();
    CHANGED.notify_all();
}

/// The agent's own NCCL calls (teardown, creation) make gated driver calls, on its thread
/// and on NCCL's: with the gate closed they would wait for ever.
fn refuse_closed_gate() -> Result<(), String> {
    if crate::gate::is_closed() {
        return Err("the application's CUDA calls are held (its memory is not back yet)".into());
    }
    Ok(())
}

impl State {
    /// A device this process's communicators use (the first one known), for the agent's own
    /// NCCL calls.
    fn device(&self) -> Option<c_int> {
        self.comms.values().map(|e| e.dev).find(|d| *d >= 0)
    }

    /// The first lane that went past where the cut puts it (its limit, or its count when
    /// the hold began): a group let in to catch up on one lane can add to others.
    fn overshoot(&self) -> Option<String> {
        self.comms.iter().find_map(|(h, e)| {
            e.lanes.iter().find_map(|(lane, &n)| {
                let cut = self.limits.get(&(*h, *lane)).or_else(|| self.held_at.get(&(*h, *lane))).copied().unwrap_or(0);
                (n > cut).then(|| format!("communicator {:016x} lane {lane} reached {n}, past the cut at {cut}", e.key))
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
    let h = s.comms.iter().find(|(_, e)| e.key == key && !e.failed).map(|(h, _)| *h).ok_or_else(|| format!("no NCCL communicator {key:016x}"))?;
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
            (live().map(|e| e.real as Comm).collect(), live().map(|e| e.dev).filter(|d| *d >= 0).collect())
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
    if s.phase == Phase::Down && s.comms.values().any(|e| e.real == 0 && !e.failed) {
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
        let reals = s.comms.iter_mut().rev().map(|(h, e)| (*h, std::mem::take(&mut e.real))).filter(|(_, r)| *r != 0).collect();
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
        for (h, e) in s.comms.iter_mut().filter(|(_, e)| e.key == key && !e.failed) {
            found = true;
            e.failed = true;
            match std::mem::take(&mut e.real) {
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
    for e in s.comms.values_mut().filter(|e| e.key == key && !e.failed) {
        e.next_id = Some(id);
        found = true;
    }
    if !found {
        return Err(format!("no NCCL communicator {key:016x}"));
    }
    Ok(())
}

/// What one communicator is rebuilt from.
struct Plan {
    handle: usize,
    rank: c_int,
    nranks: c_int,
    dev: c_int,
    id: UniqueId,
    /// Its own copy of the recorded config: the creation thread may outlive the record.
    config: Option<Config>,
}

/// One `ncclCommInitAll` call to make again: its members (handle, index), and the call's
/// device count and list.
type AllCall = (Vec<(usize, usize)>, c_int, Vec<c_int>);

/// Every communicator to make again.
struct Creation {
    all: Vec<AllCall>,
    plans: Vec<Plan>,
}

/// Makes the communicators of `c` (on a thread of its own: creation is collective and
/// waits for every rank). Returns each one's handle and real communicator.
fn create(c: Creation, d: &'static cuda::Driver, init: FnInitConfig, init_all: FnInitAll, deadline: Instant) -> Result<Vec<(usize, usize)>, String> {
    // NCCL's group end sets the thread's device back to the one current when the group
    // began: on this fresh thread that was device 0, so a rank on GPU 1 gained a primary
    // context on GPU 0 in its first rebuild (0.13 s of the pause and 518 MiB of device memory
    // on 2xH200, then checkpointed by the driver each time). The whole creation runs with a
    // device of its own communicators current.
    let home = c.plans.first().map(|p| p.dev).or_else(|| c.all.first().map(|(_, _, devs)| devs.first().copied().unwrap_or(0))).filter(|d| *d >= 0);
    on_device(home, || create_here(c, d, init, init_all, deadline))
}

fn create_here(mut c: Creation, d: &'static cuda::Driver, init: FnInitConfig, init_all: FnInitAll, deadline: Instant) -> Result<Vec<(usize, usize)>, String> {
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
struct Outcome {
    made: Option<Result<Vec<(usize, usize)>, String>>,
    abandoned: bool,
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
        if let Some(e) = s.comms.values().find(|e| !e.failed && matches!(e.origin, Origin::Ranks { .. }) && e.next_id.is_none()) {
            return Err(format!("no unique id for NCCL communicator {:016x}", e.key));
        }
        let mut all: BTreeMap<u64, AllCall> = BTreeMap::new();
        let mut plans = Vec::new();
        let mut stale = Vec::new();
        for (h, e) in s.comms.iter_mut().filter(|(_, e)| !e.failed) {
            match std::mem::take(&mut e.real) {
                0 => {}
                r => stale.push((*h, r)),
            }
            match &mut e.origin {
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
            Some(e) => e.real = c,
            None => log("a rebuilt NCCL communicator has no handle any more"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lane_admits_up_to_its_limit_and_a_torn_down_one_nothing() {
        let mut s = State::new();
        let h = s.register(0x1000 as Comm, 7, 0, 2, Origin::Ranks { config: None }).unwrap() as usize;
        assert!((1..=MAX_HANDLE).contains(&h), "the application gets a synthetic handle");
        s.comms.get_mut(&h).unwrap().lanes.insert(Lane::Coll, 3);
        assert!(s.admits(h, Lane::Coll) && s.admits(h, Lane::Send(1)));
        s.phase = Phase::Held;
        assert!(!s.admits(h, Lane::Coll) && !s.admits(h, Lane::Send(1)), "held: no lane grows");
        assert!(!s.behind(), "nothing to catch up on: groups wait too");
        s.limits.insert((h, Lane::Coll), 5);
        assert!(s.admits(h, Lane::Coll) && s.behind());
        assert!(!s.admits(h, Lane::Send(1)), "only the raised lane");
        s.comms.get_mut(&h).unwrap().lanes.insert(Lane::Coll, 5);
        assert!(!s.admits(h, Lane::Coll) && !s.behind(), "at the limit");
        s.phase = Phase::Down;
        assert!(!s.admits(h, Lane::Coll));
    }

    /// The only test that touches the process's own state (the agent's `STATE`).
    #[test]
    fn calls_go_through_again_only_once_every_communicator_is_rebuilt_or_fail_once_ended() {
        let h = {
            let mut s = lock();
            let h = s.register(0x1000 as Comm, 9, 0, 2, Origin::Ranks { config: None }).unwrap() as usize;
            s.phase = Phase::Down;
            s.comms.get_mut(&h).unwrap().real = 0;
            h
        };
        assert!(open().is_err(), "torn down, not rebuilt: calls must keep waiting");
        assert!(is_down());
        lock().comms.get_mut(&h).unwrap().real = 0x2000;
        assert!(is_down(), "rebuilt but not opened: calls still wait (hiber opens every rank together)");
        open().unwrap();
        assert!(!is_down());
        assert!(fail(9).is_err(), "only torn-down communicators can be ended for good");
        // Torn down again, and a rank of communicator 9 is gone for good: its calls fail as
        // after a peer's death; another communicator of the process waits for its rebuild.
        let other = {
            let mut s = lock();
            let other = s.register(0x3000 as Comm, 4, 1, 2, Origin::Ranks { config: None }).unwrap() as usize;
            s.phase = Phase::Down;
            s.comms.get_mut(&h).unwrap().real = 0;
            s.comms.get_mut(&other).unwrap().real = 0;
            other
        };
        assert!(fail(5).is_err(), "no such communicator");
        fail(9).unwrap();
        assert_eq!(count(), 1, "only the other communicator counts for a cut or a rebuild");
        assert!(list().iter().all(|r| r.key == 4));
        assert_eq!(submit(h as Comm, Lane::Coll).err(), Some(REMOTE_ERROR));
        assert_eq!(real_of(h as Comm).err(), Some(REMOTE_ERROR));
        assert!(open().is_err() && is_down(), "the other one is not rebuilt yet");
        lock().comms.get_mut(&other).unwrap().real = 0x4000;
        open().unwrap();
        assert!(!is_down());
        assert_eq!(submit(h as Comm, Lane::Coll).err(), Some(REMOTE_ERROR), "still failed once open");
        lock().comms.remove(&other);
        lock().comms.remove(&h);
        assert!(is_synthetic(h as Comm) && !is_synthetic(std::ptr::null_mut()) && !is_synthetic((MAX_HANDLE + 1) as Comm));
    }

    #[test]
    fn keys_depend_on_every_part() {
        let a = name_of(&[b"init", &[1, 2, 3]]);
        assert_eq!(a, name_of(&[b"init", &[1, 2, 3]]));
        assert_ne!(a, name_of(&[b"init", &[1, 2, 4]]));
        assert_ne!(name_of(&[b"ab", b"c"]), name_of(&[b"a", b"bc"]), "parts are delimited");
    }

    #[test]
    fn a_config_copy_keeps_its_strings() {
        let net = CString::new("Socket").unwrap();
        let mut raw = [0u64; 10];
        raw[0] = 80;
        raw[1] = 0xcafebeef;
        raw[CONFIG_NET_NAME] = net.as_ptr() as u64;
        // SAFETY: `raw` is an 80-byte config whose size field says so.
        let mut c = unsafe { Config::capture(raw.as_ptr() as *const c_void) }.unwrap();
        drop(net);
        let p = c.as_ptr() as *const u64;
        // SAFETY: the copy is 80 bytes, and its netName points at the agent's own string.
        unsafe {
            assert_eq!(*p, 80);
            assert_eq!(*p.add(1), 0xcafebeef);
            assert_eq!(CStr::from_ptr(*p.add(CONFIG_NET_NAME) as *const c_char).to_str().unwrap(), "Socket");
            assert_eq!(*p.add(CONFIG_COMM_NAME), 0);
        }
        raw[0] = 8;
        // SAFETY: as above; a size too small to be a config is refused before reading more.
        assert!(unsafe { Config::capture(raw.as_ptr() as *const c_void) }.is_none());
    }
}
