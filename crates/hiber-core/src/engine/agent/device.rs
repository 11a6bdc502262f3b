//! hiber's side of the agent engine's data path: device memory hiber holds (imported from
//! the application, or created to restore into) and the movers that stream it between
//! the GPU and the image's chunk files through small pinned buffers, in parallel.

use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::fingerprint;
use crate::engine::cuda::ffi::{CuResult, CudaLib, Kernel, PinnedBuf, PrimaryContext, Staging, Stream};
use crate::image::{FileEntry, ImageSink};

pub use crate::image::chunks::{chunk_files, CHUNK};

/// The CUDA library plus the primary context hiber uses on each device.
pub struct Gpus {
    pub cuda: CudaLib,
    contexts: Mutex<HashMap<i32, PrimaryContext>>,
    /// The fingerprint kernel on each device, once loaded and checked (`None`: not usable).
    fingerprint: Mutex<HashMap<i32, Option<Kernel>>>,
}

impl Gpus {
    pub fn new(cuda: CudaLib) -> Gpus {
        Gpus { cuda, contexts: Mutex::new(HashMap::new()), fingerprint: Mutex::new(HashMap::new()) }
    }

    /// The fingerprint kernel on `dev`: loaded on first use (the driver compiles it, which
    /// is why a checkpoint asks before it stops the application) and checked against the
    /// host's function on a block of known content. `None` when fingerprints are off, or
    /// the kernel cannot be loaded or disagrees: chunks are then copied and hashed.
    pub fn fingerprint_kernel(self: &Arc<Self>, dev: i32) -> Option<Kernel> {
        if !fingerprint::enabled() {
            return None;
        }
        let mut cache = self.fingerprint.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = cache.get(&dev) {
            return *k;
        }
        let start = std::time::Instant::now();
        let k = self
            .load_fingerprint(dev)
            .inspect_err(|e| tracing::warn!(dev, error = %e, "no fingerprints on this GPU; unchanged chunks are found by copying them"))
            .ok();
        tracing::debug!(dev, seconds = start.elapsed().as_secs_f64(), usable = k.is_some(), "fingerprint kernel");
        cache.insert(dev, k);
        k
    }

    fn load_fingerprint(self: &Arc<Self>, dev: i32) -> Result<Kernel, String> {
        let name = |e| self.cuda.error_name(e);
        self.enter(dev).map_err(|e| format!("CUDA context: {}", name(e)))?;
        let ptx = std::ffi::CString::new(fingerprint::PTX).expect("the PTX has no NUL");
        let entry = std::ffi::CString::new(fingerprint::KERNEL).expect("a plain name");
        let k = self.cuda.load_kernel(&ptx, &entry).map_err(|e| format!("loading the kernel: {}", name(e)))?;
        // Checked on one block against the host's function before it is trusted.
        let block = fingerprint::test_block();
        let data = DeviceMem::create(self, fingerprint::BLOCK as u64, dev, false).map_err(|e| format!("device memory: {}", name(e)))?;
        let out_mem = DeviceMem::create(self, GRANULE, dev, false).map_err(|e| format!("device memory: {}", name(e)))?;
        let stream = self.cuda.stream().map_err(|e| format!("stream: {}", name(e)))?;
        let mut out = vec![0u8; fingerprint::OUT_PER_BLOCK];
        // SAFETY: `data` and `out_mem` are hiber's own mappings, of one block and of more
        // than the kernel writes for one block; the kernel takes (data, out).
        unsafe {
            self.cuda.write_device(data.va, &block, &stream).map_err(|e| format!("copy: {}", name(e)))?;
            self.cuda.launch2(k, 1, fingerprint::THREADS, data.va, out_mem.va, &stream).map_err(|e| format!("launch: {}", name(e)))?;
            self.cuda.read_device(&mut out, out_mem.va, &stream).map_err(|e| format!("copy: {}", name(e)))?;
        }
        drop(stream);
        if out != fingerprint::block_out(&block) {
            return Err("the kernel's result differs from the host's".into());
        }
        Ok(k)
    }

