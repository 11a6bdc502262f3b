//! hiber against itself and against SIGKILL at the worst moments (issue #41, items 5 and 6):
//!
//! - a restore killed while CRIU restores, or right after: the job is listed (as an
//!   interrupted restore), `hiber recover` adopts it where its tree can run on and removes
//!   it where it cannot, `hiber rm -f` removes it, and the name is free again;
//! - two checkpoints of one job at once: the second is refused at once, naming the hiber
//!   that holds the job, and the first succeeds;
//! - `hiber run` killed once the job's name is taken, or once the job runs: the name is
//!   free again in the first case, and in the second the job is listed and runs on, as
//!   any job.

mod common;

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use common::*;

const LONG: Duration = Duration::from_secs(120);

/// Starts `hiber ARGS` with `env`, and returns it once it says it paused (`HIBER_PAUSE_AT`).
fn spawn_paused(h: &Hiber, args: &[&str], env: &[(&str, &str)]) -> Child {
    let mut c = h.command(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let mut child = c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("paused at") {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "hiber {args:?} ended before it paused");
    }
    // The rest of its stderr is not read: a pipe nobody reads would hold it up.
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    child
}

fn sigkill(mut child: Child) {
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A checkpointed job `name` (a CPU workload of `steps` steps, unique to the test so that
/// its processes can be counted), its image, and its progress until the checkpoint.
fn checkpointed(h: &Hiber, name: &str, steps: &str) -> (PathBuf, Vec<(u64, String)>) {
    h.start(name, &["cpu", "--steps", steps, "--mem-mib", "16", "--interval-ms", "40"]);
    h.wait_step(name, 5);
    let image = h.images_dir().join(name);
    h.ok(&["checkpoint", name, "--out", image.to_str().unwrap()]);
    (image, h.progress(name))
}

/// How many processes of the workload with `steps` steps run (restored copies included).
fn running_with_steps(steps: &str) -> usize {
    let needle = format!("--steps\0{steps}\0");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_to_string(e.path().join("cmdline")).is_ok_and(|c| c.contains("workload") && c.contains(&needle)))
        .filter(|e| e.file_name().to_str().and_then(|p| p.parse().ok()).is_some_and(alive))
        .count()
}

/// The job `name` as `hiber ls --json` lists it, if it does.
fn listed(h: &Hiber, name: &str) -> Option<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(&h.ok(&["ls", "--json"])).unwrap();
    v["jobs"].as_array().unwrap().iter().find(|j| j["name"] == name).cloned()
}

/// `hiber recover`'s stdout and stderr together.
fn recover(h: &Hiber) -> String {
    let out = h.output(&["recover"]);
    let text = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    text
}

/// Waits until the job makes progress again, then checks it went on from the image with
/// the original's checksums.
fn assert_runs_on(h: &Hiber, name: &str, before: &[(u64, String)]) {
    let from = before.last().unwrap().0 + 1;
    h.wait_step(name, from + 5);
    assert_continues(before, &h.progress(name), from);
}

/// The name is free: no directory, and a restore may take it again.
fn assert_name_free(h: &Hiber, name: &str, image: &Path) {
    assert!(listed(h, name).is_none(), "{name} is still listed");
    assert!(!h.state.join("jobs").join(name).exists(), "{name}'s directory is left");
    h.ok(&["restore", image.to_str().unwrap(), "--name", name]);
    h.ok(&["rm", "-f", name]);
}

