//! OpenCL's C types and constants (from Khronos's `CL/cl.h`, as far as the layer needs
//! them), and the real entry points of the ICD loader the application links.
//!
//! The real functions are looked up in `libOpenCL.so.1` by its handle, so they are the
//! loader's own and never this layer's exports of the same names.

#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::c_void;
use std::sync::OnceLock;

pub type cl_int = i32;
pub type cl_uint = u32;
pub type cl_ulong = u64;
pub type cl_bitfield = u64;
pub type cl_bool = u32;
/// Every OpenCL object handle, real or virtual.
pub type H = *mut c_void;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImageFormat {
    pub order: cl_uint,
    pub data_type: cl_uint,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ImageDesc {
    pub image_type: cl_uint,
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub array_size: usize,
    pub row_pitch: usize,
    pub slice_pitch: usize,
    pub num_mip_levels: cl_uint,
    pub num_samples: cl_uint,
    pub buffer: H,
}

// SAFETY: a description is plain data; its `buffer` is a handle value the layer never
// dereferences (the copies records keep have it null).
unsafe impl Send for ImageDesc {}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BufferRegion {
    pub origin: usize,
    pub size: usize,
}

pub const CL_SUCCESS: cl_int = 0;
pub const CL_DEVICE_NOT_FOUND: cl_int = -1;
pub const CL_OUT_OF_HOST_MEMORY: cl_int = -6;
pub const CL_PROFILING_INFO_NOT_AVAILABLE: cl_int = -7;
pub const CL_INVALID_VALUE: cl_int = -30;
pub const CL_INVALID_PLATFORM: cl_int = -32;
pub const CL_INVALID_DEVICE: cl_int = -33;
pub const CL_INVALID_CONTEXT: cl_int = -34;
pub const CL_INVALID_COMMAND_QUEUE: cl_int = -36;
pub const CL_INVALID_MEM_OBJECT: cl_int = -38;
pub const CL_INVALID_SAMPLER: cl_int = -41;
pub const CL_INVALID_PROGRAM: cl_int = -44;
pub const CL_INVALID_KERNEL: cl_int = -48;
pub const CL_INVALID_EVENT_WAIT_LIST: cl_int = -57;
pub const CL_INVALID_EVENT: cl_int = -58;
pub const CL_INVALID_OPERATION: cl_int = -59;
pub const CL_PLATFORM_NOT_FOUND_KHR: cl_int = -1001;

pub const CL_PLATFORM_NAME: cl_uint = 0x0902;
pub const CL_DEVICE_TYPE_CPU: cl_bitfield = 1 << 1;
pub const CL_DEVICE_TYPE_GPU: cl_bitfield = 1 << 2;
pub const CL_DEVICE_TYPE_ALL: cl_bitfield = 0xFFFF_FFFF;
pub const CL_DEVICE_TYPE: cl_uint = 0x1000;
pub const CL_DEVICE_NAME: cl_uint = 0x102B;
pub const CL_DEVICE_PLATFORM: cl_uint = 0x1031;
pub const CL_DEVICE_PARENT_DEVICE: cl_uint = 0x1042;
pub const CL_CONTEXT_REFERENCE_COUNT: cl_uint = 0x1080;
pub const CL_CONTEXT_DEVICES: cl_uint = 0x1081;
pub const CL_CONTEXT_PROPERTIES: cl_uint = 0x1082;
pub const CL_CONTEXT_PLATFORM: isize = 0x1084;
pub const CL_QUEUE_ON_DEVICE: cl_bitfield = 1 << 2;
pub const CL_QUEUE_PROPERTIES: u64 = 0x1093;
pub const CL_QUEUE_CONTEXT: cl_uint = 0x1090;
pub const CL_QUEUE_DEVICE: cl_uint = 0x1091;
pub const CL_QUEUE_REFERENCE_COUNT: cl_uint = 0x1092;
pub const CL_QUEUE_DEVICE_DEFAULT: cl_uint = 0x1095;
pub const CL_MEM_USE_HOST_PTR: cl_bitfield = 1 << 3;
/// `CL_MEM_HOST_WRITE_ONLY | CL_MEM_HOST_READ_ONLY | CL_MEM_HOST_NO_ACCESS`: promises of
/// how the host will use an object, which would forbid hiber its own reads and writes.
pub const CL_MEM_HOST_ACCESS: cl_bitfield = (1 << 7) | (1 << 8) | (1 << 9);
pub const CL_MEM_FLAGS: cl_uint = 0x1101;
pub const CL_MEM_COPY_HOST_PTR: cl_bitfield = 1 << 5;
pub const CL_MEM_OBJECT_IMAGE2D: cl_uint = 0x10F1;
pub const CL_MEM_OBJECT_IMAGE3D: cl_uint = 0x10F2;
pub const CL_MEM_OBJECT_IMAGE2D_ARRAY: cl_uint = 0x10F3;
pub const CL_MEM_OBJECT_IMAGE1D: cl_uint = 0x10F4;
pub const CL_MEM_OBJECT_IMAGE1D_ARRAY: cl_uint = 0x10F5;
pub const CL_MEM_OBJECT_IMAGE1D_BUFFER: cl_uint = 0x10F6;
pub const CL_MEM_REFERENCE_COUNT: cl_uint = 0x1105;
pub const CL_MEM_CONTEXT: cl_uint = 0x1106;
pub const CL_MEM_ASSOCIATED_MEMOBJECT: cl_uint = 0x1107;
pub const CL_IMAGE_ELEMENT_SIZE: cl_uint = 0x1111;
pub const CL_IMAGE_BUFFER: cl_uint = 0x1118;
pub const CL_SAMPLER_REFERENCE_COUNT: cl_uint = 0x1150;
pub const CL_SAMPLER_CONTEXT: cl_uint = 0x1151;
pub const CL_PROGRAM_REFERENCE_COUNT: cl_uint = 0x1160;
pub const CL_PROGRAM_CONTEXT: cl_uint = 0x1161;
pub const CL_PROGRAM_DEVICES: cl_uint = 0x1163;
pub const CL_KERNEL_FUNCTION_NAME: cl_uint = 0x1190;
pub const CL_KERNEL_REFERENCE_COUNT: cl_uint = 0x1192;
pub const CL_KERNEL_CONTEXT: cl_uint = 0x1193;
pub const CL_KERNEL_PROGRAM: cl_uint = 0x1194;
pub const CL_EVENT_COMMAND_QUEUE: cl_uint = 0x11D0;
pub const CL_EVENT_COMMAND_TYPE: cl_uint = 0x11D1;
pub const CL_EVENT_REFERENCE_COUNT: cl_uint = 0x11D2;
pub const CL_EVENT_COMMAND_EXECUTION_STATUS: cl_uint = 0x11D3;
pub const CL_EVENT_CONTEXT: cl_uint = 0x11D4;
pub const CL_COMPLETE: cl_int = 0;
pub const CL_COMMAND_USER: cl_uint = 0x1204;
pub const CL_BUFFER_CREATE_TYPE_REGION: cl_uint = 0x1220;
pub const CL_TRUE: cl_bool = 1;

/// The name OpenCL's headers give an error code, for messages.
pub fn error_name(code: cl_int) -> String {
    let name = match code {
        0 => "CL_SUCCESS",
        -1 => "CL_DEVICE_NOT_FOUND",
        -2 => "CL_DEVICE_NOT_AVAILABLE",
        -3 => "CL_COMPILER_NOT_AVAILABLE",
        -4 => "CL_MEM_OBJECT_ALLOCATION_FAILURE",
        -5 => "CL_OUT_OF_RESOURCES",
        -6 => "CL_OUT_OF_HOST_MEMORY",
        -11 => "CL_BUILD_PROGRAM_FAILURE",
        -30 => "CL_INVALID_VALUE",
        -33 => "CL_INVALID_DEVICE",
        -34 => "CL_INVALID_CONTEXT",
        -36 => "CL_INVALID_COMMAND_QUEUE",
        -38 => "CL_INVALID_MEM_OBJECT",
        -39 => "CL_INVALID_IMAGE_FORMAT_DESCRIPTOR",
        -42 => "CL_INVALID_BINARY",
        -43 => "CL_INVALID_BUILD_OPTIONS",
        -44 => "CL_INVALID_PROGRAM",
        -46 => "CL_INVALID_KERNEL_NAME",
        -48 => "CL_INVALID_KERNEL",
        -59 => "CL_INVALID_OPERATION",
        -61 => "CL_INVALID_BUFFER_SIZE",
        -64 => "CL_INVALID_PROPERTY",
        -1001 => "CL_PLATFORM_NOT_FOUND_KHR",
        _ => return format!("OpenCL error {code}"),
    };
    format!("{name} ({code})")
}

macro_rules! real_table {
    ($($name:ident: fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// The ICD loader's entry points; `None` where the loader lacks one.
        pub struct Real {
            $(pub $name: Option<unsafe extern "C" fn($($arg),*) -> $ret>,)*
            /// The loader these came from; `None` for the proxy's stubs ([`crate::remote`]).
            pub(crate) _lib: Option<libloading::Library>,
        }

        impl Real {
            /// Loads the ICD loader's entry points from `libOpenCL.so.1`.
            pub fn load() -> Result<Real, String> {
                // SAFETY: loading the ICD loader runs its initializers, which take no
                // arguments from us; it is already loaded in a process that calls OpenCL.
                let lib = unsafe { libloading::Library::new("libOpenCL.so.1") }.map_err(|e| e.to_string())?;
                Ok(Real {
                    $(
                        // SAFETY: the symbol is the loader's C function of this name, whose
                        // signature the OpenCL headers give as written here.
                        $name: unsafe { lib.get::<unsafe extern "C" fn($($arg),*) -> $ret>(concat!(stringify!($name), "\0").as_bytes()) }.ok().map(|s| *s),
                    )*
                    _lib: Some(lib),
                })
            }
        }
    };
}

pub type Notify = Option<unsafe extern "C" fn(*const i8, *const c_void, usize, *mut c_void)>;
pub type ProgramNotify = Option<unsafe extern "C" fn(H, *mut c_void)>;
pub type EventNotify = Option<unsafe extern "C" fn(H, cl_int, *mut c_void)>;

real_table! {
    clGetPlatformIDs: fn(cl_uint, *mut H, *mut cl_uint) -> cl_int;
    clGetPlatformInfo: fn(H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clGetDeviceIDs: fn(H, cl_bitfield, cl_uint, *mut H, *mut cl_uint) -> cl_int;
    clGetDeviceInfo: fn(H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clCreateSubDevices: fn(H, *const isize, cl_uint, *mut H, *mut cl_uint) -> cl_int;
    clGetDeviceAndHostTimer: fn(H, *mut u64, *mut u64) -> cl_int;
    clGetHostTimer: fn(H, *mut u64) -> cl_int;
    clCreateContext: fn(*const isize, cl_uint, *const H, Notify, *mut c_void, *mut cl_int) -> H;
    clCreateContextFromType: fn(*const isize, cl_bitfield, Notify, *mut c_void, *mut cl_int) -> H;
    clReleaseContext: fn(H) -> cl_int;
    clGetContextInfo: fn(H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clCreateCommandQueue: fn(H, H, cl_bitfield, *mut cl_int) -> H;
    clCreateCommandQueueWithProperties: fn(H, H, *const u64, *mut cl_int) -> H;
    clReleaseCommandQueue: fn(H) -> cl_int;
    clRetainCommandQueue: fn(H) -> cl_int;
    clGetCommandQueueInfo: fn(H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clSetCommandQueueProperty: fn(H, cl_bitfield, cl_bool, *mut cl_bitfield) -> cl_int;
    clSetDefaultDeviceCommandQueue: fn(H, H, H) -> cl_int;
    clFlush: fn(H) -> cl_int;
    clFinish: fn(H) -> cl_int;
    clCreateBuffer: fn(H, cl_bitfield, usize, *mut c_void, *mut cl_int) -> H;
    clCreateBufferWithProperties: fn(H, *const u64, cl_bitfield, usize, *mut c_void, *mut cl_int) -> H;
    clCreateSubBuffer: fn(H, cl_bitfield, cl_uint, *const c_void, *mut cl_int) -> H;
    clCreateImage: fn(H, cl_bitfield, *const ImageFormat, *const ImageDesc, *mut c_void, *mut cl_int) -> H;
    clCreateImageWithProperties: fn(H, *const u64, cl_bitfield, *const ImageFormat, *const ImageDesc, *mut c_void, *mut cl_int) -> H;
    clCreatePipe: fn(H, cl_bitfield, cl_uint, cl_uint, *const isize, *mut cl_int) -> H;
    clReleaseMemObject: fn(H) -> cl_int;
    clSetMemObjectDestructorCallback: fn(H, ProgramNotify, *mut c_void) -> cl_int;
    clSetContextDestructorCallback: fn(H, ProgramNotify, *mut c_void) -> cl_int;
    clGetMemObjectInfo: fn(H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clGetImageInfo: fn(H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clGetPipeInfo: fn(H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clGetSupportedImageFormats: fn(H, cl_bitfield, cl_uint, cl_uint, *mut ImageFormat, *mut cl_uint) -> cl_int;
    clSVMAlloc: fn(H, cl_bitfield, usize, cl_uint) -> *mut c_void;
    clSVMFree: fn(H, *mut c_void) -> ();
    clCreateSampler: fn(H, cl_bool, cl_uint, cl_uint, *mut cl_int) -> H;
    clCreateSamplerWithProperties: fn(H, *const u64, *mut cl_int) -> H;
    clReleaseSampler: fn(H) -> cl_int;
    clGetSamplerInfo: fn(H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clCreateProgramWithSource: fn(H, cl_uint, *const *const i8, *const usize, *mut cl_int) -> H;
    clCreateProgramWithBinary: fn(H, cl_uint, *const H, *const usize, *const *const u8, *mut cl_int, *mut cl_int) -> H;
    clCreateProgramWithIL: fn(H, *const c_void, usize, *mut cl_int) -> H;
    clCreateProgramWithBuiltInKernels: fn(H, cl_uint, *const H, *const i8, *mut cl_int) -> H;
    clReleaseProgram: fn(H) -> cl_int;
    clBuildProgram: fn(H, cl_uint, *const H, *const i8, ProgramNotify, *mut c_void) -> cl_int;
    clCompileProgram: fn(H, cl_uint, *const H, *const i8, cl_uint, *const H, *const *const i8, ProgramNotify, *mut c_void) -> cl_int;
    clLinkProgram: fn(H, cl_uint, *const H, *const i8, cl_uint, *const H, ProgramNotify, *mut c_void, *mut cl_int) -> H;
    clSetProgramSpecializationConstant: fn(H, cl_uint, usize, *const c_void) -> cl_int;
    clUnloadPlatformCompiler: fn(H) -> cl_int;
    clGetProgramInfo: fn(H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clGetProgramBuildInfo: fn(H, H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clCreateKernel: fn(H, *const i8, *mut cl_int) -> H;
    clCreateKernelsInProgram: fn(H, cl_uint, *mut H, *mut cl_uint) -> cl_int;
    clCloneKernel: fn(H, *mut cl_int) -> H;
    clReleaseKernel: fn(H) -> cl_int;
    clSetKernelArg: fn(H, cl_uint, usize, *const c_void) -> cl_int;
    clSetKernelArgSVMPointer: fn(H, cl_uint, *const c_void) -> cl_int;
    clSetKernelExecInfo: fn(H, cl_uint, usize, *const c_void) -> cl_int;
    clGetKernelInfo: fn(H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clGetKernelArgInfo: fn(H, cl_uint, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clGetKernelWorkGroupInfo: fn(H, H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clGetKernelSubGroupInfo: fn(H, H, cl_uint, usize, *const c_void, usize, *mut c_void, *mut usize) -> cl_int;
    clWaitForEvents: fn(cl_uint, *const H) -> cl_int;
    clGetEventInfo: fn(H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clCreateUserEvent: fn(H, *mut cl_int) -> H;
    clReleaseEvent: fn(H) -> cl_int;
    clSetUserEventStatus: fn(H, cl_int) -> cl_int;
    clSetEventCallback: fn(H, cl_int, EventNotify, *mut c_void) -> cl_int;
    clGetEventProfilingInfo: fn(H, cl_uint, usize, *mut c_void, *mut usize) -> cl_int;
    clEnqueueReadBuffer: fn(H, H, cl_bool, usize, usize, *mut c_void, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueReadBufferRect: fn(H, H, cl_bool, *const usize, *const usize, *const usize, usize, usize, usize, usize, *mut c_void, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueWriteBuffer: fn(H, H, cl_bool, usize, usize, *const c_void, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueWriteBufferRect: fn(H, H, cl_bool, *const usize, *const usize, *const usize, usize, usize, usize, usize, *const c_void, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueFillBuffer: fn(H, H, *const c_void, usize, usize, usize, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueCopyBuffer: fn(H, H, H, usize, usize, usize, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueCopyBufferRect: fn(H, H, H, *const usize, *const usize, *const usize, usize, usize, usize, usize, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueReadImage: fn(H, H, cl_bool, *const usize, *const usize, usize, usize, *mut c_void, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueWriteImage: fn(H, H, cl_bool, *const usize, *const usize, usize, usize, *const c_void, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueFillImage: fn(H, H, *const c_void, *const usize, *const usize, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueCopyImage: fn(H, H, H, *const usize, *const usize, *const usize, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueCopyImageToBuffer: fn(H, H, H, *const usize, *const usize, usize, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueCopyBufferToImage: fn(H, H, H, usize, *const usize, *const usize, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueMapBuffer: fn(H, H, cl_bool, cl_bitfield, usize, usize, cl_uint, *const H, *mut H, *mut cl_int) -> *mut c_void;
    clEnqueueMapImage: fn(H, H, cl_bool, cl_bitfield, *const usize, *const usize, *mut usize, *mut usize, cl_uint, *const H, *mut H, *mut cl_int) -> *mut c_void;
    clEnqueueUnmapMemObject: fn(H, H, *mut c_void, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueMigrateMemObjects: fn(H, cl_uint, *const H, cl_bitfield, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueNDRangeKernel: fn(H, H, cl_uint, *const usize, *const usize, *const usize, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueTask: fn(H, H, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueMarkerWithWaitList: fn(H, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueBarrierWithWaitList: fn(H, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueMarker: fn(H, *mut H) -> cl_int;
    clEnqueueBarrier: fn(H) -> cl_int;
    clEnqueueWaitForEvents: fn(H, cl_uint, *const H) -> cl_int;
    clEnqueueSVMFree: fn(H, cl_uint, *const *mut c_void, *const c_void, *mut c_void, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueSVMMemcpy: fn(H, cl_bool, *mut c_void, *const c_void, usize, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueSVMMemFill: fn(H, *mut c_void, *const c_void, usize, usize, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueSVMMap: fn(H, cl_bool, cl_bitfield, *mut c_void, usize, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueSVMUnmap: fn(H, *mut c_void, cl_uint, *const H, *mut H) -> cl_int;
    clEnqueueSVMMigrateMem: fn(H, cl_uint, *const *const c_void, *const usize, cl_bitfield, cl_uint, *const H, *mut H) -> cl_int;
    clGetExtensionFunctionAddressForPlatform: fn(H, *const i8) -> *mut c_void;
}

/// The loader's entry points, loaded on first use; `None` where there is no ICD loader.
/// In proxy mode ([`crate::remote::enabled`]), the stubs that forward to the proxy.
pub fn real() -> Option<&'static Real> {
    static REAL: OnceLock<Option<Real>> = OnceLock::new();
    REAL.get_or_init(|| {
        let table = if crate::remote::enabled() {
            crate::remote::set_connect(crate::proxy::connect);
            Ok(crate::remote::client::table())
        } else {
            Real::load()
        };
        match table {
            Ok(r) => Some(r),
            Err(e) => {
                crate::log(&format!("cannot load the OpenCL ICD loader (libOpenCL.so.1): {e}"));
                None
            }
        }
    })
    .as_ref()
}
