//! The local image directory, the sink every checkpoint writes to today: a hidden
//! temporary directory, renamed into place when complete.

use std::collections::HashMap;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{hash_file, list_files, FileEntry, Image, ImageError, ImageSink, Manifest, ParentRef, CRIU_DIR, MANIFEST_FILE, MANIFEST_SUM_FILE};

/// The parent of an incremental image: its files by content, and what was shared so far.
#[derive(Debug)]
struct Parent {
    dir: PathBuf,
    manifest_blake3: String,
    /// (blake3, size) → the file's path in the parent.
    by_content: HashMap<(String, u64), String>,
    /// GPU fingerprint → the parent's entry of a chunk with that data; empty when the
    /// parent's files cannot be linked from here (another filesystem).
    by_fingerprint: HashMap<String, FileEntry>,
    shared_files: AtomicU64,
    shared_bytes: AtomicU64,
}

/// An image being written. Dropping it without [`ImageWriter::commit`] removes the
/// temporary directory, so a failed checkpoint leaves nothing behind.
#[derive(Debug)]
pub struct ImageWriter {
    tmp: PathBuf,
    dest: PathBuf,
    committed: bool,
    keep: bool,
    parent: Option<Parent>,
    compression: Option<i32>,
    /// Files and directories fsynced at the commit (see [`ImageWriter::transient`]).
    durable: bool,
}

