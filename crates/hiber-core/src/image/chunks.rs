//! Device data in an image: each memory object or allocation is a run of chunk files
//! `PREFIX.NNNNN` of [`CHUNK`] bytes (the last one shorter), each listed in the manifest
//! with its blake3. Engines write and read chunks through these helpers, so every engine's
//! device data is checked the same way on the way back.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

use super::{FileEntry, ImageSink};

/// Bytes per chunk file: large enough for full-speed copies, small enough that a few
/// pinned buffers of this size are cheap to allocate.
pub const CHUNK: u64 = 64 << 20;

/// The chunk files of an object of `size` bytes, relative to the image.
pub fn chunk_files(prefix: &str, size: u64) -> Vec<String> {
    (0..size.div_ceil(CHUNK)).map(|k| format!("{prefix}.{k:05}")).collect()
}

/// Whether every byte of `data` is zero.
fn is_zero(data: &[u8]) -> bool {
    // SAFETY: every bit pattern is a valid u128; align_to only splits off unaligned ends.
    let (head, words, tail) = unsafe { data.align_to::<u128>() };
    head.iter().all(|&b| b == 0) && words.chunks(64).all(|c| c.iter().fold(0, |acc, &w| acc | w) == 0) && tail.iter().all(|&b| b == 0)
}

/// blake3 of `len` zero bytes, computed once for a whole chunk.
fn zero_hash(len: usize) -> String {
    static FULL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let hash = || blake3::hash(&vec![0u8; len]).to_hex().to_string();
    if len as u64 == CHUNK {
        FULL.get_or_init(hash).clone()
    } else {
        hash()
    }
}

/// Writes chunk `rel` as `len` zero bytes, a sparse file (see [`write`]), without the data.
pub fn write_zeros(sink: &dyn ImageSink, rel: &str, len: usize) -> Result<FileEntry, String> {
    let io = |e: std::io::Error| format!("{rel}: {e}");
    let f = sink.create_file(rel).map_err(io)?;
    f.set_len(len as u64).map_err(io)?;
    f.sync_all().map_err(io)?;
    Ok(FileEntry { path: rel.to_string(), size: len as u64, blake3: zero_hash(len), encoding: None, fingerprint: None })
}

/// Writes chunk `rel` (created 0600 by the sink, made durable) and returns its manifest
/// entry.
///
/// A chunk of zeros (memory the application never wrote: most of a pool that JAX or an
/// inference server reserves up front) becomes a sparse file of the same length: it reads
/// back as the same zeros under the same checksum, and takes no disk space or write time.
///
/// With the sink's compression on, a chunk is stored as one zstd frame when that is
/// shorter than the data, and as it is otherwise: so a chunk file shorter than its data is
/// compressed, whether or not a manifest says so (`hiber recover` reads partial images).
///
/// A chunk the parent image of an incremental checkpoint already holds (the same stored
/// bytes) is shared with it ([`ImageSink::reuse`]), not written.
pub fn write(sink: &dyn ImageSink, rel: &str, data: &[u8]) -> Result<FileEntry, String> {
    let io = |e: std::io::Error| format!("{rel}: {e}");
    if is_zero(data) {
        return write_zeros(sink, rel, data.len());
    }
    let compressed = match sink.compression() {
        Some(level) => Some(zstd::bulk::compress(data, level).map_err(io)?).filter(|c| c.len() < data.len()),
        None => None,
    };
    let stored = compressed.as_deref().unwrap_or(data);
    let size = stored.len() as u64;
    let blake3 = blake3::hash(stored).to_hex().to_string();
    if !sink.reuse(rel, &blake3, size).map_err(io)? {
        let mut f = sink.create_file(rel).map_err(io)?;
        f.write_all(stored).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    Ok(FileEntry { path: rel.to_string(), size, blake3, encoding: compressed.map(|_| "zstd".to_string()), fingerprint: None })
}

/// Writes each `(rel, data)` as [`write`] does, on several threads at once (hashing,
/// compressing and syncing a chunk take about as long as copying it, so one thread leaves
/// a fast disk idle). Returns the entries in the order given; the first error fails it,
/// and the chunks not begun then are not written.
pub fn write_many(sink: &dyn ImageSink, items: &[(String, &[u8])]) -> Result<Vec<FileEntry>, String> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::atomic::AtomicBool::new(false);
    let done: std::sync::Mutex<Vec<(usize, Result<FileEntry, String>)>> = std::sync::Mutex::new(Vec::new());
    // Each compressing thread holds a compressed copy of its chunk as well: fewer of them.
    let most = if sink.compression().is_some() { WRITERS / 2 } else { WRITERS };
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, most).min(items.len());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= items.len() || failed.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let r = write(sink, &items[i].0, items[i].1);
                if r.is_err() {
                    failed.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                done.lock().unwrap_or_else(|e| e.into_inner()).push((i, r));
            });
        }
    });
    let mut done = done.into_inner().unwrap_or_else(|e| e.into_inner());
    done.sort_by_key(|(i, _)| *i);
    if let Some((_, Err(e))) = done.iter().find(|(_, r)| r.is_err()) {
        return Err(e.clone());
    }
    Ok(done.into_iter().filter_map(|(_, r)| r.ok()).collect())
}

