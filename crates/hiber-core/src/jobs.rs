//! The job registry: `$STATE/jobs/NAME/` holds `job.json`, the job's `stdout.log` and
//! `stderr.log`, and `exit.json` once its shim has seen the tree's root exit.
//!
//! A job being restored also holds, until its restore is complete, `restoring.json` (a
//! [`RestoreMarker`], there from the moment the name is taken, before the shim starts),
//! `restore.lock` (held by the restoring hiber and the job's shim while either lives) and,
//! once CRIU has restored the tree, `root.json` (a [`RestoredRoot`], written by the shim
//! before it reports the tree to hiber). Should hiber be killed meanwhile, the job is still
//! listed, as an interrupted restore that `hiber recover` settles (see
//! `restore::interrupted`). `job.lock` is [`crate::lock`]'s.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::proctree;
use crate::state::StateDir;
use crate::sys::{self, ExitStatus};

const JOB_FILE: &str = "job.json";
const EXIT_FILE: &str = "exit.json";
const RESTORING_FILE: &str = "restoring.json";
const ROOT_FILE: &str = "root.json";
const RESTORE_LOCK: &str = "restore.lock";
/// In the directory of a job `hiber run` is starting, until its shim recorded it: the
/// [`crate::state::hiber_tag`] of that hiber, under an exclusive lock that hiber takes and
/// the job's shim inherits, so that a name whose hiber and shim are both gone before the
/// job was recorded is free again.
const STARTING_FILE: &str = "starting";
/// A directory a restore prepares under a hidden name before it takes the job's name.
const RESERVING_SUFFIX: &str = ".reserving";
pub const STDOUT_LOG: &str = "stdout.log";
pub const STDERR_LOG: &str = "stderr.log";

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("no job named '{0}'")]
    NotFound(String),
    #[error("a job named '{0}' already exists")]
    Exists(String),
    #[error("'{0}' is not a valid job name (letters, digits, '.', '_' and '-'; at most 64; not starting with '.' or '-')")]
    BadName(String),
    #[error("job '{name}': {step}: {source}")]
    Io { name: String, step: &'static str, source: io::Error },
    #[error("job '{name}': job.json is corrupt: {reason}")]
    Corrupt { name: String, reason: String },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Job {
    pub name: String,
    /// Host PID of the tree's root (the init of the job's PID namespace).
    pub pid: i32,
    /// The root's start time, so a reused PID is never mistaken for the job.
    pub start_time: u64,
    pub command: Vec<String>,
    /// RFC 3339, UTC.
    pub created: String,
    /// The image this job was restored from, if any.
    pub restored_from: Option<String>,
    /// Set when a checkpoint stopped the job: the image it went to.
    pub checkpointed_to: Option<String>,
    /// The job's latest image (either kind of checkpoint): the parent of its next one.
    #[serde(default)]
    pub last_image: Option<String>,
}

impl Job {
    /// Notes a checkpoint of this job to `image`: its latest image, which its next
    /// checkpoint shares unchanged data with, and where it went when the checkpoint stopped
    /// it (`left_running` false). [`Registry::save`] puts it on record.
    pub fn checkpointed(&mut self, image: &Path, left_running: bool) {
        if !left_running {
            self.checkpointed_to = Some(image.display().to_string());
        }
        self.last_image = Some(image.display().to_string());
    }

    /// The image its next checkpoint shares unchanged data with: its latest, while that is
    /// still there and readable (else none: a full image).
    pub fn default_parent(&self) -> Option<PathBuf> {
        self.last_image
            .as_ref()
            .map(PathBuf::from)
            .filter(|p| crate::image::Image::open(p).inspect_err(|e| tracing::debug!(error = %e, "the job's latest image cannot be a parent")).is_ok())
    }
}

/// What `hiber restore` records in a new job's directory before the job's shim starts, and
/// removes once the restore is complete: enough for `hiber ls` to show the job and for
/// `hiber recover` to settle it should that hiber be killed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoreMarker {
    pub hiber_pid: i32,
    pub hiber_start_time: u64,
    pub image: String,
    /// The job's command (the image's root's command line).
    pub command: Vec<String>,
    /// RFC 3339, UTC.
    pub created: String,
    /// Engines whose device state hiber restores after CRIU: without it the tree cannot
    /// run as it should.
    pub devices: Vec<String>,
    /// CRIU leaves the tree stopped, for hiber to continue (the shim kills it if hiber goes).
    pub leave_stopped: bool,
    /// One participant of a coordinated restore, whose others may have given up.
    pub coordinated: bool,
    /// Restored from a private copy of `image` (an untrusted one), which is no parent for
    /// the job's checkpoints.
    #[serde(default)]
    pub private_copy: bool,
}