    /// Makes `dev`'s primary context current on the calling thread.
    pub fn enter(&self, dev: i32) -> Result<(), CuResult> {
        let mut c = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        match c.get(&dev) {
            Some(&ctx) => self.cuda.set_current(ctx),
            None => {
                let ctx = self.cuda.use_device(dev)?;
                c.insert(dev, ctx);
                Ok(())
            }
        }
    }

    /// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" of device ordinal `dev`.
    pub fn uuid(&self, dev: i32) -> Result<String, CuResult> {
        Ok(hiber_wire::gpu_uuid(&self.cuda.device_uuid(dev)?.bytes))
    }

    /// The ordinal of the device with `uuid`.
    pub fn ordinal(&self, uuid: &str) -> Result<Option<i32>, CuResult> {
        for d in 0..self.cuda.device_count()? {
            if self.uuid(d)? == uuid {
                return Ok(Some(d));
            }
        }
        Ok(None)
    }

    /// Free bytes on `dev`.
    pub fn free_bytes(&self, dev: i32) -> Result<u64, CuResult> {
        self.enter(dev)?;
        Ok(self.cuda.mem_info()?.0)
    }
}

/// Device memory mapped into hiber's address space; unmapped and released on drop.
pub struct DeviceMem {
    gpus: Arc<Gpus>,
    pub va: u64,
    pub size: u64,
    pub dev: i32,
    handle: u64,
}

impl DeviceMem {
    fn mapped(gpus: &Arc<Gpus>, handle: u64, size: u64, dev: i32) -> Result<DeviceMem, CuResult> {
        let cuda = &gpus.cuda;
        let va = match cuda.reserve(size as usize) {
            Ok(va) => va,
            Err(e) => {
                let _ = cuda.release(handle);
                return Err(e);
            }
        };
        if let Err(e) = cuda.map(va, size as usize, handle, dev) {
            let _ = cuda.release(handle);
            let _ = cuda.free_reservation(va, size as usize);
            return Err(e);
        }
        Ok(DeviceMem { gpus: gpus.clone(), va, size, dev, handle })
    }

    /// Takes a reference to the application's memory behind `fd`.
    pub fn import(gpus: &Arc<Gpus>, fd: BorrowedFd<'_>, size: u64) -> Result<DeviceMem, CuResult> {
        let (h, dev) = gpus.cuda.import_fd(fd)?;
        gpus.enter(dev)?;
        Self::mapped(gpus, h, size, dev)
    }

    /// New memory on `dev`; `exportable` when it is to be handed to an application.
    pub fn create(gpus: &Arc<Gpus>, size: u64, dev: i32, exportable: bool) -> Result<DeviceMem, CuResult> {
        gpus.enter(dev)?;
        let h = gpus.cuda.create(size as usize, dev, exportable)?;
        Self::mapped(gpus, h, size, dev)
    }

    pub fn export_fd(&self) -> Result<std::os::fd::OwnedFd, CuResult> {
        self.gpus.cuda.export_fd(self.handle)
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        let cuda = &self.gpus.cuda;
        let _ = self.gpus.enter(self.dev);
        let _ = cuda.unmap(self.va, self.size as usize);
        let _ = cuda.release(self.handle);
        let _ = cuda.free_reservation(self.va, self.size as usize);
    }
}

/// The granularity of VMM memory on current GPUs (cuMemCreate's).
pub const GRANULE: u64 = 2 << 20;

/// Where the bytes of one chunk are while hiber holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Device memory mapped in hiber: the application's own, or hiber's copy of it.
    Gpu { dev: i32, va: u64 },
    /// The checkpoint's page-locked staging area in host memory, from this offset.
    Host { off: usize },
    /// Nowhere hiber holds: the parent image has a chunk of the same fingerprint, which
    /// the image shares.
    Parent,
    /// Nowhere: its fingerprint is that of zeros (memory never written), saved as a sparse
    /// file without its data.
    Zero,
}

/// One chunk file of an image, and where its bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub at: Place,
    pub len: usize,
    pub rel: String,
    /// Its fingerprint, taken on the GPU while the application was stopped.
    pub fp: Option<String>,
}

