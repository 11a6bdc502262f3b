//! Virtual OpenCL objects: what the application holds instead of the platform's handles.
//!
//! Each handle the application gets is the address of an [`Obj`], in `hiber-layer`'s table
//! of virtual handles (the real handle it stands for, swapped when hiber re-creates the
//! object, and the application's reference count), with this layer's [`Data`]: a
//! [`Record`] of how the object was made, which names the objects it was made from. A
//! record keeps those alive, as OpenCL keeps a kernel's program alive, so every object
//! still in use can be re-created in creation order after the real ones were released.
//!
//! Locks: the table's is never held while another is taken or the platform is called,
//! and no `Arc<Obj>` is dropped while it is held (a drop may release the object, which
//! takes the table). A record's lock may be taken while holding that of a record that
//! names it (a kernel's, then its program's), never the other way: records name only
//! older objects, so these waits cannot form a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use hiber_layer::table::{self, Layer, Table};

use crate::cl::{self, cl_int, ImageDesc, ImageFormat, H};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Platform,
    Device,
    Context,
    Queue,
    Mem,
    Sampler,
    Program,
    Kernel,
    Event,
}

impl Kind {
    /// The error OpenCL gives for a bad handle of this kind.
    pub fn invalid(self) -> cl_int {
        match self {
            Kind::Platform => cl::CL_INVALID_PLATFORM,
            Kind::Device => cl::CL_INVALID_DEVICE,
            Kind::Context => cl::CL_INVALID_CONTEXT,
            Kind::Queue => cl::CL_INVALID_COMMAND_QUEUE,
            Kind::Mem => cl::CL_INVALID_MEM_OBJECT,
            Kind::Sampler => cl::CL_INVALID_SAMPLER,
            Kind::Program => cl::CL_INVALID_PROGRAM,
            Kind::Kernel => cl::CL_INVALID_KERNEL,
            Kind::Event => cl::CL_INVALID_EVENT,
        }
    }
}

/// A kernel argument as the application set it.
#[derive(Debug, Clone)]
pub enum Arg {
    Bytes(Vec<u8>),
    /// `__local` memory of this size (`arg_value` NULL).
    Local(usize),
    /// A memory object or sampler, by its virtual object.
    Object(Arc<Obj>),
}

#[derive(Debug, Clone)]
pub enum ProgramSource {
    Text(Vec<u8>),
    Il(Vec<u8>),
    /// One binary per device, as given.
    Binary(Vec<(Arc<Obj>, Vec<u8>)>),
}

#[derive(Debug, Clone)]
pub enum Shape {
    Buffer,
    Sub { parent: Arc<Obj>, origin: usize },
    Image { format: ImageFormat, desc: ImageDesc, buffer: Option<Arc<Obj>>, element: usize },
}

/// How an object was made.
#[derive(Debug)]
pub enum Record {
    Platform {
        name: String,
    },
    Device {
        platform: Arc<Obj>,
        name: String,
        device_type: u64,
        /// Its place among the devices of its platform with its name (two GPUs of one
        /// model), in the order the platform lists them.
        ordinal: usize,
    },
    Context {
        devices: Vec<Arc<Obj>>,
        platform: Option<Arc<Obj>>,
        props: Vec<isize>,
        notify: ContextNotify,
        user_data: usize,
    },
    /// `props` is a zero-terminated `cl_queue_properties` list.
    Queue {
        context: Arc<Obj>,
        device: Arc<Obj>,
        props: Vec<u64>,
    },
    Mem {
        context: Arc<Obj>,
        flags: u64,
        size: usize,
        host_ptr: usize,
        props: Vec<u64>,
        shape: Shape,
    },
    /// `props` is a zero-terminated `cl_sampler_properties` list.
    Sampler {
        context: Arc<Obj>,
        props: Vec<u64>,
    },
    Program {
        context: Arc<Obj>,
        source: ProgramSource,
        build: Option<(Vec<Arc<Obj>>, CString)>,
    },
    Kernel {
        program: Arc<Obj>,
        name: CString,
        args: BTreeMap<u32, Arg>,
    },
    /// `status` is read when the real event is released (and set by `clSetUserEventStatus`).
    Event {
        context: Arc<Obj>,
        queue: Option<Arc<Obj>>,
        command: u32,
        user: bool,
        status: Option<cl_int>,
    },
    /// Made by a feature hiber cannot re-create (named in the registry's `refused`).
    Opaque {
        what: &'static str,
    },
}

