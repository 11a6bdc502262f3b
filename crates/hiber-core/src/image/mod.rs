//! The image format, version 1.1, or 1.2 when device data chunks are zstd-compressed (a
//! reader takes 1.0 to 1.2), and the sink an image is written through.
//!
//! An image is a directory:
//! ```text
//! IMAGE/
//!   manifest.json   magic "HIBER-IMAGE", format {major, minor}, creation time, host,
//!                   kernel, CRIU and hiber versions, the process tree, one section per
//!                   device engine, the parent image it shares files with (if any), and
//!                   every other file with its size, blake3 hash and encoding as stored
//!   criu/           CRIU's image files
//!   <engine>/       files a device engine wrote (the agent's device memory chunks)
//! ```
//! The format version is independent of hiber's version. A reader rejects a different
//! major or a newer minor version. Every file is listed in the manifest: a missing, extra,
//! truncated or altered file makes the image invalid, with an error that names it.
//!
//! An image is written under a hidden temporary name in the destination's parent and
//! renamed into place only when complete and fsync'd, so a crash never leaves a partial
//! image that looks complete. Directories are 0700 and files 0600: an image holds process
//! memory, secrets included.

pub mod chunks;
mod manifest;
mod sink;
pub mod trust;
mod writer;

pub use manifest::{DeviceSection, FileEntry, FormatVersion, Head, Manifest, ParentRef, Source};
pub use sink::ImageSink;
pub use writer::{is_temp_name, make_durable, ImageWriter};

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

pub const MAGIC: &str = "HIBER-IMAGE";
/// 1.1: engine sections carry their own version; processes list the device files they
/// hold instead of a flag for NVIDIA's. A 1.1 reader takes 1.0 images. Images are written
/// as 1.1 unless they need [`FORMAT_COMPRESSED`].
pub const FORMAT: FormatVersion = FormatVersion { major: 1, minor: 1 };
/// 1.2: device data chunks may be zstd frames (a file's `encoding`), which a 1.1 reader
/// would take for truncated files. The newest format this hiber reads.
pub const FORMAT_COMPRESSED: FormatVersion = FormatVersion { major: 1, minor: 2 };
pub const MANIFEST_FILE: &str = "manifest.json";

/// The machine's record of the PID namespace numbers that images' CUDA sockets name, for
/// every state directory (jobs of another `HIBER_STATE` take namespaces from the same
/// kernel): lines `NUMBER<TAB>IMAGE`, appended by each checkpoint. It outlives a reboot: the
/// kernel numbers namespaces from the same base at every boot, so an image's names can
/// clash with a job started after one.
const NAMESPACE_RECORD: &str = "/var/lib/hiber/cuda-namespaces";

/// Past this size the record is rewritten with the entries whose image is still there.
const NAMESPACE_RECORD_PRUNE_BYTES: u64 = 1 << 20;

/// Adds the image at `image` (committed) and its namespace numbers to the machine's record.
pub fn record_cuda_namespaces(image: &Path, numbers: &[u64]) -> std::io::Result<()> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if numbers.is_empty() {
        return Ok(());
    }
    let record = Path::new(NAMESPACE_RECORD);
    if let Some(dir) = record.parent() {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    }
    let image = std::fs::canonicalize(image)?;
    let mut f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).open(record)?;
    // Concurrent checkpoints and the pruning below take turns.
    crate::sys::flock(&f, true)?;
    if f.metadata()?.len() > NAMESPACE_RECORD_PRUNE_BYTES {
        let mut text = String::new();
        f.read_to_string(&mut text)?;
        let live: String = text.lines().filter(|l| l.split_once('\t').is_some_and(|(_, i)| image_is_there(i))).map(|l| format!("{l}\n")).collect();
        f.set_len(0)?;
        f.rewind()?;
        f.write_all(live.as_bytes())?;
    }
    f.seek(std::io::SeekFrom::End(0))?;
    let lines: String = numbers.iter().map(|n| format!("{n}\t{}\n", image.display())).collect();
    f.write_all(lines.as_bytes())
}

/// The numbers of the machine's record whose image is still there.
pub fn recorded_cuda_namespaces() -> Vec<u64> {
    let Ok(mut f) = std::fs::File::open(NAMESPACE_RECORD) else { return Vec::new() };
    let mut text = String::new();
    if crate::sys::flock(&f, false).and_then(|()| std::io::Read::read_to_string(&mut f, &mut text)).is_err() {
        return Vec::new();
    }
    let mut out: Vec<u64> =
        text.lines().filter_map(|l| l.split_once('\t')).filter(|(_, image)| image_is_there(image)).filter_map(|(n, _)| n.parse().ok()).collect();
    out.sort_unstable();
    out.dedup();
    out
}

