//! The CUDA driver API as hiber uses it: one set of declarations for the CUDA engines in
//! `hiber-core`, the agent (`hiber-agent`) and the built-in GPU workload.
//!
//! Nothing here links or loads libcuda. Each user resolves entry points its own way (the
//! engines through `libloading`, the agent through glibc's real `dlsym`, since it exports
//! driver symbols itself) and casts them to the function-pointer types of [`fns`], named
//! after the symbol they are resolved from (`cuMemAlloc_v2`, not `cuMemAlloc`). The crate
//! has no dependencies, so the agent still pulls in nothing heavier than libc.
//!
//! The `#[repr(C)]` structs mirror cuda.h of CUDA 13.0. [`abi_layout`] prints their
//! layout in the format of the GPU suite's `abi.c`, which diffs it against the cuda.h of
//! the GPU machine; the unit tests below pin the sizes and offsets here.

#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_uint, c_void};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
/// `CUmemGenericAllocationHandle`.
pub type CUmemHandle = u64;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUevent = *mut c_void;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;

/// `CUmemAllocationHandleType`: a POSIX file descriptor.
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
/// `CUmemLocationType`: device memory.
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// `CUmemAllocationType`: pinned (the only type cuMemCreate takes).
pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
/// `CUmemAccess_flags`: read and write.
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
/// `CUmemAllocationGranularity_flags`: the minimum granularity.
pub const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;
/// `CUstream_flags`: a stream that does not synchronize with the legacy default stream.
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
/// `cuMemHostRegister`: the memory is page-locked for every context, not only the current one.
pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;

/// `CUevent_flags`: no timing data (what an interprocess event must have).
pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;
/// `CUevent_flags`: usable across processes through `cuIpcGetEventHandle`.
pub const CU_EVENT_INTERPROCESS: c_uint = 4;
/// Bytes of `CU_IPC_HANDLE_SIZE`: a `CUipcMemHandle` or `CUipcEventHandle`, opaque.
pub const CU_IPC_HANDLE_SIZE: usize = 64;

/// `CUipcMemHandle` and `CUipcEventHandle` (one layout): passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUipcHandle {
    pub reserved: [u8; CU_IPC_HANDLE_SIZE],
}

/// `CU_LIMIT_STACK_SIZE`: the per-thread stack of kernels, whose local memory the driver
/// reserves for every thread the device can run at once.
pub const CU_LIMIT_STACK_SIZE: c_int = 0;
/// `CUprocessState`.
pub const CU_PROCESS_STATE_RUNNING: c_int = 0;
pub const CU_PROCESS_STATE_LOCKED: c_int = 1;
pub const CU_PROCESS_STATE_CHECKPOINTED: c_int = 2;
pub const CU_PROCESS_STATE_FAILED: c_int = 3;

/// `CUuuid`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

/// `CUmemLocation` (8 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CUmemLocation {
    pub kind: c_int,
    pub id: c_int,
}

impl CUmemLocation {
    pub fn device(dev: CUdevice) -> CUmemLocation {
        CUmemLocation { kind: CU_MEM_LOCATION_TYPE_DEVICE, id: dev }
    }

    pub fn is_device(&self) -> bool {
        self.kind == CU_MEM_LOCATION_TYPE_DEVICE
    }
}

/// `CUmemAllocationProp` (32 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemAllocationProp {
    pub kind: c_int,
    pub requested_handle_types: c_int,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    /// `allocFlags`: compression type, GPU-direct RDMA capability, usage, reserved.
    pub alloc_flags: [u8; 8],
}

impl CUmemAllocationProp {
    /// Pinned device memory on `dev`, exportable as the handle types given (0: none).
    pub fn device(dev: CUdevice, handle_types: c_int) -> CUmemAllocationProp {
        CUmemAllocationProp {
            kind: CU_MEM_ALLOCATION_TYPE_PINNED,
            requested_handle_types: handle_types,
            location: CUmemLocation::device(dev),
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: [0; 8],
        }
    }
}

/// `CUmemAccessDesc` (12 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: c_int,
}

impl CUmemAccessDesc {
    pub fn read_write(dev: CUdevice) -> CUmemAccessDesc {
        CUmemAccessDesc { location: CUmemLocation::device(dev), flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE }
    }
}

