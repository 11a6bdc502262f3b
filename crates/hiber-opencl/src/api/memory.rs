//! Memory objects (buffers, images, pipes, shared virtual memory) and samplers.

use super::*;

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
