//! Shapes from CRIU's own test suite (zdtm; scripts/zdtm.sh runs it through hiber) that
//! CRIU handles and hiber once refused or failed: a program that runs a child under a pty
//! pair of its own (zdtm's pty00, tty00), a deleted file of 8 MiB held open (past CRIU's
//! default ghost limit, 1 MiB: ghost_multi_hole00), and a server with a connection it has
//! not accepted yet (socket-tcp-skip-in-flight). Each fixture (tests/fixtures/*.c) checks
//! its own state after restore; a terminal from outside the job is still refused.
//! One shape that CRIU alone fails too: a server whose closed connections hold its port in
//! TIME_WAIT when it is restored in place.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;

const BOUND: Duration = Duration::from_secs(20);

fn wait_log(h: &Hiber, job: &str, what: &str, mut cond: impl FnMut(&str) -> bool) {
    wait(&format!("{job} to print {what}"), BOUND, || cond(&h.log(job)));
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill has no memory preconditions; the PID is a job's root, started by the test.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
}

/// (N, "ok" or "lost") of every `round N ctty X` line of a job's log.
fn rounds(h: &Hiber, job: &str) -> Vec<(u64, String)> {
    h.log(job)
        .lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            ["round", n, "ctty", state] => Some((n.parse().ok()?, state.to_string())),
            _ => None,
        })
        .collect()
}

#[test]
fn pty_pair_held_inside_the_job_is_checkpointed_with_its_controlling_terminal() {
    let h = Hiber::new("zdtm-pty");
    let bin = h.build_fixture("cc", "pty_session");
    h.ok(&["run", "--name", "pty", "--", bin.to_str().unwrap()]);
    wait("10 rounds through the pty", BOUND, || rounds(&h, "pty").len() >= 10);
    let image = h.images_dir().join("pty");
    let pid = h.pid_of("pty");
    h.ok(&["checkpoint", "pty", "--out", image.to_str().unwrap()]);
    wait("the original to stop", Duration::from_secs(10), || !alive(pid));
    let last = rounds(&h, "pty").last().unwrap().0;
    h.ok(&["restore", image.to_str().unwrap(), "--name", "pty-r"]);
    wait("20 rounds after restore", BOUND, || rounds(&h, "pty-r").len() >= 20);
    let ours = rounds(&h, "pty-r");
    assert_eq!(ours[0].0, last + 1, "the rounds go on from the checkpoint's count: {ours:?}");
    for w in ours.windows(2) {
        assert_eq!(w[1].0, w[0].0 + 1, "one round after another: {w:?}");
    }
    assert!(ours.iter().all(|r| r.1 == "ok"), "the child's session keeps the slave as its controlling terminal: {ours:?}");
    assert_eq!(h.state_of("pty-r"), "running");
}

#[test]
fn controlling_terminal_from_outside_the_job_is_still_refused() {
    let h = Hiber::new("zdtm-pty-outside");
    let bin = h.build_fixture("cc", "pty_session");
    // A pty whose master this test holds: to the job, a terminal from outside.
    // SAFETY: posix_openpt, grantpt and unlockpt take only a flag or the descriptor it returned.
    let master = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY) };
    assert!(master >= 0, "posix_openpt");
    // SAFETY: as above; `master` is open.
    assert!(unsafe { libc::grantpt(master) == 0 && libc::unlockpt(master) == 0 }, "grantpt/unlockpt");
    let mut name = [0 as libc::c_char; 64];
    // SAFETY: `name` is writable for its whole length, which is passed.
    assert_eq!(unsafe { libc::ptsname_r(master, name.as_mut_ptr(), name.len()) }, 0, "ptsname_r");
    // SAFETY: ptsname_r wrote a NUL-terminated string into `name`.
    let slave = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_str().unwrap().to_string();
    // The job opens it by its path, which names the host's terminal only in the host's
    // /dev/pts (a job has its own unless `--host-pts`).
    h.ok(&["run", "--host-pts", "--name", "outside", "--", bin.to_str().unwrap(), "--slave", &slave]);
    wait_log(&h, "outside", "ctty ok", |l| l.contains("ctty ok"));
    let f = h.fails(&["checkpoint", "outside", "--out", h.images_dir().join("outside").to_str().unwrap()]);
    assert!(f.stderr.contains(&format!("controlling terminal from outside the tree ({slave})")) && f.stderr.contains("hint: "), "{}", f.stderr);
    assert_eq!(h.state_of("outside"), "running", "refusing touched nothing");
    // SAFETY: `master` is this test's own descriptor, closed once.
    unsafe { libc::close(master) };
}

/// `verified ...` lines of a job's log.
fn verdicts(h: &Hiber, job: &str) -> Vec<String> {
    h.log(job).lines().filter(|l| l.starts_with("verified")).map(String::from).collect()
}

/// Asks job `job`'s program to check its deleted file and returns its verdict.
fn verify_ghost(h: &Hiber, job: &str) -> String {
    let before = verdicts(h, job).len();
    signal(h.pid_of(job), libc::SIGUSR1);
    wait(&format!("{job} to check its deleted file"), BOUND, || verdicts(h, job).len() > before);
    verdicts(h, job).pop().unwrap()
}

