//! The CUDA driver's checkpoint API and NVML, loaded at run time.
//!
//! libcuda.so.1 and libnvidia-ml.so.1 are `dlopen`ed, never linked, so the same hiber runs
//! on machines without a GPU. The `#[repr(C)]` argument structs mirror cuda.h (CUDA 13.0):
//! 64 bytes each, reserved fields zeroed; the GPU suite checks them against the cuda.h of
//! the GPU machine. All unsafe code of the CUDA engine is in this module.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};

use libloading::Library;

use hiber_cuda_sys::fns;
pub use hiber_cuda_sys::{
    CUcheckpointCheckpointArgs as CheckpointArgs, CUcheckpointGpuPair as GpuPair, CUcheckpointLockArgs as LockArgs, CUcheckpointRestoreArgs as RestoreArgs,
    CUcheckpointUnlockArgs as UnlockArgs, CUresult as CuResult, CUuuid as CuUuid, CUDA_ERROR_NOT_SUPPORTED, CUDA_SUCCESS,
};
use hiber_cuda_sys::{
    CUcontext, CUfunction, CUmemAccessDesc, CUmemAllocationProp, CUmodule, CUstream, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR as HANDLE_TYPE_POSIX_FD,
};

/// The checkpoint entry points of a loaded libcuda.
pub struct CheckpointFns {
    get_state: fns::cuCheckpointProcessGetState,
    lock: fns::cuCheckpointProcessLock,
    checkpoint: fns::cuCheckpointProcessCheckpoint,
    restore: fns::cuCheckpointProcessRestore,
    unlock: fns::cuCheckpointProcessUnlock,
    restore_thread: Option<fns::cuCheckpointProcessGetRestoreThreadId>,
}

/// A loaded libcuda. The library handle is kept for as long as the function pointers.
pub struct CudaLib {
    _lib: Library,
    init: fns::cuInit,
    init_result: std::sync::OnceLock<CuResult>,
    error_name: Option<fns::cuGetErrorName>,
    driver_version: c_int,
    checkpoint: Option<CheckpointFns>,
    vmm: Option<VmmFns>,
}

/// Why libcuda could not be used.
#[derive(Debug, Clone)]
pub enum LoadError {
    NoLibrary(String),
    MissingSymbol(&'static str),
    Init(CuResult),
}

fn sym<T: Copy>(lib: &Library, name: &'static str) -> Result<T, LoadError> {
    let cname = format!("{name}\0");
    // SAFETY: `T` is the exact function-pointer type of `name` as declared in cuda.h (or
    // nvml.h); the pointer is only used while `lib` (kept beside it) stays loaded.
    unsafe { lib.get::<T>(cname.as_bytes()).map(|s| *s).map_err(|_| LoadError::MissingSymbol(name)) }
}

impl CudaLib {
    pub fn load() -> Result<CudaLib, LoadError> {
        // SAFETY: loading libcuda runs its initializers, which are designed to be loaded
        // into arbitrary processes.
        let lib = unsafe { Library::new("libcuda.so.1") }.map_err(|e| LoadError::NoLibrary(e.to_string()))?;
        let init: fns::cuInit = sym(&lib, "cuInit")?;
        let version: fns::cuDriverGetVersion = sym(&lib, "cuDriverGetVersion")?;
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer.
        let r = unsafe { version(&mut v) };
        if r != CUDA_SUCCESS {
            return Err(LoadError::Init(r));
        }
        let checkpoint = (|| {
            Ok::<_, LoadError>(CheckpointFns {
                get_state: sym(&lib, "cuCheckpointProcessGetState")?,
                lock: sym(&lib, "cuCheckpointProcessLock")?,
                checkpoint: sym(&lib, "cuCheckpointProcessCheckpoint")?,
                restore: sym(&lib, "cuCheckpointProcessRestore")?,
                unlock: sym(&lib, "cuCheckpointProcessUnlock")?,
                restore_thread: sym(&lib, "cuCheckpointProcessGetRestoreThreadId").ok(),
            })
        })()
        .ok();
        let error_name = sym(&lib, "cuGetErrorName").ok();
        let vmm = VmmFns::load(&lib).ok();
        Ok(CudaLib { _lib: lib, init, init_result: std::sync::OnceLock::new(), error_name, driver_version: v, checkpoint, vmm })
    }

    /// As `cuDriverGetVersion` reports it: 1000 * major + 10 * minor.
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    pub fn has_checkpoint_api(&self) -> bool {
        self.checkpoint.is_some()
    }

