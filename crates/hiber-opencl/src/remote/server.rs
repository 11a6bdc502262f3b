//! The proxy's side: [`Dispatcher`] decodes a request ([`super::wire`]), rebuilds its
//! arguments in the proxy's memory, calls the real ICD loader and encodes the outputs.
//!
//! One dispatcher serves one application (one connection). It keeps what outlives a
//! request: the first error of a posted call (handed back with the next call's answer),
//! the regions mapped for the application, and the callbacks' trampolines. Requests come
//! from a process this one does not trust to be well formed: every length is checked
//! against the bytes actually sent, allocations are fallible, and a malformed request is
//! answered `CL_INVALID_VALUE`.

#![allow(non_snake_case)]

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};

use super::peer;
use super::wire::{self, Layout, Op, Reader, WireError, Writer, MODE_POST};
use super::{NOTIFY_CONTEXT, NOTIFY_DESTRUCTOR, NOTIFY_EVENT};
use crate::cl::{self, cl_int, cl_uint, ImageDesc, ImageFormat, Real, H};

/// Sends a notification (see [`super::on_notify`]) to the application. Called from the
/// platform's own threads, at any time, so it must not block on the dispatcher.
pub type Notifier = Arc<dyn Fn(&[u8]) + Send + Sync>;

const CL_OUT_OF_HOST_MEMORY: cl_int = -6;
const CL_OUT_OF_RESOURCES: cl_int = -5;
const CL_INVALID_VALUE: cl_int = -30;
const CL_INVALID_IMAGE_FORMAT_DESCRIPTOR: cl_int = -39;
const CL_INVALID_WORK_DIMENSION: cl_int = -53;
const CL_TRUE: cl_uint = 1;
const CL_FALSE: cl_uint = 0;
const CL_MEM_TYPE: cl_uint = 0x1100;
const CL_MEM_SIZE: cl_uint = 0x1102;
const CL_MEM_READ_WRITE: u64 = 1;
const CL_MEM_ALLOC_HOST_PTR: u64 = 1 << 4;
const CL_MAP_READ: u64 = 1;
const CL_MAP_WRITE: u64 = 1 << 1;
/// Transfers of at least this many bytes make their context a page-locked staging
/// ([`Pinned`]); smaller ones use it only when it is there.
const PINNED_MIN: usize = 4 << 20;
const CL_PROGRAM_NUM_DEVICES: cl_uint = 0x1162;
const CL_PROGRAM_BINARY_SIZES: cl_uint = 0x1165;
const CL_PROGRAM_BINARIES: cl_uint = 0x1166;
/// The most bytes one info answer may hold.
const MAX_INFO: usize = 256 << 20;
/// The most handles one list answer may hold.
const MAX_HANDLES: u32 = 1 << 16;

/// Why an op gives no normal answer: the request was malformed, or the op fails with a
/// code before (or instead of) calling the loader.
enum Fail {
    Wire,
    Code(cl_int),
}

impl From<WireError> for Fail {
    fn from(_: WireError) -> Fail {
        Fail::Wire
    }
}

type Res = Result<(), Fail>;

/// The loader's entry point, or the op fails with `CL_INVALID_OPERATION`.
macro_rules! f {
    ($s:ident . $name:ident) => {
        $s.real.as_ref().and_then(|r| r.$name).ok_or(Fail::Code(cl::CL_INVALID_OPERATION))?
    };
}

/// A region mapped for the application: the bytes at the mapped pointer, laid out so.
#[derive(Clone, Copy)]
struct Mapped {
    layout: Layout,
}

/// What a trampoline needs to send its notification.
struct Trampoline {
    id: u64,
    notify: Notifier,
}

/// Runs one application's requests against the real loader.
pub struct Dispatcher {
    /// `None` when the loader could not be loaded: every op then fails.
    real: Option<Real>,
    deferred: AtomicI32,
    maps: Mutex<HashMap<(u64, u64), Vec<Mapped>>>,
    /// The application's pid, for bulk transfers through its memory ([`peer`]).
    peer: Option<i32>,
    /// Staging pieces of bulk transfers, kept for the next one.
    staging: Mutex<Vec<Vec<u8>>>,
    /// Page-locked staging per context (by handle), for bulk transfers the device's DMA
    /// reads and writes itself; taken out while a transfer uses it.
    pinned: Mutex<HashMap<u64, Pinned>>,
    /// Counts `clReleaseContext` calls: a transfer that saw one meanwhile does not put its
    /// context's staging back.
    context_releases: std::sync::atomic::AtomicU64,
    /// Contexts that get no page-locked staging: released by the application (staging
    /// would keep them alive), or where making it failed once.
    no_pin: Mutex<std::collections::HashSet<u64>>,
}

/// Two page-locked staging pieces of one context: `CL_MEM_ALLOC_HOST_PTR` buffers kept
/// mapped through a queue of the proxy's own. They hold a reference on their context, so
/// they are let go of before any `clReleaseContext` of the application's goes through.
struct Pinned {
    queue: H,
    mems: [H; 2],
    ptrs: [*mut u8; 2],
}

// SAFETY: the handles and mapped pointers are the platform's, usable from any thread; one
// transfer at a time holds a `Pinned` (it is taken out of the table while used).
unsafe impl Send for Pinned {}

/// A bulk transfer's staging: the context's page-locked pieces, or pageable `bufs`, and
/// where each of the two pieces starts (`pieces`, into one or the other; a Vec's bytes do
/// not move with it).
struct Bulk {
    pid: i32,
    pinned: Option<Pinned>,
    /// The count of context releases when the staging was taken (see `put_pinned`).
    releases: u64,
    bufs: [Vec<u8>; 2],
    pieces: [*mut u8; 2],
}

impl Default for Dispatcher {
    fn default() -> Dispatcher {
        Dispatcher::new()
    }
}

impl Dispatcher {
    /// A dispatcher over the loader `libOpenCL.so.1` (in the proxy, which loads the
    /// vendor's library). Without a loader (logged), every op fails with
    /// `CL_INVALID_OPERATION`.
    pub fn new() -> Dispatcher {
        let real = Real::load().map_err(|e| crate::log(&format!("proxy: cannot load the OpenCL ICD loader (libOpenCL.so.1): {e}"))).ok();
        Dispatcher {
            real,
            deferred: AtomicI32::new(0),
            maps: Mutex::default(),
            peer: None,
            staging: Mutex::default(),
            pinned: Mutex::default(),
            context_releases: Default::default(),
            no_pin: Mutex::default(),
        }
    }

    /// A dispatcher over the given entry points.
    pub fn with_real(real: Real) -> Dispatcher {
        Dispatcher {
            real: Some(real),
            deferred: AtomicI32::new(0),
            maps: Mutex::default(),
            peer: None,
            staging: Mutex::default(),
            pinned: Mutex::default(),
            context_releases: Default::default(),
            no_pin: Mutex::default(),
        }
    }

    /// The same, serving the process `pid`, whose memory bulk transfers may then read and
    /// write directly ([`peer`]) where the kernel allows it.
    pub fn with_peer(mut self, pid: i32) -> Dispatcher {
        self.peer = Some(pid);
        self
    }

    /// Handles one request and writes its answer into `answer` (cleared first): `i32
    /// deferred, i32 rc` and the op's outputs. A post's answer is for the transport to
    /// drop; its failure is kept and goes out as `deferred` of the next call that waits for
    /// the queues' work (`clFinish`, `clWaitForEvents`, a read). Callbacks the
    /// request registers send their notifications through `notify` (kept, and called later
    /// from the platform's threads). Never panics; may be called from several threads at
    /// once.
    pub fn handle(&self, req: &[u8], answer: &mut Vec<u8>, notify: Notifier) {
        let mut w = Writer { buf: std::mem::take(answer) };
        w.buf.clear();
        w.i32(0);
        let mut r = Reader::new(req);
        let (op, mode) = match (r.u16(), r.u8()) {
            (Ok(op), Ok(mode)) => (Op::from_u16(op), mode),
            _ => (None, 0),
        };
        let res = match op {
            // SAFETY: `run` rebuilds every pointer it passes the loader from bytes it has
            // checked (see the module doc); the loader's contract is the spec's.
            Some(op) => catch_unwind(AssertUnwindSafe(|| unsafe { self.run(op, &mut r, &mut w, &notify) })).unwrap_or(Err(Fail::Code(CL_OUT_OF_HOST_MEMORY))),
            None => Err(Fail::Wire),
        };
        if let Err(e) = res {
            w.buf.truncate(4);
            w.i32(match e {
                Fail::Wire => CL_INVALID_VALUE,
                Fail::Code(c) => c,
            });
        }
        let rc = i32::from_le_bytes([w.buf[4], w.buf[5], w.buf[6], w.buf[7]]);
        if mode == MODE_POST {
            if rc != cl::CL_SUCCESS {
                let _ = self.deferred.compare_exchange(0, rc, Ordering::AcqRel, Ordering::Acquire);
            }
        } else if matches!(
            op,
            Some(Op::Finish | Op::WaitForEvents | Op::EnqueueReadBuffer | Op::EnqueueReadBufferPeer | Op::EnqueueReadBufferRect | Op::EnqueueReadImage)
        ) {
            // Only the calls that wait for the queue's work take the error of a posted call
            // (and report it); any other call leaves it for them.
            let d = self.deferred.swap(0, Ordering::AcqRel);
            w.buf[..4].copy_from_slice(&d.to_le_bytes());
        }
        *answer = w.buf;
    }

