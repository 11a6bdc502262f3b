//! `hiber run [--name NAME] -- CMD [ARGS...]`

use std::os::fd::AsRawFd;

use hiber_core::jobs::{Job, Registry};
use hiber_core::launch::{self, Started};
use hiber_core::state::StateDir;

use crate::cli_error::{CliError, ENVIRONMENT, FAILED};

#[derive(clap::Args)]
pub struct Args {
    /// Job name (default: the command's name and a number).
    #[arg(long)]
    name: Option<String>,
    /// Print only the job name.
    #[arg(short, long)]
    quiet: bool,
    /// Do not preload hiber's agent into the job: GPU memory is then checkpointed by the
    /// driver alone (slower; see the README).
    #[arg(long)]
    no_agent: bool,
    /// How the job's OpenCL calls reach the platform: `proxy` (every call goes to a proxy
    /// process beside the job, which alone loads the vendor's library: needed for platforms
    /// that keep device files open, NVIDIA's), `inline` (the layer in the job calls the
    /// platform itself: no round trip), `off` (no layer: CRIU alone, CPU platforms on the
    /// same device only). Default: proxy where such a platform is registered, else inline.
    #[arg(long, value_name = "MODE", value_parser = ["auto", "proxy", "inline", "off"], default_value = "auto")]
    opencl: String,
    /// The same as `--opencl=off`.
    #[arg(long, conflicts_with = "opencl")]
    no_opencl: bool,
    /// Let the job use io_uring. hiber otherwise keeps its jobs off it (the kernel answers
    /// ENOSYS, as without io_uring, and programs fall back), because CRIU cannot checkpoint
    /// an io_uring: a job that holds one cannot be checkpointed.
    #[arg(long)]
    allow_io_uring: bool,
    /// Leave the job the host's /dev/shm. hiber otherwise gives each job a /dev/shm of its
    /// own (a tmpfs as large as the host's), which its images carry: named semaphores, as
    /// Python's spawned processes share, can be checkpointed only from there, and copies
    /// restored side by side each get their own.
    #[arg(long)]
    host_shm: bool,
    /// Leave the job the host's IPC namespace. hiber otherwise gives each job one of its
    /// own, as containers have: CRIU can checkpoint SysV shared memory, semaphores and
    /// message queues only there, and restored copies each get their own.
    #[arg(long)]
    host_ipc: bool,
    /// Leave the job the host's /dev/pts. hiber otherwise gives each job one of its own, as
    /// containers have: CRIU restores a terminal under its old number (mpirun gives one to
    /// each rank), which on the host another program may have taken since; and copies
    /// restored side by side each get their own. With it, the job cannot open the host's
    /// terminals by path.
    #[arg(long)]
    host_pts: bool,
    /// The command and its arguments.
    // No `allow_hyphen_values`: a mistyped option of hiber's before the command is refused
    // as unknown rather than run as the command; the command's own options after its name
    // still pass (trailing_var_arg).
    #[arg(required = true, trailing_var_arg = true)]
    command: Vec<String>,
}

/// Starts `command` as a job: its own PID namespace and session, stdin from /dev/null,
/// stdout/stderr appended to the job's logs, a shim that records its exit.
/// How `hiber run` starts a job.
#[derive(Debug, Clone, Copy)]
pub struct JobOptions {
    /// Preload the agent.
    pub agent: bool,
    /// Preload the OpenCL layer, and how it reaches the platform; `None`: no layer.
    pub opencl: Option<hiber_core::engine::opencl::Mode>,
    pub allow_io_uring: bool,
    pub host_shm: bool,
    pub host_ipc: bool,
    pub host_pts: bool,
}

/// Open MPI 4's setting for where mpirun makes its session directory (else `$TMPDIR`, or
/// `/tmp`).
const OMPI_SESSION_DIR_ENV: &str = "OMPI_MCA_orte_tmpdir_base";

