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
//! trusts its pointers as the loader would. This module holds what they share; the entry
//! points are in its children, by the objects they work on.

#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::null_mut;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use hiber_layer::gate;

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

/// A destructor callback of a context, memory object or program: called when the
/// application's object goes, not when hiber releases the real one.
fn add_destructor(h: H, kind: Kind, f: Option<unsafe extern "C" fn(H, *mut c_void)>, user_data: *mut c_void) -> cl_int {
    let x = tri!(o::get(h, kind).ok_or(kind.invalid()));
    let Some(f) = f else { return cl::CL_INVALID_VALUE };
    x.destructors.lock().unwrap_or_else(|e| e.into_inner()).push((f, user_data as usize));
    cl::CL_SUCCESS
}

// The entry points, by the objects they work on.
mod commands;
mod contexts;
mod events;
mod extensions;
mod memory;
mod platforms;
mod programs;

use platforms::device_virtual;
