//! The `hiber` command: one file per verb under `commands/`, each turning its arguments
//! into a request for the core library.

mod cli_error;
mod commands;
mod opencl_proxy;
mod workload;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "hiber", version, about = "Checkpoint, restore and migrate (GPU) applications", long_about = None)]
struct Cli {
    /// Show the full error chain and debug logs.
    #[arg(short, long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a command as a job that can always be checkpointed and restored.
    Run(commands::run::Args),
    /// Checkpoint a job (or any process tree by PID) into an image.
    Checkpoint(commands::checkpoint::Args),
    /// Restore an image as a new, detached job.
    Restore(commands::restore::Args),
    /// List jobs and images with their state.
    Ls(commands::ls::Args),
    /// Show what an image holds, and verify every file of it.
    Inspect(commands::inspect::Args),
    /// Remove jobs (stopping them) or images.
    Rm(commands::rm::Args),
    /// Print a job's stdout and stderr.
    Logs(commands::logs::Args),
    /// Checkpoint, kill and restore a built-in workload, and report.
    Demo(commands::demo::Args),
    /// Check what this machine offers: CRIU, kernel, privileges, NVIDIA driver.
    Doctor(commands::doctor::Args),
    /// Hold several checkpoints or restores (hibers with --coordinator) at each phase until
    /// all reach it: one consistent cut across processes and hosts.
    Coordinate(commands::coordinate::Args),
    /// Move a running job to another host's `hiber serve`, over an encrypted connection.
    Migrate(commands::migrate::Args),
    /// Receive jobs that other hosts move here with `hiber migrate`.
    Serve(commands::serve::Args),
    /// Undo checkpoints that were interrupted (hiber killed mid-way).
    Recover,
    /// Built-in workloads used by `hiber demo` and the tests.
    #[command(hide = true)]
    Workload(workload::Args),
    /// A job's shim: hiber runs itself so, with a task on stdin (see hiber_core::launch).
    #[command(name = hiber_core::launch::SHIM_COMMAND, hide = true)]
    Shim,
    /// A job's OpenCL proxy (see opencl_proxy.rs).
    #[command(name = "__opencl-proxy", hide = true)]
    OpenclProxy(opencl_proxy::Args),
    /// A checkpoint's keeper of device memory (see hiber_core::keeper).
    #[command(name = hiber_core::keeper::KEEP_COMMAND, hide = true)]
    Keep { targets: Vec<String> },
}

fn main() {
    let cli = Cli::parse();
    if let Command::Shim = cli.command {
        // Before anything could start a thread: the shim forks.
        // SAFETY: this process was started by spawn_shim as `hiber __shim`, and nothing of
        // it owns a descriptor above 2 yet.
        std::process::exit(unsafe { hiber_core::launch::shim_main(std::io::stdin()) });
    }
    if let Command::Keep { targets } = &cli.command {
        // What the keeper inherited above stdio (hiber's own descriptors of the driver, say)
        // must not outlive hiber in it.
        // SAFETY: this process was started by Keeper::start as `hiber __keep`, and nothing of
        // it owns a descriptor above 2 yet.
        unsafe { hiber_core::sys::close_from_except(3, &[]) };
        std::process::exit(hiber_core::keeper::main(targets));
    }
    if let Command::OpenclProxy(a) = cli.command {
        std::process::exit(opencl_proxy::main(a));
    }
    let filter = if cli.verbose { "debug" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("HIBER_LOG").unwrap_or_else(|_| filter.into()))
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .init();
    let result = match cli.command {
        Command::Workload(a) => workload::run(a),
        Command::Recover => commands::recover::run(),
        other => {
            commands::recover::recover_stale_quietly();
            match other {
                Command::Run(a) => commands::run::run(a),
                Command::Checkpoint(a) => commands::checkpoint::run(a),
                Command::Restore(a) => commands::restore::run(a),
                Command::Ls(a) => {
                    end_quietly_on_a_closed_pipe();
                    commands::ls::run(a)
                }
                Command::Inspect(a) => {
                    end_quietly_on_a_closed_pipe();
                    commands::inspect::run(a)
                }
                Command::Rm(a) => commands::rm::run(a),
                Command::Logs(a) => {
                    end_quietly_on_a_closed_pipe();
                    commands::logs::run(a)
                }
                Command::Demo(a) => commands::demo::run(a),
                Command::Doctor(a) => commands::doctor::run(a),
                Command::Coordinate(a) => commands::coordinate::run(a),
                Command::Migrate(a) => commands::migrate::run(a),
                Command::Serve(a) => commands::serve::run(a),
                Command::Recover | Command::Workload(_) | Command::Shim | Command::Keep { .. } | Command::OpenclProxy(_) => unreachable!("handled above"),
            }
        }
    };
    if let Err(e) = result {
        e.report(cli.verbose);
        std::process::exit(e.code);
    }
}

/// For verbs that only print (`ls`, `inspect`, `logs`): a reader that goes away (`hiber ls |
/// head`) ends hiber as it ends other tools, by SIGPIPE, instead of a panic in `println!`.
/// Not for verbs that talk to CRIU or a job's shim, whose end going away must be an error.
fn end_quietly_on_a_closed_pipe() {
    let _ = hiber_core::sys::default_sigpipe();
}