#[test]
fn deleted_file_of_8_mib_held_open_is_restored_with_its_content() {
    let h = Hiber::new("zdtm-ghost");
    let bin = h.build_fixture("cc", "ghost_file");
    h.ok(&["run", "--name", "ghost", "--", bin.to_str().unwrap(), h.scratch.to_str().unwrap()]);
    wait_log(&h, "ghost", "ready", |l| l.contains("ready 8388608"));
    let image = h.images_dir().join("ghost");
    h.ok(&["checkpoint", "ghost", "--out", image.to_str().unwrap()]);
    h.ok(&["restore", image.to_str().unwrap(), "--name", "ghost-r"]);
    assert_eq!(verify_ghost(&h, "ghost-r"), "verified ok 8388608 nlink 0");
    assert!(!h.scratch.join("ghost").exists(), "the restore leaves no name behind");
}

#[test]
fn deleted_file_is_intact_in_the_original_and_a_copy_beside_it() {
    let h = Hiber::new("zdtm-ghost-leave");
    let bin = h.build_fixture("cc", "ghost_file");
    h.ok(&["run", "--name", "orig", "--", bin.to_str().unwrap(), h.scratch.to_str().unwrap()]);
    wait_log(&h, "orig", "ready", |l| l.contains("ready 8388608"));
    let image = h.images_dir().join("orig");
    h.ok(&["checkpoint", "orig", "--leave-running", "--out", image.to_str().unwrap()]);
    h.ok(&["restore", image.to_str().unwrap(), "--name", "copy"]);
    for job in ["copy", "orig"] {
        assert_eq!(verify_ghost(&h, job), "verified ok 8388608 nlink 0", "{job}");
    }
    assert!(!h.scratch.join("ghost").exists(), "neither the dump nor the restore leaves a name behind");
}

#[test]
fn listening_socket_with_a_connection_not_yet_accepted() {
    let h = Hiber::new("zdtm-inflight");
    let bin = h.build_fixture("cc", "listen_inflight");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    h.ok(&["run", "--name", "srv", "--", bin.to_str().unwrap(), &port]);
    wait_log(&h, "srv", "listening", |l| l.contains("listening"));
    // The kernel completes the handshake; the server has not accepted it (it accepts
    // nothing before SIGUSR1): the connection waits in the accept queue.
    let mut early = TcpStream::connect(format!("127.0.0.1:{port}")).unwrap();
    early.write_all(b"early\n").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let image = h.images_dir().join("srv");
    h.ok(&["checkpoint", "srv", "--out", image.to_str().unwrap()]);
    // What the client of a connection left out of the image sees once the server stopped:
    // a reset, as after a server restart.
    early.set_read_timeout(Some(BOUND)).unwrap();
    let err = early.read(&mut [0u8; 64]).expect_err("the connection the image left out is reset");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    h.ok(&["restore", image.to_str().unwrap(), "--name", "srv-r"]);
    signal(h.pid_of("srv-r"), libc::SIGUSR1);
    let mut client = TcpStream::connect(format!("127.0.0.1:{port}")).unwrap();
    client.set_read_timeout(Some(BOUND)).unwrap();
    client.write_all(b"ping\n").unwrap();
    let mut reply = String::new();
    BufReader::new(&client).read_line(&mut reply).unwrap();
    assert_eq!(reply, "pong ping\n", "the restored server listens and serves");
    wait_log(&h, "srv-r", "served", |l| l.contains("served"));
    assert!(h.log("srv-r").lines().any(|l| l == "served 1 ping"), "the first client served after restore is the new one:\n{}", h.log("srv-r"));
}

/// One client of a server on `port`: sends `line`, returns the answer, and waits for the
/// server to close first (its side of the connection then waits in TIME_WAIT).
fn ask(port: &str, line: &str) -> String {
    let mut client = TcpStream::connect(format!("127.0.0.1:{port}")).unwrap();
    client.set_read_timeout(Some(BOUND)).unwrap();
    client.write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut reply = String::new();
    client.read_to_string(&mut reply).unwrap();
    reply
}

/// The connections on `port` in TIME_WAIT, as `ss` lists them.
fn time_wait_on(port: &str) -> usize {
    let out = std::process::Command::new("ss").args(["-Htan", "state", "time-wait", "sport", "=", &format!(":{port}")]).output().expect("run ss");
    String::from_utf8_lossy(&out.stdout).lines().count()
}

/// A server that closed its connections first, and listens without SO_REUSEADDR, stopped
/// by a checkpoint and restored in place at once: its closed connections still wait in
/// TIME_WAIT on its port, which CRIU must bind again. The restore ends them (they are the
/// job's past) and the server goes on counting its clients.
#[test]
fn a_server_that_closed_its_connections_is_restored_in_place_at_once() {
    let h = Hiber::new("zdtm-timewait");
    let bin = h.build_fixture("cc", "closing_server");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    h.ok(&["run", "--name", "srv", "--", bin.to_str().unwrap(), &port]);
    wait_log(&h, "srv", "listening", |l| l.contains("listening"));
    for (n, line) in ["one", "two", "three"].iter().enumerate() {
        assert_eq!(ask(&port, line), format!("pong {} {line}\n", n + 1));
    }
    let image = h.images_dir().join("srv");
    h.ok(&["checkpoint", "srv", "--out", image.to_str().unwrap()]);
    assert_eq!(time_wait_on(&port), 3, "the server's closed connections hold its port");
    h.ok(&["restore", image.to_str().unwrap(), "--name", "srv-r"]);
    assert_eq!(time_wait_on(&port), 0, "the restore ended them");
    assert_eq!(ask(&port, "after"), "pong 4 after\n", "the restored server counts on");
    wait_log(&h, "srv-r", "served 4", |l| l.contains("served 4 after"));
}
