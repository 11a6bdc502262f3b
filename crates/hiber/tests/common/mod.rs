//! Harness for the end-to-end tests: the real `hiber` binary, a real CRIU, real processes.
//! Each test gets its own state directory; every job it started is killed at the end.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub mod hosts;

/// The workloads' progress-line parser, the very file the binary uses.
#[path = "../../src/workload/progress.rs"]
mod progress;

pub const HIBER: &str = env!("CARGO_BIN_EXE_hiber");

/// A Python program that talks to itself over an established loopback TCP connection (the
/// shape of a launcher and its store, or a server and its client), checking every answer
/// against the running sum: prints `tick N ok` (or `tick N BAD ...`) every 20 ms.
pub const TCP_PAIR: &str = "\
import socket, time
srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(1)
cli = socket.create_connection(srv.getsockname()); conn, _ = srv.accept()
total = 0
for n in range(1, 100000):
    cli.sendall(n.to_bytes(8, 'little'))
    got = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), 'little')
    total += got
    conn.sendall(total.to_bytes(8, 'little'))
    back = int.from_bytes(cli.recv(8, socket.MSG_WAITALL), 'little')
    ok = got == n and back == n * (n + 1) // 2
    print('tick', n, 'ok' if ok else f'BAD {got} {back}', flush=True)
    time.sleep(0.02)
";

/// Fails loudly (never skips) when the machine cannot run these tests.
pub fn require_environment() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "the end-to-end tests need root (CRIU); run them with scripts/test.sh");
    let out = Command::new(HIBER).arg("doctor").output().expect("run hiber doctor");
    assert!(out.status.success(), "hiber doctor fails; run scripts/setup.sh first:\n{}", String::from_utf8_lossy(&out.stdout));
}

pub struct Hiber {
    pub state: PathBuf,
    pub scratch: PathBuf,
}

#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub stderr: String,
}

