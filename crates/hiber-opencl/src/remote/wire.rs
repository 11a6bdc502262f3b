//! The proxy's wire encoding: little-endian, no padding, no self-description.
//!
//! A request is `u16 op, u8 mode (0 call, 1 post)` and then the op's arguments; an answer
//! is `i32 deferred, i32 rc` and then, as each op defines, its outputs. Integers are fixed
//! width (`usize` travels as `u64`), a handle is its `u64` value, a byte string is a `u64`
//! length and the bytes, an optional one has a `u8` present flag first, and an array is a
//! `u32` count and its items.
//!
//! Both ends are this crate, so nothing is versioned; but the proxy reads requests from a
//! process it does not trust to be well formed, so every read is bounds-checked and no
//! length from the wire sizes an allocation before the bytes it counts have been seen.

use std::fmt;

use crate::cl::H;

/// A request or answer that ended early or held an impossible value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireError;

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("malformed proxy message")
    }
}

impl std::error::Error for WireError {}

/// Request mode: the client waits for the answer.
pub const MODE_CALL: u8 = 0;
/// Request mode: the client does not wait; the proxy keeps the first failure (see
/// [`super`]'s "Posted calls").
pub const MODE_POST: u8 = 1;

/// Builds a message.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Writer {
        Writer { buf: Vec::with_capacity(64) }
    }

    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn i32(&mut self, v: i32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn i64(&mut self, v: i64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn usize(&mut self, v: usize) {
        self.u64(v as u64);
    }
    pub fn bool(&mut self, v: bool) {
        self.u8(v as u8);
    }
    /// A handle's value; the receiving side never dereferences it.
    pub fn h(&mut self, v: H) {
        self.u64(v as usize as u64);
    }
    pub fn bytes(&mut self, v: &[u8]) {
        self.u64(v.len() as u64);
        self.buf.extend_from_slice(v);
    }
    pub fn opt_bytes(&mut self, v: Option<&[u8]>) {
        match v {
            Some(b) => {
                self.u8(1);
                self.bytes(b);
            }
            None => self.u8(0),
        }
    }
    pub fn handles(&mut self, v: &[H]) {
        self.u32(v.len() as u32);
        for &h in v {
            self.h(h);
        }
    }
    pub fn usizes(&mut self, v: &[usize]) {
        self.u32(v.len() as u32);
        for &x in v {
            self.usize(x);
        }
    }
    pub fn opt_usizes(&mut self, v: Option<&[usize]>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.usizes(v);
            }
            None => self.u8(0),
        }
    }
    pub fn i64s(&mut self, v: &[i64]) {
        self.u32(v.len() as u32);
        for &x in v {
            self.i64(x);
        }
    }
    pub fn opt_i64s(&mut self, v: Option<&[i64]>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.i64s(v);
            }
            None => self.u8(0),
        }
    }
}

/// Reads a message; every read fails with [`WireError`] rather than run past the end.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    /// The bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.remaining() {
            return Err(WireError);
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn i32(&mut self) -> Result<i32, WireError> {
        Ok(i32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub fn i64(&mut self) -> Result<i64, WireError> {
        Ok(i64::from_le_bytes(self.array()?))
    }
    pub fn usize(&mut self) -> Result<usize, WireError> {
        usize::try_from(self.u64()?).map_err(|_| WireError)
    }
    pub fn bool(&mut self) -> Result<bool, WireError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(WireError),
        }
    }
    pub fn h(&mut self) -> Result<H, WireError> {
        Ok(self.u64()? as usize as H)
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], WireError> {
        let n = self.usize()?;
        self.take(n)
    }
    pub fn opt_bytes(&mut self) -> Result<Option<&'a [u8]>, WireError> {
        if self.bool()? {
            self.bytes().map(Some)
        } else {
            Ok(None)
        }
    }
    /// A `u32` count of `item`-byte items, checked against the bytes left before anything
    /// is allocated.
    fn count(&mut self, item: usize) -> Result<usize, WireError> {
        let n = self.u32()? as usize;
        if n.checked_mul(item).is_none_or(|b| b > self.remaining()) {
            return Err(WireError);
        }
        Ok(n)
    }
    pub fn handles(&mut self) -> Result<Vec<H>, WireError> {
        let n = self.count(8)?;
        (0..n).map(|_| self.h()).collect()
    }
    pub fn usizes(&mut self) -> Result<Vec<usize>, WireError> {
        let n = self.count(8)?;
        (0..n).map(|_| self.usize()).collect()
    }
    pub fn opt_usizes(&mut self) -> Result<Option<Vec<usize>>, WireError> {
        if self.bool()? {
            self.usizes().map(Some)
        } else {
            Ok(None)
        }
    }
    pub fn i64s(&mut self) -> Result<Vec<i64>, WireError> {
        let n = self.count(8)?;
        (0..n).map(|_| self.i64()).collect()
    }
    pub fn opt_i64s(&mut self) -> Result<Option<Vec<i64>>, WireError> {
        if self.bool()? {
            self.i64s().map(Some)
        } else {
            Ok(None)
        }
    }
    /// Exactly three `usize`s (an origin or a region).
    pub fn triple(&mut self) -> Result<[usize; 3], WireError> {
        Ok([self.usize()?, self.usize()?, self.usize()?])
    }
}

