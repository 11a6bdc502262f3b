//! Checkpoint and replay: what the control thread does to the objects while the gate is
//! closed.
//!
//! - [`drain`]: every queue finishes its work (bounded by hiber's timeout).
//! - [`read_mem`]: a memory object's bytes into a memfd for hiber.
//! - [`release`]: every real object goes; the records stay.
//! - [`replay`]: every object still in use is made again from its record, in creation
//!   order, on the devices it had or on the one hiber names; [`write_mem`] puts the saved
//!   bytes back.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::null_mut;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hiber_layer::gate;

use crate::cl::{self, cl_int, cl_uint, ImageDesc, H};
use crate::objects::{self as o, Arg, Kind, Obj, ProgramSource, Record, Shape};

fn r() -> Result<&'static cl::Real, String> {
    cl::real().ok_or_else(|| "no OpenCL ICD loader (libOpenCL.so.1) here".to_string())
}

macro_rules! f {
    ($name:ident) => {
        r()?.$name.ok_or_else(|| format!("the OpenCL loader has no {}", stringify!($name)))?
    };
}

fn check(what: &str, code: cl_int) -> Result<(), String> {
    if code == cl::CL_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {}", cl::error_name(code)))
    }
}

/// A string answer of a real `clGet*Info`.
fn info_string(get: impl Fn(usize, *mut c_void, *mut usize) -> cl_int) -> String {
    let mut size = 0;
    if get(0, null_mut(), &mut size) != cl::CL_SUCCESS || size == 0 {
        return String::new();
    }
    let mut buf = vec![0u8; size];
    if get(size, buf.as_mut_ptr() as *mut c_void, null_mut()) != cl::CL_SUCCESS {
        return String::new();
    }
    String::from_utf8_lossy(&buf).trim_end_matches('\0').to_string()
}

fn info_value<T: Copy + Default>(get: impl Fn(usize, *mut c_void, *mut usize) -> cl_int) -> T {
    let mut v = T::default();
    get(std::mem::size_of::<T>(), &mut v as *mut T as *mut c_void, null_mut());
    v
}

pub(crate) fn platform_name(p: H) -> String {
    let Some(f) = cl::real().and_then(|r| r.clGetPlatformInfo) else { return String::new() };
    // SAFETY: a real platform and buffers of the sizes given.
    info_string(|s, v, sr| unsafe { f(p, cl::CL_PLATFORM_NAME, s, v, sr) })
}

/// A real device's platform, name and type.
pub(crate) fn device_identity(d: H) -> (H, String, u64) {
    let Some(f) = cl::real().and_then(|r| r.clGetDeviceInfo) else { return (null_mut(), String::new(), 0) };
    // SAFETY: a real device and buffers of the sizes given.
    let get = |param| move |s, v, sr| unsafe { f(d, param, s, v, sr) };
    (info_value::<H>(get(cl::CL_DEVICE_PLATFORM)), info_string(get(cl::CL_DEVICE_NAME)), info_value::<u64>(get(cl::CL_DEVICE_TYPE)))
}

pub(crate) fn context_devices(c: H) -> Vec<H> {
    let Some(f) = cl::real().and_then(|r| r.clGetContextInfo) else { return Vec::new() };
    let mut size = 0;
    // SAFETY: a real context; first the size, then the list into a buffer of that size.
    unsafe {
        if f(c, cl::CL_CONTEXT_DEVICES, 0, null_mut(), &mut size) != cl::CL_SUCCESS {
            return Vec::new();
        }
        let mut v = vec![null_mut(); size / std::mem::size_of::<H>()];
        if f(c, cl::CL_CONTEXT_DEVICES, size, v.as_mut_ptr() as *mut c_void, null_mut()) != cl::CL_SUCCESS {
            return Vec::new();
        }
        v
    }
}

/// The place of device `d` among the devices of `platform` named `name`.
pub(crate) fn ordinal_among_namesakes(platform: H, d: H, name: &str) -> usize {
    let Some(get) = cl::real().and_then(|r| r.clGetDeviceIDs) else { return 0 };
    let mut n = 0;
    // SAFETY: counting a real platform's devices into our variable.
    if unsafe { get(platform, cl::CL_DEVICE_TYPE_ALL, 0, null_mut(), &mut n) } != cl::CL_SUCCESS {
        return 0;
    }
    let mut ds = vec![null_mut(); n as usize];
    // SAFETY: `n` devices into a list of `n`.
    if unsafe { get(platform, cl::CL_DEVICE_TYPE_ALL, n, ds.as_mut_ptr(), null_mut()) } != cl::CL_SUCCESS {
        return 0;
    }
    ds.iter().take_while(|&&x| x != d).filter(|&&x| device_identity(x).1 == name).count()
}

