//! GL and EGL interop, refused where it is made, and the extension entry points the layer
//! offers.

use super::contexts::clCreateCommandQueueWithProperties;
use super::programs::{clCreateProgramWithIL, clGetKernelSubGroupInfoKHR};
use super::*;

// Interop with GL and EGL: refused where it is made, naming the call (a context with GL
// sharing properties is already refused in `context_props`).

macro_rules! interop_refused {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $val:expr;)*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            $(let _ = $arg;)*
            crate::log(concat!(stringify!($name), " (GL/EGL interop) is not supported under hiber's OpenCL layer (run the job with --no-opencl)"));
            $val
        }
    )*};
}

interop_refused! {
    clCreateFromGLBuffer(c: H, flags: cl_bitfield, buf: cl_uint, errcode_ret: *mut cl_int) -> H = fail(errcode_ret, cl::CL_INVALID_OPERATION);
    clCreateFromGLTexture(c: H, flags: cl_bitfield, target: cl_uint, level: cl_int, tex: cl_uint, errcode_ret: *mut cl_int) -> H = fail(errcode_ret, cl::CL_INVALID_OPERATION);
    clCreateFromGLTexture2D(c: H, flags: cl_bitfield, target: cl_uint, level: cl_int, tex: cl_uint, errcode_ret: *mut cl_int) -> H = fail(errcode_ret, cl::CL_INVALID_OPERATION);
    clCreateFromGLTexture3D(c: H, flags: cl_bitfield, target: cl_uint, level: cl_int, tex: cl_uint, errcode_ret: *mut cl_int) -> H = fail(errcode_ret, cl::CL_INVALID_OPERATION);
    clCreateFromGLRenderbuffer(c: H, flags: cl_bitfield, rb: cl_uint, errcode_ret: *mut cl_int) -> H = fail(errcode_ret, cl::CL_INVALID_OPERATION);
    clGetGLObjectInfo(m: H, t: *mut cl_uint, name: *mut cl_uint) -> cl_int = cl::CL_INVALID_MEM_OBJECT;
    clGetGLTextureInfo(m: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int = cl::CL_INVALID_MEM_OBJECT;
    clEnqueueAcquireGLObjects(q: H, nm: cl_uint, mems: *const H, n: cl_uint, list: *const H, event: *mut H) -> cl_int = cl::CL_INVALID_OPERATION;
    clEnqueueReleaseGLObjects(q: H, nm: cl_uint, mems: *const H, n: cl_uint, list: *const H, event: *mut H) -> cl_int = cl::CL_INVALID_OPERATION;
    clGetGLContextInfoKHR(props: *const isize, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int = cl::CL_INVALID_OPERATION;
    clCreateEventFromGLsyncKHR(c: H, sync: *mut c_void, errcode_ret: *mut cl_int) -> H = fail(errcode_ret, cl::CL_INVALID_OPERATION);
    clCreateFromEGLImageKHR(c: H, display: *mut c_void, image: *mut c_void, flags: cl_bitfield, props: *const isize, errcode_ret: *mut cl_int) -> H = fail(errcode_ret, cl::CL_INVALID_OPERATION);
    clCreateEventFromEGLSyncKHR(c: H, sync: *mut c_void, display: *mut c_void, errcode_ret: *mut cl_int) -> H = fail(errcode_ret, cl::CL_INVALID_OPERATION);
    clEnqueueAcquireEGLObjectsKHR(q: H, nm: cl_uint, mems: *const H, n: cl_uint, list: *const H, event: *mut H) -> cl_int = cl::CL_INVALID_OPERATION;
    clEnqueueReleaseEGLObjectsKHR(q: H, nm: cl_uint, mems: *const H, n: cl_uint, list: *const H, event: *mut H) -> cl_int = cl::CL_INVALID_OPERATION;
    clCreateSubDevicesEXT(d: H, props: *const u64, n: cl_uint, out: *mut H, num: *mut cl_uint) -> cl_int = cl::CL_INVALID_OPERATION;
    clRetainDeviceEXT(d: H) -> cl_int = cl::CL_SUCCESS;
    clReleaseDeviceEXT(d: H) -> cl_int = cl::CL_SUCCESS;
}

// Extension entry points: those the layer implements, by name; any other would take the
// layer's handles to the platform, so it is not offered.

fn extension(name: *const c_char) -> *mut c_void {
    if name.is_null() {
        return null_mut();
    }
    // SAFETY: the name is a NUL-terminated string.
    let n = unsafe { CStr::from_ptr(name) }.to_bytes();
    let f: *mut c_void = match n {
        b"clCreateProgramWithILKHR" => clCreateProgramWithIL as *mut c_void,
        b"clGetKernelSubGroupInfoKHR" => clGetKernelSubGroupInfoKHR as *mut c_void,
        b"clCreateCommandQueueWithPropertiesKHR" => clCreateCommandQueueWithProperties as *mut c_void,
        _ => null_mut(),
    };
    if f.is_null() {
        crate::log(&format!("extension function {} is not offered under hiber's OpenCL layer", String::from_utf8_lossy(n)));
    }
    f
}

#[no_mangle]
pub unsafe extern "C" fn clGetExtensionFunctionAddress(name: *const c_char) -> *mut c_void {
    extension(name)
}

#[no_mangle]
pub unsafe extern "C" fn clGetExtensionFunctionAddressForPlatform(_platform: H, name: *const c_char) -> *mut c_void {
    extension(name)
}
