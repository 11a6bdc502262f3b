//! How failures reach the user: one line saying what failed, one line of hint, and the
//! whole cause chain only with `-v`.
//!
//! Exit codes: 0 success; 1 the operation failed (the application is left as it was);
//! 2 bad usage; 3 no such job, process or image; 4 the image is invalid; 5 this machine
//! lacks something hiber needs (CRIU, root, a GPU engine).

use std::error::Error;

use hiber_core::checkpoint::CheckpointError;
use hiber_core::criu::CriuError;
use hiber_core::image::ImageError;
use hiber_core::jobs::JobError;
use hiber_core::lock::LockError;
use hiber_core::proctree::TreeError;
use hiber_core::restore::interrupted::SettleError;
use hiber_core::restore::RestoreError;

pub const FAILED: i32 = 1;
pub const NOT_FOUND: i32 = 3;
pub const INVALID_IMAGE: i32 = 4;
pub const ENVIRONMENT: i32 = 5;

#[derive(Debug)]
pub struct CliError {
    pub code: i32,
    pub message: String,
    pub hint: Option<String>,
    pub source: Option<Box<dyn Error + Send + Sync>>,
}

impl CliError {
    pub fn new(code: i32, message: impl Into<String>) -> CliError {
        CliError { code, message: message.into(), hint: None, source: None }
    }

    pub fn hint(mut self, hint: impl Into<String>) -> CliError {
        self.hint = Some(hint.into());
        self
    }

    fn from_error(code: i32, e: impl Error + Send + Sync + 'static, hint: Option<String>) -> CliError {
        // Permission denied anywhere in the chain: the cause is who runs hiber, whatever
        // the step was.
        let hint = if denied(&e) { Some(ROOT_HINT.to_string()) } else { hint };
        CliError { code, message: e.to_string(), hint, source: Some(Box::new(e)) }
    }

    pub fn report(&self, verbose: bool) {
        eprintln!("hiber: {}", self.message);
        if verbose {
            let mut cur = self.source.as_ref().and_then(|s| s.source());
            while let Some(c) = cur {
                eprintln!("  caused by: {c}");
                cur = c.source();
            }
        }
        if let Some(h) = &self.hint {
            eprintln!("hint: {h}");
        }
    }
}

/// What a user who is not root is told where a job or image is not theirs to read.
pub const ROOT_HINT: &str = "hiber's jobs and images are root's: run hiber as root (sudo)";

/// Whether an I/O error in `e`'s chain is a permission denied.
fn denied(e: &(dyn Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::PermissionDenied) {
            return true;
        }
        cur = c.source();
    }
    false
}

impl From<CriuError> for CliError {
    fn from(e: CriuError) -> Self {
        let (code, hint) = match &e {
            CriuError::NotFound | CriuError::TooOld { .. } | CriuError::Spawn { .. } => {
                (ENVIRONMENT, Some("run scripts/setup.sh (builds CRIU 4.1.1), or set HIBER_CRIU to a CRIU 4.x binary".to_string()))
            }
            _ => (FAILED, e.log().map(|l| format!("CRIU's log: {}", l.display()))),
        };
        CliError::from_error(code, e, hint)
    }
}

impl From<ImageError> for CliError {
    fn from(e: ImageError) -> Self {
        let (code, hint) = match &e {
            ImageError::NotFound(_) => (NOT_FOUND, Some("`hiber ls` lists images".to_string())),
            ImageError::OutputExists(_) => (FAILED, None),
            ImageError::Io { .. } => (FAILED, None),
            _ => (INVALID_IMAGE, Some("the image cannot be trusted; checkpoint again".to_string())),
        };
        CliError::from_error(code, e, hint)
    }
}

impl From<JobError> for CliError {
    fn from(e: JobError) -> Self {
        let (code, hint) = match &e {
            JobError::NotFound(_) => (NOT_FOUND, Some("`hiber ls` lists jobs".to_string())),
            JobError::Exists(_) => (FAILED, Some("choose another --name, or `hiber rm` the old job".to_string())),
            JobError::BadName(_) => (FAILED, None),
            _ => (FAILED, None),
        };
        CliError::from_error(code, e, hint)
    }
}

impl From<LockError> for CliError {
    fn from(e: LockError) -> Self {
        let hint = matches!(e, LockError::Held { .. }).then(|| "wait for that hiber to finish, then try again".to_string());
        CliError::from_error(FAILED, e, hint)
    }
}

impl From<SettleError> for CliError {
    fn from(e: SettleError) -> Self {
        let hint = e.hint();
        CliError::from_error(FAILED, e, hint)
    }
}

impl From<TreeError> for CliError {
    fn from(e: TreeError) -> Self {
        let code = if matches!(e, TreeError::NoSuchProcess(_)) { NOT_FOUND } else { FAILED };
        CliError::from_error(code, e, None)
    }
}

impl From<CheckpointError> for CliError {
    fn from(e: CheckpointError) -> Self {
        let hint = e.hint();
        let code = match &e {
            CheckpointError::Tree(TreeError::NoSuchProcess(_)) => NOT_FOUND,
            CheckpointError::NotPermitted { .. } => ENVIRONMENT,
            CheckpointError::Criu(CriuError::NotFound | CriuError::TooOld { .. }) => ENVIRONMENT,
            _ => FAILED,
        };
        let resumed = !matches!(e, CheckpointError::Resume { .. });
        let mut err = CliError::from_error(code, e, hint);
        if code == FAILED && resumed {
            err.message = format!("checkpoint failed: {}; the application keeps running", err.message);
        }
        err
    }
}

impl From<RestoreError> for CliError {
    fn from(e: RestoreError) -> Self {
        let hint = e.hint();
        let code = match &e {
            RestoreError::Image(ImageError::NotFound(_)) => NOT_FOUND,
            RestoreError::Image(i) if i.is_invalid_image() => INVALID_IMAGE,
            RestoreError::EngineUnavailable { .. } | RestoreError::NotRoot => ENVIRONMENT,
            _ => FAILED,
        };
        let mut err = CliError::from_error(code, e, hint);
        if code != NOT_FOUND && code != INVALID_IMAGE {
            err.message = format!("restore failed: {}", err.message);
        }
        err
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError::from_error(FAILED, e, None)
    }
}