/// The error callback an application gives a context (it takes no handles).
pub type ContextNotify = Option<unsafe extern "C" fn(*const std::ffi::c_char, *const c_void, usize, *mut c_void)>;

/// A destructor callback the application registered on a context, memory object or program.
pub type Destructor = (unsafe extern "C" fn(H, *mut c_void), usize);

/// One virtual object.
pub type Obj = table::Obj<Opencl>;

/// What the layer keeps of each object besides its handle and real handle.
pub struct Data {
    /// Outstanding maps of a memory object (clEnqueueMap* minus clEnqueueUnmapMemObject).
    pub maps: AtomicI64,
    pub rec: Mutex<Record>,
    pub destructors: Mutex<Vec<Destructor>>,
    /// An event's callbacks that have not run yet.
    pub callbacks: Mutex<Vec<PendingCallback>>,
}

impl Data {
    pub fn rec(&self) -> MutexGuard<'_, Record> {
        self.rec.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An event callback the application registered that has not run yet. A checkpoint releases
/// the real event before the platform may have run it; the layer registers it again on the
/// event it makes in its place, so that it runs once, on the event the application knows.
#[derive(Debug, Clone, Copy)]
pub struct PendingCallback {
    pub id: u64,
    /// The execution status it waits for (CL_COMPLETE, CL_RUNNING, CL_SUBMITTED).
    pub status: i32,
    /// The application's `void (*)(cl_event, cl_int, void *)`.
    pub f: EventNotify,
    pub data: usize,
}

/// What the platform hands the trampoline: one registration of one callback on one real event.
struct EventCallback {
    pending: PendingCallback,
    event: Arc<Obj>,
    /// The real event it was registered on.
    real: usize,
}

unsafe extern "C" fn event_trampoline(_real: H, status: cl_int, data: *mut c_void) {
    // SAFETY: `data` is the box `register_event_callback` leaked for this one call.
    let cb = unsafe { Box::from_raw(data as *mut EventCallback) };
    let run = {
        let mut pending = cb.event.callbacks.lock().unwrap_or_else(|e| e.into_inner());
        // A real event the layer released for a checkpoint: the callback is registered
        // again on the one made in its place, and runs there.
        // Run only by the registration that takes it off the pending list: never twice.
        let before = pending.len();
        if cb.event.real() as usize == cb.real {
            pending.retain(|p| p.id != cb.pending.id);
        }
        pending.len() < before
    };
    if run {
        // SAFETY: the application's callback with its own event handle and data.
        unsafe { (cb.pending.f)(cb.event.handle(), status, cb.pending.data as *mut c_void) };
    }
}

/// Registers `p` with the platform on `x`'s real event, through the trampoline.
pub(crate) fn register_event_callback(x: &Arc<Obj>, p: PendingCallback) -> cl_int {
    let Some(real_f) = cl::real().and_then(|r| r.clSetEventCallback) else { return cl::CL_INVALID_OPERATION };
    let real = x.real();
    let data = Box::into_raw(Box::new(EventCallback { pending: p, event: x.clone(), real: real as usize }));
    // SAFETY: the real event; the trampoline gives the application its own handle.
    let r = unsafe { real_f(real, p.status, Some(event_trampoline), data as *mut c_void) };
    if r != cl::CL_SUCCESS {
        // SAFETY: not registered, so not called: the box is ours to free.
        drop(unsafe { Box::from_raw(data) });
    }
    r
}

/// An event callback's type.
pub type EventNotify = unsafe extern "C" fn(H, cl_int, *mut c_void);

/// A fresh id for a [`PendingCallback`].
pub fn next_callback_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The OpenCL layer, as `hiber-layer`'s table knows it.
pub struct Opencl;

static TABLE: Table<Opencl> = Table::new();

impl Layer for Opencl {
    type Kind = Kind;
    type Data = Data;
    type State = State;
    const MAGIC: u64 = 0x3143_7265_6269_6821; // "!hiberC1"

