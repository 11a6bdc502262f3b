//! The built-in GPU workload: device memory whose every word follows a known chain,
//! advanced by a kernel each step, and verified word by word by another kernel at the end.
//!
//! The kernels are PTX embedded in hiber and JIT-compiled by the driver, so this runs on
//! any machine with an NVIDIA driver and no CUDA toolkit. The driver API is loaded at run
//! time like the CUDA engine does; all unsafe code of the workload is in this file.

use std::ffi::{c_char, c_void, CStr, CString};

use libloading::Library;

use super::{line, mix, now_ms};

const PTX: &str = include_str!("kernels.ptx");
/// Words copied back each step for the running checksum.
const SAMPLE_WORDS: usize = 8192;

use hiber_cuda_sys::{
    fns, CUcontext as CuContext, CUdevice as CuDevice, CUdeviceptr as CuDevicePtr, CUfunction as CuFunction, CUmodule as CuModule, CUresult as CuResult,
};

/// The driver entry points the workload uses.
struct Driver {
    _lib: Library,
    init: fns::cuInit,
    device_get: fns::cuDeviceGet,
    primary_ctx_retain: fns::cuDevicePrimaryCtxRetain,
    ctx_set_current: fns::cuCtxSetCurrent,
    module_load_data: fns::cuModuleLoadData,
    module_get_function: fns::cuModuleGetFunction,
    mem_alloc: fns::cuMemAlloc_v2,
    memcpy_dtoh: fns::cuMemcpyDtoH_v2,
    memset_d8: fns::cuMemsetD8_v2,
    launch: fns::cuLaunchKernel,
    synchronize: fns::cuCtxSynchronize,
    error_name: fns::cuGetErrorName,
}

fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
    let c = CString::new(name).expect("no NUL");
    // SAFETY: each `T` below is the exact function-pointer type of `name` in cuda.h, and
    // the pointer lives no longer than `lib`, which `Driver` keeps.
    unsafe { lib.get::<T>(c.as_bytes_with_nul()).map(|s| *s).map_err(|e| format!("{name}: {e}")) }
}

impl Driver {
    fn load() -> Result<Driver, String> {
        // SAFETY: libcuda's initializers are made to run in any process.
        let lib = unsafe { Library::new("libcuda.so.1") }.map_err(|e| format!("no NVIDIA driver: {e}"))?;
        Ok(Driver {
            init: sym(&lib, "cuInit")?,
            device_get: sym(&lib, "cuDeviceGet")?,
            primary_ctx_retain: sym(&lib, "cuDevicePrimaryCtxRetain")?,
            ctx_set_current: sym(&lib, "cuCtxSetCurrent")?,
            module_load_data: sym(&lib, "cuModuleLoadData")?,
            module_get_function: sym(&lib, "cuModuleGetFunction")?,
            mem_alloc: sym(&lib, "cuMemAlloc_v2")?,
            memcpy_dtoh: sym(&lib, "cuMemcpyDtoH_v2")?,
            memset_d8: sym(&lib, "cuMemsetD8_v2")?,
            launch: sym(&lib, "cuLaunchKernel")?,
            synchronize: sym(&lib, "cuCtxSynchronize")?,
            error_name: sym(&lib, "cuGetErrorName")?,
            _lib: lib,
        })
    }

    fn check(&self, what: &str, r: CuResult) -> Result<(), String> {
        if r == 0 {
            return Ok(());
        }
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: `p` is a valid out-pointer; on success it points at a static string.
        let name = if unsafe { (self.error_name)(r, &mut p) } == 0 && !p.is_null() {
            // SAFETY: the driver returns a static NUL-terminated string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        } else {
            format!("CUresult {r}")
        };
        Err(format!("{what}: {name}"))
    }

    /// Launches `f` over a grid large enough to cover the GPU, with 64-bit parameters.
    fn launch(&self, f: CuFunction, params: &mut [u64]) -> Result<(), String> {
        let mut ptrs: Vec<*mut c_void> = params.iter_mut().map(|p| p as *mut u64 as *mut c_void).collect();
        // SAFETY: `f` is a loaded kernel whose parameters are all .u64, and `ptrs` points at
        // exactly that many u64 values that outlive the launch call (it copies them).
        let r = unsafe { (self.launch)(f, 1024, 1, 1, 256, 1, 1, 0, std::ptr::null_mut(), ptrs.as_mut_ptr(), std::ptr::null_mut()) };
        self.check("cuLaunchKernel", r)?;
        // SAFETY: no arguments.
        self.check("cuCtxSynchronize", unsafe { (self.synchronize)() })
    }
}

