//! Platforms and devices.

use super::*;

fn platform_virtual(real_p: H) -> H {
    if let Some(v) = o::virtual_of(real_p) {
        return v;
    }
    let name = crate::replay::platform_name(real_p);
    Arc::as_ptr(&o::make(Kind::Platform, real_p, Record::Platform { name })) as H
}

pub(crate) fn device_virtual(real_d: H) -> H {
    if let Some(v) = o::virtual_of(real_d) {
        return v;
    }
    let (platform_real, name, device_type) = crate::replay::device_identity(real_d);
    let platform = o::get(platform_virtual(platform_real), Kind::Platform);
    let Some(platform) = platform else { return real_d };
    let ordinal = crate::replay::ordinal_among_namesakes(platform.real(), real_d, &name);
    Arc::as_ptr(&o::make(Kind::Device, real_d, Record::Device { platform, name, device_type, ordinal })) as H
}

#[no_mangle]
pub unsafe extern "C" fn clGetPlatformIDs(num_entries: cl_uint, platforms: *mut H, num_platforms: *mut cl_uint) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetPlatformIDs, cl::CL_PLATFORM_NOT_FOUND_KHR);
    start();
    let mut n = 0;
    // SAFETY: the application's arguments, as the loader takes them; the count goes to our
    // variable first.
    let r = unsafe { f(num_entries, platforms, &mut n) };
    if r == cl::CL_SUCCESS {
        // SAFETY: the loader wrote `min(n, num_entries)` platforms.
        unsafe { list_answer(platforms, num_entries, n, num_platforms, platform_virtual) };
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn clGetPlatformInfo(platform: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetPlatformInfo, cl::CL_INVALID_PLATFORM);
    let p = tri!(real_opt(platform, Kind::Platform));
    // SAFETY: the application's arguments with the real platform.
    unsafe { f(p, param, size, value, size_ret) }
}

#[no_mangle]
pub unsafe extern "C" fn clGetDeviceIDs(platform: H, device_type: cl_bitfield, num_entries: cl_uint, devices: *mut H, num_devices: *mut cl_uint) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetDeviceIDs, cl::CL_INVALID_PLATFORM);
    start();
    let p = tri!(real_opt(platform, Kind::Platform));
    let mut n = 0;
    // SAFETY: the application's arguments with the real platform; the count goes to our
    // variable first.
    let r = unsafe { f(p, device_type, num_entries, devices, &mut n) };
    if r == cl::CL_SUCCESS {
        // SAFETY: the loader wrote `min(n, num_entries)` devices.
        unsafe { list_answer(devices, num_entries, n, num_devices, device_virtual) };
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn clGetDeviceInfo(device: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetDeviceInfo, cl::CL_INVALID_DEVICE);
    let d = tri!(real(device, Kind::Device));
    // SAFETY: the application's arguments with the real device.
    info(|s| unsafe { f(d, param, size, value, s) }, &[cl::CL_DEVICE_PLATFORM, cl::CL_DEVICE_PARENT_DEVICE], param, value, size_ret)
}

#[no_mangle]
pub unsafe extern "C" fn clCreateSubDevices(device: H, props: *const isize, n: cl_uint, out: *mut H, num: *mut cl_uint) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clCreateSubDevices, cl::CL_INVALID_DEVICE);
    let d = tri!(real(device, Kind::Device));
    o::refuse("clCreateSubDevices");
    let mut got = 0;
    // SAFETY: the application's arguments with the real device; the count to our variable.
    let r = unsafe { f(d, props, n, out, &mut got) };
    if r == cl::CL_SUCCESS {
        // SAFETY: the platform wrote `min(got, n)` devices.
        unsafe { list_answer(out, n, got, num, device_virtual) };
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn clRetainDevice(device: H) -> cl_int {
    let _pass = gate::enter();
    o::retain(device, Kind::Device)
}

#[no_mangle]
pub unsafe extern "C" fn clReleaseDevice(device: H) -> cl_int {
    let _pass = gate::enter();
    o::release(device, Kind::Device)
}

#[no_mangle]
pub unsafe extern "C" fn clGetDeviceAndHostTimer(device: H, dev_ts: *mut u64, host_ts: *mut u64) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetDeviceAndHostTimer, cl::CL_INVALID_OPERATION);
    let d = tri!(real(device, Kind::Device));
    // SAFETY: the application's arguments with the real device.
    unsafe { f(d, dev_ts, host_ts) }
}

#[no_mangle]
pub unsafe extern "C" fn clGetHostTimer(device: H, host_ts: *mut u64) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetHostTimer, cl::CL_INVALID_OPERATION);
    let d = tri!(real(device, Kind::Device));
    // SAFETY: the application's arguments with the real device.
    unsafe { f(d, host_ts) }
}
