//! The OpenCL API as the application sees it: every entry point the ICD loader exports,
//! each translating virtual handles to real ones, calling the loader, and recording what
//! it made (see [`crate::objects`]).
//!
//! Every call passes the gate, so none is inside the platform while hiber checkpoints.
//! Features hiber cannot re-create (shared virtual memory, pipes, GL/EGL interop, native
//! kernels, separate compile and link, sub-devices, device-side queues) still work: they
//! are translated and passed on, and the process is marked as one hiber refuses to
//! checkpoint, naming the feature, before anything is stopped.
//!
//! These functions' safety contract is the OpenCL specification's: each is `unsafe` and
//! trusts its pointers as the loader would.

#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::null_mut;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use hiber_wire::gate;

use crate::cl::{self, cl_bitfield, cl_bool, cl_int, cl_uint, ImageDesc, ImageFormat, H};
use crate::objects::{self as o, Arg, EventNotify, Kind, Obj, ProgramSource, Record, Shape};

/// The loader's entry point `$name`, or `return $err` when there is none.
macro_rules! real_fn {
    ($name:ident, $err:expr) => {
        match cl::real().and_then(|r| r.$name) {
            Some(f) => f,
            None => return $err,
        }
    };
}

/// `Ok` value, or `return` the error code.
macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => return code,
        }
    };
    ($e:expr, $errcode_ret:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => return fail($errcode_ret, code),
        }
    };
}

/// Stores `code` where the application asked for it and returns a null handle.
fn fail<T>(errcode_ret: *mut cl_int, code: cl_int) -> *mut T {
    if !errcode_ret.is_null() {
        // SAFETY: a non-null `errcode_ret` points to a cl_int the application owns.
        unsafe { *errcode_ret = code };
    }
    null_mut()
}

fn ok_or(errcode_ret: *mut cl_int, code: cl_int) {
    if !errcode_ret.is_null() {
        // SAFETY: as in `fail`.
        unsafe { *errcode_ret = code };
    }
}

/// After a real create call: a virtual object for `real`, or the error the call gave.
fn made(real: H, err: cl_int, errcode_ret: *mut cl_int, kind: Kind, rec: impl FnOnce() -> Record) -> H {
    if real.is_null() {
        return fail(errcode_ret, if err == cl::CL_SUCCESS { cl::CL_OUT_OF_HOST_MEMORY } else { err });
    }
    ok_or(errcode_ret, cl::CL_SUCCESS);
    o::give(o::make(kind, real, rec()))
}

fn obj(h: H, kind: Kind) -> Result<Arc<Obj>, cl_int> {
    let x = o::get(h, kind).ok_or(kind.invalid())?;
    if x.real().is_null() {
        return Err(kind.invalid());
    }
    Ok(x)
}

fn real(h: H, kind: Kind) -> Result<H, cl_int> {
    o::real_of(h, kind)
}

/// A real handle that may be null (an optional argument).
fn real_opt(h: H, kind: Kind) -> Result<H, cl_int> {
    if h.is_null() {
        Ok(null_mut())
    } else {
        real(h, kind)
    }
}

/// The context an object was made in.
fn context_of(x: &Obj) -> Option<Arc<Obj>> {
    match &*x.rec() {
        Record::Queue { context, .. }
        | Record::Mem { context, .. }
        | Record::Sampler { context, .. }
        | Record::Program { context, .. }
        | Record::Event { context, .. } => Some(context.clone()),
        Record::Kernel { program, .. } => context_of(program),
        _ => None,
    }
}

/// Rewrites real handles the platform wrote into an answer as the application's.
///
/// # Safety
/// `value` holds `bytes` bytes of handles (or is null).
unsafe fn virtualize(value: *mut c_void, bytes: usize) {
    if value.is_null() {
        return;
    }
    let n = bytes / std::mem::size_of::<H>();
    // SAFETY: the caller's contract; handles are pointer-sized and the platform wrote them
    // aligned as an array of handles.
    let hs = unsafe { std::slice::from_raw_parts_mut(value as *mut H, n) };
    for h in hs {
        if let Some(v) = o::virtual_of(*h) {
            *h = v;
        }
    }
}

/// Calls a real `clGet*Info` and rewrites the handles in the answer when `param` names
/// objects.
fn info(call: impl FnOnce(*mut usize) -> cl_int, handle_params: &[cl_uint], param: cl_uint, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let mut size = 0usize;
    let r = call(&mut size);
    if r == cl::CL_SUCCESS && handle_params.contains(&param) {
        // SAFETY: the platform wrote `size` bytes of handles for these params.
        unsafe { virtualize(value, size) };
    }
    if !size_ret.is_null() {
        // SAFETY: a non-null `size_ret` points to a size_t the application owns.
        unsafe { *size_ret = size };
    }
    r
}

/// A new virtual event for a real one a call returned, where the application asked.
fn out_event(q: &Arc<Obj>, real_event: H, event: *mut H) {
    if event.is_null() || real_event.is_null() {
        return;
    }
    let context = context_of(q);
    let Some(context) = context else { return };
    let v = o::give(o::make(Kind::Event, real_event, Record::Event { context, queue: Some(q.clone()), command: 0, user: false, status: None }));
    // SAFETY: a non-null `event` points to a cl_event the application owns.
    unsafe { *event = v };
}

/// `event` for a real call: a local to receive the real event when the application asked.
fn ev_slot(event: *mut H, slot: &mut H) -> *mut H {
    if event.is_null() {
        null_mut()
    } else {
        slot
    }
}

fn waits(list: *const H, n: cl_uint) -> Result<Vec<H>, cl_int> {
    // SAFETY: OpenCL's contract for wait lists: `list` holds `n` events.
    unsafe { o::reals(list, n, Kind::Event) }.map_err(|_| cl::CL_INVALID_EVENT_WAIT_LIST)
}

fn list_ptr(v: &[H]) -> *const H {
    if v.is_empty() {
        std::ptr::null()
    } else {
        v.as_ptr()
    }
}

/// Copies a zero-terminated property list (`T` is isize or u64).
///
/// # Safety
/// `props` is null or a zero-terminated list of key/value pairs.
unsafe fn props_list<T: Copy + PartialEq + Default>(props: *const T) -> Vec<T> {
    let mut out = Vec::new();
    if props.is_null() {
        return out;
    }
    let mut i = 0;
    loop {
        // SAFETY: the caller's contract: keys up to and including the terminating zero.
        let k = unsafe { *props.add(i) };
        out.push(k);
        if k == T::default() {
            return out;
        }
        // SAFETY: every non-zero key has a value after it.
        out.push(unsafe { *props.add(i + 1) });
        i += 2;
    }
}

fn cstr_to_owned(s: *const c_char) -> CString {
    if s.is_null() {
        return CString::default();
    }
    // SAFETY: OpenCL strings are NUL-terminated.
    unsafe { CStr::from_ptr(s) }.to_owned()
}

// ---------------------------------------------------------------------------------------
// Platforms and devices

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

/// The process calls OpenCL: marks it so, and starts the control thread (once per process;
/// a child forked after its parent called OpenCL gets its own).
fn start() {
    o::registry().active = true;
    crate::control::start();
}

