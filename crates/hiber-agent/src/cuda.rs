//! The real driver: libcuda's entry points, found behind the agent's own exports.
//!
//! The agent exports driver symbols itself (so programs linked against libcuda call the
//! agent), so it must never call a driver function by name: every real entry point is
//! looked up in libcuda's own handle with the real `dlsym`. All of the agent's unsafe
//! calls into libcuda are in this module, behind safe wrappers that return `CUresult`s.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::OnceLock;

use hiber_cuda_sys::fns;
pub use hiber_cuda_sys::{
    CUcontext as Ctx, CUdeviceptr as DevPtr, CUmemAccessDesc as AccessDesc, CUmemAllocationProp as AllocationProp, CUmemHandle as Handle, CUresult as CuResult,
    CUuuid,
};

pub const SUCCESS: CuResult = hiber_cuda_sys::CUDA_SUCCESS;
pub const ERROR_INVALID_VALUE: CuResult = hiber_cuda_sys::CUDA_ERROR_INVALID_VALUE;
pub const ERROR_OUT_OF_MEMORY: CuResult = hiber_cuda_sys::CUDA_ERROR_OUT_OF_MEMORY;
pub const ERROR_NOT_FOUND: CuResult = hiber_cuda_sys::CUDA_ERROR_NOT_FOUND;
pub const HANDLE_TYPE_POSIX_FD: c_int = hiber_cuda_sys::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

type RealDlsym = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// glibc's dlsym, resolved when the agent is loaded; the `dlsym` entry point jumps to it.
pub static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// Runs when the agent is loaded: resolves glibc's dlsym before anyone calls the agent's.
extern "C" fn resolve_at_load() {
    let _ = real_dlsym();
}

#[used]
#[link_section = ".init_array"]
static RESOLVE_AT_LOAD: extern "C" fn() = resolve_at_load;
static LIBCUDA: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// Whether `p` lies in the agent's own code.
pub(crate) fn in_agent(p: *mut c_void) -> bool {
    // SAFETY: dladdr only reads the loader's tables; Dl_info is plain data.
    unsafe {
        let mut a: libc::Dl_info = std::mem::zeroed();
        let mut b: libc::Dl_info = std::mem::zeroed();
        libc::dladdr(p, &mut a) != 0 && libc::dladdr(in_agent as *const c_void, &mut b) != 0 && a.dli_fbase == b.dli_fbase
    }
}

/// glibc's own `dlsym`, behind the agent's export.
pub fn real_dlsym() -> Option<RealDlsym> {
    let mut p = REAL_DLSYM.load(Ordering::Acquire);
    if p == 0 {
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
            // SAFETY: dlvsym with RTLD_NEXT and NUL-terminated names; the agent is the
            // caller, so "next" is the C library's dlsym.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) } as usize;
            if p != 0 {
                break;
            }
        }
        REAL_DLSYM.store(p, Ordering::Release);
    }
    // SAFETY: a non-zero `p` is glibc's dlsym, whose signature RealDlsym is.
    (p != 0).then(|| unsafe { std::mem::transmute::<usize, RealDlsym>(p) })
}

/// libcuda's handle, once the application has loaded it (the agent never loads it into a
/// process that has not).
pub fn libcuda() -> Option<*mut c_void> {
    let h = LIBCUDA.load(Ordering::Acquire);
    if !h.is_null() {
        return Some(h);
    }
    // SAFETY: RTLD_NOLOAD only returns a handle to an already loaded library.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if h.is_null() {
        return None;
    }
    LIBCUDA.store(h, Ordering::Release);
    Some(h)
}

/// The address of libcuda's own `name`, or 0.
pub fn real_symbol(name: &CStr) -> usize {
    match (libcuda(), real_dlsym()) {
        // SAFETY: `h` is a live dlopen handle and `name` is NUL-terminated.
        (Some(h), Some(dlsym)) => unsafe { dlsym(h, name.as_ptr()) as usize },
        _ => 0,
    }
}

/// Resolves `name` into `slot` once.
pub fn resolve(slot: &AtomicUsize, name: &CStr) -> usize {
    let p = slot.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    let p = real_symbol(name);
    slot.store(p, Ordering::Relaxed);
    p
}

