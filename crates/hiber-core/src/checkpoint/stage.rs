//! A staging area in memory for CRIU's files of a `--leave-running` checkpoint.
//!
//! CRIU writes the frozen processes' memory into its files while the application is
//! paused. On 2×H200, 3.4 GiB went into the image's directory on ext4 at 3.8 GB/s, and into
//! a tmpfs with large folios (`huge=within_size`) at 5.7 GB/s
//! (`bench/probes/results/2026-11-26-h200x2-criu-write.txt`): about 0.3 s of a DDP job's
//! pause. So a `--leave-running` checkpoint gives CRIU a private tmpfs of its own, when
//! memory allows, and copies the files into the image after the application runs again;
//! then the tmpfs goes.
//!
//! The tmpfs is mounted 0700 at `$STATE/stage/<hiber pid>-<its start time>-<n>`, with room
//! for what CRIU can write (the tree's resident anonymous and shared memory and swap, the
//! job's own `/dev/shm`, which CRIU carries whole, a quarter more, and 256 MiB), and only
//! where that leaves 2 GiB of the host's available memory and of every memory cgroup above
//! hiber. Should CRIU still fill it, the dump is made again into the image's directory.
//! It holds process memory, secrets included: it is unmounted whatever happens to the
//! checkpoint, and the stages of a hiber that was killed are swept by the next hiber
//! command ([`sweep`]). `HIBER_CRIU_STAGE=0` turns it off; `HIBER_CRIU_STAGE_MIB` caps its
//! size.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::state::StateDir;
use crate::{proctree, sys};

/// Large folios for the files that fit them (CRIU's pages files); the host's default for
/// tmpfs is none.
const OPTIONS: &str = "mode=0700,huge=within_size";
/// Available memory left to everything else while the stage is full.
const RESERVE: u64 = 2 << 30;

/// The tmpfs, mounted until dropped.
#[derive(Debug)]
pub struct Stage {
    dir: PathBuf,
}

/// Bytes CRIU may have to write for the tree of `root`, processes `pids`, and the tmpfs
/// size that holds them.
fn room(root: i32, pids: &[i32]) -> (u64, u64) {
    let mut need: u64 = pids.iter().map(|&p| dumped_bytes(p)).sum();
    // A job with a mount namespace of its own has a /dev/shm of its own (`hiber run`
    // gives it one), which CRIU carries whole, mapped or not.
    if proctree::has_own_namespace(root, "mnt") {
        need += sys::used_bytes(Path::new(&format!("/proc/{root}/root/dev/shm"))).unwrap_or(0);
    }
    (need, need + need / 4 + (256 << 20))
}

