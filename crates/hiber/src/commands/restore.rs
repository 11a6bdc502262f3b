//! `hiber restore IMAGE [--name NAME] [--gpu-map OLD=NEW,...]`

use hiber_core::engine::cuda::parse_gpu_map;
use hiber_core::engine::DeviceRestoreOptions;
use hiber_core::restore::{restore_with, RestoreRequest};

use super::{context, image_path, secs};
use crate::cli_error::{CliError, FAILED};

#[derive(clap::Args)]
pub struct Args {
    /// The image directory (or its name under the state directory's images/).
    image: String,
    /// Name of the new job (default: the original job's name and a number).
    #[arg(long)]
    name: Option<String>,
    /// Restore onto other GPUs of the same type: OLD=NEW[,...], UUIDs or indices (the
    /// image's on the left, this machine's on the right).
    #[arg(long, value_name = "OLD=NEW,...")]
    gpu_map: Option<String>,
    /// Re-create the job's OpenCL objects on another device: `cpu`, `gpu` (the first of
    /// that type) or PLATFORM:DEVICE, numbered as `clinfo -l` lists them. Without it each
    /// process gets the device it had.
    #[arg(long, value_name = "DEVICE")]
    opencl_device: Option<String>,
    /// Restore into a new network namespace with only loopback, so a copy does not clash
    /// with the sockets of an original that still runs.
    #[arg(long)]
    isolate_net: bool,
    /// Hold at each phase until every participant of `hiber coordinate`'s session at ADDR
    /// reached it (the token in $HIBER_SESSION): restore several jobs or hosts as one.
    #[arg(long, value_name = "ADDR")]
    coordinator: Option<String>,
    /// Restore an image that another user could have written (hiber otherwise refuses
    /// one that is not root's alone, as sshd refuses keys others can write): it is copied
    /// into a private directory, and the copy is verified and restored. Use it only for an
    /// image whose writer you trust: a restore runs what the image holds as root.
    #[arg(long)]
    trust_image: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<(), CliError> {
    let mut ctx = context()?;
    let progress = super::show_progress(&mut ctx, args.json);
    let gpu_map = match &args.gpu_map {
        Some(s) => parse_gpu_map(s).map_err(|e| CliError::new(FAILED, format!("--gpu-map: {e}")).hint("write it as OLD=NEW[,OLD=NEW...]"))?,
        None => Vec::new(),
    };
    let req = RestoreRequest {
        image: image_path(&ctx.state, &args.image),
        name: args.name,
        devices: DeviceRestoreOptions { gpu_map, opencl_device: args.opencl_device, ..Default::default() },
        isolate_net: args.isolate_net,
        trust_image: args.trust_image,
        hold_stopped: false,
    };
    let coord = super::coordinator(args.coordinator.as_deref(), &args.image)?;
    let report = restore_with(&ctx, &req, coord.as_ref());
    if let Some(p) = progress {
        p.finish_and_clear();
    }
    let report = report?;
    if args.json {
        let v = serde_json::json!({
            "job": report.job.name,
            "pid": report.job.pid,
            "verify_seconds": report.verify.as_secs_f64(),
            "criu_seconds": report.criu.as_secs_f64(),
            "devices_seconds": report.devices.as_secs_f64(),
            "total_seconds": report.total.as_secs_f64(),
        });
        println!("{v}");
    } else {
        println!(
            "restored job {} (pid {}) in {} (verify {}, criu {}, devices {}); logs: hiber logs {}",
            report.job.name,
            report.job.pid,
            secs(report.total),
            secs(report.verify),
            secs(report.criu),
            secs(report.devices),
            report.job.name
        );
    }
    Ok(())
}
