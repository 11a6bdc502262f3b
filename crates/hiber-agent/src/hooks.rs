//! The hook layer: one table of intercepted driver entry points.
//!
//! Applications reach the driver three ways, and all three lead here:
//! - calls to exported symbols (programs and libraries linked against libcuda, such as
//!   Triton's launchers): the agent, preloaded, exports the same names;
//! - `dlsym(libcuda, "cu...")` (PyTorch's driver table, statically linked cudart asking for
//!   `cuGetProcAddress`): the agent's `dlsym` redirects results that are table entries
//!   (and `dlsym(libnccl, "nccl...")`, XLA's way to NCCL, to the agent's NCCL exports: see
//!   [`crate::nccl::redirect_dlsym`]);
//! - `cuGetProcAddress` of every version and flag (cudart, and through it
//!   `cudaGetDriverEntryPoint[ByVersion]`): the agent's redirects them the same way.
//!
//! Redirection matches the *address* the driver returned against the addresses of its
//! exported symbols, so every version and per-thread-stream variant of an entry point
//! finds its own wrapper, and anything not in the table passes through untouched.
//!
//! Work-submitting entry points (launches, copies, memsets, graph launches) are "gated":
//! a generic wrapper passes the gate and forwards its integer/pointer arguments unchanged.
//! Memory-management entry points have typed wrappers that serve or track allocations.
//! The same table is where a remote-GPU mode would forward calls.
//!
//! Nothing here panics across the C ABI: failures become `CUresult`s.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::AtomicUsize;
use std::sync::OnceLock;

use crate::cuda::{self, AccessDesc, AllocationProp, CuResult, DevPtr, Handle};
use crate::{gate, memory};
use hiber_cuda_sys::{fns, CUevent as Event, CUipcHandle as IpcHandle};

/// Every gated entry point takes at most this many integer or pointer arguments.
type Generic = unsafe extern "C" fn(usize, usize, usize, usize, usize, usize, usize, usize, usize, usize, usize, usize, usize, usize) -> CuResult;

/// libcuda's entry point `name` (resolved once into `slot`), typed as [`Generic`].
fn generic(slot: &AtomicUsize, name: &CStr) -> Option<Generic> {
    match cuda::resolve(slot, name) {
        0 => None,
        // SAFETY: a non-zero address is libcuda's own entry point of this name. Every entry
        // point called through `Generic` takes integers or pointers (no floats) or structs
        // passed by value that both ABIs pass where `Generic`'s arguments sit: the 8-byte
        // CUmemLocation of cuMemPrefetchAsync_v2 is classed as one integer register;
        // cuIpcOpenMemHandle's 64-byte CUipcMemHandle goes in eight stack slots on x86_64
        // (a6 to a13, as no register is left to it) and by reference on aarch64. The C
        // calling conventions of x86_64 and aarch64 pass such arguments in the same
        // registers and 8-byte stack slots whatever their declared types; the callee reads
        // the ones it declares and the caller cleans the stack.
        f => Some(unsafe { std::mem::transmute::<usize, Generic>(f) }),
    }
}