macro_rules! driver_fns {
    ($($field:ident = $sym:ident;)*) => {
        /// The libcuda entry points the agent itself calls.
        pub struct Driver {
            $(pub $field: fns::$sym,)*
        }

        impl Driver {
            fn load() -> Option<Driver> {
                Some(Driver {
                    $($field: {
                        let p = real_symbol(CStr::from_bytes_with_nul(concat!(stringify!($sym), "\0").as_bytes()).ok()?);
                        if p == 0 {
                            return None;
                        }
                        // SAFETY: `p` is libcuda's `$sym`, whose cuda.h signature is
                        // `fns::$sym`.
                        unsafe { std::mem::transmute::<usize, fns::$sym>(p) }
                    },)*
                })
            }
        }
    };
}

driver_fns! {
    ctx_get_current = cuCtxGetCurrent;
    ctx_get_device = cuCtxGetDevice;
    ctx_synchronize = cuCtxSynchronize;
    ctx_push = cuCtxPushCurrent_v2;
    ctx_pop = cuCtxPopCurrent_v2;
    primary_retain = cuDevicePrimaryCtxRetain;
    primary_release = cuDevicePrimaryCtxRelease_v2;
    primary_state = cuDevicePrimaryCtxGetState;
    device_count = cuDeviceGetCount;
    ctx_get_limit = cuCtxGetLimit;
    ctx_set_limit = cuCtxSetLimit;
    address_reserve = cuMemAddressReserve;
    address_free = cuMemAddressFree;
    create = cuMemCreate;
    release = cuMemRelease;
    map = cuMemMap;
    unmap = cuMemUnmap;
    set_access = cuMemSetAccess;
    export = cuMemExportToShareableHandle;
    import = cuMemImportFromShareableHandle;
    granularity = cuMemGetAllocationGranularity;
    properties = cuMemGetAllocationPropertiesFromHandle;
    device_uuid = cuDeviceGetUuid_v2;
    retain = cuMemRetainAllocationHandle;
    mem_alloc = cuMemAlloc_v2;
    mem_free = cuMemFree_v2;
    mem_alloc_pitch = cuMemAllocPitch_v2;
    mem_address_range = cuMemGetAddressRange_v2;
    stream_is_capturing = cuStreamIsCapturing;
}

static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();

/// A device's primary context made current on this thread by [`Driver::enter`]; dropping it
/// pops that context and releases it. Not `Send`: the context stack is the thread's own.
pub struct Current<'a> {
    driver: &'a Driver,
    dev: c_int,
    _thread: std::marker::PhantomData<*const ()>,
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        let mut old: Ctx = std::ptr::null_mut();
        // SAFETY: `enter` pushed this device's retained primary context on this thread;
        // this pops it and gives the retain back, once.
        unsafe {
            (self.driver.ctx_pop)(&mut old);
            (self.driver.primary_release)(self.dev);
        }
    }
}

/// The driver, once libcuda is loaded. `None` before that, or when an entry point the
/// agent needs is missing (a driver too old for VMM): then the agent only passes through.
pub fn driver() -> Option<&'static Driver> {
    if let Some(d) = DRIVER.get() {
        return d.as_ref();
    }
    libcuda()?;
    DRIVER.get_or_init(Driver::load).as_ref()
}

fn check(r: CuResult) -> Result<(), CuResult> {
    if r == SUCCESS {
        Ok(())
    } else {
        Err(r)
    }
}

// Safe wrappers: each passes valid out-pointers and plain values; the driver validates
// handles and addresses itself and answers with an error code.
impl Driver {
    pub fn current_device(&self) -> Option<(Ctx, c_int)> {
        let mut ctx: Ctx = std::ptr::null_mut();
        let mut dev: c_int = 0;
        // SAFETY: valid out-pointers.
        unsafe {
            check((self.ctx_get_current)(&mut ctx)).ok()?;
            if ctx.is_null() {
                return None;
            }
            check((self.ctx_get_device)(&mut dev)).ok()?;
        }
        Some((ctx, dev))
    }