/// `CUcheckpointLockArgs` (64 bytes, reserved fields zero).
#[repr(C)]
#[derive(Debug, Default)]
pub struct CUcheckpointLockArgs {
    pub timeout_ms: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs` (64 bytes, all reserved).
#[repr(C)]
#[derive(Debug, Default)]
pub struct CUcheckpointCheckpointArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointGpuPair`: restore the state of GPU `old_uuid` onto `new_uuid`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUcheckpointGpuPair {
    pub old_uuid: CUuuid,
    pub new_uuid: CUuuid,
}

/// `CUcheckpointRestoreArgs` (64 bytes; GPU pairs since CUDA 13.0).
#[repr(C)]
#[derive(Debug)]
pub struct CUcheckpointRestoreArgs {
    pub gpu_pairs: *const CUcheckpointGpuPair,
    pub gpu_pairs_count: c_uint,
    pub reserved: [u8; 44],
    pub reserved1: u64,
}

impl CUcheckpointRestoreArgs {
    /// Arguments naming `pairs`, which must outlive the call they are passed to.
    pub fn with_pairs(pairs: &[CUcheckpointGpuPair]) -> CUcheckpointRestoreArgs {
        CUcheckpointRestoreArgs {
            gpu_pairs: if pairs.is_empty() { std::ptr::null() } else { pairs.as_ptr() },
            gpu_pairs_count: pairs.len() as c_uint,
            reserved: [0; 44],
            reserved1: 0,
        }
    }
}

/// `CUcheckpointUnlockArgs` (64 bytes, all reserved).
#[repr(C)]
#[derive(Debug, Default)]
pub struct CUcheckpointUnlockArgs {
    pub reserved: [u64; 8],
}

/// Function-pointer types of the driver entry points hiber calls, named after the symbol
/// each is resolved from. Their signatures are cuda.h's.
pub mod fns {
    use super::*;
    use std::ffi::c_char;

    // Initialization, versions, errors.
    pub type cuInit = unsafe extern "C" fn(c_uint) -> CUresult;
    pub type cuDriverGetVersion = unsafe extern "C" fn(*mut c_int) -> CUresult;
    pub type cuGetErrorName = unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult;
    pub type cuGetProcAddress = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;
    pub type cuGetProcAddress_v2 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;

    // Devices and contexts.
    pub type cuDeviceGet = unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult;
    pub type cuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> CUresult;
    pub type cuDeviceGetUuid_v2 = unsafe extern "C" fn(*mut CUuuid, CUdevice) -> CUresult;
    pub type cuDevicePrimaryCtxRetain = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult;
    pub type cuDevicePrimaryCtxRelease_v2 = unsafe extern "C" fn(CUdevice) -> CUresult;
    pub type cuCtxGetCurrent = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
    pub type cuCtxSetCurrent = unsafe extern "C" fn(CUcontext) -> CUresult;
    pub type cuCtxPushCurrent_v2 = unsafe extern "C" fn(CUcontext) -> CUresult;
    pub type cuCtxPopCurrent_v2 = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
    pub type cuCtxGetDevice = unsafe extern "C" fn(*mut CUdevice) -> CUresult;
    pub type cuCtxSynchronize = unsafe extern "C" fn() -> CUresult;
    pub type cuDevicePrimaryCtxGetState = unsafe extern "C" fn(CUdevice, *mut c_uint, *mut c_int) -> CUresult;
    pub type cuCtxGetLimit = unsafe extern "C" fn(*mut usize, c_int) -> CUresult;
    pub type cuCtxSetLimit = unsafe extern "C" fn(c_int, usize) -> CUresult;