impl Hiber {
    pub fn new(tag: &str) -> Hiber {
        require_environment();
        let base = std::env::temp_dir().join(format!("hiber-e2e-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join("scratch")).unwrap();
        Hiber { state: base.join("state"), scratch: base.join("scratch") }
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(HIBER);
        c.args(args).env("HIBER_STATE", &self.state).env_remove("HIBER_LOG");
        c
    }

    pub fn output(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run hiber")
    }

    /// Runs hiber and returns its stdout; panics with stderr if it failed.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.output(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "hiber {args:?} failed ({}):\n{stderr}", out.status);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs hiber expecting failure; checks the error is one line plus a hint, no panic.
    pub fn fails(&self, args: &[&str]) -> Failure {
        let out = self.output(args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "hiber {args:?} should have failed; stdout:\n{}", String::from_utf8_lossy(&out.stdout));
        assert!(!stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"), "hiber {args:?} panicked:\n{stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert!(lines.first().is_some_and(|l| l.starts_with("hiber: ")), "first line is the reason: {stderr}");
        assert!(lines.len() <= 2 && lines.get(1).is_none_or(|l| l.starts_with("hint: ")), "a reason and at most a hint: {stderr}");
        Failure { code: out.status.code().unwrap_or(-1), stderr }
    }

    /// Starts `hiber workload ARGS...` as job `name`.
    pub fn start(&self, name: &str, workload: &[&str]) -> i32 {
        let mut args = vec!["run", "--name", name, "--", HIBER, "workload"];
        args.extend_from_slice(workload);
        self.ok(&args);
        self.pid_of(name)
    }

    pub fn job(&self, name: &str) -> serde_json::Value {
        let text = std::fs::read(self.state.join("jobs").join(name).join("job.json")).expect("job.json");
        serde_json::from_slice(&text).unwrap()
    }

    pub fn pid_of(&self, name: &str) -> i32 {
        self.job(name)["pid"].as_i64().unwrap() as i32
    }

    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.state.join("jobs").join(name).join("stdout.log")).unwrap_or_default()
    }

    /// (step, checksum) of every progress line in a job's log, read with the workloads' own
    /// parser; the checksum as the workloads print it (16 hex digits).
    pub fn progress(&self, name: &str) -> Vec<(u64, String)> {
        progress_in(&self.log(name))
    }

    /// Compiles `tests/fixtures/NAME.c` with `compiler` (`cc`, `mpicc`) into the test's
    /// scratch directory.
    pub fn build_fixture(&self, compiler: &str, name: &str) -> PathBuf {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/{name}.c"));
        let out = self.scratch.join(name);
        let st = Command::new(compiler)
            .args(["-O2", "-Wall", "-o"])
            .arg(&out)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("run {compiler} ({e}; scripts/setup.sh installs it)"));
        assert!(st.success(), "{compiler} {name}.c failed");
        out
    }

    pub fn last_step(&self, name: &str) -> Option<u64> {
        self.progress(name).last().map(|p| p.0)
    }

    pub fn wait_step(&self, name: &str, step: u64) {
        wait(&format!("job {name} to reach step {step}"), Duration::from_secs(60), || self.last_step(name).is_some_and(|s| s >= step));
    }

    pub fn state_of(&self, name: &str) -> String {
        let v: serde_json::Value = serde_json::from_str(&self.ok(&["ls", "--json"])).unwrap();
        v["jobs"].as_array().unwrap().iter().find(|j| j["name"] == name).map(|j| j["state"].as_str().unwrap().to_string()).unwrap_or_default()
    }

    pub fn wait_done(&self, name: &str, limit: Duration) -> String {
        wait(&format!("job {name} to finish"), limit, || self.state_of(name) != "running");
        self.state_of(name)
    }

    /// Asserts the job finished on its own, its final self-check passed, and returns its log.
    pub fn assert_verified(&self, name: &str, limit: Duration) -> String {
        let state = self.wait_done(name, limit);
        let log = self.log(name);
        let stderr = std::fs::read_to_string(self.state.join("jobs").join(name).join("stderr.log")).unwrap_or_default();
        assert_eq!(state, "exited(0)", "job {name} ended as {state}; log tail:\n{}\nstderr tail:\n{}", tail(&log), tail(&stderr));
        assert!(log.lines().any(|l| l.starts_with("verify ok")), "job {name} did not verify:\n{}", tail(&log));
        log
    }

    /// Waits until a checkpoint's journal entry mentions `needle` (the phase it reached).
    pub fn wait_journal(&self, needle: &str, what: &str) {
        wait(what, Duration::from_secs(30), || {
            std::fs::read_dir(self.state.join("journal"))
                .ok()
                .into_iter()
                .flatten()
                .flatten()
                .any(|e| std::fs::read_to_string(e.path()).is_ok_and(|t| t.contains(needle)))
        });
    }

    pub fn images_dir(&self) -> PathBuf {
        self.state.join("images")
    }
}

impl Drop for Hiber {
    fn drop(&mut self) {
        if let Ok(dir) = std::fs::read_dir(self.state.join("jobs")) {
            for e in dir.flatten() {
                let _ = self.output(&["rm", "-f", &e.file_name().to_string_lossy()]);
            }
        }
        if let Some(base) = self.state.parent() {
            let _ = std::fs::remove_dir_all(base);
        }
    }
}

/// (step, checksum) of every progress line of `text` (a program's output), read with the
/// workloads' own parser; the checksum as the workloads print it (16 hex digits).
pub fn progress_in(text: &str) -> Vec<(u64, String)> {
    progress::progress_of(text).into_iter().map(|p| (p.step, format!("{:016x}", p.checksum))).collect()
}

pub fn wait(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

pub fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

pub fn alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
}

/// Checks that a restored copy went on from step `from` with the same state trajectory as
/// the original: the same checksum at every step both printed.
pub fn assert_continues(original: &[(u64, String)], copy: &[(u64, String)], from: u64) {
    assert_eq!(copy.first().map(|p| p.0), Some(from), "the copy should resume at step {from}");
    for (step, sum) in copy {
        if let Some((_, o)) = original.iter().find(|(s, _)| s == step) {
            assert_eq!(o, sum, "checksum differs at step {step}");
        }
    }
    for w in copy.windows(2) {
        assert_eq!(w[1].0, w[0].0 + 1, "steps must be consecutive");
    }
}