impl Stage {
    /// A stage for a dump of the tree of `root` (processes `pids`), or `None` (and CRIU
    /// writes into the image) when it is turned off, memory is short, or the mount fails
    /// (hiber not root, say).
    pub fn open(state: &StateDir, root: i32, pids: &[i32]) -> Option<Stage> {
        if std::env::var_os("HIBER_CRIU_STAGE").is_some_and(|v| v == "0") {
            return None;
        }
        let (need, size) = room(root, pids);
        let cap = std::env::var("HIBER_CRIU_STAGE_MIB").ok().and_then(|v| v.parse::<u64>().ok()).map_or(u64::MAX, |m| m << 20);
        let size = size.min(cap);
        let available = sys::host_memory().ok()?.0;
        let available = sys::cgroup_memory_left().map_or(available, |c| c.min(available));
        if available < size + RESERVE {
            tracing::info!(
                need_mib = need >> 20,
                available_mib = available >> 20,
                "CRIU writes into the image directory: too little memory for a staging area"
            );
            return None;
        }
        static N: AtomicU32 = AtomicU32::new(0);
        let root = stages(state);
        state.ensure(&root).ok()?;
        let dir = root.join(format!("{}-{}", crate::state::hiber_tag().ok()?, N.fetch_add(1, Ordering::Relaxed)));
        DirBuilder::new().mode(0o700).create(&dir).ok()?;
        match sys::mount_tmpfs(&dir, &format!("size={size},{OPTIONS}")) {
            Ok(()) => Some(Stage { dir }),
            Err(e) => {
                tracing::info!(error = %e, "CRIU writes into the image directory: no staging area");
                let _ = fs::remove_dir(&dir);
                None
            }
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a dump that failed with CRIU's log `log` ran out of room here.
    pub fn filled(&self, log: &Path) -> bool {
        let said = fs::read_to_string(log).is_ok_and(|t| t.contains("No space left on device"));
        said || sys::available_bytes(&self.dir).is_ok_and(|a| a < 8 << 20)
    }

    /// Copies every file CRIU wrote into `dest` (each created private, never replacing
    /// one), then unmounts the stage. Returns the bytes copied.
    pub fn move_into(self, dest: &Path) -> io::Result<u64> {
        let mut bytes = 0;
        for e in fs::read_dir(&self.dir)? {
            let e = e?;
            if !e.file_type()?.is_file() {
                return Err(io::Error::other(format!("{} is not a file", e.path().display())));
            }
            let mut from = File::open(e.path())?;
            let mut to = OpenOptions::new().write(true).create_new(true).mode(0o600).open(dest.join(e.file_name()))?;
            bytes += io::copy(&mut from, &mut to)?;
        }
        Ok(bytes)
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        remove(&self.dir);
    }
}

/// Detaches, in the caller's mount namespace, every hiber staging area it sees (any state
/// directory's: a tmpfs at `…/stage/<pid>-<start time>-<n>`). For a job's new mount
/// namespace, which starts as a copy of the host's: a staging area of a checkpoint under
/// way then (or of a killed hiber not yet swept) would stay in it for good, with another
/// job's process memory in it. CRIU would dump that tmpfs whole into the job's images, and
/// their restore would fail once the staging area is gone ("Can't stat mountpoint").
/// Best effort: a mount that cannot be detached stays.
pub fn detach_all_here() {
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else { return };
    for target in staging_mounts(&info) {
        let _ = sys::umount_detach(&target);
    }
}

/// The mount points of the staging areas in a mountinfo text.
fn staging_mounts(mountinfo: &str) -> Vec<PathBuf> {
    let stage_name = |n: &str| {
        let parts: Vec<&str> = n.split('-').collect();
        parts.len() == 3 && parts.iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    };
    mountinfo
        .lines()
        .filter_map(|l| {
            let (mount, fs) = l.split_once(" - ")?;
            if fs.split_whitespace().next() != Some("tmpfs") {
                return None;
            }
            let point = PathBuf::from(unescape(mount.split_whitespace().nth(4)?));
            let name = point.file_name()?.to_str()?;
            (point.parent()?.file_name()? == "stage" && stage_name(name)).then_some(point)
        })
        .collect()
}

/// A mountinfo field with its octal escapes (`\040` for a space) undone.
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn stages(state: &StateDir) -> PathBuf {
    state.root().join("stage")
}

fn remove(dir: &Path) {
    if let Err(e) = sys::umount_detach(dir) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot unmount a staging area");
    }
    let _ = fs::remove_dir(dir);
}

/// Unmounts the stages of hibers that no longer run (killed during a checkpoint), and
/// returns how many.
pub fn sweep(state: &StateDir) -> usize {
    let Ok(dir) = fs::read_dir(stages(state)) else { return 0 };
    let mut swept = 0;
    for e in dir.filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        if crate::state::made_by_a_gone_hiber(&name) {
            remove(&e.path());
            swept += 1;
        }
    }
    swept
}