    // Memory: classic allocations.
    pub type cuMemGetInfo_v2 = unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult;
    pub type cuMemAlloc_v2 = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
    pub type cuMemAllocPitch_v2 = unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) -> CUresult;
    pub type cuMemFree_v2 = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
    pub type cuMemGetAddressRange_v2 = unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, CUdeviceptr) -> CUresult;
    pub type cuMemHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CUresult;
    pub type cuMemFreeHost = unsafe extern "C" fn(*mut c_void) -> CUresult;
    pub type cuMemHostRegister_v2 = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult;
    pub type cuMemHostUnregister = unsafe extern "C" fn(*mut c_void) -> CUresult;
    pub type cuMemcpyDtoH_v2 = unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize) -> CUresult;
    pub type cuMemcpyDtoHAsync_v2 = unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize, CUstream) -> CUresult;
    pub type cuMemcpyHtoDAsync_v2 = unsafe extern "C" fn(CUdeviceptr, *const c_void, usize, CUstream) -> CUresult;
    pub type cuMemcpyDtoDAsync_v2 = unsafe extern "C" fn(CUdeviceptr, CUdeviceptr, usize, CUstream) -> CUresult;
    pub type cuMemsetD8_v2 = unsafe extern "C" fn(CUdeviceptr, u8, usize) -> CUresult;

    // Memory: the virtual memory management (VMM) API.
    pub type cuMemAddressReserve = unsafe extern "C" fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64) -> CUresult;
    pub type cuMemAddressFree = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
    pub type cuMemCreate = unsafe extern "C" fn(*mut CUmemHandle, usize, *const CUmemAllocationProp, u64) -> CUresult;
    pub type cuMemRelease = unsafe extern "C" fn(CUmemHandle) -> CUresult;
    pub type cuMemMap = unsafe extern "C" fn(CUdeviceptr, usize, usize, CUmemHandle, u64) -> CUresult;
    pub type cuMemUnmap = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
    pub type cuMemSetAccess = unsafe extern "C" fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize) -> CUresult;
    pub type cuMemExportToShareableHandle = unsafe extern "C" fn(*mut c_void, CUmemHandle, c_int, u64) -> CUresult;
    pub type cuMemImportFromShareableHandle = unsafe extern "C" fn(*mut CUmemHandle, *mut c_void, c_int) -> CUresult;
    pub type cuMemGetAllocationGranularity = unsafe extern "C" fn(*mut usize, *const CUmemAllocationProp, c_int) -> CUresult;
    pub type cuMemGetAllocationPropertiesFromHandle = unsafe extern "C" fn(*mut CUmemAllocationProp, CUmemHandle) -> CUresult;
    pub type cuMemRetainAllocationHandle = unsafe extern "C" fn(*mut CUmemHandle, *mut c_void) -> CUresult;

    // Streams, modules, launches.
    pub type cuStreamCreate = unsafe extern "C" fn(*mut CUstream, c_uint) -> CUresult;
    pub type cuStreamSynchronize = unsafe extern "C" fn(CUstream) -> CUresult;
    pub type cuStreamIsCapturing = unsafe extern "C" fn(CUstream, *mut c_int) -> CUresult;
    pub type cuStreamDestroy_v2 = unsafe extern "C" fn(CUstream) -> CUresult;

    // Events and legacy IPC.
    pub type cuEventCreate = unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult;
    pub type cuEventSynchronize = unsafe extern "C" fn(CUevent) -> CUresult;
    pub type cuIpcGetMemHandle = unsafe extern "C" fn(*mut CUipcHandle, CUdeviceptr) -> CUresult;
    pub type cuIpcOpenMemHandle_v2 = unsafe extern "C" fn(*mut CUdeviceptr, CUipcHandle, c_uint) -> CUresult;
    pub type cuIpcCloseMemHandle = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
    pub type cuIpcGetEventHandle = unsafe extern "C" fn(*mut CUipcHandle, CUevent) -> CUresult;
    pub type cuIpcOpenEventHandle = unsafe extern "C" fn(*mut CUevent, CUipcHandle) -> CUresult;
    pub type cuModuleLoadData = unsafe extern "C" fn(*mut CUmodule, *const c_void) -> CUresult;
    pub type cuModuleGetFunction = unsafe extern "C" fn(*mut CUfunction, CUmodule, *const c_char) -> CUresult;
    pub type cuLaunchKernel =
        unsafe extern "C" fn(CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CUstream, *mut *mut c_void, *mut *mut c_void) -> CUresult;

    // The checkpoint API (driver 570+).
    pub type cuCheckpointProcessGetState = unsafe extern "C" fn(c_int, *mut c_int) -> CUresult;
    pub type cuCheckpointProcessLock = unsafe extern "C" fn(c_int, *mut CUcheckpointLockArgs) -> CUresult;
    pub type cuCheckpointProcessCheckpoint = unsafe extern "C" fn(c_int, *mut CUcheckpointCheckpointArgs) -> CUresult;
    pub type cuCheckpointProcessRestore = unsafe extern "C" fn(c_int, *mut CUcheckpointRestoreArgs) -> CUresult;
    pub type cuCheckpointProcessUnlock = unsafe extern "C" fn(c_int, *mut CUcheckpointUnlockArgs) -> CUresult;
    pub type cuCheckpointProcessGetRestoreThreadId = unsafe extern "C" fn(c_int, *mut c_int) -> CUresult;
}