/// The most threads [`write_many`] writes chunks on.
const WRITERS: usize = 8;

/// Reads chunk `rel` of the image in `dir` into `buf` (its exact length), checking the file
/// against its manifest checksum (`sums` is `None` only when recovering from a partial
/// image, which has no manifest yet: then only the length is checked). A file shorter than
/// `buf` is a zstd frame, which must decompress to exactly `buf`'s length.
pub fn read(dir: &Path, rel: &str, buf: &mut [u8], sums: Option<&HashMap<String, String>>) -> Result<(), String> {
    read_timed(dir, rel, buf, sums, &mut ReadTimes::default())
}

/// How much of a chunk [`read_timed`] reads before it hashes it: small enough to be still
/// in the core's cache (L2 is 1-2 MiB on the CPUs of GPU machines), large enough for
/// blake3's SIMD lanes and few system calls.
const VERIFY_PIECE: usize = 512 << 10;

/// Where the time of [`read_timed`] went: reading the file, and checking its hash (with
/// decompressing, for a compressed chunk).
#[derive(Debug, Default, Clone, Copy)]
pub struct ReadTimes {
    pub read: std::time::Duration,
    pub verify: std::time::Duration,
}

/// [`read`], adding the time it spent to `times`.
pub fn read_timed(dir: &Path, rel: &str, buf: &mut [u8], sums: Option<&HashMap<String, String>>, times: &mut ReadTimes) -> Result<(), String> {
    let path = dir.join(rel);
    let io = |e: std::io::Error| format!("{}: {e}", path.display());
    let t0 = std::time::Instant::now();
    let mut f = File::open(&path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    let check = |stored: &[u8]| -> Result<(), String> {
        if let Some(sums) = sums {
            let want = sums.get(rel).ok_or_else(|| format!("{rel} is not in the manifest"))?;
            if blake3::hash(stored).to_hex().as_str() != want {
                return Err(format!("{} does not match its checksum", path.display()));
            }
        }
        Ok(())
    };
    if len == buf.len() as u64 {
        let Some(sums) = sums else {
            f.read_exact(buf).map_err(io)?;
            times.read += t0.elapsed();
            return Ok(());
        };
        let want = sums.get(rel).ok_or_else(|| format!("{rel} is not in the manifest"))?;
        // Read and hashed a piece at a time, each hashed while it is still in the CPU's
        // cache: a whole chunk read first and hashed after comes back from DRAM for the hash,
        // and the restore's threads share DRAM's bandwidth (measured on an H100 machine, 47
        // GiB from page cache on 16 threads: 16-18 thread-seconds reading, as many hashing).
        let mut h = blake3::Hasher::new();
        let mut verify = std::time::Duration::ZERO;
        for piece in buf.chunks_mut(VERIFY_PIECE) {
            f.read_exact(piece).map_err(io)?;
            let t = std::time::Instant::now();
            h.update(piece);
            verify += t.elapsed();
        }
        times.read += t0.elapsed().saturating_sub(verify);
        times.verify += verify;
        if h.finalize().to_hex().as_str() != want {
            return Err(format!("{} does not match its checksum", path.display()));
        }
        return Ok(());
    }
    if len > buf.len() as u64 {
        return Err(format!("{} has {len} bytes, expected {} at most", path.display(), buf.len()));
    }
    let mut stored = Vec::with_capacity(len as usize);
    f.read_to_end(&mut stored).map_err(io)?;
    let t1 = std::time::Instant::now();
    times.read += t1 - t0;
    check(&stored)?;
    let n = zstd::bulk::decompress_to_buffer(&stored, buf).map_err(|e| format!("{}: not a zstd frame of its data: {e}", path.display()))?;
    times.verify += t1.elapsed();
    if n != buf.len() {
        return Err(format!("{} holds {n} bytes, expected {}", path.display(), buf.len()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection_sees_every_byte() {
        let mut v = vec![0u8; (1 << 20) + 3];
        assert!(is_zero(&v));
        assert!(is_zero(&v[1..]));
        for at in [0, 1, 15, 16, 4095, 1 << 19, (1 << 20) + 2] {
            v[at] = 1;
            assert!(!is_zero(&v), "a set byte at {at}");
            assert!(!is_zero(&v[1..]) || at == 0, "a set byte at {at}, unaligned");
            v[at] = 0;
        }
        assert_eq!(zero_hash(CHUNK as usize), blake3::hash(&vec![0u8; CHUNK as usize]).to_hex().to_string());
        assert_eq!(zero_hash(5), blake3::hash(&[0u8; 5]).to_hex().to_string());
    }

    #[test]
    fn chunking_covers_the_object() {
        assert_eq!(chunk_files("agent/1/7", 1), vec!["agent/1/7.00000"]);
        assert_eq!(chunk_files("agent/1/7", CHUNK).len(), 1);
        assert_eq!(chunk_files("agent/1/7", CHUNK + 1).len(), 2);
        assert_eq!(chunk_files("a", 32 << 30).len(), 512);
    }
}
