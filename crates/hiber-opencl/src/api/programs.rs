//! Programs and kernels.

use super::*;

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