/// After a real call that listed objects: the application's handles in place of the real
/// ones (`min(count, room)` were written) and the count where it asked for it.
///
/// # Safety
/// `out` is null or holds `room` handles; `count_out` is null or the application's count.
unsafe fn list_answer(out: *mut H, room: cl_uint, count: cl_uint, count_out: *mut cl_uint, to_virtual: impl Fn(H) -> H) {
    if !out.is_null() {
        for i in 0..count.min(room) as usize {
            // SAFETY: the caller's contract: the platform wrote these.
            unsafe { *out.add(i) = to_virtual(*out.add(i)) };
        }
    }
    if !count_out.is_null() {
        // SAFETY: the caller's contract.
        unsafe { *count_out = count };
    }
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

// ---------------------------------------------------------------------------------------
// Contexts

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

/// Answers a `clGet*Info` with one value of our own.
fn answer<T: Copy>(v: T, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    answer_slice(std::slice::from_ref(&v), size, value, size_ret)
}

fn answer_slice<T: Copy>(v: &[T], size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let bytes = std::mem::size_of_val(v);
    if !value.is_null() {
        if size < bytes {
            return cl::CL_INVALID_VALUE;
        }
        // SAFETY: the application gave `size` ≥ `bytes` bytes at `value`.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, value as *mut u8, bytes) };
    }
    if !size_ret.is_null() {
        // SAFETY: the application's size_t.
        unsafe { *size_ret = bytes };
    }
    cl::CL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn clSetContextDestructorCallback(c: H, f: Option<unsafe extern "C" fn(H, *mut c_void)>, user_data: *mut c_void) -> cl_int {
    add_destructor(c, Kind::Context, f, user_data)
}

fn add_destructor(h: H, kind: Kind, f: Option<unsafe extern "C" fn(H, *mut c_void)>, user_data: *mut c_void) -> cl_int {
    let x = tri!(o::get(h, kind).ok_or(kind.invalid()));
    let Some(f) = f else { return cl::CL_INVALID_VALUE };
    // Called when the virtual object goes, not when hiber releases the real one.
    x.destructors.lock().unwrap_or_else(|e| e.into_inner()).push((f, user_data as usize));
    cl::CL_SUCCESS
}

// ---------------------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------------------
// Memory objects

fn host_ptr_of(flags: cl_bitfield, host_ptr: *mut c_void) -> usize {
    if flags & cl::CL_MEM_USE_HOST_PTR != 0 {
        host_ptr as usize
    } else {
        0
    }
}

#[no_mangle]
pub unsafe extern "C" fn clCreateBuffer(c: H, flags: cl_bitfield, size: usize, host_ptr: *mut c_void, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateBuffer, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    let mut err = 0;
    // SAFETY: the application's arguments with the real context.
    let m = unsafe { f(ctx.real(), flags, size, host_ptr, &mut err) };
    made(m, err, errcode_ret, Kind::Mem, || Record::Mem {
        context: ctx,
        flags,
        size,
        host_ptr: host_ptr_of(flags, host_ptr),
        props: Vec::new(),
        shape: Shape::Buffer,
    })
}

#[no_mangle]
pub unsafe extern "C" fn clCreateBufferWithProperties(
    c: H,
    props: *const u64,
    flags: cl_bitfield,
    size: usize,
    host_ptr: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateBufferWithProperties, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    // SAFETY: OpenCL's contract for the property list.
    let list = unsafe { props_list(props) };
    let mut err = 0;
    // SAFETY: the application's arguments with the real context.
    let m = unsafe { f(ctx.real(), props, flags & !cl::CL_MEM_HOST_ACCESS, size, host_ptr, &mut err) };
    made(m, err, errcode_ret, Kind::Mem, || Record::Mem {
        context: ctx,
        flags,
        size,
        host_ptr: host_ptr_of(flags, host_ptr),
        props: list,
        shape: Shape::Buffer,
    })
}

#[no_mangle]
pub unsafe extern "C" fn clCreateSubBuffer(buffer: H, flags: cl_bitfield, create_type: cl_uint, create_info: *const c_void, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateSubBuffer, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let parent = tri!(obj(buffer, Kind::Mem), errcode_ret);
    if create_type != cl::CL_BUFFER_CREATE_TYPE_REGION || create_info.is_null() {
        return fail(errcode_ret, cl::CL_INVALID_VALUE);
    }
    // SAFETY: for CL_BUFFER_CREATE_TYPE_REGION, `create_info` is a cl_buffer_region.
    let region = unsafe { *(create_info as *const cl::BufferRegion) };
    let mut err = 0;
    // SAFETY: the application's arguments with the real buffer.
    let m = unsafe { f(parent.real(), flags & !cl::CL_MEM_HOST_ACCESS, create_type, create_info, &mut err) };
    let context = match &*parent.rec() {
        Record::Mem { context, .. } => context.clone(),
        _ => return fail(errcode_ret, cl::CL_INVALID_MEM_OBJECT),
    };
    // The flags as the application gave them (what it inherits from its parent is the
    // platform's to work out, again, at replay).
    made(m, err, errcode_ret, Kind::Mem, || Record::Mem {
        context,
        flags,
        size: region.size,
        host_ptr: 0,
        props: Vec::new(),
        shape: Shape::Sub { parent: parent.clone(), origin: region.origin },
    })
}

fn image_record(
    ctx: Arc<Obj>,
    flags: cl_bitfield,
    format: *const ImageFormat,
    desc: *const ImageDesc,
    host_ptr: *mut c_void,
    props: Vec<u64>,
    real_m: H,
) -> Record {
    // SAFETY: clCreateImage succeeded, so both point to valid structures.
    let (format, mut desc) = unsafe { (*format, *desc) };
    let buffer = o::get(desc.buffer, Kind::Mem);
    desc.buffer = null_mut();
    let element = crate::replay::image_element_size(real_m);
    let size = crate::replay::image_bytes(&desc, element);
    Record::Mem { context: ctx, flags, size, host_ptr: host_ptr_of(flags, host_ptr), props, shape: Shape::Image { format, desc, buffer, element } }
}

/// `desc` with its buffer translated to the real one.
///
/// # Safety
/// `desc` is null or a valid `cl_image_desc`.
unsafe fn real_desc(desc: *const ImageDesc) -> Result<Option<ImageDesc>, cl_int> {
    if desc.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract.
    let mut d = unsafe { *desc };
    if !d.buffer.is_null() {
        d.buffer = real(d.buffer, Kind::Mem)?;
    }
    Ok(Some(d))
}

#[no_mangle]
pub unsafe extern "C" fn clCreateImage(
    c: H,
    flags: cl_bitfield,
    format: *const ImageFormat,
    desc: *const ImageDesc,
    host_ptr: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateImage, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    // SAFETY: OpenCL's contract: `desc` is null or a cl_image_desc.
    let d = tri!(unsafe { real_desc(desc) }, errcode_ret);
    let dp = d.as_ref().map_or(std::ptr::null(), |d| d as *const ImageDesc);
    let mut err = 0;
    // SAFETY: the application's arguments with the real context and buffer.
    let m = unsafe { f(ctx.real(), flags & !cl::CL_MEM_HOST_ACCESS, format, dp, host_ptr, &mut err) };
    if m.is_null() {
        return fail(errcode_ret, err);
    }
    made(m, err, errcode_ret, Kind::Mem, || image_record(ctx, flags, format, desc, host_ptr, Vec::new(), m))
}

#[no_mangle]
pub unsafe extern "C" fn clCreateImageWithProperties(
    c: H,
    props: *const u64,
    flags: cl_bitfield,
    format: *const ImageFormat,
    desc: *const ImageDesc,
    host_ptr: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateImageWithProperties, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    // SAFETY: OpenCL's contract: `desc` is null or a cl_image_desc.
    let d = tri!(unsafe { real_desc(desc) }, errcode_ret);
    let dp = d.as_ref().map_or(std::ptr::null(), |d| d as *const ImageDesc);
    // SAFETY: OpenCL's contract for the property list.
    let list = unsafe { props_list(props) };
    let mut err = 0;
    // SAFETY: the application's arguments with the real context and buffer.
    let m = unsafe { f(ctx.real(), props, flags & !cl::CL_MEM_HOST_ACCESS, format, dp, host_ptr, &mut err) };
    if m.is_null() {
        return fail(errcode_ret, err);
    }
    made(m, err, errcode_ret, Kind::Mem, || image_record(ctx, flags, format, desc, host_ptr, list, m))
}

#[no_mangle]
pub unsafe extern "C" fn clCreateImage2D(
    c: H,
    flags: cl_bitfield,
    format: *const ImageFormat,
    w: usize,
    h: usize,
    row_pitch: usize,
    host_ptr: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    let desc = ImageDesc {
        image_type: cl::CL_MEM_OBJECT_IMAGE2D,
        width: w,
        height: h,
        depth: 1,
        array_size: 1,
        row_pitch,
        slice_pitch: 0,
        num_mip_levels: 0,
        num_samples: 0,
        buffer: null_mut(),
    };
    // SAFETY: the OpenCL 1.0 call as its OpenCL 1.2 equivalent.
    unsafe { clCreateImage(c, flags, format, &desc, host_ptr, errcode_ret) }
}

#[no_mangle]
pub unsafe extern "C" fn clCreateImage3D(
    c: H,
    flags: cl_bitfield,
    format: *const ImageFormat,
    w: usize,
    h: usize,
    d: usize,
    row_pitch: usize,
    slice_pitch: usize,
    host_ptr: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    let desc = ImageDesc {
        image_type: cl::CL_MEM_OBJECT_IMAGE3D,
        width: w,
        height: h,
        depth: d,
        array_size: 1,
        row_pitch,
        slice_pitch,
        num_mip_levels: 0,
        num_samples: 0,
        buffer: null_mut(),
    };
    // SAFETY: the OpenCL 1.0 call as its OpenCL 1.2 equivalent.
    unsafe { clCreateImage(c, flags, format, &desc, host_ptr, errcode_ret) }
}

#[no_mangle]
pub unsafe extern "C" fn clCreatePipe(c: H, flags: cl_bitfield, packet: cl_uint, max: cl_uint, props: *const isize, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreatePipe, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    o::refuse("clCreatePipe");
    let mut err = 0;
    // SAFETY: the application's arguments with the real context.
    let m = unsafe { f(ctx.real(), flags, packet, max, props, &mut err) };
    made(m, err, errcode_ret, Kind::Mem, || Record::Opaque { what: "clCreatePipe" })
}

#[no_mangle]
pub unsafe extern "C" fn clRetainMemObject(m: H) -> cl_int {
    let _pass = gate::enter();
    o::retain(m, Kind::Mem)
}

#[no_mangle]
pub unsafe extern "C" fn clReleaseMemObject(m: H) -> cl_int {
    let _pass = gate::enter();
    o::release(m, Kind::Mem)
}

#[no_mangle]
pub unsafe extern "C" fn clGetMemObjectInfo(m: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetMemObjectInfo, cl::CL_INVALID_MEM_OBJECT);
    let x = tri!(obj(m, Kind::Mem));
    if param == cl::CL_MEM_REFERENCE_COUNT {
        return answer(x.app_refs(), size, value, size_ret);
    }
    if param == cl::CL_MEM_FLAGS {
        // The application's flags: the real object was made without its host-access
        // promises (see `CL_MEM_HOST_ACCESS`).
        if let Record::Mem { flags, .. } = &*x.rec() {
            return answer(*flags, size, value, size_ret);
        }
    }
    // SAFETY: the application's arguments with the real object.
    info(|s| unsafe { f(x.real(), param, size, value, s) }, &[cl::CL_MEM_CONTEXT, cl::CL_MEM_ASSOCIATED_MEMOBJECT], param, value, size_ret)
}

#[no_mangle]
pub unsafe extern "C" fn clGetImageInfo(m: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetImageInfo, cl::CL_INVALID_MEM_OBJECT);
    let x = tri!(real(m, Kind::Mem));
    // SAFETY: the application's arguments with the real image.
    info(|s| unsafe { f(x, param, size, value, s) }, &[cl::CL_IMAGE_BUFFER], param, value, size_ret)
}