fn image_is_there(dir: &str) -> bool {
    Path::new(dir).join(MANIFEST_FILE).exists()
}

/// The hex blake3 of `manifest.json`, on one line.
pub const MANIFEST_SUM_FILE: &str = "manifest.blake3";
/// CRIU's files live in this subdirectory of an image.
pub const CRIU_DIR: &str = "criu";
/// A manifest larger than this is not a manifest; bounds what a reader decodes.
const MAX_MANIFEST_BYTES: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{0}: no such image")]
    NotFound(PathBuf),
    #[error("{0}: not a hiber image (no {MANIFEST_FILE})")]
    NotAnImage(PathBuf),
    #[error("{path}: manifest is corrupt: {reason}")]
    CorruptManifest { path: PathBuf, reason: String },
    #[error("{path}: image format {found} is not supported (this hiber reads {}.0 to {})", FORMAT_COMPRESSED.major, FORMAT_COMPRESSED)]
    UnsupportedFormat { path: PathBuf, found: FormatVersion },
    #[error("{0}: file listed in the manifest is missing")]
    MissingFile(PathBuf),
    #[error("{0}: file is not listed in the manifest")]
    UnexpectedFile(PathBuf),
    #[error("{path}: truncated or resized: {found} bytes, manifest says {expected}")]
    SizeMismatch { path: PathBuf, expected: u64, found: u64 },
    #[error("{0}: checksum mismatch (the file was altered or damaged)")]
    ChecksumMismatch(PathBuf),
    #[error("{path}: {step}: {source}")]
    Io { path: PathBuf, step: &'static str, source: io::Error },
    #[error("{0}: already exists; choose another --out or remove it")]
    OutputExists(PathBuf),
    /// Another user could have written it (see [`trust`]).
    #[error("{path}: not trusted: {why}")]
    Untrusted { path: PathBuf, why: String },
}

impl ImageError {
    fn io<'a>(path: &'a Path, step: &'static str) -> impl FnOnce(io::Error) -> ImageError + 'a {
        move |source| ImageError::Io { path: path.to_path_buf(), step, source }
    }

    /// Whether the image itself is damaged or foreign (as opposed to an I/O failure).
    pub fn is_invalid_image(&self) -> bool {
        !matches!(self, ImageError::Io { .. } | ImageError::OutputExists(_) | ImageError::NotFound(_))
    }
}

/// An image whose manifest has been read and checked (but whose files have not yet been
/// verified: see [`Image::verify`]).
#[derive(Debug)]
pub struct Image {
    pub dir: PathBuf,
    pub manifest: Manifest,
}

