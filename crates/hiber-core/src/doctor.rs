//! `hiber doctor`: what this machine offers for checkpointing, checked for real.

use serde::Serialize;

use crate::criu::Criu;
use crate::engine::cuda;
use crate::state::StateDir;
use crate::sys;

const CAP_SYS_ADMIN: u32 = 21;
const CAP_CHECKPOINT_RESTORE: u32 = 40;

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
    /// A failed check that does not stop CPU checkpoints (no GPU, say).
    pub optional: bool,
}

fn effective_caps() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("CapEff:")).and_then(|v| u64::from_str_radix(v.trim(), 16).ok()))
        .unwrap_or(0)
}

pub fn run(state: &StateDir) -> Vec<Check> {
    let mut out = Vec::new();
    let (kernel, host) = sys::uname();
    out.push(Check { name: "kernel", ok: true, detail: format!("{kernel} on {host}"), optional: false });

    let caps = effective_caps();
    let root = sys::geteuid() == 0;
    let has = |c: u32| caps & (1 << c) != 0;
    out.push(Check {
        name: "privileges",
        ok: root || (has(CAP_CHECKPOINT_RESTORE) && has(CAP_SYS_ADMIN)),
        detail: format!(
            "{}; CAP_CHECKPOINT_RESTORE {}, CAP_SYS_ADMIN {}",
            if root { "root" } else { "not root" },
            if has(CAP_CHECKPOINT_RESTORE) { "yes" } else { "no" },
            if has(CAP_SYS_ADMIN) { "yes" } else { "no" }
        ),
        optional: false,
    });

    match Criu::locate() {
        Err(e) => out.push(Check { name: "criu", ok: false, detail: e.to_string(), optional: false }),
        Ok(criu) => {
            match criu.require_supported() {
                Ok(v) => out.push(Check { name: "criu", ok: true, detail: format!("{v} at {}", criu.path().display()), optional: false }),
                Err(e) => out.push(Check { name: "criu", ok: false, detail: format!("{e} ({})", criu.path().display()), optional: false }),
            }
            let dir = state.logs().join(format!("check-{}", std::process::id()));
            let checked = state.ensure(&dir).map_err(|e| e.to_string()).and_then(|_| criu.check(&dir).map_err(|e| e.to_string()));
            out.push(Check {
                name: "criu check",
                ok: checked.is_ok(),
                detail: match &checked {
                    Ok(()) => "looks good".into(),
                    Err(e) => format!("{e} (log kept in {})", dir.display()),
                },
                optional: false,
            });
            if checked.is_ok() {
                let _ = std::fs::remove_dir_all(&dir);
            }
            // CRIU archives a job's own /dev/shm (a tmpfs) with tar, and unpacks it on restore.
            let tar = criu.helper_tool("tar");
            out.push(Check {
                name: "tar",
                ok: tar.is_some(),
                detail: match tar {
                    Some(p) => format!("tar at {}", p.display()),
                    None => "tar is missing: CRIU needs it for the /dev/shm of each job (`hiber run --host-shm` jobs excepted)".into(),
                },
                optional: false,
            });
            let ip = criu.helper_tool("ip");
            out.push(Check {
                name: "iproute2",
                ok: ip.is_some(),
                detail: match ip {
                    Some(p) => format!("ip at {}", p.display()),
                    None => "ip is missing: jobs in a network namespace of their own (copies restored with --isolate-net) cannot be checkpointed".into(),
                },
                optional: true,
            });
        }
    }

    let gpu = cuda::probe();
    out.push(Check { name: "nvidia driver", ok: gpu.checkpoint_api, detail: gpu.summary(), optional: true });
    let (ok, detail) = crate::engine::opencl::probe();
    out.push(Check { name: "opencl", ok, detail, optional: true });
    if gpu.checkpoint_api {
        let (ok, detail) = host_staging();
        out.push(Check { name: "host staging", ok, detail, optional: true });
    }
    out
}

/// What a `--leave-running` checkpoint of a GPU without room for a copy can stage in host
/// memory, and whether huge pages make the staging area quick to make ready.
fn host_staging() -> (bool, String) {
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    let thp = thp.split_whitespace().find(|w| w.starts_with('[')).map(|w| w.trim_matches(['[', ']']).to_string()).unwrap_or_else(|| "absent".into());
    let huge = matches!(thp.as_str(), "always" | "madvise");
    let memory = match sys::host_memory() {
        Ok((available, total)) => format!("{} GiB of {} GiB available", available >> 30, total >> 30),
        Err(e) => format!("host memory unknown ({e})"),
    };
    let cgroup = sys::cgroup_memory_left().map(|b| format!(", the memory cgroup allows {} GiB more", b >> 30)).unwrap_or_default();
    let pages = if huge {
        format!("transparent huge pages: {thp}")
    } else {
        format!("transparent huge pages: {thp}, so the staging area takes 0.15-0.3 s per GiB to make ready instead of about 0.07")
    };
    (huge, format!("{memory}{cgroup}; {pages}"))
}
