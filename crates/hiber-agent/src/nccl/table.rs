//! What the agent records: each communicator the application made through it, behind a
//! virtual handle of hiber-layer's table (the handle the OpenCL layer's objects have too:
//! the real communicator behind it, swapped at a teardown and a rebuild, and how it was
//! made), with its lanes' counts and the phase of the cut.

use std::sync::Arc;

use hiber_layer::table::{Layer, Obj, Table};

use super::*;

pub use hiber_wire::agent::Lane;

/// A copy of the application's `ncclConfig_t`, with the strings it points to.
#[derive(Clone)]
pub(super) struct Config {
    pub(super) bytes: Vec<u64>,
    pub(super) net_name: Option<CString>,
    pub(super) comm_name: Option<CString>,
}

/// `ncclConfig_t`'s first fields (stable since NCCL 2.14): size, magic, version, then at
/// byte 32 `const char *netName` and at byte 48 `const char *commName`.
pub(super) const CONFIG_NET_NAME: usize = 32 / 8;
pub(super) const CONFIG_COMM_NAME: usize = 48 / 8;
pub(super) const CONFIG_MAX: usize = 1024;

impl Config {
    /// Copies `*p` (the application may free its config and strings after the call).
    ///
    /// # Safety
    /// `p` is null or points to an `ncclConfig_t` whose `size` field is its size.
    pub(super) unsafe fn capture(p: *const c_void) -> Option<Config> {
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
    pub(super) fn as_ptr(&mut self) -> *mut c_void {
        self.bytes[CONFIG_NET_NAME] = self.net_name.as_ref().map_or(0, |s| s.as_ptr() as u64);
        self.bytes[CONFIG_COMM_NAME] = self.comm_name.as_ref().map_or(0, |s| s.as_ptr() as u64);
        self.bytes.as_mut_ptr() as *mut c_void
    }
}

/// How a communicator was made, so it can be made again.
pub(super) enum Origin {
    /// Made from a unique id every rank shares (`ncclCommInitRank*`, or derived from a
    /// parent: split, shrink): rebuilt with `ncclCommInitRankConfig` and a fresh id.
    Ranks { config: Option<Config> },
    /// One of `ncclCommInitAll`'s communicators (all ranks in this process): rebuilt
    /// together, by `ncclCommInitAll` again.
    All { group: u64, index: usize, ndev: c_int, devs: Vec<c_int> },
}

/// The agent's layer in hiber-layer's table: one kind of object, the communicator.
pub(super) struct Nccl;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Kind {
    Comm,
}

/// How a communicator was made: what its object in the table carries.
pub(super) struct Record {
    /// The same on every rank: derived from the unique id, or from the parent's key.
    pub(super) key: u64,
    pub(super) origin: Origin,
}

static TABLE: Table<Nccl> = Table::new();

impl Layer for Nccl {
    type Kind = Kind;
    type Data = Record;
    type State = ();
    /// "hiberNCL", little-endian. NCCL's own `ncclComm` starts with its `startMagic`.
    const MAGIC: u64 = u64::from_le_bytes(*b"hiberNCL");
    fn table() -> &'static Table<Nccl> {
        &TABLE
    }
    fn is_root(_kind: Kind) -> bool {
        false
    }
    /// The real communicator is ended by the application's `ncclCommDestroy` or by a
    /// teardown, never by the handle going: nothing to do (and no lock may be taken here,
    /// where `STATE` may be held).
    fn dropped(_kind: Kind, _real: *mut c_void, _handle: usize, _data: &mut Record) {}
}

/// The agent's communicator behind the application's handle `c`, if it is one (a
/// communicator NCCL made for someone else is passed through untouched): its place in
/// creation order, which keys [`State::comms`].
pub(super) fn seq_of(c: Comm) -> Option<usize> {
    // Eight bytes are read behind a non-null `c`: the agent's object, or NCCL's (which
    // starts with its magic).
    Table::<Nccl>::get(c, Kind::Comm).map(|o| o.seq as usize)
}

/// The application lets go of its handle `c` (its communicator ended): the object goes
/// once the entry that holds it does too.
pub(super) fn release_handle(c: Comm) {
    Table::<Nccl>::release(c, Kind::Comm);
}

/// One of the agent's handles (not a communicator NCCL made for another library).
pub(super) fn is_synthetic(c: Comm) -> bool {
    seq_of(c).is_some()
}

pub(super) struct Entry {
    /// The application's handle: the real communicator behind it (null while torn down) and
    /// how it was made.
    pub(super) obj: Arc<Obj<Nccl>>,
    pub(super) rank: c_int,
    pub(super) nranks: c_int,
    pub(super) dev: c_int,
    pub(super) lanes: BTreeMap<Lane, u64>,
    /// Splits and shrinks made from it, which derive their keys from it.
    pub(super) children: u64,
    /// Why it cannot be rebuilt, when it used something the agent does not replay.
    pub(super) unsafe_use: Option<&'static str>,
    /// The unique id of its next rebuild (from hiber).
    pub(super) next_id: Option<UniqueId>,
    /// Torn down for good (a rank's process is gone): its calls fail as after a peer's
    /// death in NCCL, and no cut or rebuild counts it.
    pub(super) failed: bool,
}

impl Entry {
    /// The real communicator; 0 while torn down.
    pub(super) fn real(&self) -> usize {
        self.obj.real() as usize
    }

    pub(super) fn set_real(&self, real: usize) {
        self.obj.set_real(real as *mut c_void);
    }

    /// The real communicator, leaving none behind the handle.
    pub(super) fn take_real(&self) -> usize {
        let r = self.real();
        if r != 0 {
            self.set_real(0);
        }
        r
    }