/// Every chunk of each memory, in order, where the memory is.
pub fn chunks(mems: &[(&DeviceMem, String)]) -> Vec<Chunk> {
    let mut out = Vec::new();
    for (m, prefix) in mems {
        for (k, rel) in chunk_files(prefix, m.size).into_iter().enumerate() {
            let off = k as u64 * CHUNK;
            out.push(Chunk { at: Place::Gpu { dev: m.dev, va: m.va + off }, len: (m.size - off).min(CHUNK) as usize, rel, fp: None });
        }
    }
    out
}

/// A worker's CUDA resources: a pinned buffer (made on first use) and a stream per device.
pub struct Worker<'a> {
    gpus: &'a Gpus,
    buf: Option<PinnedBuf<'a>>,
    streams: HashMap<i32, Stream<'a>>,
    /// Device memory for the fingerprint kernel's output, per device.
    scratch: HashMap<i32, DeviceMem>,
}

impl<'a> Worker<'a> {
    /// Makes `dev`'s context current and returns this worker's stream on it.
    fn stream(&mut self, dev: i32) -> Result<&Stream<'a>, String> {
        let gpus = self.gpus;
        gpus.enter(dev).map_err(|e| format!("CUDA context: {}", gpus.cuda.error_name(e)))?;
        match self.streams.entry(dev) {
            std::collections::hash_map::Entry::Occupied(o) => Ok(o.into_mut()),
            std::collections::hash_map::Entry::Vacant(v) => Ok(v.insert(gpus.cuda.stream().map_err(|e| format!("stream: {}", gpus.cuda.error_name(e)))?)),
        }
    }

    /// Makes `dev`'s context current; returns the pinned buffer and the stream on it.
    fn buf_and_stream(&mut self, dev: i32) -> Result<(&mut PinnedBuf<'a>, &Stream<'a>), String> {
        self.stream(dev)?;
        if self.buf.is_none() {
            self.buf = Some(self.gpus.cuda.pinned(CHUNK as usize).map_err(|e| format!("pinned buffer: {}", self.gpus.cuda.error_name(e)))?);
        }
        Ok((self.buf.as_mut().expect("made above"), self.streams.get(&dev).expect("made above")))
    }
}

impl Drop for Worker<'_> {
    fn drop(&mut self) {
        for (dev, s) in self.streams.drain() {
            // A stream is destroyed with its own context current.
            let _ = self.gpus.enter(dev);
            drop(s);
        }
    }
}

/// The number of threads that move chunks: one per core, at least 8 (most of their time
/// is spent waiting on the disk or the GPU), at most 16.
fn workers() -> usize {
    std::thread::available_parallelism().map_or(8, |n| n.get()).clamp(8, 16)
}