    pub fn error_name(&self, r: CuResult) -> String {
        if let Some(f) = self.error_name {
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: `p` is a valid out-pointer; on success it points at a static string.
            if unsafe { f(r, &mut p) } == CUDA_SUCCESS && !p.is_null() {
                // SAFETY: the driver returns a NUL-terminated static string.
                return unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
            }
        }
        format!("CUresult {r}")
    }

    /// `cuInit`, once, on first use: commands that never touch a GPU (`ls`, `inspect`)
    /// never pay for the driver's initialization or its threads.
    fn fns(&self) -> Result<&CheckpointFns, CuResult> {
        // SAFETY: cuInit takes flags by value; 0 is the only defined value.
        let r = *self.init_result.get_or_init(|| unsafe { (self.init)(0) });
        check(r)?;
        Ok(self.checkpoint.as_ref().expect("callers check has_checkpoint_api"))
    }

    pub fn get_state(&self, pid: i32) -> Result<i32, CuResult> {
        let mut s: c_int = -1;
        let fns = self.fns()?;
        // SAFETY: `s` is a valid out-pointer.
        check(unsafe { (fns.get_state)(pid, &mut s) }).map(|_| s)
    }

    pub fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), CuResult> {
        let mut args = LockArgs { timeout_ms, ..Default::default() };
        let fns = self.fns()?;
        // SAFETY: `args` is a valid, zero-reserved LockArgs.
        check(unsafe { (fns.lock)(pid, &mut args) })
    }

    pub fn checkpoint(&self, pid: i32) -> Result<(), CuResult> {
        let mut args = CheckpointArgs::default();
        let fns = self.fns()?;
        // SAFETY: `args` is a valid, zeroed CheckpointArgs.
        check(unsafe { (fns.checkpoint)(pid, &mut args) })
    }

    pub fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), CuResult> {
        let mut args = RestoreArgs::with_pairs(pairs);
        let fns = self.fns()?;
        // SAFETY: `args` is valid and zero-reserved; `gpu_pairs` points at `pairs.len()`
        // pairs that outlive the call (or is NULL with a count of 0).
        check(unsafe { (fns.restore)(pid, &mut args) })
    }

    /// The thread of `pid` that carries out the driver's restore (`None` when this driver
    /// lacks the entry point).
    pub fn restore_thread(&self, pid: i32) -> Result<Option<i32>, CuResult> {
        let fns = self.fns()?;
        let Some(f) = fns.restore_thread else { return Ok(None) };
        let mut tid: c_int = 0;
        // SAFETY: `tid` is a valid out-pointer.
        check(unsafe { f(pid, &mut tid) }).map(|_| Some(tid))
    }

    pub fn unlock(&self, pid: i32) -> Result<(), CuResult> {
        let mut args = UnlockArgs::default();
        let fns = self.fns()?;
        // SAFETY: `args` is a valid, zeroed UnlockArgs.
        check(unsafe { (fns.unlock)(pid, &mut args) })
    }
}

fn check(r: CuResult) -> Result<(), CuResult> {
    if r == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(r)
    }
}

// ---- VMM and copies: hiber's own device memory, for the agent engine ----

fn device_prop(dev: c_int, exportable: bool) -> CUmemAllocationProp {
    CUmemAllocationProp::device(dev, if exportable { HANDLE_TYPE_POSIX_FD } else { 0 })
}

/// A device's primary context, retained by hiber for as long as it runs. Only
/// [`CudaLib::use_device`] makes one, so a context passed back to the driver is always live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrimaryContext(CUcontext);

// SAFETY: a CUDA context is a process-wide handle; the driver lets any thread make it
// current, and hiber never releases a primary context it retained.
unsafe impl Send for PrimaryContext {}
// SAFETY: as above; the handle is never dereferenced by hiber.
unsafe impl Sync for PrimaryContext {}

/// A non-blocking stream of the context current when it was made; destroyed on drop (with
/// that context current, which is the caller's to ensure, as for every stream call).
pub struct Stream<'a> {
    lib: &'a CudaLib,
    raw: CUstream,
}

impl Drop for Stream<'_> {
    fn drop(&mut self) {
        if let Ok(f) = self.lib.vmm_fns() {
            // SAFETY: `raw` came from cuStreamCreate and is destroyed once, here.
            unsafe { (f.stream_destroy)(self.raw) };
        }
    }
}

