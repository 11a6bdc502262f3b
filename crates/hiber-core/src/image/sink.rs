//! Where an image's bytes go.
//!
//! A checkpoint writes through an [`ImageSink`]: CRIU's files and the engines' chunks
//! alike. Today the one sink is the local image directory ([`super::ImageWriter`]: a
//! hidden temporary directory, renamed into place when complete), which makes incremental
//! images too: a chunk its parent image already holds is hard-linked from there
//! ([`ImageSink::reuse`]), so every image stays a whole directory and the filesystem counts
//! the references, with no chunk store beside the images. The same seam takes a stream to
//! another host (migration: files are sent as they are written, and the manifest last).
//!
//! CRIU writes its own files into a directory it is given (`images_dir`); a sink that is
//! not a local directory gives CRIU a local staging directory and takes the files from
//! there, or CRIU's page server, as the stream sink will.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

pub trait ImageSink: Send + Sync {
    /// The directory CRIU writes its image files into.
    fn criu_dir(&self) -> PathBuf;

    /// Creates file `rel` of the image (relative to its root, `/`-separated), private
    /// (0600, directories 0700), failing rather than replacing an existing one.
    fn create_file(&self, rel: &str) -> io::Result<File>;

    /// Whether file `rel` is already in the image (written by an earlier step).
    fn has_file(&self, rel: &str) -> bool;

    /// Puts into the image, as `rel`, a file of the parent image (an incremental
    /// checkpoint's) with this content, instead of writing it: `Ok(true)` when it did.
    /// `Ok(false)` when there is no parent, no such file, or it cannot be shared (another
    /// filesystem): then the caller writes the file.
    fn reuse(&self, _rel: &str, _blake3: &str, _size: u64) -> io::Result<bool> {
        Ok(false)
    }

    /// Whether the parent image holds a device data chunk with GPU fingerprint `fp` that
    /// this image can share (see [`ImageSink::reuse_fingerprint`]).
    fn parent_fingerprint(&self, _fp: &str) -> bool {
        false
    }

    /// Puts into the image, as `rel`, the parent's chunk with GPU fingerprint `fp`, as
    /// [`ImageSink::reuse`] does, and returns its entry (the parent's checksum, size and
    /// encoding); `Ok(None)` when it cannot. Then the caller writes the data if it still
    /// holds it.
    fn reuse_fingerprint(&self, _rel: &str, _fp: &str) -> io::Result<Option<super::FileEntry>> {
        Ok(None)
    }

    /// The zstd level device data chunks are compressed at, if at all.
    fn compression(&self) -> Option<i32> {
        None
    }

    /// Where the sink keeps what it was given, for messages and for `hiber recover`.
    fn location(&self) -> &Path;
}
