//! The manifest: what an image holds, in `manifest.json`.

use serde::{Deserialize, Serialize};

use crate::proctree::ProcessInfo;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FormatVersion {
    pub major: u32,
    pub minor: u32,
}

impl std::fmt::Display for FormatVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Where the image came from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Source {
    /// The hiber job, when the tree was started by `hiber run` or `hiber restore`.
    pub job: Option<String>,
    /// The root PID as hiber saw it at checkpoint time.
    pub pid: i32,
    pub leave_running: bool,
    /// The tree's root lives in a PID namespace of its own (a hiber job).
    pub pid_namespace: bool,
    /// ... and in a mount namespace of its own, whose mounts (but its /proc) are the
    /// host's: CRIU restores it with `/` as root and those mounts as external.
    #[serde(default)]
    pub mount_namespace: bool,
    /// Paths of the root's stdout and stderr when they were regular files: a restore hands
    /// the new copy its own log files in their place.
    pub stdout: Option<String>,
    pub stderr: Option<String>,
    /// CRIU's `file[MNT_ID:INODE]` for stdout and stderr, when they were dumped as external
    /// files (1.1): the key under which a restore hands the new copy its logs. 1.0 images
    /// used the path.
    #[serde(default)]
    pub stdout_external: Option<String>,
    #[serde(default)]
    pub stderr_external: Option<String>,
    /// The PID namespace numbers named by the CUDA sockets the tree held
    /// (`cuda-uvmfd-NS-PID`), which a restore binds again: `hiber run` keeps new jobs out
    /// of namespaces with these numbers, so that none holds such a name when this image is
    /// restored.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cuda_namespaces: Vec<u64>,
}

impl Source {
    /// `(key, path)` under which a restore hands CRIU each of the new copy's two logs, in
    /// the order stdout, stderr; `None` where the image had no log file there.
    pub fn log_keys(&self) -> [Option<String>; 2] {
        let key = |ext: &Option<String>, path: &Option<String>| ext.clone().or_else(|| path.as_ref().map(|p| p.trim_start_matches('/').to_string()));
        [key(&self.stdout_external, &self.stdout), key(&self.stderr_external, &self.stderr)]
    }
}

/// What one device engine recorded, opaque to the pipeline.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DeviceSection {
    pub engine: String,
    /// The version of `state`'s shape, the engine's own (1.0 images: 1).
    #[serde(default = "first_section_version")]
    pub version: u32,
    pub state: serde_json::Value,
}

fn first_section_version() -> u32 {
    1
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    /// Relative to the image directory.
    pub path: String,
    /// Of the file as stored.
    pub size: u64,
    /// Of the file as stored.
    pub blake3: String,
    /// How the file encodes its data, when not as is: "zstd" for a device data chunk
    /// compressed into one zstd frame (always shorter than the data it holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<String>,
    /// For a device data chunk: the fingerprint of its data taken on the GPU at the
    /// checkpoint, by which the next incremental checkpoint knows an unchanged chunk
    /// without reading it (see the agent engine's fingerprint.rs). Readers before it
    /// ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub magic: String,
    pub format: super::FormatVersion,
    /// RFC 3339, UTC.
    pub created: String,
    pub host: String,
    pub kernel: String,
    pub criu_version: String,
    pub hiber_version: String,
    pub source: Source,
    pub processes: Vec<ProcessInfo>,
    pub devices: Vec<DeviceSection>,
    /// Seconds the tree was frozen by CRIU, as hiber measured it.
    pub frozen_seconds: f64,
    /// The earlier image this one shares files with (absent when it shares none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentRef>,
    pub files: Vec<FileEntry>,
}

/// An incremental image's parent: the image whose unchanged files it shares (each such file
/// is one file with two names, a hard link: removing either image leaves the other whole).
/// Every shared file is still listed in this image's own `files`, with its checksum, so the
/// image reads, verifies and restores without the parent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParentRef {
    /// Where the parent was when this image was written.
    pub path: String,
    /// The parent's manifest.blake3 then.
    pub manifest_blake3: String,
    pub shared_files: u64,
    pub shared_bytes: u64,
}

/// The part of a manifest every version shares: enough to tell a hiber image of a
/// supported format from anything else before reading the rest.
#[derive(Debug, Clone, Deserialize)]
pub struct Head {
    pub magic: String,
    pub format: FormatVersion,
}

impl Manifest {
    pub fn parse_head(bytes: &[u8]) -> Result<Head, String> {
        serde_json::from_slice(bytes).map_err(|e| e.to_string())
    }

    /// Parses a whole manifest of this format (check the head first).
    pub fn parse(bytes: &[u8]) -> Result<Manifest, String> {
        serde_json::from_slice(bytes).map_err(|e| e.to_string())
    }
}