macro_rules! gated {
    ($($name:ident)*) => {
        $(
            #[no_mangle]
            #[allow(non_snake_case)]
            /// # Safety
            /// Called by the application with the driver entry point's own arguments.
            pub unsafe extern "C" fn $name(
                a0: usize, a1: usize, a2: usize, a3: usize, a4: usize, a5: usize, a6: usize,
                a7: usize, a8: usize, a9: usize, a10: usize, a11: usize, a12: usize, a13: usize,
            ) -> CuResult {
                static REAL: AtomicUsize = AtomicUsize::new(0);
                // SAFETY: the bytes are an identifier followed by the one NUL that `concat!`
                // appends; an identifier holds no NUL of its own.
                let name = unsafe { CStr::from_bytes_with_nul_unchecked(concat!(stringify!($name), "\0").as_bytes()) };
                let Some(f) = generic(&REAL, name) else { return cuda::ERROR_NOT_FOUND };
                let _pass = gate::enter();
                // SAFETY: the caller (the application) passes the arguments cuda.h specifies
                // for this entry point, and they are forwarded unchanged, in the registers
                // and stack slots they arrived in, to the real entry point of the same name.
                unsafe { f(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13) }
            }
        )*
        fn gated() -> Vec<(&'static str, usize)> {
            vec![$((concat!(stringify!($name), "\0"), $name as *const () as usize)),*]
        }
    };
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!("the agent's generic gated wrappers assume the x86_64 or aarch64 C calling convention");

gated! {
    cuLaunchKernel cuLaunchKernel_ptsz cuLaunchKernelEx cuLaunchKernelEx_ptsz
    cuLaunchCooperativeKernel cuLaunchCooperativeKernel_ptsz cuLaunchCooperativeKernelMultiDevice
    cuLaunchHostFunc cuLaunchHostFunc_ptsz cuLaunch cuLaunchGrid cuLaunchGridAsync
    cuGraphLaunch cuGraphLaunch_ptsz cuGraphUpload cuGraphUpload_ptsz
    cuMemcpy cuMemcpy_ptds cuMemcpyAsync cuMemcpyAsync_ptsz
    cuMemcpyPeer cuMemcpyPeer_ptds cuMemcpyPeerAsync cuMemcpyPeerAsync_ptsz
    cuMemcpyHtoD_v2 cuMemcpyHtoD_v2_ptds cuMemcpyDtoH_v2 cuMemcpyDtoH_v2_ptds
    cuMemcpyDtoD_v2 cuMemcpyDtoD_v2_ptds cuMemcpyHtoDAsync_v2 cuMemcpyHtoDAsync_v2_ptsz
    cuMemcpyDtoHAsync_v2 cuMemcpyDtoHAsync_v2_ptsz cuMemcpyDtoDAsync_v2 cuMemcpyDtoDAsync_v2_ptsz
    cuMemcpy2D_v2 cuMemcpy2D_v2_ptds cuMemcpy2DUnaligned_v2 cuMemcpy2DUnaligned_v2_ptds
    cuMemcpy2DAsync_v2 cuMemcpy2DAsync_v2_ptsz cuMemcpy3D_v2 cuMemcpy3D_v2_ptds
    cuMemcpy3DAsync_v2 cuMemcpy3DAsync_v2_ptsz cuMemcpy3DPeer cuMemcpy3DPeer_ptds
    cuMemcpy3DPeerAsync cuMemcpy3DPeerAsync_ptsz
    cuMemcpyDtoA_v2 cuMemcpyDtoA_v2_ptds cuMemcpyAtoD_v2 cuMemcpyAtoD_v2_ptds
    cuMemcpyHtoA_v2 cuMemcpyHtoA_v2_ptds cuMemcpyAtoH_v2 cuMemcpyAtoH_v2_ptds
    cuMemcpyBatchAsync cuMemcpyBatchAsync_ptsz cuMemcpyBatchAsync_v2 cuMemcpyBatchAsync_v2_ptsz
    cuMemcpy3DBatchAsync cuMemcpy3DBatchAsync_ptsz cuMemcpy3DBatchAsync_v2 cuMemcpy3DBatchAsync_v2_ptsz
    cuMemsetD8_v2 cuMemsetD8_v2_ptds cuMemsetD16_v2 cuMemsetD16_v2_ptds cuMemsetD32_v2 cuMemsetD32_v2_ptds
    cuMemsetD2D8_v2 cuMemsetD2D8_v2_ptds cuMemsetD2D16_v2 cuMemsetD2D16_v2_ptds cuMemsetD2D32_v2 cuMemsetD2D32_v2_ptds
    cuMemsetD8Async cuMemsetD8Async_ptsz cuMemsetD16Async cuMemsetD16Async_ptsz cuMemsetD32Async cuMemsetD32Async_ptsz
    cuMemsetD2D8Async cuMemsetD2D8Async_ptsz cuMemsetD2D16Async cuMemsetD2D16Async_ptsz
    cuMemsetD2D32Async cuMemsetD2D32Async_ptsz
    cuStreamWriteValue32_v2 cuStreamWriteValue32_v2_ptsz cuStreamWriteValue64_v2 cuStreamWriteValue64_v2_ptsz
    cuStreamBatchMemOp_v2 cuStreamBatchMemOp_v2_ptsz
    cuMemPrefetchAsync cuMemPrefetchAsync_ptsz cuMemPrefetchAsync_v2 cuMemPrefetchAsync_v2_ptsz
    cuMemFreeAsync cuMemFreeAsync_ptsz
}

/// Sharing between processes and GPUs, which no checkpoint of one process can take: each
/// successful call moves a counter of [`crate::sharing`]; the calls are not gated.
macro_rules! counted {
    ($($name:ident => $counter:ident $delta:literal;)*) => {
        $(
            #[no_mangle]
            #[allow(non_snake_case)]
            /// # Safety
            /// Called by the application with the driver entry point's own arguments.
            pub unsafe extern "C" fn $name(
                a0: usize, a1: usize, a2: usize, a3: usize, a4: usize, a5: usize, a6: usize,
                a7: usize, a8: usize, a9: usize, a10: usize, a11: usize, a12: usize, a13: usize,
            ) -> CuResult {
                static REAL: AtomicUsize = AtomicUsize::new(0);
                // SAFETY: as in `gated!`: an identifier and the NUL `concat!` appends.
                let name = unsafe { CStr::from_bytes_with_nul_unchecked(concat!(stringify!($name), "\0").as_bytes()) };
                let Some(f) = generic(&REAL, name) else { return cuda::ERROR_NOT_FOUND };
                // SAFETY: the caller's arguments, forwarded unchanged (see `gated!`).
                let r = unsafe { f(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13) };
                if r == cuda::SUCCESS {
                    crate::sharing::$counter.fetch_add($delta as u64, std::sync::atomic::Ordering::Relaxed);
                }
                r
            }
        )*
        fn counted() -> Vec<(&'static str, usize)> {
            vec![$((concat!(stringify!($name), "\0"), $name as *const () as usize)),*]
        }
    };
}

counted! {
    cuCtxDisablePeerAccess => PEER 18446744073709551615u64;
}

/// Resolves a typed real entry point once.
macro_rules! real {
    ($name:expr => $ty:ty) => {{
        static REAL: AtomicUsize = AtomicUsize::new(0);
        match cuda::resolve(&REAL, $name) {
            0 => None,
            // SAFETY: the non-zero address is libcuda's `$name`, whose cuda.h signature `$ty` is.
            p => Some(unsafe { std::mem::transmute::<usize, $ty>(p) }),
        }
    }};
}

type FnGetProcAddress = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CuResult;
type FnGetProcAddressV2 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CuResult;

/// The typed wrappers, by the exported name each stands for.
fn typed() -> [(&'static str, usize); 29] {
    [
        ("cuGetProcAddress\0", cuGetProcAddress as *const () as usize),
        ("cuGetProcAddress_v2\0", cuGetProcAddress_v2 as *const () as usize),
        ("cuInit\0", cuInit as *const () as usize),
        ("cuMemAlloc_v2\0", cuMemAlloc_v2 as *const () as usize),
        ("cuMemAllocPitch_v2\0", cuMemAllocPitch_v2 as *const () as usize),
        ("cuMemFree_v2\0", cuMemFree_v2 as *const () as usize),
        ("cuMemGetAddressRange_v2\0", cuMemGetAddressRange_v2 as *const () as usize),
        ("cuMemCreate\0", cuMemCreate as *const () as usize),
        ("cuMemRelease\0", cuMemRelease as *const () as usize),
        ("cuMemRetainAllocationHandle\0", cuMemRetainAllocationHandle as *const () as usize),
        ("cuMemMap\0", cuMemMap as *const () as usize),
        ("cuMemUnmap\0", cuMemUnmap as *const () as usize),
        ("cuMemSetAccess\0", cuMemSetAccess as *const () as usize),
        ("cuMemExportToShareableHandle\0", cuMemExportToShareableHandle as *const () as usize),
        ("cuMemGetAllocationPropertiesFromHandle\0", cuMemGetAllocationPropertiesFromHandle as *const () as usize),
        ("cuMemAllocAsync\0", cuMemAllocAsync as *const () as usize),
        ("cuMemAllocAsync_ptsz\0", cuMemAllocAsync_ptsz as *const () as usize),
        ("cuMemAllocFromPoolAsync\0", cuMemAllocFromPoolAsync as *const () as usize),
        ("cuMemAllocFromPoolAsync_ptsz\0", cuMemAllocFromPoolAsync_ptsz as *const () as usize),
        ("cuMemAllocManaged\0", cuMemAllocManaged as *const () as usize),
        ("cuCtxEnablePeerAccess\0", cuCtxEnablePeerAccess as *const () as usize),
        ("cuMemImportFromShareableHandle\0", cuMemImportFromShareableHandle as *const () as usize),
        ("cuIpcGetMemHandle\0", cuIpcGetMemHandle as *const () as usize),
        ("cuIpcOpenMemHandle\0", cuIpcOpenMemHandle as *const () as usize),
        ("cuIpcOpenMemHandle_v2\0", cuIpcOpenMemHandle_v2 as *const () as usize),
        ("cuIpcCloseMemHandle\0", cuIpcCloseMemHandle as *const () as usize),
        ("cuIpcGetEventHandle\0", cuIpcGetEventHandle as *const () as usize),
        ("cuIpcOpenEventHandle\0", cuIpcOpenEventHandle as *const () as usize),
        ("cuEventCreate\0", cuEventCreate as *const () as usize),
    ]
}

static BY_REAL: OnceLock<HashMap<usize, usize>> = OnceLock::new();

/// The wrapper standing for the driver address `p`, or `p` itself.
pub fn redirect(p: *mut c_void) -> *mut c_void {
    if p.is_null() {
        return p;
    }
    let map = match BY_REAL.get() {
        Some(m) => m,
        None => {
            if cuda::libcuda().is_none() {
                return p;
            }
            BY_REAL.get_or_init(|| {
                let mut m = HashMap::new();
                for (name, wrapper) in gated().into_iter().chain(counted()).chain(typed()) {
                    let name = CStr::from_bytes_with_nul(name.as_bytes()).expect("table names end in NUL");
                    let real = cuda::real_symbol(name);
                    if real != 0 {
                        m.insert(real, wrapper);
                    }
                }
                m
            })
        }
    };
    map.get(&(p as usize)).map(|w| *w as *mut c_void).unwrap_or(p)
}

// ---- dlsym ----------------------------------------------------------------------------

/// `dlsym`: jumps to [`hooked_dlsym`] with the caller's return address as a third
/// argument, which `RTLD_NEXT` lookups need to find what comes after the caller.
///
/// # Safety
/// Called as dlsym(3).
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(_handle: *mut c_void, _symbol: *const c_char) -> *mut c_void {
    // Names starting with neither "cu" nor "nc" go straight to glibc's dlsym (resolved when
    // the agent was loaded), which then sees the real caller and the agent allocates nothing.
    core::arch::naked_asm!(
        "test rsi, rsi",
        "jz 2f",
        "cmp byte ptr [rsi], 0x63",
        "jne 4f",
        "cmp byte ptr [rsi + 1], 0x75",
        "jne 2f",
        "3:",
        "mov rdx, [rsp]",
        "jmp {hooked}",
        "4:",
        "cmp byte ptr [rsi], 0x6e",
        "jne 2f",
        "cmp byte ptr [rsi + 1], 0x63",
        "je 3b",
        "2:",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 3b",
        "jmp rax",
        hooked = sym hooked_dlsym,
        real = sym cuda::REAL_DLSYM,
    )
}

/// See the x86_64 version.
///
/// # Safety
/// Called as dlsym(3).
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(_handle: *mut c_void, _symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!("mov x2, x30", "b {0}", sym hooked_dlsym)
}

unsafe extern "C" fn hooked_dlsym(handle: *mut c_void, symbol: *const c_char, caller: *const c_void) -> *mut c_void {
    let Some(real) = cuda::real_dlsym() else { return std::ptr::null_mut() };
    let r = if handle == libc::RTLD_NEXT {
        // SAFETY: `symbol` is the caller's NUL-terminated name; `caller` is its return address.
        unsafe { next_after(real, caller, symbol) }
    } else {
        // SAFETY: forwarding the caller's own arguments.
        unsafe { real(handle, symbol) }
    };
    // SAFETY: `symbol` is a NUL-terminated string (dlsym's contract); only four bytes are
    // read when it is shorter.
    if !r.is_null() && !symbol.is_null() && unsafe { CStr::from_ptr(symbol) }.to_bytes().starts_with(b"nccl") {
        // SAFETY: the caller's handle and NUL-terminated name, and what glibc answered.
        return unsafe { crate::nccl::redirect_dlsym(handle, symbol, r) };
    }
    // SAFETY: as above; only two bytes are read when it is shorter.
    if !r.is_null() && !symbol.is_null() && unsafe { *symbol == b'c' as c_char && *symbol.add(1) == b'u' as c_char } {
        // Without libcuda, the agent's own exports are not a driver: a program probing for
        // CUDA must not find one.
        if cuda::libcuda().is_none() && cuda::in_agent(r) {
            return std::ptr::null_mut();
        }
        return redirect(r);
    }
    r
}

struct Object {
    name: std::ffi::CString,
    ranges: Vec<(usize, usize)>,
}

impl Object {
    fn contains(&self, p: usize) -> bool {
        self.ranges.iter().any(|&(a, b)| p >= a && p < b)
    }
}

unsafe extern "C" fn collect_object(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
    // SAFETY: dl_iterate_phdr passes a valid info for the duration of the call, and `data`
    // is the Vec handed to it by `loaded_objects`.
    unsafe {
        let info = &*info;
        let out = &mut *(data as *mut Vec<Object>);
        let mut ranges = Vec::new();
        for i in 0..info.dlpi_phnum as usize {
            let ph = &*info.dlpi_phdr.add(i);
            if ph.p_type == libc::PT_LOAD {
                let start = info.dlpi_addr as usize + ph.p_vaddr as usize;
                ranges.push((start, start + ph.p_memsz as usize));
            }
        }
        let name = if info.dlpi_name.is_null() { c"".into() } else { CStr::from_ptr(info.dlpi_name).into() };
        out.push(Object { name, ranges });
    }
    0
}

fn loaded_objects() -> Vec<Object> {
    let mut out: Vec<Object> = Vec::new();
    // SAFETY: the callback only reads the info it is given and appends to `out`.
    unsafe { libc::dl_iterate_phdr(Some(collect_object), (&mut out as *mut Vec<Object>).cast()) };
    out
}

/// `dlsym(RTLD_NEXT, symbol)` as seen from `caller`: the first definition in an object
/// loaded after the caller's (glibc would see the agent as the caller otherwise).
unsafe fn next_after(real: unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void, caller: *const c_void, symbol: *const c_char) -> *mut c_void {
    let objects = loaded_objects();
    let Some(at) = objects.iter().position(|o| o.contains(caller as usize)) else { return std::ptr::null_mut() };
    for o in &objects[at + 1..] {
        if o.name.as_bytes().is_empty() {
            continue;
        }
        // SAFETY: RTLD_NOLOAD only returns a handle to an already loaded object, closed below.
        let h = unsafe { libc::dlopen(o.name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if h.is_null() {
            continue;
        }
        // SAFETY: `h` is live until the dlclose; `symbol` is NUL-terminated.
        let p = unsafe { real(h, symbol) };
        // SAFETY: closes the reference taken above.
        unsafe { libc::dlclose(h) };
        if !p.is_null() && o.contains(p as usize) {
            return p;
        }
    }
    std::ptr::null_mut()
}

// ---- cuGetProcAddress ----------------------------------------------------------------

/// # Safety
/// Called as the driver's cuGetProcAddress (CUDA 11.3 signature).
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) -> CuResult {
    let Some(real) = real!(c"cuGetProcAddress" => FnGetProcAddress) else { return cuda::ERROR_NOT_FOUND };
    // SAFETY: the caller (the application) passes the arguments cuda.h specifies; they are
    // forwarded unchanged.
    let r = unsafe { real(symbol, pfn, version, flags) };
    if r == cuda::SUCCESS && !pfn.is_null() {
        // SAFETY: `pfn` is the caller's non-null out-pointer (cuda.h: a `void **`), which the
        // driver has just filled in.
        unsafe { *pfn = redirect(*pfn) };
    }
    r
}

/// # Safety
/// Called as the driver's cuGetProcAddress_v2 (CUDA 12 signature).
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut c_int) -> CuResult {
    let Some(real) = real!(c"cuGetProcAddress_v2" => FnGetProcAddressV2) else { return cuda::ERROR_NOT_FOUND };
    // SAFETY: the caller (the application) passes the arguments cuda.h specifies; they are
    // forwarded unchanged.
    let r = unsafe { real(symbol, pfn, version, flags, status) };
    if r == cuda::SUCCESS && !pfn.is_null() {
        // SAFETY: `pfn` is the caller's non-null out-pointer (cuda.h: a `void **`), which the
        // driver has just filled in.
        unsafe { *pfn = redirect(*pfn) };
    }
    r
}

/// # Safety
/// Called as cuInit.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CuResult {
    let Some(real) = real!(c"cuInit" => unsafe extern "C" fn(c_uint) -> CuResult) else { return cuda::ERROR_NOT_FOUND };
    // SAFETY: a plain flags value, forwarded unchanged.
    let r = unsafe { real(flags) };
    if r == cuda::SUCCESS {
        crate::fork::install();
        crate::control::start();
    }
    r
}

// ---- allocations the agent serves ----------------------------------------------------

/// # Safety
/// Called as cuMemAlloc_v2.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevPtr, size: usize) -> CuResult {
    let _pass = gate::enter();
    if let Some(d) = cuda::driver() {
        if !dptr.is_null() {
            match memory::serve(d, size) {
                Ok(Some(p)) => {
                    // SAFETY: `dptr` is the caller's non-null out-pointer (cuda.h: a
                    // `CUdeviceptr *`).
                    unsafe { *dptr = p };
                    return cuda::SUCCESS;
                }
                Err(e) => return e,
                Ok(None) => {}
            }
        }
    }
    let Some(real) = real!(c"cuMemAlloc_v2" => unsafe extern "C" fn(*mut DevPtr, usize) -> CuResult) else { return cuda::ERROR_NOT_FOUND };
    // SAFETY: the caller (the application) passes the arguments cuda.h specifies; they are
    // forwarded unchanged.
    let r = unsafe { real(dptr, size) };
    if r == cuda::SUCCESS {
        memory::with(|t| {
            t.passthrough.calls += 1;
            t.passthrough.bytes = t.passthrough.bytes.saturating_add(size as u64);
            t.passthrough.small += 1;
        });
    }
    r
}