#[no_mangle]
pub unsafe extern "C" fn clGetPipeInfo(m: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetPipeInfo, cl::CL_INVALID_MEM_OBJECT);
    let x = tri!(real(m, Kind::Mem));
    // SAFETY: the application's arguments with the real pipe.
    unsafe { f(x, param, size, value, size_ret) }
}

#[no_mangle]
pub unsafe extern "C" fn clSetMemObjectDestructorCallback(m: H, f: Option<unsafe extern "C" fn(H, *mut c_void)>, user_data: *mut c_void) -> cl_int {
    add_destructor(m, Kind::Mem, f, user_data)
}

#[no_mangle]
pub unsafe extern "C" fn clGetSupportedImageFormats(
    c: H,
    flags: cl_bitfield,
    image_type: cl_uint,
    n: cl_uint,
    formats: *mut ImageFormat,
    num: *mut cl_uint,
) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetSupportedImageFormats, cl::CL_INVALID_CONTEXT);
    let c = tri!(real(c, Kind::Context));
    // SAFETY: the application's arguments with the real context.
    unsafe { f(c, flags, image_type, n, formats, num) }
}

#[no_mangle]
pub unsafe extern "C" fn clSVMAlloc(c: H, flags: cl_bitfield, size: usize, alignment: cl_uint) -> *mut c_void {
    let _pass = gate::enter();
    let f = real_fn!(clSVMAlloc, null_mut());
    let Ok(c) = real(c, Kind::Context) else { return null_mut() };
    o::refuse("clSVMAlloc (shared virtual memory)");
    // SAFETY: the application's arguments with the real context.
    unsafe { f(c, flags, size, alignment) }
}

#[no_mangle]
pub unsafe extern "C" fn clSVMFree(c: H, p: *mut c_void) {
    let _pass = gate::enter();
    let Some(f) = cl::real().and_then(|r| r.clSVMFree) else { return };
    let Ok(c) = real(c, Kind::Context) else { return };
    // SAFETY: the application's arguments with the real context.
    unsafe { f(c, p) }
}

// ---------------------------------------------------------------------------------------
// Samplers

#[no_mangle]
pub unsafe extern "C" fn clCreateSampler(c: H, normalized: cl_bool, addressing: cl_uint, filter: cl_uint, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateSampler, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    let mut err = 0;
    // SAFETY: the application's arguments with the real context.
    let s = unsafe { f(ctx.real(), normalized, addressing, filter, &mut err) };
    made(s, err, errcode_ret, Kind::Sampler, || Record::Sampler {
        context: ctx,
        props: vec![0x1152, normalized as u64, 0x1153, addressing as u64, 0x1154, filter as u64, 0],
    })
}