pub struct GpuRun {
    pub mem_mib: u64,
    pub steps: u64,
    pub interval_ms: u64,
    pub seed: u64,
    pub device: i32,
}

pub fn run(a: &GpuRun) -> Result<bool, String> {
    let d = Driver::load()?;
    // SAFETY: cuInit takes flags by value.
    d.check("cuInit", unsafe { (d.init)(0) })?;
    let mut dev: CuDevice = 0;
    // SAFETY: valid out-pointer.
    d.check("cuDeviceGet", unsafe { (d.device_get)(&mut dev, a.device) })?;
    let mut ctx: CuContext = std::ptr::null_mut();
    // SAFETY: valid out-pointer and a device from cuDeviceGet.
    d.check("cuDevicePrimaryCtxRetain", unsafe { (d.primary_ctx_retain)(&mut ctx, dev) })?;
    // SAFETY: `ctx` is a retained context.
    d.check("cuCtxSetCurrent", unsafe { (d.ctx_set_current)(ctx) })?;
    let ptx = CString::new(PTX).expect("PTX has no NUL");
    let mut module: CuModule = std::ptr::null_mut();
    // SAFETY: `ptx` is a NUL-terminated PTX image that outlives the call.
    d.check("cuModuleLoadData", unsafe { (d.module_load_data)(&mut module, ptx.as_ptr() as *const c_void) })?;
    let get = |name: &str| -> Result<CuFunction, String> {
        let mut f: CuFunction = std::ptr::null_mut();
        let c = CString::new(name).expect("no NUL");
        // SAFETY: valid out-pointer, a loaded module and a NUL-terminated name.
        d.check(name, unsafe { (d.module_get_function)(&mut f, module, c.as_ptr()) })?;
        Ok(f)
    };
    let (k_init, k_step, k_verify) = (get("hiber_init")?, get("hiber_step")?, get("hiber_verify")?);

    let words = ((a.mem_mib.max(1) << 20) / 8).max(SAMPLE_WORDS as u64 * 2);
    let mut buf: CuDevicePtr = 0;
    let mut bad: CuDevicePtr = 0;
    // SAFETY: valid out-pointers; sizes are non-zero.
    d.check("cuMemAlloc", unsafe { (d.mem_alloc)(&mut buf, (words * 8) as usize) })?;
    // SAFETY: as above.
    d.check("cuMemAlloc", unsafe { (d.mem_alloc)(&mut bad, 8) })?;
    d.launch(k_init, &mut [buf, words, a.seed])?;
    line(format_args!("start gpu steps {} mem_mib {} device {} pid {}", a.steps, a.mem_mib, a.device, std::process::id()));

    let mut sample = vec![0u64; SAMPLE_WORDS];
    let mut checksum = a.seed;
    for step in 0..a.steps {
        d.launch(k_step, &mut [buf, words, step])?;
        let offset = mix(step) % (words - SAMPLE_WORDS as u64);
        // SAFETY: `sample` has room for SAMPLE_WORDS words and the source range lies inside
        // the allocation (offset + SAMPLE_WORDS <= words).
        d.check("cuMemcpyDtoH", unsafe { (d.memcpy_dtoh)(sample.as_mut_ptr() as *mut c_void, buf + offset * 8, SAMPLE_WORDS * 8) })?;
        checksum = sample.iter().fold(mix(checksum ^ step), |c, &w| mix(c ^ w));
        line(format_args!("step {step} checksum {checksum:016x} t {}", now_ms()));
        std::thread::sleep(std::time::Duration::from_millis(a.interval_ms));
    }
    // SAFETY: `bad` is an 8-byte allocation.
    d.check("cuMemsetD8", unsafe { (d.memset_d8)(bad, 0, 8) })?;
    d.launch(k_verify, &mut [buf, words, a.seed, a.steps, bad])?;
    let mut bad_words = 0u64;
    // SAFETY: copies 8 bytes into a u64.
    d.check("cuMemcpyDtoH", unsafe { (d.memcpy_dtoh)(&mut bad_words as *mut u64 as *mut c_void, bad, 8) })?;
    if bad_words == 0 {
        line(format_args!("verify ok steps {} words {words} checksum {checksum:016x}", a.steps));
        Ok(true)
    } else {
        line(format_args!("verify FAILED bad_words {bad_words} of {words}"));
        Ok(false)
    }
}
