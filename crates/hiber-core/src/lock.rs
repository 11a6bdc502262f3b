//! Locks that keep two hibers off one job at once.
//!
//! A checkpoint, and `hiber rm` of a running job, hold an flock on the job's `job.lock`
//! (or, for a process tree that is no job, on `$STATE/locks/pid-<PID>.lock`) for as long as
//! they work on it; a second one is turned away at once, before it touches anything, and
//! says who holds the lock: the holder writes its PID and what it does into the file. Two
//! CRIU dumps of one tree at once fail in CRIU's own words ("Unable to detach from PID"),
//! after both froze the application.
//!
//! The kernel drops an flock when its holder dies, so a killed hiber leaves no stale lock.
//! The holder removes the file as it lets go; one that opened the file just before waits
//! for a lock on a name that is gone, so every taker checks, once it holds the lock, that
//! the path still names the file it locked, and starts again if not.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::jobs::Registry;
use crate::state::StateDir;
use crate::sys;

/// The file a job's lock is held on, in its directory.
const JOB_LOCK: &str = "job.lock";

/// Who holds a lock, as written in its file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub hiber_pid: i32,
    /// What it does to the target, as a participle: "checkpointed", "removed".
    pub doing: String,
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another hiber holds the lock (`holder`: who, when its file could be read).
    #[error("{target} is already being {}", holder.as_ref().map(|h| format!("{} by hiber PID {}", h.doing, h.hiber_pid)).unwrap_or_else(|| "worked on by another hiber".into()))]
    Held { target: String, holder: Option<Holder> },
    #[error("cannot lock {}: {step}: {source}", path.display())]
    Io { path: PathBuf, step: &'static str, source: io::Error },
}

/// Takes job `name`'s lock for `doing` (see [`Holder::doing`]).
pub fn lock_job(registry: &Registry, name: &str, doing: &str) -> Result<OpLock, LockError> {
    OpLock::acquire(&registry.dir_of(name).join(JOB_LOCK), &format!("job '{name}'"), doing)
}

/// Takes the lock of the process tree rooted at `pid`, which is no job's, for `doing`.
pub fn lock_pid(state: &StateDir, pid: i32, doing: &str) -> Result<OpLock, LockError> {
    let dir = state.root().join("locks");
    state.ensure(&dir).map_err(|source| LockError::Io { path: dir.clone(), step: "create", source })?;
    OpLock::acquire(&dir.join(format!("pid-{pid}.lock")), &format!("process {pid}"), doing)
}

/// An exclusive lock, held until dropped; its file goes with it.
#[derive(Debug)]
pub struct OpLock {
    /// Open for as long as the lock is held: the lock is this open file's.
    _file: File,
    path: PathBuf,
}

impl OpLock {
    /// Takes the lock at `path` for `doing` (see [`Holder::doing`]) on `target` (named in the
    /// error: "job 'train'"), or fails at once with [`LockError::Held`]. The directory of
    /// `path` must exist.
    pub fn acquire(path: &Path, target: &str, doing: &str) -> Result<OpLock, LockError> {
        let io_err = |step| move |source| LockError::Io { path: path.to_path_buf(), step, source };
        // Bounded: each round means another holder came and went meanwhile.
        for _ in 0..100 {
            let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).open(path).map_err(io_err("open"))?;
            if !sys::try_flock_exclusive(&file).map_err(io_err("flock"))? {
                return Err(LockError::Held { target: target.to_string(), holder: read_holder(&mut file) });
            }
            let ours = file.metadata().map_err(io_err("stat"))?;
            match fs::metadata(path) {
                Ok(m) if m.ino() == ours.ino() && m.dev() == ours.dev() => {}
                // Removed (or replaced) by the holder this one waited behind: again.
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("stat")(e)),
            }
            let holder = Holder { hiber_pid: sys::getpid(), doing: doing.to_string() };
            file.set_len(0).map_err(io_err("write"))?;
            file.write_all(&serde_json::to_vec(&holder).expect("a holder serializes")).map_err(io_err("write"))?;
            return Ok(OpLock { _file: file, path: path.to_path_buf() });
        }
        Err(LockError::Io { path: path.to_path_buf(), step: "flock", source: io::Error::other("the lock changed hands 100 times") })
    }
}

impl Drop for OpLock {
    fn drop(&mut self) {
        // Removed while still held, so that nobody can take it under this name meanwhile;
        // the directory may be gone already (`hiber rm` removes the job's).
        let _ = fs::remove_file(&self.path);
    }
}

/// Who holds the lock of `file`, if it says; the holder writes it a moment after it took
/// the lock, so an empty file is read again for a little while.
fn read_holder(file: &mut File) -> Option<Holder> {
    for _ in 0..20 {
        let mut text = String::new();
        if file.rewind().is_ok() && file.read_to_string(&mut text).is_ok() {
            if let Ok(h) = serde_json::from_str(&text) {
                return Some(h);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tempdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hiber-lock-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_second_taker_is_turned_away_and_told_who_holds_it() {
        let dir = tempdir("second");
        let path = dir.join("job.lock");
        let first = OpLock::acquire(&path, "job 'a'", "checkpointed").unwrap();
        let e = OpLock::acquire(&path, "job 'a'", "removed").unwrap_err();
        assert_eq!(e.to_string(), format!("job 'a' is already being checkpointed by hiber PID {}", std::process::id()));
        assert!(matches!(e, LockError::Held { holder: Some(Holder { ref doing, .. }), .. } if doing == "checkpointed"));
        drop(first);
        assert!(!path.exists(), "the file goes with the lock");
        let again = OpLock::acquire(&path, "job 'a'", "removed").unwrap();
        drop(again);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_taker_waiting_on_a_removed_file_does_not_share_the_lock() {
        let dir = tempdir("removed");
        let path = dir.join("pid-1.lock");
        let first = OpLock::acquire(&path, "process 1", "checkpointed").unwrap();
        // A second file description of the same file, opened before the holder lets go.
        let stale = OpenOptions::new().read(true).write(true).open(&path).unwrap();
        drop(first);
        assert!(sys::try_flock_exclusive(&stale).unwrap(), "the stale description gets the old file's lock");
        // ...but the name is free, and a new taker gets its own file.
        let second = OpLock::acquire(&path, "process 1", "checkpointed").unwrap();
        assert_ne!(stale.metadata().unwrap().ino(), fs::metadata(&path).unwrap().ino());
        assert!(matches!(OpLock::acquire(&path, "process 1", "checkpointed"), Err(LockError::Held { .. })));
        drop(second);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_holder_that_wrote_nothing_is_an_unknown_hiber() {
        let dir = tempdir("unknown");
        let path = dir.join("job.lock");
        let f = File::create(&path).unwrap();
        assert!(sys::try_flock_exclusive(&f).unwrap());
        let e = OpLock::acquire(&path, "job 'b'", "checkpointed").unwrap_err();
        assert_eq!(e.to_string(), "job 'b' is already being worked on by another hiber");
        drop(f);
        fs::remove_dir_all(&dir).unwrap();
    }
}
