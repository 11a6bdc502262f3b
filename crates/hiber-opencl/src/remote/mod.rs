//! API-proxy mode: the layer's calls to "the real OpenCL" go to a separate proxy process
//! instead of `libOpenCL.so.1`, so the application never loads the vendor's library (whose
//! open device files CRIU cannot checkpoint).
//!
//! With `HIBER_OPENCL_PROXY` set (and non-empty), [`crate::cl::real`] returns
//! [`client::table`]: one stub per entry point, each encoding its arguments ([`wire`]),
//! sending them over the current [`Transport`], and writing the answer's outputs where the
//! caller asked. In the proxy, a [`server::Dispatcher`] decodes each request, calls the real
//! ICD loader and encodes the outputs. "Real" handles in the application are then the
//! proxy's handle values: opaque numbers, never dereferenced here.
//!
//! # Posted calls
//! Calls whose result the application cannot observe at once are *posted*: sent without
//! waiting, answered `CL_SUCCESS` at once. They are `clSetKernelArg`, `clFlush`, every
//! `clRelease*` and `clRetainCommandQueue`, and `clEnqueueNDRangeKernel`, `clEnqueueTask`,
//! `clEnqueueFill*` and `clEnqueueCopy*` without an event out, and the non-blocking
//! `clEnqueueWrite*` without an event out. The proxy runs posts in order before any later
//! call. If one fails there, the proxy keeps the first such error and hands it back in the
//! next call's answer (CheCL does the same): the stub logs it, and `clFinish`,
//! `clWaitForEvents` and the reads return it when they themselves succeeded.
//!
//! # Memory
//! Reads are always done blocking in the proxy and their bytes written to the
//! application's pointer before the stub returns (a non-blocking read that completes at
//! once is allowed). Writes copy the application's bytes into the request, but for
//! those of at least [`peer::PEER_MIN`] bytes, which the proxy reads straight from this
//! process's memory, as large reads write into it ([`peer`]), when it can. A map is done
//! blocking in the proxy and answered with a copy of the mapped bytes, held in application
//! memory: at `host_ptr + offset` for a `CL_MEM_USE_HOST_PTR` object (the spec requires
//! that pointer), else in pages the stub maps; unmap sends the bytes back when the map was
//! for writing. The proxy makes a `CL_MEM_USE_HOST_PTR` object with `CL_MEM_COPY_HOST_PTR`
//! from the bytes sent, so its host memory is coherent only through map and unmap, which is
//! all the spec promises anyway; `CL_MEM_FLAGS` and `CL_MEM_HOST_PTR` answer what the
//! application asked for.
//!
//! # Callbacks
//! Event, destructor and context callbacks are kept here under an id ([`on_notify`]); the
//! proxy registers a trampoline that sends the id and the callback's arguments back as a
//! notification, which the transport's notify thread hands to [`on_notify`]. Build,
//! compile and link notifications run the call synchronously and call the function after
//! the answer.
//!
//! # Not supported
//! Shared virtual memory (`clSVMAlloc`, `clSVMFree`, `clEnqueueSVM*`,
//! `clSetKernelArgSVMPointer`), pipes (`clCreatePipe`, `clGetPipeInfo`) and
//! `clGetExtensionFunctionAddressForPlatform` answer `CL_INVALID_OPERATION` (or null). The
//! layer refuses checkpoints of processes that use them anyway.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use crate::cl::{cl_int, H};

pub mod client;
pub mod peer;
pub mod server;
pub mod wire;

/// How requests reach the proxy. Implemented by the shared-memory transport.
pub trait Transport: Send + Sync {
    /// Sends a request and waits for its answer.
    fn call(&self, req: &[u8]) -> std::io::Result<Vec<u8>>;
    /// Sends a request without waiting; the proxy handles posts in order, before any later
    /// call.
    fn post(&self, req: &[u8]) -> std::io::Result<()>;
    /// Sends a request that the proxy handles without waiting for earlier posts (for calls
    /// that only unblock the platform: a post blocked in it may wait for one).
    fn call_unordered(&self, req: &[u8]) -> std::io::Result<Vec<u8>> {
        self.call(req)
    }
    /// A connection this process inherited from its parent by `fork`: it belongs to the
    /// parent's proxy, and using (or closing) it would break the parent's calls.
    fn inherited(&self) -> bool {
        false
    }
}

/// Connects lazily when a stub finds no transport.
pub type ConnectFn = fn() -> Option<Arc<dyn Transport>>;

static TRANSPORT: RwLock<Option<Arc<dyn Transport>>> = RwLock::new(None);
/// Counts the transports set or connected: what is known of one proxy (whether it reaches
/// this process's memory) is not taken for the next.
static GENERATION: AtomicU64 = AtomicU64::new(0);
static CONNECT: OnceLock<ConnectFn> = OnceLock::new();

/// Whether the layer runs in proxy mode: `HIBER_OPENCL_PROXY` set and non-empty, read once.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os(hiber_wire::opencl::PROXY_ENV).is_some_and(|v| !v.is_empty()))
}

/// Sets (or, with `None`, drops) the transport every stub uses.
pub fn set_transport(t: Option<Arc<dyn Transport>>) {
    let mut slot = TRANSPORT.write().unwrap_or_else(|e| e.into_inner());
    *slot = t;
    GENERATION.fetch_add(1, Ordering::AcqRel);
}