    fn table() -> &'static Table<Opencl> {
        &TABLE
    }

    /// Platforms and devices live as long as the process.
    fn is_root(kind: Kind) -> bool {
        matches!(kind, Kind::Platform | Kind::Device)
    }

    fn dropped(kind: Kind, real: H, me: usize, data: &mut Data) {
        let callbacks = std::mem::take(data.destructors.get_mut().unwrap_or_else(|e| e.into_inner()));
        // The application's destructor callbacks run when the platform deletes the object,
        // which may be after commands still using it finish: handed to the platform's own
        // callback where it has one, else called now.
        let callbacks = if callbacks.is_empty() || real.is_null() { callbacks } else { hand_to_platform(kind, real, callbacks, me) };
        if !real.is_null() {
            release_real(kind, real);
        }
        run_destructors(callbacks, me);
    }
}

fn run_destructors(callbacks: Vec<Destructor>, me: usize) {
    for (f, data) in callbacks.into_iter().rev() {
        // SAFETY: the application registered `f` with `data` for this object's
        // destruction, which is now; it gets the handle it knew the object by.
        unsafe { f(me as H, data as *mut c_void) };
    }
}

unsafe extern "C" fn destructor_trampoline(_real: H, data: *mut c_void) {
    // SAFETY: `data` is the box `hand_to_platform` leaked for this one call.
    let b = unsafe { Box::from_raw(data as *mut (Vec<Destructor>, usize)) };
    run_destructors(b.0, b.1);
}

/// Registers `callbacks` with the platform's destructor callback of `real`; what it could
/// not register comes back.
fn hand_to_platform(kind: Kind, real: H, callbacks: Vec<Destructor>, me: usize) -> Vec<Destructor> {
    let set = cl::real().and_then(|r| match kind {
        Kind::Mem => r.clSetMemObjectDestructorCallback,
        Kind::Context => r.clSetContextDestructorCallback,
        _ => None,
    });
    let Some(set) = set else { return callbacks };
    let data = Box::into_raw(Box::new((callbacks, me)));
    // SAFETY: a real object on which the layer still holds its reference; the trampoline
    // takes the box back when the platform calls it, once.
    if unsafe { set(real, Some(destructor_trampoline), data as *mut c_void) } == cl::CL_SUCCESS {
        return Vec::new();
    }
    // SAFETY: not registered, so never called: the box is ours again.
    unsafe { Box::from_raw(data) }.0
}

/// Releases the one reference the layer holds on a real object.
pub(crate) fn release_real(kind: Kind, real: H) {
    let Some(r) = cl::real() else { return };
    let f = match kind {
        Kind::Context => r.clReleaseContext,
        Kind::Queue => r.clReleaseCommandQueue,
        Kind::Mem => r.clReleaseMemObject,
        Kind::Sampler => r.clReleaseSampler,
        Kind::Program => r.clReleaseProgram,
        Kind::Kernel => r.clReleaseKernel,
        Kind::Event => r.clReleaseEvent,
        Kind::Platform | Kind::Device => None,
    };
    if let Some(f) = f {
        // SAFETY: `real` is a live object of this kind on which the layer holds one
        // reference, given up here exactly once.
        unsafe { f(real) };
    }
}

/// What the layer keeps for the whole process (reached through [`registry`]).
#[derive(Default)]
pub struct State {
    /// OpenCL features used that hiber cannot checkpoint.
    pub refused: BTreeSet<&'static str>,
    /// The real objects were released for a checkpoint and not yet re-created.
    pub released: bool,
    /// Memory objects re-created whose bytes hiber has not written back yet: the gate
    /// stays closed while there are any.
    pub pending: BTreeSet<u64>,
    /// The process called OpenCL.
    pub active: bool,
}

/// The table, locked: the layer's [`State`] and its objects.
pub fn registry() -> table::Guard<Opencl> {
    TABLE.lock()
}

