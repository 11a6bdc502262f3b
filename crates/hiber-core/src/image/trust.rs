//! Whether an image may be handed to CRIU.
//!
//! A restore runs as root, and CRIU makes whatever the image's files say: memory (code
//! included), credentials, open files. An image that another user could have written is a
//! program that user could run as root. So, as sshd refuses keys that others can write
//! (`StrictModes`), a restore refuses an image unless hiber's own user (root) owns every
//! directory and file of it and nobody else can write any of them, nor rename the image
//! away and put another in its place: every directory above it must be owned by root or
//! hiber's user and writable by nobody else, unless it is sticky and root's (`/tmp`),
//! where others cannot rename what is not theirs.
//!
//! Such an image cannot change between its verification and CRIU's reading it, but by
//! root. An image that fails the check can still be restored with an explicit override
//! (`hiber restore --trust-image`): it is then copied into a private directory first, and
//! the copy is what hiber verifies and CRIU reads, so nothing can be swapped in between.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::ImageError;

/// Group- and world-writable bits.
const WRITABLE_BY_OTHERS: u32 = 0o022;
const STICKY: u32 = 0o1000;

/// Checks `dir` (an image directory), everything in it and every directory above it.
pub fn check(dir: &Path) -> Result<(), ImageError> {
    let me = crate::sys::geteuid();
    let untrusted = |path: &Path, why: String| ImageError::Untrusted { path: path.to_path_buf(), why };
    let canonical = fs::canonicalize(dir).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => ImageError::NotFound(dir.to_path_buf()),
        _ => ImageError::Io { path: dir.to_path_buf(), step: "resolve", source: e },
    })?;
    for above in canonical.ancestors().skip(1) {
        let meta = fs::metadata(above).map_err(ImageError::io(above, "stat"))?;
        let mode = meta.permissions().mode();
        let owner_ok = meta.uid() == 0 || meta.uid() == me;
        if !owner_ok {
            return Err(untrusted(above, format!("a directory above the image is owned by uid {}, who could put another image in its place", meta.uid())));
        }
        if mode & WRITABLE_BY_OTHERS != 0 && !(mode & STICKY != 0 && meta.uid() == 0) {
            return Err(untrusted(
                above,
                format!("a directory above the image is writable by others (mode {:o}), who could put another image in its place", mode & 0o7777),
            ));
        }
    }
    check_tree(&canonical, me)
}

/// Every directory and file from `path` down: owned by `me`, writable by nobody else, and
/// no links or special files.
fn check_tree(path: &Path, me: u32) -> Result<(), ImageError> {
    let meta = fs::symlink_metadata(path).map_err(ImageError::io(path, "stat"))?;
    let mode = meta.permissions().mode();
    let untrusted = |why: String| Err(ImageError::Untrusted { path: path.to_path_buf(), why });
    if meta.uid() != me {
        return untrusted(format!("owned by uid {}, not by hiber's user ({me})", meta.uid()));
    }
    if mode & WRITABLE_BY_OTHERS != 0 {
        return untrusted(format!("writable by others (mode {:o})", mode & 0o7777));
    }
    if meta.is_dir() {
        for entry in fs::read_dir(path).map_err(ImageError::io(path, "read dir"))? {
            let entry = entry.map_err(ImageError::io(path, "read dir"))?;
            check_tree(&entry.path(), me)?;
        }
    } else if !meta.is_file() {
        return untrusted("neither a file nor a directory (an image holds no links or devices)".into());
    }
    Ok(())
}

/// Copies the image at `src` into `dest` (created, 0700), every file 0600, opened without
/// following links: the copy an untrusted image is restored from. It is not verified here;
/// the caller verifies the copy, which nobody else can change.
pub fn private_copy(src: &Path, dest: &Path) -> Result<(), ImageError> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new().mode(0o700).create(dest).map_err(ImageError::io(dest, "create"))?;
    copy_dir(src, dest)
}

