//! Where hiber keeps its jobs, images, journals and logs.

use std::fs::DirBuilder;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// A file of hiber's state that could not be read, and why.
pub type Unreadable = (PathBuf, String);

/// `PID-START`: the PID and start time of this hiber, by which the directories it makes for
/// one operation under the state directory are named (a staging area, a private copy of an
/// image, a restore's reserved job directory), so that a later hiber can tell those of a
/// hiber that no longer runs ([`made_by_a_gone_hiber`]).
pub fn hiber_tag() -> io::Result<String> {
    let me = crate::sys::getpid();
    let start = crate::proctree::stat(me).map_err(io::Error::other)?.start_time;
    Ok(format!("{me}-{start}"))
}

/// Whether `name`, which starts with a [`hiber_tag`] (anything may follow a further `-` or
/// `.`), was made by a hiber that no longer runs. Names of another shape are not.
pub fn made_by_a_gone_hiber(name: &str) -> bool {
    let mut parts = name.splitn(2, '-');
    let pid = parts.next().and_then(|p| p.parse::<i32>().ok());
    let start = parts.next().map(|rest| rest.split(['-', '.']).next().unwrap_or("")).and_then(|s| s.parse::<u64>().ok());
    match (pid, start) {
        (Some(pid), Some(start)) => !crate::proctree::is_same_process(pid, start),
        _ => false,
    }
}

#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    /// `$HIBER_STATE`, else `/var/lib/hiber` for root, else `$XDG_STATE_HOME/hiber`
    /// (or `~/.local/state/hiber`).
    pub fn from_env() -> StateDir {
        if let Some(p) = std::env::var_os("HIBER_STATE") {
            return StateDir { root: PathBuf::from(p) };
        }
        if crate::sys::geteuid() == 0 {
            return StateDir { root: PathBuf::from("/var/lib/hiber") };
        }
        let base = std::env::var_os("XDG_STATE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
            .unwrap_or_else(|| PathBuf::from("/tmp"));
        StateDir { root: base.join("hiber") }
    }

    pub fn at(root: impl Into<PathBuf>) -> StateDir {
        StateDir { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn jobs(&self) -> PathBuf {
        self.root.join("jobs")
    }

    pub fn images(&self) -> PathBuf {
        self.root.join("images")
    }

    pub fn journal(&self) -> PathBuf {
        self.root.join("journal")
    }

    /// CRIU's logs of each dump and restore, kept for diagnosis.
    pub fn logs(&self) -> PathBuf {
        self.root.join("logs")
    }

    /// Creates `sub` (and the root) with mode 0700.
    pub fn ensure(&self, sub: &Path) -> io::Result<()> {
        DirBuilder::new().recursive(true).mode(0o700).create(sub)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_tell_a_gone_hiber_from_a_running_one() {
        let mine = hiber_tag().unwrap();
        for suffix in ["", "-3", ".reserving", "-0-x"] {
            assert!(!made_by_a_gone_hiber(&format!("{mine}{suffix}")), "this hiber runs: {mine}{suffix}");
        }
        let (pid, start) = mine.split_once('-').unwrap();
        let earlier = start.parse::<u64>().unwrap() - 1;
        assert!(made_by_a_gone_hiber(&format!("{pid}-{earlier}-0")), "same PID, another start: a hiber gone");
        assert!(made_by_a_gone_hiber("999999999-1"));
        for odd in ["", "x-1", "12", "12-x", "-5"] {
            assert!(!made_by_a_gone_hiber(odd), "not a tag: {odd:?}");
        }
    }
}
