//! Restores that a killed hiber left unfinished, and how `hiber recover` and `hiber rm`
//! settle them.
//!
//! A restore takes the job's name with its record already in place (`restoring.json`, see
//! [`RestoreMarker`]), before the job's shim starts; the shim, which outlives hiber, records
//! the restored root (`root.json`) before it reports it; the record goes once the restore is
//! complete. So a job whose restore marker names a hiber that no longer runs is an
//! interrupted restore, listed by `hiber ls`, and settled here:
//!
//! - while the restoring hiber's shim still runs and has recorded no root, CRIU is still
//!   restoring: wait for it (`restore.lock`, which the shim inherits from hiber, tells that
//!   one of them still runs);
//! - no root recorded and nobody left: CRIU never restored a tree; the directory goes;
//! - the tree ended (a tree CRIU left stopped is killed by its shim once hiber is gone):
//!   the directory goes, once the shim has recorded the end;
//! - the tree runs and needs nothing more (no device state, not left stopped, or hiber had
//!   recorded the job already): it is adopted, a job like any other;
//! - otherwise it cannot be completed without the hiber that restored it (device state, a
//!   stopped tree, one part of a coordinated restore whose others gave up): it is stopped,
//!   and the directory goes.

use std::time::{Duration, Instant};

use crate::jobs::{Job, JobError, JobState, Registry, RestoreMarker, RestoredRoot};
use crate::lock::{self, LockError};
use crate::proctree;
use crate::sys::{self, ExitStatus};

/// How long a recovery waits for a CRIU that is still restoring.
pub const CRIU_WAIT: Duration = Duration::from_secs(120);
/// How long a shim gets to record the end of a tree that was stopped, and go.
const SHIM_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum SettleError {
    #[error("job '{name}' is being restored by hiber PID {hiber_pid}")]
    Restoring { name: String, hiber_pid: i32 },
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error(transparent)]
    Job(#[from] JobError),
}

impl SettleError {
    pub fn hint(&self) -> Option<String> {
        Some(match self {
            SettleError::Restoring { .. } => "wait for that restore to finish; should that hiber hang, kill it, then run `hiber recover`".into(),
            SettleError::Lock(LockError::Held { .. }) => "wait for that hiber to finish, then try again".into(),
            _ => return None,
        })
    }
}

/// What to do with a tree that runs and could be adopted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Adopt it (`hiber recover`).
    Adopt,
    /// Stop it (`hiber rm -f`).
    Stop,
}

/// How an interrupted restore was settled.
#[derive(Debug, Clone, PartialEq)]
pub enum Settled {
    /// The tree runs and needed nothing more: it is a job like any other now.
    Adopted { pid: i32 },
    /// The job's directory went.
    Removed(Removal),
    /// CRIU was still restoring when the wait ran out: left for a later recovery.
    StillRestoring,
}

/// Why an interrupted restore's job was removed.
#[derive(Debug, Clone, PartialEq)]
pub enum Removal {
    /// CRIU never restored a tree: hiber died before it ran, or it failed.
    NeverStarted,
    /// The restored tree had ended (how, when its shim recorded it).
    Ended(Option<ExitStatus>),
    /// The tree was stopped, for this reason.
    Stopped(Incomplete),
}

/// Why a restored tree that runs was stopped rather than adopted.
#[derive(Debug, Clone, PartialEq)]
pub enum Incomplete {
    /// Its device state (of these engines) was not restored.
    Devices(Vec<String>),
    /// CRIU left it stopped, and nothing continued it.
    LeftStopped,
    /// One part of a coordinated restore, whose other parts gave up.
    Coordinated,
    /// Asked to (`hiber rm -f`).
    Asked,
}

impl std::fmt::Display for Incomplete {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Incomplete::Devices(engines) => write!(f, "its device state ({}) was never restored", engines.join(", ")),
            Incomplete::LeftStopped => write!(f, "it was left stopped, for a hiber that is gone to continue"),
            Incomplete::Coordinated => write!(f, "it was one part of a coordinated restore, whose other parts gave up"),
            Incomplete::Asked => write!(f, "as asked"),
        }
    }
}

