//! Checkpoints and restores fail at each phase barrier (`HIBER_FAIL_AT`, what a
//! coordinator of several hosts does when another participant fails), and lose nothing:
//! the application keeps computing correctly, no image or partial image is left, no
//! journal entry stays behind, and a later checkpoint and restore of the same job work.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const LONG: Duration = Duration::from_secs(120);

/// Whether `dir` holds anything: images, or hidden partial ones.
fn has_entries(dir: &Path) -> bool {
    std::fs::read_dir(dir).map(|mut d| d.next().is_some()).unwrap_or(false)
}

fn checkpoint_failing_at(h: &Hiber, job: &str, phase: &str, leave_running: bool) {
    let image = h.images_dir().join(format!("{job}-{phase}"));
    let mut args = vec!["checkpoint", job, "--out", image.to_str().unwrap()];
    if leave_running {
        args.push("--leave-running");
    }
    let out = h.command(&args).env("HIBER_FAIL_AT", phase).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "checkpoint with a failing {phase} barrier succeeded");
    assert!(stderr.contains("injected failure at") && stderr.contains("the application keeps running"), "{phase}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.lines().next().is_some_and(|l| l.starts_with("hiber: ")) && stderr.lines().count() <= 2, "{phase}: one line and a hint at most:\n{stderr}");
    assert!(!image.exists(), "{phase}: no image may be left");
    assert!(!has_entries(&h.images_dir()), "{phase}: no partial image may be left");
    assert!(!has_entries(&h.state.join("journal")), "{phase}: the journal entry is finished");
    assert_eq!(h.state_of(job), "running", "{phase}: the job still runs");
    let now = h.last_step(job).unwrap();
    h.wait_step(job, now + 2);
}

#[test]
fn a_checkpoint_failing_at_any_phase_leaves_the_job_running() {
    let h = Hiber::new("phases");
    h.start("ph", &["cpu", "--steps", "400", "--mem-mib", "16", "--interval-ms", "40"]);
    h.wait_step("ph", 3);
    for phase in ["prepared", "quiesced", "captured", "dumped", "committed"] {
        checkpoint_failing_at(&h, "ph", phase, false);
    }
    for phase in ["dumped", "committed"] {
        checkpoint_failing_at(&h, "ph", phase, true);
    }
    // After all that, the job checkpoints and restores as ever, and computed correctly.
    let image = h.images_dir().join("ph");
    h.ok(&["checkpoint", "ph", "--out", image.to_str().unwrap()]);
    let before = h.progress("ph");
    h.ok(&["restore", image.to_str().unwrap(), "--name", "ph-r"]);
    h.assert_verified("ph-r", LONG);
    assert_continues(&before, &h.progress("ph-r"), before.last().unwrap().0 + 1);
}

#[test]
fn a_restore_failing_at_any_phase_leaves_no_job() {
    let h = Hiber::new("rphases");
    // A step count of its own: the processes left running are found by it, host-wide.
    h.start("rp", &["cpu", "--steps", "317", "--mem-mib", "16", "--interval-ms", "40"]);
    h.wait_step("rp", 5);
    let image = h.images_dir().join("rp");
    h.ok(&["checkpoint", "rp", "--out", image.to_str().unwrap()]);
    let before = h.progress("rp");
    for phase in ["restore_prepared", "sockets_restored", "processes_restored", "devices_restored"] {
        let out = h.command(&["restore", image.to_str().unwrap(), "--name", "rp-r"]).env("HIBER_FAIL_AT", phase).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("injected failure at"), "{phase}: {stderr}");
        assert!(!h.state.join("jobs").join("rp-r").exists(), "{phase}: the half-restored job is removed");
        let ours = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter(|e| std::fs::read_to_string(e.path().join("cmdline")).is_ok_and(|c| c.contains("workload") && c.contains("--steps\x00317")))
            .count();
        assert_eq!(ours, 0, "{phase}: no restored process is left running");
    }
    h.ok(&["restore", image.to_str().unwrap(), "--name", "rp-r"]);
    h.assert_verified("rp-r", LONG);
    assert_continues(&before, &h.progress("rp-r"), before.last().unwrap().0 + 1);
}

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// `hiber coordinate` on a free loopback port, with the session token given.
fn coordinator(h: &Hiber, participants: &str) -> (std::process::Child, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let child = h
        .command(&["coordinate", "--participants", participants, "--listen", &addr, "--timeout", "120"])
        .env("HIBER_SESSION", TOKEN)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Listening once it says so.
    wait("the coordinator to listen", Duration::from_secs(10), || std::net::TcpStream::connect(&addr).map(drop).is_ok());
    (child, addr)
}