struct VmmFns {
    device_count: fns::cuDeviceGetCount,
    device_uuid: fns::cuDeviceGetUuid_v2,
    primary_retain: fns::cuDevicePrimaryCtxRetain,
    ctx_set_current: fns::cuCtxSetCurrent,
    mem_info: fns::cuMemGetInfo_v2,
    address_reserve: fns::cuMemAddressReserve,
    address_free: fns::cuMemAddressFree,
    create: fns::cuMemCreate,
    release: fns::cuMemRelease,
    map: fns::cuMemMap,
    unmap: fns::cuMemUnmap,
    set_access: fns::cuMemSetAccess,
    export: fns::cuMemExportToShareableHandle,
    import: fns::cuMemImportFromShareableHandle,
    properties: fns::cuMemGetAllocationPropertiesFromHandle,
    host_alloc: fns::cuMemHostAlloc,
    free_host: fns::cuMemFreeHost,
    host_register: fns::cuMemHostRegister_v2,
    host_unregister: fns::cuMemHostUnregister,
    dtoh_async: fns::cuMemcpyDtoHAsync_v2,
    htod_async: fns::cuMemcpyHtoDAsync_v2,
    dtod_async: fns::cuMemcpyDtoDAsync_v2,
    stream_create: fns::cuStreamCreate,
    stream_sync: fns::cuStreamSynchronize,
    stream_destroy: fns::cuStreamDestroy_v2,
    module_load_data: fns::cuModuleLoadData,
    module_get_function: fns::cuModuleGetFunction,
    launch_kernel: fns::cuLaunchKernel,
}

impl VmmFns {
    fn load(lib: &Library) -> Result<VmmFns, LoadError> {
        Ok(VmmFns {
            device_count: sym(lib, "cuDeviceGetCount")?,
            device_uuid: sym(lib, "cuDeviceGetUuid_v2")?,
            primary_retain: sym(lib, "cuDevicePrimaryCtxRetain")?,
            ctx_set_current: sym(lib, "cuCtxSetCurrent")?,
            mem_info: sym(lib, "cuMemGetInfo_v2")?,
            address_reserve: sym(lib, "cuMemAddressReserve")?,
            address_free: sym(lib, "cuMemAddressFree")?,
            create: sym(lib, "cuMemCreate")?,
            release: sym(lib, "cuMemRelease")?,
            map: sym(lib, "cuMemMap")?,
            unmap: sym(lib, "cuMemUnmap")?,
            set_access: sym(lib, "cuMemSetAccess")?,
            export: sym(lib, "cuMemExportToShareableHandle")?,
            import: sym(lib, "cuMemImportFromShareableHandle")?,
            properties: sym(lib, "cuMemGetAllocationPropertiesFromHandle")?,
            host_alloc: sym(lib, "cuMemHostAlloc")?,
            free_host: sym(lib, "cuMemFreeHost")?,
            host_register: sym(lib, "cuMemHostRegister_v2")?,
            host_unregister: sym(lib, "cuMemHostUnregister")?,
            dtoh_async: sym(lib, "cuMemcpyDtoHAsync_v2")?,
            htod_async: sym(lib, "cuMemcpyHtoDAsync_v2")?,
            dtod_async: sym(lib, "cuMemcpyDtoDAsync_v2")?,
            stream_create: sym(lib, "cuStreamCreate")?,
            stream_sync: sym(lib, "cuStreamSynchronize")?,
            stream_destroy: sym(lib, "cuStreamDestroy_v2")?,
            module_load_data: sym(lib, "cuModuleLoadData")?,
            module_get_function: sym(lib, "cuModuleGetFunction")?,
            launch_kernel: sym(lib, "cuLaunchKernel")?,
        })
    }
}

/// A kernel of a module hiber loaded into one of its primary contexts. The module is never
/// unloaded (the context lives as long as hiber), so the handle stays valid.
#[derive(Debug, Clone, Copy)]
pub struct Kernel(CUfunction);

// SAFETY: a CUfunction is a handle the driver lets any thread launch (with its context
// current); hiber never dereferences it.
unsafe impl Send for Kernel {}
// SAFETY: as above.
unsafe impl Sync for Kernel {}

/// Pinned host memory from `cuMemHostAlloc`, freed on drop.
pub struct PinnedBuf<'a> {
    lib: &'a CudaLib,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value; the driver allows freeing it
