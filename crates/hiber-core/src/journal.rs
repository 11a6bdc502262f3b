//! The checkpoint journal: what a checkpoint has changed in the application so far.
//!
//! hiber writes `$STATE/journal/<id>.json` before it changes anything and updates it
//! before each step. If hiber dies mid-checkpoint (even by SIGKILL), the next invocation
//! finds the entry of a hiber that no longer runs and undoes what it records: it waits for
//! CRIU to let go of the tree (CRIU runs in its own process group and, when its client is
//! gone, fails the dump and resumes the tree), brings every claimed device back to running,
//! and removes the unfinished image.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::engine::DeviceEngine;
use crate::image::Image;
use crate::proctree;
use crate::state::StateDir;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Started,
    DevicesQuiesced,
    /// Device state moved where the dump takes it.
    Captured,
    Dumping,
    /// The image is complete and in place.
    Committed,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Claim {
    pub engine: String,
    pub pids: Vec<i32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    pub hiber_pid: i32,
    pub hiber_start_time: u64,
    pub root_pid: i32,
    pub tmp_dir: PathBuf,
    pub dest: PathBuf,
    pub leave_running: bool,
    pub claims: Vec<Claim>,
    pub phase: Phase,
    /// Part of a cut held by a coordinator of several hibers: its image counts only once
    /// every participant passed the last barrier (`cut_passed`).
    #[serde(default)]
    pub coordinated: bool,
    #[serde(default)]
    pub cut_passed: bool,
}

/// An open journal entry; [`Journal::finish`] removes it.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    entry: Entry,
}

impl Journal {
    pub fn begin(state: &StateDir, entry: Entry) -> io::Result<Journal> {
        let dir = state.journal();
        state.ensure(&dir)?;
        let path = dir.join(format!("checkpoint-{}-{}.json", entry.root_pid, entry.hiber_pid));
        let j = Journal { path, entry };
        j.write()?;
        Ok(j)
    }

    pub fn update(&mut self, f: impl FnOnce(&mut Entry)) -> io::Result<()> {
        f(&mut self.entry);
        self.write()
    }

    pub fn entry(&self) -> &Entry {
        &self.entry
    }

    fn write(&self) -> io::Result<()> {
        let tmp = self.path.with_extension("tmp");
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
        f.write_all(&serde_json::to_vec(&self.entry).expect("entry serializes"))?;
        f.sync_all()?;
        fs::rename(&tmp, &self.path)
    }

    pub fn finish(self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// What recovery found and did for one interrupted checkpoint.
#[derive(Debug)]
pub struct Recovered {
    pub root_pid: i32,
    pub root_running: bool,
    /// The image was complete: the checkpoint had in fact succeeded.
    pub image_complete: Option<PathBuf>,
    pub problems: Vec<String>,
    /// What the recovery could not give back because processes of the job are gone: said,
    /// but nothing a later recovery could retry.
    pub notes: Vec<String>,
}

/// Entries left by a hiber that no longer runs.
pub fn stale_entries(state: &StateDir) -> Vec<(PathBuf, Entry)> {
    entries(state).0
}

/// Entries left by a hiber that no longer runs, and the journal files that could not be
/// read (corrupt, say), each with why: nothing recovery can act on, but a person should
/// know (what they recorded may need undoing by hand).
pub fn entries(state: &StateDir) -> (Vec<(PathBuf, Entry)>, Vec<crate::state::Unreadable>) {
    let Ok(dir) = fs::read_dir(state.journal()) else { return (Vec::new(), Vec::new()) };
    let (mut stale, mut unreadable) = (Vec::new(), Vec::new());
    for p in dir.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "json")) {
        let entry = fs::read(&p).map_err(|e| e.to_string()).and_then(|b| serde_json::from_slice::<Entry>(&b).map_err(|e| format!("corrupt: {e}")));
        match entry {
            Ok(entry) if !proctree::is_same_process(entry.hiber_pid, entry.hiber_start_time) => stale.push((p, entry)),
            Ok(_) => {}
            Err(why) => unreadable.push((p, why)),
        }
    }
    unreadable.sort();
    (stale, unreadable)
}

/// Undoes every interrupted checkpoint. `engines` are this machine's device engines.
pub fn recover(state: &StateDir, engines: &[Box<dyn DeviceEngine>]) -> Vec<Recovered> {
    stale_entries(state).into_iter().map(|(path, entry)| recover_one(&path, &entry, engines)).collect()
}