/// Generates [`Op`], the function ids, from one list.
macro_rules! ops {
    ($($name:ident),* $(,)?) => {
        /// Which OpenCL function a request is for.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(u16)]
        pub enum Op { $($name),* }

        impl Op {
            const ALL: &'static [Op] = &[$(Op::$name),*];

            pub fn from_u16(v: u16) -> Option<Op> {
                Op::ALL.get(v as usize).copied()
            }
        }
    };
}

ops! {
    GetPlatformIDs, GetPlatformInfo, GetDeviceIDs, GetDeviceInfo, CreateSubDevices,
    GetDeviceAndHostTimer, GetHostTimer, CreateContext, CreateContextFromType, ReleaseContext,
    GetContextInfo, CreateCommandQueue, CreateCommandQueueWithProperties, ReleaseCommandQueue,
    RetainCommandQueue, GetCommandQueueInfo, SetCommandQueueProperty, SetDefaultDeviceCommandQueue,
    Flush, Finish, CreateBuffer, CreateBufferWithProperties, CreateSubBuffer, CreateImage,
    CreateImageWithProperties, ReleaseMemObject, SetMemObjectDestructorCallback,
    SetContextDestructorCallback, GetMemObjectInfo, GetImageInfo, GetSupportedImageFormats,
    CreateSampler, CreateSamplerWithProperties, ReleaseSampler, GetSamplerInfo,
    CreateProgramWithSource, CreateProgramWithBinary, CreateProgramWithIL,
    CreateProgramWithBuiltInKernels, ReleaseProgram, BuildProgram, CompileProgram, LinkProgram,
    SetProgramSpecializationConstant, UnloadPlatformCompiler, GetProgramInfo, GetProgramBuildInfo,
    CreateKernel, CreateKernelsInProgram, CloneKernel, ReleaseKernel, SetKernelArg,
    SetKernelExecInfo, GetKernelInfo, GetKernelArgInfo, GetKernelWorkGroupInfo,
    GetKernelSubGroupInfo, WaitForEvents, GetEventInfo, CreateUserEvent, ReleaseEvent,
    SetUserEventStatus, SetEventCallback, GetEventProfilingInfo, EnqueueReadBuffer,
    EnqueueReadBufferRect, EnqueueWriteBuffer, EnqueueWriteBufferRect, EnqueueFillBuffer,
    EnqueueCopyBuffer, EnqueueCopyBufferRect, EnqueueReadImage, EnqueueWriteImage, EnqueueFillImage,
    EnqueueCopyImage, EnqueueCopyImageToBuffer, EnqueueCopyBufferToImage, EnqueueMapBuffer,
    EnqueueMapImage, EnqueueUnmapMemObject, EnqueueMigrateMemObjects, EnqueueNDRangeKernel,
    EnqueueTask, EnqueueMarkerWithWaitList, EnqueueBarrierWithWaitList, EnqueueMarker,
    EnqueueBarrier, EnqueueWaitForEvents,
    // Bulk transfers the proxy makes straight from and into the application's memory
    // (`remote::peer`), and the check that it can.
    PeerMemory, EnqueueWriteBufferPeer, EnqueueReadBufferPeer,
}

/// The bytes of a region of host memory and how they are laid out: `slices` slices
/// `slice_pitch` apart, each of `rows` rows `row_pitch` apart, each `row` bytes long.
/// Rect transfers and image transfers travel packed (pitches `row` and `row * rows`), so
/// neither the gaps between rows nor an origin offset crosses the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub row: usize,
    pub rows: usize,
    pub row_pitch: usize,
    pub slices: usize,
    pub slice_pitch: usize,
}

impl Layout {
    /// One contiguous run of `len` bytes.
    pub fn flat(len: usize) -> Layout {
        Layout { row: len, rows: 1, row_pitch: len, slices: 1, slice_pitch: len }
    }