#[no_mangle]
pub unsafe extern "C" fn clCreateSamplerWithProperties(c: H, props: *const u64, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateSamplerWithProperties, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    // SAFETY: OpenCL's contract for the property list.
    let list = unsafe { props_list(props) };
    let mut err = 0;
    // SAFETY: the application's arguments with the real context.
    let s = unsafe { f(ctx.real(), props, &mut err) };
    made(s, err, errcode_ret, Kind::Sampler, || Record::Sampler { context: ctx, props: if list.is_empty() { vec![0] } else { list } })
}

#[no_mangle]
pub unsafe extern "C" fn clRetainSampler(s: H) -> cl_int {
    let _pass = gate::enter();
    o::retain(s, Kind::Sampler)
}

#[no_mangle]
pub unsafe extern "C" fn clReleaseSampler(s: H) -> cl_int {
    let _pass = gate::enter();
    o::release(s, Kind::Sampler)
}

#[no_mangle]
pub unsafe extern "C" fn clGetSamplerInfo(s: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetSamplerInfo, cl::CL_INVALID_SAMPLER);
    let x = tri!(obj(s, Kind::Sampler));
    if param == cl::CL_SAMPLER_REFERENCE_COUNT {
        return answer(x.app_refs(), size, value, size_ret);
    }
    // SAFETY: the application's arguments with the real sampler.
    info(|sz| unsafe { f(x.real(), param, size, value, sz) }, &[cl::CL_SAMPLER_CONTEXT], param, value, size_ret)
}

// ---------------------------------------------------------------------------------------
// Programs

#[no_mangle]
pub unsafe extern "C" fn clCreateProgramWithSource(c: H, count: cl_uint, strings: *const *const c_char, lengths: *const usize, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateProgramWithSource, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    if strings.is_null() || count == 0 {
        return fail(errcode_ret, cl::CL_INVALID_VALUE);
    }
    let mut text = Vec::new();
    for i in 0..count as usize {
        // SAFETY: OpenCL's contract: `count` strings, each NUL-terminated unless its
        // length is given and non-zero.
        unsafe {
            let s = *strings.add(i);
            if s.is_null() {
                return fail(errcode_ret, cl::CL_INVALID_VALUE);
            }
            let len = if lengths.is_null() { 0 } else { *lengths.add(i) };
            if len == 0 {
                text.extend_from_slice(CStr::from_ptr(s).to_bytes());
            } else {
                text.extend_from_slice(std::slice::from_raw_parts(s as *const u8, len));
            }
        }
    }
    let mut err = 0;
    // SAFETY: the application's arguments with the real context.
    let p = unsafe { f(ctx.real(), count, strings, lengths, &mut err) };
    made(p, err, errcode_ret, Kind::Program, || Record::Program { context: ctx, source: ProgramSource::Text(text), build: None })
}

#[no_mangle]
pub unsafe extern "C" fn clCreateProgramWithIL(c: H, il: *const c_void, len: usize, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateProgramWithIL, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    if il.is_null() || len == 0 {
        return fail(errcode_ret, cl::CL_INVALID_VALUE);
    }
    // SAFETY: OpenCL's contract: `len` bytes of IL.
    let bytes = unsafe { std::slice::from_raw_parts(il as *const u8, len) }.to_vec();
    let mut err = 0;
    // SAFETY: the application's arguments with the real context.
    let p = unsafe { f(ctx.real(), il, len, &mut err) };
    made(p, err, errcode_ret, Kind::Program, || Record::Program { context: ctx, source: ProgramSource::Il(bytes), build: None })
}

#[no_mangle]
pub unsafe extern "C" fn clCreateProgramWithBinary(
    c: H,
    n: cl_uint,
    devices: *const H,
    lengths: *const usize,
    binaries: *const *const u8,
    status: *mut cl_int,
    errcode_ret: *mut cl_int,
) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateProgramWithBinary, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    // SAFETY: OpenCL's contract: `n` devices.
    let devs = tri!(unsafe { o::objs(devices, n, Kind::Device) }, errcode_ret);
    if lengths.is_null() || binaries.is_null() {
        return fail(errcode_ret, cl::CL_INVALID_VALUE);
    }
    let mut bins = Vec::new();
    for (i, d) in devs.iter().enumerate() {
        // SAFETY: OpenCL's contract: one binary of `lengths[i]` bytes per device.
        let b = unsafe {
            let p = *binaries.add(i);
            let l = *lengths.add(i);
            if p.is_null() || l == 0 {
                return fail(errcode_ret, cl::CL_INVALID_VALUE);
            }
            std::slice::from_raw_parts(p, l).to_vec()
        };
        bins.push((d.clone(), b));
    }
    let reals: Vec<H> = devs.iter().map(|d| d.real()).collect();
    let mut err = 0;
    // SAFETY: the application's arguments with the real context and devices.
    let p = unsafe { f(ctx.real(), n, list_ptr(&reals), lengths, binaries, status, &mut err) };
    made(p, err, errcode_ret, Kind::Program, || Record::Program { context: ctx, source: ProgramSource::Binary(bins), build: None })
}

#[no_mangle]
pub unsafe extern "C" fn clCreateProgramWithBuiltInKernels(c: H, n: cl_uint, devices: *const H, names: *const c_char, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateProgramWithBuiltInKernels, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(real(c, Kind::Context), errcode_ret);
    // SAFETY: OpenCL's contract: `n` devices.
    let devs = tri!(unsafe { o::reals(devices, n, Kind::Device) }, errcode_ret);
    o::refuse("clCreateProgramWithBuiltInKernels");
    let mut err = 0;
    // SAFETY: the application's arguments, translated.
    let p = unsafe { f(ctx, n, list_ptr(&devs), names, &mut err) };
    made(p, err, errcode_ret, Kind::Program, || Record::Opaque { what: "clCreateProgramWithBuiltInKernels" })
}

#[no_mangle]
pub unsafe extern "C" fn clRetainProgram(p: H) -> cl_int {
    let _pass = gate::enter();
    o::retain(p, Kind::Program)
}

#[no_mangle]
pub unsafe extern "C" fn clReleaseProgram(p: H) -> cl_int {
    let _pass = gate::enter();
    o::release(p, Kind::Program)
}

type ProgramNotify = Option<unsafe extern "C" fn(H, *mut c_void)>;

/// Builds run to completion here and the application's callback, if any, is called after
/// them with its own handle (OpenCL lets a build with a callback finish before returning).
fn notify_after(p: H, notify: ProgramNotify, user_data: *mut c_void) {
    if let Some(cb) = notify {
        // SAFETY: the application's callback, with its program handle and data.
        unsafe { cb(p, user_data) };
    }
}

#[no_mangle]
pub unsafe extern "C" fn clBuildProgram(p: H, n: cl_uint, devices: *const H, options: *const c_char, notify: ProgramNotify, user_data: *mut c_void) -> cl_int {
    let r = {
        let _pass = gate::enter();
        let f = real_fn!(clBuildProgram, cl::CL_INVALID_OPERATION);
        let prog = tri!(obj(p, Kind::Program));
        // SAFETY: OpenCL's contract: `n` devices.
        let devs = tri!(unsafe { o::objs(devices, n, Kind::Device) });
        let reals: Vec<H> = devs.iter().map(|d| d.real()).collect();
        // SAFETY: the application's arguments with the real program and devices, built
        // synchronously.
        let r = unsafe { f(prog.real(), n, list_ptr(&reals), options, None, null_mut()) };
        if r == cl::CL_SUCCESS {
            if let Record::Program { build, .. } = &mut *prog.rec() {
                *build = Some((devs, cstr_to_owned(options)));
            }
        }
        r
    };
    notify_after(p, notify, user_data);
    r
}