/// One interrupted restore `hiber recover` found, and what became of it.
#[derive(Debug)]
pub struct Recovered {
    pub name: String,
    pub outcome: Result<Settled, SettleError>,
}

/// Settles every interrupted restore: adopts what can be, removes the rest.
pub fn recover(registry: &Registry) -> Vec<Recovered> {
    let abandoned = registry.remove_abandoned_reservations();
    if abandoned > 0 {
        tracing::info!(abandoned, "removed job directories that killed restores prepared but never named");
    }
    registry
        .list()
        .into_iter()
        .filter(|j| registry.state(j) == JobState::InterruptedRestore)
        .map(|j| {
            let outcome = lock::lock_job(registry, &j.name, "recovered").map_err(SettleError::from).and_then(|_lock| settle(registry, &j.name, Policy::Adopt));
            Recovered { name: j.name, outcome }
        })
        .collect()
}

/// Settles the interrupted restore of job `name` (see the module's doc), waiting for a CRIU
/// that still restores at most [`CRIU_WAIT`]. The caller holds the job's lock.
pub fn settle(registry: &Registry, name: &str, policy: Policy) -> Result<Settled, SettleError> {
    settle_within(registry, name, policy, CRIU_WAIT)
}

fn settle_within(registry: &Registry, name: &str, policy: Policy, criu_wait: Duration) -> Result<Settled, SettleError> {
    let marker = registry.restore_marker(name).ok_or_else(|| JobError::NotFound(name.to_string()))?;
    if proctree::is_same_process(marker.hiber_pid, marker.hiber_start_time) {
        return Err(SettleError::Restoring { name: name.to_string(), hiber_pid: marker.hiber_pid });
    }
    let root = match wait_for_root(registry, name, criu_wait) {
        Some(Some(root)) => root,
        Some(None) => {
            remove(registry, name)?;
            return Ok(Settled::Removed(Removal::NeverStarted));
        }
        None => return Ok(Settled::StillRestoring),
    };
    if !proctree::is_same_process(root.pid, root.start_time) {
        wait_unattended(registry, name, SHIM_WAIT);
        let status = registry.exit_status(name);
        remove(registry, name)?;
        return Ok(Settled::Removed(Removal::Ended(status)));
    }
    let why = match (policy, incomplete(&marker, registry.has_record(name))) {
        (Policy::Adopt, None) => return adopt(registry, name, &marker, root),
        (_, Some(why)) => why,
        (Policy::Stop, None) => Incomplete::Asked,
    };
    stop_tree(root.pid);
    // The shim records the end and goes before the directory does: it must not write into
    // a later job of the same name.
    wait_unattended(registry, name, SHIM_WAIT);
    remove(registry, name)?;
    Ok(Settled::Removed(Removal::Stopped(why)))
}

/// Whether the job of an interrupted restore, whose tree runs, cannot run as it should
/// without the hiber that restored it, and why. `recorded`: that hiber had written the
/// job's record, which it does once device state is back and the tree continued.
fn incomplete(marker: &RestoreMarker, recorded: bool) -> Option<Incomplete> {
    if marker.coordinated {
        // Whether every participant got as far is unknown here; those that did not stopped
        // their parts.
        return Some(Incomplete::Coordinated);
    }
    if recorded {
        return None;
    }
    if !marker.devices.is_empty() {
        return Some(Incomplete::Devices(marker.devices.clone()));
    }
    marker.leave_stopped.then_some(Incomplete::LeftStopped)
}

