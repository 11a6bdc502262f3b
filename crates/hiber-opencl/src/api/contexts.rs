//! Contexts and command queues.

use super::*;

/// A context property list with its platform translated; the platform's object apart.
///
/// # Safety
/// `props` is null or a zero-terminated `cl_context_properties` list.
unsafe fn context_props(props: *const isize) -> Result<(Vec<isize>, Option<Arc<Obj>>), cl_int> {
    // SAFETY: the caller's contract.
    let mut list = unsafe { props_list(props) };
    let mut platform = None;
    let mut i = 0;
    while i + 1 < list.len() {
        if list[i] == cl::CL_CONTEXT_PLATFORM {
            let p = o::get(list[i + 1] as H, Kind::Platform).ok_or(cl::CL_INVALID_PLATFORM)?;
            list[i + 1] = p.real() as isize;
            platform = Some(p);
        } else if list[i] != 0 {
            // GL/EGL sharing and the like: the platform's own handles, which hiber
            // cannot re-create.
            o::refuse("context sharing properties (GL/EGL/D3D interop)");
        }
        i += 2;
    }
    Ok((list, platform))
}

fn props_ptr<T>(v: &[T]) -> *const T {
    if v.is_empty() {
        std::ptr::null()
    } else {
        v.as_ptr()
    }
}

type Notify = o::ContextNotify;

#[no_mangle]
pub unsafe extern "C" fn clCreateContext(
    props: *const isize,
    n: cl_uint,
    devices: *const H,
    notify: Notify,
    user_data: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateContext, fail(errcode_ret, cl::CL_INVALID_PLATFORM));
    start();
    // SAFETY: OpenCL's contract for the property list.
    let (list, platform) = tri!(unsafe { context_props(props) }, errcode_ret);
    // SAFETY: OpenCL's contract: `devices` holds `n` devices.
    let devs = tri!(unsafe { o::objs(devices, n, Kind::Device) }, errcode_ret);
    let reals: Vec<H> = devs.iter().map(|d| d.real()).collect();
    let mut err = 0;
    // SAFETY: the application's arguments with real devices and platform; the callback
    // takes no handles.
    let c = unsafe { f(props_ptr(&list), n, list_ptr(&reals), notify, user_data, &mut err) };
    made(c, err, errcode_ret, Kind::Context, || Record::Context { devices: devs, platform, props: list, notify, user_data: user_data as usize })
}

#[no_mangle]
pub unsafe extern "C" fn clCreateContextFromType(
    props: *const isize,
    device_type: cl_bitfield,
    notify: Notify,
    user_data: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateContextFromType, fail(errcode_ret, cl::CL_INVALID_PLATFORM));
    start();
    // SAFETY: OpenCL's contract for the property list.
    let (list, platform) = tri!(unsafe { context_props(props) }, errcode_ret);
    let mut err = 0;
    // SAFETY: the application's arguments with the real platform.
    let c = unsafe { f(props_ptr(&list), device_type, notify, user_data, &mut err) };
    if c.is_null() {
        return fail(errcode_ret, err);
    }
    // Recorded with the devices it got, so it is re-created on those (or their stand-ins).
    let devs: Vec<Arc<Obj>> = crate::replay::context_devices(c).into_iter().filter_map(|d| o::get(device_virtual(d), Kind::Device)).collect();
    made(c, err, errcode_ret, Kind::Context, || Record::Context { devices: devs, platform, props: list, notify, user_data: user_data as usize })
}

#[no_mangle]
pub unsafe extern "C" fn clRetainContext(c: H) -> cl_int {
    let _pass = gate::enter();
    o::retain(c, Kind::Context)
}

#[no_mangle]
pub unsafe extern "C" fn clReleaseContext(c: H) -> cl_int {
    let _pass = gate::enter();
    o::release(c, Kind::Context)
}

#[no_mangle]
pub unsafe extern "C" fn clGetContextInfo(c: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetContextInfo, cl::CL_INVALID_CONTEXT);
    let x = tri!(obj(c, Kind::Context));
    if param == cl::CL_CONTEXT_REFERENCE_COUNT {
        return answer(x.app_refs(), size, value, size_ret);
    }
    if param == cl::CL_CONTEXT_PROPERTIES {
        // The properties as the application gave them, with its platform handle.
        let mut list = match &*x.rec() {
            Record::Context { props, .. } => props.clone(),
            _ => Vec::new(),
        };
        if let Record::Context { platform: Some(p), .. } = &*x.rec() {
            for i in (0..list.len().saturating_sub(1)).step_by(2) {
                if list[i] == cl::CL_CONTEXT_PLATFORM {
                    list[i + 1] = p.handle() as isize;
                }
            }
        }
        return answer_slice(&list, size, value, size_ret);
    }
    // SAFETY: the application's arguments with the real context.
    info(|s| unsafe { f(x.real(), param, size, value, s) }, &[cl::CL_CONTEXT_DEVICES], param, value, size_ret)
}