    /// The device of context `ctx` (made current for the question, then popped again).
    ///
    /// # Safety
    /// `ctx` must be a live context (one the driver just accepted from the application).
    pub unsafe fn context_device(&self, ctx: Ctx) -> Result<c_int, CuResult> {
        let mut dev: c_int = 0;
        // SAFETY: `ctx` is live (this function's contract); the push is paired with its
        // pop, and the out-pointers are valid.
        unsafe {
            check((self.ctx_push)(ctx))?;
            let r = check((self.ctx_get_device)(&mut dev));
            let mut old: Ctx = std::ptr::null_mut();
            (self.ctx_pop)(&mut old);
            r?;
        }
        Ok(dev)
    }

    pub fn synchronize_current(&self) -> Result<(), CuResult> {
        // SAFETY: no arguments; synchronizes the calling thread's context.
        check(unsafe { (self.ctx_synchronize)() })
    }

    /// Waits for all work on `dev`'s primary context.
    pub fn synchronize_device(&self, dev: c_int) -> Result<(), CuResult> {
        self.with_device(dev, || self.synchronize_current())?
    }

    /// Whether work sent to `stream` (a CUstream's value, never dereferenced here) now is
    /// captured into a CUDA graph (not run).
    pub fn capturing(&self, stream: usize) -> bool {
        let mut status: c_int = 0;
        // SAFETY: the application's stream handle, passed as it gave it, and a valid
        // out-pointer; the driver answers an error for a handle it does not know.
        check(unsafe { (self.stream_is_capturing)(stream as *mut c_void, &mut status) }).is_ok() && status != 0
    }

    /// Runs `f` with `dev`'s primary context current on this thread.
    pub fn with_device<T>(&self, dev: c_int, f: impl FnOnce() -> T) -> Result<T, CuResult> {
        let _current = self.enter(dev)?;
        Ok(f())
    }