/// Two jobs checkpointed as one cut through `hiber coordinate` (as two hosts would): both
/// images, each restorable. Then one participant fails at a phase (here: injected at the
/// commit of a --leave-running checkpoint, after both dumped): the other aborts too, both
/// jobs run on, and no image of the cut is left. The stranger without the token is turned
/// away without disturbing the session.
#[test]
fn two_jobs_checkpoint_as_one_cut_and_abort_together() {
    let h = Hiber::new("coord");
    for j in ["ca", "cb"] {
        h.start(j, &["cpu", "--steps", "600", "--mem-mib", "16", "--interval-ms", "40"]);
        h.wait_step(j, 3);
    }
    let (mut server, addr) = coordinator(&h, "2");
    let stranger = h.command(&["checkpoint", "ca", "--coordinator", &addr, "--out", "/nonexistent/x"]).env("HIBER_SESSION", "wrong").output().unwrap();
    assert!(!stranger.status.success() && String::from_utf8_lossy(&stranger.stderr).contains("not a participant of this session"));
    let ckpt = |job: &str, extra: &[&str], env: &[(&str, &str)]| {
        let image = h.images_dir().join(job);
        let mut args = vec!["checkpoint", job, "--coordinator", &addr, "--out", image.to_str().unwrap()];
        args.extend_from_slice(extra);
        let mut c = h.command(&args);
        c.env("HIBER_SESSION", TOKEN);
        for (k, v) in env {
            c.env(k, v);
        }
        (c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap(), image)
    };
    let (a, ia) = ckpt("ca", &["--leave-running"], &[]);
    let (b, ib) = ckpt("cb", &["--leave-running"], &[]);
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(a.status.success() && b.status.success(), "{}\n{}", String::from_utf8_lossy(&a.stderr), String::from_utf8_lossy(&b.stderr));
    let out = server.wait_with_output().unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("every participant passed Committed"));
    let before = h.progress("cb");
    h.ok(&["restore", ib.to_str().unwrap(), "--name", "cb-r"]);
    h.ok(&["inspect", ia.to_str().unwrap()]);

    // The second cut: cb's commit fails, so ca's committed image goes too.
    let (s2, addr2) = coordinator(&h, "2");
    server = s2;
    let ckpt2 = |job: &str, env: &[(&str, &str)]| {
        let image = h.images_dir().join(format!("{job}-2"));
        let mut c = h.command(&["checkpoint", job, "--leave-running", "--coordinator", &addr2, "--out", image.to_str().unwrap()]);
        c.env("HIBER_SESSION", TOKEN);
        for (k, v) in env {
            c.env(k, v);
        }
        (c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap(), image)
    };
    let (a, ia2) = ckpt2("ca", &[]);
    let (b, ib2) = ckpt2("cb", &[("HIBER_FAIL_AT", "committed")]);
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let eb = String::from_utf8_lossy(&b.stderr);
    assert!(!b.status.success() && eb.contains("injected failure"), "cb's checkpoint fails at the injected failure: {eb}");
    let ea = String::from_utf8_lossy(&a.stderr);
    assert!(!a.status.success() && ea.contains("another participant failed"), "{ea}");
    assert!(!ia2.exists() && !ib2.exists(), "no image of an aborted cut is kept");
    let out = server.wait_with_output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("aborted everywhere"));
    for j in ["ca", "cb"] {
        assert_eq!(h.state_of(j), "running", "{j} runs on");
        let now = h.last_step(j).unwrap();
        h.wait_step(j, now + 2);
    }
    // The first cut's copy went on from where the image caught it.
    h.wait_step("cb-r", before.last().unwrap().0 + 5);
    let copy = h.progress("cb-r");
    assert_continues(&h.progress("cb"), &copy, copy[0].0);
}
