//! hiber's core: the checkpoint and restore pipelines and the pieces they are made of.
//!
//! - [`proctree`]: which processes make up a tree, and what they hold;
//! - [`engine`]: device engines (GPU state), behind one trait;
//! - [`criu`]: CRIU over its RPC interface;
//! - [`image`]: the on-disk image format, and the sink an image is written through;
//! - [`jobs`] and [`launch`]: the job registry and how a job's tree is started;
//! - [`lock`]: what keeps two hibers off one job at once;
//! - [`journal`]: undoing an interrupted checkpoint ([`restore::interrupted`]: settling an
//!   interrupted restore);
//! - [`checkpoint`] and [`restore`]: the pipelines, run as sessions of phases that a
//!   [`coordinator`] may hold at barriers between them.

pub mod checkpoint;
pub mod coordinator;
pub mod criu;
pub mod doctor;
pub mod engine;
pub mod image;
pub mod jobs;
pub mod journal;
pub mod keeper;
pub mod launch;
pub mod lock;
pub mod migrate;
pub mod proctree;
pub mod restore;
pub mod secure;
pub mod sockdiag;
pub mod state;
pub mod sys;

use std::path::PathBuf;

/// What every pipeline needs: where state lives, CRIU, and this machine's device engines.
pub struct Context {
    pub state: state::StateDir,
    pub criu: criu::Criu,
    /// As CRIU reported it when the context was made (recorded in every manifest).
    pub criu_version: criu::CriuVersion,
    pub engines: Vec<Box<dyn engine::DeviceEngine>>,
    /// Told each step of a pipeline as it starts ("dumping process state"), for a
    /// progress display; does nothing by default.
    pub on_phase: Box<dyn Fn(&str) + Send + Sync>,
}

impl Context {
    pub fn phase(&self, what: &str) {
        tracing::debug!(phase = what);
        (self.on_phase)(what)
    }

    /// A fresh directory under `$STATE/logs` for one CRIU run's log.
    pub fn criu_work_dir(&self, op: &str) -> std::io::Result<PathBuf> {
        let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
        let dir = self.state.logs().join(format!("{op}-{ms}-{}", std::process::id()));
        self.state.ensure(&dir)?;
        Ok(dir)
    }
}