pub(crate) fn image_element_size(m: H) -> usize {
    let Some(f) = cl::real().and_then(|r| r.clGetImageInfo) else { return 0 };
    // SAFETY: a real image and a size_t for the answer.
    info_value::<usize>(|s, v, sr| unsafe { f(m, cl::CL_IMAGE_ELEMENT_SIZE, s, v, sr) })
}

pub(crate) fn kernel_name(k: H) -> std::ffi::CString {
    let Some(f) = cl::real().and_then(|r| r.clGetKernelInfo) else { return Default::default() };
    // SAFETY: a real kernel and buffers of the sizes given.
    let name = info_string(|s, v, sr| unsafe { f(k, cl::CL_KERNEL_FUNCTION_NAME, s, v, sr) });
    std::ffi::CString::new(name).unwrap_or_default()
}

/// The region a whole image covers, in pixels (rows and slices for arrays).
pub fn image_region(d: &ImageDesc) -> [usize; 3] {
    match d.image_type {
        cl::CL_MEM_OBJECT_IMAGE1D | cl::CL_MEM_OBJECT_IMAGE1D_BUFFER => [d.width, 1, 1],
        cl::CL_MEM_OBJECT_IMAGE1D_ARRAY => [d.width, d.array_size, 1],
        cl::CL_MEM_OBJECT_IMAGE2D => [d.width, d.height, 1],
        cl::CL_MEM_OBJECT_IMAGE2D_ARRAY => [d.width, d.height, d.array_size],
        _ => [d.width, d.height, d.depth],
    }
}

/// An image's bytes, packed (no row or slice padding).
pub fn image_bytes(d: &ImageDesc, element: usize) -> usize {
    image_region(d).iter().product::<usize>() * element
}

// ---------------------------------------------------------------------------------------
// Checkpoint

fn live(kind: Kind) -> Vec<Arc<Obj>> {
    o::all_live().into_iter().filter(|x| x.kind == kind).collect()
}

/// Finishes every queue's work, each on its own thread so a queue that never finishes (a
/// command waiting on a user event no one will set) is reported instead of waited for.
pub fn drain(timeout: Duration) -> Result<(), String> {
    let finish = f!(clFinish);
    let retain = f!(clRetainCommandQueue);
    let release = f!(clReleaseCommandQueue);
    let queues = live(Kind::Queue);
    let deadline = Instant::now().checked_add(timeout).unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365));
    let (tx, rx) = std::sync::mpsc::channel();
    let mut threads = Vec::new();
    for q in &queues {
        let (real, seq, tx) = (q.real() as usize, q.seq, tx.clone());
        // The thread holds a reference of its own: one that overruns the timeout outlives
        // the checkpoint, and the application may release the queue meanwhile.
        // SAFETY: a real queue the layer holds.
        unsafe { retain(real as H) };
        let spawned = std::thread::Builder::new().name("hiber-cl-drain".into()).spawn(move || {
            // SAFETY: a real queue on which this thread holds a reference.
            let code = unsafe { finish(real as H) };
            // SAFETY: the reference taken for this thread, given back once.
            unsafe { release(real as H) };
            let _ = tx.send((seq, code));
        });
        threads.push(spawned.map_err(|e| format!("cannot start a thread to drain a queue: {e}"))?);
    }
    for _ in &queues {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((_, code)) if code == cl::CL_SUCCESS => {}
            Ok((seq, code)) => return Err(format!("clFinish on queue {seq}: {}", cl::error_name(code))),
            Err(_) => {
                // The thread still inside clFinish is left to end by itself.
                return Err(format!(
                    "a command queue still has work after {} ms (a command may wait on a user event that is not complete)",
                    timeout.as_millis()
                ));
            }
        }
    }
    // Every thread has answered: none is left half-exited when CRIU dumps the process.
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

/// The memory objects whose bytes go into the image: buffers and images with storage of
/// their own (sub-buffers and images made from a buffer share their buffer's).
pub fn saved_mems() -> Vec<(Arc<Obj>, usize, hiber_wire::opencl::MemKind)> {
    use hiber_wire::opencl::MemKind;
    live(Kind::Mem)
        .into_iter()
        .filter_map(|m| {
            let kind = match &*m.rec() {
                Record::Mem { shape: Shape::Buffer, size, .. } => (*size, MemKind::Buffer),
                Record::Mem { shape: Shape::Image { buffer: None, .. }, size, .. } => (*size, MemKind::Image),
                _ => return None,
            };
            Some((m.clone(), kind.0, kind.1))
        })
        .collect()
}

/// The devices the live contexts use, as (type, "PLATFORM / DEVICE").
pub fn used_devices() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for c in live(Kind::Context) {
        let devs = match &*c.rec() {
            Record::Context { devices, .. } => devices.clone(),
            _ => continue,
        };
        for d in devs {
            let desc = describe_device(&d);
            if !out.contains(&desc) {
                out.push(desc);
            }
        }
    }
    out
}