#[no_mangle]
pub unsafe extern "C" fn clCompileProgram(
    p: H,
    n: cl_uint,
    devices: *const H,
    options: *const c_char,
    nh: cl_uint,
    headers: *const H,
    names: *const *const c_char,
    notify: ProgramNotify,
    user_data: *mut c_void,
) -> cl_int {
    let r = {
        let _pass = gate::enter();
        let f = real_fn!(clCompileProgram, cl::CL_INVALID_OPERATION);
        let prog = tri!(real(p, Kind::Program));
        // SAFETY: OpenCL's contract: `n` devices and `nh` header programs.
        let (devs, hs) = unsafe { (tri!(o::reals(devices, n, Kind::Device)), tri!(o::reals(headers, nh, Kind::Program))) };
        o::refuse("clCompileProgram/clLinkProgram");
        // SAFETY: the application's arguments, translated, compiled synchronously.
        unsafe { f(prog, n, list_ptr(&devs), options, nh, list_ptr(&hs), names, None, null_mut()) }
    };
    notify_after(p, notify, user_data);
    r
}

#[no_mangle]
pub unsafe extern "C" fn clLinkProgram(
    c: H,
    n: cl_uint,
    devices: *const H,
    options: *const c_char,
    ni: cl_uint,
    inputs: *const H,
    notify: ProgramNotify,
    user_data: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    let p = {
        let _pass = gate::enter();
        let f = real_fn!(clLinkProgram, fail(errcode_ret, cl::CL_INVALID_OPERATION));
        let ctx = tri!(real(c, Kind::Context), errcode_ret);
        // SAFETY: OpenCL's contract: `n` devices and `ni` input programs.
        let (devs, ins) = unsafe { (tri!(o::reals(devices, n, Kind::Device), errcode_ret), tri!(o::reals(inputs, ni, Kind::Program), errcode_ret)) };
        o::refuse("clCompileProgram/clLinkProgram");
        let mut err = 0;
        // SAFETY: the application's arguments, translated, linked synchronously.
        let p = unsafe { f(ctx, n, list_ptr(&devs), options, ni, list_ptr(&ins), None, null_mut(), &mut err) };
        made(p, err, errcode_ret, Kind::Program, || Record::Opaque { what: "clLinkProgram" })
    };
    if !p.is_null() {
        notify_after(p, notify, user_data);
    }
    p
}

#[no_mangle]
pub unsafe extern "C" fn clSetProgramSpecializationConstant(p: H, id: cl_uint, size: usize, value: *const c_void) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clSetProgramSpecializationConstant, cl::CL_INVALID_OPERATION);
    let p = tri!(real(p, Kind::Program));
    o::refuse("clSetProgramSpecializationConstant");
    // SAFETY: the application's arguments with the real program.
    unsafe { f(p, id, size, value) }
}

#[no_mangle]
pub unsafe extern "C" fn clSetProgramReleaseCallback(p: H, f: Option<unsafe extern "C" fn(H, *mut c_void)>, user_data: *mut c_void) -> cl_int {
    add_destructor(p, Kind::Program, f, user_data)
}

#[no_mangle]
pub unsafe extern "C" fn clUnloadCompiler() -> cl_int {
    cl::CL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn clUnloadPlatformCompiler(platform: H) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clUnloadPlatformCompiler, cl::CL_SUCCESS);
    let p = tri!(real(platform, Kind::Platform));
    // SAFETY: the real platform.
    unsafe { f(p) }
}

#[no_mangle]
pub unsafe extern "C" fn clGetProgramInfo(p: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetProgramInfo, cl::CL_INVALID_PROGRAM);
    let x = tri!(obj(p, Kind::Program));
    if param == cl::CL_PROGRAM_REFERENCE_COUNT {
        return answer(x.app_refs(), size, value, size_ret);
    }
    // SAFETY: the application's arguments with the real program.
    info(|s| unsafe { f(x.real(), param, size, value, s) }, &[cl::CL_PROGRAM_CONTEXT, cl::CL_PROGRAM_DEVICES], param, value, size_ret)
}

#[no_mangle]
pub unsafe extern "C" fn clGetProgramBuildInfo(p: H, device: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetProgramBuildInfo, cl::CL_INVALID_PROGRAM);
    let (p, d) = (tri!(real(p, Kind::Program)), tri!(real(device, Kind::Device)));
    // SAFETY: the application's arguments with the real program and device.
    unsafe { f(p, d, param, size, value, size_ret) }
}

// ---------------------------------------------------------------------------------------
// Kernels

fn kernel_record(program: Arc<Obj>, name: CString) -> Record {
    Record::Kernel { program, name, args: Default::default() }
}

#[no_mangle]
pub unsafe extern "C" fn clCreateKernel(p: H, name: *const c_char, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateKernel, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let prog = tri!(obj(p, Kind::Program), errcode_ret);
    let mut err = 0;
    // SAFETY: the application's arguments with the real program.
    let k = unsafe { f(prog.real(), name, &mut err) };
    made(k, err, errcode_ret, Kind::Kernel, || kernel_record(prog, cstr_to_owned(name)))
}

#[no_mangle]
pub unsafe extern "C" fn clCreateKernelsInProgram(p: H, n: cl_uint, kernels: *mut H, num: *mut cl_uint) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clCreateKernelsInProgram, cl::CL_INVALID_OPERATION);
    let prog = tri!(obj(p, Kind::Program));
    let mut got = 0;
    // SAFETY: the application's arguments with the real program; the count to ours.
    let r = unsafe { f(prog.real(), n, kernels, &mut got) };
    if r == cl::CL_SUCCESS {
        let make = |k: H| o::give(o::make(Kind::Kernel, k, kernel_record(prog.clone(), crate::replay::kernel_name(k))));
        // SAFETY: the platform wrote `min(got, n)` kernels.
        unsafe { list_answer(kernels, n, got, num, make) };
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn clCloneKernel(k: H, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCloneKernel, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let src = tri!(obj(k, Kind::Kernel), errcode_ret);
    let mut err = 0;
    // SAFETY: the real kernel.
    let c = unsafe { f(src.real(), &mut err) };
    let rec = match &*src.rec() {
        Record::Kernel { program, name, args } => Record::Kernel { program: program.clone(), name: name.clone(), args: args.clone() },
        _ => return fail(errcode_ret, cl::CL_INVALID_KERNEL),
    };
    made(c, err, errcode_ret, Kind::Kernel, || rec)
}

#[no_mangle]
pub unsafe extern "C" fn clRetainKernel(k: H) -> cl_int {
    let _pass = gate::enter();
    o::retain(k, Kind::Kernel)
}

#[no_mangle]
pub unsafe extern "C" fn clReleaseKernel(k: H) -> cl_int {
    let _pass = gate::enter();
    o::release(k, Kind::Kernel)
}

#[no_mangle]
pub unsafe extern "C" fn clSetKernelArg(k: H, index: cl_uint, size: usize, value: *const c_void) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clSetKernelArg, cl::CL_INVALID_KERNEL);
    // SAFETY: the kernel is used only within this call.
    let kernel = tri!(unsafe { o::borrow(k, Kind::Kernel) });
    // A memory object or sampler is passed as a pointer to its handle: one of ours (the
    // platform gets the real one). Anything else is plain bytes, or local memory.
    let mut object = None;
    if size == std::mem::size_of::<H>() && !value.is_null() {
        // SAFETY: `value` points to `size` bytes, a handle-sized value.
        let h = unsafe { std::ptr::read_unaligned(value as *const H) };
        object = o::lookup(h, Kind::Mem).or_else(|| o::lookup(h, Kind::Sampler));
    }
    let r = match &object {
        Some(x) => {
            let real_h = x.real();
            // SAFETY: the real kernel and a pointer to the real object's handle.
            unsafe { f(kernel.real(), index, size, &real_h as *const H as *const c_void) }
        }
        // SAFETY: the application's arguments with the real kernel.
        None => unsafe { f(kernel.real(), index, size, value) },
    };
    if r == cl::CL_SUCCESS {
        // The argument replaced ends only after the record's lock and this call's use of the
        // kernel: the last reference to a memory object may run the application's destructor
        // callback, which may release the kernel.
        let _replaced = {
            let mut rec = kernel.rec();
            let Record::Kernel { args, .. } = &mut *rec else { return r };
            match (object, args.get_mut(&index)) {
                (Some(x), _) => args.insert(index, Arg::Object(x)),
                (None, _) if value.is_null() => args.insert(index, Arg::Local(size)),
                // The same argument set again (a loop counter, say): its bytes in place, no
                // allocation on the application's launch path.
                (None, Some(Arg::Bytes(old))) if old.len() == size => {
                    // SAFETY: `value` points to `size` bytes.
                    old.copy_from_slice(unsafe { std::slice::from_raw_parts(value as *const u8, size) });
                    None
                }
                // SAFETY: `value` points to `size` bytes.
                (None, _) => args.insert(index, Arg::Bytes(unsafe { std::slice::from_raw_parts(value as *const u8, size) }.to_vec())),
            }
        };
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn clSetKernelArgSVMPointer(k: H, index: cl_uint, value: *const c_void) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clSetKernelArgSVMPointer, cl::CL_INVALID_OPERATION);
    let k = tri!(real(k, Kind::Kernel));
    o::refuse("clSetKernelArgSVMPointer (shared virtual memory)");
    // SAFETY: the application's arguments with the real kernel.
    unsafe { f(k, index, value) }
}

