//! `hiber migrate JOB --to HOST:PORT --token-file F [--name NAME] [--keep-image DIR]`: move
//! a running job to another host's `hiber serve` (see hiber_core::migrate).

use std::path::PathBuf;
use std::time::Duration;

use hiber_core::migrate::{migrate, MigrateError, MigrateRequest};

use super::{context, human_bytes, secs};
use crate::cli_error::{CliError, FAILED};

#[derive(clap::Args)]
pub struct Args {
    /// The job to move (see `hiber ls`).
    job: String,
    /// The target's `hiber serve` address, HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    to: String,
    /// A file (mode 0600) with the secret the target's `hiber serve` was given: both sides
    /// prove they hold it, and the image travels encrypted (TLS 1.3).
    #[arg(long, value_name = "FILE")]
    token_file: PathBuf,
    /// The job's name on the target (default: its name here).
    #[arg(long)]
    name: Option<String>,
    /// Keep a copy of the image in DIR (which must not exist).
    #[arg(long, value_name = "DIR")]
    keep_image: Option<PathBuf>,
    /// How long to wait for the target at each step, its restore included, in seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<(), CliError> {
    let token = super::token(&args.token_file)?;
    let mut ctx = context()?;
    let progress = super::show_progress(&mut ctx, args.json);
    let req = MigrateRequest {
        job: args.job,
        to: args.to.clone(),
        token,
        name: args.name,
        keep_image: args.keep_image,
        timeout: Duration::from_secs(args.timeout.max(1)),
    };
    let report = migrate(&ctx, &req);
    if let Some(p) = progress {
        p.finish_and_clear();
    }
    let report = report.map_err(|e| match e {
        MigrateError::Job(e) => CliError::from(e),
        MigrateError::Checkpoint(e) => CliError::from(e),
        e => {
            let hint = e.hint();
            super::with_hint(CliError::new(FAILED, e.to_string()), hint)
        }
    })?;
    if args.json {
        let v = serde_json::json!({
            "job": report.name,
            "to": args.to,
            "pid": report.pid,
            "stopped_seconds": report.stopped.as_secs_f64(),
            "sent_bytes": report.sent_bytes,
            "checkpoint_seconds": report.checkpoint.total.as_secs_f64(),
            "image_kept": report.image_kept,
        });
        println!("{v}");
    } else {
        println!(
            "moved job {} to {} (pid {} there): stopped {}, {} sent{}",
            report.name,
            args.to,
            report.pid,
            secs(report.stopped),
            human_bytes(report.sent_bytes),
            report.image_kept.map(|d| format!("; image kept at {}", d.display())).unwrap_or_default()
        );
    }
    Ok(())
}
