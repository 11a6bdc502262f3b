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
    h.start("rp", &["cpu", "--steps", "300", "--mem-mib", "16", "--interval-ms", "40"]);
    h.wait_step("rp", 5);
    let image = h.images_dir().join("rp");
    h.ok(&["checkpoint", "rp", "--out", image.to_str().unwrap()]);
    let before = h.progress("rp");
    for phase in ["restore_prepared", "processes_restored", "devices_restored"] {
        let out = h.command(&["restore", image.to_str().unwrap(), "--name", "rp-r"]).env("HIBER_FAIL_AT", phase).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("injected failure at"), "{phase}: {stderr}");
        assert!(!h.state.join("jobs").join("rp-r").exists(), "{phase}: the half-restored job is removed");
        let ours = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter(|e| std::fs::read_to_string(e.path().join("cmdline")).is_ok_and(|c| c.contains("workload") && c.contains("--steps\x00300")))
            .count();
        assert_eq!(ours, 0, "{phase}: no restored process is left running");
    }
    h.ok(&["restore", image.to_str().unwrap(), "--name", "rp-r"]);
    h.assert_verified("rp-r", LONG);
    assert_continues(&before, &h.progress("rp-r"), before.last().unwrap().0 + 1);
}