#[no_mangle]
pub unsafe extern "C" fn clSetKernelExecInfo(k: H, param: cl_uint, size: usize, value: *const c_void) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clSetKernelExecInfo, cl::CL_INVALID_OPERATION);
    let k = tri!(real(k, Kind::Kernel));
    o::refuse("clSetKernelExecInfo (shared virtual memory)");
    // SAFETY: the application's arguments with the real kernel.
    unsafe { f(k, param, size, value) }
}

#[no_mangle]
pub unsafe extern "C" fn clGetKernelInfo(k: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetKernelInfo, cl::CL_INVALID_KERNEL);
    let x = tri!(obj(k, Kind::Kernel));
    if param == cl::CL_KERNEL_REFERENCE_COUNT {
        return answer(x.app_refs(), size, value, size_ret);
    }
    // SAFETY: the application's arguments with the real kernel.
    info(|s| unsafe { f(x.real(), param, size, value, s) }, &[cl::CL_KERNEL_CONTEXT, cl::CL_KERNEL_PROGRAM], param, value, size_ret)
}

#[no_mangle]
pub unsafe extern "C" fn clGetKernelArgInfo(k: H, index: cl_uint, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetKernelArgInfo, cl::CL_INVALID_KERNEL);
    let k = tri!(real(k, Kind::Kernel));
    // SAFETY: the application's arguments with the real kernel.
    unsafe { f(k, index, param, size, value, size_ret) }
}

#[no_mangle]
pub unsafe extern "C" fn clGetKernelWorkGroupInfo(k: H, device: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetKernelWorkGroupInfo, cl::CL_INVALID_KERNEL);
    let (k, d) = (tri!(real(k, Kind::Kernel)), tri!(real_opt(device, Kind::Device)));
    // SAFETY: the application's arguments with the real kernel and device.
    unsafe { f(k, d, param, size, value, size_ret) }
}

#[no_mangle]
pub unsafe extern "C" fn clGetKernelSubGroupInfo(
    k: H,
    device: H,
    param: cl_uint,
    in_size: usize,
    in_value: *const c_void,
    size: usize,
    value: *mut c_void,
    size_ret: *mut usize,
) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetKernelSubGroupInfo, cl::CL_INVALID_OPERATION);
    let (k, d) = (tri!(real(k, Kind::Kernel)), tri!(real_opt(device, Kind::Device)));
    // SAFETY: the application's arguments with the real kernel and device.
    unsafe { f(k, d, param, in_size, in_value, size, value, size_ret) }
}

#[no_mangle]
pub unsafe extern "C" fn clGetKernelSubGroupInfoKHR(
    k: H,
    device: H,
    param: cl_uint,
    in_size: usize,
    in_value: *const c_void,
    size: usize,
    value: *mut c_void,
    size_ret: *mut usize,
) -> cl_int {
    // SAFETY: the KHR extension's entry point is the OpenCL 2.1 core one.
    unsafe { clGetKernelSubGroupInfo(k, device, param, in_size, in_value, size, value, size_ret) }
}

// ---------------------------------------------------------------------------------------
// Events

#[no_mangle]
pub unsafe extern "C" fn clWaitForEvents(n: cl_uint, list: *const H) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clWaitForEvents, cl::CL_INVALID_EVENT);
    // SAFETY: OpenCL's contract: `n` events.
    let evs = tri!(unsafe { o::reals(list, n, Kind::Event) });
    // SAFETY: the real events.
    unsafe { f(n, list_ptr(&evs)) }
}

#[no_mangle]
pub unsafe extern "C" fn clGetEventInfo(e: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetEventInfo, cl::CL_INVALID_EVENT);
    let x = tri!(obj(e, Kind::Event));
    match param {
        cl::CL_EVENT_REFERENCE_COUNT => return answer(x.app_refs(), size, value, size_ret),
        // Answered from the record: an event re-created after a restore is a user event
        // standing in for the command it was.
        cl::CL_EVENT_COMMAND_QUEUE | cl::CL_EVENT_CONTEXT => {
            let (ctx, q) = match &*x.rec() {
                Record::Event { context, queue, .. } => (context.handle(), queue.as_ref().map_or(null_mut(), |q| q.handle())),
                _ => (null_mut(), null_mut()),
            };
            return answer(if param == cl::CL_EVENT_CONTEXT { ctx } else { q }, size, value, size_ret);
        }
        cl::CL_EVENT_COMMAND_TYPE => {
            if let Record::Event { command, .. } = &*x.rec() {
                if *command != 0 {
                    return answer(*command, size, value, size_ret);
                }
            }
        }
        _ => {}
    }
    // SAFETY: the application's arguments with the real event.
    unsafe { f(x.real(), param, size, value, size_ret) }
}

