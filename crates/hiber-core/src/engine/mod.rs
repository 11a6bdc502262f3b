//! Device engines: how device (GPU) state gets in and out of an image.
//!
//! The pipelines drive every engine through three traits and never name one:
//! - [`EngineKind`]: what hiber knows of an engine without loading it: its name, the
//!   version of its manifest section, how it describes a section (`hiber inspect`), how it
//!   prepares a job at launch (`hiber run`), which image files it verifies itself;
//! - [`DeviceEngine`]: the engine loaded on this machine; it opens one session per
//!   checkpoint or restore, and undoes an interrupted checkpoint (`hiber recover`);
//! - [`CheckpointSession`] and [`RestoreSession`]: the per-operation state, owned by the
//!   pipeline and driven phase by phase.
//!
//! Every step that changes the application has an undo: [`CheckpointSession::resume`]
//! brings the session's processes back to running from whatever state a failed
//! checkpoint left them in.
//!
//! Adding an engine: its own folder here, and one line in [`KINDS`].

pub mod agent;
pub mod cuda;
mod layer;
pub mod opencl;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::coordinator::Coordinator;
use crate::image::{FileEntry, ImageSink};
use crate::proctree::ProcessInfo;

/// Every engine hiber knows, most specific first: this order is the order in which
/// engines quiesce and capture; they resume and restore in reverse.
pub static KINDS: &[&dyn EngineKind] = &[&opencl::KIND, &agent::KIND, &cuda::KIND];

