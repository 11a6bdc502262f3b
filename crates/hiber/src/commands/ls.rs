//! `hiber ls`: jobs and images, with their state.

use std::fs;

use hiber_core::image::{is_temp_name, Image};
use hiber_core::jobs::{JobState, Registry};
use hiber_core::proctree;
use hiber_core::state::StateDir;

use super::human_bytes;
use crate::cli_error::CliError;

#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<(), CliError> {
    let state = StateDir::from_env();
    let registry = Registry::new(&state);
    let (listed, unreadable) = registry.list_and_unreadable();
    // Said once, on stderr (the listing itself stays machine-readable).
    for (path, why) in &unreadable {
        eprintln!("hiber: skipped {}: {why}", path.display());
    }
    let jobs: Vec<_> = listed
        .into_iter()
        .map(|j| {
            let s = registry.state(&j);
            (j, s)
        })
        .collect();
    let mut images = Vec::new();
    if let Ok(dir) = fs::read_dir(state.images()) {
        for e in dir.filter_map(Result::ok) {
            let name = e.file_name().to_string_lossy().into_owned();
            if is_temp_name(&name) {
                continue;
            }
            images.push((name, Image::open(&e.path())));
        }
    }
    images.sort_by(|a, b| a.0.cmp(&b.0));

    if args.json {
        let jobs: Vec<_> = jobs
            .iter()
            // PID 0: a restore whose tree CRIU has not restored yet.
            .map(|(j, s)| serde_json::json!({"name": j.name, "state": s.to_string(), "pid": (j.pid > 0).then_some(j.pid), "command": j.command, "restored_from": j.restored_from, "checkpointed_to": j.checkpointed_to, "problem": broken(&registry, j, s)}))
            .collect();
        let images: Vec<_> = images
            .iter()
            .map(|(n, i)| match i {
                Ok(i) => serde_json::json!({"name": n, "path": i.dir, "created": i.manifest.created, "bytes": i.total_bytes(), "processes": i.manifest.processes.len(), "job": i.manifest.source.job,
                    "parent": i.manifest.parent.as_ref().map(|p| &p.path), "shared_bytes": i.manifest.parent.as_ref().map_or(0, |p| p.shared_bytes), "valid": true}),
                Err(e) => serde_json::json!({"name": n, "valid": false, "error": e.to_string()}),
            })
            .collect();
        println!("{}", serde_json::json!({"state_dir": state.root(), "jobs": jobs, "images": images}));
        return Ok(());
    }
    println!("JOBS ({})", state.jobs().display());
    if jobs.is_empty() {
        println!("  (none)");
    } else {
        println!("  {:<20} {:<19} {:>8}  COMMAND", "NAME", "STATE", "PID");
        for (j, s) in &jobs {
            let mut cmd = j.command.join(" ");
            if cmd.len() > 60 {
                cmd.truncate(57);
                cmd.push_str("...");
            }
            let mut from = j.restored_from.as_ref().map(|r| format!("  (restored from {r})")).unwrap_or_default();
            if let Some(why) = broken(&registry, j, s) {
                from.push_str(&format!("  (broken: {why})"));
            }
            // The tree of an interrupted restore may run too.
            let runs = *s == JobState::Running || (*s == JobState::InterruptedRestore && j.pid > 0 && proctree::is_same_process(j.pid, j.start_time));
            let pid = if runs { j.pid.to_string() } else { "-".into() };
            println!("  {:<20} {:<19} {:>8}  {cmd}{from}", j.name, s.to_string(), pid);
        }
        if jobs.iter().any(|(_, s)| *s == JobState::InterruptedRestore) {
            println!("  (an interrupted restore is left by a hiber that was killed: `hiber recover` adopts or removes it)");
        }
    }
    println!("IMAGES ({})", state.images().display());
    if images.is_empty() {
        println!("  (none)");
    } else {
        println!("  {:<40} {:<22} {:>10} {:>6}  SOURCE", "NAME", "CREATED", "SIZE", "PROCS");
        for (n, i) in &images {
            match i {
                Ok(i) => {
                    let src = i.manifest.source.job.clone().unwrap_or_else(|| format!("pid {}", i.manifest.source.pid));
                    let gpu = if i.manifest.devices.is_empty() { "" } else { " +gpu" };
                    // Files shared with a parent are counted in both images' sizes.
                    let shared = i
                        .manifest
                        .parent
                        .as_ref()
                        .map(|p| {
                            let parent = std::path::Path::new(&p.path).file_name().map_or(p.path.clone(), |f| f.to_string_lossy().into_owned());
                            format!(" ({} shared with {parent})", human_bytes(p.shared_bytes))
                        })
                        .unwrap_or_default();
                    println!(
                        "  {:<40} {:<22} {:>10} {:>6}  {src}{gpu}{shared}",
                        n,
                        i.manifest.created,
                        human_bytes(i.total_bytes()),
                        i.manifest.processes.len()
                    );
                }
                Err(e) => println!("  {n:<40} invalid: {e}"),
            }
        }
    }
    Ok(())
}

/// A running job that cannot go on as it should, and why: its OpenCL proxy died.
fn broken(registry: &Registry, job: &hiber_core::jobs::Job, state: &JobState) -> Option<String> {
    (*state == JobState::Running).then(|| hiber_core::engine::opencl::proxy_problem(&registry.dir_of(&job.name))).flatten()
}