/// # Safety
/// Called as cuMemAllocPitch_v2.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(dptr: *mut DevPtr, pitch: *mut usize, width: usize, height: usize, elem: c_uint) -> CuResult {
    let _pass = gate::enter();
    // The driver's pitch alignment on current GPUs; cudaMallocPitch answers the same.
    const PITCH_ALIGN: usize = 512;
    if let (Some(d), false, false, 4 | 8 | 16) = (cuda::driver(), dptr.is_null(), pitch.is_null(), elem) {
        if let Some(total) = width.checked_next_multiple_of(PITCH_ALIGN).and_then(|p| p.checked_mul(height).map(|t| (p, t))) {
            let (p, total) = total;
            match memory::serve(d, total) {
                Ok(Some(va)) => {
                    // SAFETY: `dptr` and `pitch` are the caller's out-pointers (cuda.h:
                    // `CUdeviceptr *` and `size_t *`), checked non-null above.
                    unsafe {
                        *dptr = va;
                        *pitch = p;
                    }
                    return cuda::SUCCESS;
                }
                Err(e) => return e,
                Ok(None) => {}
            }
        }
    }
    let Some(real) = real!(c"cuMemAllocPitch_v2" => unsafe extern "C" fn(*mut DevPtr, *mut usize, usize, usize, c_uint) -> CuResult) else {
        return cuda::ERROR_NOT_FOUND;
    };
    // SAFETY: the caller (the application) passes the arguments cuda.h specifies; they are
    // forwarded unchanged.
    let r = unsafe { real(dptr, pitch, width, height, elem) };
    if r == cuda::SUCCESS {
        memory::with(|t| {
            t.passthrough.calls += 1;
            t.passthrough.bytes += width.saturating_mul(height) as u64;
            t.passthrough.pitch += 1;
        });
    }
    r
}