/// Runs `work` over `items` on up to [`workers`] threads, each with its own [`Worker`].
/// The first error stops the others.
fn parallel<I: Sync, T: Send>(gpus: &Gpus, items: &[I], work: impl Fn(&I, &mut Worker<'_>) -> Result<T, String> + Sync) -> Result<Vec<T>, String> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results: Mutex<Vec<(usize, T)>> = Mutex::new(Vec::new());
    let first_error: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..workers().min(items.len()) {
            s.spawn(|| {
                let mut w = Worker { gpus, buf: None, streams: HashMap::new(), scratch: HashMap::new() };
                let out = loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= items.len() || failed.load(Ordering::Relaxed) {
                        break Ok(());
                    }
                    match work(&items[i], &mut w) {
                        Ok(v) => results.lock().unwrap_or_else(|e| e.into_inner()).push((i, v)),
                        Err(e) => break Err(e),
                    }
                };
                drop(w);
                if let Err(e) = out {
                    failed.store(true, Ordering::Relaxed);
                    first_error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    let mut r = results.into_inner().unwrap_or_else(|e| e.into_inner());
    r.sort_by_key(|(i, _)| *i);
    Ok(r.into_iter().map(|(_, v)| v).collect())
}

/// Writes each chunk to its file `rel` of the image (see [`crate::image::chunks`]), from
/// the GPU through a pinned buffer or straight from `staging`. Returns the files' manifest
/// entries.
///
/// A chunk whose fingerprint the parent image holds is shared with the parent instead
/// (see [`ImageSink::reuse_fingerprint`]); one that is only there ([`Place::Parent`]) and
/// cannot be shared fails the save.
pub fn save(gpus: &Gpus, chunks: &[Chunk], staging: Option<&Staging>, sink: &dyn ImageSink) -> Result<Vec<FileEntry>, String> {
    parallel(gpus, chunks, |c, w| {
        // Zeros are cheaper made than shared.
        if let Some(fp) = c.fp.as_deref().filter(|fp| c.at != Place::Zero && sink.parent_fingerprint(fp)) {
            if let Some(e) = sink.reuse_fingerprint(&c.rel, fp).map_err(|e| format!("{}: {e}", c.rel))? {
                return Ok(e);
            }
        }
        let mut entry = match c.at {
            Place::Gpu { dev, va } => {
                let (buf, stream) = w.buf_and_stream(dev)?;
                // SAFETY: a chunk covers `len` bytes inside one DeviceMem mapping (see `chunks`
                // and the agent engine's `place`).
                unsafe { gpus.cuda.copy_to_host(buf, c.len, va, stream) }.map_err(|e| format!("copying from the GPU: {}", gpus.cuda.error_name(e)))?;
                crate::image::chunks::write(sink, &c.rel, &buf.as_mut_slice()[..c.len])?
            }
            Place::Host { off } => {
                let staging = staging.ok_or("a chunk in host memory, but no staging area")?;
                // SAFETY: the copy into this range finished when it was staged; nothing writes
                // the staging area after that.
                crate::image::chunks::write(sink, &c.rel, unsafe { staging.slice(off, c.len) })?
            }
            Place::Zero => crate::image::chunks::write_zeros(sink, &c.rel, c.len)?,
            Place::Parent => {
                return Err(format!(
                    "{}: unchanged since the parent image, whose copy could not be shared (it changed or moved since the checkpoint began)",
                    c.rel
                ))
            }
        };
        entry.fingerprint = c.fp.clone();
        Ok(entry)
    })
}

/// The fingerprint of each chunk (see [`fingerprint`]), computed on its GPU; `None` for a
/// chunk that is not whole 2 MiB blocks of device memory, or on a device without the
/// kernel. The chunks are read where they are, and nothing crosses PCIe but 4 KiB per 2 MiB.
pub fn fingerprints(gpus: &Arc<Gpus>, chunks: &[Chunk]) -> Result<Vec<Option<String>>, String> {
    parallel(gpus, chunks, |c, w| {
        let Place::Gpu { dev, va } = c.at else { return Ok(None) };
        if c.len == 0 || !c.len.is_multiple_of(fingerprint::BLOCK) {
            return Ok(None);
        }
        let Some(kernel) = gpus.fingerprint_kernel(dev) else { return Ok(None) };
        let blocks = c.len / fingerprint::BLOCK;
        let mut out = vec![0u8; blocks * fingerprint::OUT_PER_BLOCK];
        let err = |what: &str, e| format!("{what}: {}", gpus.cuda.error_name(e));
        if let std::collections::hash_map::Entry::Vacant(v) = w.scratch.entry(dev) {
            v.insert(DeviceMem::create(gpus, (out.len() as u64).next_multiple_of(GRANULE), dev, false).map_err(|e| err("fingerprint memory", e))?);
        }
        let out_va = w.scratch.get(&dev).filter(|m| m.size >= out.len() as u64).map(|m| m.va).ok_or("a chunk larger than the fingerprint memory")?;
        let stream = w.stream(dev)?;
        // SAFETY: the chunk is `len` bytes (whole blocks) of one DeviceMem mapping that no
        // one writes while the application is stopped; `scratch` is this worker's own and
        // holds the kernel's output for `blocks` blocks (checked above).
        unsafe {
            gpus.cuda.launch2(kernel, blocks as u32, fingerprint::THREADS, va, out_va, stream).map_err(|e| err("fingerprinting on the GPU", e))?;
            gpus.cuda.read_device(&mut out, out_va, stream).map_err(|e| err("reading fingerprints", e))?;
        }
        Ok(Some(fingerprint::digest(c.len as u64, &out)))
    })
}

/// Copies each chunk from where it is (`from`, on a GPU) to its place in `to` (hiber's
/// copy on the same GPU, or the staging area), in parallel.
pub fn stage(gpus: &Gpus, from: &[Chunk], to: &[Place], staging: Option<&Staging>) -> Result<(), String> {
    let pairs: Vec<(&Chunk, Place)> = from.iter().zip(to.iter().copied()).collect();
    parallel(gpus, &pairs, |(c, dst), w| {
        let Place::Gpu { dev, va: src } = c.at else { return Err("staging a chunk that is not on a GPU".into()) };
        let stream = w.stream(dev)?;
        match *dst {
            Place::Gpu { va, .. } => {
                // SAFETY: `src` and `va` are `len` bytes inside DeviceMem mappings hiber
                // holds; each destination range belongs to this chunk alone (see the
                // agent engine's `place`).
                unsafe { gpus.cuda.copy_on_device(va, src, c.len, stream) }.map_err(|e| format!("copying on the GPU: {}", gpus.cuda.error_name(e)))
            }
            Place::Host { off } => {
                let staging = staging.ok_or("a chunk for host memory, but no staging area")?;
                // SAFETY: as above; `[off, off + len)` of the staging area is this chunk's.
                unsafe { staging.copy_in(off, src, c.len, stream) }.map_err(|e| format!("copying to host memory: {}", gpus.cuda.error_name(e)))
            }
            Place::Parent | Place::Zero => Err("staging a chunk to nowhere".into()),
        }
    })
    .map(|_| ())
}

/// Streams chunk files back into each memory, checking every chunk against its
/// manifest checksum before it reaches the GPU (`sums` is `None` only when recovering from
/// a partial image, which has no manifest yet: then sizes are checked).
/// A raised `stop` ends the load early, with an error.
pub fn load(
    gpus: &Gpus,
    mems: &[(&DeviceMem, String)],
    dir: &Path,
    sums: Option<&HashMap<String, String>>,
    stop: Option<&AtomicBool>,
) -> Result<LoadTimes, String> {
    let per_chunk = parallel(gpus, &chunks(mems), |c, w| {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return Err("stopped".into());
        }
        let Place::Gpu { dev, va } = c.at else { return Err("loading into host memory".into()) };
        let (buf, stream) = w.buf_and_stream(dev)?;
        let mut times = crate::image::chunks::ReadTimes::default();
        crate::image::chunks::read_timed(dir, &c.rel, &mut buf.as_mut_slice()[..c.len], sums, &mut times)?;
        let t = std::time::Instant::now();
        // SAFETY: a chunk covers `len` bytes inside one DeviceMem mapping (see `chunks`),
        // which no one else writes while hiber loads it.
        unsafe { gpus.cuda.copy_to_device(va, buf, c.len, stream) }.map_err(|e| format!("copying to the GPU: {}", gpus.cuda.error_name(e)))?;
        Ok((times, t.elapsed(), c.len))
    })?;
    let mut total = LoadTimes { threads: workers().min(per_chunk.len()), ..LoadTimes::default() };
    for (times, copy, len) in per_chunk {
        total.read_s += times.read.as_secs_f64();
        total.verify_s += times.verify.as_secs_f64();
        total.copy_s += copy.as_secs_f64();
        total.bytes += len as u64;
    }
    Ok(total)
}

/// Where [`load`]'s threads spent their time, summed over all of them (so each sum can be
/// up to `threads` times the wall time): reading chunk files, checking (and decompressing)
/// them, and copying them to the GPU.
#[derive(Debug, Default, Clone, Copy)]
pub struct LoadTimes {
    pub threads: usize,
    pub bytes: u64,
    pub read_s: f64,
    pub verify_s: f64,
    pub copy_s: f64,
}