fn describe_device(d: &Obj) -> (String, String) {
    match &*d.rec() {
        Record::Device { platform, name, device_type, .. } => {
            let pname = match &*platform.rec() {
                Record::Platform { name } => name.clone(),
                _ => String::new(),
            };
            let t = if device_type & cl::CL_DEVICE_TYPE_GPU != 0 {
                "gpu"
            } else if device_type & cl::CL_DEVICE_TYPE_CPU != 0 {
                "cpu"
            } else {
                "other"
            };
            (t.to_string(), format!("{pname} / {name}"))
        }
        _ => ("other".into(), "?".into()),
    }
}

/// Runs `f` with a real queue of `ctx`: one of the application's, else a temporary one on
/// the context's first device.
fn with_queue(ctx: &Arc<Obj>, f: impl FnOnce(H) -> cl_int) -> Result<cl_int, String> {
    let q = live(Kind::Queue).into_iter().find(|q| matches!(&*q.rec(), Record::Queue { context, .. } if Arc::ptr_eq(context, ctx)) && !q.real().is_null());
    if let Some(q) = q {
        return Ok(f(q.real()));
    }
    let dev = match &*ctx.rec() {
        Record::Context { devices, .. } => devices.first().cloned(),
        _ => None,
    };
    let dev = dev.ok_or("a context without devices")?;
    let create = f!(clCreateCommandQueue);
    let release = f!(clReleaseCommandQueue);
    let mut err = 0;
    // SAFETY: a real context and one of its real devices.
    let q = unsafe { create(ctx.real(), dev.real(), 0, &mut err) };
    if q.is_null() {
        return Err(format!("creating a queue to move memory: {}", cl::error_name(err)));
    }
    let out = f(q);
    // SAFETY: the queue made above, released once.
    unsafe { release(q) };
    Ok(out)
}

fn mem_parts(m: &Obj) -> Result<(Arc<Obj>, Option<ImageDesc>), String> {
    match &*m.rec() {
        Record::Mem { context, shape: Shape::Buffer, .. } => Ok((context.clone(), None)),
        Record::Mem { context, shape: Shape::Image { desc, .. }, .. } => Ok((context.clone(), Some(*desc))),
        _ => Err(format!("memory object {} has no storage of its own", m.seq)),
    }
}

/// A shared memory file of `size` bytes, mapped.
struct MemFile {
    fd: OwnedFd,
    ptr: *mut c_void,
    size: usize,
}

impl MemFile {
    fn create(size: usize) -> Result<MemFile, String> {
        // SAFETY: a fresh anonymous file; the name is a NUL-terminated literal.
        let fd = unsafe { libc::memfd_create(c"hiber-opencl".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just created and is owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sizing the file we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
            return Err(format!("sizing a memory file of {size} bytes: {}", std::io::Error::last_os_error()));
        }
        MemFile::map(fd, size, libc::PROT_READ | libc::PROT_WRITE)
    }

    fn map(fd: OwnedFd, size: usize, prot: i32) -> Result<MemFile, String> {
        // SAFETY: a shared mapping of a file of at least `size` bytes, at an address the
        // kernel picks; unmapped in Drop.
        let ptr = unsafe { libc::mmap(null_mut(), size.max(1), prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(format!("mapping {size} bytes: {}", std::io::Error::last_os_error()));
        }
        Ok(MemFile { fd, ptr, size })
    }
}

impl Drop for MemFile {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.ptr, self.size.max(1)) };
    }
}

/// Reads memory object `m` into a new memfd for hiber.
pub fn read_mem(m: &Arc<Obj>, size: usize) -> Result<OwnedFd, String> {
    let (ctx, desc) = mem_parts(m)?;
    let file = MemFile::create(size)?;
    let code = match desc {
        None => {
            let read = f!(clEnqueueReadBuffer);
            // SAFETY: a blocking read of the whole buffer into a mapping of its size.
            with_queue(&ctx, |q| unsafe { read(q, m.real(), cl::CL_TRUE, 0, size, file.ptr, 0, std::ptr::null(), null_mut()) })?
        }
        Some(d) => {
            let read = f!(clEnqueueReadImage);
            let region = image_region(&d);
            // SAFETY: a blocking read of the whole image, packed, into a mapping of its size.
            with_queue(&ctx, |q| unsafe {
                read(q, m.real(), cl::CL_TRUE, [0usize; 3].as_ptr(), region.as_ptr(), 0, 0, file.ptr, 0, std::ptr::null(), null_mut())
            })?
        }
    };
    check(&format!("reading memory object {}", m.seq), code)?;
    file.fd.try_clone().map_err(|e| e.to_string())
}

