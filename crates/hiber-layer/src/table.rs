//! Virtual handles: what the application holds in place of a library's own.
//!
//! Each handle a layer gives the application is the address of an [`Obj`]: the real handle
//! it stands for (swapped when hiber re-creates the object), the application's reference
//! count, a sequence number in creation order, and the layer's own data (for the OpenCL
//! layer, a record of how the object was made, naming the objects it was made from by
//! `Arc<Obj>`, which keeps those alive as the library keeps a kernel's program). Every
//! object still in use can so be made again, in creation order, after the real ones were
//! released ([`Table::all_live`]).
//!
//! A handle is recognized by the magic number its object starts with (each layer has its
//! own): reading the first eight bytes is valid behind any handle an application passes,
//! ours or the library's (whose objects start with a pointer). [`Table::lookup`] answers
//! from the table alone, for values that may be handles or plain data.
//!
//! Locks: the table's is never held while another is taken or the library is called, and
//! no `Arc<Obj>` is dropped while it is held (a drop may release the object, which takes
//! the table's lock).

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::hash::Hash;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// What a layer keeps in its table.
pub trait Layer: Sized + Send + Sync + 'static {
    /// The kinds of object (the OpenCL layer's: platform, device, context, ...).
    type Kind: Copy + Eq + Hash + std::fmt::Debug + Send + Sync;
    /// What one object carries besides its handle, kind, sequence number and real handle.
    type Data: Send + Sync;
    /// What the table keeps for the whole process besides its objects.
    type State: Default + Send;
    /// The first eight bytes of every object of this layer.
    const MAGIC: u64;
    /// The layer's table (a `static` of its own).
    fn table() -> &'static Table<Self>;
    /// Objects of this kind live as long as the process: the table holds them, and the
    /// application's releases do nothing.
    fn is_root(kind: Self::Kind) -> bool;
    /// The object is gone (its last reference dropped; it has left the table): gives up
    /// the real handle, when it has one, and whatever its data asks for.
    fn dropped(kind: Self::Kind, real: *mut c_void, handle: usize, data: &mut Self::Data);
}

/// One virtual object. `#[repr(C)]` keeps `magic` first, where handles are checked.
#[repr(C)]
pub struct Obj<L: Layer> {
    magic: u64,
    pub kind: L::Kind,
    /// Its place in creation order.
    pub seq: u64,
    real: AtomicPtr<c_void>,
    app_refs: AtomicU32,
    data: L::Data,
}

impl<L: Layer> std::fmt::Debug for Obj<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} #{} ({:p})", self.kind, self.seq, self.real())
    }
}

impl<L: Layer> std::ops::Deref for Obj<L> {
    type Target = L::Data;
    fn deref(&self) -> &L::Data {
        &self.data
    }
}

impl<L: Layer> Obj<L> {
    pub fn real(&self) -> *mut c_void {
        self.real.load(Ordering::Acquire)
    }

    /// Puts `real` behind the handle (a re-created object, or null once released).
    pub fn set_real(&self, real: *mut c_void) {
        let old = self.real.swap(real, Ordering::AcqRel);
        let me = self.handle() as usize;
        let mut reg = L::table().lock();
        if !old.is_null() && reg.by_real.get(&(old as usize)).is_some_and(|&(_, v)| v == me) {
            reg.by_real.remove(&(old as usize));
        }
        if !real.is_null() {
            reg.by_real.insert(real as usize, (self.kind, me));
        }
    }

    /// The handle the application holds.
    pub fn handle(&self) -> *mut c_void {
        self as *const Obj<L> as *mut c_void
    }

    pub fn app_refs(&self) -> u32 {
        self.app_refs.load(Ordering::Relaxed)
    }
}

impl<L: Layer> Drop for Obj<L> {
    fn drop(&mut self) {
        let real = *self.real.get_mut();
        let me = self.handle() as usize;
        let mut reg = L::table().lock();
        reg.live.remove(&self.seq);
        reg.handles.remove(&me);
        // Before the release: once released, the library may give the address to a new
        // object, whose entry this must not remove.
        if !real.is_null() && reg.by_real.get(&(real as usize)).is_some_and(|&(_, v)| v == me) {
            reg.by_real.remove(&(real as usize));
        }
        drop(reg);
        L::dropped(self.kind, real, me, &mut self.data);
    }
}

