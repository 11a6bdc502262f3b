//! The application's side: one stub per entry point of [`cl::Real`], each with the
//! loader's exact signature. A stub copies its in-memory inputs into a request
//! ([`super::wire`]), calls or posts it over the current transport, and writes the
//! answer's outputs where the caller asked (see [`super`] for what is posted, how memory
//! and maps travel, and what is not supported).
//!
//! Every stub's safety contract is the OpenCL specification's: it trusts its pointers as
//! the loader would. No stub unwinds: a panic becomes `CL_OUT_OF_HOST_MEMORY`.

#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::null_mut;
use std::sync::{Mutex, OnceLock};

use super::wire::{self, Layout, Op, Reader, WireError, Writer, MODE_CALL, MODE_POST};
use super::{add_callback, peer, remove_callback, transport, transport_and_generation, Callback};
use crate::cl::{self, cl_bitfield, cl_bool, cl_int, cl_uint, BufferRegion, ImageDesc, ImageFormat, Real, H};

type R<T> = Result<T, cl_int>;

const CL_OUT_OF_RESOURCES: cl_int = -5;
const CL_INVALID_HOST_PTR: cl_int = -37;
const CL_INVALID_WORK_DIMENSION: cl_int = -53;
const CL_MEM_TYPE: cl_uint = 0x1100;
const CL_MEM_HOST_PTR: cl_uint = 0x1103;
const CL_PROGRAM_BINARIES: cl_uint = 0x1166;
const CL_MAP_WRITE: u64 = 1 << 1;
const CL_MAP_WRITE_INVALIDATE_REGION: u64 = 1 << 2;
/// The most work dimensions a stub copies (OpenCL devices have 3).
const MAX_DIMS: cl_uint = 16;

impl From<WireError> for cl_int {
    fn from(_: WireError) -> cl_int {
        crate::log("remote: a malformed answer from the proxy");
        CL_OUT_OF_RESOURCES
    }
}

// ---------------------------------------------------------------------------------------
// Requests and answers.

fn begin(op: Op, mode: u8) -> Writer {
    let mut w = Writer::new();
    w.u16(op as u16);
    w.u8(mode);
    w
}

/// A call's answer, past its `deferred` field.
struct Answer {
    buf: Vec<u8>,
    deferred: cl_int,
}

impl Answer {
    fn reader(&self) -> Reader<'_> {
        Reader::new(&self.buf[4..])
    }
}

fn call(w: Writer) -> R<Answer> {
    call_in_order(w, true)
}

/// `after_posts` false: the proxy handles it at once, not after the posts made before it.
fn call_in_order(w: Writer, after_posts: bool) -> R<Answer> {
    let t = transport().ok_or(CL_OUT_OF_RESOURCES)?;
    let sent = if after_posts { t.call(&w.buf) } else { t.call_unordered(&w.buf) };
    let buf = sent.map_err(|e| {
        crate::log(&format!("remote: the job's OpenCL proxy did not answer ({e}); the call fails with CL_OUT_OF_RESOURCES"));
        CL_OUT_OF_RESOURCES
    })?;
    let deferred = Reader::new(&buf).i32()?;
    if deferred != cl::CL_SUCCESS {
        crate::log(&format!("remote: an earlier posted call failed in the proxy: {}", cl::error_name(deferred)));
    }
    Ok(Answer { buf, deferred })
}

fn post(w: Writer) -> R<()> {
    let t = transport().ok_or(CL_OUT_OF_RESOURCES)?;
    t.post(&w.buf).map_err(|e| {
        crate::log(&format!("remote: the job's OpenCL proxy did not take a call ({e}); it fails with CL_OUT_OF_RESOURCES"));
        CL_OUT_OF_RESOURCES
    })
}

/// Calls `w` and returns the answer's reader position past `rc`, failing with `rc`.
fn call_ok(w: Writer) -> R<Answer> {
    let a = call(w)?;
    let rc = a.reader().i32()?;
    if rc != cl::CL_SUCCESS {
        return Err(rc);
    }
    Ok(a)
}

/// Reads `rc` (already known to be success) off an answer's reader.
fn skip_rc<'a>(a: &'a Answer) -> R<Reader<'a>> {
    let mut r = a.reader();
    r.i32()?;
    Ok(r)
}

/// A call that returns only its code; with `surface`, a deferred error too.
fn call_code(w: Writer, surface: bool) -> R<()> {
    let a = call(w)?;
    let rc = a.reader().i32()?;
    if rc != cl::CL_SUCCESS {
        return Err(rc);
    }
    if surface && a.deferred != cl::CL_SUCCESS {
        return Err(a.deferred);
    }
    Ok(())
}

/// A create's call: its handle.
fn call_made(w: Writer) -> R<H> {
    let a = call_ok(w)?;
    let h = skip_rc(&a)?.h()?;
    Ok(h)
}

// ---------------------------------------------------------------------------------------
// What every stub shares: no unwinding, outputs written only where asked.

fn code(f: impl FnOnce() -> R<()>) -> cl_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => cl::CL_SUCCESS,
        Ok(Err(c)) => c,
        Err(_) => {
            crate::log("remote: a stub panicked");
            cl::CL_OUT_OF_HOST_MEMORY
        }
    }
}

fn handle(errcode_ret: *mut cl_int, f: impl FnOnce() -> R<H>) -> H {
    let (h, err) = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(h)) => (h, cl::CL_SUCCESS),
        Ok(Err(c)) => (null_mut(), c),
        Err(_) => {
            crate::log("remote: a stub panicked");
            (null_mut(), cl::CL_OUT_OF_HOST_MEMORY)
        }
    };
    // SAFETY: a non-null `errcode_ret` points to a cl_int the application owns.
    unsafe { out(errcode_ret, err) };
    h
}

/// Writes `v` through `p` when the application gave one.
unsafe fn out<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: a non-null output pointer points to a `T` the application owns.
        unsafe { p.write_unaligned(v) };
    }
}

/// `n` items at `p`, or none when `p` is null.
unsafe fn slice<'a, T>(p: *const T, n: usize) -> &'a [T] {
    if p.is_null() || n == 0 {
        &[]
    } else {
        // SAFETY: the spec has the application pass `n` items at a non-null `p`.
        unsafe { std::slice::from_raw_parts(p, n) }
    }
}

/// A C string's bytes (without the NUL), or `None` for null.
unsafe fn cstr<'a>(p: *const i8) -> Option<&'a [u8]> {
    // SAFETY: a non-null string argument is NUL-terminated, as the spec requires.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_bytes())
}

/// A 0-terminated property list, terminator included, as `i64`s.
unsafe fn props<T: Copy + Into<i64>>(p: *const T) -> Option<Vec<i64>> {
    if p.is_null() {
        return None;
    }
    let mut v = Vec::new();
    let mut i = 0;
    loop {
        // SAFETY: the list is pairs ended by a 0 key, as the spec requires.
        let key = unsafe { *p.add(i) }.into();
        v.push(key);
        if key == 0 {
            return Some(v);
        }
        // SAFETY: as above; a non-zero key has a value.
        v.push(unsafe { *p.add(i + 1) }.into());
        i += 2;
    }
}

fn isize_props(p: *const isize) -> Option<Vec<i64>> {
    // SAFETY: forwarded from the stub's caller; `isize` is 64 bits on the platforms hiber
    // supports, so the cast keeps every value.
    unsafe { props(p.cast::<i64>()) }
}

fn u64_props(p: *const u64) -> Option<Vec<i64>> {
    // SAFETY: as above; property values are bit patterns, kept by the cast.
    unsafe { props(p.cast::<i64>()) }
}

/// Copies an answer's value into the application's `value` (of `size` bytes).
unsafe fn copy_value(bytes: &[u8], size: usize, value: *mut c_void) -> R<()> {
    if value.is_null() {
        return Ok(());
    }
    if bytes.len() > size {
        return Err(cl::CL_INVALID_VALUE);
    }
    // SAFETY: `value` holds `size` bytes, at least `bytes.len()`.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), value.cast::<u8>(), bytes.len()) };
    Ok(())
}

/// Answers an info query from a value known here.
unsafe fn local_value(bytes: &[u8], size: usize, value: *mut c_void, size_ret: *mut usize) -> R<()> {
    if !value.is_null() && size < bytes.len() {
        return Err(cl::CL_INVALID_VALUE);
    }
    // SAFETY: forwarded.
    unsafe {
        copy_value(bytes, size, value)?;
        out(size_ret, bytes.len());
    }
    Ok(())
}

/// Copies packed `data` into the application's region at `base`.
unsafe fn unpack(layout: &Layout, base: *mut u8, data: &[u8]) -> R<()> {
    if Some(data.len()) != layout.packed_len() {
        return Err(CL_OUT_OF_RESOURCES);
    }
    let mut i = 0;
    layout.each_row(|off| {
        // SAFETY: the application's region holds the layout's footprint at `base`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(i), base.add(off), layout.row) };
        i += layout.row;
    });
    Ok(())
}

/// The application's region at `base`, packed.
unsafe fn pack(layout: &Layout, base: *const u8) -> R<Vec<u8>> {
    let len = layout.footprint().ok_or(cl::CL_INVALID_VALUE)?;
    // SAFETY: the application's region holds the layout's footprint at `base`.
    Ok(layout.pack(unsafe { slice(base, len) }))
}

fn unsupported(name: &'static str) {
    static SEEN: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    if SEEN.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashSet::new).insert(name) {
        crate::log(&format!("remote: {name} is not supported through the OpenCL proxy"));
    }
}

// ---------------------------------------------------------------------------------------
// Memory objects as the application made them, and its maps.

/// How the application made a memory object.
#[derive(Clone, Copy, Default)]
struct MemRecord {
    flags: u64,
    /// The application's host memory of a `CL_MEM_USE_HOST_PTR` object, else 0.
    host: usize,
    image: Option<ImageShape>,
}

/// An image's element size, type and format order, and, for one with host memory, that
/// memory's pitches (resolved from OpenCL's defaults).
#[derive(Clone, Copy, Default)]
struct ImageShape {
    elem: usize,
    ty: cl_uint,
    order: cl_uint,
    row_pitch: usize,
    slice_pitch: usize,
}