/// Writes the bytes in `fd` into memory object `id` (after a replay).
pub fn write_mem(id: u64, fd: OwnedFd) -> Result<(), String> {
    let m = o::all_live().into_iter().find(|x| x.seq == id && x.kind == Kind::Mem).ok_or_else(|| format!("no memory object {id}"))?;
    let size = match &*m.rec() {
        Record::Mem { size, .. } => *size,
        _ => 0,
    };
    let (ctx, desc) = mem_parts(&m)?;
    // SAFETY: fstat on a descriptor we own.
    let len = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        st.st_size as usize
    };
    if len != size {
        return Err(format!("memory object {id} has {size} bytes; hiber sent {len}"));
    }
    let file = MemFile::map(fd, size, libc::PROT_READ)?;
    let code = match desc {
        None => {
            let write = f!(clEnqueueWriteBuffer);
            // SAFETY: a blocking write of the whole buffer from a mapping of its size.
            with_queue(&ctx, |q| unsafe { write(q, m.real(), cl::CL_TRUE, 0, size, file.ptr, 0, std::ptr::null(), null_mut()) })?
        }
        Some(d) => {
            let write = f!(clEnqueueWriteImage);
            let region = image_region(&d);
            // SAFETY: a blocking write of the whole image, packed, from a mapping of its size.
            with_queue(&ctx, |q| unsafe {
                write(q, m.real(), cl::CL_TRUE, [0usize; 3].as_ptr(), region.as_ptr(), 0, 0, file.ptr, 0, std::ptr::null(), null_mut())
            })?
        }
    };
    check(&format!("writing memory object {id}"), code)?;
    o::registry().pending.remove(&id);
    Ok(())
}

/// Set in a job's environment (by tests), the layer overwrites every memory object before
/// it releases it: a platform that hands the same memory back when the object is made again
/// (PoCL's CPU drivers do) would otherwise hide bytes hiber failed to load.
pub const POISON_ENV: &str = "HIBER_OPENCL_POISON";

fn poison() -> Result<(), String> {
    let fill = f!(clEnqueueFillBuffer);
    let write_image = f!(clEnqueueWriteImage);
    for (m, size, _) in saved_mems() {
        let (ctx, desc) = mem_parts(&m)?;
        let pattern = 0xa5a5_a5a5u32;
        let code = match desc {
            // SAFETY: a fill of the whole buffer with a 4-byte pattern (sizes are multiples
            // of 4 here, or the fill fails and says so).
            None => with_queue(&ctx, |q| unsafe {
                fill(q, m.real(), &pattern as *const u32 as *const c_void, if size % 4 == 0 { 4 } else { 1 }, 0, size, 0, std::ptr::null(), null_mut())
            })?,
            Some(d) => {
                let junk = vec![0xa5u8; size];
                let region = image_region(&d);
                // SAFETY: a blocking write of the whole image from a buffer of its size.
                with_queue(&ctx, |q| unsafe {
                    write_image(
                        q,
                        m.real(),
                        cl::CL_TRUE,
                        [0usize; 3].as_ptr(),
                        region.as_ptr(),
                        0,
                        0,
                        junk.as_ptr() as *const c_void,
                        0,
                        std::ptr::null(),
                        null_mut(),
                    )
                })?
            }
        };
        check(&format!("poisoning memory object {}", m.seq), code)?;
    }
    with_all_queues_finished()
}

fn with_all_queues_finished() -> Result<(), String> {
    let finish = f!(clFinish);
    for q in live(Kind::Queue) {
        // SAFETY: a real queue the layer holds.
        check("clFinish", unsafe { finish(q.real()) })?;
    }
    Ok(())
}