/// # Safety
/// Called as cuMemFree_v2.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemFree_v2(p: DevPtr) -> CuResult {
    let _pass = gate::enter();
    if let Some(d) = cuda::driver() {
        if let Some(r) = memory::free_served(d, p) {
            return r;
        }
    }
    match real!(c"cuMemFree_v2" => unsafe extern "C" fn(DevPtr) -> CuResult) {
        // SAFETY: a plain value, forwarded unchanged.
        Some(real) => unsafe { real(p) },
        None => cuda::ERROR_NOT_FOUND,
    }
}

/// # Safety
/// Called as cuMemGetAddressRange_v2.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(base: *mut DevPtr, size: *mut usize, p: DevPtr) -> CuResult {
    if let Some((b, s)) = memory::served_range(p) {
        if !base.is_null() {
            // SAFETY: `base` is the caller's non-null out-pointer (cuda.h: a `CUdeviceptr *`).
            unsafe { *base = b };
        }
        if !size.is_null() {
            // SAFETY: `size` is the caller's non-null out-pointer (cuda.h: a `size_t *`).
            unsafe { *size = s };
        }
        return cuda::SUCCESS;
    }
    match real!(c"cuMemGetAddressRange_v2" => unsafe extern "C" fn(*mut DevPtr, *mut usize, DevPtr) -> CuResult) {
        // SAFETY: the caller (the application) passes the arguments cuda.h specifies; they are
        // forwarded unchanged.
        Some(real) => unsafe { real(base, size, p) },
        None => cuda::ERROR_NOT_FOUND,
    }
}