/// A map the application holds: where its bytes live in the proxy, and in the application.
struct AppMap {
    proxy: u64,
    write: bool,
    layout: Layout,
    /// The pages the stub mapped for it (freed at unmap), or `None` for host memory.
    owned: Option<usize>,
}

fn mems() -> std::sync::MutexGuard<'static, HashMap<u64, MemRecord>> {
    static MEMS: OnceLock<Mutex<HashMap<u64, MemRecord>>> = OnceLock::new();
    MEMS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// Maps not yet unmapped, by (memory object, application pointer).
type MapTable = HashMap<(u64, usize), Vec<AppMap>>;

fn maps() -> std::sync::MutexGuard<'static, MapTable> {
    static MAPS: OnceLock<Mutex<MapTable>> = OnceLock::new();
    MAPS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

fn key(h: H) -> u64 {
    h as usize as u64
}

fn record(h: H, rec: MemRecord) {
    mems().insert(key(h), rec);
}

fn recorded(h: H) -> Option<MemRecord> {
    mems().get(&key(h)).copied()
}

/// An image's element size and type: recorded at its creation, else asked of the proxy.
fn image_shape(m: H) -> R<ImageShape> {
    if let Some(s) = recorded(m).and_then(|r| r.image) {
        return Ok(s);
    }
    let (mut elem, mut ty) = (0usize, 0 as cl_uint);
    // SAFETY: each value is a local of the size passed.
    unsafe {
        ok(code(|| info(Op::GetImageInfo, |w| w.h(m), cl::CL_IMAGE_ELEMENT_SIZE, 8, (&mut elem as *mut usize).cast(), null_mut())))?;
        ok(code(|| info(Op::GetMemObjectInfo, |w| w.h(m), CL_MEM_TYPE, 4, (&mut ty as *mut cl_uint).cast(), null_mut())))?;
    }
    let shape = ImageShape { elem, ty, ..Default::default() };
    mems().entry(key(m)).or_default().image = Some(shape);
    Ok(shape)
}

fn ok(c: cl_int) -> R<()> {
    if c == cl::CL_SUCCESS {
        Ok(())
    } else {
        Err(c)
    }
}

/// Page-aligned memory for a map's copy.
fn map_pages(len: usize) -> R<*mut u8> {
    // SAFETY: an anonymous private mapping, asking nothing of existing memory.
    let p = unsafe { libc::mmap(null_mut(), len.max(1), libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    if p == libc::MAP_FAILED {
        return Err(cl::CL_OUT_OF_HOST_MEMORY);
    }
    Ok(p.cast())
}

fn unmap_pages(p: usize, len: usize) {
    // SAFETY: `p` is a mapping of `len.max(1)` bytes that `map_pages` made for a map the
    // application has just given back.
    unsafe { libc::munmap(p as *mut c_void, len.max(1)) };
}

// ---------------------------------------------------------------------------------------
// Shapes of requests that many stubs share.

/// An info query: `head` writes the handles, then param, size, whether a value is wanted.
unsafe fn info(op: Op, head: impl FnOnce(&mut Writer), param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> R<()> {
    let mut w = begin(op, MODE_CALL);
    head(&mut w);
    w.u32(param);
    w.usize(size);
    w.bool(!value.is_null());
    let a = call_ok(w)?;
    let mut r = skip_rc(&a)?;
    let (bytes, sr) = (r.bytes()?, r.usize()?);
    // SAFETY: forwarded.
    unsafe {
        copy_value(bytes, size, value)?;
        out(size_ret, sr);
    }
    Ok(())
}

/// A list query (`num_entries, out, num_out`).
unsafe fn list(op: Op, head: impl FnOnce(&mut Writer), n: cl_uint, outp: *mut H, num: *mut cl_uint) -> R<()> {
    let mut w = begin(op, MODE_CALL);
    head(&mut w);
    w.u32(n);
    w.bool(!outp.is_null());
    let a = call_ok(w)?;
    let mut r = skip_rc(&a)?;
    let (v, total) = (r.handles()?, r.u32()?);
    if !outp.is_null() {
        if v.len() > n as usize {
            return Err(CL_OUT_OF_RESOURCES);
        }
        // SAFETY: `outp` has room for `n` handles, at least `v.len()`.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), outp, v.len()) };
    }
    // SAFETY: forwarded.
    unsafe { out(num, total) };
    Ok(())
}

/// Writes a wait list.
unsafe fn waits(w: &mut Writer, n: cl_uint, list: *const H) {
    // SAFETY: the list holds `n` events.
    w.handles(unsafe { slice(list, n as usize) });
}

/// Reads an enqueue's event part (`bool`, event) into `event`.
unsafe fn event_out(r: &mut Reader, event: *mut H) -> R<()> {
    if r.bool()? {
        let e = r.h()?;
        // SAFETY: forwarded.
        unsafe { out(event, e) };
    }
    Ok(())
}

/// An enqueue: `build` writes the arguments and the wait list; this adds whether an event
/// is wanted, and posts it when `may_post` and no event is wanted.
unsafe fn enqueue(op: Op, may_post: bool, event: *mut H, build: impl FnOnce(&mut Writer)) -> R<()> {
    let posted = may_post && event.is_null();
    let mut w = begin(op, if posted { MODE_POST } else { MODE_CALL });
    build(&mut w);
    w.bool(!event.is_null());
    if posted {
        return post(w);
    }
    let a = call_ok(w)?;
    let mut r = skip_rc(&a)?;
    // SAFETY: forwarded.
    unsafe { event_out(&mut r, event) }
}

/// Whether this connection's proxy reads and writes this process's memory itself for bulk
/// transfers ([`peer`]): asked once per connection, with a [`peer::Probe`].
fn peer_memory() -> bool {
    static KNOWN: Mutex<Option<(u64, bool)>> = Mutex::new(None);
    if !peer::allowed() {
        return false;
    }
    let Some((t, generation)) = transport_and_generation() else { return false };
    let mut known = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((g, ok)) = *known {
        if g == generation {
            return ok;
        }
    }
    let probe = peer::Probe::new();
    let mut w = begin(Op::PeerMemory, MODE_CALL);
    w.u64(probe.addr());
    let echoed = t.call(&w.buf).ok().and_then(|buf| {
        let mut r = Reader::new(&buf);
        r.i32().ok()?;
        (r.i32().ok()? == cl::CL_SUCCESS).then(|| r.bytes().ok().map(|b| probe.matches(b)))?
    });
    let ok = echoed == Some(true);
    crate::log(if ok {
        "remote: bulk transfers go straight between this process's memory and the proxy's"
    } else {
        "remote: the proxy does not reach this process's memory; bulk transfers go through the channel"
    });
    *known = Some((generation, ok));
    ok
}

/// Posts a call that takes one handle (releases, retains, flush).
fn post_handle(op: Op, h: H) -> cl_int {
    code(|| {
        let mut w = begin(op, MODE_POST);
        w.h(h);
        post(w)
    })
}

fn call_handle(op: Op, h: H, surface: bool) -> cl_int {
    code(|| {
        let mut w = begin(op, MODE_CALL);
        w.h(h);
        call_code(w, surface)
    })
}

/// A buffer create: `head` writes the context (and properties).
unsafe fn create_buffer(op: Op, head: impl FnOnce(&mut Writer), flags: u64, size: usize, host: *mut c_void) -> R<H> {
    let has_host = flags & (cl::CL_MEM_USE_HOST_PTR | cl::CL_MEM_COPY_HOST_PTR) != 0;
    if !host.is_null() && !has_host {
        return Err(CL_INVALID_HOST_PTR);
    }
    let mut w = begin(op, MODE_CALL);
    head(&mut w);
    w.u64(flags);
    w.usize(size);
    // SAFETY: with a host-pointer flag, `host` holds `size` bytes.
    w.opt_bytes((!host.is_null()).then(|| unsafe { slice(host.cast::<u8>(), size) }));
    let h = call_made(w)?;
    let use_host = flags & cl::CL_MEM_USE_HOST_PTR != 0;
    record(h, MemRecord { flags, host: if use_host { host as usize } else { 0 }, image: None });
    Ok(h)
}

/// An image create: `head` writes the context (and properties).
unsafe fn create_image(op: Op, head: impl FnOnce(&mut Writer), flags: u64, fmt: *const ImageFormat, desc: *const ImageDesc, host: *mut c_void) -> R<H> {
    if fmt.is_null() {
        return Err(-39); // CL_INVALID_IMAGE_FORMAT_DESCRIPTOR
    }
    if desc.is_null() {
        return Err(-65); // CL_INVALID_IMAGE_DESCRIPTOR
    }
    // SAFETY: both point to the structs the spec defines.
    let (fmt, desc) = unsafe { (*fmt, *desc) };
    let elem = wire::element_size(fmt.order, fmt.data_type).ok_or(-39)?;
    let has_host = flags & (cl::CL_MEM_USE_HOST_PTR | cl::CL_MEM_COPY_HOST_PTR) != 0;
    if !host.is_null() && !has_host {
        return Err(CL_INVALID_HOST_PTR);
    }
    let host_layout = wire::image_layout(elem, desc.image_type, wire::image_extent(&desc), desc.row_pitch, desc.slice_pitch).ok_or(cl::CL_INVALID_VALUE)?;
    let mut w = begin(op, MODE_CALL);
    head(&mut w);
    w.u64(flags);
    w.u32(fmt.order);
    w.u32(fmt.data_type);
    w.u32(desc.image_type);
    for x in [desc.width, desc.height, desc.depth, desc.array_size, desc.row_pitch, desc.slice_pitch] {
        w.usize(x);
    }
    w.u32(desc.num_mip_levels);
    w.u32(desc.num_samples);
    w.h(desc.buffer);
    let len = host_layout.footprint().ok_or(cl::CL_INVALID_VALUE)?;
    // SAFETY: with a host-pointer flag, `host` holds the image's bytes at its pitches.
    w.opt_bytes((!host.is_null()).then(|| unsafe { slice(host.cast::<u8>(), len) }));
    let h = call_made(w)?;
    let (row_pitch, slice_pitch) = if desc.image_type == cl::CL_MEM_OBJECT_IMAGE1D_ARRAY {
        (host_layout.row.max(desc.row_pitch), host_layout.row_pitch)
    } else {
        (host_layout.row_pitch, host_layout.slice_pitch)
    };
    let shape = ImageShape { elem, ty: desc.image_type, order: fmt.order, row_pitch, slice_pitch };
    let use_host = flags & cl::CL_MEM_USE_HOST_PTR != 0;
    record(h, MemRecord { flags, host: if use_host { host as usize } else { 0 }, image: Some(shape) });
    Ok(h)
}

/// The application's rect region: where it starts and how it is laid out.
unsafe fn rect(host_origin: *const usize, region: *const usize, row_pitch: usize, slice_pitch: usize) -> R<(usize, Layout, [usize; 3])> {
    // SAFETY: forwarded from the stub's caller.
    let (ho, region) = unsafe { (triple(host_origin)?, triple(region)?) };
    let rp = if row_pitch == 0 { region[0] } else { row_pitch };
    let sp = if slice_pitch == 0 { region[1].checked_mul(rp).ok_or(cl::CL_INVALID_VALUE)? } else { slice_pitch };
    let start = ho[2].checked_mul(sp).and_then(|a| a.checked_add(ho[1].checked_mul(rp)?)).and_then(|a| a.checked_add(ho[0])).ok_or(cl::CL_INVALID_VALUE)?;
    Ok((start, Layout { row: region[0], rows: region[1], row_pitch: rp, slices: region[2], slice_pitch: sp }, region))
}

/// Three `usize`s at `p` (an origin or region).
unsafe fn triple(p: *const usize) -> R<[usize; 3]> {
    if p.is_null() {
        return Err(cl::CL_INVALID_VALUE);
    }
    // SAFETY: origins and regions are three `size_t`s.
    Ok(unsafe { [*p, *p.add(1), *p.add(2)] })
}

fn write_triple(w: &mut Writer, t: [usize; 3]) {
    t.iter().for_each(|&x| w.usize(x));
}

/// The pitches a map answers for an image region laid out so.
fn map_pitches(shape: &ImageShape, layout: &Layout) -> (usize, usize) {
    match shape.ty {
        cl::CL_MEM_OBJECT_IMAGE1D_ARRAY => (layout.row, layout.row_pitch),
        cl::CL_MEM_OBJECT_IMAGE3D | cl::CL_MEM_OBJECT_IMAGE2D_ARRAY => (layout.row_pitch, layout.slice_pitch),
        _ => (layout.row_pitch, 0),
    }
}

// ---------------------------------------------------------------------------------------
// The stubs, in `cl::Real`'s order.

type Notify = cl::Notify;
type ProgramNotify = cl::ProgramNotify;
type EventNotify = cl::EventNotify;

pub unsafe extern "C" fn clGetPlatformIDs(n: cl_uint, platforms: *mut H, num: *mut cl_uint) -> cl_int {
    // SAFETY: the application's pointers, valid as the spec requires of its caller (this
    // holds for every stub below).
    code(|| unsafe { list(Op::GetPlatformIDs, |_| {}, n, platforms, num) })
}

pub unsafe extern "C" fn clGetPlatformInfo(p: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetPlatformInfo, |w| w.h(p), param, size, value, size_ret) })
}