/// Marks a feature the process used that hiber cannot checkpoint.
pub fn refuse(what: &'static str) {
    let mut reg = registry();
    if reg.refused.insert(what) {
        drop(reg);
        crate::log(&format!("the application used {what}: it runs on, but hiber will refuse to checkpoint it"));
    }
}

/// A new object for `real`, held once by the application (roots are held by the table).
pub fn make(kind: Kind, real: H, rec: Record) -> Arc<Obj> {
    let data = Data { maps: AtomicI64::new(0), rec: Mutex::new(rec), destructors: Mutex::new(Vec::new()), callbacks: Mutex::new(Vec::new()) };
    TABLE.make(kind, real, data)
}

/// Hands a new object to the application: the handle owns one strong count.
pub fn give(o: Arc<Obj>) -> H {
    Table::give(o)
}

/// The object behind an application handle, if it is one of ours of `kind`.
pub fn get(h: H, kind: Kind) -> Option<Arc<Obj>> {
    Table::get(h, kind)
}

/// The object of `kind` whose handle is the value `h`, if there is one: for values that
/// may be handles or plain data (a kernel argument), never read through.
pub fn lookup(h: H, kind: Kind) -> Option<Arc<Obj>> {
    TABLE.lookup(h, kind)
}

/// The real handle behind `h`, or OpenCL's error for a bad handle of `kind`. On every
/// call's path, so it takes no reference: the application holds the handle for the call.
/// Safe with any value the application passed as a handle (see [`Table::get`]).
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn real_of(h: H, kind: Kind) -> Result<H, cl_int> {
    // SAFETY: the reference ends here, within the application's call.
    unsafe { borrow(h, kind) }.map(|o| o.real())
}

/// The live object of `kind` behind handle `h`, borrowed for the call that passed it (the
/// application holds the handle meanwhile, as for [`real_of`]): no reference is taken, for
/// the calls on every launch's path.
///
/// # Safety
/// The reference must not outlive the application's call.
pub unsafe fn borrow<'a>(h: H, kind: Kind) -> Result<&'a Obj, cl_int> {
    // SAFETY: the caller's contract.
    unsafe { Table::borrow(h, kind) }.ok_or(kind.invalid())
}

/// Real handles for a list of `n` virtual ones (a wait list, a device list).
///
/// # Safety
/// `list` points to `n` handles, or is null with `n` 0.
pub unsafe fn reals(list: *const H, n: u32, kind: Kind) -> Result<Vec<H>, cl_int> {
    if list.is_null() || n == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the caller's contract.
    let l = unsafe { std::slice::from_raw_parts(list, n as usize) };
    l.iter().map(|&h| real_of(h, kind)).collect()
}

/// The objects for a list of `n` virtual handles.
///
/// # Safety
/// As [`reals`].
pub unsafe fn objs(list: *const H, n: u32, kind: Kind) -> Result<Vec<Arc<Obj>>, cl_int> {
    if list.is_null() || n == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the caller's contract.
    let l = unsafe { std::slice::from_raw_parts(list, n as usize) };
    l.iter().map(|&h| get(h, kind).ok_or(kind.invalid())).collect()
}

/// The application's handle for a real one, when the layer knows it.
pub fn virtual_of(real: H) -> Option<H> {
    TABLE.virtual_of(real)
}

/// `clRetain*` (see [`Table::retain`]).
pub fn retain(h: H, kind: Kind) -> cl_int {
    if Table::<Opencl>::retain(h, kind) {
        cl::CL_SUCCESS
    } else {
        kind.invalid()
    }
}

/// `clRelease*`: the application's last release lets the object go (now, or when the
/// objects made from it go).
pub fn release(h: H, kind: Kind) -> cl_int {
    if Table::<Opencl>::release(h, kind) {
        cl::CL_SUCCESS
    } else {
        kind.invalid()
    }
}

/// Every object not yet destroyed, in creation order.
pub fn all_live() -> Vec<Arc<Obj>> {
    TABLE.all_live()
}