pub fn start_job(registry: &Registry, name: Option<String>, command: Vec<String>, opts: JobOptions) -> Result<Job, CliError> {
    if hiber_core::sys::geteuid() != 0 {
        return Err(CliError::new(ENVIRONMENT, "hiber run needs root: each job gets its own PID namespace").hint("run it with sudo"));
    }
    let base = std::path::Path::new(&command[0]).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "job".into());
    let name = name.unwrap_or_else(|| registry.free_name(&base));
    // The start's lock: held by this hiber, then by the job's shim too, so that the name
    // is only ever reclaimed from a start that both left before the job was recorded.
    let (dir, start_lock) = registry.create_dir(&name)?;
    pause_for_tests("run-reserved");
    let started = (|| {
        registry.open_logs(&name)?;
        let cwd = std::env::current_dir()?;
        let cmd =
            launch::Command::new(&command, &cwd, &registry.stdout_of(&name), &registry.stderr_of(&name)).map_err(|e| CliError::new(FAILED, e.to_string()))?;
        // Out of the PID namespaces whose numbers images of this machine will need again
        // (see `launch::Command::avoid_pid_namespaces`).
        let mut cmd = cmd
            .allow_io_uring(opts.allow_io_uring)
            .host_shm(opts.host_shm)
            .host_ipc(opts.host_ipc)
            .host_pts(opts.host_pts)
            .avoid_pid_namespaces(hiber_core::image::recorded_cuda_namespaces())
            .hold(start_lock.as_raw_fd());
        // What the device engines prepare for a job: the agent's preload, say.
        let mut skip = Vec::new();
        if !opts.agent {
            skip.push(hiber_core::engine::agent::ENGINE);
        }
        if opts.opencl.is_none() {
            skip.push(hiber_core::engine::opencl::ENGINE);
        }
        // Open MPI names its session directory after mpirun's PID, which is 1 in every job's
        // PID namespace: two jobs' mpiruns would share /tmp/ompi.HOST.UID/pid.1 and break
        // each other's start. In the job's own /dev/shm it is the job's, and goes into its
        // image (so an image restores once the original has ended and removed its own).
        if !opts.host_shm && std::env::var_os(OMPI_SESSION_DIR_ENV).is_none() {
            cmd = cmd.env(OMPI_SESSION_DIR_ENV, "/dev/shm").map_err(|e| CliError::new(FAILED, e.to_string()))?;
        }
        let env = hiber_core::engine::launch_env(&dir, &skip);
        let layered = env.iter().any(|(k, _)| k == hiber_wire::opencl::TOKEN_ENV);
        for (k, v) in env {
            cmd = cmd.env(&k, &v).map_err(|e| CliError::new(FAILED, e.to_string()))?;
        }
        // Proxy mode: the job's proxy listens before the job starts.
        if layered && opts.opencl == Some(hiber_core::engine::opencl::Mode::Proxy) {
            let sock = hiber_core::engine::opencl::start_proxy(&dir)
                .map_err(|e| CliError::new(FAILED, format!("cannot start the job's OpenCL proxy: {e}")).hint("run it with --opencl=inline"))?;
            cmd = cmd.env(hiber_wire::opencl::PROXY_ENV, &sock.display().to_string()).map_err(|e| CliError::new(FAILED, e.to_string()))?;
        }
        match launch::spawn_shim(&dir, &launch::ShimTask::Run(cmd)) {
            Ok(Started::Running { pid }) => Ok(pid),
            Ok(Started::Failed { message, hint, .. }) => {
                let e = CliError::new(FAILED, message);
                Err(match hint {
                    Some(h) => e.hint(h),
                    None => e,
                })
            }
            Err(e) => Err(CliError::new(FAILED, e.to_string())),
        }
    })();
    if let Err(e) = started {
        // A job the shim recorded runs, whatever hiber heard: it stays, as a job.
        if !registry.has_record(&name) {
            let _ = registry.remove(&name);
        }
        return Err(e);
    }
    // The job's shim recorded it (and ended its start) before it reported it started.
    pause_for_tests("run-started");
    Ok(registry.load(&name)?)
}

/// Fault injection for tests of a killed `hiber run`: `HIBER_PAUSE_AT=run-reserved` holds
/// it once the job's name is taken, `run-started` once the job runs, until it is killed.
fn pause_for_tests(at: &str) {
    if std::env::var("HIBER_PAUSE_AT").is_ok_and(|v| v == at) {
        eprintln!("hiber: paused at {at} (HIBER_PAUSE_AT)");
        loop {
            std::thread::park();
        }
    }
}

fn opencl_mode(args: &Args) -> Option<hiber_core::engine::opencl::Mode> {
    use hiber_core::engine::opencl::{default_mode, Mode};
    match args.opencl.as_str() {
        _ if args.no_opencl => None,
        "off" => None,
        "proxy" => Some(Mode::Proxy),
        "inline" => Some(Mode::Inline),
        _ => Some(default_mode()),
    }
}

pub fn run(args: Args) -> Result<(), CliError> {
    let registry = Registry::new(&StateDir::from_env());
    let opencl = opencl_mode(&args);
    let job = start_job(
        &registry,
        args.name,
        args.command,
        JobOptions {
            agent: !args.no_agent,
            opencl,
            allow_io_uring: args.allow_io_uring,
            host_shm: args.host_shm,
            host_ipc: args.host_ipc,
            host_pts: args.host_pts,
        },
    )?;
    if args.quiet {
        println!("{}", job.name);
    } else {
        println!("started job {} (pid {}); logs: hiber logs {}", job.name, job.pid, job.name);
    }
    Ok(())
}