// from any thread with a context current.
unsafe impl Send for PinnedBuf<'_> {}

impl PinnedBuf<'_> {
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points at `len` bytes this value owns exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuf<'_> {
    fn drop(&mut self) {
        if let Ok(f) = self.lib.vmm_fns() {
            // SAFETY: `ptr` came from cuMemHostAlloc and is freed once.
            unsafe { (f.free_host)(self.ptr.cast()) };
        }
    }
}

/// Host memory hiber mapped ([`crate::sys::Anon`]) and page-locked for the GPU with
/// `cuMemHostRegister`: the staging area of a checkpoint that finds no room on the GPU.
/// Unregistered (then unmapped) on drop.
///
/// It keeps the driver's entry points it needs, not a borrow of the [`CudaLib`], so that a
/// checkpoint session can hold it beside its `Arc` of the library; the engine that made it
/// keeps the library loaded for longer than any session.
pub struct Staging {
    unregister: fns::cuMemHostUnregister,
    dtoh_async: fns::cuMemcpyDtoHAsync_v2,
    stream_sync: fns::cuStreamSynchronize,
    mem: crate::sys::Anon,
}

impl Staging {
    /// Its length in bytes.
    pub fn size(&self) -> usize {
        self.mem.len()
    }

    /// `n` bytes from `off`.
    ///
    /// # Safety
    ///
    /// No copy into that range may be in flight while the slice lives.
    pub unsafe fn slice(&self, off: usize, n: usize) -> &[u8] {
        // SAFETY: the caller's contract is the mapping's.
        unsafe { self.mem.slice(off, n) }
    }

    /// Device → this staging area at `off`, waited for.
    ///
    /// # Safety
    ///
    /// `src` must be `len` bytes of device memory mapped by hiber, and no one else may use
    /// `[off, off + len)` of the staging area meanwhile.
    pub unsafe fn copy_in(&self, off: usize, src: u64, len: usize, s: &Stream<'_>) -> Result<(), CuResult> {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.mem.len()));
        // SAFETY: the destination range is inside the registered mapping (asserted) and the
        // caller's alone; `src` is `len` bytes of device memory; waited for before return.
        unsafe {
            check((self.dtoh_async)(self.mem.ptr_at(off).cast(), src, len, s.raw))?;
            check((self.stream_sync)(s.raw))
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: registered once in `CudaLib::staging`, unregistered once here, before the
        // mapping goes.
        let r = unsafe { (self.unregister)(self.mem.ptr_at(0).cast()) };
        if r != CUDA_SUCCESS {
            // The mapping goes anyway; what stays locked is the driver's to reclaim at exit.
            tracing::warn!(result = r, mib = self.mem.len() >> 20, "could not unregister the staging area");
        }
    }
}

impl CudaLib {
    /// `len` bytes of host memory faulted in by `threads` threads, then page-locked.
    pub fn staging(&self, len: usize, threads: usize) -> Result<Staging, String> {
        let f = self.vmm_fns().map_err(|e| self.error_name(e))?;
        let start = std::time::Instant::now();
        let mem = crate::sys::Anon::populated(len, threads).map_err(|e| format!("mapping {} MiB: {e}", len >> 20))?;
        let populated = start.elapsed();
        // SAFETY: `mem` is `len` bytes of mapped memory this process owns for as long as the
        // registration (Staging unregisters before it unmaps). Portable: hiber copies into
        // it from each GPU's own context.
        check(unsafe { (f.host_register)(mem.ptr_at(0).cast(), len, hiber_cuda_sys::CU_MEMHOSTREGISTER_PORTABLE) })
            .map_err(|e| format!("page-locking {} MiB: {}", len >> 20, self.error_name(e)))?;
        tracing::debug!(mib = len >> 20, populate_s = populated.as_secs_f64(), register_s = (start.elapsed() - populated).as_secs_f64(), "staging area");
        Ok(Staging { unregister: f.host_unregister, dtoh_async: f.dtoh_async, stream_sync: f.stream_sync, mem })
    }

    fn vmm_fns(&self) -> Result<&VmmFns, CuResult> {
        // SAFETY: cuInit takes flags by value; 0 is the only defined value.
        let r = *self.init_result.get_or_init(|| unsafe { (self.init)(0) });
        check(r)?;
        self.vmm.as_ref().ok_or(CUDA_ERROR_NOT_SUPPORTED)
    }

