//! `hiber checkpoint JOB|PID [--leave-running] [--out DIR] [--parent IMAGE | --no-parent]`

use std::path::PathBuf;

use hiber_core::checkpoint::{checkpoint_with, CheckpointRequest};
use hiber_core::jobs::Registry;

use super::{context, human_bytes, image_path, resolve_target, running_pid, secs, Target};
use crate::cli_error::CliError;

#[derive(clap::Args)]
pub struct Args {
    /// A job name (see `hiber ls`) or the PID of any process tree's root.
    target: String,
    /// Keep the application running after the checkpoint.
    #[arg(long)]
    leave_running: bool,
    /// Where to write the image (must not exist). Default: the state directory's images/.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Share the device data that has not changed with this earlier image (a name from
    /// `hiber ls` or a path) instead of writing it again. Default: the job's latest image,
    /// or the one it was restored from.
    #[arg(long, value_name = "IMAGE", conflicts_with = "no_parent")]
    parent: Option<String>,
    /// Write every byte, sharing nothing with an earlier image.
    #[arg(long)]
    no_parent: bool,
    /// Compress device data chunks with zstd (`--compress` or `--compress=LEVEL`, 1-19,
    /// default 1) where that makes them
    /// shorter. Pays where the disk is slower than the CPUs and the data compresses
    /// (bf16 weights about 1.28x, fp32 about 1.08x, random bytes not at all).
    #[arg(long, value_name = "LEVEL", num_args = 0..=1, require_equals = true, default_missing_value = "1", value_parser = clap::value_parser!(i32).range(1..=19))]
    compress: Option<i32>,
    /// Hold at each phase until every participant of `hiber coordinate`'s session at ADDR
    /// reached it (the token in $HIBER_SESSION): one cut across several jobs or hosts.
    #[arg(long, value_name = "ADDR")]
    coordinator: Option<String>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<(), CliError> {
    let mut ctx = context()?;
    let progress = super::show_progress(&mut ctx, args.json);
    let registry = Registry::new(&ctx.state);
    let (pid, job) = match resolve_target(&registry, &args.target)? {
        Target::Job(job) => (running_pid(&registry, &job)?, Some(job)),
        Target::Pid(pid) => (pid, registry.running_job_at(pid)),
    };
    let dest = args.out.unwrap_or_else(|| hiber_core::checkpoint::default_image_path(&ctx.state, job.as_ref(), pid));
    let parent = match (&args.parent, args.no_parent) {
        (Some(p), _) => Some(image_path(&ctx.state, p)),
        (None, true) => None,
        (None, false) => job.as_ref().and_then(|j| j.default_parent()),
    };
    let req =
        CheckpointRequest { pid, job: job.clone(), dest, leave_running: args.leave_running, parent: parent.clone(), compress: args.compress, transient: false };
    let coord = super::coordinator(args.coordinator.as_deref(), job.as_ref().map_or(&args.target, |j| &j.name))?;
    let report = checkpoint_with(&ctx, &req, coord.as_ref());
    if let Some(p) = progress {
        p.finish_and_clear();
    }
    let report = report?;
    if let Some(mut job) = job {
        job.checkpointed(&report.image, args.leave_running);
        // The checkpoint itself succeeded: its image is in place, whatever happens to this
        // bookkeeping.
        if let Err(e) = registry.save(&job) {
            tracing::warn!(error = %e, "could not record the checkpoint in the job");
        }
    }
    if args.json {
        let v = serde_json::json!({
            "image": report.image,
            "processes": report.processes,
            "devices_seconds": report.devices.as_secs_f64(),
            "dump_seconds": report.dump.as_secs_f64(),
            "total_seconds": report.total.as_secs_f64(),
            "image_bytes": report.image_bytes,
            "shared_bytes": report.shared_bytes,
            "parent": parent.filter(|_| report.shared_bytes > 0),
            "left_running": args.leave_running,
            "paused_seconds": report.paused.map(|d| d.as_secs_f64()),
            "criu_frozen_seconds": report.criu.map(|c| c.frozen.as_secs_f64()),
            "criu_memdump_seconds": report.criu.map(|c| c.memdump.as_secs_f64()),
            "criu_memwrite_seconds": report.criu.map(|c| c.memwrite.as_secs_f64()),
            "criu_memory_bytes": report.criu.map(|c| c.bytes_written),
            "criu_staged": report.criu_staged,
            "pause_steps": report.steps.iter().map(|(n, d)| serde_json::json!({"step": n, "seconds": d.as_secs_f64()})).collect::<Vec<_>>(),
        });
        println!("{v}");
    } else {
        let shared = match &parent {
            Some(p) if report.shared_bytes > 0 => format!(", {} of it shared with {}", human_bytes(report.shared_bytes), p.display()),
            _ => String::new(),
        };
        println!(
            "checkpointed {} process(es) to {} ({}{shared}) in {} (devices {}, dump {}){}",
            report.processes,
            report.image.display(),
            human_bytes(report.image_bytes),
            secs(report.total),
            secs(report.devices),
            secs(report.dump),
            match (args.leave_running, report.paused) {
                (true, Some(p)) => format!("; the application keeps running (paused {})", secs(p)),
                (true, None) => "; the application keeps running".to_string(),
                (false, _) => "; the application was stopped".to_string(),
            }
        );
    }
    Ok(())
}