fn recover_one(path: &Path, entry: &Entry, engines: &[Box<dyn DeviceEngine>]) -> Recovered {
    let (mut problems, mut notes) = (Vec::new(), Vec::new());
    // CRIU may still be finishing (it outlives hiber on purpose): wait until it has let go
    // of the tree, so that device state is not touched under it. If it still holds the
    // tree, leave the entry for a later recovery.
    if !wait_untraced(entry.root_pid, Duration::from_secs(120)) {
        return Recovered {
            root_pid: entry.root_pid,
            root_running: true,
            image_complete: None,
            problems: vec!["CRIU still holds the tree after 120 s; run `hiber recover` again later".into()],
            notes: Vec::new(),
        };
    }
    // Engines that quiesced first resume last (the agent needs the driver unlocked).
    for claim in entry.claims.iter().rev() {
        match engines.iter().find(|e| e.name() == claim.engine) {
            Some(engine) => {
                let (alive, gone): (Vec<i32>, Vec<i32>) = claim.pids.iter().partition(|&&p| proctree::alive(p));
                match engine.recover(&alive, &gone, &[&entry.tmp_dir, &entry.dest]) {
                    Ok(()) => {}
                    Err(e @ crate::engine::EngineError::ProcessesGone { .. }) => notes.push(e.to_string()),
                    Err(e) => problems.push(e.to_string()),
                }
            }
            None => problems.push(format!("engine {} is not available here to resume pids {:?}", claim.engine, claim.pids)),
        }
    }
    if !problems.is_empty() {
        // Keep the partial image (device data may be in it) and the entry: a later
        // `hiber recover` tries again.
        return Recovered { root_pid: entry.root_pid, root_running: proctree::alive(entry.root_pid), image_complete: None, problems, notes };
    }
    let _ = fs::remove_dir_all(&entry.tmp_dir);
    let root_running = proctree::alive(entry.root_pid);
    let mut image_complete = Image::open(&entry.dest).ok().map(|_| entry.dest.clone());
    if image_complete.is_some() && entry.coordinated && !entry.cut_passed {
        // Committed here, but hiber died before the coordinator said every participant
        // had: the others removed theirs, so this one is no part of a whole cut.
        let _ = fs::remove_dir_all(&entry.dest);
        image_complete = None;
    }
    if image_complete.is_some() && root_running && !entry.leave_running {
        // The image was finished but CRIU never stopped the tree (hiber died before it
        // acknowledged): the checkpoint did not take effect, and restoring that image next
        // to the running application would duplicate it.
        let _ = fs::remove_dir_all(&entry.dest);
        image_complete = None;
    }
    let _ = fs::remove_file(path);
    Recovered { root_pid: entry.root_pid, root_running, image_complete, problems, notes }
}

fn tracer_of(pid: i32) -> Option<i32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("TracerPid:")).and_then(|v| v.trim().parse().ok())
}