/// Events whose pending callbacks wait for the gate to open after a replay.
fn deferred() -> std::sync::MutexGuard<'static, Vec<Arc<Obj>>> {
    static DEFERRED: std::sync::Mutex<Vec<Arc<Obj>>> = std::sync::Mutex::new(Vec::new());
    DEFERRED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Opens the gate, then registers again the event callbacks a replay left pending (see
/// [`replay`]), each on the event made in place of the one it was registered on.
pub fn open_gate() {
    gate::open();
    let events = std::mem::take(&mut *deferred());
    for x in events {
        let pending = x.callbacks.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for p in pending {
            let r = o::register_event_callback(&x, p);
            if r != cl::CL_SUCCESS {
                crate::log(&format!("could not register an event callback again (error {r}); it will not run"));
            }
        }
    }
}

/// Releases every real object (the newest first); the records stay for [`replay`].
pub fn release() -> Result<(), String> {
    let get_event = f!(clGetEventInfo);
    let objects = o::all_live();
    for x in &objects {
        if x.kind != Kind::Event || x.real().is_null() {
            continue;
        }
        let real = x.real();
        // SAFETY: a real event and cl_int/cl_uint answers.
        let status: cl_int = info_value(|s, v, sr| unsafe { get_event(real, cl::CL_EVENT_COMMAND_EXECUTION_STATUS, s, v, sr) });
        // SAFETY: as above.
        let command: cl_uint = info_value(|s, v, sr| unsafe { get_event(real, cl::CL_EVENT_COMMAND_TYPE, s, v, sr) });
        if let Record::Event { status: st, command: c, .. } = &mut *x.rec() {
            *st = Some(status);
            *c = command;
        }
    }
    if std::env::var_os(POISON_ENV).is_some() {
        poison()?;
    }
    for x in objects.iter().rev() {
        if matches!(x.kind, Kind::Platform | Kind::Device) {
            continue;
        }
        let real = x.real();
        if !real.is_null() {
            // Forgotten first, then released: an event callback the platform runs from now
            // on finds its event's real object gone and leaves it for the replay.
            {
                let _callbacks = x.callbacks.lock().unwrap_or_else(|e| e.into_inner());
                x.set_real(null_mut());
            }
            o::release_real(x.kind, real);
        }
    }
    o::registry().released = true;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Replay

struct RealDevice {
    platform: H,
    platform_name: String,
    device: H,
    name: String,
    device_type: u64,
}

fn real_devices() -> Result<Vec<Vec<RealDevice>>, String> {
    let get_platforms = f!(clGetPlatformIDs);
    let get_devices = f!(clGetDeviceIDs);
    let mut n = 0;
    // SAFETY: counting platforms into our variable.
    check("listing OpenCL platforms", unsafe { get_platforms(0, null_mut(), &mut n) })?;
    let mut ps = vec![null_mut(); n as usize];
    // SAFETY: `n` platforms into a list of `n`.
    check("listing OpenCL platforms", unsafe { get_platforms(n, ps.as_mut_ptr(), null_mut()) })?;
    let mut out = Vec::new();
    for p in ps {
        let pname = platform_name(p);
        let mut nd = 0;
        // SAFETY: counting the platform's devices into our variable.
        if unsafe { get_devices(p, cl::CL_DEVICE_TYPE_ALL, 0, null_mut(), &mut nd) } != cl::CL_SUCCESS {
            out.push(Vec::new());
            continue;
        }
        let mut ds = vec![null_mut(); nd as usize];
        // SAFETY: `nd` devices into a list of `nd`.
        check("listing OpenCL devices", unsafe { get_devices(p, cl::CL_DEVICE_TYPE_ALL, nd, ds.as_mut_ptr(), null_mut()) })?;
        out.push(
            ds.into_iter()
                .map(|d| {
                    let (_, name, device_type) = device_identity(d);
                    RealDevice { platform: p, platform_name: pname.clone(), device: d, name, device_type }
                })
                .collect(),
        );
    }
    Ok(out)
}

fn pick<'a>(all: &'a [Vec<RealDevice>], selector: &str) -> Result<&'a RealDevice, String> {
    let listing = || {
        let mut s = Vec::new();
        for (pi, p) in all.iter().enumerate() {
            for (di, d) in p.iter().enumerate() {
                s.push(format!("{pi}:{di} {} / {}", d.platform_name, d.name));
            }
        }
        if s.is_empty() {
            "none".to_string()
        } else {
            s.join("; ")
        }
    };
    let found = match selector {
        "cpu" => all.iter().flatten().find(|d| d.device_type & cl::CL_DEVICE_TYPE_CPU != 0),
        "gpu" => all.iter().flatten().find(|d| d.device_type & cl::CL_DEVICE_TYPE_GPU != 0),
        s => match s.split_once(':').and_then(|(p, d)| Some((p.parse::<usize>().ok()?, d.parse::<usize>().ok()?))) {
            Some((p, d)) => all.get(p).and_then(|l| l.get(d)),
            None => return Err(format!("--opencl-device {s}: say cpu, gpu or PLATFORM:DEVICE (devices here: {})", listing())),
        },
    };
    found.ok_or_else(|| format!("no OpenCL device {selector} here (devices here: {})", listing()))
}