pub unsafe extern "C" fn clGetDeviceIDs(p: H, t: cl_bitfield, n: cl_uint, devices: *mut H, num: *mut cl_uint) -> cl_int {
    let head = |w: &mut Writer| {
        w.h(p);
        w.u64(t);
    };
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { list(Op::GetDeviceIDs, head, n, devices, num) })
}

pub unsafe extern "C" fn clGetDeviceInfo(d: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetDeviceInfo, |w| w.h(d), param, size, value, size_ret) })
}

pub unsafe extern "C" fn clCreateSubDevices(d: H, properties: *const isize, n: cl_uint, devices: *mut H, num: *mut cl_uint) -> cl_int {
    let head = |w: &mut Writer| {
        w.h(d);
        w.opt_i64s(isize_props(properties).as_deref());
    };
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { list(Op::CreateSubDevices, head, n, devices, num) })
}

pub unsafe extern "C" fn clGetDeviceAndHostTimer(d: H, device: *mut u64, host: *mut u64) -> cl_int {
    code(|| {
        let mut w = begin(Op::GetDeviceAndHostTimer, MODE_CALL);
        w.h(d);
        let a = call_ok(w)?;
        let mut r = skip_rc(&a)?;
        let (x, y) = (r.u64()?, r.u64()?);
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe {
            out(device, x);
            out(host, y);
        }
        Ok(())
    })
}

pub unsafe extern "C" fn clGetHostTimer(d: H, host: *mut u64) -> cl_int {
    code(|| {
        let mut w = begin(Op::GetHostTimer, MODE_CALL);
        w.h(d);
        let a = call_ok(w)?;
        let x = skip_rc(&a)?.u64()?;
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe { out(host, x) };
        Ok(())
    })
}

/// Keeps a context's notify function for the proxy's trampoline; 0 for none.
fn context_callback(notify: Notify, user_data: *mut c_void) -> u64 {
    notify.map_or(0, |f| add_callback(Callback::Context(f, user_data as usize)))
}

pub unsafe extern "C" fn clCreateContext(
    props: *const isize,
    n: cl_uint,
    devices: *const H,
    notify: Notify,
    user_data: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    handle(errcode_ret, || {
        let id = context_callback(notify, user_data);
        let mut w = begin(Op::CreateContext, MODE_CALL);
        w.opt_i64s(isize_props(props).as_deref());
        // SAFETY: as in `clGetPlatformIDs`.
        w.handles(unsafe { slice(devices, n as usize) });
        w.u64(id);
        call_made(w).inspect_err(|_| remove_callback(id))
    })
}

pub unsafe extern "C" fn clCreateContextFromType(props: *const isize, t: cl_bitfield, notify: Notify, user_data: *mut c_void, errcode_ret: *mut cl_int) -> H {
    handle(errcode_ret, || {
        let id = context_callback(notify, user_data);
        let mut w = begin(Op::CreateContextFromType, MODE_CALL);
        w.opt_i64s(isize_props(props).as_deref());
        w.u64(t);
        w.u64(id);
        call_made(w).inspect_err(|_| remove_callback(id))
    })
}

pub unsafe extern "C" fn clReleaseContext(c: H) -> cl_int {
    post_handle(Op::ReleaseContext, c)
}

pub unsafe extern "C" fn clGetContextInfo(c: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetContextInfo, |w| w.h(c), param, size, value, size_ret) })
}

pub unsafe extern "C" fn clCreateCommandQueue(c: H, d: H, props: cl_bitfield, errcode_ret: *mut cl_int) -> H {
    handle(errcode_ret, || {
        let mut w = begin(Op::CreateCommandQueue, MODE_CALL);
        w.h(c);
        w.h(d);
        w.u64(props);
        call_made(w)
    })
}

pub unsafe extern "C" fn clCreateCommandQueueWithProperties(c: H, d: H, props: *const u64, errcode_ret: *mut cl_int) -> H {
    handle(errcode_ret, || {
        let mut w = begin(Op::CreateCommandQueueWithProperties, MODE_CALL);
        w.h(c);
        w.h(d);
        w.opt_i64s(u64_props(props).as_deref());
        call_made(w)
    })
}

pub unsafe extern "C" fn clReleaseCommandQueue(q: H) -> cl_int {
    post_handle(Op::ReleaseCommandQueue, q)
}

pub unsafe extern "C" fn clRetainCommandQueue(q: H) -> cl_int {
    post_handle(Op::RetainCommandQueue, q)
}

pub unsafe extern "C" fn clGetCommandQueueInfo(q: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetCommandQueueInfo, |w| w.h(q), param, size, value, size_ret) })
}

pub unsafe extern "C" fn clSetCommandQueueProperty(q: H, props: cl_bitfield, enable: cl_bool, old: *mut cl_bitfield) -> cl_int {
    code(|| {
        let mut w = begin(Op::SetCommandQueueProperty, MODE_CALL);
        w.h(q);
        w.u64(props);
        w.bool(enable != 0);
        let a = call_ok(w)?;
        let o = skip_rc(&a)?.u64()?;
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe { out(old, o) };
        Ok(())
    })
}

pub unsafe extern "C" fn clSetDefaultDeviceCommandQueue(c: H, d: H, q: H) -> cl_int {
    code(|| {
        let mut w = begin(Op::SetDefaultDeviceCommandQueue, MODE_CALL);
        w.h(c);
        w.h(d);
        w.h(q);
        call_code(w, false)
    })
}

pub unsafe extern "C" fn clFlush(q: H) -> cl_int {
    post_handle(Op::Flush, q)
}

pub unsafe extern "C" fn clFinish(q: H) -> cl_int {
    call_handle(Op::Finish, q, true)
}

pub unsafe extern "C" fn clCreateBuffer(c: H, flags: cl_bitfield, size: usize, host: *mut c_void, errcode_ret: *mut cl_int) -> H {
    // SAFETY: as in `clGetPlatformIDs`.
    handle(errcode_ret, || unsafe { create_buffer(Op::CreateBuffer, |w| w.h(c), flags, size, host) })
}

pub unsafe extern "C" fn clCreateBufferWithProperties(
    c: H,
    props: *const u64,
    flags: cl_bitfield,
    size: usize,
    host: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    let head = |w: &mut Writer| {
        w.h(c);
        w.opt_i64s(u64_props(props).as_deref());
    };
    // SAFETY: as in `clGetPlatformIDs`.
    handle(errcode_ret, || unsafe { create_buffer(Op::CreateBufferWithProperties, head, flags, size, host) })
}