// ---- the application's own VMM allocations -------------------------------------------

/// # Safety
/// Called as cuMemCreate.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemCreate(handle: *mut Handle, size: usize, prop: *const AllocationProp, flags: u64) -> CuResult {
    let _pass = gate::enter();
    let Some(real) = real!(c"cuMemCreate" => unsafe extern "C" fn(*mut Handle, usize, *const AllocationProp, u64) -> CuResult) else {
        return cuda::ERROR_NOT_FOUND;
    };
    if !prop.is_null() && !handle.is_null() {
        // SAFETY: `prop` is the caller's non-null `const CUmemAllocationProp *` (cuda.h), plain
        // data that any bit pattern makes valid; it is only copied out.
        let mut p = unsafe { *prop };
        if p.location.is_device() {
            // Exportable as a descriptor, so hiber can take a reference at checkpoint time.
            p.requested_handle_types |= cuda::HANDLE_TYPE_POSIX_FD;
            // SAFETY: the caller's `handle` and `size` forwarded unchanged, with `p`, a
            // valid local copy of its prop, in place of `prop`.
            if unsafe { real(handle, size, &p, flags) } == cuda::SUCCESS {
                // SAFETY: `handle` is the caller's non-null out-pointer (cuda.h: a
                // `CUmemGenericAllocationHandle *`), which the driver has just filled in.
                unsafe { *handle = memory::track_created(*handle, size, p.location.id) };
                return cuda::SUCCESS;
            }
            memory::with(|t| t.passthrough.vmm_not_exportable += 1);
        }
    }
    // SAFETY: the caller (the application) passes the arguments cuda.h specifies; they are
    // forwarded unchanged.
    unsafe { real(handle, size, prop, flags) }
}

/// # Safety
/// Called as cuMemRelease.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemRelease(handle: Handle) -> CuResult {
    let _pass = gate::enter();
    if let Some(r) = cuda::driver().and_then(|d| memory::release_app_handle(d, handle)) {
        return r;
    }
    let r = match real!(c"cuMemRelease" => unsafe extern "C" fn(Handle) -> CuResult) {
        // SAFETY: a plain value, forwarded unchanged.
        Some(real) => unsafe { real(handle) },
        None => cuda::ERROR_NOT_FOUND,
    };
    if r == cuda::SUCCESS {
        crate::sharing::released(handle);
    }
    r
}

