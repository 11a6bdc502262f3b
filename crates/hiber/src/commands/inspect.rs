//! `hiber inspect IMAGE`: what an image holds, and whether every file of it is intact.

use std::time::Instant;

use hiber_core::engine;
use hiber_core::image::Image;
use hiber_core::state::StateDir;

use super::{human_bytes, image_path};
use crate::cli_error::CliError;

#[derive(clap::Args)]
pub struct Args {
    /// The image directory (or its name under the state directory's images/).
    image: String,
    /// Print the manifest and the verification result as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<(), CliError> {
    let state = StateDir::from_env();
    let img = Image::open(&image_path(&state, &args.image))?;
    let start = Instant::now();
    let verified = img.verify();
    let elapsed = start.elapsed();
    if args.json {
        let v = serde_json::json!({
            "manifest": img.manifest,
            "verified": verified.is_ok(),
            "error": verified.as_ref().err().map(|e| e.to_string()),
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("serializes"));
        verified?;
        return Ok(());
    }
    let m = &img.manifest;
    println!("image       {}", img.dir.display());
    println!("format      {} (hiber {})", m.format, m.hiber_version);
    println!("created     {} on {} (kernel {}, CRIU {})", m.created, m.host, m.kernel, m.criu_version);
    let src = m.source.job.as_ref().map(|j| format!("job {j}")).unwrap_or_else(|| "a process not started by hiber".into());
    println!("source      {src}, root pid {}{}", m.source.pid, if m.source.leave_running { ", left running" } else { "" });
    println!("frozen      {:.2}s during the dump", m.frozen_seconds);
    let compressed: Vec<_> = m.files.iter().filter(|f| f.encoding.is_some()).collect();
    if !compressed.is_empty() {
        println!("compressed  {} device data chunks with zstd, {} stored", compressed.len(), human_bytes(compressed.iter().map(|f| f.size).sum()));
    }
    if let Some(p) = &m.parent {
        println!("parent      {} ({} in {} files shared with it)", p.path, human_bytes(p.shared_bytes), p.shared_files);
    }
    println!("size        {} in {} files, {} of process memory", human_bytes(img.total_bytes()), m.files.len(), human_bytes(img.memory_bytes()));
    println!("processes   {}", m.processes.len());
    for p in &m.processes {
        let cmd = if p.cmdline.is_empty() { p.comm.clone() } else { p.cmdline.join(" ") };
        println!("  pid {:<6} threads {:<3} rss {:>10}  {}", p.ns_pid, p.threads, human_bytes(p.rss_bytes), cmd);
        for f in p.fds.iter().filter(|f| f.is_path()) {
            let size = f.size.map(|s| format!(" ({})", human_bytes(s))).unwrap_or_default();
            println!("      fd {:<3} {}{size}", f.fd, f.target);
        }
    }
    if m.devices.is_empty() {
        println!("devices     none (CPU only)");
    }
    for d in &m.devices {
        println!("devices     {} (section version {})", d.engine, d.version);
        let lines = match engine::kind(&d.engine) {
            Some(kind) => kind.describe(&d.state),
            None => vec![format!("(an engine this hiber does not know: {})", d.state)],
        };
        for l in lines {
            println!("  {l}");
        }
    }
    match verified {
        Ok(bytes) => {
            println!("verified    all {} files, {} checksummed in {:.2}s", m.files.len(), human_bytes(bytes), elapsed.as_secs_f64());
            Ok(())
        }
        Err(e) => {
            println!("verified    FAILED");
            Err(e.into())
        }
    }
}