pub unsafe extern "C" fn clCreateSubBuffer(b: H, flags: cl_bitfield, t: cl_uint, info: *const c_void, errcode_ret: *mut cl_int) -> H {
    handle(errcode_ret, || {
        if t != cl::CL_BUFFER_CREATE_TYPE_REGION || info.is_null() {
            return Err(cl::CL_INVALID_VALUE);
        }
        // SAFETY: for CL_BUFFER_CREATE_TYPE_REGION, `info` is a cl_buffer_region.
        let region = unsafe { *info.cast::<BufferRegion>() };
        let mut w = begin(Op::CreateSubBuffer, MODE_CALL);
        w.h(b);
        w.u64(flags);
        w.u32(t);
        w.usize(region.origin);
        w.usize(region.size);
        let h = call_made(w)?;
        let parent = recorded(b).unwrap_or_default();
        let host = if parent.host != 0 { parent.host + region.origin } else { 0 };
        record(h, MemRecord { flags: flags | (parent.flags & (cl::CL_MEM_USE_HOST_PTR | cl::CL_MEM_COPY_HOST_PTR)), host, image: None });
        Ok(h)
    })
}

pub unsafe extern "C" fn clCreateImage(
    c: H,
    flags: cl_bitfield,
    fmt: *const ImageFormat,
    desc: *const ImageDesc,
    host: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    // SAFETY: as in `clGetPlatformIDs`.
    handle(errcode_ret, || unsafe { create_image(Op::CreateImage, |w| w.h(c), flags, fmt, desc, host) })
}

pub unsafe extern "C" fn clCreateImageWithProperties(
    c: H,
    props: *const u64,
    flags: cl_bitfield,
    fmt: *const ImageFormat,
    desc: *const ImageDesc,
    host: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    let head = |w: &mut Writer| {
        w.h(c);
        w.opt_i64s(u64_props(props).as_deref());
    };
    // SAFETY: as in `clGetPlatformIDs`.
    handle(errcode_ret, || unsafe { create_image(Op::CreateImageWithProperties, head, flags, fmt, desc, host) })
}

pub unsafe extern "C" fn clCreatePipe(_c: H, _flags: cl_bitfield, _size: cl_uint, _n: cl_uint, _props: *const isize, errcode_ret: *mut cl_int) -> H {
    unsupported("clCreatePipe");
    handle(errcode_ret, || Err(cl::CL_INVALID_OPERATION))
}

pub unsafe extern "C" fn clReleaseMemObject(m: H) -> cl_int {
    post_handle(Op::ReleaseMemObject, m)
}

/// Registers a destructor callback (memory object or context).
fn destructor(op: Op, h: H, f: ProgramNotify, user_data: *mut c_void) -> cl_int {
    code(|| {
        let f = f.ok_or(cl::CL_INVALID_VALUE)?;
        let id = add_callback(Callback::Destructor(f, user_data as usize));
        let mut w = begin(op, MODE_CALL);
        w.h(h);
        w.u64(id);
        call_code(w, false).inspect_err(|_| remove_callback(id))
    })
}

pub unsafe extern "C" fn clSetMemObjectDestructorCallback(m: H, f: ProgramNotify, user_data: *mut c_void) -> cl_int {
    destructor(Op::SetMemObjectDestructorCallback, m, f, user_data)
}

pub unsafe extern "C" fn clSetContextDestructorCallback(c: H, f: ProgramNotify, user_data: *mut c_void) -> cl_int {
    destructor(Op::SetContextDestructorCallback, c, f, user_data)
}

pub unsafe extern "C" fn clGetMemObjectInfo(m: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe {
        // The proxy made a USE_HOST_PTR object with COPY_HOST_PTR; the application sees
        // what it asked for.
        match (param, recorded(m)) {
            (CL_MEM_HOST_PTR, Some(rec)) if rec.flags & cl::CL_MEM_USE_HOST_PTR != 0 => local_value(&rec.host.to_ne_bytes(), size, value, size_ret),
            (cl::CL_MEM_FLAGS, Some(rec)) if rec.flags & cl::CL_MEM_USE_HOST_PTR != 0 => local_value(&rec.flags.to_ne_bytes(), size, value, size_ret),
            _ => info(Op::GetMemObjectInfo, |w| w.h(m), param, size, value, size_ret),
        }
    })
}

pub unsafe extern "C" fn clGetImageInfo(m: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetImageInfo, |w| w.h(m), param, size, value, size_ret) })
}

pub unsafe extern "C" fn clGetPipeInfo(_m: H, _param: cl_uint, _size: usize, _value: *mut c_void, _size_ret: *mut usize) -> cl_int {
    unsupported("clGetPipeInfo");
    cl::CL_INVALID_OPERATION
}

pub unsafe extern "C" fn clGetSupportedImageFormats(c: H, flags: cl_bitfield, t: cl_uint, n: cl_uint, formats: *mut ImageFormat, num: *mut cl_uint) -> cl_int {
    code(|| {
        let mut w = begin(Op::GetSupportedImageFormats, MODE_CALL);
        w.h(c);
        w.u64(flags);
        w.u32(t);
        w.u32(n);
        w.bool(!formats.is_null());
        let a = call_ok(w)?;
        let mut r = skip_rc(&a)?;
        let k = r.u32()?;
        if k > n && !formats.is_null() {
            return Err(CL_OUT_OF_RESOURCES);
        }
        for i in 0..k as usize {
            let f = ImageFormat { order: r.u32()?, data_type: r.u32()? };
            // SAFETY: `formats` has room for `n` formats, and `i < k <= n`.
            unsafe { out(formats.add(i), f) };
        }
        let total = r.u32()?;
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe { out(num, total) };
        Ok(())
    })
}

pub unsafe extern "C" fn clSVMAlloc(_c: H, _flags: cl_bitfield, _size: usize, _align: cl_uint) -> *mut c_void {
    unsupported("clSVMAlloc");
    null_mut()
}

pub unsafe extern "C" fn clSVMFree(_c: H, _p: *mut c_void) {
    unsupported("clSVMFree");
}

pub unsafe extern "C" fn clCreateSampler(c: H, norm: cl_bool, addr: cl_uint, filter: cl_uint, errcode_ret: *mut cl_int) -> H {
    handle(errcode_ret, || {
        let mut w = begin(Op::CreateSampler, MODE_CALL);
        w.h(c);
        w.u32(norm);
        w.u32(addr);
        w.u32(filter);
        call_made(w)
    })
}

pub unsafe extern "C" fn clCreateSamplerWithProperties(c: H, props: *const u64, errcode_ret: *mut cl_int) -> H {
    handle(errcode_ret, || {
        let mut w = begin(Op::CreateSamplerWithProperties, MODE_CALL);
        w.h(c);
        w.opt_i64s(u64_props(props).as_deref());
        call_made(w)
    })
}

pub unsafe extern "C" fn clReleaseSampler(s: H) -> cl_int {
    post_handle(Op::ReleaseSampler, s)
}

pub unsafe extern "C" fn clGetSamplerInfo(s: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetSamplerInfo, |w| w.h(s), param, size, value, size_ret) })
}

pub unsafe extern "C" fn clCreateProgramWithSource(c: H, n: cl_uint, strings: *const *const i8, lengths: *const usize, errcode_ret: *mut cl_int) -> H {
    handle(errcode_ret, || {
        if strings.is_null() || n == 0 {
            return Err(cl::CL_INVALID_VALUE);
        }
        let mut w = begin(Op::CreateProgramWithSource, MODE_CALL);
        w.h(c);
        w.u32(n);
        for i in 0..n as usize {
            // SAFETY: `strings` holds `n` strings and `lengths` (when given) `n` lengths;
            // a length of 0 means a NUL-terminated string.
            unsafe {
                let s = *strings.add(i);
                if s.is_null() {
                    return Err(cl::CL_INVALID_VALUE);
                }
                let len = if lengths.is_null() { 0 } else { *lengths.add(i) };
                w.bytes(if len == 0 { cstr(s).unwrap_or_default() } else { slice(s.cast::<u8>(), len) });
            }
        }
        call_made(w)
    })
}

pub unsafe extern "C" fn clCreateProgramWithBinary(
    c: H,
    n: cl_uint,
    devices: *const H,
    lengths: *const usize,
    binaries: *const *const u8,
    status: *mut cl_int,
    errcode_ret: *mut cl_int,
) -> H {
    handle(errcode_ret, || {
        if devices.is_null() || lengths.is_null() || binaries.is_null() || n == 0 {
            return Err(cl::CL_INVALID_VALUE);
        }
        let mut w = begin(Op::CreateProgramWithBinary, MODE_CALL);
        w.h(c);
        // SAFETY: the three arrays hold `n` items each, binary `i` `lengths[i]` bytes.
        unsafe {
            w.handles(slice(devices, n as usize));
            w.u32(n);
            for i in 0..n as usize {
                let (b, len) = (*binaries.add(i), *lengths.add(i));
                if b.is_null() || len == 0 {
                    return Err(cl::CL_INVALID_VALUE);
                }
                w.bytes(slice(b, len));
            }
        }
        let a = call(w)?;
        let mut r = a.reader();
        let (rc, h, k) = (r.i32()?, r.h()?, r.u32()?);
        for i in 0..k.min(n) as usize {
            let s = r.i32()?;
            // SAFETY: `status`, when given, holds `n` codes.
            unsafe { out(if status.is_null() { null_mut() } else { status.add(i) }, s) };
        }
        if rc != cl::CL_SUCCESS {
            return Err(rc);
        }
        Ok(h)
    })
}

pub unsafe extern "C" fn clCreateProgramWithIL(c: H, il: *const c_void, len: usize, errcode_ret: *mut cl_int) -> H {
    handle(errcode_ret, || {
        if il.is_null() || len == 0 {
            return Err(cl::CL_INVALID_VALUE);
        }
        let mut w = begin(Op::CreateProgramWithIL, MODE_CALL);
        w.h(c);
        // SAFETY: `il` holds `len` bytes.
        w.bytes(unsafe { slice(il.cast::<u8>(), len) });
        call_made(w)
    })
}

pub unsafe extern "C" fn clCreateProgramWithBuiltInKernels(c: H, n: cl_uint, devices: *const H, names: *const i8, errcode_ret: *mut cl_int) -> H {
    handle(errcode_ret, || {
        let mut w = begin(Op::CreateProgramWithBuiltInKernels, MODE_CALL);
        w.h(c);
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe {
            w.handles(slice(devices, n as usize));
            w.bytes(cstr(names).ok_or(cl::CL_INVALID_VALUE)?);
        }
        call_made(w)
    })
}

