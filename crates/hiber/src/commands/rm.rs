//! `hiber rm [-f] NAME...`: remove jobs (their logs too) or images.

use std::fs;
use std::time::{Duration, Instant};

use hiber_core::image::Image;
use hiber_core::jobs::{JobError, JobState, Registry};
use hiber_core::lock;
use hiber_core::restore::interrupted::{self, Policy, SettleError, Settled};
use hiber_core::state::StateDir;
use hiber_core::{proctree, sys};

use super::image_path;
use crate::cli_error::{CliError, FAILED, NOT_FOUND};

#[derive(clap::Args)]
pub struct Args {
    /// Stop running jobs (SIGKILL) before removing them.
    #[arg(short, long)]
    force: bool,
    /// Job names or images.
    #[arg(required = true)]
    names: Vec<String>,
}

pub fn run(args: Args) -> Result<(), CliError> {
    let state = StateDir::from_env();
    let registry = Registry::new(&state);
    let mut errors: Vec<CliError> = args.names.iter().filter_map(|n| remove_one(&state, &registry, n, args.force).err()).collect();
    match errors.len() {
        0 => Ok(()),
        1 => Err(errors.remove(0)),
        n => {
            for e in &errors {
                e.report(false);
            }
            Err(CliError::new(errors[0].code, format!("{n} of {} could not be removed", args.names.len())))
        }
    }
}

/// A job whose restore a killed hiber left unfinished: stopped (with `force`) and removed.
fn remove_interrupted_restore(registry: &Registry, name: &str, force: bool) -> Result<(), CliError> {
    let runs = registry.restored_root(name).is_some_and(|r| proctree::is_same_process(r.pid, r.start_time)) || !registry.restore_unattended(name);
    if runs && !force {
        return Err(CliError::new(FAILED, format!("job '{name}' is running (its restore was interrupted)"))
            .hint(format!("`hiber recover` adopts it if it can run on; `hiber rm -f {name}` stops and removes it")));
    }
    match interrupted::settle(registry, name, Policy::Stop)? {
        Settled::StillRestoring => {
            Err(CliError::new(FAILED, format!("job '{name}' is still being restored by CRIU, whose hiber is gone"))
                .hint("try again later, or run `hiber recover`"))
        }
        _ => {
            println!("removed job {name}");
            Ok(())
        }
    }
}

fn remove_one(state: &StateDir, registry: &Registry, name: &str, force: bool) -> Result<(), CliError> {
    let found = match registry.load(name) {
        Ok(job) => Some(job),
        // A job whose record cannot be read (permission denied, say) is not "no job".
        Err(e) if !matches!(e, JobError::NotFound(_) | JobError::BadName(_)) => return Err(e.into()),
        Err(_) => None,
    };
    if let Some(job) = found {
        // Not under a checkpoint of the job, nor another removal; held until the job is gone.
        let _lock = lock::lock_job(registry, name, "removed")?;
        match registry.state(&job) {
            JobState::Restoring { hiber_pid } => return Err(SettleError::Restoring { name: name.to_string(), hiber_pid }.into()),
            JobState::InterruptedRestore => return remove_interrupted_restore(registry, name, force),
            _ => {}
        }
        if registry.state(&job) == JobState::Running {
            if !force {
                return Err(CliError::new(FAILED, format!("job '{name}' is running")).hint(format!("stop and remove it with `hiber rm -f {name}`")));
            }
            // The root is its PID namespace's init: killing it ends every process of the job.
            let _ = sys::kill(job.pid, libc::SIGKILL);
            let start = Instant::now();
            // Wait for the process to go and for its shim to record the exit, so the
            // directory is not written to while it is removed.
            while (proctree::is_same_process(job.pid, job.start_time) || !registry.has_exit(name)) && start.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        registry.remove(name)?;
        println!("removed job {name}");
        return Ok(());
    }
    let path = image_path(state, name);
    if !path.exists() {
        return Err(CliError::new(NOT_FOUND, format!("no job or image named '{name}'")).hint(super::not_found_hint("`hiber ls` lists jobs and images")));
    }
    // Only what is recognizably an image is removed, never an arbitrary directory.
    match Image::open(&path) {
        Ok(_) | Err(hiber_core::image::ImageError::UnsupportedFormat { .. }) => {}
        Err(e) => return Err(CliError::new(FAILED, format!("{}: not removing: {e}", path.display()))),
    }
    fs::remove_dir_all(&path)?;
    println!("removed image {}", path.display());
    Ok(())
}