    pub fn device_count(&self) -> Result<i32, CuResult> {
        let f = self.vmm_fns()?;
        let mut n = 0;
        // SAFETY: valid out-pointer.
        check(unsafe { (f.device_count)(&mut n) })?;
        Ok(n)
    }

    pub fn device_uuid(&self, dev: i32) -> Result<CuUuid, CuResult> {
        let f = self.vmm_fns()?;
        let mut u = CuUuid::default();
        // SAFETY: valid out-pointer.
        check(unsafe { (f.device_uuid)(&mut u, dev) })?;
        Ok(u)
    }

    /// Retains `dev`'s primary context (hiber keeps it for its lifetime) and makes it
    /// current on the calling thread.
    /// Retains `dev`'s primary context (for the rest of hiber's life) and makes it current.
    pub fn use_device(&self, dev: i32) -> Result<PrimaryContext, CuResult> {
        let f = self.vmm_fns()?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is retained, never released.
        check(unsafe { (f.primary_retain)(&mut ctx, dev) })?;
        let ctx = PrimaryContext(ctx);
        self.set_current(ctx)?;
        Ok(ctx)
    }

    pub fn set_current(&self, ctx: PrimaryContext) -> Result<(), CuResult> {
        let f = self.vmm_fns()?;
        // SAFETY: a PrimaryContext is a retained, never released context (see use_device).
        check(unsafe { (f.ctx_set_current)(ctx.0) })
    }

    /// Free and total memory of the current context's device.
    pub fn mem_info(&self) -> Result<(u64, u64), CuResult> {
        let f = self.vmm_fns()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        check(unsafe { (f.mem_info)(&mut free, &mut total) })?;
        Ok((free as u64, total as u64))
    }

    pub fn reserve(&self, size: usize) -> Result<u64, CuResult> {
        let f = self.vmm_fns()?;
        let mut va = 0u64;
        // SAFETY: valid out-pointer.
        check(unsafe { (f.address_reserve)(&mut va, size, 0, 0, 0) })?;
        Ok(va)
    }

    pub fn free_reservation(&self, va: u64, size: usize) -> Result<(), CuResult> {
        let f = self.vmm_fns()?;
        // SAFETY: plain values, checked by the driver.
        check(unsafe { (f.address_free)(va, size) })
    }

    pub fn create(&self, size: usize, dev: i32, exportable: bool) -> Result<u64, CuResult> {
        let f = self.vmm_fns()?;
        let prop = device_prop(dev, exportable);
        let mut h = 0u64;
        // SAFETY: valid out-pointer and prop.
        check(unsafe { (f.create)(&mut h, size, &prop, 0) })?;
        Ok(h)
    }

    pub fn release(&self, h: u64) -> Result<(), CuResult> {
        let f = self.vmm_fns()?;
        // SAFETY: plain value.
        check(unsafe { (f.release)(h) })
    }

    /// Maps `h` at `va` and gives `dev` read/write access.
    pub fn map(&self, va: u64, size: usize, h: u64, dev: i32) -> Result<(), CuResult> {
        let f = self.vmm_fns()?;
        let desc = CUmemAccessDesc::read_write(dev);
        // SAFETY: plain values and one valid access descriptor.
        unsafe {
            check((f.map)(va, size, 0, h, 0))?;
            check((f.set_access)(va, size, &desc, 1)).inspect_err(|_| {
                (f.unmap)(va, size);
            })
        }
    }

    pub fn unmap(&self, va: u64, size: usize) -> Result<(), CuResult> {
        let f = self.vmm_fns()?;
        // SAFETY: plain values.
        check(unsafe { (f.unmap)(va, size) })
    }

