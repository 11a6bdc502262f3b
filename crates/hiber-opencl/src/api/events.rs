//! Events.

use super::*;

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