/// The restored tree's root, as the job's shim recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoredRoot {
    pub pid: i32,
    pub start_time: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum JobState {
    Running,
    Exited(ExitStatus),
    /// Stopped by a checkpoint into this image.
    Checkpointed(String),
    /// Not running, and its shim recorded no exit (killed together with it, say).
    Gone,
    /// Being restored by this hiber, which still runs.
    Restoring {
        hiber_pid: i32,
    },
    /// Its restore was left unfinished by a hiber that no longer runs: `hiber recover`
    /// adopts or removes it.
    InterruptedRestore,
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobState::Running => write!(f, "running"),
            JobState::Exited(ExitStatus::Code(c)) => write!(f, "exited({c})"),
            JobState::Exited(ExitStatus::Signal(s)) => write!(f, "killed(signal {s})"),
            JobState::Checkpointed(_) => write!(f, "checkpointed"),
            JobState::Gone => write!(f, "gone"),
            JobState::Restoring { .. } => write!(f, "restoring"),
            JobState::InterruptedRestore => write!(f, "interrupted restore"),
        }
    }
}

pub fn validate_name(name: &str) -> Result<(), JobError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(['.', '-'])
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(JobError::BadName(name.to_string()))
    }
}

#[derive(Debug, Clone)]
pub struct Registry {
    dir: PathBuf,
}

impl Registry {
    pub fn new(state: &StateDir) -> Registry {
        Registry { dir: state.jobs() }
    }