    /// A new descriptor for `h` (created exportable); the caller owns it.
    pub fn export_fd(&self, h: u64) -> Result<std::os::fd::OwnedFd, CuResult> {
        use std::os::fd::FromRawFd;
        let f = self.vmm_fns()?;
        let mut fd: c_int = -1;
        // SAFETY: for POSIX_FD the shareable handle is an int out-parameter.
        check(unsafe { (f.export)((&mut fd as *mut c_int).cast(), h, HANDLE_TYPE_POSIX_FD, 0) })?;
        // SAFETY: the driver returned a fresh descriptor for the caller.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    /// A handle to the memory behind `fd` and the device (ordinal) it lives on.
    pub fn import_fd(&self, fd: std::os::fd::BorrowedFd<'_>) -> Result<(u64, i32), CuResult> {
        use std::os::fd::AsRawFd;
        let f = self.vmm_fns()?;
        let mut h = 0u64;
        let mut prop = device_prop(0, false);
        // SAFETY: for POSIX_FD the OS handle is the descriptor passed as a pointer-sized
        // value; the driver does not take ownership of it.
        unsafe {
            check((f.import)(&mut h, fd.as_raw_fd() as usize as *mut c_void, HANDLE_TYPE_POSIX_FD))?;
            if let Err(e) = check((f.properties)(&mut prop, h)) {
                (f.release)(h);
                return Err(e);
            }
        }
        if !prop.location.is_device() {
            let _ = self.release(h);
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        Ok((h, prop.location.id))
    }

    pub fn pinned(&self, len: usize) -> Result<PinnedBuf<'_>, CuResult> {
        let f = self.vmm_fns()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; flags 0 = portable-less default pinned memory.
        check(unsafe { (f.host_alloc)(&mut p, len, 0) })?;
        Ok(PinnedBuf { lib: self, ptr: p.cast(), len })
    }

    /// A new non-blocking stream in the current context.
    pub fn stream(&self) -> Result<Stream<'_>, CuResult> {
        let f = self.vmm_fns()?;
        let mut raw: CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check(unsafe { (f.stream_create)(&mut raw, hiber_cuda_sys::CU_STREAM_NON_BLOCKING) })?;
        Ok(Stream { lib: self, raw })
    }

    /// Device → pinned host, waited for.
    ///
    /// # Safety
    ///
    /// `src` must be device memory (mapped by hiber) of at least `len`
    /// bytes: under unified addressing the driver also accepts host addresses.
    ///
    pub unsafe fn copy_to_host(&self, dst: &mut PinnedBuf<'_>, len: usize, src: u64, s: &Stream<'_>) -> Result<(), CuResult> {
        let f = self.vmm_fns()?;
        assert!(len <= dst.len);
        // SAFETY: `dst` holds at least `len` pinned bytes, `src` is `len` bytes of device
        // memory (this function's contract); the copy completes before return.
        unsafe {
            check((f.dtoh_async)(dst.ptr.cast(), src, len, s.raw))?;
            check((f.stream_sync)(s.raw))
        }
    }

    /// Pinned host → device, waited for.
    ///
    /// # Safety
    ///
    /// `dst` must be device memory of at least `len` bytes that nothing else uses meanwhile:
    /// under unified addressing the driver would also write host memory.
    pub unsafe fn copy_to_device(&self, dst: u64, src: &PinnedBuf<'_>, len: usize, s: &Stream<'_>) -> Result<(), CuResult> {
        let f = self.vmm_fns()?;
        assert!(len <= src.len);
        // SAFETY: `src` holds at least `len` bytes, `dst` is `len` bytes of device memory
        // (this function's contract); the copy completes before return.
        unsafe {
            check((f.htod_async)(dst, src.ptr.cast(), len, s.raw))?;
            check((f.stream_sync)(s.raw))
        }
    }

    /// Loads the PTX module `ptx` into the current context (the driver compiles it for its
    /// GPU) and returns its kernel `name`. The module stays loaded.
    pub fn load_kernel(&self, ptx: &CStr, name: &CStr) -> Result<Kernel, CuResult> {
        let f = self.vmm_fns()?;
        let mut module: CUmodule = std::ptr::null_mut();
        let mut func: CUfunction = std::ptr::null_mut();
        // SAFETY: valid out-pointers; `ptx` and `name` are NUL-terminated and outlive the
        // calls (the driver copies the image).
        unsafe {
            check((f.module_load_data)(&mut module, ptx.as_ptr().cast()))?;
            check((f.module_get_function)(&mut func, module, name.as_ptr()))?;
        }
        Ok(Kernel(func))
    }

    /// Launches `k`, a kernel taking two 64-bit parameters, on `grid` CTAs of `threads`
    /// threads in `s`, and waits for it.
    ///
    /// # Safety
    ///
    /// `k` must take exactly the parameters `(u64 a, u64 b)`, and whatever it reads or
    /// writes through them for this grid must be device memory that is mapped and that
    /// nothing else writes meanwhile.
    pub unsafe fn launch2(&self, k: Kernel, grid: u32, threads: u32, a: u64, b: u64, s: &Stream<'_>) -> Result<(), CuResult> {
        let f = self.vmm_fns()?;
        let (mut a, mut b) = (a, b);
        let mut params: [*mut c_void; 2] = [(&mut a as *mut u64).cast(), (&mut b as *mut u64).cast()];
        // SAFETY: `params` points at the two parameters the kernel takes (this function's
        // contract), alive until the launch returns; no shared memory, no extra options.
        unsafe {
            check((f.launch_kernel)(k.0, grid, 1, 1, threads, 1, 1, 0, s.raw, params.as_mut_ptr(), std::ptr::null_mut()))?;
            check((f.stream_sync)(s.raw))
        }
    }