/// Sets the function that connects when there is no transport; only the first one counts.
pub fn set_connect(f: ConnectFn) {
    let _ = CONNECT.set(f);
}

/// The current transport, connecting through [`set_connect`]'s function if there is none.
pub(crate) fn transport() -> Option<Arc<dyn Transport>> {
    if let Some(t) = TRANSPORT.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
        if !t.inherited() {
            return Some(t.clone());
        }
    }
    let connect = CONNECT.get()?;
    let mut slot = TRANSPORT.write().unwrap_or_else(|e| e.into_inner());
    if let Some(old) = slot.take_if(|t| t.inherited()) {
        // The parent's: never dropped here, where dropping would close it for the parent.
        std::mem::forget(old);
    }
    if slot.is_none() {
        *slot = connect();
        GENERATION.fetch_add(1, Ordering::AcqRel);
    }
    slot.clone()
}

/// The current transport and its generation (see [`GENERATION`]), connecting as [`transport`].
pub(crate) fn transport_and_generation() -> Option<(Arc<dyn Transport>, u64)> {
    transport()?;
    // Both under the lock that setting a transport takes: the generation is this one's.
    let held = TRANSPORT.read().unwrap_or_else(|e| e.into_inner());
    let t = held.as_ref().filter(|t| !t.inherited())?.clone();
    Some((t, GENERATION.load(Ordering::Acquire)))
}

/// Notification kinds (the byte after the callback's id).
pub(crate) const NOTIFY_EVENT: u8 = 1;
pub(crate) const NOTIFY_DESTRUCTOR: u8 = 2;
pub(crate) const NOTIFY_CONTEXT: u8 = 3;

pub(crate) type EventFn = unsafe extern "C" fn(H, cl_int, *mut c_void);
pub(crate) type DestructorFn = unsafe extern "C" fn(H, *mut c_void);
pub(crate) type ContextFn = unsafe extern "C" fn(*const std::ffi::c_char, *const c_void, usize, *mut c_void);

/// An application callback waiting for its notification; `usize` is its `user_data`.
#[derive(Clone, Copy)]
pub(crate) enum Callback {
    /// Runs once.
    Event(EventFn, usize),
    /// Runs once.
    Destructor(DestructorFn, usize),
    /// Runs any number of times, for as long as the context lives.
    Context(ContextFn, usize),
}

fn callbacks() -> &'static Mutex<HashMap<u64, Callback>> {
    static CALLBACKS: OnceLock<Mutex<HashMap<u64, Callback>>> = OnceLock::new();
    CALLBACKS.get_or_init(Default::default)
}

/// Keeps `cb` under a fresh id (never 0) for the proxy's trampoline to name.
pub(crate) fn add_callback(cb: Callback) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    callbacks().lock().unwrap_or_else(|e| e.into_inner()).insert(id, cb);
    id
}

pub(crate) fn remove_callback(id: u64) {
    callbacks().lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
}

/// Handles a notification from the proxy (`u64 id, u8 kind` and the callback's arguments):
/// calls the application's callback. The transport's notify thread calls this; it never
/// panics, and ignores a notification it cannot read or whose id it does not know.
pub fn on_notify(msg: &[u8]) {
    let r = std::panic::catch_unwind(|| notify(msg));
    if r.is_err() {
        crate::log("remote: a notification's callback panicked");
    }
}

fn notify(msg: &[u8]) {
    let mut r = wire::Reader::new(msg);
    let (Ok(id), Ok(kind)) = (r.u64(), r.u8()) else {
        crate::log("remote: a malformed notification");
        return;
    };
    let cb = {
        let mut table = callbacks().lock().unwrap_or_else(|e| e.into_inner());
        match table.get(&id).copied() {
            Some(Callback::Context(f, d)) => Some(Callback::Context(f, d)),
            Some(_) => table.remove(&id),
            None => None,
        }
    };
    let Some(cb) = cb else {
        crate::log(&format!("remote: a notification for unknown callback {id}"));
        return;
    };
    match (cb, kind) {
        (Callback::Event(f, d), NOTIFY_EVENT) => {
            let (Ok(e), Ok(status)) = (r.h(), r.i32()) else { return };
            // SAFETY: the application registered `f` for this event with `d`; it gets the
            // event's (proxy) handle and status as the loader would give them.
            unsafe { f(e, status, d as *mut c_void) };
        }
        (Callback::Destructor(f, d), NOTIFY_DESTRUCTOR) => {
            let Ok(h) = r.h() else { return };
            // SAFETY: as above, for a destructor callback of `h`.
            unsafe { f(h, d as *mut c_void) };
        }
        (Callback::Context(f, d), NOTIFY_CONTEXT) => {
            let (Ok(info), Ok(private)) = (r.bytes(), r.bytes()) else { return };
            let info = CString::new(info.iter().copied().filter(|&b| b != 0).collect::<Vec<u8>>()).unwrap_or_default();
            // SAFETY: as above; `info` is NUL-terminated and `private` holds the bytes the
            // platform gave, both alive for the call.
            unsafe { f(info.as_ptr(), private.as_ptr().cast(), private.len(), d as *mut c_void) };
        }
        _ => crate::log(&format!("remote: notification kind {kind} does not match callback {id}")),
    }
}