    pub fn dir_of(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn stdout_of(&self, name: &str) -> PathBuf {
        self.dir_of(name).join(STDOUT_LOG)
    }

    pub fn stderr_of(&self, name: &str) -> PathBuf {
        self.dir_of(name).join(STDERR_LOG)
    }

    /// Reserves `name` for a job `hiber run` starts: its directory (0700) appears with a
    /// `starting` marker in it, locked (prepared under a hidden name, then renamed). Returns
    /// the directory and the lock, which the job's shim must inherit (see
    /// [`launch::Command::hold`](crate::launch::Command::hold)). Fails if the name is taken,
    /// unless by a start whose hiber and shim are both gone with no job recorded, which is
    /// cleared first.
    pub fn create_dir(&self, name: &str) -> Result<(PathBuf, fs::File), JobError> {
        validate_name(name)?;
        let io_err = |step| move |source| JobError::Io { name: name.to_string(), step, source };
        fs::DirBuilder::new().recursive(true).create(&self.dir).map_err(io_err("create jobs dir"))?;
        let tag = crate::state::hiber_tag().map_err(io_err("read hiber's own start time"))?;
        let tmp = self.dir.join(format!(".{name}.{tag}{RESERVING_SUFFIX}"));
        let _ = fs::remove_dir_all(&tmp);
        let prepared = (|| {
            fs::DirBuilder::new().mode(0o700).create(&tmp).map_err(io_err("create job dir"))?;
            let mut lock =
                OpenOptions::new().write(true).create_new(true).mode(0o600).open(tmp.join(STARTING_FILE)).map_err(io_err("create the start marker"))?;
            sys::flock(&lock, true).map_err(io_err("lock the start marker"))?;
            lock.write_all(tag.as_bytes()).map_err(io_err("write the start marker"))?;
            Ok(lock)
        })();
        let dir = self.dir_of(name);
        let taken = prepared.and_then(|lock| {
            let rename = || sys::rename_noreplace(&tmp, &dir);
            match rename() {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && self.reclaim_abandoned_start(name) => rename(),
                r => r,
            }
            .map(|()| lock)
            .map_err(|e| if e.kind() == io::ErrorKind::AlreadyExists { JobError::Exists(name.to_string()) } else { io_err("rename job dir")(e) })
        });
        if taken.is_err() {
            let _ = fs::remove_dir_all(&tmp);
        }
        taken.map(|lock| (dir, lock))
    }

    /// Removes `name` if it is a start that nobody finishes: no job recorded, and neither
    /// its hiber nor its shim holds the marker's lock (this takes it, so two hibers never
    /// both remove one). The directory is moved aside before it goes, while still locked,
    /// so that only that directory goes. Whether it was removed.
    fn reclaim_abandoned_start(&self, name: &str) -> bool {
        let dir = self.dir_of(name);
        let Ok(marker) = fs::File::open(dir.join(STARTING_FILE)) else { return false };
        if !sys::try_flock_exclusive(&marker).unwrap_or(false) || dir.join(JOB_FILE).exists() || dir.join(RESTORING_FILE).exists() {
            return false;
        }
        let tag = crate::state::hiber_tag().unwrap_or_default();
        let aside = self.dir.join(format!(".{name}.{tag}.abandoned"));
        let _ = fs::remove_dir_all(&aside);
        if fs::rename(&dir, &aside).is_err() {
            return false;
        }
        let _ = fs::remove_dir_all(&aside);
        true
    }

    /// Takes `name` for a job being restored: its directory appears with `marker` and a
    /// locked `restore.lock` already in it (prepared under a hidden name, then renamed), so
    /// that no moment exists when the name is taken and the job cannot be listed. Returns
    /// the directory and the lock, which the job's shim must inherit (see
    /// [`RestoreMarker`]).
    pub fn create_restoring(&self, name: &str, marker: &RestoreMarker) -> Result<(PathBuf, fs::File), JobError> {
        validate_name(name)?;
        let io_err = |step| move |source| JobError::Io { name: name.to_string(), step, source };
        fs::DirBuilder::new().recursive(true).create(&self.dir).map_err(io_err("create jobs dir"))?;
        let tmp = self.dir.join(format!(".{name}.{}-{}{RESERVING_SUFFIX}", marker.hiber_pid, marker.hiber_start_time));
        let _ = fs::remove_dir_all(&tmp);
        let prepared = (|| {
            fs::DirBuilder::new().mode(0o700).create(&tmp).map_err(io_err("create job dir"))?;
            let lock = OpenOptions::new().write(true).create_new(true).mode(0o600).open(tmp.join(RESTORE_LOCK)).map_err(io_err("create restore.lock"))?;
            sys::flock(&lock, true).map_err(io_err("lock restore.lock"))?;
            write_atomically(&tmp, RESTORING_FILE, &serde_json::to_vec_pretty(marker).expect("a marker serializes")).map_err(io_err("write restoring.json"))?;
            Ok(lock)
        })();
        let dir = self.dir_of(name);
        let taken = prepared.and_then(|lock| match sys::rename_noreplace(&tmp, &dir) {
            Ok(()) => Ok(lock),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(JobError::Exists(name.to_string())),
            Err(e) => Err(io_err("rename job dir")(e)),
        });
        if taken.is_err() {
            let _ = fs::remove_dir_all(&tmp);
        }
        Ok((dir, taken?))
    }

    /// Ends a restore: the job is complete and recorded (`job.json`).
    pub fn finish_restore(&self, name: &str) -> Result<(), JobError> {
        match fs::remove_file(self.dir_of(name).join(RESTORING_FILE)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(JobError::Io { name: name.to_string(), step: "remove restoring.json", source: e }),
            _ => Ok(()),
        }
    }

    /// The record of a restore not yet complete, if `name` is one.
    pub fn restore_marker(&self, name: &str) -> Option<RestoreMarker> {
        serde_json::from_slice(&fs::read(self.dir_of(name).join(RESTORING_FILE)).ok()?).ok()
    }

    /// The restored tree's root, once the job's shim has recorded it.
    pub fn restored_root(&self, name: &str) -> Option<RestoredRoot> {
        serde_json::from_slice(&fs::read(self.dir_of(name).join(ROOT_FILE)).ok()?).ok()
    }

    /// Whether neither the restoring hiber nor the job's shim still runs: nothing will
    /// write into the job's directory any more. (The lock is checked, not taken: nobody
    /// takes it again.)
    pub fn restore_unattended(&self, name: &str) -> bool {
        let Ok(f) = fs::File::open(self.dir_of(name).join(RESTORE_LOCK)) else { return true };
        // An error (none is expected) counts as held: the job is then left alone.
        sys::try_flock_exclusive(&f).unwrap_or(false)
    }

    /// Whether the job has a full record (`job.json`), rather than only a restore's marker.
    pub fn has_record(&self, name: &str) -> bool {
        self.dir_of(name).join(JOB_FILE).exists()
    }

    /// Removes the directories that restores and starts prepared but never got to name,
    /// and the names of starts whose job never started (their hiber was killed in between);
    /// a start whose job was recorded loses its marker. Returns how many were removed.
    pub fn remove_abandoned_reservations(&self) -> usize {
        let Ok(dir) = fs::read_dir(&self.dir) else { return 0 };
        let mut removed = 0;
        for e in dir.filter_map(Result::ok) {
            let name = e.file_name().to_string_lossy().into_owned();
            if validate_name(&name).is_ok() {
                if self.reclaim_abandoned_start(&name) {
                    removed += 1;
                }
                continue;
            }
            let Some(rest) = name.strip_prefix('.').and_then(|n| n.strip_suffix(RESERVING_SUFFIX)) else { continue };
            let Some((_, tag)) = rest.rsplit_once('.') else { continue };
            if crate::state::made_by_a_gone_hiber(tag) && fs::remove_dir_all(e.path()).is_ok() {
                removed += 1;
            }
        }
        removed
    }

    /// A free name `BASE-N` for a new job.
    pub fn free_name(&self, base: &str) -> String {
        let base: String = base.chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')).take(40).collect();
        let base = base.trim_start_matches(['.', '-']);
        let base = if base.is_empty() { "job" } else { base };
        (1..).map(|n| format!("{base}-{n}")).find(|n| !self.dir_of(n).exists()).expect("some name is free")
    }

    /// Opens (creating, 0600, append-only) the job's two log files.
    pub fn open_logs(&self, name: &str) -> Result<(fs::File, fs::File), JobError> {
        let open = |p: PathBuf| {
            OpenOptions::new().create(true).append(true).mode(0o600).open(&p).map_err(|source| JobError::Io {
                name: name.to_string(),
                step: "open log",
                source,
            })
        };
        Ok((open(self.stdout_of(name))?, open(self.stderr_of(name))?))
    }

    pub fn save(&self, job: &Job) -> Result<(), JobError> {
        write_record(&self.dir_of(&job.name), job).map_err(|source| JobError::Io { name: job.name.clone(), step: "write job.json", source })
    }

    /// The job's record; for a job whose restore has not recorded it yet, what its restore
    /// marker and its shim say (PID 0 until the shim has recorded the root).
    pub fn load(&self, name: &str) -> Result<Job, JobError> {
        validate_name(name).map_err(|_| JobError::NotFound(name.to_string()))?;
        let path = self.dir_of(name).join(JOB_FILE);
        let text = match fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let marker = self.restore_marker(name).ok_or_else(|| JobError::NotFound(name.to_string()))?;
                let root = self.restored_root(name);
                return Ok(Job {
                    name: name.to_string(),
                    pid: root.map_or(0, |r| r.pid),
                    start_time: root.map_or(0, |r| r.start_time),
                    command: marker.command,
                    created: marker.created,
                    restored_from: Some(marker.image.clone()),
                    checkpointed_to: None,
                    last_image: (!marker.private_copy).then_some(marker.image),
                });
            }
            Err(e) => return Err(JobError::Io { name: name.to_string(), step: "read job.json", source: e }),
        };
        serde_json::from_slice(&text).map_err(|e| JobError::Corrupt { name: name.to_string(), reason: e.to_string() })
    }

    /// Every job with a readable record, by name.
    pub fn list(&self) -> Vec<Job> {
        self.list_and_unreadable().0
    }

    /// Every job with a readable record, by name, and the job directories whose record
    /// could not be read (corrupt, or not readable by this user), each with its path and
    /// why, for a listing to say what it left out. Directories with no record at all (a
    /// job being started, a restore's name being reserved) are neither.
    pub fn list_and_unreadable(&self) -> (Vec<Job>, Vec<crate::state::Unreadable>) {
        let dir = match fs::read_dir(&self.dir) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return (Vec::new(), Vec::new()),
            Err(e) => return (Vec::new(), vec![(self.dir.clone(), e.to_string())]),
        };
        let (mut jobs, mut unreadable) = (Vec::new(), Vec::new());
        for e in dir.filter_map(Result::ok) {
            let Some(name) = e.file_name().to_str().map(str::to_string) else { continue };
            if validate_name(&name).is_err() {
                continue;
            }
            match self.load(&name) {
                Ok(job) => jobs.push(job),
                Err(JobError::NotFound(_)) => {}
                Err(err) => unreadable.push((e.path().join(JOB_FILE), err.to_string())),
            }
        }
        jobs.sort_by(|a, b| a.name.cmp(&b.name));
        unreadable.sort();
        (jobs, unreadable)
    }

    /// The running job whose root is `pid`: a tree named by its root's PID is that job.
    pub fn running_job_at(&self, pid: i32) -> Option<Job> {
        self.list().into_iter().find(|j| j.pid == pid && self.state(j) == JobState::Running)
    }

    pub fn state(&self, job: &Job) -> JobState {
        if let Some(m) = self.restore_marker(&job.name) {
            if proctree::is_same_process(m.hiber_pid, m.hiber_start_time) {
                return JobState::Restoring { hiber_pid: m.hiber_pid };
            }
            return JobState::InterruptedRestore;
        }
        if let Some(image) = &job.checkpointed_to {
            if !proctree::is_same_process(job.pid, job.start_time) {
                return JobState::Checkpointed(image.clone());
            }
        }
        // The shim writes the exit status before it reaps the root, so: a status means
        // exited; no status and a live (or still exiting) root means running.
        if let Some(status) = read_exit(&self.dir_of(&job.name)) {
            return JobState::Exited(status);
        }
        match proctree::stat(job.pid) {
            Ok(st) if st.start_time == job.start_time => JobState::Running,
            _ => JobState::Gone,
        }
    }

    /// How the job's root exited, once its shim has recorded it.
    pub fn exit_status(&self, name: &str) -> Option<ExitStatus> {
        read_exit(&self.dir_of(name))
    }

    /// The last non-empty line the job wrote to stderr (at most 300 characters of it).
    pub fn last_stderr_line(&self, name: &str) -> Option<String> {
        let text = fs::read(self.dir_of(name).join(STDERR_LOG)).ok()?;
        let tail = &text[text.len().saturating_sub(4096)..];
        let line = String::from_utf8_lossy(tail).lines().rev().map(str::trim).find(|l| !l.is_empty())?.to_string();
        Some(line.chars().take(300).collect())
    }

    /// Whether the job's shim has recorded how the root exited.
    pub fn has_exit(&self, name: &str) -> bool {
        read_exit(&self.dir_of(name)).is_some()
    }

    /// Removes a job's directory (logs included). The caller has made sure it is not
    /// running.
    pub fn remove(&self, name: &str) -> Result<(), JobError> {
        validate_name(name)?;
        fs::remove_dir_all(self.dir_of(name)).map_err(|source| JobError::Io { name: name.to_string(), step: "remove", source })
    }
}