    /// Device → host memory of any kind (pageable too), waited for.
    ///
    /// # Safety
    ///
    /// `src` must be device memory (mapped by hiber) of at least `dst.len()` bytes.
    pub unsafe fn read_device(&self, dst: &mut [u8], src: u64, s: &Stream<'_>) -> Result<(), CuResult> {
        let f = self.vmm_fns()?;
        // SAFETY: `dst` is `dst.len()` writable bytes, `src` as many bytes of device memory
        // (this function's contract); the copy completes before return.
        unsafe {
            check((f.dtoh_async)(dst.as_mut_ptr().cast(), src, dst.len(), s.raw))?;
            check((f.stream_sync)(s.raw))
        }
    }

    /// Host memory of any kind → device, waited for.
    ///
    /// # Safety
    ///
    /// `dst` must be device memory of at least `src.len()` bytes that nothing else uses
    /// meanwhile.
    pub unsafe fn write_device(&self, dst: u64, src: &[u8], s: &Stream<'_>) -> Result<(), CuResult> {
        let f = self.vmm_fns()?;
        // SAFETY: `src` is `src.len()` readable bytes, `dst` as many bytes of device memory
        // (this function's contract); the copy completes before return.
        unsafe {
            check((f.htod_async)(dst, src.as_ptr().cast(), src.len(), s.raw))?;
            check((f.stream_sync)(s.raw))
        }
    }