    pub(super) fn key(&self) -> u64 {
        self.obj.key
    }

    pub(super) fn origin(&self) -> &Origin {
        &self.obj.origin
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Open,
    /// No submission beyond the limits.
    Held,
    /// Communicators torn down: every call on them waits.
    Down,
}

pub(super) struct State {
    pub(super) phase: Phase,
    /// By creation order ([`seq_of`] the handle).
    pub(super) comms: BTreeMap<usize, Entry>,
    pub(super) next_all_group: u64,
    /// Threads inside a group, inside a submission, inside a communicator's creation.
    pub(super) in_group: usize,
    pub(super) in_call: usize,
    pub(super) in_init: usize,
    /// Threads in other calls on a real communicator.
    pub(super) in_use: usize,
    /// Lane limits while held; a lane not listed may not grow.
    pub(super) limits: BTreeMap<(usize, Lane), u64>,
    /// Every lane's count when the hold began: what a lane without a limit must still have.
    pub(super) held_at: BTreeMap<(usize, Lane), u64>,
}

impl State {
    /// No communicator yet, nothing held.
    pub(super) const fn new() -> State {
        State {
            phase: Phase::Open,
            comms: BTreeMap::new(),
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

pub(super) static STATE: Mutex<State> = Mutex::new(State::new());
pub(super) static CHANGED: Condvar = Condvar::new();

thread_local! {
    /// The thread's depth of NCCL groups.
    pub(super) static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Set while the thread runs NCCL's own code (an application call the agent forwarded,
    /// or the agent's control thread calling NCCL): NCCL's calls to its own exported API
    /// come back to the agent's exports and must go straight through, uncounted.
    pub(super) static INSIDE: Cell<bool> = const { Cell::new(false) };
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

pub(super) fn nested() -> bool {
    INSIDE.get()
}

pub(super) fn lock() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn wait(g: MutexGuard<'static, State>) -> MutexGuard<'static, State> {
    CHANGED.wait_timeout(g, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0
}

/// A 64-bit name for bytes every rank holds alike (FNV-1a: an identifier, not a checksum).
pub(super) fn name_of(parts: &[&[u8]]) -> u64 {
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
    pub(super) fn count(&self, h: usize, lane: Lane) -> u64 {
        self.comms.get(&h).and_then(|e| e.lanes.get(&lane)).copied().unwrap_or(0)
    }

    /// Whether a submission on `lane` of `h` may go ahead now.
    pub(super) fn admits(&self, h: usize, lane: Lane) -> bool {
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
    pub(super) fn behind(&self) -> bool {
        self.limits.iter().any(|(&(h, lane), &limit)| self.count(h, lane) < limit)
    }

    /// Records `real` and returns the application's handle for it.
    pub(super) fn register(&mut self, real: Comm, key: u64, rank: c_int, nranks: c_int, origin: Origin) -> Comm {
        let obj = TABLE.make(Kind::Comm, real, Record { key, origin });
        let h = obj.seq as usize;
        let entry = Entry { obj: obj.clone(), rank, nranks, dev: -1, lanes: BTreeMap::new(), children: 0, unsafe_use: None, next_id: None, failed: false };
        self.comms.insert(h, entry);
        Table::give(obj) as Comm
    }
}

/// A call holding a real communicator the agent made: [`down`] waits for it before tearing
/// any down. Calls on communicators the agent did not make are not counted (nothing of
/// theirs is torn down).
pub(super) struct InUse(bool);

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
pub(super) fn real_of(c: Comm) -> Result<(Comm, InUse), NcclResult> {
    let Some(h) = seq_of(c) else {
        return Ok((c, InUse(false)));
    };
    let mut s = lock();
    loop {
        match s.comms.get(&h) {
            None => return Err(INVALID_ARGUMENT),
            Some(e) if e.failed => return Err(REMOTE_ERROR),
            Some(e) if e.real() != 0 => {
                let real = e.real() as Comm;
                s.in_use += 1;
                return Ok((real, InUse(true)));
            }
            Some(_) if s.phase == Phase::Down => s = wait(s),
            Some(_) => return Err(INVALID_USAGE),
        }
    }
}

/// A submission on its way into NCCL: counted, and left when it returns.
pub(super) struct Submission;

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
pub(super) fn submit(c: Comm, lane: Lane) -> Result<(Comm, Submission), NcclResult> {
    let seq = seq_of(c);
    let mut s = lock();
    let Some(h) = seq else {
        s.in_call += 1;
        return Ok((c, Submission));
    };
    if s.comms.get(&h).is_some_and(|e| e.failed) {
        return Err(REMOTE_ERROR);
    }
    if DEPTH.get() == 0 {
        while s.comms.get(&h).is_some_and(|e| !e.failed) && !s.admits(h, lane) {
            s = wait(s);
        }
    }
    let e = s.comms.get_mut(&h).ok_or(INVALID_ARGUMENT)?;
    if e.real() == 0 {
        return Err(if e.failed { REMOTE_ERROR } else { INVALID_USAGE });
    }
    *e.lanes.entry(lane).or_default() += 1;
    let real = e.real() as Comm;
    s.in_call += 1;
    Ok((real, Submission))
}

/// Waits until communicators may be created (not while hiber holds or rebuilds them).
pub(super) fn begin_init() {
    let mut s = lock();
    if DEPTH.get() == 0 {
        while s.phase != Phase::Open {
            s = wait(s);
        }
    }
    s.in_init += 1;
}

pub(super) fn end_init() {
    let mut s = lock();
    s.in_init -= 1;
    CHANGED.notify_all();
}
