//! A job's shim is hiber executed afresh (`hiber __shim`), never a fork of a hiber that may
//! have threads: it has one thread and holds only /dev/null on 0 to 2 (and, under a
//! restored job, the log files CRIU was given).

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

fn parent_of(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    stat.rsplit(')').next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Checks the shim of job `name` and returns what its descriptors above 2 point at.
fn check_shim(h: &Hiber, name: &str) -> Vec<String> {
    let shim = parent_of(h.pid_of(name));
    let exe = std::fs::read_link(format!("/proc/{shim}/exe")).unwrap();
    assert_eq!(exe, std::fs::canonicalize(HIBER).unwrap(), "the shim of {name} runs hiber");
    let cmdline = std::fs::read_to_string(format!("/proc/{shim}/cmdline")).unwrap();
    assert!(cmdline.split('\0').any(|a| a == "__shim"), "{cmdline:?}");
    let status = std::fs::read_to_string(format!("/proc/{shim}/status")).unwrap();
    assert!(status.lines().any(|l| l.split_whitespace().eq(["Threads:", "1"])), "the shim has one thread:\n{status}");
    let mut fds: Vec<(i32, String)> = std::fs::read_dir(format!("/proc/{shim}/fd"))
        .unwrap()
        .flatten()
        .map(|e| (e.file_name().to_str().unwrap().parse().unwrap(), std::fs::read_link(e.path()).unwrap().display().to_string()))
        .collect();
    fds.sort();
    for fd in 0..3 {
        assert_eq!(fds.get(fd).map(|(n, t)| (*n, t.as_str())), Some((fd as i32, "/dev/null")), "{fds:?}");
    }
    fds.into_iter().skip(3).map(|(_, t)| t).collect()
}

#[test]
fn shims_are_fresh_single_threaded_hibers() {
    let h = Hiber::new("shim");
    h.start("shim", &["cpu", "--steps", "300", "--mem-mib", "8"]);
    assert_eq!(check_shim(&h, "shim"), Vec::<String>::new(), "a job's shim holds nothing but 0 to 2");
    h.wait_step("shim", 3);
    let image = h.images_dir().join("shim");
    h.ok(&["checkpoint", "shim", "--out", image.to_str().unwrap()]);
    h.ok(&["restore", image.to_str().unwrap(), "--name", "shim-r"]);
    let logs = h.state.join("jobs").join("shim-r");
    for target in check_shim(&h, "shim-r") {
        assert!(target.starts_with(logs.to_str().unwrap()), "a restored job's shim holds only its logs besides 0 to 2: {target}");
    }
    h.assert_verified("shim-r", Duration::from_secs(120));
}

#[test]
fn the_shim_command_is_hidden_and_refuses_a_bad_request() {
    let help = Command::new(HIBER).arg("--help").output().unwrap();
    assert!(!String::from_utf8_lossy(&help.stdout).contains("__shim"));
    let mut shim = Command::new(HIBER).arg("__shim").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    shim.stdin.take().unwrap().write_all(b"nonsense").unwrap();
    let out = shim.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["failed"]["message"].as_str().unwrap().contains("bad request"), "{report}");
}

/// A job gets SIGPIPE's default action back (hiber, like any Rust program, ignores it, and
/// an ignored signal stays ignored across exec): `yes | head -n 1` ends.
#[test]
fn jobs_get_the_default_sigpipe() {
    let h = Hiber::new("sigpipe");
    h.ok(&["run", "--name", "pipe", "--", "sh", "-c", "grep SigIgn /proc/self/status; yes | head -n 1; echo done"]);
    wait("the job to end", Duration::from_secs(20), || h.state_of("pipe") != "running");
    let log = h.log("pipe");
    let ignored = log.lines().find_map(|l| l.strip_prefix("SigIgn:")).map(|v| u64::from_str_radix(v.trim(), 16).unwrap()).expect("SigIgn line");
    assert_eq!(ignored & (1 << (libc::SIGPIPE - 1)), 0, "SIGPIPE is not ignored in the job: {log}");
    assert!(log.ends_with("y\ndone\n"), "{log}");
    assert_eq!(h.state_of("pipe"), "exited(0)");
}

/// A new job's PID namespace never has a number that a CUDA socket here is named after
/// (`cuda-uvmfd-NS-PID`, which a restored job keeps from the namespace it was checkpointed
/// in): CUDA would fail in the new job. The socket is held by this test, as a restored
/// copy would hold it, for a namespace that is then gone, whose number the kernel would
/// hand out again.
#[test]
fn a_new_job_avoids_a_pid_namespace_named_in_a_cuda_socket() {
    use std::os::linux::net::SocketAddrExt;
    let h = Hiber::new("uvmfd");
    let ns =
        |pid: i32| std::fs::read_link(format!("/proc/{pid}/ns/pid")).unwrap().to_string_lossy().trim_start_matches("pid:[").trim_end_matches(']').to_string();
    h.ok(&["run", "--name", "gone", "--", "sleep", "600"]);
    let gone = ns(h.pid_of("gone"));
    let name = format!("cuda-uvmfd-{gone}-1\0");
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let _held = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    let pid = h.pid_of("gone");
    h.ok(&["rm", "-f", "gone"]);
    wait("the first job's namespace to go", Duration::from_secs(20), || !alive(pid));
    for i in 0..3 {
        let job = format!("new{i}");
        h.ok(&["run", "--name", &job, "--", "sleep", "600"]);
        assert_ne!(ns(h.pid_of(&job)), gone, "job {job} got the namespace number a CUDA socket is named after");
    }
}
