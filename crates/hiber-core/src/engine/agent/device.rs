//! hiber's side of the agent engine's data path: device memory hiber holds (imported from
//! the application, or created to restore into) and the movers that stream it between
//! the GPU and the image's chunk files through small pinned buffers, in parallel.

use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::engine::cuda::ffi::{CuResult, CudaLib, PinnedBuf, PrimaryContext, Stream};
use crate::image::{FileEntry, ImageSink};

pub use crate::image::chunks::{chunk_files, CHUNK};
const WORKERS: usize = 8;

/// The CUDA library plus the primary context hiber uses on each device.
pub struct Gpus {
    pub cuda: CudaLib,
    contexts: Mutex<HashMap<i32, PrimaryContext>>,
}

impl Gpus {
    pub fn new(cuda: CudaLib) -> Gpus {
        Gpus { cuda, contexts: Mutex::new(HashMap::new()) }
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

    /// A copy on the same device (fast: device bandwidth), not exportable.
    pub fn snapshot(&self) -> Result<DeviceMem, CuResult> {
        let copy = DeviceMem::create(&self.gpus, self.size, self.dev, false)?;
        let s = self.gpus.cuda.stream()?;
        // SAFETY: both are whole mappings hiber made, of `size` bytes; `copy` is new and
        // not yet shared.
        let r = unsafe { self.gpus.cuda.copy_on_device(copy.va, self.va, self.size as usize, &s) };
        drop(s);
        r.map(|()| copy)
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

struct Task {
    dev: i32,
    va: u64,
    len: usize,
    rel: String,
}

fn tasks(mems: &[(&DeviceMem, String)]) -> Vec<Task> {
    let mut out = Vec::new();
    for (m, prefix) in mems {
        for (k, rel) in chunk_files(prefix, m.size).into_iter().enumerate() {
            let off = k as u64 * CHUNK;
            out.push(Task { dev: m.dev, va: m.va + off, len: (m.size - off).min(CHUNK) as usize, rel });
        }
    }
    out
}

/// Runs `work` over `tasks` on up to [`WORKERS`] threads, each with its own pinned buffer
/// and streams. The first error stops the others.
fn parallel<T: Send>(gpus: &Gpus, tasks: &[Task], work: impl Fn(&Task, &mut PinnedBuf<'_>, &Stream<'_>) -> Result<T, String> + Sync) -> Result<Vec<T>, String> {
    let next = AtomicUsize::new(0);
    let failed = std::sync::atomic::AtomicBool::new(false);
    let results: Mutex<Vec<(usize, T)>> = Mutex::new(Vec::new());
    let first_error: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..WORKERS.min(tasks.len()) {
            s.spawn(|| {
                let run = || -> Result<(), String> {
                    let mut streams: HashMap<i32, Stream<'_>> = HashMap::new();
                    let mut buf = None;
                    let out = loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= tasks.len() || failed.load(Ordering::Relaxed) {
                            break Ok(());
                        }
                        let t = &tasks[i];
                        gpus.enter(t.dev).map_err(|e| format!("CUDA context: {}", gpus.cuda.error_name(e)))?;
                        if buf.is_none() {
                            buf = Some(gpus.cuda.pinned(CHUNK as usize).map_err(|e| format!("pinned buffer: {}", gpus.cuda.error_name(e)))?);
                        }
                        let stream = match streams.entry(t.dev) {
                            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                            std::collections::hash_map::Entry::Vacant(v) => {
                                v.insert(gpus.cuda.stream().map_err(|e| format!("stream: {}", gpus.cuda.error_name(e)))?)
                            }
                        };
                        match work(t, buf.as_mut().expect("allocated above"), stream) {
                            Ok(v) => results.lock().unwrap_or_else(|e| e.into_inner()).push((i, v)),
                            Err(e) => break Err(e),
                        }
                    };
                    for (dev, s) in streams {
                        // A stream is destroyed with its own context current.
                        let _ = gpus.enter(dev);
                        drop(s);
                    }
                    out
                };
                if let Err(e) = run() {
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

/// Streams each memory into chunk files `PREFIX.NNNNN` of the image (see
/// [`crate::image::chunks`]). Returns the files' manifest entries.
pub fn save(gpus: &Gpus, mems: &[(&DeviceMem, String)], sink: &dyn ImageSink) -> Result<Vec<FileEntry>, String> {
    let tasks = tasks(mems);
    parallel(gpus, &tasks, |t, buf, stream| {
        // SAFETY: a task covers `len` bytes inside one DeviceMem mapping (see `tasks`).
        unsafe { gpus.cuda.copy_to_host(buf, t.len, t.va, stream) }.map_err(|e| format!("copying from the GPU: {}", gpus.cuda.error_name(e)))?;
        crate::image::chunks::write(sink, &t.rel, &buf.as_mut_slice()[..t.len])
    })
}

/// Streams chunk files back into each memory, checking every chunk against its
/// manifest checksum before it reaches the GPU (`sums` is `None` only when recovering from
/// a partial image, which has no manifest yet: then sizes are checked).
pub fn load(gpus: &Gpus, mems: &[(&DeviceMem, String)], dir: &Path, sums: Option<&HashMap<String, String>>) -> Result<(), String> {
    let tasks = tasks(mems);
    parallel(gpus, &tasks, |t, buf, stream| {
        crate::image::chunks::read(dir, &t.rel, &mut buf.as_mut_slice()[..t.len], sums)?;
        // SAFETY: a task covers `len` bytes inside one DeviceMem mapping (see `tasks`),
        // which no one else writes while hiber loads it.
        unsafe { gpus.cuda.copy_to_device(t.va, buf, t.len, stream) }.map_err(|e| format!("copying to the GPU: {}", gpus.cuda.error_name(e)))
    })
    .map(|_| ())
}