pub unsafe extern "C" fn clReleaseProgram(p: H) -> cl_int {
    post_handle(Op::ReleaseProgram, p)
}

pub unsafe extern "C" fn clBuildProgram(p: H, n: cl_uint, devices: *const H, options: *const i8, notify: ProgramNotify, user_data: *mut c_void) -> cl_int {
    let rc = code(|| {
        let mut w = begin(Op::BuildProgram, MODE_CALL);
        w.h(p);
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe {
            w.handles(slice(devices, n as usize));
            w.opt_bytes(cstr(options));
        }
        call_code(w, false)
    });
    // The build ran synchronously in the proxy; its notification follows.
    if let Some(f) = notify {
        // SAFETY: the application's callback with its data, as the loader would call it.
        unsafe { f(p, user_data) };
    }
    rc
}

pub unsafe extern "C" fn clCompileProgram(
    p: H,
    n: cl_uint,
    devices: *const H,
    options: *const i8,
    n_headers: cl_uint,
    headers: *const H,
    header_names: *const *const i8,
    notify: ProgramNotify,
    user_data: *mut c_void,
) -> cl_int {
    let rc = code(|| {
        let mut w = begin(Op::CompileProgram, MODE_CALL);
        w.h(p);
        // SAFETY: as in `clGetPlatformIDs`; `header_names` holds `n_headers` strings.
        unsafe {
            w.handles(slice(devices, n as usize));
            w.opt_bytes(cstr(options));
            let hs = slice(headers, n_headers as usize);
            let names = slice(header_names, hs.len());
            if names.len() != hs.len() {
                return Err(cl::CL_INVALID_VALUE);
            }
            w.handles(hs);
            w.u32(names.len() as u32);
            for &s in names {
                w.bytes(cstr(s).ok_or(cl::CL_INVALID_VALUE)?);
            }
        }
        call_code(w, false)
    });
    if let Some(f) = notify {
        // SAFETY: as in `clBuildProgram`.
        unsafe { f(p, user_data) };
    }
    rc
}

pub unsafe extern "C" fn clLinkProgram(
    c: H,
    n: cl_uint,
    devices: *const H,
    options: *const i8,
    n_inputs: cl_uint,
    inputs: *const H,
    notify: ProgramNotify,
    user_data: *mut c_void,
    errcode_ret: *mut cl_int,
) -> H {
    let p = handle(errcode_ret, || {
        let mut w = begin(Op::LinkProgram, MODE_CALL);
        w.h(c);
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe {
            w.handles(slice(devices, n as usize));
            w.opt_bytes(cstr(options));
            w.handles(slice(inputs, n_inputs as usize));
        }
        call_made(w)
    });
    if let (Some(f), false) = (notify, p.is_null()) {
        // SAFETY: as in `clBuildProgram`.
        unsafe { f(p, user_data) };
    }
    p
}

pub unsafe extern "C" fn clSetProgramSpecializationConstant(p: H, id: cl_uint, size: usize, value: *const c_void) -> cl_int {
    code(|| {
        let mut w = begin(Op::SetProgramSpecializationConstant, MODE_CALL);
        w.h(p);
        w.u32(id);
        // SAFETY: `value` holds `size` bytes.
        w.bytes(unsafe { slice(value.cast::<u8>(), size) });
        call_code(w, false)
    })
}

pub unsafe extern "C" fn clUnloadPlatformCompiler(p: H) -> cl_int {
    call_handle(Op::UnloadPlatformCompiler, p, false)
}

pub unsafe extern "C" fn clGetProgramInfo(p: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    if param != CL_PROGRAM_BINARIES || value.is_null() {
        // SAFETY: as in `clGetPlatformIDs`.
        return code(|| unsafe { info(Op::GetProgramInfo, |w| w.h(p), param, size, value, size_ret) });
    }
    // The value is an array of the application's pointers, one per device: each gets its
    // binary.
    code(|| {
        let mut w = begin(Op::GetProgramInfo, MODE_CALL);
        w.h(p);
        w.u32(param);
        w.usize(size);
        w.bool(true);
        let a = call_ok(w)?;
        let mut r = skip_rc(&a)?;
        let n = r.u32()? as usize;
        if size < n * size_of::<usize>() {
            return Err(cl::CL_INVALID_VALUE);
        }
        let ptrs = value.cast::<*mut u8>();
        for i in 0..n {
            let b = r.bytes()?;
            // SAFETY: `value` holds `n` pointers (checked against `size`); a non-null one
            // points to room for its device's binary (CL_PROGRAM_BINARY_SIZES).
            unsafe {
                let dst = *ptrs.add(i);
                if !dst.is_null() {
                    std::ptr::copy_nonoverlapping(b.as_ptr(), dst, b.len());
                }
            }
        }
        let sr = r.usize()?;
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe { out(size_ret, sr) };
        Ok(())
    })
}

pub unsafe extern "C" fn clGetProgramBuildInfo(p: H, d: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let head = |w: &mut Writer| {
        w.h(p);
        w.h(d);
    };
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetProgramBuildInfo, head, param, size, value, size_ret) })
}

pub unsafe extern "C" fn clCreateKernel(p: H, name: *const i8, errcode_ret: *mut cl_int) -> H {
    handle(errcode_ret, || {
        let mut w = begin(Op::CreateKernel, MODE_CALL);
        w.h(p);
        // SAFETY: as in `clGetPlatformIDs`.
        w.bytes(unsafe { cstr(name) }.ok_or(cl::CL_INVALID_VALUE)?);
        call_made(w)
    })
}

pub unsafe extern "C" fn clCreateKernelsInProgram(p: H, n: cl_uint, kernels: *mut H, num: *mut cl_uint) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { list(Op::CreateKernelsInProgram, |w| w.h(p), n, kernels, num) })
}

pub unsafe extern "C" fn clCloneKernel(k: H, errcode_ret: *mut cl_int) -> H {
    handle(errcode_ret, || {
        let mut w = begin(Op::CloneKernel, MODE_CALL);
        w.h(k);
        call_made(w)
    })
}

pub unsafe extern "C" fn clReleaseKernel(k: H) -> cl_int {
    post_handle(Op::ReleaseKernel, k)
}

pub unsafe extern "C" fn clSetKernelArg(k: H, index: cl_uint, size: usize, value: *const c_void) -> cl_int {
    code(|| {
        let mut w = begin(Op::SetKernelArg, MODE_POST);
        w.h(k);
        w.u32(index);
        w.usize(size);
        // SAFETY: a non-null `value` holds `size` bytes (a memory object's or sampler's
        // argument is the proxy's handle value, sent as is).
        w.opt_bytes((!value.is_null()).then(|| unsafe { slice(value.cast::<u8>(), size) }));
        post(w)
    })
}

pub unsafe extern "C" fn clSetKernelArgSVMPointer(_k: H, _index: cl_uint, _value: *const c_void) -> cl_int {
    unsupported("clSetKernelArgSVMPointer");
    cl::CL_INVALID_OPERATION
}

pub unsafe extern "C" fn clSetKernelExecInfo(k: H, param: cl_uint, size: usize, value: *const c_void) -> cl_int {
    code(|| {
        let mut w = begin(Op::SetKernelExecInfo, MODE_CALL);
        w.h(k);
        w.u32(param);
        // SAFETY: `value` holds `size` bytes.
        w.bytes(unsafe { slice(value.cast::<u8>(), size) });
        call_code(w, false)
    })
}

pub unsafe extern "C" fn clGetKernelInfo(k: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetKernelInfo, |w| w.h(k), param, size, value, size_ret) })
}

pub unsafe extern "C" fn clGetKernelArgInfo(k: H, index: cl_uint, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let head = |w: &mut Writer| {
        w.h(k);
        w.u32(index);
    };
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetKernelArgInfo, head, param, size, value, size_ret) })
}

pub unsafe extern "C" fn clGetKernelWorkGroupInfo(k: H, d: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    let head = |w: &mut Writer| {
        w.h(k);
        w.h(d);
    };
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetKernelWorkGroupInfo, head, param, size, value, size_ret) })
}

pub unsafe extern "C" fn clGetKernelSubGroupInfo(
    k: H,
    d: H,
    param: cl_uint,
    in_size: usize,
    input: *const c_void,
    size: usize,
    value: *mut c_void,
    size_ret: *mut usize,
) -> cl_int {
    let head = |w: &mut Writer| {
        w.h(k);
        w.h(d);
        // SAFETY: `input` holds `in_size` bytes.
        w.bytes(unsafe { slice(input.cast::<u8>(), in_size) });
    };
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetKernelSubGroupInfo, head, param, size, value, size_ret) })
}

pub unsafe extern "C" fn clWaitForEvents(n: cl_uint, list: *const H) -> cl_int {
    code(|| {
        let mut w = begin(Op::WaitForEvents, MODE_CALL);
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe { waits(&mut w, n, list) };
        call_code(w, true)
    })
}

pub unsafe extern "C" fn clGetEventInfo(e: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetEventInfo, |w| w.h(e), param, size, value, size_ret) })
}

pub unsafe extern "C" fn clCreateUserEvent(c: H, errcode_ret: *mut cl_int) -> H {
    handle(errcode_ret, || {
        let mut w = begin(Op::CreateUserEvent, MODE_CALL);
        w.h(c);
        call_made(w)
    })
}

pub unsafe extern "C" fn clReleaseEvent(e: H) -> cl_int {
    post_handle(Op::ReleaseEvent, e)
}

pub unsafe extern "C" fn clSetUserEventStatus(e: H, status: cl_int) -> cl_int {
    code(|| {
        let mut w = begin(Op::SetUserEventStatus, MODE_CALL);
        w.h(e);
        w.i32(status);
        // Not behind the posts: one of them may be blocked in the platform on this very event
        // (a release that finishes its queue); setting it earlier than the posts before it
        // changes nothing they see (what waits on it runs once it is set).
        let rc = call_in_order(w, false)?.reader().i32()?;
        if rc != cl::CL_SUCCESS {
            return Err(rc);
        }
        Ok(())
    })
}