/// Memory of another process: counted while imported, which no checkpoint of this process
/// can take (NCCL's peers' buffers are released when hiber tears NCCL down).
///
/// # Safety
/// Called as cuMemImportFromShareableHandle.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(handle: *mut Handle, os_handle: *mut c_void, kind: c_int) -> CuResult {
    let Some(real) = real!(c"cuMemImportFromShareableHandle" => unsafe extern "C" fn(*mut Handle, *mut c_void, c_int) -> CuResult) else {
        return cuda::ERROR_NOT_FOUND;
    };
    // SAFETY: the caller's arguments, forwarded unchanged.
    let r = unsafe { real(handle, os_handle, kind) };
    if r == cuda::SUCCESS && !handle.is_null() {
        // SAFETY: `handle` is the caller's non-null out-pointer, which the driver filled in.
        crate::sharing::imported(unsafe { *handle });
    }
    r
}

/// # Safety
/// Called as cuMemRetainAllocationHandle.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(handle: *mut Handle, addr: *mut c_void) -> CuResult {
    let _pass = gate::enter();
    let Some(real) = real!(c"cuMemRetainAllocationHandle" => unsafe extern "C" fn(*mut Handle, *mut c_void) -> CuResult) else {
        return cuda::ERROR_NOT_FOUND;
    };
    // SAFETY: the caller (the application) passes the arguments cuda.h specifies; they are
    // forwarded unchanged.
    let r = unsafe { real(handle, addr) };
    if r == cuda::SUCCESS && !handle.is_null() {
        // SAFETY: `handle` is the caller's non-null out-pointer (cuda.h: a
        // `CUmemGenericAllocationHandle *`), which the driver has just filled in.
        unsafe { *handle = memory::track_retained(addr as DevPtr, *handle) };
    }
    r
}

/// # Safety
/// Called as cuMemMap.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemMap(p: DevPtr, size: usize, offset: usize, handle: Handle, flags: u64) -> CuResult {
    let _pass = gate::enter();
    let Some(real) = real!(c"cuMemMap" => unsafe extern "C" fn(DevPtr, usize, usize, Handle, u64) -> CuResult) else {
        return cuda::ERROR_NOT_FOUND;
    };
    let real_handle = memory::with(|t| t.translate(handle));
    // SAFETY: plain values, forwarded unchanged but for the application's handle, which
    // becomes the driver handle it stands for.
    let r = unsafe { real(p, size, offset, real_handle, flags) };
    if r == cuda::SUCCESS {
        memory::track_mapped(p, size, offset, handle);
    }
    r
}

/// # Safety
/// Called as cuMemUnmap.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemUnmap(p: DevPtr, size: usize) -> CuResult {
    let _pass = gate::enter();
    let Some(real) = real!(c"cuMemUnmap" => unsafe extern "C" fn(DevPtr, usize) -> CuResult) else { return cuda::ERROR_NOT_FOUND };
    // SAFETY: plain values, forwarded unchanged.
    let r = unsafe { real(p, size) };
    if r == cuda::SUCCESS {
        memory::track_unmapped(p, size);
    }
    r
}

/// # Safety
/// Called as cuCtxEnablePeerAccess.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: cuda::Ctx, flags: c_uint) -> CuResult {
    // Gated as the memory hooks are: it changes the access of memory hiber may be moving.
    let _pass = gate::enter();
    let Some(real) = real!(c"cuCtxEnablePeerAccess" => unsafe extern "C" fn(cuda::Ctx, c_uint) -> CuResult) else {
        return cuda::ERROR_NOT_FOUND;
    };
    // SAFETY: the caller's arguments, forwarded unchanged.
    let r = unsafe { real(peer, flags) };
    if r == cuda::SUCCESS {
        crate::sharing::PEER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // The current context's device may now reach the peer context's memory: the
        // memory the agent serves there must say so itself (VMM memory).
        if let Some(d) = cuda::driver() {
            // SAFETY: the driver has just accepted `peer` as a live context.
            match (d.current_device(), unsafe { d.context_device(peer) }) {
                (Some((_, by)), Ok(owner)) if by != owner => {
                    if let Err(e) = memory::grant_peer(d, owner, by) {
                        crate::log(&format!("opening device {owner}'s served memory to device {by}: CUDA error {e}"));
                    }
                }
                _ => {}
            }
        }
    }
    r
}

/// # Safety
/// Called as cuMemSetAccess.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemSetAccess(p: DevPtr, size: usize, desc: *const AccessDesc, count: usize) -> CuResult {
    let _pass = gate::enter();
    let Some(real) = real!(c"cuMemSetAccess" => unsafe extern "C" fn(DevPtr, usize, *const AccessDesc, usize) -> CuResult) else {
        return cuda::ERROR_NOT_FOUND;
    };
    // SAFETY: the caller (the application) passes the arguments cuda.h specifies; they are
    // forwarded unchanged.
    let r = unsafe { real(p, size, desc, count) };
    if r == cuda::SUCCESS && !desc.is_null() && count > 0 {
        // SAFETY: cuda.h makes `desc` an array of `count` CUmemAccessDesc, which the driver
        // has just read and accepted; the struct is plain data, and the slice is only read
        // for the duration of the call.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        memory::track_access(p, size, descs);
    }
    r
}

/// # Safety
/// Called as cuMemExportToShareableHandle.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(out: *mut c_void, handle: Handle, kind: c_int, flags: u64) -> CuResult {
    let _pass = gate::enter();
    if kind == cuda::HANDLE_TYPE_POSIX_FD && !out.is_null() {
        // Memory hiber handed back is held through an imported handle, which the driver
        // will not export again: the application gets a copy of the descriptor it came with.
        if let Some(fd) = memory::with(|t| t.shared_copy(handle)) {
            // SAFETY: for a POSIX descriptor, cuda.h has `out` point at an int, and the
            // application passed a non-null one.
            unsafe { *out.cast::<c_int>() = fd };
            return cuda::SUCCESS;
        }
    }
    match real!(c"cuMemExportToShareableHandle" => unsafe extern "C" fn(*mut c_void, Handle, c_int, u64) -> CuResult) {
        Some(real) => {
            let real_handle = memory::with(|t| t.translate(handle));
            // SAFETY: the caller (the application) passes the arguments cuda.h specifies;
            // they are forwarded unchanged but for the application's handle, which becomes
            // the driver handle it stands for.
            unsafe { real(out, real_handle, kind, flags) }
        }
        None => cuda::ERROR_NOT_FOUND,
    }
}

