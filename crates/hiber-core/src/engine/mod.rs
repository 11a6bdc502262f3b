//! Device engines: how device (GPU) state gets in and out of an image.
//!
//! The pipeline drives every engine through [`DeviceEngine`] and never names one. An
//! engine claims the processes whose device state it handles, quiesces and captures them
//! before CRIU dumps the tree, and restores them after CRIU restores it. Every step that
//! changes the application has an undo: [`DeviceEngine::resume`] brings claimed processes
//! back to running from whatever state a failed or interrupted checkpoint left them in,
//! which is also what `hiber recover` calls from a journal.

pub mod agent;
pub mod cuda;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::image::FileEntry;

use crate::proctree::ProcessInfo;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{engine}: {message}")]
    Failed { engine: &'static str, message: String, hint: Option<String> },
}

impl EngineError {
    pub fn hint(&self) -> Option<&str> {
        match self {
            EngineError::Failed { hint, .. } => hint.as_deref(),
        }
    }
}

/// Options that change how device state is restored.
#[derive(Debug, Clone, Default)]
pub struct DeviceRestoreOptions {
    /// `OLD=NEW` GPU mappings as the user gave them (UUIDs or indices).
    pub gpu_map: Vec<(String, String)>,
    /// The image being restored, and the checksum of each of its files (for engines that
    /// stream their own files and check them on the way).
    pub image_dir: PathBuf,
    pub checksums: HashMap<String, String>,
}

/// Where a checkpoint goes and how it ends.
#[derive(Debug, Clone, Copy)]
pub struct CaptureTarget<'a> {
    /// The engine's own directory inside the (temporary) image.
    pub dir: &'a Path,
    /// The application runs on after the checkpoint.
    pub leave_running: bool,
}

/// A restored process: its PID inside its namespace (as recorded in the image) and the
/// PID hiber sees now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoredPid {
    pub ns_pid: i32,
    pub pid: i32,
}

pub trait DeviceEngine: Send + Sync {
    fn name(&self) -> &'static str;

    /// The PIDs of `tree` whose device state this engine captures; empty when it has
    /// nothing to do for this tree.
    fn claim(&self, tree: &[ProcessInfo]) -> Result<Vec<i32>, EngineError>;

    /// Stops new device work in `pids` and waits for work in flight, within a timeout.
    /// Engines earlier in [`available`]'s order quiesce first and resume last.
    fn quiesce(&self, pids: &[i32], target: &CaptureTarget<'_>) -> Result<(), EngineError>;

    /// Moves the device state of quiesced `pids` where the CRIU dump (or the engine's own
    /// files under `dir`) will take it. Returns the engine's manifest section.
    fn capture(&self, pids: &[i32], tree: &[ProcessInfo], dir: &Path) -> Result<serde_json::Value, EngineError>;

    /// Brings `pids` back to running from whatever state quiesce/capture left them in.
    /// Idempotent: safe on processes that were never touched.
    fn resume(&self, pids: &[i32]) -> Result<(), EngineError>;

    /// `hiber recover` after a hiber that was checkpointing died: like [`resume`], with the
    /// places (the partial image, the finished one) where that hiber may have left device
    /// data the engine needs to bring back.
    ///
    /// [`resume`]: DeviceEngine::resume
    fn recover(&self, pids: &[i32], _dirs: &[&Path]) -> Result<(), EngineError> {
        self.resume(pids)
    }

    /// Once the image's other parts are written (with `--leave-running`, after the
    /// application was resumed): writes what the engine still holds, and returns the
    /// manifest entries of every file it wrote, so they are not hashed again.
    fn finish(&self) -> Result<Vec<FileEntry>, EngineError> {
        Ok(Vec::new())
    }

    /// Before a restore commits: checks that this machine can take `section`'s state
    /// (devices present, enough memory), so a restore never half-happens.
    fn check_restore(&self, section: &serde_json::Value, opts: &DeviceRestoreOptions) -> Result<(), EngineError>;

    /// After CRIU restored the tree: restores device state into `pids` and resumes them.
    fn restore(&self, section: &serde_json::Value, pids: &[RestoredPid], opts: &DeviceRestoreOptions) -> Result<(), EngineError>;

    /// Lines for `hiber inspect` describing `section`.
    fn describe(&self, section: &serde_json::Value) -> Vec<String>;
}

/// The engines this machine can run, most specific first.
pub fn available() -> Vec<Box<dyn DeviceEngine>> {
    let mut out: Vec<Box<dyn DeviceEngine>> = Vec::new();
    if let Some(e) = agent::AgentEngine::load() {
        out.push(Box::new(e));
    }
    if let Some(e) = cuda::DriverEngine::load() {
        out.push(Box::new(e));
    }
    out
}

/// Finds the engine that wrote a manifest section. `None` when this machine lacks it.
pub fn for_section<'a>(engines: &'a [Box<dyn DeviceEngine>], name: &str) -> Option<&'a dyn DeviceEngine> {
    engines.iter().find(|e| e.name() == name).map(|e| e.as_ref())
}