/// The restored root once the shim recorded it (`Some(Some)`), or `Some(None)` once nobody
/// is left to restore it; `None` if CRIU still restores after `limit`.
fn wait_for_root(registry: &Registry, name: &str, limit: Duration) -> Option<Option<RestoredRoot>> {
    let start = Instant::now();
    loop {
        if let Some(root) = registry.restored_root(name) {
            return Some(Some(root));
        }
        if registry.restore_unattended(name) {
            // Read again: the shim may have recorded the root just before it went.
            return Some(registry.restored_root(name));
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_unattended(registry: &Registry, name: &str, limit: Duration) {
    let start = Instant::now();
    while !registry.restore_unattended(name) && start.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The tree becomes a job of the registry, as if its restore had finished.
fn adopt(registry: &Registry, name: &str, marker: &RestoreMarker, root: RestoredRoot) -> Result<Settled, SettleError> {
    if !registry.has_record(name) {
        registry.save(&Job {
            name: name.to_string(),
            pid: root.pid,
            start_time: root.start_time,
            command: marker.command.clone(),
            created: marker.created.clone(),
            restored_from: Some(marker.image.clone()),
            checkpointed_to: None,
            // As the restore would have recorded it: no parent for its checkpoints in an
            // untrusted image.
            last_image: (!marker.private_copy).then(|| marker.image.clone()),
        })?;
    }
    registry.finish_restore(name)?;
    Ok(Settled::Adopted { pid: root.pid })
}

/// SIGKILLs the tree rooted at `root`: the root first (the init of a PID namespace takes
/// the rest with it), then every other process it had.
fn stop_tree(root: i32) {
    let others: Vec<i32> = proctree::discover_tree(root).map(|t| t.iter().map(|p| p.pid).filter(|&p| p != root).collect()).unwrap_or_default();
    for pid in std::iter::once(root).chain(others).filter(|&p| p > 0) {
        let _ = sys::kill(pid, libc::SIGKILL);
    }
}

fn remove(registry: &Registry, name: &str) -> Result<(), JobError> {
    match registry.remove(name) {
        Err(JobError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;
    use crate::state::StateDir;

    struct Fixture {
        root: std::path::PathBuf,
        registry: Registry,
    }

    impl Fixture {
        fn new(tag: &str) -> Fixture {
            let root = std::env::temp_dir().join(format!("hiber-interrupted-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            Fixture { registry: Registry::new(&StateDir::at(&root)), root }
        }

        /// A restore of job `name` whose hiber is gone (this process, with another start
        /// time); its lock is returned (held) when `held`.
        fn interrupted(&self, name: &str, devices: &[&str], held: bool) -> Option<std::fs::File> {
            let me = proctree::stat(sys::getpid()).unwrap();
            let marker = RestoreMarker {
                hiber_pid: sys::getpid(),
                hiber_start_time: me.start_time + 1,
                image: "/images/x".into(),
                command: vec!["sleep".into(), "100".into()],
                created: "t".into(),
                devices: devices.iter().map(|d| d.to_string()).collect(),
                leave_stopped: false,
                coordinated: false,
                private_copy: false,
            };
            let (_, lock) = self.registry.create_restoring(name, &marker).unwrap();
            held.then_some(lock)
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    fn sleeper() -> std::process::Child {
        std::process::Command::new("sleep").arg("100").spawn().unwrap()
    }

    #[test]
    fn a_restore_that_never_got_a_tree_is_removed() {
        let f = Fixture::new("never");
        f.interrupted("a", &[], false);
        let job = f.registry.load("a").unwrap();
        assert_eq!((job.pid, f.registry.state(&job)), (0, JobState::InterruptedRestore), "listed before it is settled");
        assert_eq!(f.registry.list().len(), 1);
        assert_eq!(settle(&f.registry, "a", Policy::Adopt).unwrap(), Settled::Removed(Removal::NeverStarted));
        assert!(!f.registry.dir_of("a").exists(), "the name is free");
    }

    #[test]
    fn while_its_shim_holds_the_lock_without_a_root_criu_is_still_restoring() {
        let f = Fixture::new("pending");
        let lock = f.interrupted("a", &[], true);
        assert_eq!(settle_within(&f.registry, "a", Policy::Adopt, Duration::from_millis(100)).unwrap(), Settled::StillRestoring);
        assert!(f.registry.dir_of("a").exists(), "left for later");
        drop(lock);
        assert_eq!(settle(&f.registry, "a", Policy::Adopt).unwrap(), Settled::Removed(Removal::NeverStarted));
    }

    #[test]
    fn a_running_tree_without_device_state_is_adopted() {
        let f = Fixture::new("adopt");
        f.interrupted("a", &[], false);
        let mut child = sleeper();
        let root = crate::jobs::write_restored_root(&f.registry.dir_of("a"), child.id() as i32).unwrap();
        assert_eq!(f.registry.load("a").unwrap().pid, root.pid, "the shim's record gives the PID");
        assert_eq!(settle(&f.registry, "a", Policy::Adopt).unwrap(), Settled::Adopted { pid: root.pid });
        let job = f.registry.load("a").unwrap();
        assert_eq!((job.pid, job.start_time, job.restored_from.as_deref()), (root.pid, root.start_time, Some("/images/x")));
        assert_eq!(f.registry.state(&job), JobState::Running);
        assert!(f.registry.restore_marker("a").is_none());
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn a_running_tree_whose_device_state_is_missing_is_stopped_and_removed() {
        let f = Fixture::new("devices");
        f.interrupted("a", &["cuda"], false);
        let mut child = sleeper();
        crate::jobs::write_restored_root(&f.registry.dir_of("a"), child.id() as i32).unwrap();
        assert_eq!(settle(&f.registry, "a", Policy::Adopt).unwrap(), Settled::Removed(Removal::Stopped(Incomplete::Devices(vec!["cuda".into()]))));
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert!(!f.registry.dir_of("a").exists());
    }

    #[test]
    fn rm_stops_even_what_could_be_adopted_and_an_ended_tree_is_only_removed() {
        let f = Fixture::new("stop");
        f.interrupted("a", &[], false);
        let mut child = sleeper();
        crate::jobs::write_restored_root(&f.registry.dir_of("a"), child.id() as i32).unwrap();
        assert_eq!(settle(&f.registry, "a", Policy::Stop).unwrap(), Settled::Removed(Removal::Stopped(Incomplete::Asked)));
        child.wait().unwrap();

        f.interrupted("b", &[], false);
        let mut child = std::process::Command::new("true").spawn().unwrap();
        crate::jobs::write_restored_root(&f.registry.dir_of("b"), child.id() as i32).unwrap();
        child.wait().unwrap();
        crate::jobs::write_exit(&f.registry.dir_of("b"), ExitStatus::Code(0)).unwrap();
        assert_eq!(settle(&f.registry, "b", Policy::Adopt).unwrap(), Settled::Removed(Removal::Ended(Some(ExitStatus::Code(0)))));
    }

    #[test]
    fn a_restore_whose_hiber_runs_is_left_alone() {
        let f = Fixture::new("live");
        let me = proctree::stat(sys::getpid()).unwrap();
        let marker = RestoreMarker {
            hiber_pid: sys::getpid(),
            hiber_start_time: me.start_time,
            image: "/images/x".into(),
            command: vec![],
            created: "t".into(),
            devices: vec![],
            leave_stopped: false,
            coordinated: false,
            private_copy: false,
        };
        f.registry.create_restoring("a", &marker).unwrap();
        let job = f.registry.load("a").unwrap();
        assert_eq!(f.registry.state(&job), JobState::Restoring { hiber_pid: sys::getpid() });
        assert!(recover(&f.registry).is_empty(), "not interrupted");
        assert!(matches!(settle(&f.registry, "a", Policy::Stop), Err(SettleError::Restoring { .. })));
        assert!(f.registry.dir_of("a").exists());
    }

    #[test]
    fn recover_settles_every_interrupted_restore_and_sweeps_unnamed_ones() {
        let f = Fixture::new("recover");
        f.interrupted("a", &[], false);
        f.interrupted("b", &[], false);
        let abandoned = f.root.join("jobs").join(".c.999999999-1.reserving");
        std::fs::create_dir_all(&abandoned).unwrap();
        let done = recover(&f.registry);
        assert_eq!(done.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert!(done.iter().all(|r| matches!(r.outcome, Ok(Settled::Removed(Removal::NeverStarted)))));
        assert!(!abandoned.exists());
        assert!(f.registry.list().is_empty());
    }

    #[test]
    fn a_name_is_taken_only_once() {
        let f = Fixture::new("once");
        f.interrupted("a", &[], false);
        let marker = f.registry.restore_marker("a").unwrap();
        assert!(matches!(f.registry.create_restoring("a", &marker), Err(JobError::Exists(_))));
        assert_eq!(std::fs::read_dir(f.root.join("jobs")).unwrap().count(), 1, "no reservation is left behind");
    }
}