/// # Safety
/// Called as cuMemGetAllocationPropertiesFromHandle.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuMemGetAllocationPropertiesFromHandle(prop: *mut AllocationProp, handle: Handle) -> CuResult {
    let _pass = gate::enter();
    match real!(c"cuMemGetAllocationPropertiesFromHandle" => unsafe extern "C" fn(*mut AllocationProp, Handle) -> CuResult) {
        Some(real) => {
            let real_handle = memory::with(|t| t.translate(handle));
            // SAFETY: the caller (the application) passes the out-pointer cuda.h specifies,
            // forwarded unchanged, with the driver handle its handle stands for.
            unsafe { real(prop, real_handle) }
        }
        None => cuda::ERROR_NOT_FOUND,
    }
}

// ---- legacy IPC (see `ipc`) ----------------------------------------------------------

/// # Safety
/// Called as cuIpcGetMemHandle.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: *mut IpcHandle, p: DevPtr) -> CuResult {
    let _pass = gate::enter();
    if !handle.is_null() && cuda::driver().is_some() {
        match crate::ipc::export(p) {
            Some(Ok(bytes)) => {
                // SAFETY: `handle` is the caller's non-null out-pointer (cuda.h: a
                // `CUipcMemHandle *`, 64 bytes of plain data).
                unsafe { (*handle).reserved = bytes };
                return cuda::SUCCESS;
            }
            Some(Err(r)) => return r,
            None => {}
        }
    }
    match real!(c"cuIpcGetMemHandle" => fns::cuIpcGetMemHandle) {
        // SAFETY: the caller's arguments, forwarded unchanged.
        Some(real) => unsafe { real(handle, p) },
        None => cuda::ERROR_NOT_FOUND,
    }
}

/// `cuIpcOpenMemHandle[_v2]`: a handle the agent made is opened by the agent (not
/// counted: it goes with checkpoints); the driver's own are counted, as hiber refuses them.
///
/// # Safety
/// `pdptr` as cuda.h's; `real` is libcuda's entry point of the caller's name.
unsafe fn ipc_open(pdptr: *mut DevPtr, handle: IpcHandle, flags: c_uint, real: Option<fns::cuIpcOpenMemHandle_v2>) -> CuResult {
    let _pass = gate::enter();
    if let (Some(from), Some(d), false) = (crate::ipc::Exported::decode(&handle.reserved), cuda::driver(), pdptr.is_null()) {
        return match crate::ipc::open(d, from) {
            Ok(va) => {
                // SAFETY: `pdptr` is the caller's non-null out-pointer (a `CUdeviceptr *`).
                unsafe { *pdptr = va };
                cuda::SUCCESS
            }
            Err(r) => r,
        };
    }
    let Some(real) = real else { return cuda::ERROR_NOT_FOUND };
    // SAFETY: the caller's arguments, forwarded unchanged.
    let r = unsafe { real(pdptr, handle, flags) };
    if r == cuda::SUCCESS {
        crate::sharing::IPC.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    r
}

/// # Safety
/// Called as cuIpcOpenMemHandle.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuIpcOpenMemHandle(pdptr: *mut DevPtr, handle: IpcHandle, flags: c_uint) -> CuResult {
    let real = real!(c"cuIpcOpenMemHandle" => fns::cuIpcOpenMemHandle_v2);
    // SAFETY: the caller's arguments and the real entry point of this name (cuda.h gives
    // cuIpcOpenMemHandle and _v2 one signature).
    unsafe { ipc_open(pdptr, handle, flags, real) }
}

/// # Safety
/// Called as cuIpcOpenMemHandle_v2.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(pdptr: *mut DevPtr, handle: IpcHandle, flags: c_uint) -> CuResult {
    let real = real!(c"cuIpcOpenMemHandle_v2" => fns::cuIpcOpenMemHandle_v2);
    // SAFETY: the caller's arguments and the real entry point of this name (cuda.h gives
    // cuIpcOpenMemHandle and _v2 one signature).
    unsafe { ipc_open(pdptr, handle, flags, real) }
}

/// # Safety
/// Called as cuIpcCloseMemHandle.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuIpcCloseMemHandle(p: DevPtr) -> CuResult {
    let _pass = gate::enter();
    if let Some(r) = cuda::driver().and_then(|d| crate::ipc::close(d, p)) {
        return r;
    }
    let Some(real) = real!(c"cuIpcCloseMemHandle" => fns::cuIpcCloseMemHandle) else { return cuda::ERROR_NOT_FOUND };
    // SAFETY: a plain value, forwarded unchanged.
    let r = unsafe { real(p) };
    if r == cuda::SUCCESS {
        crate::sharing::IPC.fetch_add(u64::MAX, std::sync::atomic::Ordering::Relaxed);
    }
    r
}

/// An interprocess event's handle, made once the event has completed (see `ipc`).
///
/// # Safety
/// Called as cuIpcGetEventHandle.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuIpcGetEventHandle(handle: *mut IpcHandle, event: Event) -> CuResult {
    let _pass = gate::enter();
    if handle.is_null() {
        return cuda::ERROR_INVALID_VALUE;
    }
    let Some(sync) = real!(c"cuEventSynchronize" => fns::cuEventSynchronize) else { return cuda::ERROR_NOT_FOUND };
    // SAFETY: the application's event, passed as it gave it; the driver checks it.
    let r = unsafe { sync(event) };
    if r == cuda::SUCCESS {
        // SAFETY: `handle` is the caller's non-null out-pointer (a `CUipcEventHandle *`).
        unsafe { (*handle).reserved = crate::ipc::event_handle() };
    }
    r
}