/// Why a device engine step failed. The variants keep their causes: `-v` shows the chain.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A driver call failed with a CUresult.
    #[error("{engine}: {what}: {result}")]
    Cuda {
        engine: &'static str,
        what: String,
        #[source]
        result: CuError,
        hint: Option<String>,
    },
    /// Reading or writing device data failed.
    #[error("{engine}: {what}: {source}")]
    Io { engine: &'static str, what: String, source: std::io::Error, hint: Option<String> },
    /// The image's section for this engine is newer than this hiber reads.
    #[error("{engine}: the image's section is version {found}; this hiber reads up to {supported}")]
    SectionVersion { engine: &'static str, found: u32, supported: u32 },
    /// Anything else, said in words.
    #[error("{engine}: {message}")]
    Failed { engine: &'static str, message: String, hint: Option<String> },
    /// Processes of the job ended while it was held: the others were given back all they
    /// can be, and what they lost with them (communicators with those ranks) cannot be.
    /// Nothing is left for an undo to retry; what follows is the job's own doing.
    #[error("{engine}: {message}")]
    ProcessesGone { engine: &'static str, message: String, hint: Option<String> },
}

impl EngineError {
    pub fn failed(engine: &'static str, message: impl Into<String>, hint: Option<&str>) -> EngineError {
        EngineError::Failed { engine, message: message.into(), hint: hint.map(String::from) }
    }

    pub fn hint(&self) -> Option<&str> {
        match self {
            EngineError::Cuda { hint, .. } | EngineError::Io { hint, .. } | EngineError::Failed { hint, .. } | EngineError::ProcessesGone { hint, .. } => {
                hint.as_deref()
            }
            EngineError::SectionVersion { .. } => Some("restore it with a newer hiber"),
        }
    }

    /// The CUresult, when a driver call failed.
    pub fn cuda_result(&self) -> Option<i32> {
        match self {
            EngineError::Cuda { result, .. } => Some(result.code),
            _ => None,
        }
    }
}

/// A driver error: the CUresult and its name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name} ({code})")]
pub struct CuError {
    pub code: i32,
    pub name: String,
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
    /// `--opencl-device`: the OpenCL device to move the processes to (`cpu`, `gpu`,
    /// `PLATFORM:DEVICE`); `None` keeps each on the device it had.
    pub opencl_device: Option<String>,
}

/// How a checkpoint ends, as the engines need to know it.
#[derive(Debug, Clone, Copy, Default)]
pub struct CheckpointOptions {
    /// The application runs on after the checkpoint.
    pub leave_running: bool,
    /// CRIU lets the engines take device state while it holds the tree
    /// ([`CheckpointSession::checkpoint_frozen`]).
    pub in_freeze: bool,
}

/// A restored process: its PID inside its namespace (as recorded in the image) and the
/// PID hiber sees now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoredPid {
    pub ns_pid: i32,
    pub pid: i32,
}

/// What hiber knows of an engine without loading it.
pub trait EngineKind: Sync {
    fn name(&self) -> &'static str;

    /// The version of the manifest section this hiber writes, and the newest it reads.
    /// Sections carry it, so an engine's state can change without the image format's.
    fn section_version(&self) -> u32;

    /// The engine on this machine; `None` when it cannot run here (no driver, say).
    fn load(&self) -> Option<Box<dyn DeviceEngine>>;

    /// Lines for `hiber inspect` describing a section; works without a driver.
    fn describe(&self, section: &serde_json::Value) -> Vec<String>;

    /// Environment variables for a job that `hiber run` starts in `job_dir` (a preloaded
    /// library, say); empty when the engine prepares nothing.
    fn launch_env(&self, _job_dir: &Path) -> Vec<(String, String)> {
        Vec::new()
    }

    /// The image subdirectory whose files the engine checks itself as it streams them on
    /// restore (so they are read once, not twice).
    fn streamed_dir(&self) -> Option<&'static str> {
        None
    }

    /// What to do when an image needs this engine and this machine lacks it.
    fn unavailable_hint(&self) -> &'static str;
}

/// An engine loaded on this machine.
pub trait DeviceEngine: Send + Sync {
    fn kind(&self) -> &'static dyn EngineKind;

    fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// Claims the processes of `tree` whose device state this engine captures and opens a
    /// session over them; `None` when it has nothing to do for this tree. Touches nothing.
    fn begin_checkpoint(&self, tree: &[ProcessInfo], opts: CheckpointOptions) -> Result<Option<Box<dyn CheckpointSession>>, EngineError>;

    /// `hiber recover` after a hiber that was checkpointing died: brings `pids` back to
    /// running, with the places (the partial image, the finished one) where that hiber may
    /// have left device data the engine needs to bring back. `gone` are the processes of
    /// that checkpoint that no longer run (what they shared with `pids` cannot come back).
    fn recover(&self, pids: &[i32], gone: &[i32], dirs: &[&Path]) -> Result<(), EngineError>;

    /// Opens a restore of `section`, after checking that this machine can take its state
    /// (devices present, enough memory), so a restore never half-happens.
    fn begin_restore(&self, section: &serde_json::Value, opts: &DeviceRestoreOptions) -> Result<Box<dyn RestoreSession>, EngineError>;
}

/// One engine's share of one checkpoint. The pipeline calls quiesce, capture, then either
/// finish (the image is being committed) or resume (the undo, or `--leave-running`'s
/// normal end), in the order of [`KINDS`] (resume in reverse).
pub trait CheckpointSession: Send {
    /// The host PIDs the session claimed (recorded in the journal before anything changes).
    fn pids(&self) -> &[i32];

    /// The claimed processes whose state goes into the image, which a restore needs back:
    /// one of them that ends during the checkpoint fails it. All by default; the agent's
    /// leaves out processes it tracks nothing for (a DataLoader worker forked after CUDA,
    /// which may end with its epoch).
    fn stateful(&self) -> Vec<i32> {
        self.pids().to_vec()
    }

    /// Whether the session's checkpoint takes the device files of its processes away
    /// before the dump (the driver's does). The preflight checks the device files of the
    /// processes no such session claimed.
    fn releases_device_files(&self) -> bool {
        false
    }

    /// The claimed processes whose collective communication (NCCL) the session cuts and
    /// rebuilds itself; the preflight refuses such state in any other process.
    fn collectives(&self) -> Vec<i32> {
        Vec::new()
    }

    /// The claimed processes with device contexts on several GPUs whose restore rests on
    /// the driver's alone, and how many GPUs each uses: the driver (580) checkpoints such a
    /// process that enabled peer access between its GPUs, but refuses to restore it.
    fn on_several_gpus(&self) -> Vec<(i32, usize)> {
        Vec::new()
    }

    /// Whether the processes it claims restore with peer access enabled (the agent's: their
    /// device memory is out of the process when the driver checkpoints it; a PyTorch process
    /// on both GPUs and JAX's default client round-trip so on 2×H200).
    fn restores_peer_access(&self) -> bool {
        false
    }

    /// Readies, while the application still runs, what the pause will need (memory for
    /// copies, kernels the driver must compile), so that the pause does not include it.
    /// Touches nothing of the application's; what it could not ready, the pause does without.
    fn prepare(&mut self, _sink: &dyn ImageSink) {}

    /// Stops new device work and waits for work in flight, within a timeout. Device data
    /// that must be saved before the application's device state is released goes to `sink`.
    /// `peers` are the other participants of a coordinated checkpoint (see
    /// [`crate::coordinator`]): work that spans them (an NCCL cut) is cut with theirs.
    fn quiesce(&mut self, sink: &dyn ImageSink, peers: &dyn Coordinator) -> Result<(), EngineError>;

    /// Moves the device state of the quiesced processes where the CRIU dump (or the
    /// engine's own files) will take it. Returns the engine's manifest section.
    fn capture(&mut self, tree: &[ProcessInfo]) -> Result<serde_json::Value, EngineError>;

    /// Threads that must run while CRIU holds the tree, for
    /// [`checkpoint_frozen`](Self::checkpoint_frozen) and
    /// [`resume_frozen`](Self::resume_frozen) (the CUDA driver's restore threads): none by
    /// default. CRIU sends its device notifications only when some session names threads;
    /// both hooks are then called on every session, and do nothing by default.
    fn frozen_threads(&self) -> Vec<i32> {
        Vec::new()
    }

    /// Takes the device state that must not be away while the process runs, once CRIU
    /// holds the tree (only [`frozen_threads`](Self::frozen_threads) run). Returns the
    /// engine's manifest section again where it changed.
    fn checkpoint_frozen(&mut self) -> Result<Option<serde_json::Value>, EngineError> {
        Ok(None)
    }

    /// Gives that device state back before CRIU lets a tree that runs on go (with
    /// `--leave-running`, or after a dump that failed), the tree still held.
    fn resume_frozen(&mut self) -> Result<(), EngineError> {
        Ok(())
    }

    /// Brings the processes back to running from whatever state quiesce/capture left them
    /// in. Idempotent: safe on processes that were never touched. Device data that only
    /// hiber still holds and cannot hand back goes to `sink`, for `hiber recover`.
    /// With `peers`, state shared with them (NCCL communicators) is built again with theirs.
    fn resume(&mut self, sink: &dyn ImageSink, peers: &dyn Coordinator) -> Result<(), EngineError>;

    /// Once the image's other parts are written (with `--leave-running`, after resume):
    /// writes what the session still holds to `sink`, and returns the manifest entries of
    /// every file it wrote, so they are not hashed again.
    fn finish(&mut self, _sink: &dyn ImageSink) -> Result<Vec<FileEntry>, EngineError> {
        Ok(Vec::new())
    }
}

/// One engine's share of one restore, opened once the checks passed.
pub trait RestoreSession: Send {
    /// After CRIU restored the tree: restores device state into `pids` and resumes them.
    /// With `peers` (a coordinated restore), state shared with their processes (NCCL
    /// communicators) is built again with theirs.
    fn restore(&mut self, pids: &[RestoredPid], peers: &dyn Coordinator) -> Result<(), EngineError>;

    /// Whether this session restores into a tree that CRIU left stopped (its sessions run
    /// first, then the tree is continued, then the others run).
    fn wants_stopped_tree(&self) -> bool {
        false
    }

    /// Before CRIU starts: the directory of the job the restore makes, for sessions that
    /// start a helper beside the job (the OpenCL proxy). An error stops the restore before
    /// anything runs.
    fn job_dir(&mut self, _dir: &Path) -> Result<(), EngineError> {
        Ok(())
    }
}

/// The engines this machine can run, in [`KINDS`] order.
pub fn available() -> Vec<Box<dyn DeviceEngine>> {
    KINDS.iter().filter_map(|k| k.load()).collect()
}

/// The engine kind of a manifest section's name, loaded or not.
pub fn kind(name: &str) -> Option<&'static dyn EngineKind> {
    KINDS.iter().copied().find(|k| k.name() == name)
}