impl Image {
    pub fn open(dir: &Path) -> Result<Image, ImageError> {
        let meta = fs::metadata(dir).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => ImageError::NotFound(dir.to_path_buf()),
            _ => ImageError::Io { path: dir.to_path_buf(), step: "stat", source: e },
        })?;
        if !meta.is_dir() {
            return Err(ImageError::NotAnImage(dir.to_path_buf()));
        }
        let mpath = dir.join(MANIFEST_FILE);
        // Only a manifest that is not there makes the directory no image: one that cannot be
        // read (permission denied, say) is reported as such.
        let mmeta = fs::metadata(&mpath).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => ImageError::NotAnImage(dir.to_path_buf()),
            _ => ImageError::Io { path: mpath.clone(), step: "stat", source: e },
        })?;
        if mmeta.len() > MAX_MANIFEST_BYTES {
            return Err(ImageError::CorruptManifest { path: mpath, reason: format!("{} bytes is too large", mmeta.len()) });
        }
        let text = fs::read(&mpath).map_err(ImageError::io(&mpath, "read"))?;
        let corrupt = |reason| ImageError::CorruptManifest { path: mpath.clone(), reason };
        let head = Manifest::parse_head(&text).map_err(corrupt)?;
        if head.magic != MAGIC {
            return Err(ImageError::NotAnImage(dir.to_path_buf()));
        }
        if head.format.major != FORMAT_COMPRESSED.major || head.format.minor > FORMAT_COMPRESSED.minor {
            return Err(ImageError::UnsupportedFormat { path: dir.to_path_buf(), found: head.format });
        }
        // The manifest says what every other file must be; it is checked first itself.
        let spath = dir.join(MANIFEST_SUM_FILE);
        let sum = fs::read_to_string(&spath).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => ImageError::MissingFile(spath.clone()),
            _ => ImageError::Io { path: spath.clone(), step: "read", source: e },
        })?;
        if sum.trim() != blake3::hash(&text).to_hex().as_str() {
            return Err(ImageError::ChecksumMismatch(mpath));
        }
        let manifest = Manifest::parse(&text).map_err(corrupt)?;
        if manifest.processes.is_empty() {
            return Err(corrupt("it lists no process".into()));
        }
        if let Some(bad) = manifest.files.iter().find(|f| !is_inside_path(&f.path)) {
            return Err(corrupt(format!("it lists the file '{}', which is not a path inside the image", bad.path)));
        }
        Ok(Image { dir: dir.to_path_buf(), manifest })
    }

    /// Checks that the directory holds exactly the files the manifest lists, with their
    /// sizes and checksums. Returns the total bytes verified.
    pub fn verify(&self) -> Result<u64, ImageError> {
        self.verify_except(&[])
    }

    /// Like [`Image::verify`], but files under `deferred/` are checked for presence and
    /// size only: their engine checks each one's checksum as it streams it (device memory
    /// chunks, read once on the way to the GPU instead of twice).
    pub fn verify_except(&self, deferred: &[&str]) -> Result<u64, ImageError> {
        let listed: BTreeMap<&str, &FileEntry> = self.manifest.files.iter().map(|f| (f.path.as_str(), f)).collect();
        let present = list_files(&self.dir)?;
        for rel in &present {
            if rel != MANIFEST_FILE && rel != MANIFEST_SUM_FILE && !listed.contains_key(rel.as_str()) {
                return Err(ImageError::UnexpectedFile(self.dir.join(rel)));
            }
        }
        let mut total = 0;
        for (rel, entry) in &listed {
            let path = self.dir.join(rel);
            if !present.iter().any(|p| p == rel) {
                return Err(ImageError::MissingFile(path));
            }
            let len = fs::metadata(&path).map_err(ImageError::io(&path, "stat"))?.len();
            if len != entry.size {
                return Err(ImageError::SizeMismatch { path, expected: entry.size, found: len });
            }
            let later = deferred.iter().any(|d| rel.strip_prefix(d).is_some_and(|r| r.starts_with('/')));
            if !later && hash_file(&path)? != entry.blake3 {
                return Err(ImageError::ChecksumMismatch(path));
            }
            total += len;
        }
        Ok(total)
    }

    pub fn criu_dir(&self) -> PathBuf {
        self.dir.join(CRIU_DIR)
    }

    /// Bytes of process memory CRIU stored (its `pages-*.img` files).
    pub fn memory_bytes(&self) -> u64 {
        self.manifest.files.iter().filter(|f| is_pages_file(&f.path)).map(|f| f.size).sum()
    }

    pub fn total_bytes(&self) -> u64 {
        self.manifest.files.iter().map(|f| f.size).sum()
    }
}

/// Whether `rel` names a file inside an image: relative, and made of plain names only
/// (no `..`, no `.`, no empty part), so that joining it to the image's path stays there.
pub(crate) fn is_inside_path(rel: &str) -> bool {
    !rel.is_empty() && rel.split('/').all(|part| !part.is_empty() && part != "." && part != "..")
}

fn is_pages_file(rel: &str) -> bool {
    Path::new(rel).file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("pages-") && n.ends_with(".img"))
}

/// blake3 of a file, hashed with all cores over a memory map.
pub fn hash_file(path: &Path) -> Result<String, ImageError> {
    let mut h = blake3::Hasher::new();
    h.update_mmap_rayon(path).map_err(ImageError::io(path, "hash"))?;
    Ok(h.finalize().to_hex().to_string())
}

/// Relative paths of every file under `dir`, sorted; errors on anything that is neither a
/// file nor a directory (an image holds no links or devices).
pub fn list_files(dir: &Path) -> Result<Vec<String>, ImageError> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<(), ImageError> {
        for entry in fs::read_dir(dir).map_err(ImageError::io(dir, "read dir"))? {
            let entry = entry.map_err(ImageError::io(dir, "read dir"))?;
            let path = entry.path();
            let ft = entry.file_type().map_err(ImageError::io(&path, "stat"))?;
            if ft.is_dir() {
                walk(root, &path, out)?;
            } else if ft.is_file() {
                let rel = path.strip_prefix(root).expect("walk stays under root");
                out.push(rel.to_string_lossy().into_owned());
            } else {
                return Err(ImageError::UnexpectedFile(path));
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.sort();
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests;