/// A layer's objects, and what it keeps for the process ([`Layer::State`], reached through
/// the guard [`Table::lock`] returns).
pub struct Table<L: Layer> {
    inner: Mutex<Option<Registry<L>>>,
}

/// The table's contents.
pub struct Registry<L: Layer> {
    next_seq: u64,
    /// Every object not yet destroyed, by creation order.
    live: BTreeMap<u64, Weak<Obj<L>>>,
    /// Real handle → (kind, virtual handle), for answers that name objects.
    by_real: HashMap<usize, (L::Kind, usize)>,
    /// Every virtual handle not yet destroyed, and its kind.
    handles: HashMap<usize, L::Kind>,
    /// The objects that live as long as the process.
    roots: Vec<Arc<Obj<L>>>,
    state: L::State,
}

impl<L: Layer> std::ops::Deref for Registry<L> {
    type Target = L::State;
    fn deref(&self) -> &L::State {
        &self.state
    }
}

impl<L: Layer> std::ops::DerefMut for Registry<L> {
    fn deref_mut(&mut self) -> &mut L::State {
        &mut self.state
    }
}

/// The table, locked.
pub struct Guard<L: Layer>(MutexGuard<'static, Option<Registry<L>>>);

impl<L: Layer> std::ops::Deref for Guard<L> {
    type Target = Registry<L>;
    fn deref(&self) -> &Registry<L> {
        self.0.as_ref().expect("initialized by lock()")
    }
}

impl<L: Layer> std::ops::DerefMut for Guard<L> {
    fn deref_mut(&mut self) -> &mut Registry<L> {
        self.0.as_mut().expect("initialized by lock()")
    }
}

impl<L: Layer> Default for Table<L> {
    fn default() -> Self {
        Table::new()
    }
}

impl<L: Layer> Table<L> {
    pub const fn new() -> Table<L> {
        Table { inner: Mutex::new(None) }
    }

    pub fn lock(&'static self) -> Guard<L> {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.get_or_insert_with(|| Registry {
            next_seq: 0,
            live: BTreeMap::new(),
            by_real: HashMap::new(),
            handles: HashMap::new(),
            roots: Vec::new(),
            state: L::State::default(),
        });
        Guard(g)
    }

    /// A new object for `real`, held once by the application (a root by the table).
    pub fn make(&'static self, kind: L::Kind, real: *mut c_void, data: L::Data) -> Arc<Obj<L>> {
        let mut reg = self.lock();
        reg.next_seq += 1;
        let o = Arc::new(Obj { magic: L::MAGIC, kind, seq: reg.next_seq, real: AtomicPtr::new(real), app_refs: AtomicU32::new(1), data });
        reg.live.insert(o.seq, Arc::downgrade(&o));
        reg.handles.insert(Arc::as_ptr(&o) as usize, kind);
        if !real.is_null() {
            reg.by_real.insert(real as usize, (kind, Arc::as_ptr(&o) as usize));
        }
        if L::is_root(kind) {
            reg.roots.push(o.clone());
        }
        o
    }

    /// Hands a new object to the application: the handle owns one strong count.
    pub fn give(o: Arc<Obj<L>>) -> *mut c_void {
        Arc::into_raw(o) as *mut c_void
    }

    /// The object behind `h`, borrowed for the call that passed it, if it is one of ours:
    /// no reference is taken (the application holds the handle for the call).
    ///
    /// # Safety
    /// `h` is a value the application passed as a handle of this library, and the
    /// reference does not outlive its call.
    unsafe fn peek<'a>(h: *mut c_void) -> Option<&'a Obj<L>> {
        if h.is_null() {
            return None;
        }
        let p = h as *const Obj<L>;
        // SAFETY: a non-null handle the application passes is either one of ours (an `Obj`,
        // whose first field is `magic`) or a pointer to the library's object, which also
        // starts with a pointer-sized field. Reading eight bytes is valid either way.
        if unsafe { std::ptr::read(p as *const u64) } != L::MAGIC {
            return None;
        }
        // SAFETY: the magic says `p` is an `Obj`, alive while the application holds its
        // handle, as it does for the length of the call it passed it to.
        Some(unsafe { &*p })
    }

    /// The object behind an application handle, if it is one of ours of `kind`, with a
    /// reference of its own. Safe to call with any value the application passed as a
    /// handle of the library (eight bytes are read behind it, as `peek` says); values that
    /// may be plain data go through [`lookup`](Self::lookup).
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    pub fn get(h: *mut c_void, kind: L::Kind) -> Option<Arc<Obj<L>>> {
        // SAFETY: a handle the application passed to the call this runs in.
        let o = unsafe { Self::peek(h) }?;
        let p = o as *const Obj<L>;
        // SAFETY: `p` is an `Obj` made by `give` (or a root), alive while the application
        // holds its handle; a second strong count keeps it alive for the caller.
        let o = unsafe {
            Arc::increment_strong_count(p);
            Arc::from_raw(p)
        };
        (o.kind == kind).then_some(o)
    }

    /// The object of `kind` whose handle is the value `h`, if there is one: for values that
    /// may be handles or plain data (a kernel argument), never read through.
    pub fn lookup(&'static self, h: *mut c_void, kind: L::Kind) -> Option<Arc<Obj<L>>> {
        if self.lock().handles.get(&(h as usize)) != Some(&kind) {
            return None;
        }
        Self::get(h, kind)
    }

    /// The live object of `kind` behind `h` (one with a real handle), borrowed for the call
    /// that passed it: for the calls on every launch's path, so it takes no reference.
    ///
    /// # Safety
    /// The reference must not outlive the application's call.
    pub unsafe fn borrow<'a>(h: *mut c_void, kind: L::Kind) -> Option<&'a Obj<L>> {
        // SAFETY: the caller's contract.
        let o = unsafe { Self::peek(h) }?;
        (o.kind == kind && !o.real().is_null()).then_some(o)
    }

    /// The application's handle for a real one, when the layer knows it.
    pub fn virtual_of(&'static self, real: *mut c_void) -> Option<*mut c_void> {
        if real.is_null() {
            return None;
        }
        self.lock().by_real.get(&(real as usize)).map(|&(_, v)| v as *mut c_void)
    }

    /// The application retains `h`. An object it had let go of but that is still alive (a
    /// queue keeps its context, and a query hands the context out again) is the
    /// application's again: its handle takes back the strong count it gave up.
    pub fn retain(h: *mut c_void, kind: L::Kind) -> bool {
        let Some(o) = Self::get(h, kind) else { return false };
        if o.app_refs.fetch_add(1, Ordering::AcqRel) == 0 && !L::is_root(kind) {
            // SAFETY: `o` (from `get`) keeps the object alive; the application's handle
            // owns this new count, given back by its last release.
            unsafe { Arc::increment_strong_count(Arc::as_ptr(&o)) };
        }
        true
    }

    /// The application releases `h`: its last release lets the object go (now, or when
    /// the objects that name it go). False for a handle that is not one of ours of `kind`,
    /// or one released more often than retained.
    pub fn release(h: *mut c_void, kind: L::Kind) -> bool {
        let Some(o) = Self::get(h, kind) else { return false };
        if L::is_root(kind) {
            return true;
        }
        match o.app_refs.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)) {
            Ok(1) => {
                let p = Arc::as_ptr(&o);
                drop(o);
                // SAFETY: the application's handle owned one strong count (see `give`),
                // which its last release gives back, once.
                unsafe { Arc::decrement_strong_count(p) };
                true
            }
            Ok(_) => true,
            Err(_) => false,
        }
    }

    /// Every object not yet destroyed, in creation order.
    pub fn all_live(&'static self) -> Vec<Arc<Obj<L>>> {
        let reg = self.lock();
        reg.live.values().filter_map(Weak::upgrade).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    struct Test;

    #[derive(Default)]
    struct Made(Vec<Arc<Obj<Test>>>);

    static TABLE: Table<Test> = Table::new();
    static RELEASED: AtomicUsize = AtomicUsize::new(0);

    impl Layer for Test {
        type Kind = u8;
        /// The objects it was made from.
        type Data = Made;
        type State = u32;
        const MAGIC: u64 = 0x7473_6554_7265_6268;
        fn table() -> &'static Table<Test> {
            &TABLE
        }
        fn is_root(kind: u8) -> bool {
            kind == 0
        }
        fn dropped(_kind: u8, real: *mut c_void, _handle: usize, _data: &mut Made) {
            if !real.is_null() {
                RELEASED.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// Tests run side by side: another's `all_live` may hold an object for a moment.
    fn eventually(f: impl Fn() -> bool) -> bool {
        (0..200).any(|_| {
            let ok = f();
            if !ok {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            ok
        })
    }

    #[test]
    fn an_object_lives_while_the_application_or_an_object_made_from_it_holds_it() {
        let real = 0x1000 as *mut c_void;
        let parent = Table::give(TABLE.make(1, real, Made::default()));
        let seq = Table::<Test>::get(parent, 1).unwrap().seq;
        assert_eq!(TABLE.virtual_of(real), Some(parent));
        let child = Table::give(TABLE.make(2, std::ptr::null_mut(), Made(vec![Table::<Test>::get(parent, 1).unwrap()])));
        assert_eq!(Table::<Test>::get(child, 2).unwrap().0.len(), 1, "the child names its parent");
        assert!(Table::<Test>::release(parent, 1));
        assert!(TABLE.all_live().iter().any(|o| o.seq == seq), "the child keeps it");
        assert!(Table::<Test>::get(parent, 2).is_none(), "wrong kind");
        let before = RELEASED.load(Ordering::SeqCst);
        assert!(Table::<Test>::release(child, 2));
        assert!(eventually(|| !TABLE.all_live().iter().any(|o| o.seq == seq)), "gone with the child");
        assert!(RELEASED.load(Ordering::SeqCst) > before, "its real handle given up");
        assert_eq!(TABLE.virtual_of(real), None);
    }

    #[test]
    fn real_handles_swap_and_plain_values_are_never_read_through() {
        let h = Table::give(TABLE.make(3, std::ptr::null_mut(), Made::default()));
        // SAFETY: a handle of this test, for the length of the test.
        assert!(unsafe { Table::<Test>::borrow(h, 3) }.is_none(), "no real object behind it yet");
        let o = Table::<Test>::get(h, 3).unwrap();
        o.set_real(0x2000 as *mut c_void);
        // SAFETY: as above.
        assert!(unsafe { Table::<Test>::borrow(h, 3) }.is_some());
        assert_eq!(TABLE.virtual_of(0x2000 as *mut c_void), Some(h));
        o.set_real(0x3000 as *mut c_void);
        assert_eq!(TABLE.virtual_of(0x2000 as *mut c_void), None, "the old real handle is forgotten");
        drop(o);
        assert!(TABLE.lookup(0xdead_beef_0000_0001usize as *mut c_void, 3).is_none());
        assert!(TABLE.lookup(h, 3).is_some() && TABLE.lookup(h, 4).is_none());
        assert!(Table::<Test>::retain(h, 3) && Table::<Test>::release(h, 3) && Table::<Test>::release(h, 3));
        assert!(TABLE.lookup(h, 3).is_none(), "a destroyed object's handle is not taken for one");
        **TABLE.lock() += 1;
        assert!(**TABLE.lock() >= 1, "the layer's own state");
    }

    #[test]
    fn roots_live_as_long_as_the_process() {
        let h = Table::give(TABLE.make(0, std::ptr::null_mut(), Made::default()));
        assert!(Table::<Test>::release(h, 0) && Table::<Test>::release(h, 0));
        assert!(Table::<Test>::get(h, 0).is_some());
    }
}
