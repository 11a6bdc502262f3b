//! `hiber demo`: the whole story on a built-in workload. Start it, checkpoint it mid-run
//! (which stops it), restore the image, and show that it went on from where it stopped and
//! that its own end-to-end check of its state passes.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use hiber_core::checkpoint::{checkpoint, CheckpointRequest};
use hiber_core::engine::DeviceRestoreOptions;
use hiber_core::jobs::{Job, JobState, Registry};
use hiber_core::restore::{restore, RestoreRequest};

use super::run::{start_job, JobOptions};
use super::{context, human_bytes, secs};
use crate::cli_error::{CliError, FAILED};
use crate::workload::{progress_of, verdict_of};

#[derive(clap::Args)]
pub struct Args {
    /// Memory the workload holds, in MiB (default: 1024 of device memory with a GPU, 256
    /// of host memory without).
    #[arg(long)]
    mem_mib: Option<u64>,
    /// Run the CPU workload even where a GPU is present.
    #[arg(long)]
    cpu: bool,
    /// Steps the workload runs in all (it is checkpointed a third of the way through).
    #[arg(long, default_value_t = 150)]
    steps: u64,
    /// Keep the image and the jobs afterwards (they are removed by default).
    #[arg(long)]
    keep: bool,
}

fn read_log(registry: &Registry, job: &str) -> String {
    std::fs::read_to_string(registry.stdout_of(job)).unwrap_or_default()
}

fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Result<(), CliError> {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() > limit {
            return Err(CliError::new(FAILED, format!("demo: timed out waiting for {what}")));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

pub fn run(args: Args) -> Result<(), CliError> {
    let ctx = context()?;
    let registry = Registry::new(&ctx.state);
    let exe = std::env::current_exe()?.display().to_string();
    let steps = args.steps.max(30);
    // A GPU here: the driver engine loaded (the OpenCL engine loads everywhere).
    let gpu_here = ctx.engines.iter().any(|e| e.name() == hiber_core::engine::cuda::ENGINE);
    let gpu = !args.cpu && gpu_here;
    let (kind, mem_mib) = if gpu { ("gpu", args.mem_mib.unwrap_or(1024)) } else { ("cpu", args.mem_mib.unwrap_or(256)) };
    let command: Vec<String> =
        [exe.as_str(), "workload", kind, "--steps", &steps.to_string(), "--interval-ms", "20", "--mem-mib", &mem_mib.to_string()].map(String::from).to_vec();
    if gpu {
        println!("hiber demo: a GPU workload holding {mem_mib} MiB of device memory that checks its own state (kernels JIT-compiled from embedded PTX)");
    } else {
        println!("hiber demo: a CPU workload holding {mem_mib} MiB that checks its own state ({})", if gpu_here { "--cpu" } else { "no GPU here" });
    }

    let job = start_job(
        &registry,
        Some(registry.free_name("demo")),
        command,
        JobOptions {
            agent: true,
            opencl: Some(hiber_core::engine::opencl::default_mode()),
            allow_io_uring: false,
            host_shm: false,
            host_ipc: false,
            host_pts: false,
        },
    )?;
    println!("  started job {} (pid {})", job.name, job.pid);
    let at = steps / 3;
    wait_until("the workload to make progress", Duration::from_secs(120), || {
        progress_of(&read_log(&registry, &job.name)).last().is_some_and(|p| p.step >= at)
    })?;

    let image: PathBuf = ctx.state.images().join(format!("{}-image", job.name));
    let req =
        CheckpointRequest { pid: job.pid, job: Some(job.clone()), dest: image.clone(), leave_running: false, parent: None, compress: None, transient: false };
    let result = run_demo(&ctx, &registry, &job, &req, steps);
    if !args.keep {
        let _ = std::fs::remove_dir_all(&image);
        for j in registry.list().into_iter().filter(|j| j.name == job.name || j.restored_from.as_deref() == Some(&image.display().to_string())) {
            if registry.state(&j) == JobState::Running {
                let _ = hiber_core::sys::kill(j.pid, libc::SIGKILL);
            }
            let _ = registry.remove(&j.name);
        }
    } else {
        println!("  kept: image {} and its jobs (`hiber ls`)", image.display());
    }
    result
}

fn run_demo(ctx: &hiber_core::Context, registry: &Registry, job: &Job, req: &CheckpointRequest, steps: u64) -> Result<(), CliError> {
    let report = checkpoint(ctx, req)?;
    let mut job = job.clone();
    job.checkpointed(&report.image, false);
    registry.save(&job)?;
    let before = progress_of(&read_log(registry, &job.name));
    let last_before = before.last().map(|p| p.step).unwrap_or(0);
    wait_until("the original to stop", Duration::from_secs(10), || registry.state(&job) != JobState::Running)?;
    println!(
        "  checkpointed after step {last_before}: {} in all, application frozen {}, image {}",
        secs(report.total),
        secs(report.dump),
        human_bytes(report.image_bytes)
    );
    println!("  the original is stopped; restoring the image");

    let restored = restore(
        ctx,
        &RestoreRequest {
            image: report.image.clone(),
            name: Some(format!("{}-restored", job.name)),
            devices: DeviceRestoreOptions::default(),
            isolate_net: false,
            trust_image: false,
            hold_stopped: false,
        },
    )?;
    println!("  restored as job {} (pid {}) in {}", restored.job.name, restored.job.pid, secs(restored.total));
    wait_until("the restored workload to finish", Duration::from_secs(steps / 10 + 120), || registry.state(&restored.job) != JobState::Running)?;
    let log = read_log(registry, &restored.job.name);
    let after = progress_of(&log);
    let first_after = after.first().map(|p| p.step);
    let resumed_in_place = first_after == Some(last_before + 1);
    let finished = after.last().map(|p| p.step + 1) == Some(steps);
    let verified = verdict_of(&log) == Some(true);
    println!(
        "  resumed at step {} (expected {}), ran to step {} of {}",
        first_after.map(|s| s.to_string()).unwrap_or_else(|| "none".into()),
        last_before + 1,
        after.last().map(|p| p.step).unwrap_or(0),
        steps - 1
    );
    println!("  the workload recomputed every word of its memory from scratch and compared: {}", if verified { "identical" } else { "MISMATCH" });
    if resumed_in_place && finished && verified {
        println!("demo passed: checkpoint {}, restore {}, image {}", secs(report.total), secs(restored.total), human_bytes(report.image_bytes));
        Ok(())
    } else {
        Err(CliError::new(FAILED, "demo failed: the restored workload did not continue with its state intact")
            .hint(format!("see `hiber logs {}`", restored.job.name)))
    }
}