    /// Decodes op's arguments, calls the loader and writes `rc` and the outputs.
    ///
    /// # Safety
    /// Calls into the loader with pointers to memory built here.
    unsafe fn run(&self, op: Op, r: &mut Reader, w: &mut Writer, notify: &Notifier) -> Res {
        use Op::*;
        // SAFETY: in every call below, the loader gets handle values from the application
        // (which it validates), and pointers only to buffers this function owns, sized
        // as the call reads or writes them.
        unsafe {
            match op {
                GetPlatformIDs => {
                    let f = f!(self.clGetPlatformIDs);
                    list(r, w, |n, out, num| f(n, out, num))
                }
                GetPlatformInfo => {
                    let f = f!(self.clGetPlatformInfo);
                    let h = r.h()?;
                    info(r, w, |p, s, v, sr| f(h, p, s, v, sr))
                }
                GetDeviceIDs => {
                    let f = f!(self.clGetDeviceIDs);
                    let (p, t) = (r.h()?, r.u64()?);
                    list(r, w, |n, out, num| f(p, t, n, out, num))
                }
                GetDeviceInfo => {
                    let f = f!(self.clGetDeviceInfo);
                    let h = r.h()?;
                    info(r, w, |p, s, v, sr| f(h, p, s, v, sr))
                }
                CreateSubDevices => {
                    let f = f!(self.clCreateSubDevices);
                    let d = r.h()?;
                    let props: Option<Vec<isize>> = props(r)?;
                    list(r, w, |n, out, num| f(d, opt_ptr(&props), n, out, num))
                }
                GetDeviceAndHostTimer => {
                    let f = f!(self.clGetDeviceAndHostTimer);
                    let (mut a, mut b) = (0u64, 0u64);
                    let rc = f(r.h()?, &mut a, &mut b);
                    w.i32(rc);
                    w.u64(a);
                    w.u64(b);
                    Ok(())
                }
                GetHostTimer => {
                    let f = f!(self.clGetHostTimer);
                    let mut a = 0u64;
                    let rc = f(r.h()?, &mut a);
                    w.i32(rc);
                    w.u64(a);
                    Ok(())
                }
                CreateContext => {
                    let f = f!(self.clCreateContext);
                    let props: Option<Vec<isize>> = props(r)?;
                    let devs = r.handles()?;
                    let (cb, data) = context_notify(r.u64()?, notify);
                    let mut err = 0;
                    let c = f(opt_ptr(&props), devs.len() as cl_uint, devs.as_ptr(), cb, data, &mut err);
                    self.context_made(c);
                    made(w, c, err)
                }
                CreateContextFromType => {
                    let f = f!(self.clCreateContextFromType);
                    let props: Option<Vec<isize>> = props(r)?;
                    let t = r.u64()?;
                    let (cb, data) = context_notify(r.u64()?, notify);
                    let mut err = 0;
                    let c = f(opt_ptr(&props), t, cb, data, &mut err);
                    self.context_made(c);
                    made(w, c, err)
                }
                ReleaseContext => {
                    let f = f!(self.clReleaseContext);
                    let c = r.h()?;
                    self.context_releases.fetch_add(1, Ordering::AcqRel);
                    // The application's last reference: the layer forwards it once no queue
                    // or buffer of the context is left either. Nothing makes staging for
                    // it again (a late transfer would keep it alive).
                    self.no_pin.lock().unwrap_or_else(|e| e.into_inner()).insert(c as u64);
                    let staged = self.pinned.lock().unwrap_or_else(|e| e.into_inner()).remove(&(c as u64));
                    if let Some(p) = staged {
                        self.unpin(p);
                    }
                    w.i32(f(c));
                    Ok(())
                }
                GetContextInfo => {
                    let f = f!(self.clGetContextInfo);
                    let h = r.h()?;
                    info(r, w, |p, s, v, sr| f(h, p, s, v, sr))
                }
                CreateCommandQueue => {
                    let f = f!(self.clCreateCommandQueue);
                    let (c, d, p) = (r.h()?, r.h()?, r.u64()?);
                    let mut err = 0;
                    made(w, f(c, d, p, &mut err), err)
                }
                CreateCommandQueueWithProperties => {
                    let f = f!(self.clCreateCommandQueueWithProperties);
                    let (c, d) = (r.h()?, r.h()?);
                    let props: Option<Vec<u64>> = props(r)?;
                    let mut err = 0;
                    made(w, f(c, d, opt_ptr(&props), &mut err), err)
                }
                ReleaseCommandQueue => simple(r, w, f!(self.clReleaseCommandQueue)),
                RetainCommandQueue => simple(r, w, f!(self.clRetainCommandQueue)),
                GetCommandQueueInfo => {
                    let f = f!(self.clGetCommandQueueInfo);
                    let h = r.h()?;
                    info(r, w, |p, s, v, sr| f(h, p, s, v, sr))
                }
                SetCommandQueueProperty => {
                    let f = f!(self.clSetCommandQueueProperty);
                    let (q, p, on) = (r.h()?, r.u64()?, r.bool()?);
                    let mut old = 0u64;
                    let rc = f(q, p, on as cl_uint, &mut old);
                    w.i32(rc);
                    w.u64(old);
                    Ok(())
                }
                SetDefaultDeviceCommandQueue => {
                    let f = f!(self.clSetDefaultDeviceCommandQueue);
                    w.i32(f(r.h()?, r.h()?, r.h()?));
                    Ok(())
                }
                Flush => simple(r, w, f!(self.clFlush)),
                Finish => simple(r, w, f!(self.clFinish)),
                CreateBuffer => {
                    let f = f!(self.clCreateBuffer);
                    let (c, flags, size) = (r.h()?, r.u64()?, r.usize()?);
                    let (flags, host) = host_data(flags, r.opt_bytes()?, Some(size))?;
                    let mut err = 0;
                    made(w, f(c, flags, size, host, &mut err), err)
                }
                CreateBufferWithProperties => {
                    let f = f!(self.clCreateBufferWithProperties);
                    let c = r.h()?;
                    let props: Option<Vec<u64>> = props(r)?;
                    let (flags, size) = (r.u64()?, r.usize()?);
                    let (flags, host) = host_data(flags, r.opt_bytes()?, Some(size))?;
                    let mut err = 0;
                    made(w, f(c, opt_ptr(&props), flags, size, host, &mut err), err)
                }
                CreateSubBuffer => {
                    let f = f!(self.clCreateSubBuffer);
                    let (b, flags, t) = (r.h()?, r.u64()?, r.u32()?);
                    let region = cl::BufferRegion { origin: r.usize()?, size: r.usize()? };
                    let mut err = 0;
                    made(w, f(b, flags, t, (&region as *const cl::BufferRegion).cast(), &mut err), err)
                }
                CreateImage => {
                    let f = f!(self.clCreateImage);
                    let c = r.h()?;
                    let (flags, fmt, desc, host) = image_args(r)?;
                    let mut err = 0;
                    made(w, f(c, flags, &fmt, &desc, host, &mut err), err)
                }
                CreateImageWithProperties => {
                    let f = f!(self.clCreateImageWithProperties);
                    let c = r.h()?;
                    let props: Option<Vec<u64>> = props(r)?;
                    let (flags, fmt, desc, host) = image_args(r)?;
                    let mut err = 0;
                    made(w, f(c, opt_ptr(&props), flags, &fmt, &desc, host, &mut err), err)
                }
                ReleaseMemObject => simple(r, w, f!(self.clReleaseMemObject)),
                SetMemObjectDestructorCallback => {
                    let f = f!(self.clSetMemObjectDestructorCallback);
                    let (h, id) = (r.h()?, r.u64()?);
                    let t = trampoline(id, notify);
                    let rc = f(h, Some(destructor_trampoline), t.cast());
                    forget_on_failure(rc, t);
                    w.i32(rc);
                    Ok(())
                }
                SetContextDestructorCallback => {
                    let f = f!(self.clSetContextDestructorCallback);
                    let (h, id) = (r.h()?, r.u64()?);
                    let t = trampoline(id, notify);
                    let rc = f(h, Some(destructor_trampoline), t.cast());
                    forget_on_failure(rc, t);
                    w.i32(rc);
                    Ok(())
                }
                GetMemObjectInfo => {
                    let f = f!(self.clGetMemObjectInfo);
                    let h = r.h()?;
                    info(r, w, |p, s, v, sr| f(h, p, s, v, sr))
                }
                GetImageInfo => {
                    let f = f!(self.clGetImageInfo);
                    let h = r.h()?;
                    info(r, w, |p, s, v, sr| f(h, p, s, v, sr))
                }
                GetSupportedImageFormats => {
                    let f = f!(self.clGetSupportedImageFormats);
                    let (c, flags, t, n, want) = (r.h()?, r.u64()?, r.u32()?, r.u32()?.min(MAX_HANDLES), r.bool()?);
                    let mut v = vec![ImageFormat::default(); if want { n as usize } else { 0 }];
                    let mut num = 0;
                    let rc = f(c, flags, t, n, if want { v.as_mut_ptr() } else { null_mut() }, &mut num);
                    w.i32(rc);
                    if rc == cl::CL_SUCCESS {
                        let k = v.len().min(num as usize);
                        w.u32(k as u32);
                        for x in &v[..k] {
                            w.u32(x.order);
                            w.u32(x.data_type);
                        }
                        w.u32(num);
                    }
                    Ok(())
                }
                CreateSampler => {
                    let f = f!(self.clCreateSampler);
                    let (c, n, a, fl) = (r.h()?, r.u32()?, r.u32()?, r.u32()?);
                    let mut err = 0;
                    made(w, f(c, n, a, fl, &mut err), err)
                }
                CreateSamplerWithProperties => {
                    let f = f!(self.clCreateSamplerWithProperties);
                    let c = r.h()?;
                    let props: Option<Vec<u64>> = props(r)?;
                    let mut err = 0;
                    made(w, f(c, opt_ptr(&props), &mut err), err)
                }
                ReleaseSampler => simple(r, w, f!(self.clReleaseSampler)),
                GetSamplerInfo => {
                    let f = f!(self.clGetSamplerInfo);
                    let h = r.h()?;
                    info(r, w, |p, s, v, sr| f(h, p, s, v, sr))
                }
                CreateProgramWithSource => {
                    let f = f!(self.clCreateProgramWithSource);
                    let c = r.h()?;
                    let srcs = byte_list(r)?;
                    let ptrs: Vec<*const i8> = srcs.iter().map(|s| s.as_ptr().cast()).collect();
                    let lens: Vec<usize> = srcs.iter().map(|s| s.len()).collect();
                    let mut err = 0;
                    made(w, f(c, ptrs.len() as cl_uint, ptrs.as_ptr(), lens.as_ptr(), &mut err), err)
                }
                CreateProgramWithBinary => {
                    let f = f!(self.clCreateProgramWithBinary);
                    let c = r.h()?;
                    let devs = r.handles()?;
                    let bins = byte_list(r)?;
                    if bins.len() != devs.len() {
                        return Err(Fail::Wire);
                    }
                    let ptrs: Vec<*const u8> = bins.iter().map(|s| s.as_ptr()).collect();
                    let lens: Vec<usize> = bins.iter().map(|s| s.len()).collect();
                    let mut status = vec![0 as cl_int; devs.len()];
                    let mut err = 0;
                    let p = f(c, devs.len() as cl_uint, devs.as_ptr(), lens.as_ptr(), ptrs.as_ptr(), status.as_mut_ptr(), &mut err);
                    w.i32(if p.is_null() && err == 0 {
                        CL_OUT_OF_HOST_MEMORY
                    } else if p.is_null() {
                        err
                    } else {
                        0
                    });
                    w.h(p);
                    w.u32(status.len() as u32);
                    status.iter().for_each(|&s| w.i32(s));
                    Ok(())
                }
                CreateProgramWithIL => {
                    let f = f!(self.clCreateProgramWithIL);
                    let (c, il) = (r.h()?, r.bytes()?);
                    let mut err = 0;
                    made(w, f(c, il.as_ptr().cast(), il.len(), &mut err), err)
                }
                CreateProgramWithBuiltInKernels => {
                    let f = f!(self.clCreateProgramWithBuiltInKernels);
                    let (c, devs, names) = (r.h()?, r.handles()?, cstring(r.bytes()?)?);
                    let mut err = 0;
                    made(w, f(c, devs.len() as cl_uint, devs.as_ptr(), names.as_ptr(), &mut err), err)
                }
                ReleaseProgram => simple(r, w, f!(self.clReleaseProgram)),
                BuildProgram => {
                    let f = f!(self.clBuildProgram);
                    let (p, devs, opts) = (r.h()?, r.handles()?, opt_cstring(r.opt_bytes()?)?);
                    w.i32(f(p, devs.len() as cl_uint, opt_list(&devs), opt_cstr(&opts), None, null_mut()));
                    Ok(())
                }
                CompileProgram => {
                    let f = f!(self.clCompileProgram);
                    let (p, devs, opts) = (r.h()?, r.handles()?, opt_cstring(r.opt_bytes()?)?);
                    let headers = r.handles()?;
                    let names = byte_list(r)?.into_iter().map(cstring).collect::<Result<Vec<_>, _>>()?;
                    if names.len() != headers.len() {
                        return Err(Fail::Wire);
                    }
                    let name_ptrs: Vec<*const i8> = names.iter().map(|n| n.as_ptr()).collect();
                    let names_ptr = if name_ptrs.is_empty() { null() } else { name_ptrs.as_ptr() };
                    let n = headers.len() as cl_uint;
                    w.i32(f(p, devs.len() as cl_uint, opt_list(&devs), opt_cstr(&opts), n, opt_list(&headers), names_ptr, None, null_mut()));
                    Ok(())
                }
                LinkProgram => {
                    let f = f!(self.clLinkProgram);
                    let (c, devs, opts, inputs) = (r.h()?, r.handles()?, opt_cstring(r.opt_bytes()?)?, r.handles()?);
                    let mut err = 0;
                    let n = inputs.len() as cl_uint;
                    made(w, f(c, devs.len() as cl_uint, opt_list(&devs), opt_cstr(&opts), n, opt_list(&inputs), None, null_mut(), &mut err), err)
                }
                SetProgramSpecializationConstant => {
                    let f = f!(self.clSetProgramSpecializationConstant);
                    let (p, id, v) = (r.h()?, r.u32()?, r.bytes()?);
                    w.i32(f(p, id, v.len(), v.as_ptr().cast()));
                    Ok(())
                }
                UnloadPlatformCompiler => simple(r, w, f!(self.clUnloadPlatformCompiler)),
                GetProgramInfo => {
                    let f = f!(self.clGetProgramInfo);
                    let h = r.h()?;
                    program_info(r, w, |p, s, v, sr| f(h, p, s, v, sr))
                }
                GetProgramBuildInfo => {
                    let f = f!(self.clGetProgramBuildInfo);
                    let (h, d) = (r.h()?, r.h()?);
                    info(r, w, |p, s, v, sr| f(h, d, p, s, v, sr))
                }
                CreateKernel => {
                    let f = f!(self.clCreateKernel);
                    let (p, name) = (r.h()?, cstring(r.bytes()?)?);
                    let mut err = 0;
                    made(w, f(p, name.as_ptr(), &mut err), err)
                }
                CreateKernelsInProgram => {
                    let f = f!(self.clCreateKernelsInProgram);
                    let p = r.h()?;
                    list(r, w, |n, out, num| f(p, n, out, num))
                }
                CloneKernel => {
                    let f = f!(self.clCloneKernel);
                    let mut err = 0;
                    made(w, f(r.h()?, &mut err), err)
                }
                ReleaseKernel => simple(r, w, f!(self.clReleaseKernel)),
                SetKernelArg => {
                    let f = f!(self.clSetKernelArg);
                    let (k, i, size, v) = (r.h()?, r.u32()?, r.usize()?, r.opt_bytes()?);
                    if v.is_some_and(|v| v.len() != size) {
                        return Err(Fail::Wire);
                    }
                    w.i32(f(k, i, size, v.map_or(null(), |v| v.as_ptr().cast())));
                    Ok(())
                }
                SetKernelExecInfo => {
                    let f = f!(self.clSetKernelExecInfo);
                    let (k, p, v) = (r.h()?, r.u32()?, r.bytes()?);
                    w.i32(f(k, p, v.len(), v.as_ptr().cast()));
                    Ok(())
                }
                GetKernelInfo => {
                    let f = f!(self.clGetKernelInfo);
                    let h = r.h()?;
                    info(r, w, |p, s, v, sr| f(h, p, s, v, sr))
                }
                GetKernelArgInfo => {
                    let f = f!(self.clGetKernelArgInfo);
                    let (h, i) = (r.h()?, r.u32()?);
                    info(r, w, |p, s, v, sr| f(h, i, p, s, v, sr))
                }
                GetKernelWorkGroupInfo => {
                    let f = f!(self.clGetKernelWorkGroupInfo);
                    let (h, d) = (r.h()?, r.h()?);
                    info(r, w, |p, s, v, sr| f(h, d, p, s, v, sr))
                }
                GetKernelSubGroupInfo => {
                    let f = f!(self.clGetKernelSubGroupInfo);
                    let (h, d, input) = (r.h()?, r.h()?, r.bytes()?);
                    info(r, w, |p, s, v, sr| f(h, d, p, input.len(), input.as_ptr().cast(), s, v, sr))
                }
                WaitForEvents => {
                    let f = f!(self.clWaitForEvents);
                    let l = r.handles()?;
                    w.i32(f(l.len() as cl_uint, opt_list(&l)));
                    Ok(())
                }
                GetEventInfo => {
                    let f = f!(self.clGetEventInfo);
                    let h = r.h()?;
                    info(r, w, |p, s, v, sr| f(h, p, s, v, sr))
                }
                CreateUserEvent => {
                    let f = f!(self.clCreateUserEvent);
                    let mut err = 0;
                    made(w, f(r.h()?, &mut err), err)
                }
                ReleaseEvent => simple(r, w, f!(self.clReleaseEvent)),
                SetUserEventStatus => {
                    let f = f!(self.clSetUserEventStatus);
                    w.i32(f(r.h()?, r.i32()?));
                    Ok(())
                }
                SetEventCallback => {
                    let f = f!(self.clSetEventCallback);
                    let (e, kind, id) = (r.h()?, r.i32()?, r.u64()?);
                    let t = trampoline(id, notify);
                    let rc = f(e, kind, Some(event_trampoline), t.cast());
                    forget_on_failure(rc, t);
                    w.i32(rc);
                    Ok(())
                }
                GetEventProfilingInfo => {
                    let f = f!(self.clGetEventProfilingInfo);
                    let h = r.h()?;
                    info(r, w, |p, s, v, sr| f(h, p, s, v, sr))
                }
                EnqueueReadBuffer => {
                    let f = f!(self.clEnqueueReadBuffer);
                    let (q, m, off, size) = (r.h()?, r.h()?, r.usize()?, r.usize()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let mut data = alloc(size)?;
                    let mut ev = null_mut();
                    let rc = f(q, m, CL_TRUE, off, size, data.as_mut_ptr().cast(), waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev));
                    read_answer(w, rc, &data, want, ev)
                }
                EnqueueReadBufferRect => {
                    let f = f!(self.clEnqueueReadBufferRect);
                    let (q, m, bo, region) = (r.h()?, r.h()?, r.triple()?, r.triple()?);
                    let (rp, sp) = (r.usize()?, r.usize()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let mut data = alloc(rect_len(region)?)?;
                    let mut ev = null_mut();
                    let ho = [0usize; 3];
                    let rc = f(
                        q,
                        m,
                        CL_TRUE,
                        bo.as_ptr(),
                        ho.as_ptr(),
                        region.as_ptr(),
                        rp,
                        sp,
                        0,
                        0,
                        data.as_mut_ptr().cast(),
                        waits.len() as cl_uint,
                        opt_list(&waits),
                        ev_ptr(want, &mut ev),
                    );
                    read_answer(w, rc, &data, want, ev)
                }
                EnqueueWriteBuffer => {
                    let f = f!(self.clEnqueueWriteBuffer);
                    let (q, m, blocking, off, data) = (r.h()?, r.h()?, r.bool()?, r.usize()?, r.bytes()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    self.write(w, data, blocking, want, |data, blocking, ev| {
                        f(q, m, blocking, off, data.len(), data.as_ptr().cast(), waits.len() as cl_uint, opt_list(&waits), ev)
                    })
                }
                PeerMemory => {
                    let (mut got, addr) = ([0u8; 16], r.u64()?);
                    match self.peer.map(|pid| peer::read(pid, addr, &mut got)) {
                        Some(Ok(())) => {
                            w.i32(cl::CL_SUCCESS);
                            w.bytes(&got);
                        }
                        Some(Err(e)) => {
                            crate::log(&format!("proxy: cannot reach the application's memory ({e}); its bulk transfers go through the channel"));
                            w.i32(cl::CL_INVALID_OPERATION);
                        }
                        None => w.i32(cl::CL_INVALID_OPERATION),
                    }
                    Ok(())
                }
                EnqueueWriteBufferPeer => {
                    let (q, m, _blocking, off, size, addr) = (r.h()?, r.h()?, r.bool()?, r.usize()?, r.usize()?, r.u64()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let rc = self.write_from_peer(q, m, off, size, addr, &waits, want)?;
                    event_answer(w, rc.0, want, rc.1)
                }
                EnqueueReadBufferPeer => {
                    let (q, m, off, size, addr) = (r.h()?, r.h()?, r.usize()?, r.usize()?, r.u64()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let rc = self.read_to_peer(q, m, off, size, addr, &waits, want)?;
                    event_answer(w, rc.0, want, rc.1)
                }
                EnqueueWriteBufferRect => {
                    let f = f!(self.clEnqueueWriteBufferRect);
                    let (q, m, blocking, bo, region) = (r.h()?, r.h()?, r.bool()?, r.triple()?, r.triple()?);
                    let (rp, sp, data) = (r.usize()?, r.usize()?, r.bytes()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    if data.len() != rect_len(region)? {
                        return Err(Fail::Wire);
                    }
                    let ho = [0usize; 3];
                    self.write(w, data, blocking, want, |data, blocking, ev| {
                        let wl = opt_list(&waits);
                        f(q, m, blocking, bo.as_ptr(), ho.as_ptr(), region.as_ptr(), rp, sp, 0, 0, data.as_ptr().cast(), waits.len() as cl_uint, wl, ev)
                    })
                }
                EnqueueFillBuffer => {
                    let f = f!(self.clEnqueueFillBuffer);
                    let (q, m, pat, off, size) = (r.h()?, r.h()?, r.bytes()?, r.usize()?, r.usize()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let mut ev = null_mut();
                    let rc = f(q, m, pat.as_ptr().cast(), pat.len(), off, size, waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueCopyBuffer => {
                    let f = f!(self.clEnqueueCopyBuffer);
                    let (q, s, d, so, dof, size) = (r.h()?, r.h()?, r.h()?, r.usize()?, r.usize()?, r.usize()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let mut ev = null_mut();
                    let rc = f(q, s, d, so, dof, size, waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueCopyBufferRect => {
                    let f = f!(self.clEnqueueCopyBufferRect);
                    let (q, s, d, so, dof, region) = (r.h()?, r.h()?, r.h()?, r.triple()?, r.triple()?, r.triple()?);
                    let (srp, ssp, drp, dsp) = (r.usize()?, r.usize()?, r.usize()?, r.usize()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let mut ev = null_mut();
                    let wl = opt_list(&waits);
                    let rc = f(q, s, d, so.as_ptr(), dof.as_ptr(), region.as_ptr(), srp, ssp, drp, dsp, waits.len() as cl_uint, wl, ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueReadImage => {
                    let f = f!(self.clEnqueueReadImage);
                    let (q, m, origin, region) = (r.h()?, r.h()?, r.triple()?, r.triple()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let layout = self.image_region(m, region, 0, 0)?;
                    let mut data = alloc(layout.packed_len().ok_or(Fail::Code(CL_INVALID_VALUE))?)?;
                    let mut ev = null_mut();
                    let wl = opt_list(&waits);
                    let rc =
                        f(q, m, CL_TRUE, origin.as_ptr(), region.as_ptr(), 0, 0, data.as_mut_ptr().cast(), waits.len() as cl_uint, wl, ev_ptr(want, &mut ev));
                    read_answer(w, rc, &data, want, ev)
                }
                EnqueueWriteImage => {
                    let f = f!(self.clEnqueueWriteImage);
                    let (q, m, blocking, origin, region, data) = (r.h()?, r.h()?, r.bool()?, r.triple()?, r.triple()?, r.bytes()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let layout = self.image_region(m, region, 0, 0)?;
                    if Some(data.len()) != layout.packed_len() {
                        return Err(Fail::Wire);
                    }
                    self.write(w, data, blocking, want, |data, blocking, ev| {
                        f(q, m, blocking, origin.as_ptr(), region.as_ptr(), 0, 0, data.as_ptr().cast(), waits.len() as cl_uint, opt_list(&waits), ev)
                    })
                }
                EnqueueFillImage => {
                    let f = f!(self.clEnqueueFillImage);
                    let (q, m, color, origin, region) = (r.h()?, r.h()?, r.bytes()?, r.triple()?, r.triple()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    // A fill colour is at most four 32-bit channels; the platform reads as
                    // many as the format has.
                    let mut c = [0u8; 16];
                    let n = color.len().min(16);
                    c[..n].copy_from_slice(&color[..n]);
                    let mut ev = null_mut();
                    let wl = opt_list(&waits);
                    let rc = f(q, m, c.as_ptr().cast(), origin.as_ptr(), region.as_ptr(), waits.len() as cl_uint, wl, ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueCopyImage => {
                    let f = f!(self.clEnqueueCopyImage);
                    let (q, s, d, so, dof, region) = (r.h()?, r.h()?, r.h()?, r.triple()?, r.triple()?, r.triple()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let mut ev = null_mut();
                    let rc = f(q, s, d, so.as_ptr(), dof.as_ptr(), region.as_ptr(), waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueCopyImageToBuffer => {
                    let f = f!(self.clEnqueueCopyImageToBuffer);
                    let (q, s, d, so, region, dof) = (r.h()?, r.h()?, r.h()?, r.triple()?, r.triple()?, r.usize()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let mut ev = null_mut();
                    let rc = f(q, s, d, so.as_ptr(), region.as_ptr(), dof, waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueCopyBufferToImage => {
                    let f = f!(self.clEnqueueCopyBufferToImage);
                    let (q, s, d, so, dof, region) = (r.h()?, r.h()?, r.h()?, r.usize()?, r.triple()?, r.triple()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let mut ev = null_mut();
                    let rc = f(q, s, d, so, dof.as_ptr(), region.as_ptr(), waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueMapBuffer => {
                    let f = f!(self.clEnqueueMapBuffer);
                    let (q, m, flags, off, size) = (r.h()?, r.h()?, r.u64()?, r.usize()?, r.usize()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let mut ev = null_mut();
                    let mut err = 0;
                    let p = f(q, m, CL_TRUE, flags, off, size, waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev), &mut err);
                    self.mapped(w, m, p, err, Layout::flat(size), None, want, ev)
                }
                EnqueueMapImage => {
                    let f = f!(self.clEnqueueMapImage);
                    let (q, m, flags, origin, region) = (r.h()?, r.h()?, r.u64()?, r.triple()?, r.triple()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let kind = self.image_kind(m)?;
                    let mut ev = null_mut();
                    let (mut err, mut rp, mut sp) = (0, 0usize, 0usize);
                    let wl = opt_list(&waits);
                    let p = f(
                        q,
                        m,
                        CL_TRUE,
                        flags,
                        origin.as_ptr(),
                        region.as_ptr(),
                        &mut rp,
                        &mut sp,
                        waits.len() as cl_uint,
                        wl,
                        ev_ptr(want, &mut ev),
                        &mut err,
                    );
                    let layout = wire::image_layout(kind.0, kind.1, region, rp, sp).ok_or(Fail::Code(CL_INVALID_VALUE))?;
                    self.mapped(w, m, p, err, layout, Some((rp, sp)), want, ev)
                }
                EnqueueUnmapMemObject => {
                    let f = f!(self.clEnqueueUnmapMemObject);
                    let (q, m, p, data) = (r.h()?, r.h()?, r.u64()?, r.opt_bytes()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let key = (m as usize as u64, p);
                    let map = {
                        let mut maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
                        maps.get_mut(&key).and_then(|v| v.pop()).ok_or(Fail::Code(CL_INVALID_VALUE))?
                    };
                    if let Some(data) = data {
                        if Some(data.len()) != map.layout.packed_len() {
                            self.remember_map(key, map);
                            return Err(Fail::Wire);
                        }
                        let len = map.layout.footprint().unwrap_or(0);
                        // SAFETY: `p` is a pointer the loader mapped for this object, over
                        // `len` bytes (its layout's footprint), and not yet unmapped.
                        let dst = std::slice::from_raw_parts_mut(p as usize as *mut u8, len);
                        map.layout.unpack(dst, data);
                    }
                    let mut ev = null_mut();
                    let rc = f(q, m, p as usize as *mut c_void, waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev));
                    if rc != cl::CL_SUCCESS {
                        self.remember_map(key, map);
                    }
                    event_answer(w, rc, want, ev)
                }
                EnqueueMigrateMemObjects => {
                    let f = f!(self.clEnqueueMigrateMemObjects);
                    let (q, mems, flags) = (r.h()?, r.handles()?, r.u64()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let mut ev = null_mut();
                    let rc = f(q, mems.len() as cl_uint, opt_list(&mems), flags, waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueNDRangeKernel => {
                    let f = f!(self.clEnqueueNDRangeKernel);
                    let (q, k, dim) = (r.h()?, r.h()?, r.u32()?);
                    let (off, global, local) = (r.opt_usizes()?, r.opt_usizes()?, r.opt_usizes()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    if [&off, &global, &local].iter().any(|a| a.as_ref().is_some_and(|a| a.len() != dim as usize)) {
                        return Err(Fail::Code(CL_INVALID_WORK_DIMENSION));
                    }
                    let mut ev = null_mut();
                    let p = |a: &Option<Vec<usize>>| a.as_ref().map_or(null(), |a| a.as_ptr());
                    let rc = f(q, k, dim, p(&off), p(&global), p(&local), waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueTask => {
                    let f = f!(self.clEnqueueTask);
                    let (q, k) = (r.h()?, r.h()?);
                    let (waits, want) = (r.handles()?, r.bool()?);
                    let mut ev = null_mut();
                    let rc = f(q, k, waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueMarkerWithWaitList => {
                    let f = f!(self.clEnqueueMarkerWithWaitList);
                    let (q, waits, want) = (r.h()?, r.handles()?, r.bool()?);
                    let mut ev = null_mut();
                    let rc = f(q, waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueBarrierWithWaitList => {
                    let f = f!(self.clEnqueueBarrierWithWaitList);
                    let (q, waits, want) = (r.h()?, r.handles()?, r.bool()?);
                    let mut ev = null_mut();
                    let rc = f(q, waits.len() as cl_uint, opt_list(&waits), ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueMarker => {
                    let f = f!(self.clEnqueueMarker);
                    let (q, want) = (r.h()?, r.bool()?);
                    let mut ev = null_mut();
                    let rc = f(q, ev_ptr(want, &mut ev));
                    event_answer(w, rc, want, ev)
                }
                EnqueueBarrier => simple(r, w, f!(self.clEnqueueBarrier)),
                EnqueueWaitForEvents => {
                    let f = f!(self.clEnqueueWaitForEvents);
                    let (q, l) = (r.h()?, r.handles()?);
                    w.i32(f(q, l.len() as cl_uint, opt_list(&l)));
                    Ok(())
                }
            }
        }
    }

    /// A write's call: blocking as asked, or non-blocking with the bytes kept alive until
    /// the platform's event for it completes (a blocking write here could wait forever on
    /// a user event the application sets only later).
    ///
    /// # Safety
    /// `call` must enqueue a write of `data` as the loader's write functions do.
    unsafe fn write(&self, w: &mut Writer, data: &[u8], blocking: bool, want: bool, call: impl FnOnce(&[u8], cl_uint, *mut H) -> cl_int) -> Res {
        let mut ev = null_mut();
        if blocking {
            let rc = call(data, CL_TRUE, ev_ptr(want, &mut ev));
            return event_answer(w, rc, want, ev);
        }
        let copy: Box<Vec<u8>> = Box::new(data.to_vec());
        let rc = call(&copy, CL_FALSE, &mut ev);
        if rc != cl::CL_SUCCESS {
            return event_answer(w, rc, want, ev);
        }
        let keep = Box::into_raw(copy);
        let set = self.real.as_ref().and_then(|r| r.clSetEventCallback).map(|f| {
            // SAFETY: `keep` is a boxed Vec the callback takes back once, at completion.
            unsafe { f(ev, cl::CL_COMPLETE, Some(free_after_write), keep.cast()) }
        });
        if set != Some(cl::CL_SUCCESS) {
            if let Some(f) = self.real.as_ref().and_then(|r| r.clWaitForEvents) {
                // SAFETY: `ev` is the write's event; waiting keeps the bytes alive until then.
                unsafe { f(1, &ev) };
            }
            // SAFETY: no callback took `keep`, so it is still ours.
            drop(unsafe { Box::from_raw(keep) });
        }
        if !want {
            if let Some(f) = self.real.as_ref().and_then(|r| r.clReleaseEvent) {
                // SAFETY: the event the write gave us, released once.
                unsafe { f(ev) };
            }
        }
        event_answer(w, rc, want, ev)
    }

    /// Two staging pieces for a bulk transfer of `size` bytes.
    fn staging(&self, size: usize) -> Result<[Vec<u8>; 2], Fail> {
        let len = size.min(peer::PIECE);
        let mut pool = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let mut take = || -> Result<Vec<u8>, Fail> {
            match pool.pop() {
                Some(mut v) => {
                    if v.len() < len {
                        v.try_reserve_exact(len - v.len()).map_err(|_| Fail::Code(CL_OUT_OF_HOST_MEMORY))?;
                        v.resize(len, 0);
                    }
                    Ok(v)
                }
                None => alloc(len),
            }
        };
        Ok([take()?, take()?])
    }

    fn give_back(&self, bufs: [Vec<u8>; 2]) {
        let mut pool = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        for b in bufs.into_iter().filter(|b| !b.is_empty()) {
            // Two transfers' worth at most stay between transfers.
            if pool.len() < 4 {
                pool.push(b);
            }
        }
    }

    /// The page-locked staging of `q`'s context, taken out of the table (made for a
    /// transfer of [`PINNED_MIN`] bytes or more when there is none), and the count of
    /// context releases to give back to [`Dispatcher::put_pinned`]. `None`: pageable
    /// staging is used.
    unsafe fn take_pinned(&self, q: H, size: usize) -> (Option<Pinned>, u64) {
        let releases = self.context_releases.load(Ordering::Acquire);
        // SAFETY: `q` as the caller says.
        let Some(ctx) = (unsafe { self.queue_context(q) }) else { return (None, releases) };
        let kept = self.pinned.lock().unwrap_or_else(|e| e.into_inner()).remove(&(ctx as u64));
        if kept.is_some() || size < PINNED_MIN || !pinning() || self.no_pin.lock().unwrap_or_else(|e| e.into_inner()).contains(&(ctx as u64)) {
            return (kept, releases);
        }
        // SAFETY: `q` and its context are live (the platform just answered for them).
        let made = unsafe { self.pin(q, ctx) };
        if made.is_none() {
            self.no_pin.lock().unwrap_or_else(|e| e.into_inner()).insert(ctx as u64);
        }
        (made, releases)
    }

    /// A context the platform just made (null: none): a handle value it used before for a
    /// context since released may have staging again.
    fn context_made(&self, c: H) {
        if !c.is_null() {
            self.no_pin.lock().unwrap_or_else(|e| e.into_inner()).remove(&(c as u64));
        }
    }

    /// Puts a context's staging back for the next transfer, unless the application released
    /// a context meanwhile (then it goes) or another transfer put one back first.
    fn put_pinned(&self, q: H, p: Option<Pinned>, releases: u64) {
        let Some(p) = p else { return };
        // SAFETY: `q` is still the application's (our transfer used it just now).
        let ctx = unsafe { self.queue_context(q) };
        let mut table = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
        let back = match ctx {
            Some(c)
                if self.context_releases.load(Ordering::Acquire) == releases
                    && !table.contains_key(&(c as u64))
                    && !self.no_pin.lock().unwrap_or_else(|e| e.into_inner()).contains(&(c as u64)) =>
            {
                table.insert(c as u64, p);
                None
            }
            _ => Some(p),
        };
        drop(table);
        if let Some(p) = back {
            self.unpin(p);
        }
    }

    unsafe fn queue_context(&self, q: H) -> Option<H> {
        let f = self.real.as_ref()?.clGetCommandQueueInfo?;
        let mut ctx: H = null_mut();
        // SAFETY: a handle-sized answer into `ctx`.
        let rc = unsafe { f(q, cl::CL_QUEUE_CONTEXT, std::mem::size_of::<H>(), (&mut ctx as *mut H).cast(), null_mut()) };
        (rc == cl::CL_SUCCESS && !ctx.is_null()).then_some(ctx)
    }

    /// Whether `[off, off + size)` lies inside buffer `m` (checked before the first piece
    /// moves, so that a transfer the platform refuses changes nothing). `true` when the size
    /// cannot be asked: the platform's own check then applies to each piece.
    unsafe fn fits(&self, m: H, off: usize, size: usize) -> bool {
        let Some(info) = self.real.as_ref().and_then(|r| r.clGetMemObjectInfo) else { return true };
        let mut len = 0usize;
        // SAFETY: a size_t-sized answer into `len`.
        if unsafe { info(m, CL_MEM_SIZE, std::mem::size_of::<usize>(), (&mut len as *mut usize).cast(), null_mut()) } != cl::CL_SUCCESS {
            return true;
        }
        off.checked_add(size).is_some_and(|end| end <= len)
    }

    /// Makes two mapped `CL_MEM_ALLOC_HOST_PTR` pieces in `ctx` (page-locked on NVIDIA's
    /// platform, so its DMA reads and writes them while the next piece is copied), through
    /// a queue of its own on `q`'s device. `None` when the platform does not.
    unsafe fn pin(&self, q: H, ctx: H) -> Option<Pinned> {
        let real = self.real.as_ref()?;
        let (info, make_queue, make) = (real.clGetCommandQueueInfo?, real.clCreateCommandQueueWithProperties?, real.clCreateBuffer?);
        let (map, release_mem, release_queue) = (real.clEnqueueMapBuffer?, real.clReleaseMemObject?, real.clReleaseCommandQueue?);
        let mut dev: H = null_mut();
        let mut err = 0;
        // SAFETY: as in `queue_context`; the rest makes and maps objects of our own, each
        // released on failure (or by `unpin`).
        unsafe {
            if info(q, cl::CL_QUEUE_DEVICE, std::mem::size_of::<H>(), (&mut dev as *mut H).cast(), null_mut()) != cl::CL_SUCCESS {
                return None;
            }
            let queue = make_queue(ctx, dev, null(), &mut err);
            if queue.is_null() {
                return None;
            }
            let mut p = Pinned { queue, mems: [null_mut(); 2], ptrs: [null_mut(); 2] };
            for i in 0..2 {
                p.mems[i] = make(ctx, CL_MEM_ALLOC_HOST_PTR | CL_MEM_READ_WRITE, peer::PIECE, null_mut(), &mut err);
                if !p.mems[i].is_null() {
                    p.ptrs[i] = map(queue, p.mems[i], CL_TRUE, CL_MAP_READ | CL_MAP_WRITE, 0, peer::PIECE, 0, null(), null_mut(), &mut err).cast();
                }
                if p.ptrs[i].is_null() {
                    for m in p.mems.into_iter().filter(|m| !m.is_null()) {
                        release_mem(m);
                    }
                    release_queue(queue);
                    crate::log(&format!("proxy: no page-locked staging for bulk transfers (error {err}); they use pageable memory"));
                    return None;
                }
            }
            Some(p)
        }
    }

    /// Unmaps and lets go of a context's staging.
    fn unpin(&self, p: Pinned) {
        let Some(real) = self.real.as_ref() else { return };
        // SAFETY: our own objects, mapped once and released once.
        unsafe {
            if let Some(unmap) = real.clEnqueueUnmapMemObject {
                for (m, ptr) in p.mems.iter().zip(p.ptrs) {
                    unmap(p.queue, *m, ptr.cast(), 0, null(), null_mut());
                }
            }
            if let Some(finish) = real.clFinish {
                finish(p.queue);
            }
            if let Some(release) = real.clReleaseMemObject {
                for m in p.mems {
                    release(m);
                }
            }
            if let Some(release) = real.clReleaseCommandQueue {
                release(p.queue);
            }
        }
    }

    /// Waits for `ev` (if any) and lets it go unless it is to be kept; the wait's code.
    unsafe fn settle(&self, ev: &mut H, keep: bool) -> cl_int {
        if ev.is_null() {
            return cl::CL_SUCCESS;
        }
        let real = self.real.as_ref();
        // SAFETY: `ev` is an event a write or read of ours gave; waited on and released once.
        let rc = real.and_then(|r| r.clWaitForEvents).map_or(cl::CL_INVALID_OPERATION, |f| unsafe { f(1, ev) });
        if !keep {
            if let Some(f) = real.and_then(|r| r.clReleaseEvent) {
                // SAFETY: as above.
                unsafe { f(*ev) };
            }
            *ev = null_mut();
        }
        rc
    }

    /// What a bulk transfer of `size` bytes at `off` of `m`, on `q`, moves through; `Err`
    /// with the code to answer when it is refused before anything moves.
    unsafe fn bulk(&self, q: H, m: H, off: usize, size: usize) -> Result<Result<Bulk, cl_int>, Fail> {
        let pid = self.peer.ok_or(Fail::Code(cl::CL_INVALID_OPERATION))?;
        // SAFETY: `m` is the application's (the platform validates it).
        if size == 0 || !unsafe { self.fits(m, off, size) } {
            return Ok(Err(CL_INVALID_VALUE));
        }
        // SAFETY: `q` is the application's queue (the platform validates it).
        let (pinned, releases) = unsafe { self.take_pinned(q, size) };
        let mut bufs: [Vec<u8>; 2] = if pinned.is_some() { Default::default() } else { self.staging(size)? };
        let pieces = match &pinned {
            Some(p) => p.ptrs,
            None => [bufs[0].as_mut_ptr(), bufs[1].as_mut_ptr()],
        };
        Ok(Ok(Bulk { pid, pinned, releases, bufs, pieces }))
    }

    /// Gives a finished transfer's staging back (every piece's device copy settled).
    fn end_bulk(&self, q: H, b: Bulk) {
        self.give_back(b.bufs);
        self.put_pinned(q, b.pinned, b.releases);
    }

    /// `clEnqueueWriteBuffer` of `size` bytes at the application's `addr`, read from its
    /// memory piece by piece: a piece is read while the one before it is written to the
    /// device. Ends when every piece is on the device; `(rc, event)` (the last piece's, kept
    /// when `want`).
    #[allow(clippy::too_many_arguments)]
    unsafe fn write_from_peer(&self, q: H, m: H, off: usize, size: usize, addr: u64, waits: &[H], want: bool) -> Result<(cl_int, H), Fail> {
        let f = f!(self.clEnqueueWriteBuffer);
        // SAFETY: `q` and `m` are the application's (the platform validates them).
        let bulk = match unsafe { self.bulk(q, m, off, size)? } {
            Ok(b) => b,
            Err(rc) => return Ok((rc, null_mut())),
        };
        let (pid, pieces) = (bulk.pid, bulk.pieces);
        let mut pending = [null_mut(); 2];
        let (mut rc, mut done, mut k) = (cl::CL_SUCCESS, 0usize, 0usize);
        while done < size {
            let (slot, len) = (k % 2, (size - done).min(peer::PIECE));
            // SAFETY: this slot's earlier write, if any.
            rc = unsafe { self.settle(&mut pending[slot], false) };
            if rc != cl::CL_SUCCESS {
                break;
            }
            // SAFETY: the piece is `PIECE` (or the pageable buffer's) bytes of ours, and no
            // write of ours reads it now (settled above).
            let piece = unsafe { std::slice::from_raw_parts_mut(pieces[slot], len) };
            if let Err(e) = peer::read(pid, addr + done as u64, piece) {
                rc = peer_failed(&e);
                break;
            }
            // SAFETY: the piece stays untouched until its event completes (settled before
            // the slot is used again, and before the buffers go back).
            rc = unsafe { f(q, m, CL_FALSE, off + done, len, pieces[slot].cast(), waits.len() as cl_uint, opt_list(waits), &mut pending[slot]) };
            if rc != cl::CL_SUCCESS {
                break;
            }
            done += len;
            k += 1;
        }
        let last = (k + 1) % 2;
        let keep = rc == cl::CL_SUCCESS && want;
        for slot in [1 - last, last] {
            // SAFETY: our own events, each settled once.
            let r = unsafe { self.settle(&mut pending[slot], keep && slot == last) };
            if rc == cl::CL_SUCCESS {
                rc = r;
            }
        }
        self.end_bulk(q, bulk);
        Ok((rc, if keep { pending[last] } else { null_mut() }))
    }

    /// `clEnqueueReadBuffer` of `size` bytes into the application's memory at `addr`, piece
    /// by piece: a piece is copied to the application while the next is read from the
    /// device. `(rc, event)` as [`Dispatcher::write_from_peer`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn read_to_peer(&self, q: H, m: H, off: usize, size: usize, addr: u64, waits: &[H], want: bool) -> Result<(cl_int, H), Fail> {
        let f = f!(self.clEnqueueReadBuffer);
        // SAFETY: as in `write_from_peer`.
        let bulk = match unsafe { self.bulk(q, m, off, size)? } {
            Ok(b) => b,
            Err(rc) => return Ok((rc, null_mut())),
        };
        let (pid, pieces) = (bulk.pid, bulk.pieces);
        let mut pending = [null_mut(); 2];
        let mut piece: [(usize, usize); 2] = [(0, 0); 2];
        let (mut rc, mut done, mut k) = (cl::CL_SUCCESS, 0usize, 0usize);
        let (mut prev, mut kept): (Option<usize>, H) = (None, null_mut());
        loop {
            let mut started = None;
            if done < size && rc == cl::CL_SUCCESS {
                let (slot, len) = (k % 2, (size - done).min(peer::PIECE));
                piece[slot] = (done, len);
                // SAFETY: the slot's earlier piece was copied out (below) before it is read
                // into again, and every read is settled before the buffers go back.
                rc = unsafe { f(q, m, CL_FALSE, off + done, len, pieces[slot].cast(), waits.len() as cl_uint, opt_list(waits), &mut pending[slot]) };
                if rc == cl::CL_SUCCESS {
                    (done, k, started) = (done + len, k + 1, Some(slot));
                }
            }
            // The piece before the one just started: wait for it and copy it out.
            if let Some(p) = prev {
                let keep = want && started.is_none() && rc == cl::CL_SUCCESS && done == size;
                // SAFETY: our own event, settled once.
                let r = unsafe { self.settle(&mut pending[p], keep) };
                if rc == cl::CL_SUCCESS {
                    rc = r;
                }
                if rc == cl::CL_SUCCESS {
                    let (at, len) = piece[p];
                    // SAFETY: the piece the read just completed into (settled above).
                    let bytes = unsafe { std::slice::from_raw_parts(pieces[p], len) };
                    if let Err(e) = peer::write(pid, addr + at as u64, bytes) {
                        rc = peer_failed(&e);
                    }
                }
                if keep && rc == cl::CL_SUCCESS {
                    kept = std::mem::replace(&mut pending[p], null_mut());
                }
            }
            prev = started;
            if prev.is_none() {
                break;
            }
        }
        // Nothing of ours may still be reading into the staging when it goes back.
        for ev in &mut pending {
            // SAFETY: as above.
            unsafe { self.settle(ev, false) };
        }
        self.end_bulk(q, bulk);
        Ok((rc, kept))
    }

    /// Answers a map: `rc, u64 pointer, packed bytes, [event], [row pitch, slice pitch]`,
    /// and remembers the region for the unmap.
    #[allow(clippy::too_many_arguments)]
    unsafe fn mapped(&self, w: &mut Writer, m: H, p: *mut c_void, err: cl_int, layout: Layout, pitches: Option<(usize, usize)>, want: bool, ev: H) -> Res {
        if p.is_null() {
            w.i32(if err == 0 { CL_OUT_OF_HOST_MEMORY } else { err });
            return Ok(());
        }
        let len = layout.footprint().ok_or(Fail::Code(CL_INVALID_VALUE))?;
        // SAFETY: the loader mapped `len` bytes (the region's footprint) at `p`, blocking,
        // so they hold the object's bytes now.
        let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
        w.i32(cl::CL_SUCCESS);
        w.u64(p as usize as u64);
        w.bytes(&layout.pack(bytes));
        w.bool(want);
        if want {
            w.h(ev);
        }
        if let Some((rp, sp)) = pitches {
            w.usize(rp);
            w.usize(sp);
        }
        self.remember_map((m as usize as u64, p as usize as u64), Mapped { layout });
        Ok(())
    }

    fn remember_map(&self, key: (u64, u64), map: Mapped) {
        self.maps.lock().unwrap_or_else(|e| e.into_inner()).entry(key).or_default().push(map);
    }

    /// An image's element size and type, asked of the platform.
    unsafe fn image_kind(&self, m: H) -> Result<(usize, cl_uint), Fail> {
        let img = f!(self.clGetImageInfo);
        let mem = f!(self.clGetMemObjectInfo);
        let (mut elem, mut ty) = (0usize, 0 as cl_uint);
        // SAFETY: each value is a local of the size passed.
        let rc = unsafe { img(m, cl::CL_IMAGE_ELEMENT_SIZE, size_of::<usize>(), (&mut elem as *mut usize).cast(), null_mut()) };
        if rc != cl::CL_SUCCESS {
            return Err(Fail::Code(rc));
        }
        // SAFETY: as above.
        let rc = unsafe { mem(m, CL_MEM_TYPE, size_of::<cl_uint>(), (&mut ty as *mut cl_uint).cast(), null_mut()) };
        if rc != cl::CL_SUCCESS {
            return Err(Fail::Code(rc));
        }
        Ok((elem, ty))
    }

    /// The host layout of a region of image `m` with these pitches.
    unsafe fn image_region(&self, m: H, region: [usize; 3], rp: usize, sp: usize) -> Result<Layout, Fail> {
        // SAFETY: forwarded.
        let (elem, ty) = unsafe { self.image_kind(m) }?;
        wire::image_layout(elem, ty, region, rp, sp).ok_or(Fail::Code(CL_INVALID_VALUE))
    }
}

/// A callback's trampoline data for application callback `id`, to be taken back with
/// `Box::from_raw` by the (one-shot) trampoline or on failure.
fn trampoline(id: u64, notify: &Notifier) -> *mut Trampoline {
    Box::into_raw(Box::new(Trampoline { id, notify: notify.clone() }))
}

/// The context-notify trampoline for application callback `id` (0: none). Its data is
/// leaked: the platform may call it for as long as the context lives, which this side
/// does not see end.
fn context_notify(id: u64, notify: &Notifier) -> (cl::Notify, *mut c_void) {
    if id == 0 {
        return (None, null_mut());
    }
    (Some(context_trampoline), trampoline(id, notify).cast())
}

/// Frees a one-shot trampoline's data when the platform refused the callback.
fn forget_on_failure(rc: cl_int, t: *mut Trampoline) {
    if rc != cl::CL_SUCCESS {
        // SAFETY: the platform did not take `t`, which `Dispatcher::trampoline` boxed.
        drop(unsafe { Box::from_raw(t) });
    }
}

unsafe extern "C" fn event_trampoline(e: H, status: cl_int, data: *mut c_void) {
    // SAFETY: `data` is the Trampoline boxed for this callback, which runs once.
    let t = unsafe { Box::from_raw(data.cast::<Trampoline>()) };
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let mut w = Writer::new();
        w.u64(t.id);
        w.u8(NOTIFY_EVENT);
        w.h(e);
        w.i32(status);
        (t.notify)(&w.buf);
    }));
}

unsafe extern "C" fn destructor_trampoline(h: H, data: *mut c_void) {
    // SAFETY: as in `event_trampoline`; a destructor callback runs once.
    let t = unsafe { Box::from_raw(data.cast::<Trampoline>()) };
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let mut w = Writer::new();
        w.u64(t.id);
        w.u8(NOTIFY_DESTRUCTOR);
        w.h(h);
        (t.notify)(&w.buf);
    }));
}

unsafe extern "C" fn context_trampoline(info: *const c_char, private: *const c_void, cb: usize, data: *mut c_void) {
    // SAFETY: `data` is the leaked Trampoline of this context.
    let t = unsafe { &*data.cast::<Trampoline>() };
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let mut w = Writer::new();
        w.u64(t.id);
        w.u8(NOTIFY_CONTEXT);
        // SAFETY: the platform passes a NUL-terminated message and `cb` bytes at `private`.
        w.bytes(if info.is_null() { b"" } else { unsafe { CStr::from_ptr(info) }.to_bytes() });
        // SAFETY: as above.
        w.bytes(if private.is_null() || cb == 0 { &[] } else { unsafe { std::slice::from_raw_parts(private.cast::<u8>(), cb) } });
        (t.notify)(&w.buf);
    }));
}

unsafe extern "C" fn free_after_write(_e: H, _status: cl_int, data: *mut c_void) {
    // SAFETY: `data` is the boxed copy `Dispatcher::write` gave this callback alone.
    drop(unsafe { Box::from_raw(data.cast::<Vec<u8>>()) });
}

/// A buffer of `n` bytes, or `CL_OUT_OF_HOST_MEMORY` rather than an abort.
fn alloc(n: usize) -> Result<Vec<u8>, Fail> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Fail::Code(CL_OUT_OF_HOST_MEMORY))?;
    v.resize(n, 0);
    Ok(v)
}

/// Whether bulk transfers may stage through page-locked memory: `HIBER_OPENCL_PINNED=0` in
/// the proxy's environment (`hiber run` passes its own) says no, for comparisons.
pub fn pinning() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os(PINNED_ENV).is_none_or(|v| v != "0"))
}

/// See [`pinning`].
pub const PINNED_ENV: &str = "HIBER_OPENCL_PINNED";

/// The code a bulk transfer fails with when the application's memory cannot be reached:
/// a bad pointer is the application's (`CL_INVALID_VALUE`), anything else the proxy's.
fn peer_failed(e: &std::io::Error) -> cl_int {
    crate::log(&format!("proxy: a bulk transfer could not reach the application's memory: {e}"));
    if e.raw_os_error() == Some(libc::EFAULT) {
        CL_INVALID_VALUE
    } else {
        CL_OUT_OF_RESOURCES
    }
}

/// The packed bytes of a rect region.
fn rect_len(region: [usize; 3]) -> Result<usize, Fail> {
    region[0].checked_mul(region[1]).and_then(|x| x.checked_mul(region[2])).ok_or(Fail::Code(CL_INVALID_VALUE))
}

fn opt_ptr<T>(v: &Option<Vec<T>>) -> *const T {
    v.as_ref().map_or(null(), |v| v.as_ptr())
}

fn opt_list(v: &[H]) -> *const H {
    if v.is_empty() {
        null()
    } else {
        v.as_ptr()
    }
}

fn ev_ptr(want: bool, ev: &mut H) -> *mut H {
    if want {
        ev
    } else {
        null_mut()
    }
}

fn cstring(b: &[u8]) -> Result<CString, Fail> {
    CString::new(b).map_err(|_| Fail::Wire)
}

fn opt_cstring(b: Option<&[u8]>) -> Result<Option<CString>, Fail> {
    b.map(cstring).transpose()
}

fn opt_cstr(s: &Option<CString>) -> *const i8 {
    s.as_ref().map_or(null(), |s| s.as_ptr())
}

/// A `u32` count and that many byte strings.
fn byte_list<'a>(r: &mut Reader<'a>) -> Result<Vec<&'a [u8]>, Fail> {
    let n = r.u32()?;
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(r.bytes()?);
    }
    Ok(v)
}

/// An optional 0-terminated property list; one that does not end its pairs with 0 is
/// malformed (the loader would read past it).
fn props<T: TryFrom<i64>>(r: &mut Reader) -> Result<Option<Vec<T>>, Fail> {
    let Some(v) = r.opt_i64s()? else { return Ok(None) };
    if v.len() % 2 != 1 || v.last() != Some(&0) {
        return Err(Fail::Wire);
    }
    Ok(Some(v.into_iter().map(|x| T::try_from(x).map_err(|_| Fail::Wire)).collect::<Result<_, _>>()?))
}

/// A create's flags and host data: the proxy never keeps a pointer into a request, so
/// `CL_MEM_USE_HOST_PTR` becomes `CL_MEM_COPY_HOST_PTR`; the data must cover `need` bytes.
fn host_data(flags: u64, data: Option<&[u8]>, need: Option<usize>) -> Result<(u64, *mut c_void), Fail> {
    let mut flags = flags;
    if flags & cl::CL_MEM_USE_HOST_PTR != 0 {
        flags = (flags & !cl::CL_MEM_USE_HOST_PTR) | cl::CL_MEM_COPY_HOST_PTR;
    }
    match data {
        Some(d) => {
            if need.is_none_or(|n| d.len() < n) {
                return Err(Fail::Code(CL_INVALID_VALUE));
            }
            Ok((flags, d.as_ptr() as *mut c_void))
        }
        None => Ok((flags, null_mut())),
    }
}

/// A create-image request's `flags, format, description, host data`.
fn image_args(r: &mut Reader) -> Result<(u64, ImageFormat, ImageDesc, *mut c_void), Fail> {
    let flags = r.u64()?;
    let fmt = ImageFormat { order: r.u32()?, data_type: r.u32()? };
    let desc = ImageDesc {
        image_type: r.u32()?,
        width: r.usize()?,
        height: r.usize()?,
        depth: r.usize()?,
        array_size: r.usize()?,
        row_pitch: r.usize()?,
        slice_pitch: r.usize()?,
        num_mip_levels: r.u32()?,
        num_samples: r.u32()?,
        buffer: r.h()?,
    };
    let data = r.opt_bytes()?;
    let need = match data {
        Some(_) => {
            let elem = wire::element_size(fmt.order, fmt.data_type).ok_or(Fail::Code(CL_INVALID_IMAGE_FORMAT_DESCRIPTOR))?;
            wire::image_layout(elem, desc.image_type, wire::image_extent(&desc), desc.row_pitch, desc.slice_pitch).and_then(|l| l.footprint())
        }
        None => None,
    };
    let (flags, host) = host_data(flags, data, need)?;
    Ok((flags, fmt, desc, host))
}

/// A create's answer: `rc` and, on success, the handle.
fn made(w: &mut Writer, h: H, err: cl_int) -> Res {
    if h.is_null() {
        w.i32(if err == cl::CL_SUCCESS { CL_OUT_OF_HOST_MEMORY } else { err });
    } else {
        w.i32(cl::CL_SUCCESS);
        w.h(h);
    }
    Ok(())
}

/// An op that takes one handle and returns only its code.
fn simple(r: &mut Reader, w: &mut Writer, f: unsafe extern "C" fn(H) -> cl_int) -> Res {
    let h = r.h()?;
    // SAFETY: the loader validates the handle value.
    w.i32(unsafe { f(h) });
    Ok(())
}

/// An enqueue's answer: `rc`, then, on success, `bool` and the event if asked for.
fn event_answer(w: &mut Writer, rc: cl_int, want: bool, ev: H) -> Res {
    w.i32(rc);
    if rc == cl::CL_SUCCESS {
        w.bool(want);
        if want {
            w.h(ev);
        }
    }
    Ok(())
}

/// A read's answer: `rc`, then, on success, the bytes and the event part.
fn read_answer(w: &mut Writer, rc: cl_int, data: &[u8], want: bool, ev: H) -> Res {
    w.i32(rc);
    if rc == cl::CL_SUCCESS {
        w.bytes(data);
        w.bool(want);
        if want {
            w.h(ev);
        }
    }
    Ok(())
}

/// A list query (`num_entries, out, num_out`): request `u32 entries, bool want_list`;
/// answer `rc` and, on success, the handles written and the total.
fn list(r: &mut Reader, w: &mut Writer, call: impl FnOnce(cl_uint, *mut H, *mut cl_uint) -> cl_int) -> Res {
    let (n, want) = (r.u32()?.min(MAX_HANDLES), r.bool()?);
    let mut v = vec![null_mut(); if want { n as usize } else { 0 }];
    let mut num = 0;
    let rc = call(n, if want { v.as_mut_ptr() } else { null_mut() }, &mut num);
    w.i32(rc);
    if rc == cl::CL_SUCCESS {
        w.handles(&v[..v.len().min(num as usize)]);
        w.u32(num);
    }
    Ok(())
}

/// An info query: request `u32 param, usize size, bool want_value`; answer `rc` and, on
/// success, the value's bytes (as many as the platform wrote) and `size_ret`.
fn info(r: &mut Reader, w: &mut Writer, call: impl FnOnce(cl_uint, usize, *mut c_void, *mut usize) -> cl_int) -> Res {
    let (param, size, want) = (r.u32()?, r.usize()?.min(MAX_INFO), r.bool()?);
    let mut v = if want { alloc(size)? } else { Vec::new() };
    let mut size_ret = 0usize;
    let rc = call(param, size, if want { v.as_mut_ptr().cast() } else { null_mut() }, &mut size_ret);
    w.i32(rc);
    if rc == cl::CL_SUCCESS {
        w.bytes(&v[..v.len().min(size_ret)]);
        w.usize(size_ret);
    }
    Ok(())
}

/// `clGetProgramInfo`, where `CL_PROGRAM_BINARIES` with a value answers the binaries
/// themselves (`rc, u32 count, bytes each, size_ret`): the application's value is an
/// array of its own pointers, which the client writes through.
fn program_info(r: &mut Reader, w: &mut Writer, call: impl Fn(cl_uint, usize, *mut c_void, *mut usize) -> cl_int) -> Res {
    let (param, size, want) = (r.u32()?, r.usize()?.min(MAX_INFO), r.bool()?);
    if param != CL_PROGRAM_BINARIES || !want {
        let mut v = if want { alloc(size)? } else { Vec::new() };
        let mut size_ret = 0usize;
        let rc = call(param, size, if want { v.as_mut_ptr().cast() } else { null_mut() }, &mut size_ret);
        w.i32(rc);
        if rc == cl::CL_SUCCESS {
            w.bytes(&v[..v.len().min(size_ret)]);
            w.usize(size_ret);
        }
        return Ok(());
    }
    let mut n: cl_uint = 0;
    let rc = call(CL_PROGRAM_NUM_DEVICES, size_of::<cl_uint>(), (&mut n as *mut cl_uint).cast(), null_mut());
    if rc != cl::CL_SUCCESS {
        return Err(Fail::Code(rc));
    }
    let mut sizes = vec![0usize; n as usize];
    let rc = call(CL_PROGRAM_BINARY_SIZES, sizes.len() * size_of::<usize>(), sizes.as_mut_ptr().cast(), null_mut());
    if rc != cl::CL_SUCCESS {
        return Err(Fail::Code(rc));
    }
    let mut bins = sizes.iter().map(|&s| alloc(s)).collect::<Result<Vec<_>, _>>()?;
    let mut ptrs: Vec<*mut u8> = bins.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let rc = call(CL_PROGRAM_BINARIES, ptrs.len() * size_of::<usize>(), ptrs.as_mut_ptr().cast(), null_mut());
    w.i32(rc);
    if rc == cl::CL_SUCCESS {
        w.u32(bins.len() as u32);
        bins.iter().for_each(|b| w.bytes(b));
        w.usize(bins.len() * size_of::<usize>());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty_real() -> Real {
        {
            let mut t = crate::remote::client::table();
            t.clFinish = None;
            t
        }
    }

    #[test]
    fn malformed_requests_answer_invalid_value() {
        let d = Dispatcher::with_real(empty_real());
        let mut answer = Vec::new();
        let n: Notifier = Arc::new(|_: &[u8]| {});
        for req in [&[][..], &[1], &[0xff, 0xff, 0], &[0, 0, 0, 1]] {
            d.handle(req, &mut answer, n.clone());
            assert_eq!(answer.len(), 8);
        }
        d.handle(&[0xff, 0xff, 0], &mut answer, n.clone());
        assert_eq!(i32::from_le_bytes(answer[4..8].try_into().unwrap()), CL_INVALID_VALUE);
        // A known op whose loader function is missing.
        let mut w = Writer::new();
        w.u16(Op::Finish as u16);
        w.u8(MODE_POST);
        w.u64(1);
        d.handle(&w.buf, &mut answer, n.clone());
        assert_eq!(i32::from_le_bytes(answer[4..8].try_into().unwrap()), cl::CL_INVALID_OPERATION);
        // The post's failure waits, past calls that do not wait for the queues' work, for the
        // next one that does (clFinish here), and comes back once.
        d.handle(&[0xff, 0xff, 0], &mut answer, n.clone());
        assert_eq!(i32::from_le_bytes(answer[..4].try_into().unwrap()), 0);
        let mut finish = Writer::new();
        finish.u16(Op::Finish as u16);
        finish.u8(0);
        finish.u64(1);
        d.handle(&finish.buf, &mut answer, n.clone());
        assert_eq!(i32::from_le_bytes(answer[..4].try_into().unwrap()), cl::CL_INVALID_OPERATION);
        d.handle(&finish.buf, &mut answer, n.clone());
        assert_eq!(i32::from_le_bytes(answer[..4].try_into().unwrap()), 0);
    }

    #[test]
    fn property_lists_must_end_their_pairs() {
        for (v, ok) in [(vec![0i64], true), (vec![5, 1, 0], true), (vec![5, 0], false), (vec![5, 1], false), (vec![], false)] {
            let mut w = Writer::new();
            w.opt_i64s(Some(&v));
            let r: Result<Option<Vec<isize>>, Fail> = props(&mut Reader::new(&w.buf));
            assert_eq!(r.is_ok(), ok, "{v:?}");
        }
    }
}
