//! `hiber run [--name NAME] -- CMD [ARGS...]`

use hiber_core::jobs::{Job, Registry};
use hiber_core::launch::{self, Started};
use hiber_core::proctree;
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
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

/// Starts `command` as a job: its own PID namespace and session, stdin from /dev/null,
/// stdout/stderr appended to the job's logs, a shim that records its exit.
pub fn start_job(registry: &Registry, name: Option<String>, command: Vec<String>, agent: bool) -> Result<Job, CliError> {
    if hiber_core::sys::geteuid() != 0 {
        return Err(CliError::new(ENVIRONMENT, "hiber run needs root: each job gets its own PID namespace").hint("run it with sudo"));
    }
    let base = std::path::Path::new(&command[0]).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "job".into());
    let name = name.unwrap_or_else(|| registry.free_name(&base));
    let dir = registry.create_dir(&name)?;
    let started = (|| {
        registry.open_logs(&name)?;
        let cwd = std::env::current_dir()?;
        let mut cmd =
            launch::Command::new(&command, &cwd, &registry.stdout_of(&name), &registry.stderr_of(&name)).map_err(|e| CliError::new(FAILED, e.to_string()))?;
        if agent {
            if let Some(env) = agent_env(&dir) {
                for (k, v) in env {
                    cmd = cmd.env(&k, &v).map_err(|e| CliError::new(FAILED, e.to_string()))?;
                }
            }
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
    let pid = match started {
        Ok(pid) => pid,
        Err(e) => {
            let _ = registry.remove(&name);
            return Err(e);
        }
    };
    let job = Job {
        name,
        pid,
        start_time: proctree::stat(pid).map(|s| s.start_time).unwrap_or(0),
        command,
        created: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        restored_from: None,
        checkpointed_to: None,
    };
    registry.save(&job)?;
    Ok(job)
}

/// The environment that preloads hiber's agent, on a machine with an NVIDIA GPU and with
/// the agent library beside the hiber binary (`HIBER_AGENT_LIB` overrides where).
fn agent_env(job_dir: &std::path::Path) -> Option<Vec<(String, String)>> {
    if !std::path::Path::new("/dev/nvidiactl").exists() {
        return None;
    }
    let lib = match std::env::var_os("HIBER_AGENT_LIB") {
        Some(p) => std::path::PathBuf::from(p),
        None => std::env::current_exe().ok()?.parent()?.join("libhiber_agent.so"),
    };
    if !lib.exists() {
        eprintln!("hiber: note: {} is missing; the job runs without the agent (GPU memory goes the driver's slower way)", lib.display());
        return None;
    }
    let mut token = [0u8; 8];
    std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut token)).ok()?;
    let token: String = token.iter().map(|b| format!("{b:02x}")).collect();
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", lib.display()),
        _ => lib.display().to_string(),
    };
    Some(vec![
        ("LD_PRELOAD".into(), preload),
        (hiber_wire::TOKEN_ENV.into(), token),
        (hiber_wire::LOG_ENV.into(), job_dir.join("agent.log").display().to_string()),
    ])
}

pub fn run(args: Args) -> Result<(), CliError> {
    let registry = Registry::new(&StateDir::from_env());
    let job = start_job(&registry, args.name, args.command, !args.no_agent)?;
    if args.quiet {
        println!("{}", job.name);
    } else {
        println!("started job {} (pid {}); logs: hiber logs {}", job.name, job.pid, job.name);
    }
    Ok(())
}
