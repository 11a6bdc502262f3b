//! Where hiber keeps its jobs, images, journals and logs.

use std::fs::DirBuilder;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

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