pub unsafe extern "C" fn clSetEventCallback(e: H, kind: cl_int, f: EventNotify, user_data: *mut c_void) -> cl_int {
    code(|| {
        let f = f.ok_or(cl::CL_INVALID_VALUE)?;
        let id = add_callback(Callback::Event(f, user_data as usize));
        let mut w = begin(Op::SetEventCallback, MODE_CALL);
        w.h(e);
        w.i32(kind);
        w.u64(id);
        call_code(w, false).inspect_err(|_| remove_callback(id))
    })
}

pub unsafe extern "C" fn clGetEventProfilingInfo(e: H, param: cl_uint, size: usize, value: *mut c_void, size_ret: *mut usize) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { info(Op::GetEventProfilingInfo, |w| w.h(e), param, size, value, size_ret) })
}

/// A read's answer: the bytes (checked to be `len`), then the event part.
unsafe fn read_into(w: Writer, event: *mut H, place: impl FnOnce(&[u8]) -> R<()>) -> R<()> {
    let a = call(w)?;
    let mut r = a.reader();
    let rc = r.i32()?;
    if rc != cl::CL_SUCCESS {
        return Err(rc);
    }
    place(r.bytes()?)?;
    // SAFETY: forwarded.
    unsafe { read_end(&a, r, event) }
}

/// A read whose bytes the proxy wrote into this process itself: its answer has no bytes.
unsafe fn read_done(a: Answer, event: *mut H) -> R<()> {
    let mut r = a.reader();
    let rc = r.i32()?;
    if rc != cl::CL_SUCCESS {
        return Err(rc);
    }
    // SAFETY: forwarded.
    unsafe { read_end(&a, r, event) }
}

/// A read's answer past its bytes: a deferred error, or the event part.
unsafe fn read_end(a: &Answer, mut r: Reader<'_>, event: *mut H) -> R<()> {
    if a.deferred != cl::CL_SUCCESS {
        // The call fails: it gives the application no event (the proxy's is let go).
        if r.bool()? {
            post_handle(Op::ReleaseEvent, r.h()?);
        }
        return Err(a.deferred);
    }
    // SAFETY: forwarded.
    unsafe { event_out(&mut r, event)? };
    Ok(())
}

pub unsafe extern "C" fn clEnqueueReadBuffer(
    q: H,
    m: H,
    _blocking: cl_bool,
    offset: usize,
    size: usize,
    ptr: *mut c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    if size >= peer::PEER_MIN && !ptr.is_null() && peer_memory() {
        return code(|| {
            let mut w = begin(Op::EnqueueReadBufferPeer, MODE_CALL);
            w.h(q);
            w.h(m);
            w.usize(offset);
            w.usize(size);
            w.u64(ptr as u64);
            // SAFETY: as in `clGetPlatformIDs`; the proxy writes the `size` bytes at `ptr`
            // (which has room for them) before it answers.
            unsafe {
                waits(&mut w, n, list);
                w.bool(!event.is_null());
                read_done(call(w)?, event)
            }
        });
    }
    code(|| {
        let mut w = begin(Op::EnqueueReadBuffer, MODE_CALL);
        w.h(q);
        w.h(m);
        w.usize(offset);
        w.usize(size);
        // SAFETY: as in `clGetPlatformIDs`; `ptr` has room for `size` bytes.
        unsafe {
            waits(&mut w, n, list);
            w.bool(!event.is_null());
            read_into(w, event, |b| {
                if b.len() != size {
                    return Err(CL_OUT_OF_RESOURCES);
                }
                std::ptr::copy_nonoverlapping(b.as_ptr(), ptr.cast::<u8>(), size);
                Ok(())
            })
        }
    })
}

pub unsafe extern "C" fn clEnqueueReadBufferRect(
    q: H,
    m: H,
    _blocking: cl_bool,
    buffer_origin: *const usize,
    host_origin: *const usize,
    region: *const usize,
    buffer_row_pitch: usize,
    buffer_slice_pitch: usize,
    host_row_pitch: usize,
    host_slice_pitch: usize,
    ptr: *mut c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    code(|| {
        // SAFETY: as in `clGetPlatformIDs`; `ptr` holds the host region.
        unsafe {
            let (start, layout, region) = rect(host_origin, region, host_row_pitch, host_slice_pitch)?;
            let mut w = begin(Op::EnqueueReadBufferRect, MODE_CALL);
            w.h(q);
            w.h(m);
            write_triple(&mut w, triple(buffer_origin)?);
            write_triple(&mut w, region);
            w.usize(buffer_row_pitch);
            w.usize(buffer_slice_pitch);
            waits(&mut w, n, list);
            w.bool(!event.is_null());
            read_into(w, event, |b| unpack(&layout, ptr.cast::<u8>().add(start), b))
        }
    })
}