    /// Makes `dev`'s primary context current on this thread until the guard drops.
    pub fn enter(&self, dev: c_int) -> Result<Current<'_>, CuResult> {
        let mut ctx: Ctx = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the retain and push are undone by the guard's drop,
        // or here when the push fails.
        unsafe {
            check((self.primary_retain)(&mut ctx, dev))?;
            if let Err(r) = check((self.ctx_push)(ctx)) {
                (self.primary_release)(dev);
                return Err(r);
            }
        }
        Ok(Current { driver: self, dev, _thread: std::marker::PhantomData })
    }

    pub fn granularity(&self, dev: c_int) -> Result<usize, CuResult> {
        let prop = AllocationProp::device(dev, HANDLE_TYPE_POSIX_FD);
        let mut g = 0usize;
        // SAFETY: valid prop and out-pointer.
        check(unsafe { (self.granularity)(&mut g, &prop, hiber_cuda_sys::CU_MEM_ALLOC_GRANULARITY_MINIMUM) })?;
        Ok(g.max(1))
    }

    pub fn reserve(&self, size: usize) -> Result<DevPtr, CuResult> {
        let mut va: DevPtr = 0;
        // SAFETY: valid out-pointer; alignment and address 0 let the driver choose.
        check(unsafe { (self.address_reserve)(&mut va, size, 0, 0, 0) })?;
        Ok(va)
    }

    pub fn free_reservation(&self, va: DevPtr, size: usize) -> Result<(), CuResult> {
        // SAFETY: plain values; the driver checks they name a reservation.
        check(unsafe { (self.address_free)(va, size) })
    }

    pub fn create(&self, size: usize, prop: &AllocationProp) -> Result<Handle, CuResult> {
        let mut h: Handle = 0;
        // SAFETY: valid out-pointer and prop.
        check(unsafe { (self.create)(&mut h, size, prop, 0) })?;
        Ok(h)
    }

    pub fn release(&self, h: Handle) -> Result<(), CuResult> {
        // SAFETY: plain value.
        check(unsafe { (self.release)(h) })
    }

    pub fn map(&self, va: DevPtr, size: usize, offset: usize, h: Handle) -> Result<(), CuResult> {
        // SAFETY: plain values.
        check(unsafe { (self.map)(va, size, offset, h, 0) })
    }

    pub fn unmap(&self, va: DevPtr, size: usize) -> Result<(), CuResult> {
        // SAFETY: plain values.
        check(unsafe { (self.unmap)(va, size) })
    }

    pub fn set_access(&self, va: DevPtr, size: usize, descs: &[AccessDesc]) -> Result<(), CuResult> {
        // SAFETY: `descs` is a valid array of its length.
        check(unsafe { (self.set_access)(va, size, descs.as_ptr(), descs.len()) })
    }

    pub fn export_fd(&self, h: Handle) -> Result<c_int, CuResult> {
        let mut fd: c_int = -1;
        // SAFETY: for POSIX_FD the shareable handle is an int out-parameter.
        check(unsafe { (self.export)((&mut fd as *mut c_int).cast(), h, HANDLE_TYPE_POSIX_FD, 0) })?;
        Ok(fd)
    }

    pub fn import_fd(&self, fd: c_int) -> Result<Handle, CuResult> {
        let mut h: Handle = 0;
        // SAFETY: for POSIX_FD the OS handle is the descriptor itself, passed as a pointer-sized value.
        check(unsafe { (self.import)(&mut h, fd as usize as *mut c_void, HANDLE_TYPE_POSIX_FD) })?;
        Ok(h)
    }

    /// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as hiber and nvidia-smi name GPUs.
    pub fn device_uuid(&self, dev: c_int) -> Result<String, CuResult> {
        let mut u = CUuuid::default();
        // SAFETY: valid out-pointer.
        check(unsafe { (self.device_uuid)(&mut u, dev) })?;
        Ok(hiber_wire::gpu_uuid(&u.bytes))
    }

    /// A new reference to the allocation mapped at `va`.
    pub fn retain(&self, va: DevPtr) -> Result<Handle, CuResult> {
        let mut h: Handle = 0;
        // SAFETY: valid out-pointer; the address is passed as the pointer-sized value it is.
        check(unsafe { (self.retain)(&mut h, va as usize as *mut c_void) })?;
        Ok(h)
    }

    /// The devices whose primary context is active (the ones the application uses; asking
    /// creates none).
    pub fn active_devices(&self) -> Vec<c_int> {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        if check(unsafe { (self.device_count)(&mut n) }).is_err() {
            return Vec::new();
        }
        (0..n)
            .filter(|&dev| {
                let (mut flags, mut active): (std::ffi::c_uint, c_int) = (0, 0);
                // SAFETY: valid out-pointers; the driver checks the ordinal.
                check(unsafe { (self.primary_state)(dev, &mut flags, &mut active) }).is_ok() && active != 0
            })
            .collect()
    }

    /// Which GPU each device ordinal names in this process, as `0=GPU-…,1=GPU-…` (for the
    /// log: a restore that renumbered them shows here).
    pub fn ordinals(&self) -> String {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        if check(unsafe { (self.device_count)(&mut n) }).is_err() {
            return "?".into();
        }
        (0..n).map(|o| format!("{o}={}", self.device_uuid(o).unwrap_or_else(|r| format!("(CUDA error {r})")))).collect::<Vec<_>>().join(",")
    }

    /// The stack limit of the context current on this thread.
    pub fn stack_limit(&self) -> Result<usize, CuResult> {
        let mut v = 0usize;
        // SAFETY: valid out-pointer.
        check(unsafe { (self.ctx_get_limit)(&mut v, hiber_cuda_sys::CU_LIMIT_STACK_SIZE) })?;
        Ok(v)
    }

    /// Sets the stack limit of the context current on this thread (the driver waits for
    /// the context's work first, and resizes its local memory at once).
    pub fn set_stack_limit(&self, v: usize) -> Result<(), CuResult> {
        // SAFETY: plain values.
        check(unsafe { (self.ctx_set_limit)(hiber_cuda_sys::CU_LIMIT_STACK_SIZE, v) })
    }

    pub fn properties(&self, h: Handle) -> Result<AllocationProp, CuResult> {
        let mut p = AllocationProp::device(0, 0);
        // SAFETY: valid out-pointer.
        check(unsafe { (self.properties)(&mut p, h) })?;
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_without_libcuda() {
        // This test process never loads libcuda.
        assert!(driver().is_none());
        assert!(real_dlsym().is_some());
    }
}