/// Whether `f` holds within a second. Tests run side by side in one process, and another
/// test's `all_live` (which upgrades every object) may hold an object for a moment.
#[cfg(test)]
fn eventually(f: impl Fn() -> bool) -> bool {
    (0..200).any(|_| {
        let ok = f();
        if !ok {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        ok
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opaque(kind: Kind) -> H {
        give(make(kind, std::ptr::null_mut(), Record::Opaque { what: "test" }))
    }

    #[test]
    fn a_handle_lives_until_its_last_release_and_its_children() {
        let ctx = opaque(Kind::Context);
        let seq = get(ctx, Kind::Context).unwrap().seq;
        assert_eq!(retain(ctx, Kind::Context), cl::CL_SUCCESS);
        assert_eq!(get(ctx, Kind::Context).unwrap().app_refs(), 2);
        // A queue's record keeps its context, as OpenCL keeps it.
        let q = give(make(
            Kind::Queue,
            std::ptr::null_mut(),
            Record::Queue { context: get(ctx, Kind::Context).unwrap(), device: get(opaque(Kind::Device), Kind::Device).unwrap(), props: vec![0] },
        ));
        assert_eq!(release(ctx, Kind::Context), cl::CL_SUCCESS);
        assert_eq!(release(ctx, Kind::Context), cl::CL_SUCCESS);
        assert!(all_live().iter().any(|x| x.seq == seq), "the queue keeps its context");
        assert_eq!(release(q, Kind::Queue), cl::CL_SUCCESS);
        assert!(eventually(|| !all_live().iter().any(|x| x.seq == seq)), "gone with the queue");
    }

    #[test]
    fn handles_of_the_wrong_kind_or_none_are_refused() {
        let m = opaque(Kind::Mem);
        assert!(get(m, Kind::Mem).is_some());
        assert!(get(m, Kind::Kernel).is_none());
        assert_eq!(real_of(m, Kind::Kernel), Err(cl::CL_INVALID_KERNEL));
        // No real object behind it (released for a checkpoint): invalid until re-created.
        assert_eq!(real_of(m, Kind::Mem), Err(cl::CL_INVALID_MEM_OBJECT));
        assert_eq!(real_of(std::ptr::null_mut(), Kind::Queue), Err(cl::CL_INVALID_COMMAND_QUEUE));
        assert_eq!(release(m, Kind::Mem), cl::CL_SUCCESS);
    }

    #[test]
    fn a_kernel_argument_that_is_no_handle_is_never_read_through() {
        // An 8-byte scalar whose value is no address: `lookup` must answer from the
        // registry alone (reading through it would fault).
        let bogus = 0xdead_beef_0000_0001usize as H;
        assert!(lookup(bogus, Kind::Mem).is_none());
        let m = opaque(Kind::Mem);
        assert!(lookup(m, Kind::Mem).is_some());
        assert!(lookup(m, Kind::Sampler).is_none());
        assert_eq!(release(m, Kind::Mem), cl::CL_SUCCESS);
        assert!(lookup(m, Kind::Mem).is_none(), "a destroyed object's handle is not taken for one");
    }
}

#[cfg(test)]
mod retain_tests {
    use super::*;

    #[test]
    fn retaining_an_object_the_application_let_go_makes_it_the_applications_again() {
        let ctx = give(make(Kind::Context, std::ptr::null_mut(), Record::Opaque { what: "test" }));
        let c = get(ctx, Kind::Context).unwrap();
        let seq = c.seq;
        // A queue keeps it alive; the application releases its own reference.
        let keeper = c.clone();
        drop(c);
        assert_eq!(release(ctx, Kind::Context), cl::CL_SUCCESS);
        // It gets the handle back (as from CL_QUEUE_CONTEXT) and retains it, then releases
        // it: the keeper's reference must survive that.
        assert_eq!(retain(ctx, Kind::Context), cl::CL_SUCCESS);
        assert_eq!(release(ctx, Kind::Context), cl::CL_SUCCESS);
        assert!(eventually(|| Arc::strong_count(&keeper) == 1), "only the keeper's");
        assert!(all_live().iter().any(|x| x.seq == seq));
        drop(keeper);
        assert!(eventually(|| !all_live().iter().any(|x| x.seq == seq)));
    }
}