/// What CRIU can write of process `pid`'s memory: its resident anonymous and shared pages
/// and its swap (0 for a process that is gone).
fn dumped_bytes(pid: i32) -> u64 {
    let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else { return 0 };
    ["RssAnon:", "RssShmem:", "VmSwap:"]
        .iter()
        .filter_map(|k| status.lines().find_map(|l| l.strip_prefix(k)?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()))
        .map(|kib| kib << 10)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_room_covers_a_process_s_memory_and_more() {
        // A process whose memory stays put while it is measured.
        let mut child = std::process::Command::new("sleep").arg("10").spawn().unwrap();
        let pid = child.id() as i32;
        // Once asleep: until then its loader still maps and touches memory (CI once saw
        // RssAnon grow from 12 to 28 KiB between two reads).
        let asleep = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let status = loop {
            let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
            if status.lines().any(|l| l.starts_with("State:") && l.contains("(sleeping)")) || std::time::Instant::now() > asleep {
                break status;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        let field = |k: &str| status.lines().find_map(|l| l.strip_prefix(k)?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()).unwrap();
        let (need, size) = room(pid, &[pid]);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(need, (field("RssAnon:") + field("RssShmem:") + field("VmSwap:")) << 10);
        assert!(need > 0);
        assert_eq!(size, need + need / 4 + (256 << 20));
        assert_eq!(room(pid, &[pid, i32::MAX]).0, 0, "processes that are gone need nothing");
    }

    #[test]
    fn a_stage_holds_files_moves_them_and_goes() {
        let tmp = tempdir();
        let state = StateDir::at(tmp.join("state"));
        let Some(stage) = Stage::open(&state, sys::getpid(), &[sys::getpid()]) else {
            // Mounting needs CAP_SYS_ADMIN: CI runs as root, so this is a failure there.
            assert!(sys::geteuid() != 0, "root could not mount a staging area");
            return;
        };
        let dir = stage.dir().to_path_buf();
        assert!(is_tmpfs_mount(&dir), "a tmpfs of its own");
        fs::write(dir.join("pages-1.img"), vec![7u8; 3 << 20]).unwrap();
        fs::write(dir.join("core-1.img"), b"core").unwrap();
        let dest = tmp.join("criu");
        fs::create_dir(&dest).unwrap();
        fs::write(dest.join("core-1.img"), b"older").unwrap();
        // A file already in the image is never replaced: the move fails, and the stage
        // still goes.
        assert!(stage.move_into(&dest).is_err());
        assert!(!is_tmpfs_mount(&dir) && !dir.exists(), "unmounted after a failed move");
        assert_eq!(fs::read(dest.join("core-1.img")).unwrap(), b"older");
        fs::remove_dir_all(&dest).unwrap();
        fs::create_dir(&dest).unwrap();

        let stage = Stage::open(&state, sys::getpid(), &[sys::getpid()]).unwrap();
        fs::write(stage.dir().join("pages-1.img"), vec![7u8; 3 << 20]).unwrap();
        fs::write(stage.dir().join("core-1.img"), b"core").unwrap();
        let dir = stage.dir().to_path_buf();
        assert_eq!(stage.move_into(&dest).unwrap(), (3 << 20) + 4);
        assert_eq!(fs::read(dest.join("pages-1.img")).unwrap(), vec![7u8; 3 << 20]);
        assert_eq!(fs::read(dest.join("core-1.img")).unwrap(), b"core");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(fs::metadata(dest.join("core-1.img")).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(!is_tmpfs_mount(&dir) && !dir.exists(), "the stage is gone");

        // A stage whose hiber died is swept; a live one is not.
        let live = Stage::open(&state, sys::getpid(), &[sys::getpid()]).unwrap();
        let dead = stages(&state).join("999999999-1-0");
        fs::create_dir(&dead).unwrap();
        sys::mount_tmpfs(&dead, "size=1m,mode=0700").unwrap();
        assert!(is_tmpfs_mount(&dead));
        assert_eq!(sweep(&state), 1);
        assert!(!is_tmpfs_mount(&dead) && !dead.exists());
        assert!(is_tmpfs_mount(live.dir()));
        drop(live);
        let _ = fs::remove_dir_all(&tmp);
    }

    #[test]
    fn staging_areas_of_any_state_directory_are_found_in_mountinfo() {
        let info = "\
22 1 8:1 / / rw - ext4 /dev/vda rw
90 22 0:50 / /var/lib/hiber/stage/123-456-0 rw - tmpfs tmpfs rw,mode=700
91 22 0:51 / /tmp/my\\040state/stage/9-8-7 rw - tmpfs tmpfs rw
92 22 0:52 / /tmp/x/stage/not-a-stage rw - tmpfs tmpfs rw
93 22 0:53 / /tmp/y/stage/1-2-3 rw - ext4 /dev/vdb rw
94 22 0:54 / /tmp/z/other/1-2-3 rw - tmpfs tmpfs rw
95 22 0:55 / /dev/shm rw - tmpfs tmpfs rw";
        assert_eq!(
            staging_mounts(info),
            [PathBuf::from("/var/lib/hiber/stage/123-456-0"), PathBuf::from("/tmp/my state/stage/9-8-7")],
            "tmpfs mounts named as stages, under a directory `stage`, and nothing else"
        );
    }

    /// Whether a tmpfs is mounted at `p` (by /proc/self/mountinfo).
    fn is_tmpfs_mount(p: &Path) -> bool {
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
        info.lines().any(|l| {
            let (left, right) = l.split_once(" - ").unwrap_or((l, ""));
            left.split(' ').nth(4) == Some(&*p.to_string_lossy()) && right.starts_with("tmpfs ")
        })
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("hiber-stage-test-{}-{:?}", sys::getpid(), std::thread::current().id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }
}
