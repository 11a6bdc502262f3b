//! The job registry: `$STATE/jobs/NAME/` holds `job.json`, the job's `stdout.log` and
//! `stderr.log`, and `exit.json` once its shim has seen the tree's root exit.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::proctree;
use crate::state::StateDir;
use crate::sys::ExitStatus;

const JOB_FILE: &str = "job.json";
const EXIT_FILE: &str = "exit.json";
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

#[derive(Debug, Clone, PartialEq)]
pub enum JobState {
    Running,
    Exited(ExitStatus),
    /// Stopped by a checkpoint into this image.
    Checkpointed(String),
    /// Not running, and its shim recorded no exit (killed together with it, say).
    Gone,
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobState::Running => write!(f, "running"),
            JobState::Exited(ExitStatus::Code(c)) => write!(f, "exited({c})"),
            JobState::Exited(ExitStatus::Signal(s)) => write!(f, "killed(signal {s})"),
            JobState::Checkpointed(_) => write!(f, "checkpointed"),
            JobState::Gone => write!(f, "gone"),
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

    /// Reserves `name` by creating its directory (0700); fails if it exists.
    pub fn create_dir(&self, name: &str) -> Result<PathBuf, JobError> {
        validate_name(name)?;
        let io_err = |step| move |source| JobError::Io { name: name.to_string(), step, source };
        fs::DirBuilder::new().recursive(true).create(&self.dir).map_err(io_err("create jobs dir"))?;
        let dir = self.dir_of(name);
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => Ok(dir),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(JobError::Exists(name.to_string())),
            Err(e) => Err(io_err("create job dir")(e)),
        }
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
        let io_err = |step| move |source| JobError::Io { name: job.name.clone(), step, source };
        let dir = self.dir_of(&job.name);
        let tmp = dir.join(".job.json.tmp");
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp).map_err(io_err("write job.json"))?;
        f.write_all(&serde_json::to_vec_pretty(job).expect("job serializes")).map_err(io_err("write job.json"))?;
        f.sync_all().map_err(io_err("fsync job.json"))?;
        fs::rename(&tmp, dir.join(JOB_FILE)).map_err(io_err("rename job.json"))
    }

    pub fn load(&self, name: &str) -> Result<Job, JobError> {
        validate_name(name).map_err(|_| JobError::NotFound(name.to_string()))?;
        let path = self.dir_of(name).join(JOB_FILE);
        let text = fs::read(&path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => JobError::NotFound(name.to_string()),
            _ => JobError::Io { name: name.to_string(), step: "read job.json", source: e },
        })?;
        serde_json::from_slice(&text).map_err(|e| JobError::Corrupt { name: name.to_string(), reason: e.to_string() })
    }

    /// Every job with a readable record, by name.
    pub fn list(&self) -> Vec<Job> {
        let Ok(dir) = fs::read_dir(&self.dir) else { return Vec::new() };
        let mut jobs: Vec<Job> = dir.filter_map(Result::ok).filter_map(|e| self.load(e.file_name().to_str()?).ok()).collect();
        jobs.sort_by(|a, b| a.name.cmp(&b.name));
        jobs
    }

    pub fn state(&self, job: &Job) -> JobState {
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

    #[test]
    fn registry_round_trip() {
        let root = std::env::temp_dir().join(format!("hiber-jobs-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let reg = Registry::new(&StateDir::at(&root));
        assert_eq!(reg.free_name("/usr/bin/python3"), "usrbinpython3-1");
        let dir = reg.create_dir("a-1").unwrap();
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