/// Re-creates every object from its record; `selector` moves the process's device.
pub fn replay(selector: Option<&str>) -> Result<(), String> {
    if !o::registry().released {
        return Ok(());
    }
    let all = real_devices()?;
    let objects = o::all_live();
    let used: Vec<Arc<Obj>> = {
        let mut used: Vec<Arc<Obj>> = Vec::new();
        for c in objects.iter().filter(|x| x.kind == Kind::Context) {
            if let Record::Context { devices, .. } = &*c.rec() {
                for d in devices {
                    if !used.iter().any(|u| Arc::ptr_eq(u, d)) {
                        used.push(d.clone());
                    }
                }
            }
        }
        used
    };
    // Every device the process uses moves onto the one named: a context made for several
    // devices (a whole platform's, say) becomes a context of one.
    let target = match selector {
        Some(s) => Some(pick(&all, s)?),
        None => None,
    };
    // Devices not in use first, so a used device's binding wins where two share a real one.
    let roots: Vec<Arc<Obj>> = objects.iter().filter(|x| x.kind == Kind::Device).cloned().collect();
    let mut order: Vec<&Arc<Obj>> = roots.iter().filter(|d| !used.iter().any(|u| Arc::ptr_eq(u, d))).collect();
    order.extend(roots.iter().filter(|d| used.iter().any(|u| Arc::ptr_eq(u, d))));
    for d in order {
        let is_used = used.iter().any(|u| Arc::ptr_eq(u, d));
        let (pname, name, ordinal) = match &*d.rec() {
            Record::Device { platform, name, ordinal, .. } => (
                match &*platform.rec() {
                    Record::Platform { name } => name.clone(),
                    _ => String::new(),
                },
                name.clone(),
                *ordinal,
            ),
            _ => continue,
        };
        let real = match target.filter(|_| is_used) {
            Some(t) => Some(t),
            // The same device by its platform's name, its own, and its place among those
            // of that name (the second of two GPUs of one model stays the second).
            None => all.iter().flatten().filter(|x| x.platform_name == pname && x.name == name).nth(ordinal),
        };
        match real {
            Some(rd) => {
                d.set_real(rd.device);
                let platform = match &*d.rec() {
                    Record::Device { platform, .. } => Some(platform.clone()),
                    _ => None,
                };
                if let Some(p) = platform {
                    p.set_real(rd.platform);
                }
            }
            None if is_used => {
                return Err(format!("no OpenCL device \"{pname} / {name}\" here; choose one with --opencl-device cpu, gpu or PLATFORM:DEVICE"));
            }
            None => d.set_real(null_mut()),
        }
    }
    // Platforms by their name too (in proxy mode a new proxy's handles are all new; a
    // platform none of whose devices the process listed has no device to be found by).
    rebind_platforms(&objects, &all)?;
    for x in &objects {
        if matches!(x.kind, Kind::Platform | Kind::Device) || !x.real().is_null() {
            continue;
        }
        let real = recreate(x).map_err(|e| format!("re-creating {:?} {}: {e}", x.kind, x.seq))?;
        x.set_real(real);
        if x.kind == Kind::Event && !x.callbacks.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
            // Callbacks that had not run are registered on the new event once the gate is
            // open ([`open_gate`]): an event already complete runs them at once, and they
            // may call OpenCL, and expect the memory objects' bytes back.
            deferred().push(x.clone());
        }
    }
    // Arguments last: a kernel's arguments may be objects made after it.
    for k in objects.iter().filter(|x| x.kind == Kind::Kernel) {
        set_args(k)?;
    }
    let pending = saved_mems().into_iter().map(|(m, _, _)| m.seq).collect();
    let mut reg = o::registry();
    reg.released = false;
    // The gate stays closed until hiber has written back every one of these.
    reg.pending = pending;
    Ok(())
}

/// Gives each platform object the real platform of its name (the n-th of that name for
/// the n-th object of that name), unless a device of it was bound to one already.
fn rebind_platforms(objects: &[Arc<Obj>], all: &[Vec<RealDevice>]) -> Result<(), String> {
    let platforms: Vec<&Arc<Obj>> = objects.iter().filter(|x| x.kind == Kind::Platform).collect();
    if platforms.is_empty() {
        return Ok(());
    }
    let bound: Vec<H> = all.iter().flatten().map(|d| d.platform).collect();
    let mut reals = real_platforms()?;
    // The ones a device moved onto are taken already.
    for p in &platforms {
        if bound.contains(&p.real()) {
            reals.retain(|(h, _)| *h != p.real());
        }
    }
    for p in platforms.into_iter().filter(|p| !bound.contains(&p.real())) {
        let name = match &*p.rec() {
            Record::Platform { name } => name.clone(),
            _ => continue,
        };
        match reals.iter().position(|(_, n)| *n == name) {
            Some(i) => p.set_real(reals.remove(i).0),
            None => p.set_real(null_mut()),
        }
    }
    Ok(())
}

fn real_platforms() -> Result<Vec<(H, String)>, String> {
    let get_platforms = f!(clGetPlatformIDs);
    let mut n = 0;
    // SAFETY: counting platforms into our variable.
    check("listing OpenCL platforms", unsafe { get_platforms(0, null_mut(), &mut n) })?;
    let mut ps = vec![null_mut(); n as usize];
    // SAFETY: `n` platforms into a list of `n`.
    check("listing OpenCL platforms", unsafe { get_platforms(n, ps.as_mut_ptr(), null_mut()) })?;
    Ok(ps.into_iter().map(|p| (p, platform_name(p))).collect())
}

