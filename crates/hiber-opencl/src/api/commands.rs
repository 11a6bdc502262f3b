//! Commands: everything enqueued on a command queue.

use super::*;

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