/// Finds the loaded engine that wrote a manifest section. `None` when this machine lacks it.
pub fn for_section<'a>(engines: &'a [Box<dyn DeviceEngine>], name: &str) -> Option<&'a dyn DeviceEngine> {
    engines.iter().find(|e| e.name() == name).map(|e| e.as_ref())
}

/// The environment every engine wants for a job `hiber run` starts in `job_dir`, but
/// those named in `skip` (`hiber run --no-agent` skips "agent").
pub fn launch_env(job_dir: &Path, skip: &[&str]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for (k, v) in KINDS.iter().filter(|k| !skip.contains(&k.name())).flat_map(|k| k.launch_env(job_dir)) {
        match out.iter_mut().find(|(name, _)| *name == k) {
            // Two layers preloaded: both, each once, the first engine's first.
            Some((_, old)) if k == "LD_PRELOAD" => {
                let mut libs: Vec<&str> = old.split(':').collect();
                for lib in v.split(':') {
                    if !libs.contains(&lib) {
                        libs.push(lib);
                    }
                }
                *old = libs.join(":");
            }
            Some((_, old)) => *old = v,
            None => out.push((k, v)),
        }
    }
    out
}

/// Checks a section's version against what its engine reads.
pub fn check_section_version(kind: &dyn EngineKind, found: u32) -> Result<(), EngineError> {
    if found > kind.section_version() {
        return Err(EngineError::SectionVersion { engine: kind.name(), found, supported: kind.section_version() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_engine_is_registered_once_and_described_without_a_driver() {
        let names: Vec<&str> = KINDS.iter().map(|k| k.name()).collect();
        assert_eq!(names, ["opencl", "agent", "cuda"], "quiesce order: the layers before the driver");
        for k in KINDS {
            assert!(kind(k.name()).is_some());
            // An unreadable section is described as such, never a panic.
            assert!(!k.describe(&serde_json::json!({"nonsense": true})).is_empty());
            assert!(!k.unavailable_hint().is_empty());
        }
        assert!(kind("rocm").is_none());
    }

    #[test]
    fn a_newer_section_is_refused_with_a_hint() {
        let k = kind("cuda").unwrap();
        check_section_version(k, k.section_version()).unwrap();
        check_section_version(k, 1).unwrap();
        let e = check_section_version(k, k.section_version() + 1).unwrap_err();
        assert!(e.to_string().contains("version 2"), "{e}");
        assert!(e.hint().unwrap().contains("newer hiber"));
    }

    #[test]
    fn launch_env_skips_what_it_is_told() {
        let dir = Path::new("/nonexistent-job");
        // Without /dev/nvidiactl (CI) no engine prepares anything; with it, skipping the
        // agent leaves no LD_PRELOAD of it.
        let skipped = launch_env(dir, &["agent"]);
        assert!(!skipped.iter().any(|(k, v)| k == "LD_PRELOAD" && v.contains("hiber_agent")), "{skipped:?}");
        let skipped = launch_env(dir, &["opencl"]);
        assert!(!skipped.iter().any(|(k, v)| k == "LD_PRELOAD" && v.contains("hiber_opencl")), "{skipped:?}");
        assert!(launch_env(dir, &["agent", "opencl"]).is_empty());
        if !Path::new("/dev/nvidiactl").exists() {
            assert!(launch_env(dir, &["opencl"]).is_empty());
        }
        // Where both layers are preloaded, one LD_PRELOAD names both, each once.
        let all = launch_env(dir, &[]);
        assert!(all.iter().filter(|(k, _)| k == "LD_PRELOAD").count() <= 1, "{all:?}");
    }
}