/// The layout of every struct above, in the format the GPU suite's `abi.c` prints from
/// cuda.h (`hiber workload cuda-abi` prints this), so the two can be diffed on a machine
/// with the toolkit.
pub fn abi_layout() -> Vec<(&'static str, usize)> {
    use std::mem::{offset_of, size_of};
    vec![
        ("CUcheckpointLockArgs size", size_of::<CUcheckpointLockArgs>()),
        ("CUcheckpointLockArgs.timeoutMs", offset_of!(CUcheckpointLockArgs, timeout_ms)),
        ("CUcheckpointCheckpointArgs size", size_of::<CUcheckpointCheckpointArgs>()),
        ("CUcheckpointRestoreArgs size", size_of::<CUcheckpointRestoreArgs>()),
        ("CUcheckpointRestoreArgs.gpuPairs", offset_of!(CUcheckpointRestoreArgs, gpu_pairs)),
        ("CUcheckpointRestoreArgs.gpuPairsCount", offset_of!(CUcheckpointRestoreArgs, gpu_pairs_count)),
        ("CUcheckpointGpuPair size", size_of::<CUcheckpointGpuPair>()),
        ("CUcheckpointGpuPair.newUuid", offset_of!(CUcheckpointGpuPair, new_uuid)),
        ("CUcheckpointUnlockArgs size", size_of::<CUcheckpointUnlockArgs>()),
        ("CU_PROCESS_STATE_RUNNING", CU_PROCESS_STATE_RUNNING as usize),
        ("CU_PROCESS_STATE_LOCKED", CU_PROCESS_STATE_LOCKED as usize),
        ("CU_PROCESS_STATE_CHECKPOINTED", CU_PROCESS_STATE_CHECKPOINTED as usize),
        ("CU_PROCESS_STATE_FAILED", CU_PROCESS_STATE_FAILED as usize),
        ("CUmemAllocationProp size", size_of::<CUmemAllocationProp>()),
        ("CUmemAllocationProp.location", offset_of!(CUmemAllocationProp, location)),
        ("CUmemAllocationProp.win32HandleMetaData", offset_of!(CUmemAllocationProp, win32_handle_meta_data)),
        ("CUmemAllocationProp.allocFlags", offset_of!(CUmemAllocationProp, alloc_flags)),
        ("CUmemAccessDesc size", size_of::<CUmemAccessDesc>()),
        ("CUmemAccessDesc.flags", offset_of!(CUmemAccessDesc, flags)),
        ("CUmemLocation size", size_of::<CUmemLocation>()),
        ("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR as usize),
        ("CU_MEM_LOCATION_TYPE_DEVICE", CU_MEM_LOCATION_TYPE_DEVICE as usize),
        ("CU_MEM_ACCESS_FLAGS_PROT_READWRITE", CU_MEM_ACCESS_FLAGS_PROT_READWRITE as usize),
        ("CUipcMemHandle size", size_of::<CUipcHandle>()),
        ("CUipcEventHandle size", size_of::<CUipcHandle>()),
        ("CU_EVENT_DISABLE_TIMING", CU_EVENT_DISABLE_TIMING as usize),
        ("CU_EVENT_INTERPROCESS", CU_EVENT_INTERPROCESS as usize),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The figures cuda.h of CUDA 13.0 gives on x86_64 (the GPU suite checks them against
    /// the real header; these keep a change here from slipping by without a GPU).
    #[test]
    fn layouts_match_cuda_13_on_x86_64() {
        let got: std::collections::BTreeMap<&str, usize> = abi_layout().into_iter().collect();
        let want = [
            ("CUcheckpointLockArgs size", 64),
            ("CUcheckpointLockArgs.timeoutMs", 0),
            ("CUcheckpointCheckpointArgs size", 64),
            ("CUcheckpointRestoreArgs size", 64),
            ("CUcheckpointRestoreArgs.gpuPairs", 0),
            ("CUcheckpointRestoreArgs.gpuPairsCount", 8),
            ("CUcheckpointGpuPair size", 32),
            ("CUcheckpointGpuPair.newUuid", 16),
            ("CUcheckpointUnlockArgs size", 64),
            ("CUmemAllocationProp size", 32),
            ("CUmemAllocationProp.location", 8),
            ("CUmemAllocationProp.win32HandleMetaData", 16),
            ("CUmemAllocationProp.allocFlags", 24),
            ("CUmemAccessDesc size", 12),
            ("CUmemAccessDesc.flags", 8),
            ("CUmemLocation size", 8),
            ("CUipcMemHandle size", 64),
            ("CU_EVENT_DISABLE_TIMING", 2),
            ("CU_EVENT_INTERPROCESS", 4),
        ];
        for (k, v) in want {
            assert_eq!(got[k], v, "{k}");
        }
        assert_eq!(std::mem::size_of::<CUuuid>(), 16);
        assert_eq!(std::mem::align_of::<CUcheckpointRestoreArgs>(), 8);
    }

    #[test]
    fn restore_args_name_their_pairs() {
        let none = CUcheckpointRestoreArgs::with_pairs(&[]);
        assert!(none.gpu_pairs.is_null());
        assert_eq!(none.gpu_pairs_count, 0);
        let pairs = [CUcheckpointGpuPair { old_uuid: CUuuid { bytes: [1; 16] }, new_uuid: CUuuid { bytes: [2; 16] } }];
        let some = CUcheckpointRestoreArgs::with_pairs(&pairs);
        assert_eq!(some.gpu_pairs, pairs.as_ptr());
        assert_eq!(some.gpu_pairs_count, 1);
    }
}
