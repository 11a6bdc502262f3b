//! The real NCCL: where its entry points are, and the agent's answer to lookups of them
//! by name.

use super::*;

pub(super) static LIBNCCL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// The application's NCCL, once loaded (the agent never loads it).
pub(super) fn libnccl() -> Option<*mut c_void> {
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

/// Whether `nccl*` lookups by name are answered with the agent's entry points: yes unless
/// `HIBER_NCCL_DLSYM=0`. Without it a process that looks NCCL up by name (XLA's) holds
/// communicators the agent cannot cut, and hiber refuses its checkpoint before anything
/// stops. Such a process also needs the driver's checkpoint inside CRIU's freeze (hiber's
/// CRIU, patch 0004): libcuda's own threads in an XLA process die if it runs while its
/// device state is away (#41).
pub(super) fn dlsym_redirect_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("HIBER_NCCL_DLSYM").is_none_or(|v| v != "0"))
}

/// A handle to the agent's own library, for looking up its exports by name.
pub(super) fn agent_handle() -> Option<*mut c_void> {
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
pub(super) fn resolve(slot: &AtomicUsize, name: &CStr) -> usize {
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

pub(super) type FnComm = unsafe extern "C" fn(Comm) -> NcclResult;
pub(super) type FnAsyncError = unsafe extern "C" fn(Comm, *mut NcclResult) -> NcclResult;
pub(super) type FnCommInt = unsafe extern "C" fn(Comm, *mut c_int) -> NcclResult;
pub(super) type FnInitConfig = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut c_void) -> NcclResult;
pub(super) type FnInitAll = unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> NcclResult;
pub(super) type FnUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
pub(super) type FnGroup = unsafe extern "C" fn() -> NcclResult;

pub(super) fn real_abort(c: Comm) -> NcclResult {
    match real!("ncclCommAbort" => FnComm) {
        // SAFETY: `c` is a live real communicator the agent recorded.
        Some(f) => unsafe { f(c) },
        None => SYSTEM_ERROR,
    }
}

pub(super) fn real_async_error(c: Comm) -> NcclResult {
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

pub(super) fn real_query(c: Comm, which: &str) -> Result<c_int, NcclResult> {
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

pub(super) fn real_group(end: bool) -> NcclResult {
    let f = if end { real!("ncclGroupEnd" => FnGroup) } else { real!("ncclGroupStart" => FnGroup) };
    match f {
        // SAFETY: no arguments.
        Some(f) => unsafe { f() },
        None => SYSTEM_ERROR,
    }
}