/// Called by a job's shim when the root exits.
pub fn write_exit(job_dir: &Path, status: ExitStatus) -> io::Result<()> {
    let tmp = job_dir.join(".exit.json.tmp");
    fs::write(&tmp, serde_json::to_vec(&status).expect("status serializes"))?;
    fs::rename(tmp, job_dir.join(EXIT_FILE))
}

/// Writes a job's record (`job.json`) into its directory, whole or not at all: hiber's
/// commands, and the shim of a job `hiber run` starts, before it reports the job to hiber.
pub fn write_record(job_dir: &Path, job: &Job) -> io::Result<()> {
    write_atomically(job_dir, JOB_FILE, &serde_json::to_vec_pretty(job).expect("job serializes"))
}

/// Ends the start of the job in `job_dir` (its shim has written its record).
pub fn clear_start(job_dir: &Path) {
    let _ = fs::remove_file(job_dir.join(STARTING_FILE));
}

/// Called by a restore's shim once CRIU restored the tree rooted at `pid`, before it
/// reports the tree to hiber.
pub fn write_restored_root(job_dir: &Path, pid: i32) -> io::Result<RestoredRoot> {
    let start_time = proctree::stat(pid).map_err(io::Error::other)?.start_time;
    let root = RestoredRoot { pid, start_time };
    write_atomically(job_dir, ROOT_FILE, &serde_json::to_vec(&root).expect("a root serializes"))?;
    Ok(root)
}

