//! hiber killed with SIGKILL in the middle of a checkpoint: the application keeps running
//! (CRIU, in its own process group, fails its post-dump handshake with the dead hiber and
//! resumes the tree), and the next hiber invocation removes the partial image.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn sigkill_during_checkpoint_then_recover() {
    let h = Hiber::new("sigkill");
    let pid = h.start("victim", &["cpu", "--steps", "300", "--mem-mib", "1024"]);
    h.wait_step("victim", 5);
    let out = h.images_dir().join("victim");
    let mut hiber = h.command(&["checkpoint", "victim", "--out", out.to_str().unwrap()]).spawn().unwrap();
    // Wait until CRIU is writing the memory into the partial image, then kill hiber.
    wait("CRIU to start writing pages", Duration::from_secs(30), || {
        std::fs::read_dir(h.images_dir()).ok().into_iter().flatten().flatten().any(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.contains(".partial-")
                && std::fs::read_dir(e.path().join("criu")).ok().into_iter().flatten().flatten().any(|f| f.file_name().to_string_lossy().starts_with("pages-"))
        })
    });
    hiber.kill().unwrap();
    hiber.wait().unwrap();

    // The application comes back to running by itself once CRIU gives up...
    wait("the application to run again", Duration::from_secs(60), || {
        let now = h.last_step("victim").unwrap_or(0);
        std::thread::sleep(Duration::from_millis(200));
        h.last_step("victim").unwrap_or(0) > now
    });
    assert!(alive(pid));
    // ...and the next invocation finishes the undo: no journal, no partial image.
    let rec = h.output(&["recover"]);
    let text = String::from_utf8_lossy(&rec.stderr).into_owned() + &String::from_utf8_lossy(&rec.stdout);
    assert!(rec.status.success(), "{text}");
    assert!(text.contains("recovered an interrupted checkpoint") && text.contains("running again"), "{text}");
    assert_eq!(std::fs::read_dir(h.images_dir()).unwrap().count(), 0, "partial image removed");
    assert!(!out.exists());
    assert!(h.state.join("journal").read_dir().unwrap().next().is_none(), "journal cleared");
    assert_eq!(h.ok(&["recover"]).trim(), "nothing to recover");
    // The application finishes with its state intact.
    h.assert_verified("victim", Duration::from_secs(120));
}

/// The same during a `--leave-running` checkpoint, whose CRIU writes into a tmpfs of its
/// own: the next invocation unmounts it (it holds the application's memory).
#[test]
fn sigkill_during_a_leave_running_dump_leaves_no_staging_area() {
    let h = Hiber::new("sigkill-stage");
    let pid = h.start("victim", &["cpu", "--steps", "300", "--mem-mib", "1024"]);
    h.wait_step("victim", 5);
    let out = h.images_dir().join("victim");
    let mut hiber = h.command(&["checkpoint", "victim", "--leave-running", "--out", out.to_str().unwrap()]).spawn().unwrap();
    let stages = h.state.join("stage");
    wait("CRIU to start writing pages into its staging area", Duration::from_secs(30), || {
        std::fs::read_dir(&stages)
            .ok()
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| std::fs::read_dir(e.path()).ok().into_iter().flatten().flatten().any(|f| f.file_name().to_string_lossy().starts_with("pages-")))
    });
    hiber.kill().unwrap();
    hiber.wait().unwrap();
    let mounted = || std::fs::read_to_string("/proc/self/mountinfo").unwrap().contains(&*stages.to_string_lossy());
    assert!(mounted(), "the staging area outlives the killed hiber");
    wait("the application to run again", Duration::from_secs(60), || {
        let now = h.last_step("victim").unwrap_or(0);
        std::thread::sleep(Duration::from_millis(200));
        h.last_step("victim").unwrap_or(0) > now
    });
    let rec = h.output(&["recover"]);
    let text = String::from_utf8_lossy(&rec.stderr).into_owned() + &String::from_utf8_lossy(&rec.stdout);
    assert!(rec.status.success(), "{text}");
    assert!(text.contains("removed 1 staging area"), "{text}");
    assert!(!mounted(), "unmounted");
    assert_eq!(std::fs::read_dir(&stages).unwrap().count(), 0);
    assert!(!out.exists());
    assert!(alive(pid));
    h.assert_verified("victim", Duration::from_secs(120));
}

/// hiber killed while a restored tree waits, stopped, for its device state (the path GPU
/// images take; HIBER_RESTORE_STOPPED forces it for a CPU job, HIBER_PAUSE_AT holds hiber
/// there): the job's shim kills the tree instead of leaving it stopped forever, and records
/// how it ended.
#[test]
fn sigkill_while_a_restored_tree_waits_stopped() {
    let h = Hiber::new("stopwait");
    h.start("sw", &["pipe", "--steps", "400"]);
    h.wait_step("sw", 5);
    let image = h.images_dir().join("sw");
    h.ok(&["checkpoint", "sw", "--out", image.to_str().unwrap()]);
    let mut hiber = h
        .command(&["restore", image.to_str().unwrap(), "--name", "sw-r"])
        .env("HIBER_RESTORE_STOPPED", "1")
        .env("HIBER_PAUSE_AT", "processes_restored")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(hiber.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("paused at") {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut err, &mut line).unwrap() > 0, "hiber ended before it paused");
    }
    hiber.kill().unwrap();
    hiber.wait().unwrap();
    let exit = h.state.join("jobs").join("sw-r").join("exit.json");
    wait("the shim to kill the stopped tree and record it", Duration::from_secs(20), || exit.exists());
    let status: serde_json::Value = serde_json::from_slice(&std::fs::read(&exit).unwrap()).unwrap();
    assert_eq!(status, serde_json::json!({ "signal": 9 }), "killed, not run without its state");
}