/// Waits until no process of the tree rooted at `pid` is being traced; false on timeout.
fn wait_untraced(pid: i32, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        let traced = proctree::discover_tree(pid).map(|tree| tree.iter().any(|p| tracer_of(p.pid).unwrap_or(0) != 0)).unwrap_or(false);
        if !traced {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_entries_are_those_of_dead_hibers() {
        let root = std::env::temp_dir().join(format!("hiber-journal-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let state = StateDir::at(&root);
        let me = proctree::stat(std::process::id() as i32).unwrap();
        let tmp = root.join(".img.partial-1");
        fs::create_dir_all(&tmp).unwrap();
        let live = Entry {
            hiber_pid: std::process::id() as i32,
            hiber_start_time: me.start_time,
            root_pid: 999_999,
            tmp_dir: tmp.clone(),
            dest: root.join("img"),
            leave_running: false,
            claims: vec![],
            phase: Phase::Dumping,
            coordinated: false,
            cut_passed: false,
        };
        let j = Journal::begin(&state, live.clone()).unwrap();
        assert!(stale_entries(&state).is_empty(), "a running hiber's entry is not stale");
        j.finish();
        let dead = Entry { hiber_start_time: me.start_time + 1, ..live };
        let _j = Journal::begin(&state, dead).unwrap();
        assert_eq!(stale_entries(&state).len(), 1);
        let rec = recover(&state, &[]);
        assert_eq!(rec.len(), 1);
        assert!(rec[0].image_complete.is_none());
        assert!(!tmp.exists(), "the partial image is removed");
        assert!(stale_entries(&state).is_empty());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_coordinated_image_counts_only_once_the_cut_passed() {
        let root = std::env::temp_dir().join(format!("hiber-journal-cut-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let state = StateDir::at(&root);
        let me = proctree::stat(std::process::id() as i32).unwrap();
        for passed in [false, true] {
            // A committed image of a leave-running checkpoint whose hiber died at the last barrier.
            let dest = root.join(format!("img-{passed}"));
            let mut w = crate::image::ImageWriter::create(&dest).unwrap();
            w.commit(crate::image::tests::sample_manifest(), &[]).unwrap();
            let entry = Entry {
                hiber_pid: std::process::id() as i32,
                hiber_start_time: me.start_time + 1,
                root_pid: 999_999,
                tmp_dir: root.join(".gone"),
                dest: dest.clone(),
                leave_running: true,
                claims: vec![],
                phase: Phase::Committed,
                coordinated: true,
                cut_passed: passed,
            };
            let _j = Journal::begin(&state, entry).unwrap();
            let rec = recover(&state, &[]);
            assert_eq!(rec.len(), 1);
            assert_eq!(rec[0].image_complete.is_some(), passed, "kept only when the cut passed");
            assert_eq!(dest.exists(), passed);
        }
        fs::remove_dir_all(&root).unwrap();
    }

    /// What recover was asked: (pids, gone), per call.
    type Asked = std::sync::Arc<std::sync::Mutex<Vec<(Vec<i32>, Vec<i32>)>>>;
    /// An engine that records what recover was asked.
    struct Recording(Asked);
    struct RecordingKind;
    static RECORDING: RecordingKind = RecordingKind;

    impl crate::engine::EngineKind for RecordingKind {
        fn name(&self) -> &'static str {
            "recording"
        }
        fn section_version(&self) -> u32 {
            1
        }
        fn load(&self) -> Option<Box<dyn DeviceEngine>> {
            None
        }
        fn describe(&self, _: &serde_json::Value) -> Vec<String> {
            Vec::new()
        }
        fn unavailable_hint(&self) -> &'static str {
            ""
        }
    }

    impl DeviceEngine for Recording {
        fn kind(&self) -> &'static dyn crate::engine::EngineKind {
            &RECORDING
        }
        fn begin_checkpoint(
            &self,
            _: &[proctree::ProcessInfo],
            _: crate::engine::CheckpointOptions,
        ) -> Result<Option<Box<dyn crate::engine::CheckpointSession>>, crate::engine::EngineError> {
            Ok(None)
        }
        fn recover(&self, pids: &[i32], gone: &[i32], _: &[&Path]) -> Result<(), crate::engine::EngineError> {
            self.0.lock().unwrap().push((pids.to_vec(), gone.to_vec()));
            if gone.is_empty() {
                return Ok(());
            }
            // As the agent says when ranks' communicators cannot be built again.
            Err(crate::engine::EngineError::ProcessesGone { engine: "recording", message: format!("process(es) {gone:?} are gone"), hint: None })
        }
        fn begin_restore(
            &self,
            _: &serde_json::Value,
            _: &crate::engine::DeviceRestoreOptions,
        ) -> Result<Box<dyn crate::engine::RestoreSession>, crate::engine::EngineError> {
            Err(crate::engine::EngineError::failed("recording", "no restore", None))
        }
    }

    #[test]
    fn recover_tells_the_engine_which_processes_are_gone_zombies_included_and_says_what_they_took() {
        let root = std::env::temp_dir().join(format!("hiber-journal-gone-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let state = StateDir::at(&root);
        let me = proctree::stat(std::process::id() as i32).unwrap();
        // One that exited and was reaped, and one that exited and was not (a zombie).
        let mut reaped = std::process::Command::new("true").spawn().unwrap();
        reaped.wait().unwrap();
        let mut zombie = std::process::Command::new("true").spawn().unwrap();
        let z = zombie.id() as i32;
        let start = Instant::now();
        while proctree::stat(z).map(|s| s.state != 'Z').unwrap_or(true) && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!proctree::alive(z) && proctree::alive(std::process::id() as i32));
        let me_pid = std::process::id() as i32;
        let entry = Entry {
            hiber_pid: me_pid,
            hiber_start_time: me.start_time + 1,
            root_pid: me_pid,
            tmp_dir: root.join(".gone"),
            dest: root.join("img"),
            leave_running: true,
            claims: vec![Claim { engine: "recording".into(), pids: vec![me_pid, reaped.id() as i32, z] }],
            phase: Phase::DevicesQuiesced,
            coordinated: false,
            cut_passed: false,
        };
        let _j = Journal::begin(&state, entry).unwrap();
        let asked = Asked::default();
        let engines: Vec<Box<dyn DeviceEngine>> = vec![Box::new(Recording(asked.clone()))];
        let rec = recover(&state, &engines);
        assert_eq!(rec.len(), 1);
        assert!(rec[0].problems.is_empty(), "{:?}", rec[0].problems);
        assert!(rec[0].notes.len() == 1 && rec[0].notes[0].contains("are gone"), "said, as a note: {:?}", rec[0].notes);
        assert!(stale_entries(&state).is_empty(), "processes that are gone leave nothing for a later recovery to retry");
        zombie.wait().unwrap();
        assert_eq!(*asked.lock().unwrap(), vec![(vec![me_pid], vec![reaped.id() as i32, z])], "alive, then gone");
        fs::remove_dir_all(&root).unwrap();
    }
}