/// Writes `dir/name` whole or not at all (a temporary file, synced, renamed over it).
fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    fs::rename(tmp, dir.join(name))
}

fn read_exit(job_dir: &Path) -> Option<ExitStatus> {
    serde_json::from_slice(&fs::read(job_dir.join(EXIT_FILE)).ok()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["a", "train-1", "x.y_z", &"n".repeat(64)] {
            validate_name(ok).unwrap();
        }
        for bad in ["", ".hidden", "-x", "a/b", "a b", "..", &"n".repeat(65)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
    }

    /// A name `hiber run` took is free again once nobody holds its start (its hiber and the
    /// job's shim gone) with no job recorded; not while either holds it, nor once the job is
    /// recorded (#41: a killed run).
    #[test]
    fn a_start_nobody_holds_frees_its_name() {
        let root = std::env::temp_dir().join(format!("hiber-jobs-start-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let reg = Registry::new(&StateDir::at(&root));
        let (dir, lock) = reg.create_dir("s-1").unwrap();
        let me = crate::state::hiber_tag().unwrap();
        assert_eq!(fs::read_to_string(dir.join(STARTING_FILE)).unwrap(), me, "the start names its hiber");
        assert!(matches!(reg.create_dir("s-1"), Err(JobError::Exists(_))), "taken while its lock is held");
        assert_eq!(reg.remove_abandoned_reservations(), 0);
        fs::write(dir.join(STDOUT_LOG), "old").unwrap();
        // Its hiber and shim gone (the lock's descriptors closed): the name is free again.
        drop(lock);
        let (again, lock) = reg.create_dir("s-1").unwrap();
        assert!(!again.join(STDOUT_LOG).exists(), "the abandoned start's files went with it");
        // A job recorded by its shim is a job, whoever started it.
        let job = Job {
            name: "s-1".into(),
            pid: i32::MAX - 1,
            start_time: 1,
            command: vec!["sleep".into()],
            created: "t".into(),
            restored_from: None,
            checkpointed_to: None,
            last_image: None,
        };
        write_record(&again, &job).unwrap();
        drop(lock);
        assert!(matches!(reg.create_dir("s-1"), Err(JobError::Exists(_))));
        // The sweep: an abandoned start goes, a recorded one stays.
        let (other, lock) = reg.create_dir("s-2").unwrap();
        drop(lock);
        assert_eq!(reg.remove_abandoned_reservations(), 1);
        assert!(!other.exists() && again.join(JOB_FILE).exists());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn registry_round_trip() {
        let root = std::env::temp_dir().join(format!("hiber-jobs-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let reg = Registry::new(&StateDir::at(&root));
        assert_eq!(reg.free_name("/usr/bin/python3"), "usrbinpython3-1");
        let (dir, _lock) = reg.create_dir("a-1").unwrap();
        assert!(matches!(reg.create_dir("a-1"), Err(JobError::Exists(_))));
        assert_eq!(reg.free_name("a"), "a-2");
        let job = Job {
            name: "a-1".into(),
            pid: i32::MAX - 1,
            start_time: 1,
            command: vec!["sleep".into()],
            created: "t".into(),
            restored_from: None,
            checkpointed_to: None,
            last_image: None,
        };
        reg.save(&job).unwrap();
        assert_eq!(reg.load("a-1").unwrap(), job);
        assert_eq!(reg.state(&job), JobState::Gone);
        write_exit(&dir, ExitStatus::Code(3)).unwrap();
        assert_eq!(reg.state(&job), JobState::Exited(ExitStatus::Code(3)));
        assert!(matches!(reg.load("nope"), Err(JobError::NotFound(_))));
        assert_eq!(reg.list().len(), 1);
        reg.remove("a-1").unwrap();
        assert!(reg.list().is_empty());
        fs::remove_dir_all(&root).unwrap();
    }
}