/// # Safety
/// Called as cuIpcOpenEventHandle.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuIpcOpenEventHandle(event: *mut Event, handle: IpcHandle) -> CuResult {
    let _pass = gate::enter();
    if crate::ipc::is_event_handle(&handle.reserved) {
        let Some(create) = real!(c"cuEventCreate" => fns::cuEventCreate) else { return cuda::ERROR_NOT_FOUND };
        // SAFETY: the caller's out-pointer (a `CUevent *`), which the driver checks for null.
        return unsafe { create(event, hiber_cuda_sys::CU_EVENT_DISABLE_TIMING) };
    }
    match real!(c"cuIpcOpenEventHandle" => fns::cuIpcOpenEventHandle) {
        // SAFETY: the caller's arguments, forwarded unchanged.
        Some(real) => unsafe { real(event, handle) },
        None => cuda::ERROR_NOT_FOUND,
    }
}

/// Events are made without the interprocess flag: the agent shares them itself (`ipc`).
///
/// # Safety
/// Called as cuEventCreate.
#[no_mangle]
#[allow(non_snake_case)]
pub unsafe extern "C" fn cuEventCreate(event: *mut Event, flags: c_uint) -> CuResult {
    let Some(real) = real!(c"cuEventCreate" => fns::cuEventCreate) else { return cuda::ERROR_NOT_FOUND };
    // SAFETY: the caller's arguments, forwarded but for one flag bit.
    unsafe { real(event, flags & !hiber_cuda_sys::CU_EVENT_INTERPROCESS) }
}

// ---- allocations left to the driver, counted for `hiber inspect` ---------------------

macro_rules! counted_alloc {
    ($name:ident, $field:ident, ($($arg:ident: $ty:ty),*)) => {
        /// # Safety
        /// Called as the driver entry point of the same name.
        #[no_mangle]
        #[allow(non_snake_case)]
        pub unsafe extern "C" fn $name(dptr: *mut DevPtr, size: usize, $($arg: $ty),*) -> CuResult {
            let _pass = gate::enter();
            // SAFETY: the bytes are an identifier followed by the one NUL that `concat!`
            // appends; an identifier holds no NUL of its own.
            let name = unsafe { CStr::from_bytes_with_nul_unchecked(concat!(stringify!($name), "\0").as_bytes()) };
            let Some(real) = real!(name => unsafe extern "C" fn(*mut DevPtr, usize, $($ty),*) -> CuResult) else {
                return cuda::ERROR_NOT_FOUND;
            };
            // SAFETY: the caller (the application) passes the arguments cuda.h specifies;
            // they are forwarded unchanged.
            let r = unsafe { real(dptr, size, $($arg),*) };
            if r == cuda::SUCCESS {
                memory::with(|t| {
                    t.passthrough.calls += 1;
                    t.passthrough.bytes = t.passthrough.bytes.saturating_add(size as u64);
                    t.passthrough.$field += 1;
                });
            }
            r
        }
    };
}

counted_alloc!(cuMemAllocAsync, stream_ordered, (stream: *mut c_void));
counted_alloc!(cuMemAllocAsync_ptsz, stream_ordered, (stream: *mut c_void));
counted_alloc!(cuMemAllocFromPoolAsync, stream_ordered, (pool: *mut c_void, stream: *mut c_void));
counted_alloc!(cuMemAllocFromPoolAsync_ptsz, stream_ordered, (pool: *mut c_void, stream: *mut c_void));
counted_alloc!(cuMemAllocManaged, managed, (flags: c_uint));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_nul_terminated_and_unique() {
        let mut seen = std::collections::HashSet::new();
        for (name, w) in gated().into_iter().chain(counted()).chain(typed()) {
            assert!(name.ends_with('\0') && name.starts_with("cu"), "{name}");
            assert!(seen.insert(name), "{name} twice");
            assert!(w != 0);
        }
    }

    #[test]
    fn rtld_next_from_here_finds_the_c_library() {
        // The test binary exports `dlsym` itself, so this goes through the hook.
        // SAFETY: plain dlsym calls with NUL-terminated names.
        let (next, default) = unsafe { (dlsym(libc::RTLD_NEXT, c"getpid".as_ptr()), dlsym(libc::RTLD_DEFAULT, c"getpid".as_ptr())) };
        assert!(!next.is_null(), "RTLD_NEXT lookup found a later object's getpid");
        assert_eq!(next, default);
        // SAFETY: as above.
        assert!(unsafe { dlsym(libc::RTLD_DEFAULT, c"no_such_symbol_anywhere".as_ptr()) }.is_null());
    }

    #[test]
    fn without_libcuda_a_cuda_probe_finds_nothing() {
        // The agent exports cuInit (this test binary holds the agent), yet with no libcuda
        // loaded a program looking for the driver must not find one.
        // SAFETY: plain dlsym calls with NUL-terminated names.
        unsafe {
            assert!(dlsym(libc::RTLD_DEFAULT, c"cuInit".as_ptr()).is_null());
            assert!(dlsym(libc::RTLD_DEFAULT, c"cuMemAlloc_v2".as_ptr()).is_null());
            assert!(!dlsym(libc::RTLD_DEFAULT, c"malloc".as_ptr()).is_null());
        }
    }

    #[test]
    fn redirect_passes_unknown_addresses() {
        let p = 0x1234usize as *mut c_void;
        assert_eq!(redirect(p), p);
        assert!(redirect(std::ptr::null_mut()).is_null());
    }
}