pub unsafe extern "C" fn clEnqueueWriteBuffer(
    q: H,
    m: H,
    blocking: cl_bool,
    offset: usize,
    size: usize,
    ptr: *const c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    if size >= peer::PEER_MIN && !ptr.is_null() && peer_memory() {
        // SAFETY: as below; the proxy reads the `size` bytes at `ptr` itself, before the
        // write completes (the application may not change them until then).
        return code(|| unsafe {
            enqueue(Op::EnqueueWriteBufferPeer, blocking == 0, event, |w| {
                w.h(q);
                w.h(m);
                w.bool(blocking != 0);
                w.usize(offset);
                w.usize(size);
                w.u64(ptr as u64);
                waits(w, n, list);
            })
        });
    }
    // SAFETY: as in `clGetPlatformIDs`; `ptr` holds `size` bytes.
    code(|| unsafe {
        enqueue(Op::EnqueueWriteBuffer, blocking == 0, event, |w| {
            w.h(q);
            w.h(m);
            w.bool(blocking != 0);
            w.usize(offset);
            w.bytes(slice(ptr.cast::<u8>(), size));
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueWriteBufferRect(
    q: H,
    m: H,
    blocking: cl_bool,
    buffer_origin: *const usize,
    host_origin: *const usize,
    region: *const usize,
    buffer_row_pitch: usize,
    buffer_slice_pitch: usize,
    host_row_pitch: usize,
    host_slice_pitch: usize,
    ptr: *const c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`; `ptr` holds the host region.
    code(|| unsafe {
        let (start, layout, region) = rect(host_origin, region, host_row_pitch, host_slice_pitch)?;
        let bo = triple(buffer_origin)?;
        let data = pack(&layout, ptr.cast::<u8>().add(start))?;
        enqueue(Op::EnqueueWriteBufferRect, blocking == 0, event, |w| {
            w.h(q);
            w.h(m);
            w.bool(blocking != 0);
            write_triple(w, bo);
            write_triple(w, region);
            w.usize(buffer_row_pitch);
            w.usize(buffer_slice_pitch);
            w.bytes(&data);
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueFillBuffer(
    q: H,
    m: H,
    pattern: *const c_void,
    pattern_size: usize,
    offset: usize,
    size: usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`; `pattern` holds `pattern_size` bytes.
    code(|| unsafe {
        enqueue(Op::EnqueueFillBuffer, true, event, |w| {
            w.h(q);
            w.h(m);
            w.bytes(slice(pattern.cast::<u8>(), pattern_size));
            w.usize(offset);
            w.usize(size);
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueCopyBuffer(
    q: H,
    src: H,
    dst: H,
    src_offset: usize,
    dst_offset: usize,
    size: usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe {
        enqueue(Op::EnqueueCopyBuffer, true, event, |w| {
            w.h(q);
            w.h(src);
            w.h(dst);
            w.usize(src_offset);
            w.usize(dst_offset);
            w.usize(size);
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueCopyBufferRect(
    q: H,
    src: H,
    dst: H,
    src_origin: *const usize,
    dst_origin: *const usize,
    region: *const usize,
    src_row_pitch: usize,
    src_slice_pitch: usize,
    dst_row_pitch: usize,
    dst_slice_pitch: usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe {
        let (so, dof, region) = (triple(src_origin)?, triple(dst_origin)?, triple(region)?);
        enqueue(Op::EnqueueCopyBufferRect, true, event, |w| {
            w.h(q);
            w.h(src);
            w.h(dst);
            write_triple(w, so);
            write_triple(w, dof);
            write_triple(w, region);
            for x in [src_row_pitch, src_slice_pitch, dst_row_pitch, dst_slice_pitch] {
                w.usize(x);
            }
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueReadImage(
    q: H,
    m: H,
    _blocking: cl_bool,
    origin: *const usize,
    region: *const usize,
    row_pitch: usize,
    slice_pitch: usize,
    ptr: *mut c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    code(|| {
        // SAFETY: as in `clGetPlatformIDs`; `ptr` holds the region at these pitches.
        unsafe {
            let (origin, region) = (triple(origin)?, triple(region)?);
            let shape = image_shape(m)?;
            let layout = wire::image_layout(shape.elem, shape.ty, region, row_pitch, slice_pitch).ok_or(cl::CL_INVALID_VALUE)?;
            let mut w = begin(Op::EnqueueReadImage, MODE_CALL);
            w.h(q);
            w.h(m);
            write_triple(&mut w, origin);
            write_triple(&mut w, region);
            waits(&mut w, n, list);
            w.bool(!event.is_null());
            read_into(w, event, |b| unpack(&layout, ptr.cast::<u8>(), b))
        }
    })
}

pub unsafe extern "C" fn clEnqueueWriteImage(
    q: H,
    m: H,
    blocking: cl_bool,
    origin: *const usize,
    region: *const usize,
    row_pitch: usize,
    slice_pitch: usize,
    ptr: *const c_void,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`; `ptr` holds the region at these pitches.
    code(|| unsafe {
        let (origin, region) = (triple(origin)?, triple(region)?);
        let shape = image_shape(m)?;
        let layout = wire::image_layout(shape.elem, shape.ty, region, row_pitch, slice_pitch).ok_or(cl::CL_INVALID_VALUE)?;
        let data = pack(&layout, ptr.cast::<u8>())?;
        enqueue(Op::EnqueueWriteImage, blocking == 0, event, |w| {
            w.h(q);
            w.h(m);
            w.bool(blocking != 0);
            write_triple(w, origin);
            write_triple(w, region);
            w.bytes(&data);
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueFillImage(
    q: H,
    m: H,
    color: *const c_void,
    origin: *const usize,
    region: *const usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`; `color` is four channels, or one float for a
    // depth image.
    code(|| unsafe {
        let (origin, region) = (triple(origin)?, triple(region)?);
        let depth = recorded(m).and_then(|r| r.image).is_some_and(|s| s.order == 0x10BD);
        let color = slice(color.cast::<u8>(), if depth { 4 } else { 16 });
        enqueue(Op::EnqueueFillImage, true, event, |w| {
            w.h(q);
            w.h(m);
            w.bytes(color);
            write_triple(w, origin);
            write_triple(w, region);
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueCopyImage(
    q: H,
    src: H,
    dst: H,
    so: *const usize,
    dof: *const usize,
    region: *const usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe {
        let (so, dof, region) = (triple(so)?, triple(dof)?, triple(region)?);
        enqueue(Op::EnqueueCopyImage, true, event, |w| {
            w.h(q);
            w.h(src);
            w.h(dst);
            write_triple(w, so);
            write_triple(w, dof);
            write_triple(w, region);
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueCopyImageToBuffer(
    q: H,
    src: H,
    dst: H,
    so: *const usize,
    region: *const usize,
    dst_offset: usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe {
        let (so, region) = (triple(so)?, triple(region)?);
        enqueue(Op::EnqueueCopyImageToBuffer, true, event, |w| {
            w.h(q);
            w.h(src);
            w.h(dst);
            write_triple(w, so);
            write_triple(w, region);
            w.usize(dst_offset);
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueCopyBufferToImage(
    q: H,
    src: H,
    dst: H,
    src_offset: usize,
    dof: *const usize,
    region: *const usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe {
        let (dof, region) = (triple(dof)?, triple(region)?);
        enqueue(Op::EnqueueCopyBufferToImage, true, event, |w| {
            w.h(q);
            w.h(src);
            w.h(dst);
            w.usize(src_offset);
            write_triple(w, dof);
            write_triple(w, region);
            waits(w, n, list);
        })
    })
}

/// Places a map's bytes in the application: at `host` (a USE_HOST_PTR object's memory at
/// the region) or in fresh pages laid out `packed`; remembers the map for the unmap.
unsafe fn place_map(m: H, proxy: u64, flags: u64, data: &[u8], host: Option<(usize, Layout)>, packed: Layout) -> R<(*mut u8, Layout)> {
    let (base, layout, owned) = match host {
        Some((p, layout)) => (p as *mut u8, layout, None),
        None => {
            let len = packed.packed_len().ok_or(cl::CL_INVALID_VALUE)?;
            (map_pages(len)?, packed, Some(len))
        }
    };
    // SAFETY: `base` holds the layout's footprint: the application's host memory for the
    // object, or the pages just mapped.
    if let Err(e) = unsafe { unpack(&layout, base, data) } {
        if let Some(len) = owned {
            unmap_pages(base as usize, len);
        }
        return Err(e);
    }
    let write = flags & (CL_MAP_WRITE | CL_MAP_WRITE_INVALIDATE_REGION) != 0;
    maps().entry((key(m), base as usize)).or_default().push(AppMap { proxy, write, layout, owned });
    Ok((base, layout))
}

pub unsafe extern "C" fn clEnqueueMapBuffer(
    q: H,
    m: H,
    _blocking: cl_bool,
    flags: cl_bitfield,
    offset: usize,
    size: usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
    errcode_ret: *mut cl_int,
) -> *mut c_void {
    handle(errcode_ret, || {
        let mut w = begin(Op::EnqueueMapBuffer, MODE_CALL);
        w.h(q);
        w.h(m);
        w.u64(flags);
        w.usize(offset);
        w.usize(size);
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe { waits(&mut w, n, list) };
        w.bool(!event.is_null());
        let a = call_ok(w)?;
        let mut r = skip_rc(&a)?;
        let (proxy, data) = (r.u64()?, r.bytes()?);
        let rec = recorded(m).unwrap_or_default();
        let host = (rec.host != 0).then(|| (rec.host + offset, Layout::flat(size)));
        // SAFETY: a USE_HOST_PTR buffer's host memory holds the buffer, so `size` bytes
        // at `offset`.
        let (p, _) = unsafe { place_map(m, proxy, flags, data, host, Layout::flat(size))? };
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe { event_out(&mut r, event)? };
        Ok(p.cast())
    })
}

pub unsafe extern "C" fn clEnqueueMapImage(
    q: H,
    m: H,
    _blocking: cl_bool,
    flags: cl_bitfield,
    origin: *const usize,
    region: *const usize,
    row_pitch: *mut usize,
    slice_pitch: *mut usize,
    n: cl_uint,
    list: *const H,
    event: *mut H,
    errcode_ret: *mut cl_int,
) -> *mut c_void {
    handle(errcode_ret, || {
        // SAFETY: as in `clGetPlatformIDs`.
        let (origin, region) = unsafe { (triple(origin)?, triple(region)?) };
        let shape = image_shape(m)?;
        let mut w = begin(Op::EnqueueMapImage, MODE_CALL);
        w.h(q);
        w.h(m);
        w.u64(flags);
        write_triple(&mut w, origin);
        write_triple(&mut w, region);
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe { waits(&mut w, n, list) };
        w.bool(!event.is_null());
        let a = call_ok(w)?;
        let mut r = skip_rc(&a)?;
        let (proxy, data) = (r.u64()?, r.bytes()?);
        let packed = wire::image_layout(shape.elem, shape.ty, region, 0, 0).ok_or(cl::CL_INVALID_VALUE)?;
        let rec = recorded(m).unwrap_or_default();
        let host = if rec.host != 0 {
            let (rp, sp) = (shape.row_pitch, shape.slice_pitch);
            let start = if shape.ty == cl::CL_MEM_OBJECT_IMAGE1D_ARRAY {
                origin[0] * shape.elem + origin[1] * sp
            } else {
                origin[0] * shape.elem + origin[1] * rp + origin[2] * sp
            };
            let layout = wire::image_layout(shape.elem, shape.ty, region, rp, sp).ok_or(cl::CL_INVALID_VALUE)?;
            Some((rec.host + start, layout))
        } else {
            None
        };
        // SAFETY: a USE_HOST_PTR image's host memory holds the image at its pitches.
        let (p, layout) = unsafe { place_map(m, proxy, flags, data, host, packed)? };
        let (rp, sp) = map_pitches(&shape, &layout);
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe {
            out(row_pitch, rp);
            out(slice_pitch, sp);
            event_out(&mut r, event)?;
        }
        Ok(p.cast())
    })
}

pub unsafe extern "C" fn clEnqueueUnmapMemObject(q: H, m: H, ptr: *mut c_void, n: cl_uint, list: *const H, event: *mut H) -> cl_int {
    code(|| {
        let k = (key(m), ptr as usize);
        let map = maps().get_mut(&k).and_then(|v| v.pop()).ok_or(cl::CL_INVALID_VALUE)?;
        let mut w = begin(Op::EnqueueUnmapMemObject, MODE_CALL);
        w.h(q);
        w.h(m);
        w.u64(map.proxy);
        // SAFETY: the map's region, which the application held until now.
        let data = if map.write { Some(unsafe { pack(&map.layout, ptr.cast::<u8>()) }?) } else { None };
        w.opt_bytes(data.as_deref());
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe { waits(&mut w, n, list) };
        w.bool(!event.is_null());
        let res = call_ok(w).and_then(|a| {
            let mut r = skip_rc(&a)?;
            // SAFETY: as in `clGetPlatformIDs`.
            unsafe { event_out(&mut r, event) }
        });
        match (&res, map.owned) {
            (Ok(()), Some(len)) => unmap_pages(ptr as usize, len),
            (Ok(()), None) => {}
            (Err(_), _) => maps().entry(k).or_default().push(map),
        }
        res
    })
}

pub unsafe extern "C" fn clEnqueueMigrateMemObjects(
    q: H,
    n_mems: cl_uint,
    mems: *const H,
    flags: cl_bitfield,
    n: cl_uint,
    list: *const H,
    event: *mut H,
) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe {
        enqueue(Op::EnqueueMigrateMemObjects, false, event, |w| {
            w.h(q);
            w.handles(slice(mems, n_mems as usize));
            w.u64(flags);
            waits(w, n, list);
        })
    })
}

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
    // SAFETY: as in `clGetPlatformIDs`; each non-null array holds `dim` sizes.
    code(|| unsafe {
        if dim == 0 || dim > MAX_DIMS {
            return Err(CL_INVALID_WORK_DIMENSION);
        }
        let arr = |p: *const usize| (!p.is_null()).then(|| slice(p, dim as usize));
        enqueue(Op::EnqueueNDRangeKernel, true, event, |w| {
            w.h(q);
            w.h(k);
            w.u32(dim);
            w.opt_usizes(arr(offset));
            w.opt_usizes(arr(global));
            w.opt_usizes(arr(local));
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueTask(q: H, k: H, n: cl_uint, list: *const H, event: *mut H) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe {
        enqueue(Op::EnqueueTask, true, event, |w| {
            w.h(q);
            w.h(k);
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueMarkerWithWaitList(q: H, n: cl_uint, list: *const H, event: *mut H) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe {
        enqueue(Op::EnqueueMarkerWithWaitList, false, event, |w| {
            w.h(q);
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueBarrierWithWaitList(q: H, n: cl_uint, list: *const H, event: *mut H) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe {
        enqueue(Op::EnqueueBarrierWithWaitList, false, event, |w| {
            w.h(q);
            waits(w, n, list);
        })
    })
}

pub unsafe extern "C" fn clEnqueueMarker(q: H, event: *mut H) -> cl_int {
    // SAFETY: as in `clGetPlatformIDs`.
    code(|| unsafe { enqueue(Op::EnqueueMarker, false, event, |w| w.h(q)) })
}

pub unsafe extern "C" fn clEnqueueBarrier(q: H) -> cl_int {
    call_handle(Op::EnqueueBarrier, q, false)
}

pub unsafe extern "C" fn clEnqueueWaitForEvents(q: H, n: cl_uint, list: *const H) -> cl_int {
    code(|| {
        let mut w = begin(Op::EnqueueWaitForEvents, MODE_CALL);
        w.h(q);
        // SAFETY: as in `clGetPlatformIDs`.
        unsafe { waits(&mut w, n, list) };
        call_code(w, false)
    })
}

pub unsafe extern "C" fn clEnqueueSVMFree(
    _q: H,
    _n: cl_uint,
    _ptrs: *const *mut c_void,
    _f: *const c_void,
    _data: *mut c_void,
    _nw: cl_uint,
    _list: *const H,
    _event: *mut H,
) -> cl_int {
    unsupported("clEnqueueSVMFree");
    cl::CL_INVALID_OPERATION
}

pub unsafe extern "C" fn clEnqueueSVMMemcpy(
    _q: H,
    _b: cl_bool,
    _dst: *mut c_void,
    _src: *const c_void,
    _size: usize,
    _n: cl_uint,
    _list: *const H,
    _event: *mut H,
) -> cl_int {
    unsupported("clEnqueueSVMMemcpy");
    cl::CL_INVALID_OPERATION
}

pub unsafe extern "C" fn clEnqueueSVMMemFill(
    _q: H,
    _p: *mut c_void,
    _pat: *const c_void,
    _ps: usize,
    _size: usize,
    _n: cl_uint,
    _list: *const H,
    _event: *mut H,
) -> cl_int {
    unsupported("clEnqueueSVMMemFill");
    cl::CL_INVALID_OPERATION
}

pub unsafe extern "C" fn clEnqueueSVMMap(
    _q: H,
    _b: cl_bool,
    _flags: cl_bitfield,
    _p: *mut c_void,
    _size: usize,
    _n: cl_uint,
    _list: *const H,
    _event: *mut H,
) -> cl_int {
    unsupported("clEnqueueSVMMap");
    cl::CL_INVALID_OPERATION
}

pub unsafe extern "C" fn clEnqueueSVMUnmap(_q: H, _p: *mut c_void, _n: cl_uint, _list: *const H, _event: *mut H) -> cl_int {
    unsupported("clEnqueueSVMUnmap");
    cl::CL_INVALID_OPERATION
}

pub unsafe extern "C" fn clEnqueueSVMMigrateMem(
    _q: H,
    _n_ptrs: cl_uint,
    _ptrs: *const *const c_void,
    _sizes: *const usize,
    _flags: cl_bitfield,
    _n: cl_uint,
    _list: *const H,
    _event: *mut H,
) -> cl_int {
    unsupported("clEnqueueSVMMigrateMem");
    cl::CL_INVALID_OPERATION
}

pub unsafe extern "C" fn clGetExtensionFunctionAddressForPlatform(_p: H, _name: *const i8) -> *mut c_void {
    unsupported("clGetExtensionFunctionAddressForPlatform");
    null_mut()
}

/// The stubs as a loader table: what [`cl::real`] returns in proxy mode. A struct
/// literal, so a field added to [`Real`] without a stub does not compile.
pub fn table() -> Real {
    Real {
        clGetPlatformIDs: Some(clGetPlatformIDs),
        clGetPlatformInfo: Some(clGetPlatformInfo),
        clGetDeviceIDs: Some(clGetDeviceIDs),
        clGetDeviceInfo: Some(clGetDeviceInfo),
        clCreateSubDevices: Some(clCreateSubDevices),
        clGetDeviceAndHostTimer: Some(clGetDeviceAndHostTimer),
        clGetHostTimer: Some(clGetHostTimer),
        clCreateContext: Some(clCreateContext),
        clCreateContextFromType: Some(clCreateContextFromType),
        clReleaseContext: Some(clReleaseContext),
        clGetContextInfo: Some(clGetContextInfo),
        clCreateCommandQueue: Some(clCreateCommandQueue),
        clCreateCommandQueueWithProperties: Some(clCreateCommandQueueWithProperties),
        clReleaseCommandQueue: Some(clReleaseCommandQueue),
        clRetainCommandQueue: Some(clRetainCommandQueue),
        clGetCommandQueueInfo: Some(clGetCommandQueueInfo),
        clSetCommandQueueProperty: Some(clSetCommandQueueProperty),
        clSetDefaultDeviceCommandQueue: Some(clSetDefaultDeviceCommandQueue),
        clFlush: Some(clFlush),
        clFinish: Some(clFinish),
        clCreateBuffer: Some(clCreateBuffer),
        clCreateBufferWithProperties: Some(clCreateBufferWithProperties),
        clCreateSubBuffer: Some(clCreateSubBuffer),
        clCreateImage: Some(clCreateImage),
        clCreateImageWithProperties: Some(clCreateImageWithProperties),
        clCreatePipe: Some(clCreatePipe),
        clReleaseMemObject: Some(clReleaseMemObject),
        clSetMemObjectDestructorCallback: Some(clSetMemObjectDestructorCallback),
        clSetContextDestructorCallback: Some(clSetContextDestructorCallback),
        clGetMemObjectInfo: Some(clGetMemObjectInfo),
        clGetImageInfo: Some(clGetImageInfo),
        clGetPipeInfo: Some(clGetPipeInfo),
        clGetSupportedImageFormats: Some(clGetSupportedImageFormats),
        clSVMAlloc: Some(clSVMAlloc),
        clSVMFree: Some(clSVMFree),
        clCreateSampler: Some(clCreateSampler),
        clCreateSamplerWithProperties: Some(clCreateSamplerWithProperties),
        clReleaseSampler: Some(clReleaseSampler),
        clGetSamplerInfo: Some(clGetSamplerInfo),
        clCreateProgramWithSource: Some(clCreateProgramWithSource),
        clCreateProgramWithBinary: Some(clCreateProgramWithBinary),
        clCreateProgramWithIL: Some(clCreateProgramWithIL),
        clCreateProgramWithBuiltInKernels: Some(clCreateProgramWithBuiltInKernels),
        clReleaseProgram: Some(clReleaseProgram),
        clBuildProgram: Some(clBuildProgram),
        clCompileProgram: Some(clCompileProgram),
        clLinkProgram: Some(clLinkProgram),
        clSetProgramSpecializationConstant: Some(clSetProgramSpecializationConstant),
        clUnloadPlatformCompiler: Some(clUnloadPlatformCompiler),
        clGetProgramInfo: Some(clGetProgramInfo),
        clGetProgramBuildInfo: Some(clGetProgramBuildInfo),
        clCreateKernel: Some(clCreateKernel),
        clCreateKernelsInProgram: Some(clCreateKernelsInProgram),
        clCloneKernel: Some(clCloneKernel),
        clReleaseKernel: Some(clReleaseKernel),
        clSetKernelArg: Some(clSetKernelArg),
        clSetKernelArgSVMPointer: Some(clSetKernelArgSVMPointer),
        clSetKernelExecInfo: Some(clSetKernelExecInfo),
        clGetKernelInfo: Some(clGetKernelInfo),
        clGetKernelArgInfo: Some(clGetKernelArgInfo),
        clGetKernelWorkGroupInfo: Some(clGetKernelWorkGroupInfo),
        clGetKernelSubGroupInfo: Some(clGetKernelSubGroupInfo),
        clWaitForEvents: Some(clWaitForEvents),
        clGetEventInfo: Some(clGetEventInfo),
        clCreateUserEvent: Some(clCreateUserEvent),
        clReleaseEvent: Some(clReleaseEvent),
        clSetUserEventStatus: Some(clSetUserEventStatus),
        clSetEventCallback: Some(clSetEventCallback),
        clGetEventProfilingInfo: Some(clGetEventProfilingInfo),
        clEnqueueReadBuffer: Some(clEnqueueReadBuffer),
        clEnqueueReadBufferRect: Some(clEnqueueReadBufferRect),
        clEnqueueWriteBuffer: Some(clEnqueueWriteBuffer),
        clEnqueueWriteBufferRect: Some(clEnqueueWriteBufferRect),
        clEnqueueFillBuffer: Some(clEnqueueFillBuffer),
        clEnqueueCopyBuffer: Some(clEnqueueCopyBuffer),
        clEnqueueCopyBufferRect: Some(clEnqueueCopyBufferRect),
        clEnqueueReadImage: Some(clEnqueueReadImage),
        clEnqueueWriteImage: Some(clEnqueueWriteImage),
        clEnqueueFillImage: Some(clEnqueueFillImage),
        clEnqueueCopyImage: Some(clEnqueueCopyImage),
        clEnqueueCopyImageToBuffer: Some(clEnqueueCopyImageToBuffer),
        clEnqueueCopyBufferToImage: Some(clEnqueueCopyBufferToImage),
        clEnqueueMapBuffer: Some(clEnqueueMapBuffer),
        clEnqueueMapImage: Some(clEnqueueMapImage),
        clEnqueueUnmapMemObject: Some(clEnqueueUnmapMemObject),
        clEnqueueMigrateMemObjects: Some(clEnqueueMigrateMemObjects),
        clEnqueueNDRangeKernel: Some(clEnqueueNDRangeKernel),
        clEnqueueTask: Some(clEnqueueTask),
        clEnqueueMarkerWithWaitList: Some(clEnqueueMarkerWithWaitList),
        clEnqueueBarrierWithWaitList: Some(clEnqueueBarrierWithWaitList),
        clEnqueueMarker: Some(clEnqueueMarker),
        clEnqueueBarrier: Some(clEnqueueBarrier),
        clEnqueueWaitForEvents: Some(clEnqueueWaitForEvents),
        clEnqueueSVMFree: Some(clEnqueueSVMFree),
        clEnqueueSVMMemcpy: Some(clEnqueueSVMMemcpy),
        clEnqueueSVMMemFill: Some(clEnqueueSVMMemFill),
        clEnqueueSVMMap: Some(clEnqueueSVMMap),
        clEnqueueSVMUnmap: Some(clEnqueueSVMUnmap),
        clEnqueueSVMMigrateMem: Some(clEnqueueSVMMigrateMem),
        clGetExtensionFunctionAddressForPlatform: Some(clGetExtensionFunctionAddressForPlatform),
        _lib: None,
    }
}