fn copy_dir(src: &Path, dest: &Path) -> Result<(), ImageError> {
    use std::os::unix::fs::DirBuilderExt;
    for entry in fs::read_dir(src).map_err(ImageError::io(src, "read dir"))? {
        let entry = entry.map_err(ImageError::io(src, "read dir"))?;
        let (from, to) = (entry.path(), dest.join(entry.file_name()));
        let ft = entry.file_type().map_err(ImageError::io(&from, "stat"))?;
        if ft.is_dir() {
            fs::DirBuilder::new().mode(0o700).create(&to).map_err(ImageError::io(&to, "create"))?;
            copy_dir(&from, &to)?;
        } else if ft.is_file() {
            let mut input = fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&from).map_err(ImageError::io(&from, "open"))?;
            let mut output = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&to).map_err(ImageError::io(&to, "create"))?;
            io::copy(&mut input, &mut output).map_err(ImageError::io(&to, "copy"))?;
        } else {
            return Err(ImageError::UnexpectedFile(from));
        }
    }
    Ok(())
}

/// Where private copies of untrusted images go, under the state directory.
pub fn copies_dir(state: &crate::state::StateDir) -> PathBuf {
    state.root().join("untrusted-copies")
}

/// Removes the private copies that restores left when their hiber was killed (each is
/// named after its hiber, [`crate::state::hiber_tag`]); returns how many.
pub fn sweep_copies(state: &crate::state::StateDir) -> usize {
    let Ok(dir) = fs::read_dir(copies_dir(state)) else { return 0 };
    let mut removed = 0;
    for stale in dir.flatten() {
        if crate::state::made_by_a_gone_hiber(&stale.file_name().to_string_lossy()) && fs::remove_dir_all(stale.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn image_like(tag: &str) -> PathBuf {
        let base = std::env::temp_dir().join(format!("hiber-trust-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(base.join("img/criu")).unwrap();
        fs::set_permissions(&base, fs::Permissions::from_mode(0o755)).unwrap();
        for d in ["img", "img/criu"] {
            fs::set_permissions(base.join(d), fs::Permissions::from_mode(0o700)).unwrap();
        }
        for f in ["img/manifest.json", "img/criu/pages-1.img"] {
            fs::write(base.join(f), b"x").unwrap();
            fs::set_permissions(base.join(f), fs::Permissions::from_mode(0o600)).unwrap();
        }
        base
    }

    #[test]
    fn writable_by_others_anywhere_is_refused() {
        let base = image_like("modes");
        let img = base.join("img");
        check(&img).unwrap();
        for (path, mode) in [("img", 0o777), ("img/criu", 0o770), ("img/manifest.json", 0o666), ("img/criu/pages-1.img", 0o620)] {
            let p = base.join(path);
            let before = fs::metadata(&p).unwrap().permissions().mode();
            fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
            let e = check(&img).unwrap_err();
            assert!(matches!(&e, ImageError::Untrusted { path, .. } if path.ends_with(p.strip_prefix(&base).unwrap())), "{path}: {e}");
            fs::set_permissions(&p, fs::Permissions::from_mode(before)).unwrap();
        }
        // The directory above, writable by all without the sticky bit: another image could
        // be put in this one's place.
        fs::set_permissions(&base, fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(check(&img), Err(ImageError::Untrusted { .. })));
        fs::set_permissions(&base, fs::Permissions::from_mode(0o1777)).unwrap();
        check(&img).expect("a sticky directory of root's, as /tmp, is fine");
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn owned_by_another_user_or_linked_is_refused() {
        let base = image_like("owner");
        let img = base.join("img");
        let f = base.join("img/criu/pages-1.img");
        std::os::unix::fs::chown(&f, Some(65534), None).unwrap();
        assert!(matches!(check(&img), Err(ImageError::Untrusted { .. })));
        fs::remove_file(&f).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &f).unwrap();
        assert!(matches!(check(&img), Err(ImageError::Untrusted { .. })));
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_private_copy_is_private() {
        let base = image_like("copy");
        let copy = base.join("copy");
        private_copy(&base.join("img"), &copy).unwrap();
        assert_eq!(fs::read(copy.join("criu/pages-1.img")).unwrap(), b"x");
        assert_eq!(fs::metadata(&copy).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(fs::metadata(copy.join("manifest.json")).unwrap().permissions().mode() & 0o777, 0o600);
        fs::remove_dir_all(&base).unwrap();
    }
}
