//! Proxy mode end to end, in one process: the remote stubs (`remote::client::table()`)
//! talk through a loopback transport to a `Dispatcher` that runs a real OpenCL program on
//! PoCL. Posts are queued and run in order before the next call, and notifications reach
//! `remote::on_notify` on a thread of their own, as with the shared-memory transport.
//! Every result is checked against the same computation on the CPU.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hiber_opencl::cl::{self, cl_int, ImageDesc, ImageFormat, Real, H};
use hiber_opencl::remote::server::{Dispatcher, Notifier};
use hiber_opencl::remote::{self, Transport};

struct Loopback {
    dispatcher: Dispatcher,
    posts: Mutex<VecDeque<Vec<u8>>>,
    /// Held while posts run, so two callers run them in order.
    running: Mutex<()>,
    notify: Notifier,
}

impl Loopback {
    fn drain(&self) {
        let _g = self.running.lock().unwrap();
        loop {
            let Some(req) = self.posts.lock().unwrap().pop_front() else { break };
            let mut answer = Vec::new();
            self.dispatcher.handle(&req, &mut answer, self.notify.clone());
        }
    }
}

impl Transport for Loopback {
    fn call(&self, req: &[u8]) -> std::io::Result<Vec<u8>> {
        self.drain();
        let mut answer = Vec::new();
        self.dispatcher.handle(req, &mut answer, self.notify.clone());
        Ok(answer)
    }

    fn post(&self, req: &[u8]) -> std::io::Result<()> {
        self.posts.lock().unwrap().push_back(req.to_vec());
        Ok(())
    }
}

fn connect() -> Arc<Loopback> {
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        for msg in rx {
            remote::on_notify(&msg);
        }
    });
    let tx = Mutex::new(tx);
    let notify: Notifier = Arc::new(move |msg: &[u8]| {
        let _ = tx.lock().unwrap().send(msg.to_vec());
    });
    Arc::new(Loopback { dispatcher: Dispatcher::new(), posts: Mutex::default(), running: Mutex::default(), notify })
}

/// Calls stub `$f` of the table.
macro_rules! cl {
    ($t:ident . $f:ident ( $($a:expr),* $(,)? )) => {
        // SAFETY: the test passes arguments as OpenCL's specification asks.
        unsafe { ($t.$f.expect(stringify!($f)))($($a),*) }
    };
}

fn ok(code: cl_int, what: &str) {
    assert_eq!(code, cl::CL_SUCCESS, "{what} failed: {}", cl::error_name(code));
}

fn info_string(f: impl Fn(usize, *mut c_void, *mut usize) -> cl_int) -> String {
    let mut n = 0;
    ok(f(0, null_mut(), &mut n), "size query");
    let mut v = vec![0u8; n];
    ok(f(n, v.as_mut_ptr().cast(), null_mut()), "value query");
    String::from_utf8_lossy(v.split(|&b| b == 0).next().unwrap()).into_owned()
}

const SRC: &str = "
__kernel void saxpy(__global const float *a, __global const float *b, __global float *out, float k) {
    size_t i = get_global_id(0);
    out[i] = k * a[i] + b[i];
}
__kernel void twice(__global uint *x) { size_t i = get_global_id(0); x[i] = x[i] * 2u + 1u; }
__kernel void invert(__read_only image2d_t src, __write_only image2d_t dst) {
    int2 p = (int2)(get_global_id(0), get_global_id(1));
    uint4 v = read_imageui(src, p);
    write_imageui(dst, p, (uint4)(255u) - v);
}
";

static EVENT_STATUS: AtomicI32 = AtomicI32::new(1);
static EVENT_CALLS: AtomicI32 = AtomicI32::new(0);

unsafe extern "C" fn on_event(_e: H, status: cl_int, data: *mut c_void) {
    assert_eq!(data as usize, 0x5eed);
    EVENT_STATUS.store(status, Ordering::SeqCst);
    EVENT_CALLS.fetch_add(1, Ordering::SeqCst);
}