#[no_mangle]
pub unsafe extern "C" fn clCreateUserEvent(c: H, errcode_ret: *mut cl_int) -> H {
    let _pass = gate::enter();
    let f = real_fn!(clCreateUserEvent, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let ctx = tri!(obj(c, Kind::Context), errcode_ret);
    let mut err = 0;
    // SAFETY: the real context.
    let e = unsafe { f(ctx.real(), &mut err) };
    made(e, err, errcode_ret, Kind::Event, || Record::Event { context: ctx, queue: None, command: cl::CL_COMMAND_USER, user: true, status: None })
}

#[no_mangle]
pub unsafe extern "C" fn clRetainEvent(e: H) -> cl_int {
    let _pass = gate::enter();
    o::retain(e, Kind::Event)
}

#[no_mangle]
pub unsafe extern "C" fn clReleaseEvent(e: H) -> cl_int {
    let _pass = gate::enter();
    o::release(e, Kind::Event)
}

#[no_mangle]
pub unsafe extern "C" fn clSetUserEventStatus(e: H, status: cl_int) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clSetUserEventStatus, cl::CL_INVALID_EVENT);
    let x = tri!(obj(e, Kind::Event));
    // SAFETY: the real event.
    let r = unsafe { f(x.real(), status) };
    if r == cl::CL_SUCCESS {
        if let Record::Event { status: s, .. } = &mut *x.rec() {
            *s = Some(status);
        }
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn clSetEventCallback(e: H, kind: cl_int, f: Option<EventNotify>, user_data: *mut c_void) -> cl_int {
    let _pass = gate::enter();
    let x = tri!(obj(e, Kind::Event));
    let Some(f) = f else { return cl::CL_INVALID_VALUE };
    let p = o::PendingCallback { id: o::next_callback_id(), status: kind, f, data: user_data as usize };
    // Pending before the platform has it: a callback it runs at once finds itself there.
    x.callbacks.lock().unwrap_or_else(|e| e.into_inner()).push(p);
    let r = o::register_event_callback(&x, p);
    if r != cl::CL_SUCCESS {
        x.callbacks.lock().unwrap_or_else(|e| e.into_inner()).retain(|q| q.id != p.id);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn clGetEventProfilingInfo(e: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let _pass = gate::enter();
    let f = real_fn!(clGetEventProfilingInfo, cl::CL_PROFILING_INFO_NOT_AVAILABLE);
    let x = tri!(obj(e, Kind::Event));
    if matches!(&*x.rec(), Record::Event { command, .. } if *command != 0 && *command != cl::CL_COMMAND_USER) {
        // A stand-in for a command that ran before a restore: its times are gone.
        return cl::CL_PROFILING_INFO_NOT_AVAILABLE;
    }
    // SAFETY: the application's arguments with the real event.
    unsafe { f(x.real(), param, size, value, size_ret) }
}

// ---------------------------------------------------------------------------------------
// Commands

/// The common shape of every enqueue: the real queue, wait list and event slot, the call,
/// and a virtual event for the one it made. The caller has passed the gate before it
/// translates any handle (a real handle read before the gate may be released by a
/// checkpoint that closes it meanwhile).
macro_rules! enqueue {
    ($name:ident, $q:expr, $n:expr, $list:expr, $event:expr, |$f:ident, $rq:ident, $rl:ident, $re:ident| $call:expr) => {{
        let $f = real_fn!($name, cl::CL_INVALID_OPERATION);
        let $rq = tri!(real($q, Kind::Queue));
        let wl = tri!(waits($list, $n));
        let $rl = list_ptr(&wl);
        let mut slot: H = null_mut();
        let $re = ev_slot($event, &mut slot);
        let r = $call;
        if r == cl::CL_SUCCESS && !$event.is_null() {
            if let Some(q) = o::get($q, Kind::Queue) {
                out_event(&q, slot, $event);
            }
        }
        r
    }};
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueReadBuffer(
    q: H,
    b: H,
    blocking: cl_bool,
    offset: usize,
    size: usize,
    ptr: *mut c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let b = tri!(real(b, Kind::Mem));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueReadBuffer, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, b, blocking, offset, size, ptr, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueWriteBuffer(
    q: H,
    b: H,
    blocking: cl_bool,
    offset: usize,
    size: usize,
    ptr: *const c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let b = tri!(real(b, Kind::Mem));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueWriteBuffer, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, b, blocking, offset, size, ptr, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueReadBufferRect(
    q: H,
    b: H,
    blocking: cl_bool,
    bo: *const usize,
    ho: *const usize,
    region: *const usize,
    brp: usize,
    bsp: usize,
    hrp: usize,
    hsp: usize,
    ptr: *mut c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let b = tri!(real(b, Kind::Mem));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueReadBufferRect, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, b, blocking, bo, ho, region, brp, bsp, hrp, hsp, ptr, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueWriteBufferRect(
    q: H,
    b: H,
    blocking: cl_bool,
    bo: *const usize,
    ho: *const usize,
    region: *const usize,
    brp: usize,
    bsp: usize,
    hrp: usize,
    hsp: usize,
    ptr: *const c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let b = tri!(real(b, Kind::Mem));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueWriteBufferRect, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, b, blocking, bo, ho, region, brp, bsp, hrp, hsp, ptr, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueFillBuffer(
    q: H,
    b: H,
    pattern: *const c_void,
    psize: usize,
    offset: usize,
    size: usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let b = tri!(real(b, Kind::Mem));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueFillBuffer, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, b, pattern, psize, offset, size, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueCopyBuffer(q: H, src: H, dst: H, so: usize, d_o: usize, size: usize, n: cl_uint, list: *const H, event: *mut H) -> cl_int {
    let _pass = gate::enter();
    let (s, d) = (tri!(real(src, Kind::Mem)), tri!(real(dst, Kind::Mem)));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueCopyBuffer, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, s, d, so, d_o, size, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueCopyBufferRect(
    q: H,
    src: H,
    dst: H,
    so: *const usize,
    d_o: *const usize,
    region: *const usize,
    srp: usize,
    ssp: usize,
    drp: usize,
    dsp: usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let (s, d) = (tri!(real(src, Kind::Mem)), tri!(real(dst, Kind::Mem)));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueCopyBufferRect, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, s, d, so, d_o, region, srp, ssp, drp, dsp, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueReadImage(
    q: H,
    im: H,
    blocking: cl_bool,
    origin: *const usize,
    region: *const usize,
    rp: usize,
    sp: usize,
    ptr: *mut c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let im = tri!(real(im, Kind::Mem));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueReadImage, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, im, blocking, origin, region, rp, sp, ptr, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueWriteImage(
    q: H,
    im: H,
    blocking: cl_bool,
    origin: *const usize,
    region: *const usize,
    rp: usize,
    sp: usize,
    ptr: *const c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let im = tri!(real(im, Kind::Mem));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueWriteImage, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, im, blocking, origin, region, rp, sp, ptr, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueFillImage(
    q: H,
    im: H,
    color: *const c_void,
    origin: *const usize,
    region: *const usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let im = tri!(real(im, Kind::Mem));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueFillImage, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, im, color, origin, region, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueCopyImage(
    q: H,
    src: H,
    dst: H,
    so: *const usize,
    d_o: *const usize,
    region: *const usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let (s, d) = (tri!(real(src, Kind::Mem)), tri!(real(dst, Kind::Mem)));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueCopyImage, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, s, d, so, d_o, region, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueCopyImageToBuffer(
    q: H,
    src: H,
    dst: H,
    so: *const usize,
    region: *const usize,
    d_o: usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let (s, d) = (tri!(real(src, Kind::Mem)), tri!(real(dst, Kind::Mem)));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueCopyImageToBuffer, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, s, d, so, region, d_o, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueCopyBufferToImage(
    q: H,
    src: H,
    dst: H,
    so: usize,
    d_o: *const usize,
    region: *const usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let (s, d) = (tri!(real(src, Kind::Mem)), tri!(real(dst, Kind::Mem)));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueCopyBufferToImage, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, s, d, so, d_o, region, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueMapBuffer(
    q: H,
    b: H,
    blocking: cl_bool,
    flags: cl_bitfield,
    offset: usize,
    size: usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
    errcode_ret: *mut cl_int,
) -> *mut c_void {
    let _pass = gate::enter();
    let f = real_fn!(clEnqueueMapBuffer, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let qo = tri!(obj(q, Kind::Queue), errcode_ret);
    let bo = tri!(obj(b, Kind::Mem), errcode_ret);
    let wl = tri!(waits(list, n), errcode_ret);
    let mut slot: H = null_mut();
    let mut err = 0;
    // SAFETY: the application's arguments, translated.
    let p = unsafe { f(qo.real(), bo.real(), blocking, flags, offset, size, n, list_ptr(&wl), ev_slot(event, &mut slot), &mut err) };
    ok_or(errcode_ret, err);
    if !p.is_null() {
        bo.maps.fetch_add(1, Ordering::AcqRel);
        out_event(&qo, slot, event);
    }
    p
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueMapImage(
    q: H,
    im: H,
    blocking: cl_bool,
    flags: cl_bitfield,
    origin: *const usize,
    region: *const usize,
    rp: *mut usize,
    sp: *mut usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
    errcode_ret: *mut cl_int,
) -> *mut c_void {
    let _pass = gate::enter();
    let f = real_fn!(clEnqueueMapImage, fail(errcode_ret, cl::CL_INVALID_OPERATION));
    let qo = tri!(obj(q, Kind::Queue), errcode_ret);
    let io = tri!(obj(im, Kind::Mem), errcode_ret);
    let wl = tri!(waits(list, n), errcode_ret);
    let mut slot: H = null_mut();
    let mut err = 0;
    // SAFETY: the application's arguments, translated.
    let p = unsafe { f(qo.real(), io.real(), blocking, flags, origin, region, rp, sp, n, list_ptr(&wl), ev_slot(event, &mut slot), &mut err) };
    ok_or(errcode_ret, err);
    if !p.is_null() {
        io.maps.fetch_add(1, Ordering::AcqRel);
        out_event(&qo, slot, event);
    }
    p
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueUnmapMemObject(q: H, m: H, ptr: *mut c_void, n: cl_uint, list: *const H, event: *mut H) -> cl_int {
    let _pass = gate::enter();
    let mo = tri!(obj(m, Kind::Mem));
    let mr = mo.real();
    // SAFETY: the application's arguments, translated.
    let r = enqueue!(clEnqueueUnmapMemObject, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, mr, ptr, n, rl, re) });
    if r == cl::CL_SUCCESS {
        mo.maps.fetch_sub(1, Ordering::AcqRel);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueMigrateMemObjects(
    q: H,
    nm: cl_uint,
    mems: *const H,
    flags: cl_bitfield,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    // SAFETY: OpenCL's contract: `nm` memory objects.
    let ms = tri!(unsafe { o::reals(mems, nm, Kind::Mem) });
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueMigrateMemObjects, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, nm, list_ptr(&ms), flags, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueNDRangeKernel(
    q: H,
    k: H,
    dim: cl_uint,
    offset: *const usize,
    global: *const usize,
    local: *const usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    let k = tri!(real(k, Kind::Kernel));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueNDRangeKernel, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, k, dim, offset, global, local, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueTask(q: H, k: H, n: cl_uint, list: *const H, event: *mut H) -> cl_int {
    let _pass = gate::enter();
    let k = tri!(real(k, Kind::Kernel));
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueTask, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, k, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueNativeKernel(
    _q: H,
    _f: *mut c_void,
    _args: *mut c_void,
    _cb: usize,
    _nm: cl_uint,
    _mems: *const H,
    _locs: *const *const c_void,
    _n: cl_uint,
    _list: *const H,
    _event: *mut H,
) -> cl_int {
    // Its memory list points into the application's argument block, where the platform
    // writes real pointers the application would then see: not supported.
    crate::log("clEnqueueNativeKernel is not supported under hiber's OpenCL layer (run the job with --no-opencl)");
    cl::CL_INVALID_OPERATION
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueMarkerWithWaitList(q: H, n: cl_uint, list: *const H, event: *mut H) -> cl_int {
    let _pass = gate::enter();
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueMarkerWithWaitList, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueBarrierWithWaitList(q: H, n: cl_uint, list: *const H, event: *mut H) -> cl_int {
    let _pass = gate::enter();
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueBarrierWithWaitList, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueMarker(q: H, event: *mut H) -> cl_int {
    // SAFETY: the OpenCL 1.0 call as its OpenCL 1.2 equivalent.
    unsafe { clEnqueueMarkerWithWaitList(q, 0, std::ptr::null(), event) }
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueBarrier(q: H) -> cl_int {
    // SAFETY: the OpenCL 1.0 call as its OpenCL 1.2 equivalent.
    unsafe { clEnqueueBarrierWithWaitList(q, 0, std::ptr::null(), null_mut()) }
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueWaitForEvents(q: H, n: cl_uint, list: *const H) -> cl_int {
    // SAFETY: the OpenCL 1.0 call as its OpenCL 1.2 equivalent.
    unsafe { clEnqueueBarrierWithWaitList(q, n, list, null_mut()) }
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueSVMFree(
    q: H,
    np: cl_uint,
    ptrs: *const *mut c_void,
    cb: *const c_void,
    data: *mut c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    o::refuse("clSVMAlloc (shared virtual memory)");
    // SAFETY: the application's arguments, translated (the callback gets the real queue:
    // SVM is refused at checkpoint anyway).
    enqueue!(clEnqueueSVMFree, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, np, ptrs, cb, data, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueSVMMemcpy(
    q: H,
    blocking: cl_bool,
    dst: *mut c_void,
    src: *const c_void,
    size: usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    o::refuse("clSVMAlloc (shared virtual memory)");
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueSVMMemcpy, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, blocking, dst, src, size, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueSVMMemFill(
    q: H,
    ptr: *mut c_void,
    pattern: *const c_void,
    psize: usize,
    size: usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    o::refuse("clSVMAlloc (shared virtual memory)");
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueSVMMemFill, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, ptr, pattern, psize, size, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueSVMMap(
    q: H,
    blocking: cl_bool,
    flags: cl_bitfield,
    ptr: *mut c_void,
    size: usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    o::refuse("clSVMAlloc (shared virtual memory)");
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueSVMMap, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, blocking, flags, ptr, size, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueSVMUnmap(q: H, ptr: *mut c_void, n: cl_uint, list: *const H, event: *mut H) -> cl_int {
    let _pass = gate::enter();
    o::refuse("clSVMAlloc (shared virtual memory)");
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueSVMUnmap, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, ptr, n, rl, re) })
}

#[no_mangle]
pub unsafe extern "C" fn clEnqueueSVMMigrateMem(
    q: H,
    np: cl_uint,
    ptrs: *const *const c_void,
    sizes: *const usize,
    flags: cl_bitfield,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    let _pass = gate::enter();
    o::refuse("clSVMAlloc (shared virtual memory)");
    // SAFETY: the application's arguments, translated.
    enqueue!(clEnqueueSVMMigrateMem, q, n, list, event, |f, rq, rl, re| unsafe { f(rq, np, ptrs, sizes, flags, n, rl, re) })
}

// ---------------------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------------------
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
