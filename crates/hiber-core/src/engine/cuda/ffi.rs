//! The CUDA driver's checkpoint API and NVML, loaded at run time.
//!
//! libcuda.so.1 and libnvidia-ml.so.1 are `dlopen`ed, never linked, so the same hiber runs
//! on machines without a GPU. The `#[repr(C)]` argument structs mirror cuda.h (CUDA 13.0):
//! 64 bytes each, reserved fields zeroed; the GPU suite checks them against the cuda.h of
//! the GPU machine. All unsafe code of the CUDA engine is in this module.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};

use libloading::Library;

pub type CuResult = c_int;
pub const CUDA_SUCCESS: CuResult = 0;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CuUuid {
    pub bytes: [u8; 16],
}

#[repr(C)]
#[derive(Debug, Default)]
pub struct LockArgs {
    pub timeout_ms: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

#[repr(C)]
#[derive(Debug, Default)]
pub struct CheckpointArgs {
    pub reserved: [u64; 8],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GpuPair {
    pub old_uuid: CuUuid,
    pub new_uuid: CuUuid,
}

#[repr(C)]
#[derive(Debug)]
pub struct RestoreArgs {
    pub gpu_pairs: *const GpuPair,
    pub gpu_pairs_count: c_uint,
    pub reserved: [c_char; 44],
    pub reserved1: u64,
}

#[repr(C)]
#[derive(Debug, Default)]
pub struct UnlockArgs {
    pub reserved: [u64; 8],
}

/// hiber's view of the argument structs, in the format the GPU suite's `abi.c` prints from
/// cuda.h, so the two can be compared on a machine with the toolkit.
pub fn abi_layout() -> Vec<(&'static str, usize)> {
    use std::mem::{offset_of, size_of};
    vec![
        ("CUcheckpointLockArgs size", size_of::<LockArgs>()),
        ("CUcheckpointLockArgs.timeoutMs", offset_of!(LockArgs, timeout_ms)),
        ("CUcheckpointCheckpointArgs size", size_of::<CheckpointArgs>()),
        ("CUcheckpointRestoreArgs size", size_of::<RestoreArgs>()),
        ("CUcheckpointRestoreArgs.gpuPairs", offset_of!(RestoreArgs, gpu_pairs)),
        ("CUcheckpointRestoreArgs.gpuPairsCount", offset_of!(RestoreArgs, gpu_pairs_count)),
        ("CUcheckpointGpuPair size", size_of::<GpuPair>()),
        ("CUcheckpointGpuPair.newUuid", offset_of!(GpuPair, new_uuid)),
        ("CUcheckpointUnlockArgs size", size_of::<UnlockArgs>()),
        ("CU_PROCESS_STATE_RUNNING", 0),
        ("CU_PROCESS_STATE_LOCKED", 1),
        ("CU_PROCESS_STATE_CHECKPOINTED", 2),
        ("CU_PROCESS_STATE_FAILED", 3),
    ]
}

type FnInit = unsafe extern "C" fn(c_uint) -> CuResult;
type FnDriverVersion = unsafe extern "C" fn(*mut c_int) -> CuResult;
type FnErrorString = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;
type FnGetState = unsafe extern "C" fn(c_int, *mut c_int) -> CuResult;
type FnLock = unsafe extern "C" fn(c_int, *mut LockArgs) -> CuResult;
type FnCheckpoint = unsafe extern "C" fn(c_int, *mut CheckpointArgs) -> CuResult;
type FnRestore = unsafe extern "C" fn(c_int, *mut RestoreArgs) -> CuResult;
type FnUnlock = unsafe extern "C" fn(c_int, *mut UnlockArgs) -> CuResult;

/// The checkpoint entry points of a loaded libcuda.
pub struct CheckpointFns {
    get_state: FnGetState,
    lock: FnLock,
    checkpoint: FnCheckpoint,
    restore: FnRestore,
    unlock: FnUnlock,
}

/// A loaded libcuda. The library handle is kept for as long as the function pointers.
pub struct CudaLib {
    _lib: Library,
    init: FnInit,
    init_result: std::sync::OnceLock<CuResult>,
    error_name: Option<FnErrorString>,
    driver_version: c_int,
    checkpoint: Option<CheckpointFns>,
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
        let init: FnInit = sym(&lib, "cuInit")?;
        let version: FnDriverVersion = sym(&lib, "cuDriverGetVersion")?;
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
            })
        })()
        .ok();
        let error_name = sym(&lib, "cuGetErrorName").ok();
        Ok(CudaLib { _lib: lib, init, init_result: std::sync::OnceLock::new(), error_name, driver_version: v, checkpoint })
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

    /// `cuInit`, once, on first use: it may start driver threads, and hiber forks job
    /// shims, which must happen while it is single-threaded.
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
        let mut args = RestoreArgs {
            gpu_pairs: if pairs.is_empty() { std::ptr::null() } else { pairs.as_ptr() },
            gpu_pairs_count: pairs.len() as c_uint,
            reserved: [0; 44],
            reserved1: 0,
        };
        let fns = self.fns()?;
        // SAFETY: `args` is valid and zero-reserved; `gpu_pairs` points at `pairs.len()`
        // pairs that outlive the call (or is NULL with a count of 0).
        check(unsafe { (fns.restore)(pid, &mut args) })
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
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn checkpoint_args_are_64_bytes() {
        assert_eq!(size_of::<LockArgs>(), 64);
        assert_eq!(size_of::<CheckpointArgs>(), 64);
        assert_eq!(size_of::<RestoreArgs>(), 64);
        assert_eq!(size_of::<UnlockArgs>(), 64);
        assert_eq!(offset_of!(LockArgs, timeout_ms), 0);
        assert_eq!(offset_of!(RestoreArgs, gpu_pairs), 0);
        assert_eq!(offset_of!(RestoreArgs, gpu_pairs_count), 8);
        assert_eq!(size_of::<GpuPair>(), 32);
        assert_eq!(size_of::<CuUuid>(), 16);
        assert_eq!(align_of::<RestoreArgs>(), 8);
    }

    #[test]
    fn nvml_structs() {
        assert_eq!(size_of::<NvmlMemory>(), 24);
        assert_eq!(size_of::<NvmlProcessInfo>(), 24);
        assert_eq!(offset_of!(NvmlProcessInfo, used_gpu_memory), 8);
    }

    #[test]
    fn loading_without_a_driver_fails_cleanly() {
        // On a machine with a driver this loads; without one it must be an error, never a
        // crash.
        match CudaLib::load() {
            Ok(lib) => assert!(lib.driver_version() > 0),
            Err(LoadError::NoLibrary(_)) | Err(LoadError::Init(_)) | Err(LoadError::MissingSymbol(_)) => {}
        }
    }
}