fn wait_for(what: &str, f: impl Fn() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_program_runs_through_the_proxy() {
    std::env::set_var("POCL_DEVICES", "basic pthread");
    remote::set_transport(Some(connect()));
    let t: Real = remote::client::table();

    // Platforms and devices.
    let mut n = 0u32;
    ok(cl!(t.clGetPlatformIDs(0, null_mut(), &mut n)), "clGetPlatformIDs");
    assert!(n >= 1, "no platform (is PoCL installed?)");
    let mut platforms = vec![null_mut(); n as usize];
    ok(cl!(t.clGetPlatformIDs(n, platforms.as_mut_ptr(), null_mut())), "clGetPlatformIDs");
    let platform = platforms[0];
    let name = info_string(|s, v, r| cl!(t.clGetPlatformInfo(platform, cl::CL_PLATFORM_NAME, s, v, r)));
    assert!(!name.is_empty());
    let mut dev: H = null_mut();
    ok(cl!(t.clGetDeviceIDs(platform, cl::CL_DEVICE_TYPE_ALL, 1, &mut dev, null_mut())), "clGetDeviceIDs");
    let dev_name = info_string(|s, v, r| cl!(t.clGetDeviceInfo(dev, cl::CL_DEVICE_NAME, s, v, r)));
    assert!(!dev_name.is_empty());

    // Context and queue.
    let mut err = 0;
    let props = [cl::CL_CONTEXT_PLATFORM, platform as isize, 0];
    let ctx = cl!(t.clCreateContext(props.as_ptr(), 1, &dev, None, null_mut(), &mut err));
    ok(err, "clCreateContext");
    let q = cl!(t.clCreateCommandQueueWithProperties(ctx, dev, null(), &mut err));
    ok(err, "clCreateCommandQueueWithProperties");
    let mut qdev: H = null_mut();
    ok(cl!(t.clGetCommandQueueInfo(q, cl::CL_QUEUE_DEVICE, 8, (&mut qdev as *mut H).cast(), null_mut())), "clGetCommandQueueInfo");
    assert_eq!(qdev, dev);

    // Program and kernels.
    let src = SRC.as_ptr().cast::<i8>();
    let len = SRC.len();
    let prog = cl!(t.clCreateProgramWithSource(ctx, 1, &src, &len, &mut err));
    ok(err, "clCreateProgramWithSource");
    ok(cl!(t.clBuildProgram(prog, 1, &dev, c"-cl-std=CL1.2".as_ptr(), None, null_mut())), "clBuildProgram");
    let log = info_string(|s, v, r| cl!(t.clGetProgramBuildInfo(prog, dev, 0x1183, s, v, r)));
    let _ = log; // CL_PROGRAM_BUILD_LOG: a string, maybe empty
    let saxpy = cl!(t.clCreateKernel(prog, c"saxpy".as_ptr(), &mut err));
    ok(err, "clCreateKernel");
    let kname = info_string(|s, v, r| cl!(t.clGetKernelInfo(saxpy, cl::CL_KERNEL_FUNCTION_NAME, s, v, r)));
    assert_eq!(kname, "saxpy");

    // The program's binaries come back through the application's pointers.
    let mut sizes = [0usize; 1];
    ok(cl!(t.clGetProgramInfo(prog, 0x1165, 8, sizes.as_mut_ptr().cast(), null_mut())), "CL_PROGRAM_BINARY_SIZES");
    let mut bin = vec![0u8; sizes[0]];
    let mut ptrs = [bin.as_mut_ptr()];
    ok(cl!(t.clGetProgramInfo(prog, 0x1166, 8, ptrs.as_mut_ptr().cast(), null_mut())), "CL_PROGRAM_BINARIES");
    assert!(sizes[0] > 0 && bin.iter().any(|&b| b != 0), "an empty binary");

    // saxpy: a non-blocking write (posted), a blocking one, a kernel with an event callback.
    const N: usize = 4096;
    let a: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
    let b: Vec<f32> = (0..N).map(|i| (N - i) as f32).collect();
    let k = 3.0f32;
    let bytes = N * 4;
    let ba = cl!(t.clCreateBuffer(ctx, 1, bytes, null_mut(), &mut err));
    ok(err, "clCreateBuffer");
    let bb = cl!(t.clCreateBuffer(ctx, 1, bytes, null_mut(), &mut err));
    ok(err, "clCreateBuffer");
    let bo = cl!(t.clCreateBuffer(ctx, 1, bytes, null_mut(), &mut err));
    ok(err, "clCreateBuffer");
    ok(cl!(t.clEnqueueWriteBuffer(q, ba, 0, 0, bytes, a.as_ptr().cast(), 0, null(), null_mut())), "clEnqueueWriteBuffer");
    ok(cl!(t.clEnqueueWriteBuffer(q, bb, cl::CL_TRUE, 0, bytes, b.as_ptr().cast(), 0, null(), null_mut())), "clEnqueueWriteBuffer");
    for (i, m) in [ba, bb, bo].iter().enumerate() {
        ok(cl!(t.clSetKernelArg(saxpy, i as u32, 8, (m as *const H).cast())), "clSetKernelArg");
    }
    ok(cl!(t.clSetKernelArg(saxpy, 3, 4, (&k as *const f32).cast())), "clSetKernelArg");
    let global = N;
    let mut ev: H = null_mut();
    ok(cl!(t.clEnqueueNDRangeKernel(q, saxpy, 1, null(), &global, null(), 0, null(), &mut ev)), "clEnqueueNDRangeKernel");
    ok(cl!(t.clSetEventCallback(ev, cl::CL_COMPLETE, Some(on_event), 0x5eed as *mut c_void)), "clSetEventCallback");
    let mut out = vec![0f32; N];
    ok(cl!(t.clEnqueueReadBuffer(q, bo, 0, 0, bytes, out.as_mut_ptr().cast(), 1, &ev, null_mut())), "clEnqueueReadBuffer");
    let want: Vec<f32> = (0..N).map(|i| k * a[i] + b[i]).collect();
    assert_eq!(out, want, "saxpy through the proxy differs from the CPU's");
    ok(cl!(t.clFinish(q)), "clFinish");
    wait_for("the event callback", || EVENT_CALLS.load(Ordering::SeqCst) == 1);
    assert_eq!(EVENT_STATUS.load(Ordering::SeqCst), cl::CL_COMPLETE);
    let mut st: cl_int = -1;
    ok(cl!(t.clGetEventInfo(ev, cl::CL_EVENT_COMMAND_EXECUTION_STATUS, 4, (&mut st as *mut cl_int).cast(), null_mut())), "clGetEventInfo");
    assert_eq!(st, cl::CL_COMPLETE);
    ok(cl!(t.clReleaseEvent(ev)), "clReleaseEvent");

    // Map for writing: the stub's copy goes back at unmap.
    let p = cl!(t.clEnqueueMapBuffer(q, bo, cl::CL_TRUE, 3, 0, bytes, 0, null(), null_mut(), &mut err));
    ok(err, "clEnqueueMapBuffer");
    assert_eq!(p as usize % 4096, 0, "a map's copy is page-aligned");
    // SAFETY: the map's `bytes` bytes, the application's until the unmap.
    let mapped = unsafe { std::slice::from_raw_parts_mut(p.cast::<f32>(), N) };
    assert_eq!(mapped, &want[..]);
    mapped.iter_mut().for_each(|x| *x += 1.0);
    ok(cl!(t.clEnqueueUnmapMemObject(q, bo, p, 0, null(), null_mut())), "clEnqueueUnmapMemObject");
    ok(cl!(t.clEnqueueReadBuffer(q, bo, cl::CL_TRUE, 0, bytes, out.as_mut_ptr().cast(), 0, null(), null_mut())), "clEnqueueReadBuffer");
    assert!(out.iter().zip(&want).all(|(o, w)| *o == w + 1.0), "the unmap did not write back");

    // A USE_HOST_PTR buffer: made from the host bytes, mapped at the host pointer.
    let mut host: Vec<u32> = (0..N as u32).collect();
    let ub = cl!(t.clCreateBuffer(ctx, 1 | cl::CL_MEM_USE_HOST_PTR, bytes, host.as_mut_ptr().cast(), &mut err));
    ok(err, "clCreateBuffer(USE_HOST_PTR)");
    let mut hp: *mut c_void = null_mut();
    ok(cl!(t.clGetMemObjectInfo(ub, 0x1103, 8, (&mut hp as *mut *mut c_void).cast(), null_mut())), "CL_MEM_HOST_PTR");
    assert_eq!(hp, host.as_mut_ptr().cast());
    let mut flags = 0u64;
    ok(cl!(t.clGetMemObjectInfo(ub, cl::CL_MEM_FLAGS, 8, (&mut flags as *mut u64).cast(), null_mut())), "CL_MEM_FLAGS");
    assert_ne!(flags & cl::CL_MEM_USE_HOST_PTR, 0);
    let twice = cl!(t.clCreateKernel(prog, c"twice".as_ptr(), &mut err));
    ok(err, "clCreateKernel");
    ok(cl!(t.clSetKernelArg(twice, 0, 8, (&ub as *const H).cast())), "clSetKernelArg");
    ok(cl!(t.clEnqueueNDRangeKernel(q, twice, 1, null(), &global, null(), 0, null(), null_mut())), "clEnqueueNDRangeKernel");
    let off = 16 * 4;
    let p = cl!(t.clEnqueueMapBuffer(q, ub, cl::CL_TRUE, 1, off, bytes - off, 0, null(), null_mut(), &mut err));
    ok(err, "clEnqueueMapBuffer(USE_HOST_PTR)");
    // SAFETY: only the address is compared.
    assert_eq!(p, unsafe { host.as_mut_ptr().cast::<u8>().add(off) }.cast());
    ok(cl!(t.clEnqueueUnmapMemObject(q, ub, p, 0, null(), null_mut())), "clEnqueueUnmapMemObject");
    ok(cl!(t.clFinish(q)), "clFinish");
    assert!((16..N).all(|i| host[i] == i as u32 * 2 + 1), "the mapped host memory does not hold the kernel's result");

    // An image written, inverted by a kernel and read back with a row pitch.
    let (w, h) = (37usize, 23usize);
    let fmt = ImageFormat { order: 0x10B5, data_type: 0x10DA }; // CL_RGBA, CL_UNSIGNED_INT8
    let desc = ImageDesc {
        image_type: cl::CL_MEM_OBJECT_IMAGE2D,
        width: w,
        height: h,
        depth: 1,
        array_size: 1,
        row_pitch: 0,
        slice_pitch: 0,
        num_mip_levels: 0,
        num_samples: 0,
        buffer: null_mut(),
    };
    let pixels: Vec<u8> = (0..w * h * 4).map(|i| (i * 7 % 251) as u8).collect();
    let src_img = cl!(t.clCreateImage(ctx, 1 | cl::CL_MEM_COPY_HOST_PTR, &fmt, &desc, pixels.as_ptr() as *mut c_void, &mut err));
    ok(err, "clCreateImage");
    let dst_img = cl!(t.clCreateImage(ctx, 1, &fmt, &desc, null_mut(), &mut err));
    ok(err, "clCreateImage");
    let invert = cl!(t.clCreateKernel(prog, c"invert".as_ptr(), &mut err));
    ok(err, "clCreateKernel");
    ok(cl!(t.clSetKernelArg(invert, 0, 8, (&src_img as *const H).cast())), "clSetKernelArg");
    ok(cl!(t.clSetKernelArg(invert, 1, 8, (&dst_img as *const H).cast())), "clSetKernelArg");
    let gsz = [w, h];
    ok(cl!(t.clEnqueueNDRangeKernel(q, invert, 2, null(), gsz.as_ptr(), null(), 0, null(), null_mut())), "clEnqueueNDRangeKernel");
    let pitch = w * 4 + 12;
    let mut back = vec![0xAAu8; pitch * h];
    let origin = [0usize; 3];
    let region = [w, h, 1];
    ok(
        cl!(t.clEnqueueReadImage(q, dst_img, cl::CL_TRUE, origin.as_ptr(), region.as_ptr(), pitch, 0, back.as_mut_ptr().cast(), 0, null(), null_mut())),
        "clEnqueueReadImage",
    );
    for y in 0..h {
        for x in 0..w * 4 {
            assert_eq!(back[y * pitch + x], 255 - pixels[y * w * 4 + x], "pixel byte ({x}, {y})");
        }
        assert!(back[y * pitch + w * 4..(y + 1) * pitch].iter().all(|&b| b == 0xAA), "a read wrote between rows");
    }
    let mut elem = 0usize;
    ok(cl!(t.clGetImageInfo(dst_img, cl::CL_IMAGE_ELEMENT_SIZE, 8, (&mut elem as *mut usize).cast(), null_mut())), "clGetImageInfo");
    assert_eq!(elem, 4);

    // A posted call's failure surfaces at the next call that reports it.
    ok(cl!(t.clSetKernelArg(saxpy, 99, 4, (&k as *const f32).cast())), "a posted clSetKernelArg");
    assert_eq!(cl!(t.clFinish(q)), -49, "the bad argument index did not surface"); // CL_INVALID_ARG_INDEX
    ok(cl!(t.clFinish(q)), "clFinish after the deferred error");

    // Unsupported: SVM.
    assert!(cl!(t.clSVMAlloc(ctx, 1, 64, 0)).is_null());

    for k in [saxpy, twice, invert] {
        ok(cl!(t.clReleaseKernel(k)), "clReleaseKernel");
    }
    for m in [ba, bb, bo, ub, src_img, dst_img] {
        ok(cl!(t.clReleaseMemObject(m)), "clReleaseMemObject");
    }
    ok(cl!(t.clReleaseProgram(prog)), "clReleaseProgram");
    ok(cl!(t.clReleaseCommandQueue(q)), "clReleaseCommandQueue");
    ok(cl!(t.clReleaseContext(ctx)), "clReleaseContext");
    // The releases were posted: a call runs them, and none failed.
    let mut np = 0u32;
    ok(cl!(t.clGetPlatformIDs(0, null_mut(), &mut np)), "clGetPlatformIDs after the releases");
    drop(host);
}