impl ImageWriter {
    /// Prepares to write `dest`, which must not exist. Its parent is created (0700) when
    /// missing.
    pub fn create(dest: &Path) -> Result<ImageWriter, ImageError> {
        if dest.symlink_metadata().is_ok() {
            return Err(ImageError::OutputExists(dest.to_path_buf()));
        }
        let name = dest
            .file_name()
            .ok_or_else(|| ImageError::Io {
                path: dest.to_path_buf(),
                step: "name",
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "has no file name"),
            })?
            .to_string_lossy()
            .into_owned();
        let parent = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        DirBuilder::new().recursive(true).mode(0o700).create(parent).map_err(ImageError::io(parent, "create directory"))?;
        let tmp = parent.join(temp_name(&name));
        let mut b = DirBuilder::new();
        b.mode(0o700);
        b.create(&tmp).map_err(ImageError::io(&tmp, "create directory"))?;
        b.create(tmp.join(CRIU_DIR)).map_err(ImageError::io(&tmp, "create directory"))?;
        Ok(ImageWriter { tmp, dest: dest.to_path_buf(), committed: false, keep: false, parent: None, compression: None, durable: true })
    }

    /// Makes this an incremental image of `parent`: device data the parent already holds
    /// (the same bytes, by blake3 and size) is shared with it, not written again. The
    /// parent's manifest is checked now; each shared file's content is checked when either
    /// image is verified or restored.
    pub fn share_with(&mut self, parent: &Path) -> Result<(), ImageError> {
        let image = Image::open(parent)?;
        let sum_path = image.dir.join(MANIFEST_SUM_FILE);
        let manifest_blake3 = fs::read_to_string(&sum_path).map_err(ImageError::io(&sum_path, "read"))?.trim().to_string();
        // Device data only (not CRIU's files), and only paths inside the image.
        let inside = |p: &str| Path::new(p).components().all(|c| matches!(c, std::path::Component::Normal(_)));
        let by_content = image
            .manifest
            .files
            .iter()
            .filter(|f| !f.path.starts_with(&format!("{CRIU_DIR}/")) && inside(&f.path))
            .map(|f| ((f.blake3.clone(), f.size), f.path.clone()))
            .collect();
        let dir = fs::canonicalize(&image.dir).map_err(ImageError::io(&image.dir, "resolve"))?;
        // A chunk found unchanged by its fingerprint is not copied while the application is
        // stopped, so it must be shareable for sure: on the same filesystem (a hard link),
        // and only a data file inside the image, as `by_content`.
        let same_fs = match (fs::metadata(&dir), fs::metadata(&self.tmp)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev(),
            _ => false,
        };
        let by_fingerprint = if same_fs {
            image
                .manifest
                .files
                .iter()
                .filter(|f| !f.path.starts_with(&format!("{CRIU_DIR}/")) && inside(&f.path))
                .filter_map(|f| Some((f.fingerprint.clone()?, f.clone())))
                .collect()
        } else {
            HashMap::new()
        };
        self.parent = Some(Parent { dir, manifest_blake3, by_content, by_fingerprint, shared_files: AtomicU64::new(0), shared_bytes: AtomicU64::new(0) });
        Ok(())
    }

    /// Compresses device data chunks with zstd at `level` (where that makes them shorter).
    pub fn compress(&mut self, level: i32) {
        self.compression = Some(level);
    }

    /// Files and bytes shared with the parent so far.
    pub fn shared(&self) -> (u64, u64) {
        self.parent.as_ref().map_or((0, 0), |p| (p.shared_files.load(Ordering::Relaxed), p.shared_bytes.load(Ordering::Relaxed)))
    }

    /// Keeps the temporary directory when dropped: it holds device data that `hiber
    /// recover` needs (a checkpoint whose undo failed).
    pub fn keep_partial(&mut self) {
        self.keep = true;
    }

    /// Where the image goes (is, once committed).
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    pub fn is_committed(&self) -> bool {
        self.committed
    }

    /// An image that is only a transfer buffer (a migration's: removed once the job runs
    /// elsewhere): its commit does not fsync it. Whoever keeps it after all makes it durable
    /// with [`make_durable`].
    pub fn transient(&mut self) {
        self.durable = false;
    }

    pub fn tmp_dir(&self) -> &Path {
        &self.tmp
    }

    /// Lists and hashes every file, writes the manifest, makes it all durable and renames
    /// the directory into place. On error nothing is renamed and the caller decides (the
    /// drop removes the temporary directory).
    ///
    /// `known` are entries of files already written durably and hashed by their writer
    /// (device memory chunks); they are checked for size, not hashed again.
    pub fn commit(&mut self, mut manifest: Manifest, known: &[FileEntry]) -> Result<(), ImageError> {
        let known: std::collections::HashMap<&str, &FileEntry> = known.iter().map(|f| (f.path.as_str(), f)).collect();
        let mut entries = Vec::new();
        let present = list_files(&self.tmp)?;
        if let Some(missing) = known.keys().find(|k| !present.iter().any(|p| p == *k)) {
            return Err(ImageError::MissingFile(self.tmp.join(missing)));
        }
        for rel in present {
            if rel == MANIFEST_FILE || rel == MANIFEST_SUM_FILE {
                return Err(ImageError::UnexpectedFile(self.tmp.join(rel)));
            }
            let path = self.tmp.join(&rel);
            if let Some(k) = known.get(rel.as_str()) {
                let size = fs::metadata(&path).map_err(ImageError::io(&path, "stat"))?.len();
                if size != k.size {
                    return Err(ImageError::SizeMismatch { path, expected: k.size, found: size });
                }
                entries.push((*k).clone());
                continue;
            }
            fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).map_err(ImageError::io(&path, "chmod"))?;
            let f = File::open(&path).map_err(ImageError::io(&path, "open"))?;
            if self.durable {
                f.sync_all().map_err(ImageError::io(&path, "fsync"))?;
            }
            let size = f.metadata().map_err(ImageError::io(&path, "stat"))?.len();
            entries.push(FileEntry { blake3: hash_file(&path)?, path: rel, size, encoding: None, fingerprint: None });
        }
        if entries.iter().any(|e| e.encoding.is_some()) {
            manifest.format = super::FORMAT_COMPRESSED;
        }
        manifest.files = entries;
        manifest.parent = self.parent.as_ref().filter(|p| p.shared_files.load(Ordering::Relaxed) > 0).map(|p| ParentRef {
            path: p.dir.display().to_string(),
            manifest_blake3: p.manifest_blake3.clone(),
            shared_files: p.shared_files.load(Ordering::Relaxed),
            shared_bytes: p.shared_bytes.load(Ordering::Relaxed),
        });
        let json = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
        let sum = format!("{}\n", blake3::hash(&json).to_hex());
        for (name, bytes) in [(MANIFEST_FILE, json.as_slice()), (MANIFEST_SUM_FILE, sum.as_bytes())] {
            let path = self.tmp.join(name);
            let mut f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).map_err(ImageError::io(&path, "create"))?;
            f.write_all(bytes).map_err(ImageError::io(&path, "write"))?;
            if self.durable {
                f.sync_all().map_err(ImageError::io(&path, "fsync"))?;
            }
        }
        if self.durable {
            sync_dirs(&self.tmp)?;
        }
        crate::sys::rename_noreplace(&self.tmp, &self.dest).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => ImageError::OutputExists(self.dest.clone()),
            _ => ImageError::Io { path: self.dest.clone(), step: "rename into place", source: e },
        })?;
        self.committed = true;
        // The image is complete and in place; a failure to make the rename itself durable
        // is reported, not treated as a failed image.
        let parent = self.dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        if !self.durable {
            return Ok(());
        }
        if let Err(e) = sync_dir(parent) {
            tracing::warn!(error = %e, "could not fsync the image's parent directory");
        }
        Ok(())
    }
}

impl ImageSink for ImageWriter {
    fn criu_dir(&self) -> PathBuf {
        self.tmp.join(CRIU_DIR)
    }