/// A CRIU that, run by a job's shim (to restore), first touches `started`, runs `before`
/// (shell), then either runs the real CRIU or, with `then_fail`, fails. Run by hiber itself
/// (its version query), it is the real CRIU.
fn criu_wrapper(h: &Hiber, before: &str, then_fail: bool) -> (PathBuf, PathBuf) {
    let real = ["/usr/local/sbin/criu", "/usr/sbin/criu", "/sbin/criu", "/usr/local/bin/criu", "/usr/bin/criu"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("CRIU is installed (scripts/setup.sh)");
    let started = h.scratch.join("criu-started");
    let script = h.scratch.join("criu-wrapper.sh");
    let end = if then_fail { "exit 1".to_string() } else { format!("exec {real} \"$@\"") };
    let text = format!(
        "#!/bin/sh\ncase \"$(tr '\\0' ' ' < /proc/$PPID/cmdline)\" in\n*__shim*)\n  touch {}\n  {before}\n  {end};;\nesac\nexec {real} \"$@\"\n",
        started.display()
    );
    std::fs::write(&script, text).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    (script, started)
}

/// hiber killed right after the shim reported the restored tree (held there by
/// `HIBER_PAUSE_AT`): the job is listed, `hiber recover` adopts it (a CPU image needs
/// nothing more), it computes on from the image, and `hiber rm -f` removes it.
#[test]
fn a_restore_killed_after_criu_is_listed_and_adopted() {
    let h = Hiber::new("race-adopt");
    let (image, before) = checkpointed(&h, "ad", "611");
    let hiber = spawn_paused(&h, &["restore", image.to_str().unwrap(), "--name", "ad-r"], &[("HIBER_PAUSE_AT", "processes_restored")]);
    sigkill(hiber);

    let job = listed(&h, "ad-r").expect("a killed restore's job is listed");
    assert_eq!(job["state"], "interrupted restore", "{job}");
    assert!(job["pid"].as_i64().is_some_and(|p| p > 0), "the shim recorded the restored root: {job}");
    let text = recover(&h);
    assert!(text.contains("adopted job ad-r"), "{text}");
    assert_eq!(h.state_of("ad-r"), "running");
    assert_eq!(listed(&h, "ad-r").unwrap()["pid"], job["pid"]);
    assert_runs_on(&h, "ad-r", &before);
    assert_eq!(recover(&h).trim(), "nothing to recover");

    h.ok(&["rm", "-f", "ad-r"]);
    assert_eq!(running_with_steps("611"), 0, "rm -f stopped the adopted job");
    assert_name_free(&h, "ad-r", &image);
}

/// hiber killed while CRIU restores (held in a CRIU that takes its time): the job is
/// listed before CRIU is done, and `hiber recover` waits for CRIU, then adopts the tree.
#[test]
fn a_restore_killed_while_criu_restores_is_adopted_once_criu_is_done() {
    let h = Hiber::new("race-midcriu");
    let (image, before) = checkpointed(&h, "mc", "613");
    let (criu, started) = criu_wrapper(&h, "sleep 3", false);
    let hiber = h.command(&["restore", image.to_str().unwrap(), "--name", "mc-r"]).env("HIBER_CRIU", &criu).stderr(Stdio::null()).spawn().unwrap();
    wait("CRIU to be asked to restore", Duration::from_secs(30), || started.exists());
    sigkill(hiber);

    let job = listed(&h, "mc-r").expect("a killed restore's job is listed while CRIU restores");
    assert_eq!(job["state"], "interrupted restore", "{job}");
    let text = recover(&h);
    assert!(text.contains("adopted job mc-r"), "{text}");
    assert_runs_on(&h, "mc-r", &before);
    h.ok(&["rm", "-f", "mc-r"]);
    assert_eq!(running_with_steps("613"), 0);
}

/// hiber killed before CRIU restored anything, and CRIU then fails: `hiber recover` removes
/// the job, and its name is free.
#[test]
fn a_restore_killed_before_criu_restored_a_tree_is_removed() {
    let h = Hiber::new("race-never");
    let (image, _) = checkpointed(&h, "nv", "617");
    let go = h.scratch.join("go");
    let (criu, started) = criu_wrapper(&h, &format!("while [ ! -e {} ]; do sleep 0.05; done", go.display()), true);
    let hiber = h.command(&["restore", image.to_str().unwrap(), "--name", "nv-r"]).env("HIBER_CRIU", &criu).stderr(Stdio::null()).spawn().unwrap();
    wait("CRIU to be asked to restore", Duration::from_secs(30), || started.exists());
    sigkill(hiber);

    let job = listed(&h, "nv-r").expect("listed");
    assert_eq!((job["state"].as_str(), job["pid"].is_null()), (Some("interrupted restore"), true), "{job}");
    std::fs::write(&go, "").unwrap();
    let text = recover(&h);
    assert!(text.contains("removed job nv-r: its restore was interrupted before CRIU restored its tree"), "{text}");
    assert_eq!(running_with_steps("617"), 0);
    assert_name_free(&h, "nv-r", &image);
}

/// hiber killed while the restored tree waits, stopped, for its device state (the path GPU
/// images take): the tree cannot be completed, so `hiber recover` removes the job (its
/// shim has killed the tree, or recover stops it), and nothing of it runs on.
#[test]
fn a_restore_killed_before_its_tree_was_continued_is_removed() {
    let h = Hiber::new("race-stopped");
    let (image, _) = checkpointed(&h, "st", "619");
    let env = [("HIBER_PAUSE_AT", "processes_restored"), ("HIBER_RESTORE_STOPPED", "1")];
    sigkill(spawn_paused(&h, &["restore", image.to_str().unwrap(), "--name", "st-r"], &env));

    assert_eq!(listed(&h, "st-r").expect("listed")["state"], "interrupted restore");
    let text = recover(&h);
    assert!(text.contains("removed job st-r"), "{text}");
    assert!(!text.contains("adopted"), "{text}");
    assert_eq!(running_with_steps("619"), 0, "nothing of the tree runs on");
    assert_name_free(&h, "st-r", &image);
}

/// `hiber rm` on a killed restore whose tree runs: refused without -f, done with it.
#[test]
fn rm_f_removes_a_killed_restore() {
    let h = Hiber::new("race-rm");
    let (image, _) = checkpointed(&h, "rm", "623");
    sigkill(spawn_paused(&h, &["restore", image.to_str().unwrap(), "--name", "rm-r"], &[("HIBER_PAUSE_AT", "processes_restored")]));

    let refused = h.fails(&["rm", "rm-r"]);
    assert!(refused.stderr.contains("job 'rm-r' is running (its restore was interrupted)"), "{}", refused.stderr);
    assert_eq!(running_with_steps("623"), 1, "left running");
    assert_eq!(h.ok(&["rm", "-f", "rm-r"]).trim(), "removed job rm-r");
    assert_eq!(running_with_steps("623"), 0);
    assert_eq!(recover(&h).trim(), "nothing to recover");
    assert_name_free(&h, "rm-r", &image);
}

/// Two checkpoints of one job at once (the first held after it prepared): the second, by
/// name or by PID, is refused at once with who holds the job, and so is `hiber rm -f`; the
/// job runs on, and the first checkpoint succeeds with an image that restores.
#[test]
fn a_second_checkpoint_of_a_job_is_refused_while_the_first_runs() {
    let h = Hiber::new("race-twice");
    let pid = h.start("tw", &["cpu", "--steps", "629", "--mem-mib", "16", "--interval-ms", "40"]);
    h.wait_step("tw", 5);
    let (first, second) = (h.images_dir().join("tw-1"), h.images_dir().join("tw-2"));
    let env = [("HIBER_PAUSE_AT", "prepared"), ("HIBER_PAUSE_MS", "6000")];
    let holder = spawn_paused(&h, &["checkpoint", "tw", "--leave-running", "--out", first.to_str().unwrap()], &env);
    let said = format!("job 'tw' is already being checkpointed by hiber PID {}", holder.id());

    for target in ["tw".to_string(), pid.to_string()] {
        let refused = h.fails(&["checkpoint", &target, "--leave-running", "--out", second.to_str().unwrap()]);
        assert!(refused.stderr.contains(&said), "{target}: {}", refused.stderr);
        assert!(refused.stderr.contains("hint: "), "{}", refused.stderr);
        assert!(!second.exists(), "nothing written for the refused one");
    }
    let refused = h.fails(&["rm", "-f", "tw"]);
    assert!(refused.stderr.contains(&said), "{}", refused.stderr);
    assert_eq!(h.state_of("tw"), "running");

    let out = holder.wait_with_output().unwrap();
    assert!(out.status.success(), "the first checkpoint fails: {out:?}");
    assert_eq!(h.state_of("tw"), "running", "left running");
    let now = h.last_step("tw").unwrap();
    h.wait_step("tw", now + 2);
    h.ok(&["restore", first.to_str().unwrap(), "--name", "tw-r"]);
    wait("the copy to compute a few steps", LONG, || h.progress("tw-r").len() >= 3);
    let copy = h.progress("tw-r");
    assert_continues(&h.progress("tw"), &copy, copy[0].0);
    // Once the first is done, checkpoints go on as ever.
    h.ok(&["checkpoint", "tw", "--leave-running", "--out", second.to_str().unwrap()]);
}

/// `hiber run` killed once it took the job's name, before the job started: the name is
/// free again for the next `hiber run` (before, the empty directory kept it: "a job named
/// ... already exists"), and no process was left.
#[test]
fn a_run_killed_before_its_job_started_frees_the_name() {
    let h = Hiber::new("race-run-reserved");
    let args = ["run", "--name", "rr", "--", HIBER, "workload", "cpu", "--steps", "631", "--mem-mib", "8", "--interval-ms", "40"];
    sigkill(spawn_paused(&h, &args, &[("HIBER_PAUSE_AT", "run-reserved")]));
    assert_eq!(running_with_steps("631"), 0, "nothing started");
    assert!(listed(&h, "rr").is_none(), "no job");
    h.ok(&args);
    h.wait_step("rr", 3);
    assert_eq!(listed(&h, "rr").expect("listed")["state"], "running");
    assert_eq!(h.ok(&["rm", "-f", "rr"]).trim(), "removed job rr");
}

/// `hiber run` killed once its job runs, before it heard back from the job's shim in full:
/// the shim recorded the job first, so it is listed with its PID, runs on, and goes with
/// `hiber rm -f` (before, it ran untracked and kept its name).
#[test]
fn a_run_killed_once_its_job_runs_leaves_a_listed_job() {
    let h = Hiber::new("race-run-started");
    let args = ["run", "--name", "rs", "--", HIBER, "workload", "cpu", "--steps", "637", "--mem-mib", "8", "--interval-ms", "40"];
    sigkill(spawn_paused(&h, &args, &[("HIBER_PAUSE_AT", "run-started")]));
    let job = listed(&h, "rs").expect("the job is listed");
    assert_eq!(job["state"], "running", "{job}");
    assert_eq!(job["pid"].as_i64(), Some(h.pid_of("rs") as i64), "{job}");
    h.wait_step("rs", 3);
    assert_eq!(running_with_steps("637"), 1);
    assert!(!h.state.join("jobs/rs/starting").exists(), "the shim ended the start once it recorded the job");
    recover(&h);
    assert_eq!(listed(&h, "rs").expect("still listed")["state"], "running", "recover leaves a job alone");
    assert_eq!(h.ok(&["rm", "-f", "rs"]).trim(), "removed job rs");
    assert_eq!(running_with_steps("637"), 0);
    assert!(listed(&h, "rs").is_none());
}
