//! `hiber logs JOB`: the job's stdout (to stdout) and stderr (to stderr).

use std::io::Write;

use hiber_core::jobs::Registry;
use hiber_core::state::StateDir;

use crate::cli_error::CliError;

#[derive(clap::Args)]
pub struct Args {
    job: String,
}

pub fn run(args: Args) -> Result<(), CliError> {
    let registry = Registry::new(&StateDir::from_env());
    registry.load(&args.job)?;
    let out = std::fs::read(registry.stdout_of(&args.job)).unwrap_or_default();
    let err = std::fs::read(registry.stderr_of(&args.job)).unwrap_or_default();
    std::io::stdout().write_all(&out)?;
    std::io::stderr().write_all(&err)?;
    Ok(())
}
