//! One module per verb, plus what several of them share.

pub mod checkpoint;
pub mod coordinate;
pub mod demo;
pub mod doctor;
pub mod inspect;
pub mod logs;
pub mod ls;
pub mod migrate;
pub mod recover;
pub mod restore;
pub mod rm;
pub mod run;
pub mod serve;

use std::path::{Path, PathBuf};
use std::time::Duration;

use hiber_core::criu::Criu;
use hiber_core::jobs::{Job, JobError, JobState, Registry};
use hiber_core::state::StateDir;
use hiber_core::{engine, Context};

use crate::cli_error::{CliError, NOT_FOUND};

/// The context for commands that run CRIU.
pub fn context() -> Result<Context, CliError> {
    let criu = Criu::locate()?;
    let criu_version = criu.require_supported()?;
    Ok(Context { state: StateDir::from_env(), criu, criu_version, engines: engine::available(), on_phase: Box::new(|_| {}) })
}

/// Shows each step of a pipeline on a spinner line when stderr is a terminal (and the
/// output is not JSON); otherwise stays silent. No ticker thread.
pub fn show_progress(ctx: &mut Context, json: bool) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if json || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new_spinner();
    let shown = bar.clone();
    ctx.on_phase = Box::new(move |what| {
        shown.tick();
        shown.set_message(what.to_string());
    });
    Some(bar)
}

/// The coordinator a checkpoint or restore holds at between phases: `hiber coordinate`'s
/// at `addr` (the session token in `$HIBER_SESSION`), or none (every phase runs on; faults
/// may be injected with `HIBER_FAIL_AT`).
pub fn coordinator(addr: Option<&str>, name: &str) -> Result<Box<dyn hiber_core::coordinator::Coordinator>, CliError> {
    use hiber_core::coordinator::{from_env, net::Remote};
    let Some(addr) = addr else { return Ok(Box::new(from_env())) };
    let session = std::env::var(coordinate::SESSION_ENV).map_err(|_| {
        CliError::new(crate::cli_error::FAILED, format!("--coordinator needs the session's token in ${}", coordinate::SESSION_ENV))
            .hint("`hiber coordinate` prints it when it starts")
    })?;
    let secs = std::env::var("HIBER_BARRIER_TIMEOUT_S").ok().and_then(|v| v.parse().ok()).unwrap_or(600);
    let host = hiber_core::sys::uname().1;
    let remote = Remote::join(addr, &session, &format!("{host}/{name}"), Duration::from_secs(secs), from_env()).map_err(|e| {
        CliError::new(crate::cli_error::FAILED, e.to_string())
            .hint("start `hiber coordinate --participants N` first, and give every participant its address and token")
    })?;
    Ok(Box::new(remote))
}

/// The token in `path`, as `migrate` and `serve` take it (`--token-file`).
pub fn token(path: &Path) -> Result<hiber_core::secure::Token, CliError> {
    hiber_core::secure::Token::from_file(path).map_err(|e| with_hint(CliError::new(crate::cli_error::FAILED, e.to_string()), e.hint()))
}

/// `err` with `hint`, where there is one.
pub fn with_hint(err: CliError, hint: Option<String>) -> CliError {
    match hint {
        Some(h) => err.hint(h),
        None => err,
    }
}

/// A job name or a PID, as `checkpoint` and `rm` take them.
pub enum Target {
    Job(Job),
    Pid(i32),
}

pub fn resolve_target(registry: &Registry, what: &str) -> Result<Target, CliError> {
    match registry.load(what) {
        Ok(job) => return Ok(Target::Job(job)),
        // A job whose record cannot be read (permission denied, say) is not "no job".
        Err(e) if !matches!(e, JobError::NotFound(_) | JobError::BadName(_)) => return Err(e.into()),
        Err(_) => {}
    }
    match what.parse::<i32>() {
        Ok(pid) if pid > 0 => Ok(Target::Pid(pid)),
        _ => Err(CliError::new(NOT_FOUND, format!("no job named '{what}', and it is not a PID")).hint(not_found_hint("`hiber ls` lists jobs"))),
    }
}

/// The hint for a job or image not found: `usual`, or, to a user who is not root (whose
/// state directory is not root's), where root's jobs are.
pub fn not_found_hint(usual: &str) -> String {
    if hiber_core::sys::geteuid() == 0 {
        usual.to_string()
    } else {
        format!("{usual}; jobs started by root are root's to see: run hiber as root (sudo)")
    }
}

/// The job's root PID if it is running.
pub fn running_pid(registry: &Registry, job: &Job) -> Result<i32, CliError> {
    match registry.state(job) {
        JobState::Running => Ok(job.pid),
        state => Err(CliError::new(crate::cli_error::FAILED, format!("job '{}' is not running ({state})", job.name))
            .hint("`hiber ls` shows jobs and images; restore an image to run it again")),
    }
}

/// An image given by path, or by name under the state directory's images.
pub fn image_path(state: &StateDir, given: &str) -> PathBuf {
    let p = Path::new(given);
    if p.exists() || given.contains('/') {
        return p.to_path_buf();
    }
    let under = state.images().join(given);
    if under.exists() {
        under
    } else {
        p.to_path_buf()
    }
}

/// Bytes as a person reads them ("256.70 MiB").
pub fn human_bytes(b: u64) -> String {
    indicatif::HumanBytes(b).to_string()
}

pub fn secs(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
    }
}