fn real_list(objs: &[Arc<Obj>]) -> Vec<H> {
    let mut out: Vec<H> = Vec::new();
    for d in objs {
        // Two devices moved onto one become one.
        if !out.contains(&d.real()) {
            out.push(d.real());
        }
    }
    out
}

fn made(real: H, err: cl_int) -> Result<H, String> {
    if real.is_null() {
        Err(cl::error_name(if err == 0 { cl::CL_OUT_OF_HOST_MEMORY } else { err }))
    } else {
        Ok(real)
    }
}

fn recreate(x: &Arc<Obj>) -> Result<H, String> {
    let mut err = 0;
    let rec = x.rec();
    match &*rec {
        Record::Context { devices, platform, props, notify, user_data } => {
            let mut props = props.clone();
            for i in (0..props.len().saturating_sub(1)).step_by(2) {
                if props[i] == cl::CL_CONTEXT_PLATFORM {
                    let p = match (platform, devices.first()) {
                        // The platform of the device the context now has.
                        (_, Some(d)) => device_identity(d.real()).0,
                        (Some(p), None) => p.real(),
                        (None, None) => null_mut(),
                    };
                    props[i + 1] = p as isize;
                }
            }
            let devs = real_list(devices);
            let create = f!(clCreateContext);
            let pp = if props.is_empty() { std::ptr::null() } else { props.as_ptr() };
            // SAFETY: real devices and a property list with the real platform.
            made(unsafe { create(pp, devs.len() as u32, devs.as_ptr(), *notify, *user_data as *mut c_void, &mut err) }, err)
        }
        Record::Queue { context, device, props } => {
            if let Some(create) = cl::real().and_then(|r| r.clCreateCommandQueueWithProperties) {
                // SAFETY: real context and device, and a zero-terminated property list.
                return made(unsafe { create(context.real(), device.real(), props.as_ptr(), &mut err) }, err);
            }
            let bits = props.chunks(2).find(|kv| kv[0] == cl::CL_QUEUE_PROPERTIES).and_then(|kv| kv.get(1).copied()).unwrap_or(0);
            let create = f!(clCreateCommandQueue);
            // SAFETY: real context and device.
            made(unsafe { create(context.real(), device.real(), bits, &mut err) }, err)
        }
        Record::Mem { context, flags, size, host_ptr, props, shape } => {
            // Without COPY_HOST_PTR (the bytes come from the image), nor the host-access
            // promises (hiber writes the bytes back from the host).
            let flags = flags & !(cl::CL_MEM_COPY_HOST_PTR | cl::CL_MEM_HOST_ACCESS);
            let hp = *host_ptr as *mut c_void;
            match shape {
                Shape::Buffer if props.is_empty() => {
                    let create = f!(clCreateBuffer);
                    // SAFETY: the recorded arguments; a host pointer only for USE_HOST_PTR,
                    // whose memory CRIU restored at the same address.
                    made(unsafe { create(context.real(), flags, *size, hp, &mut err) }, err)
                }
                Shape::Buffer => {
                    let create = f!(clCreateBufferWithProperties);
                    // SAFETY: as above, with the recorded zero-terminated properties.
                    made(unsafe { create(context.real(), props.as_ptr(), flags, *size, hp, &mut err) }, err)
                }
                Shape::Sub { parent, origin } => {
                    let create = f!(clCreateSubBuffer);
                    let region = cl::BufferRegion { origin: *origin, size: *size };
                    // SAFETY: the real parent and a region of it, as recorded.
                    made(unsafe { create(parent.real(), flags, cl::CL_BUFFER_CREATE_TYPE_REGION, &region as *const _ as *const c_void, &mut err) }, err)
                }
                Shape::Image { format, desc, buffer, .. } => {
                    let mut d = *desc;
                    d.buffer = buffer.as_ref().map_or(null_mut(), |b| b.real());
                    if hp.is_null() && d.buffer.is_null() {
                        // Pitches describe a host pointer's layout; without one they must be 0.
                        d.row_pitch = 0;
                        d.slice_pitch = 0;
                    }
                    let create = f!(clCreateImage);
                    // SAFETY: the recorded format and description with the real buffer.
                    made(unsafe { create(context.real(), flags, format, &d, hp, &mut err) }, err)
                }
            }
        }
        Record::Sampler { context, props } => {
            let create = f!(clCreateSamplerWithProperties);
            // SAFETY: the real context and a zero-terminated property list.
            made(unsafe { create(context.real(), props.as_ptr(), &mut err) }, err)
        }
        Record::Program { context, source, build } => {
            let p = match source {
                ProgramSource::Text(text) => {
                    let create = f!(clCreateProgramWithSource);
                    let (ptr, len) = (text.as_ptr() as *const i8, text.len());
                    // SAFETY: one string of `len` bytes.
                    made(unsafe { create(context.real(), 1, &ptr, &len, &mut err) }, err)?
                }
                ProgramSource::Il(il) => {
                    let create = f!(clCreateProgramWithIL);
                    // SAFETY: the recorded IL bytes.
                    made(unsafe { create(context.real(), il.as_ptr() as *const c_void, il.len(), &mut err) }, err)?
                }
                ProgramSource::Binary(bins) => {
                    for (d, _) in bins {
                        let was = describe_device(d).1;
                        let now = device_identity(d.real()).1;
                        if !was.ends_with(&format!(" / {now}")) {
                            return Err(format!(
                                "the program was made from a binary for {was}; a binary cannot move to {now} (build it from source or IL to move it)"
                            ));
                        }
                    }
                    let create = f!(clCreateProgramWithBinary);
                    let devs: Vec<H> = bins.iter().map(|(d, _)| d.real()).collect();
                    let lens: Vec<usize> = bins.iter().map(|(_, b)| b.len()).collect();
                    let ptrs: Vec<*const u8> = bins.iter().map(|(_, b)| b.as_ptr()).collect();
                    // SAFETY: one binary per real device, as recorded.
                    made(unsafe { create(context.real(), devs.len() as u32, devs.as_ptr(), lens.as_ptr(), ptrs.as_ptr(), null_mut(), &mut err) }, err)?
                }
            };
            if let Some((devices, options)) = build {
                let build_fn = f!(clBuildProgram);
                let devs = real_list(devices);
                let dp = if devs.is_empty() { std::ptr::null() } else { devs.as_ptr() };
                // SAFETY: the new real program, real devices and the recorded options.
                let code = unsafe { build_fn(p, devs.len() as u32, dp, options.as_ptr(), None, null_mut()) };
                if code != cl::CL_SUCCESS {
                    let log = build_log(p, devices.first().map(|d| d.real()));
                    o::release_real(Kind::Program, p);
                    return Err(format!("building it again: {}{}", cl::error_name(code), if log.is_empty() { String::new() } else { format!(": {log}") }));
                }
            }
            Ok(p)
        }
        Record::Kernel { program, name, .. } => {
            let create = f!(clCreateKernel);
            // SAFETY: the real program and the recorded kernel name.
            made(unsafe { create(program.real(), name.as_ptr(), &mut err) }, err)
        }
        Record::Event { context, status, user, .. } => {
            let create = f!(clCreateUserEvent);
            let set = f!(clSetUserEventStatus);
            // SAFETY: the real context.
            let e = made(unsafe { create(context.real(), &mut err) }, err)?;
            // A command that had run (complete, or failed with its error) is a user event
            // in that state; a user event not yet set stays open for the application.
            match status {
                Some(s) if *s <= cl::CL_COMPLETE => {
                    // SAFETY: the user event just made.
                    unsafe { set(e, *s) };
                }
                _ if !user => {
                    // SAFETY: as above.
                    unsafe { set(e, cl::CL_COMPLETE) };
                }
                _ => {}
            }
            Ok(e)
        }
        Record::Opaque { what } => Err(format!("it was made by {what}, which hiber cannot re-create")),
        Record::Platform { .. } | Record::Device { .. } => Ok(x.real()),
    }
}

