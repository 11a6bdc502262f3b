//! Open MPI jobs on one host, started as users start them (`mpirun -np N PROGRAM` under
//! `hiber run`): mpirun and its ranks are one job, whose shared-memory transport, PMIx
//! sockets and session directory CRIU takes with it. The program (tests/fixtures/mpi_ring.c)
//! prints a trajectory that depends on every rank's state at every step; each restore must
//! go on from the step after its checkpoint, on the trajectory of an uninterrupted run.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{assert_continues, Hiber};

const RANKS: &str = "3";
const STEPS: &str = "150";

/// Builds tests/fixtures/mpi_ring.c with Open MPI's compiler wrapper.
fn ring(h: &Hiber) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mpi_ring.c");
    let out = h.scratch.join("mpi_ring");
    let st = Command::new("mpicc").args(["-O2", "-Wall", "-o"]).arg(&out).arg(&src).status().expect("run mpicc (scripts/setup.sh installs Open MPI)");
    assert!(st.success(), "mpicc mpi_ring.c failed");
    out
}

/// `mpirun` as root on a machine with fewer cores than ranks, as a user there would type it.
fn mpirun(bin: &Path, pause_ms: &str) -> Vec<String> {
    ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", RANKS, bin.to_str().unwrap(), STEPS, pause_ms].map(String::from).to_vec()
}

/// The uninterrupted trajectory, run outside hiber.
fn reference(bin: &Path) -> Vec<(u64, String)> {
    let args = mpirun(bin, "0");
    let out = Command::new(&args[0]).args(&args[1..]).output().expect("run mpirun");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("verify ok"), "the reference run failed: {}\n{}", text, String::from_utf8_lossy(&out.stderr));
    let p: Vec<(u64, String)> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 4 && f[0] == "step").then(|| (f[1].parse().unwrap(), f[3].to_string()))
        })
        .collect();
    assert_eq!(p.len(), STEPS.parse::<usize>().unwrap());
    p
}

fn run(h: &Hiber, name: &str, bin: &Path) {
    let mut args = vec!["run", "--name", name, "--"];
    let cmd = mpirun(bin, "40");
    args.extend(cmd.iter().map(String::as_str));
    h.ok(&args);
}

/// The processes of a job's image (mpirun and every rank).
fn processes(h: &Hiber, image: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(&h.ok(&["inspect", image, "--json"])).unwrap();
    v["manifest"]["processes"].as_array().map_or(0, |a| a.len() as u64)
}

/// Stopped, restored, stopped again and restored again (a job preempted twice): each copy
/// goes on from the step after its checkpoint and the whole run is the uninterrupted one.
#[test]
fn an_open_mpi_job_is_preempted_twice_and_finishes_on_its_trajectory() {
    let h = Hiber::new("mpi");
    let bin = ring(&h);
    let reference = reference(&bin);
    run(&h, "mpi", &bin);
    h.wait_step("mpi", 15);
    let first = h.images_dir().join("mpi-1");
    h.ok(&["checkpoint", "mpi", "--out", first.to_str().unwrap()]);
    assert_eq!(processes(&h, first.to_str().unwrap()), 1 + RANKS.parse::<u64>().unwrap(), "mpirun and its ranks are in the image");
    let at = h.last_step("mpi").unwrap();
    h.ok(&["restore", first.to_str().unwrap(), "--name", "mpi-r"]);
    h.wait_step("mpi-r", at + 15);
    let second = h.images_dir().join("mpi-2");
    h.ok(&["checkpoint", "mpi-r", "--out", second.to_str().unwrap()]);
    let at2 = h.last_step("mpi-r").unwrap();
    h.ok(&["restore", second.to_str().unwrap(), "--name", "mpi-r2"]);
    h.assert_verified("mpi-r2", Duration::from_secs(60));
    assert_continues(&reference, &h.progress("mpi"), 1);
    assert_continues(&reference, &h.progress("mpi-r"), at + 1);
    assert_continues(&reference, &h.progress("mpi-r2"), at2 + 1);
    assert_eq!(h.last_step("mpi-r2"), Some(STEPS.parse().unwrap()), "it ran to its last step");
}

/// `--leave-running`: the job pauses for the dump and goes on, on the uninterrupted
/// trajectory, to its end. A copy restored beside it is refused, saying why.
#[test]
fn an_open_mpi_job_runs_on_after_a_leave_running_checkpoint() {
    let h = Hiber::new("mpil");
    let bin = ring(&h);
    let reference = reference(&bin);
    run(&h, "mpil", &bin);
    h.wait_step("mpil", 15);
    let img = h.images_dir().join("mpil");
    let before = h.last_step("mpil").unwrap();
    h.ok(&["checkpoint", "mpil", "--leave-running", "--out", img.to_str().unwrap()]);
    let after = h.last_step("mpil").unwrap();
    // A copy beside the running original cannot have the terminals mpirun gave its ranks
    // (CRIU restores each under its number): refused with the reason, the original untouched.
    let f = h.fails(&["restore", img.to_str().unwrap(), "--name", "mpil-copy", "--isolate-net"]);
    assert!(f.stderr.contains("pseudo-terminal"), "the refusal says why: {}", f.stderr);
    h.assert_verified("mpil", Duration::from_secs(60));
    assert_continues(&reference, &h.progress("mpil"), 1);
    assert_eq!(h.last_step("mpil"), Some(STEPS.parse().unwrap()));
    // Once the original has ended (and mpirun removed what it kept on the host), the image
    // still restores: mpirun's session directory is in the job's /dev/shm, in the image.
    h.ok(&["restore", img.to_str().unwrap(), "--name", "mpil-later"]);
    h.assert_verified("mpil-later", Duration::from_secs(60));
    let later = h.progress("mpil-later");
    let first = later.first().map(|p| p.0).unwrap_or(0);
    assert!(first > before && first <= after + 1, "the copy goes on from the checkpoint (between steps {before} and {after}), not from {first}");
    assert_continues(&reference, &later, first);
}

/// Two Open MPI jobs started at once: every job's mpirun is PID 1 in its own PID namespace,
/// and Open MPI names its session directory after that PID. Both must start, run and end.
#[test]
fn two_open_mpi_jobs_start_side_by_side() {
    let h = Hiber::new("mpi2");
    let bin = ring(&h);
    let reference = reference(&bin);
    let names = ["mpi-a", "mpi-b", "mpi-c"];
    std::thread::scope(|s| {
        for name in names {
            let (h, bin) = (&h, &bin);
            s.spawn(move || run(h, name, bin));
        }
    });
    for name in names {
        h.assert_verified(name, Duration::from_secs(60));
        assert_continues(&reference, &h.progress(name), 1);
    }
}