    /// Device → device, waited for.
    ///
    /// # Safety
    ///
    /// `src` and `dst` must be device memory of at least `len` bytes each, `dst` unused
    /// by anything else meanwhile.
    pub unsafe fn copy_on_device(&self, dst: u64, src: u64, len: usize, s: &Stream<'_>) -> Result<(), CuResult> {
        let f = self.vmm_fns()?;
        // SAFETY: both are `len` bytes of device memory (this function's contract); the copy
        // completes before return.
        unsafe {
            check((f.dtod_async)(dst, src, len, s.raw))?;
            check((f.stream_sync)(s.raw))
        }
    }
}

// ---- NVML: GPUs and per-process memory, without creating a CUDA context ----

type NvmlReturn = c_int;
type NvmlDevice = *mut c_void;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct NvmlMemory {
    pub total: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `nvmlProcessInfo_t` as used by `nvmlDeviceGetComputeRunningProcesses_v3`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct NvmlProcessInfo {
    pub pid: c_uint,
    pub used_gpu_memory: c_ulonglong,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

type FnNvmlInit = unsafe extern "C" fn() -> NvmlReturn;
type FnNvmlCount = unsafe extern "C" fn(*mut c_uint) -> NvmlReturn;
type FnNvmlHandle = unsafe extern "C" fn(c_uint, *mut NvmlDevice) -> NvmlReturn;
type FnNvmlString = unsafe extern "C" fn(NvmlDevice, *mut c_char, c_uint) -> NvmlReturn;
type FnNvmlMemory = unsafe extern "C" fn(NvmlDevice, *mut NvmlMemory) -> NvmlReturn;
type FnNvmlProcs = unsafe extern "C" fn(NvmlDevice, *mut c_uint, *mut NvmlProcessInfo) -> NvmlReturn;
type FnNvmlDriver = unsafe extern "C" fn(*mut c_char, c_uint) -> NvmlReturn;

pub struct Nvml {
    _lib: Library,
    count: FnNvmlCount,
    handle: FnNvmlHandle,
    uuid: FnNvmlString,
    name: FnNvmlString,
    memory: FnNvmlMemory,
    procs: FnNvmlProcs,
    driver: FnNvmlDriver,
}

/// One GPU as NVML sees it.
#[derive(Debug, Clone)]
pub struct NvmlGpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory: NvmlMemory,
    pub processes: Vec<(u32, u64)>,
}

const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;

impl Nvml {
    pub fn load() -> Option<Nvml> {
        // SAFETY: loading NVML runs its initializers, which are made for that.
        let lib = unsafe { Library::new("libnvidia-ml.so.1") }.ok()?;
        let init: FnNvmlInit = sym(&lib, "nvmlInit_v2").ok()?;
        // SAFETY: nvmlInit_v2 takes no arguments.
        if unsafe { init() } != 0 {
            return None;
        }
        Some(Nvml {
            count: sym(&lib, "nvmlDeviceGetCount_v2").ok()?,
            handle: sym(&lib, "nvmlDeviceGetHandleByIndex_v2").ok()?,
            uuid: sym(&lib, "nvmlDeviceGetUUID").ok()?,
            name: sym(&lib, "nvmlDeviceGetName").ok()?,
            memory: sym(&lib, "nvmlDeviceGetMemoryInfo").ok()?,
            procs: sym(&lib, "nvmlDeviceGetComputeRunningProcesses_v3").ok()?,
            driver: sym(&lib, "nvmlSystemGetDriverVersion").ok()?,
            _lib: lib,
        })
    }

    fn string(f: impl FnOnce(*mut c_char, c_uint) -> NvmlReturn) -> Option<String> {
        let mut buf = [0 as c_char; 96];
        if f(buf.as_mut_ptr(), buf.len() as c_uint) != 0 {
            return None;
        }
        // SAFETY: on success NVML wrote a NUL-terminated string into `buf`.
        Some(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    }

    pub fn driver_version(&self) -> Option<String> {
        // SAFETY: the buffer pointer and length come from `string`'s local buffer.
        Nvml::string(|p, n| unsafe { (self.driver)(p, n) })
    }

    pub fn gpus(&self) -> Vec<NvmlGpu> {
        let mut n: c_uint = 0;
        // SAFETY: `n` is a valid out-pointer.
        if unsafe { (self.count)(&mut n) } != 0 {
            return Vec::new();
        }
        (0..n).filter_map(|i| self.gpu(i)).collect()
    }

    fn gpu(&self, index: u32) -> Option<NvmlGpu> {
        let mut dev: NvmlDevice = std::ptr::null_mut();
        // SAFETY: `dev` is a valid out-pointer.
        if unsafe { (self.handle)(index, &mut dev) } != 0 {
            return None;
        }
        // SAFETY: `dev` is a handle NVML returned; the buffer comes from `string`.
        let uuid = Nvml::string(|p, n| unsafe { (self.uuid)(dev, p, n) })?;
        // SAFETY: as above.
        let name = Nvml::string(|p, n| unsafe { (self.name)(dev, p, n) }).unwrap_or_default();
        let mut memory = NvmlMemory::default();
        // SAFETY: `memory` is a valid out-pointer of the v1 layout.
        unsafe { (self.memory)(dev, &mut memory) };
        let mut processes = Vec::new();
        let mut cap: c_uint = 64;
        loop {
            let mut infos = vec![NvmlProcessInfo::default(); cap as usize];
            let mut count = cap;
            // SAFETY: `infos` has room for `count` entries, as NVML is told.
            let r = unsafe { (self.procs)(dev, &mut count, infos.as_mut_ptr()) };
            if r == NVML_ERROR_INSUFFICIENT_SIZE && cap < 65536 {
                cap = count.max(cap * 2);
                continue;
            }
            if r == 0 {
                processes = infos[..count as usize].iter().map(|p| (p.pid, p.used_gpu_memory)).collect();
            }
            break;
        }
        Some(NvmlGpu { index, uuid, name, memory, processes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn nvml_structs() {
        assert_eq!(size_of::<NvmlMemory>(), 24);
        assert_eq!(size_of::<NvmlProcessInfo>(), 24);
        assert_eq!(offset_of!(NvmlProcessInfo, used_gpu_memory), 8);
    }

    #[test]
    fn loading_says_why_there_is_no_driver() {
        match CudaLib::load() {
            Ok(lib) => assert!(lib.driver_version() >= 12000, "a loaded driver reports its version"),
            // Without libcuda.so.1 (CI), the error says the library is missing, and doctor's
            // probe turns that into a line, not a failure.
            Err(e) => {
                assert!(matches!(e, LoadError::NoLibrary(_)), "expected NoLibrary, got {e:?}");
                let probe = super::super::probe();
                assert!(probe.summary().starts_with("no NVIDIA driver"), "{}", probe.summary());
                assert!(probe.driver.is_none() && !probe.checkpoint_api);
            }
        }
    }
}