fn build_log(p: H, d: Option<H>) -> String {
    let (Some(f), Some(d)) = (cl::real().and_then(|r| r.clGetProgramBuildInfo), d) else { return String::new() };
    const CL_PROGRAM_BUILD_LOG: u32 = 0x1183;
    // SAFETY: a real program and device, and buffers of the sizes given.
    let s = info_string(|sz, v, sr| unsafe { f(p, d, CL_PROGRAM_BUILD_LOG, sz, v, sr) });
    s.lines().take(3).collect::<Vec<_>>().join(" | ")
}

fn set_args(k: &Arc<Obj>) -> Result<(), String> {
    let set = f!(clSetKernelArg);
    let args = match &*k.rec() {
        Record::Kernel { args, .. } => args.clone(),
        _ => return Ok(()),
    };
    for (i, a) in args {
        let code = match a {
            // SAFETY: the recorded bytes of the argument.
            Arg::Bytes(b) => unsafe { set(k.real(), i, b.len(), b.as_ptr() as *const c_void) },
            // SAFETY: local memory of the recorded size.
            Arg::Local(n) => unsafe { set(k.real(), i, n, std::ptr::null()) },
            Arg::Object(x) => {
                let h = x.real();
                // SAFETY: a pointer to the object's new real handle.
                unsafe { set(k.real(), i, std::mem::size_of::<H>(), &h as *const H as *const c_void) }
            }
        };
        check(&format!("setting argument {i} of kernel {}", k.seq), code)?;
    }
    Ok(())
}
