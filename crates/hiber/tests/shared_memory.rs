//! Memory that processes of a job share through the kernel's IPC: SysV shared memory,
//! semaphores and message queues, which CRIU takes only with an IPC namespace of the job's
//! own; and POSIX shared memory in the job's own /dev/shm, which a restore must not look
//! for on the host. The program (tests/fixtures/ipc.c) checks its shared state at every
//! tick: a restore that lost any of it shows as a BAD line, a hang, or a restart at 1.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{wait, Hiber};

/// The tick numbers a job printed, each checked: every line `ok`, consecutive.
fn ticks(h: &Hiber, job: &str) -> Vec<u64> {
    let log = h.log(job);
    let lines: Vec<&str> = log.lines().filter(|l| l.starts_with("tick ")).collect();
    if let Some(bad) = lines.iter().find(|l| !l.ends_with(" ok")) {
        panic!("{job}: its shared state is wrong: {bad}");
    }
    let n: Vec<u64> = lines.iter().map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap()).collect();
    for w in n.windows(2) {
        assert_eq!(w[1], w[0] + 1, "{job}: ticks must be consecutive");
    }
    n
}

fn wait_ticks(h: &Hiber, job: &str, at_least: usize) {
    wait(&format!("{job} to tick {at_least} times"), Duration::from_secs(30), || ticks(h, job).len() >= at_least);
}

/// A copy restored from an image taken at tick `at` goes on from there (not from 1), with
/// its shared state right.
fn assert_goes_on(h: &Hiber, copy: &str, at: u64) {
    wait_ticks(h, copy, 20);
    let first = ticks(h, copy)[0];
    assert!(first > 5 && first <= at + 1, "{copy} goes on from the checkpoint (tick {at}), not from the start: its first tick is {first}");
}

/// SysV shared memory, a semaphore and a message queue, shared by a parent and its child:
/// the job's IPC namespace goes into the image, the original runs on (`--leave-running`),
/// and two copies restored side by side each get their own.
#[test]
fn sysv_ipc_is_checkpointed_with_the_job_s_own_namespace() {
    let h = Hiber::new("sysv");
    let bin = h.build_fixture("cc", "ipc");
    h.ok(&["run", "--name", "sysv", "--", bin.to_str().unwrap(), "sysv", "x"]);
    wait_ticks(&h, "sysv", 10);
    let img = h.images_dir().join("sysv");
    h.ok(&["checkpoint", "sysv", "--leave-running", "--out", img.to_str().unwrap()]);
    let at = *ticks(&h, "sysv").last().unwrap();
    wait_ticks(&h, "sysv", at as usize + 10);
    for copy in ["sysv-a", "sysv-b"] {
        h.ok(&["restore", img.to_str().unwrap(), "--name", copy]);
    }
    for copy in ["sysv-a", "sysv-b"] {
        assert_goes_on(&h, copy, at);
    }
    // The original, beside them, is undisturbed.
    let now = ticks(&h, "sysv").len();
    wait_ticks(&h, "sysv", now + 10);
    // A copy restored from a copy's stopping checkpoint: the preemption loop.
    let again = h.images_dir().join("sysv-again");
    h.ok(&["checkpoint", "sysv-a", "--out", again.to_str().unwrap()]);
    let at = *ticks(&h, "sysv-a").last().unwrap();
    h.ok(&["restore", again.to_str().unwrap(), "--name", "sysv-c"]);
    wait_ticks(&h, "sysv-c", 20);
    assert_eq!(ticks(&h, "sysv-c")[0], at + 1, "the second restore goes on from the tick after its checkpoint");
}

/// A job left the host's IPC namespace (`--host-ipc`) that holds SysV shared memory is
/// refused before anything is stopped, with the reason and the way out; it runs on.
#[test]
fn sysv_ipc_in_the_host_namespace_is_refused_up_front() {
    let h = Hiber::new("sysv-host");
    let bin = h.build_fixture("cc", "ipc");
    h.ok(&["run", "--name", "sysvh", "--host-ipc", "--", bin.to_str().unwrap(), "sysv", "x"]);
    wait_ticks(&h, "sysvh", 5);
    let f = h.fails(&["checkpoint", "sysvh"]);
    assert!(f.stderr.contains("SysV shared memory") && f.stderr.contains("hint:") && f.stderr.contains("--host-ipc"), "{}", f.stderr);
    let now = ticks(&h, "sysvh").len();
    wait_ticks(&h, "sysvh", now + 5);
}

/// POSIX shared memory in the job's own /dev/shm, its descriptor open: restored although
/// the host has no file of that name (the check of open files once looked there), and the
/// copy's shared state is right.
#[test]
fn posix_shared_memory_restores_without_a_file_on_the_host() {
    let h = Hiber::new("posix");
    let bin = h.build_fixture("cc", "ipc");
    let name = format!("hiber-e2e-posix-{}", std::process::id());
    let on_host = Path::new("/dev/shm").join(&name);
    let _ = std::fs::remove_file(&on_host);
    h.ok(&["run", "--name", "posix", "--", bin.to_str().unwrap(), "posix", &name]);
    wait_ticks(&h, "posix", 10);
    assert!(!on_host.exists(), "the job's /dev/shm is its own");
    let img = h.images_dir().join("posix");
    h.ok(&["checkpoint", "posix", "--out", img.to_str().unwrap()]);
    let at = *ticks(&h, "posix").last().unwrap();
    assert!(!on_host.exists());
    h.ok(&["restore", img.to_str().unwrap(), "--name", "posix-r"]);
    wait_ticks(&h, "posix-r", 20);
    assert_eq!(ticks(&h, "posix-r")[0], at + 1, "the copy goes on from the tick after its checkpoint");
    // Twice more side by side, each with its own /dev/shm.
    for copy in ["posix-a", "posix-b"] {
        h.ok(&["restore", img.to_str().unwrap(), "--name", copy]);
    }
    for copy in ["posix-a", "posix-b"] {
        assert_goes_on(&h, copy, at);
    }
}