    fn create_file(&self, rel: &str) -> std::io::Result<File> {
        let path = self.tmp.join(rel);
        if let Some(parent) = path.parent() {
            DirBuilder::new().recursive(true).mode(0o700).create(parent)?;
        }
        OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)
    }

    fn has_file(&self, rel: &str) -> bool {
        self.tmp.join(rel).exists()
    }

    /// A hard link to the parent's file: one file with two names, so removing either image
    /// leaves the other whole (the filesystem counts the links). The linked file is read
    /// back and must hash to `blake3`: the parent may have changed since its manifest was
    /// read, and this image's manifest vouches for every byte. Sharing only saves work, so
    /// whatever goes wrong (another filesystem, a parent file gone or altered) makes the
    /// caller write the chunk instead.
    fn reuse(&self, rel: &str, blake3: &str, size: u64) -> std::io::Result<bool> {
        let Some(p) = &self.parent else { return Ok(false) };
        let Some(src) = p.by_content.get(&(blake3.to_string(), size)).map(|r| p.dir.join(r)) else { return Ok(false) };
        let dst = self.tmp.join(rel);
        let mut linked = false;
        let mut link = || -> std::io::Result<bool> {
            // Only a plain file as private as this image's own: hiber's, 0600.
            let m = fs::symlink_metadata(&src)?;
            if !m.is_file() || m.uid() != crate::sys::geteuid() || m.mode() & 0o077 != 0 {
                return Ok(false);
            }
            let dir = dst.parent().unwrap_or(&self.tmp);
            DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
            fs::hard_link(&src, &dst)?;
            linked = true;
            let mut h = blake3::Hasher::new();
            let n = std::io::copy(&mut File::open(&dst)?, &mut h)?;
            if n != size || h.finalize().to_hex().as_str() != blake3 {
                tracing::warn!(parent = %src.display(), "a file of the parent image no longer matches its manifest; written instead of shared");
                fs::remove_file(&dst)?;
                return Ok(false);
            }
            // The new name is as durable as a written chunk would be.
            File::open(dir)?.sync_all()?;
            Ok(true)
        };
        match link() {
            Ok(true) => {
                p.shared_files.fetch_add(1, Ordering::Relaxed);
                p.shared_bytes.fetch_add(size, Ordering::Relaxed);
                Ok(true)
            }
            Ok(false) => Ok(false),
            Err(e) => {
                tracing::debug!(parent = %src.display(), error = %e, "not shared with the parent; written instead");
                // The link this made, if any, goes, so that the chunk can be written.
                if linked {
                    fs::remove_file(&dst)?;
                }
                Ok(false)
            }
        }
    }

    fn parent_fingerprint(&self, fp: &str) -> bool {
        self.parent.as_ref().is_some_and(|p| p.by_fingerprint.contains_key(fp))
    }

    fn reuse_fingerprint(&self, rel: &str, fp: &str) -> std::io::Result<Option<FileEntry>> {
        let Some(e) = self.parent.as_ref().and_then(|p| p.by_fingerprint.get(fp)) else { return Ok(None) };
        if !self.reuse(rel, &e.blake3, e.size)? {
            return Ok(None);
        }
        Ok(Some(FileEntry { path: rel.to_string(), fingerprint: Some(fp.to_string()), ..e.clone() }))
    }

    fn location(&self) -> &Path {
        &self.tmp
    }

    fn compression(&self) -> Option<i32> {
        self.compression
    }
}

impl Drop for ImageWriter {
    fn drop(&mut self) {
        if !self.committed && !self.keep {
            if let Err(e) = fs::remove_dir_all(&self.tmp) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %self.tmp.display(), error = %e, "could not remove partial image");
                }
            }
        }
    }
}

/// Hidden and marked, so that neither `hiber ls` nor a reader mistakes it for an image.
fn temp_name(final_name: &str) -> String {
    format!(".{final_name}.partial-{}", std::process::id())
}

/// Whether a directory name is that of an unfinished image.
pub fn is_temp_name(name: &str) -> bool {
    name.starts_with('.') && name.contains(".partial-")
}

fn sync_dir(dir: &Path) -> Result<(), ImageError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(ImageError::io(dir, "fsync directory"))
}

/// Makes a committed image that was [`ImageWriter::transient`] durable: every file, every
/// directory, and its name in its parent.
pub fn make_durable(root: &Path) -> Result<(), ImageError> {
    fn files(dir: &Path) -> Result<(), ImageError> {
        for entry in fs::read_dir(dir).map_err(ImageError::io(dir, "read dir"))? {
            let entry = entry.map_err(ImageError::io(dir, "read dir"))?;
            let path = entry.path();
            if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                files(&path)?;
            } else {
                File::open(&path).and_then(|f| f.sync_all()).map_err(ImageError::io(&path, "fsync"))?;
            }
        }
        Ok(())
    }
    files(root)?;
    sync_dirs(root)?;
    sync_dir(root.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))
}

fn sync_dirs(root: &Path) -> Result<(), ImageError> {
    for entry in fs::read_dir(root).map_err(ImageError::io(root, "read dir"))? {
        let entry = entry.map_err(ImageError::io(root, "read dir"))?;
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            sync_dirs(&entry.path())?;
        }
    }
    sync_dir(root)
}