    /// The bytes from the first to the last one the region covers; `None` on overflow.
    pub fn footprint(&self) -> Option<usize> {
        if self.row == 0 || self.rows == 0 || self.slices == 0 {
            return Some(0);
        }
        (self.slices - 1).checked_mul(self.slice_pitch)?.checked_add((self.rows - 1).checked_mul(self.row_pitch)?)?.checked_add(self.row)
    }

    /// The bytes the region holds, packed; `None` on overflow.
    pub fn packed_len(&self) -> Option<usize> {
        self.row.checked_mul(self.rows)?.checked_mul(self.slices)
    }

    /// Copies the region out of `base` (which holds [`Layout::footprint`] bytes), packed.
    pub fn pack(&self, base: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.packed_len().unwrap_or(0));
        self.each_row(|off| out.extend_from_slice(&base[off..off + self.row]));
        out
    }

    /// Copies packed `data` into the region of `base`.
    pub fn unpack(&self, base: &mut [u8], data: &[u8]) {
        let mut i = 0;
        self.each_row(|off| {
            base[off..off + self.row].copy_from_slice(&data[i..i + self.row]);
            i += self.row;
        });
    }

    pub fn each_row(&self, mut f: impl FnMut(usize)) {
        if self.row == 0 {
            return;
        }
        for s in 0..self.slices {
            for r in 0..self.rows {
                f(s * self.slice_pitch + r * self.row_pitch);
            }
        }
    }
}

/// Bytes per element of an image format (OpenCL's `CL_IMAGE_ELEMENT_SIZE`), computed from
/// the format so that neither end needs a round trip to size host memory; `None` for a
/// format this does not know.
pub fn element_size(order: u32, data_type: u32) -> Option<usize> {
    let packed = match data_type {
        0x10D4 | 0x10D5 => Some(2), // UNORM_SHORT_565, UNORM_SHORT_555
        0x10D6 | 0x10E0 => Some(4), // UNORM_INT_101010, UNORM_INT_101010_2
        _ => None,
    };
    if packed.is_some() {
        return packed;
    }
    let channel = match data_type {
        0x10D0 | 0x10D2 | 0x10D7 | 0x10DA => 1,          // SNORM_INT8, UNORM_INT8, SIGNED_INT8, UNSIGNED_INT8
        0x10D1 | 0x10D3 | 0x10D8 | 0x10DB | 0x10DD => 2, // *_INT16, HALF_FLOAT
        0x10D9 | 0x10DC | 0x10DE | 0x10DF => 4,          // *_INT32, FLOAT, UNORM_INT24
        _ => return None,
    };
    let channels = match order {
        0x10B0 | 0x10B1 | 0x10B8 | 0x10B9 | 0x10BA | 0x10BD => 1, // R, A, INTENSITY, LUMINANCE, Rx, DEPTH
        0x10B2 | 0x10B3 | 0x10BB => 2,                            // RG, RA, RGx
        0x10B4 | 0x10BC | 0x10BF => 3,                            // RGB, RGBx, sRGB
        0x10B5 | 0x10B6 | 0x10B7 | 0x10C0 | 0x10C1 | 0x10C2 | 0x10C3 => 4, // RGBA, BGRA, ARGB, sRGBx, sRGBA, sBGRA, ABGR
        0x10BE => return Some(if data_type == 0x10DE { 8 } else { 4 }), // DEPTH_STENCIL
        _ => return None,
    };
    Some(channel * channels)
}

/// Where a region of an image lies in host memory with pitches `row_pitch` and
/// `slice_pitch` (0: OpenCL's defaults), for an image of type `image_type` with elements of
/// `elem` bytes. For a 1D image array the images are the rows, `slice_pitch` apart.
pub fn image_layout(elem: usize, image_type: u32, region: [usize; 3], row_pitch: usize, slice_pitch: usize) -> Option<Layout> {
    let row = region[0].checked_mul(elem)?;
    let rp = if row_pitch == 0 { row } else { row_pitch };
    if image_type == crate::cl::CL_MEM_OBJECT_IMAGE1D_ARRAY {
        let sp = if slice_pitch == 0 { rp } else { slice_pitch };
        return Some(Layout { row, rows: region[1], row_pitch: sp, slices: 1, slice_pitch: 0 });
    }
    let sp = if slice_pitch == 0 { rp.checked_mul(region[1])? } else { slice_pitch };
    Some(Layout { row, rows: region[1], row_pitch: rp, slices: region[2], slice_pitch: sp })
}