#[no_mangle]
pub unsafe extern "C" fn clSetContextDestructorCallback(c: H, f: Option<unsafe extern "C" fn(H, *mut c_void)>, user_data: *mut c_void) -> cl_int {
    add_destructor(c, Kind::Context, f, user_data)
}

// Command queues

fn queue_props_of(bits: cl_bitfield) -> Vec<u64> {
    if bits == 0 {
        vec![0]
    } else {
        vec![cl::CL_QUEUE_PROPERTIES, bits, 0]
    }
}

#[no_mangle]
pub unsafe extern "C" fn clCreateCommandQueue(c: H, device: H, props: cl_bitfield, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateCommandQueue, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    let dev = tri!(obj(device, Kind::Device), errcode_ret);
    if props & cl::CL_QUEUE_ON_DEVICE != 0 {
        o::refuse("device-side queues (CL_QUEUE_ON_DEVICE)");
    }
    let mut err = 0;
    // SAFETY: the application's arguments with the real context and device.
    let q = unsafe { f(ctx.real(), dev.real(), props, &mut err) };
    made(q, err, errcode_ret, Kind::Queue, || Record::Queue { context: ctx, device: dev, props: queue_props_of(props) })
}

#[no_mangle]
pub unsafe extern "C" fn clCreateCommandQueueWithProperties(c: H, device: H, props: *const u64, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateCommandQueueWithProperties, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    let dev = tri!(obj(device, Kind::Device), errcode_ret);
    // SAFETY: OpenCL's contract for the property list.
    let list = unsafe { props_list(props) };
    if list.chunks(2).any(|kv| kv[0] == cl::CL_QUEUE_PROPERTIES && kv.get(1).is_some_and(|v| v & cl::CL_QUEUE_ON_DEVICE != 0)) {
        o::refuse("device-side queues (CL_QUEUE_ON_DEVICE)");
    }
    let mut err = 0;
    // SAFETY: the application's arguments with the real context and device.
    let q = unsafe { f(ctx.real(), dev.real(), props, &mut err) };
    made(q, err, errcode_ret, Kind::Queue, || Record::Queue { context: ctx, device: dev, props: if list.is_empty() { vec![0] } else { list } })
}

#[no_mangle]
pub unsafe extern "C" fn clRetainCommandQueue(q: H) -> cl_int {
    let _pass = gate::enter();
    o::retain(q, Kind::Queue)
}

#[no_mangle]
pub unsafe extern "C" fn clReleaseCommandQueue(q: H) -> cl_int {
    let _pass = gate::enter();
    o::release(q, Kind::Queue)
}

#[no_mangle]
pub unsafe extern "C" fn clGetCommandQueueInfo(q: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetCommandQueueInfo, cl::CL_INVALID_COMMAND_QUEUE);
    let x = tri!(obj(q, Kind::Queue));
    if param == cl::CL_QUEUE_REFERENCE_COUNT {
        return answer(x.app_refs(), size, value, size_ret);
    }
    // SAFETY: the application's arguments with the real queue.
    info(|s| unsafe { f(x.real(), param, size, value, s) }, &[cl::CL_QUEUE_CONTEXT, cl::CL_QUEUE_DEVICE, cl::CL_QUEUE_DEVICE_DEFAULT], param, value, size_ret)
}

#[no_mangle]
pub unsafe extern "C" fn clSetCommandQueueProperty(q: H, props: cl_bitfield, enable: cl_bool, old: *mut cl_bitfield) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clSetCommandQueueProperty, cl::CL_INVALID_OPERATION);
    let x = tri!(obj(q, Kind::Queue));
    o::refuse("clSetCommandQueueProperty");
    // SAFETY: the application's arguments with the real queue.
    unsafe { f(x.real(), props, enable, old) }
}

#[no_mangle]
pub unsafe extern "C" fn clSetDefaultDeviceCommandQueue(c: H, device: H, q: H) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clSetDefaultDeviceCommandQueue, cl::CL_INVALID_OPERATION);
    let (c, d, q) = (tri!(real(c, Kind::Context)), tri!(real(device, Kind::Device)), tri!(real(q, Kind::Queue)));
    o::refuse("device-side queues (clSetDefaultDeviceCommandQueue)");
    // SAFETY: the application's arguments, translated.
    unsafe { f(c, d, q) }
}

#[no_mangle]
pub unsafe extern "C" fn clFlush(q: H) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clFlush, cl::CL_INVALID_COMMAND_QUEUE);
    let q = tri!(real(q, Kind::Queue));
    // SAFETY: the real queue.
    unsafe { f(q) }
}

#[no_mangle]
pub unsafe extern "C" fn clFinish(q: H) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clFinish, cl::CL_INVALID_COMMAND_QUEUE);
    let q = tri!(real(q, Kind::Queue));
    // SAFETY: the real queue.
    unsafe { f(q) }
}