/// The region an image of this description covers, as [`image_layout`] takes it.
pub fn image_extent(desc: &crate::cl::ImageDesc) -> [usize; 3] {
    use crate::cl::*;
    match desc.image_type {
        CL_MEM_OBJECT_IMAGE1D_ARRAY => [desc.width, desc.array_size, 1],
        CL_MEM_OBJECT_IMAGE2D => [desc.width, desc.height, 1],
        CL_MEM_OBJECT_IMAGE2D_ARRAY => [desc.width, desc.height, desc.array_size],
        CL_MEM_OBJECT_IMAGE3D => [desc.width, desc.height, desc.depth],
        _ => [desc.width, 1, 1],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut w = Writer::new();
        w.u16(7);
        w.u8(MODE_POST);
        w.u32(0xdead_beef);
        w.i32(-30);
        w.u64(u64::MAX);
        w.i64(i64::MIN);
        w.usize(12345);
        w.bool(true);
        w.h(0x1000 as H);
        w.bytes(b"hello");
        w.opt_bytes(None);
        w.opt_bytes(Some(b""));
        w.handles(&[1 as H, 2 as H]);
        w.usizes(&[3, 4, 5]);
        w.opt_usizes(None);
        w.opt_i64s(Some(&[-1, 0x1084]));
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.u16(), Ok(7));
        assert_eq!(r.u8(), Ok(MODE_POST));
        assert_eq!(r.u32(), Ok(0xdead_beef));
        assert_eq!(r.i32(), Ok(-30));
        assert_eq!(r.u64(), Ok(u64::MAX));
        assert_eq!(r.i64(), Ok(i64::MIN));
        assert_eq!(r.usize(), Ok(12345));
        assert_eq!(r.bool(), Ok(true));
        assert_eq!(r.h(), Ok(0x1000 as H));
        assert_eq!(r.bytes(), Ok(&b"hello"[..]));
        assert_eq!(r.opt_bytes(), Ok(None));
        assert_eq!(r.opt_bytes(), Ok(Some(&b""[..])));
        assert_eq!(r.handles(), Ok(vec![1 as H, 2 as H]));
        assert_eq!(r.usizes(), Ok(vec![3, 4, 5]));
        assert_eq!(r.opt_usizes(), Ok(None));
        assert_eq!(r.opt_i64s(), Ok(Some(vec![-1, 0x1084])));
        assert_eq!(r.remaining(), 0);
        assert_eq!(r.u8(), Err(WireError));
    }

    #[test]
    fn truncated_input_is_rejected() {
        let mut w = Writer::new();
        w.bytes(b"0123456789");
        w.handles(&[1 as H, 2 as H, 3 as H]);
        // Every prefix must fail somewhere and never panic.
        for cut in 0..w.buf.len() {
            let mut r = Reader::new(&w.buf[..cut]);
            let ok = r.bytes().is_ok() && r.handles().is_ok();
            assert!(!ok, "a prefix of {cut} bytes decoded");
        }
    }

    #[test]
    fn lying_lengths_are_rejected() {
        let mut w = Writer::new();
        w.u64(u64::MAX);
        assert_eq!(Reader::new(&w.buf).bytes(), Err(WireError));
        let mut w = Writer::new();
        w.u32(u32::MAX);
        w.u64(1);
        assert_eq!(Reader::new(&w.buf).handles(), Err(WireError));
        assert_eq!(Reader::new(&[2]).bool(), Err(WireError));
    }

    #[test]
    fn op_ids_round_trip() {
        for (i, op) in Op::ALL.iter().enumerate() {
            assert_eq!(Op::from_u16(i as u16), Some(*op));
        }
        assert_eq!(Op::from_u16(Op::ALL.len() as u16), None);
    }

    #[test]
    fn layout_packs_and_unpacks() {
        let l = Layout { row: 2, rows: 2, row_pitch: 4, slices: 2, slice_pitch: 10 };
        assert_eq!(l.footprint(), Some(16));
        let base: Vec<u8> = (0..16).collect();
        let p = l.pack(&base);
        assert_eq!(p, vec![0, 1, 4, 5, 10, 11, 14, 15]);
        let mut back = vec![0xffu8; 16];
        l.unpack(&mut back, &p);
        assert_eq!(back[..6], [0, 1, 0xff, 0xff, 4, 5]);
        assert_eq!(Layout::flat(5).footprint(), Some(5));
        assert_eq!(Layout { row: 1, rows: 2, row_pitch: usize::MAX, slices: 1, slice_pitch: 0 }.footprint(), None);
    }
}
