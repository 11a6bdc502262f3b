//! The OpenCL engine end to end: real OpenCL programs (tests/opencl/*.c) on PoCL's two CPU
//! devices (`POCL_DEVICES="basic pthread"`: two drivers), under `hiber run`, checkpointed
//! and restored with a real CRIU. Each restored program checks its own device state against
//! a host reference, and its trajectory is compared with an uninterrupted run's.
//!
//! A program on PoCL's CPU device would also round-trip through CRIU alone (its state is
//! process memory), so these tests look for the engine's own work: the memory objects in
//! the image, and restores onto the other device, which only a replay of the objects gives.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::{assert_continues, wait, Hiber};

const DEVICES: &str = "basic pthread";
const BASIC: &str = "basic-";
const PTHREAD: &str = "pthread-";

/// Compiles test program `name` into the scratch directory.
fn program(h: &Hiber, name: &str) -> PathBuf {
    compile(h, "crates/hiber/tests/opencl", name)
}

/// Builds DIR/NAME.c (DIR from the repository's root) into the test's scratch directory.
fn compile(h: &Hiber, dir: &str, name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(dir);
    let out = h.scratch.join(name);
    let st = Command::new("cc")
        .args(["-O2", "-Wall", "-o"])
        .arg(&out)
        .arg(dir.join(format!("{name}.c")))
        .args(["-lOpenCL", "-lpthread"])
        .status()
        .expect("run cc (scripts/setup.sh installs it with OpenCL's headers)");
    assert!(st.success(), "cc {name}.c failed");
    out
}

/// Progress of an uninterrupted run of the same program, without hiber.
fn reference(bin: &PathBuf, args: &[&str]) -> Vec<(u64, String)> {
    let mut a: Vec<&str> = args.to_vec();
    a[3] = "0"; // no sleep
    let out = Command::new(bin).args(&a).env("POCL_DEVICES", DEVICES).output().expect("run the reference");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("verify ok"), "the reference run failed: {text}");
    text.lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.first() == Some(&"step")).then(|| (w[1].parse().unwrap(), w[3].to_string()))
        })
        .collect()
}

/// The device names a job's log shows, in order of first appearance.
fn devices_in(log: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for l in log.lines().filter(|l| l.starts_with("step ")) {
        if let Some(d) = l.split(" dev ").nth(1) {
            if !out.iter().any(|x| x == d) {
                out.push(d.to_string());
            }
        }
    }
    out
}

fn start(h: &Hiber, mode: &str, name: &str, bin: &PathBuf, args: &[&str]) {
    let opencl = format!("--opencl={mode}");
    let mut cmd = h.command(&["run", &opencl, "--name", name, "--"]);
    // The layer overwrites each memory object before releasing it: PoCL hands the same host
    // memory back when an object is made again, which would hide bytes hiber did not load.
    cmd.arg(bin).args(args).env("POCL_DEVICES", DEVICES).env("HIBER_OPENCL_POISON", "1");
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "hiber run failed: {}", String::from_utf8_lossy(&out.stderr));
}

fn restore(h: &Hiber, image: &str, name: &str, extra: &[&str]) {
    let mut args = vec!["restore", image, "--name", name];
    args.extend_from_slice(extra);
    let out = h.command(&args).env("POCL_DEVICES", DEVICES).output().unwrap();
    assert!(out.status.success(), "hiber restore failed: {}", String::from_utf8_lossy(&out.stderr));
}

fn opencl_section(image: &str) -> serde_json::Value {
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(PathBuf::from(image).join("manifest.json")).unwrap()).unwrap();
    let sections = m["devices"].as_array().cloned().unwrap_or_default();
    let s = sections.iter().find(|s| s["engine"] == "opencl").unwrap_or_else(|| panic!("no opencl section in {image}: {m}"));
    s["state"].clone()
}

fn stencil_moves_to_the_other_device_and_goes_on_identically(mode: &str) {
    let h = Hiber::new(&format!("ocl-stencil-{mode}"));
    let bin = program(&h, "stencil");
    let args = ["300", "65536", "0", "10"];
    let want = reference(&bin, &args);
    start(&h, mode, "st", &bin, &args);
    h.wait_step("st", 40);
    let image = h.images_dir().join("st").display().to_string();
    h.ok(&["checkpoint", "st", "--out", &image]);
    let at = h.last_step("st").unwrap();

    // The engine at work: both buffers' bytes are in the image, as checksummed chunks.
    let s = opencl_section(&image);
    let p = &s["processes"][0];
    assert_eq!(p["mems"].as_array().unwrap().len(), 2, "{s}");
    assert_eq!(p["bytes"], 2 * 65536 * 4, "{s}");
    assert!(p["devices"][0]["name"].as_str().unwrap().contains(BASIC), "{s}");
    for m in p["mems"].as_array().unwrap() {
        for f in m["files"].as_array().unwrap() {
            assert!(PathBuf::from(&image).join(f.as_str().unwrap()).is_file(), "{f} missing");
        }
    }
    let inspect = h.ok(&["inspect", &image]);
    assert!(inspect.contains("2 memory objects, 524288 bytes"), "{inspect}");

    restore(&h, &image, "st2", &["--opencl-device", "0:1"]);
    h.assert_verified("st2", Duration::from_secs(60));
    let log = h.log("st2");
    assert_eq!(devices_in(&log).len(), 1, "{log}");
    assert!(devices_in(&log)[0].starts_with(PTHREAD), "the restored program runs on the other device: {:?}", devices_in(&log));
    assert!(devices_in(&h.log("st"))[0].starts_with(BASIC));
    assert_continues(&want, &h.progress("st2"), at + 1);
}

fn two_queues_leave_running_then_two_restores(mode: &str) {
    let h = Hiber::new(&format!("ocl-reduce-{mode}"));
    let bin = program(&h, "reduce");
    let args = ["200", "32768", "1", "10"];
    let want = reference(&bin, &args);
    start(&h, mode, "rd", &bin, &args);
    h.wait_step("rd", 30);
    let image = h.images_dir().join("rd").display().to_string();
    h.ok(&["checkpoint", "rd", "--leave-running", "--out", &image]);
    // The original re-created its objects and goes on, with the same trajectory.
    h.assert_verified("rd", Duration::from_secs(60));
    assert_continues(&want, &h.progress("rd"), 1);
    let s = opencl_section(&image);
    // The data buffer, the partial sums and the result; the sub-buffer shares the data's.
    assert_eq!(s["processes"][0]["mems"].as_array().unwrap().len(), 3, "{s}");
    assert_eq!(s["processes"][0]["objects"]["queues"], 2, "{s}");
    assert_eq!(s["processes"][0]["objects"]["kernels"], 3, "{s}");
    // The image restores twice, side by side (the second copy in a network namespace of its
    // own, as the layer's control socket name is taken by the first), once onto each
    // device, each copy verifying on its own.
    restore(&h, &image, "rd-a", &[]);
    restore(&h, &image, "rd-b", &["--opencl-device", "0:0", "--isolate-net"]);
    for (name, dev) in [("rd-a", PTHREAD), ("rd-b", BASIC)] {
        h.assert_verified(name, Duration::from_secs(60));
        let p = h.progress(name);
        assert_continues(&want, &p, p[0].0);
        assert!(devices_in(&h.log(name))[0].starts_with(dev), "{name}: {:?}", devices_in(&h.log(name)));
    }
}

fn images_and_a_sampler_round_trip_and_move(mode: &str) {
    let h = Hiber::new(&format!("ocl-image-{mode}"));
    let bin = program(&h, "image");
    let args = ["200", "96", "1", "10"];
    let want = reference(&bin, &args);
    start(&h, mode, "im", &bin, &args);
    h.wait_step("im", 30);
    let image = h.images_dir().join("im").display().to_string();
    h.ok(&["checkpoint", "im", "--out", &image]);
    let at = h.last_step("im").unwrap();
    let s = opencl_section(&image);
    let mems = s["processes"][0]["mems"].as_array().unwrap().clone();
    assert_eq!(mems.len(), 2, "{s}");
    assert!(mems.iter().all(|m| m["kind"] == "image" && m["size"] == 96 * 96 * 4), "{s}");
    assert_eq!(s["processes"][0]["objects"]["samplers"], 1, "{s}");
    restore(&h, &image, "im2", &["--opencl-device", "cpu"]);
    h.assert_verified("im2", Duration::from_secs(60));
    assert!(devices_in(&h.log("im2"))[0].starts_with(BASIC), "`cpu` is the first CPU device: {:?}", devices_in(&h.log("im2")));
    assert_continues(&want, &h.progress("im2"), at + 1);
}

fn a_chain_of_checkpoints_keeps_the_trajectory(mode: &str) {
    let h = Hiber::new(&format!("ocl-chain-{mode}"));
    let bin = program(&h, "stencil");
    let args = ["400", "16384", "0", "10"];
    let want = reference(&bin, &args);
    start(&h, mode, "c0", &bin, &args);
    let mut job = "c0".to_string();
    for i in 1..=3 {
        let step = h.last_step(&job).unwrap_or(0);
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.wait_step(&job, step + 15)));
        if ok.is_err() {
            let dir = h.state.join("jobs").join(&job);
            let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
            panic!(
                "job {job} made no progress: state {}, stdout: {}, stderr: {}, opencl.log: {}",
                h.state_of(&job),
                common::tail(&read("stdout.log")),
                common::tail(&read("stderr.log")),
                common::tail(&read("opencl.log"))
            );
        }
        let image = h.images_dir().join(format!("c{i}")).display().to_string();
        h.ok(&["checkpoint", &job, "--out", &image]);
        let next = format!("c{i}");
        // Back and forth between the two devices.
        restore(&h, &image, &next, &["--opencl-device", if i % 2 == 1 { "0:1" } else { "0:0" }]);
        job = next;
    }
    h.assert_verified(&job, Duration::from_secs(60));
    let p = h.progress(&job);
    assert_continues(&want, &p, p[0].0);
}

fn features_it_cannot_recreate_are_refused_before_anything_stops(mode: &str) {
    let h = Hiber::new(&format!("ocl-refuse-{mode}"));
    let bin = program(&h, "stencil");
    for (job, feature, says) in [("mapped", "map", "mapped"), ("svm", "svm", "clSVMAlloc")] {
        start(&h, mode, job, &bin, &["100000", "4096", "0", "10", feature]);
        h.wait_step(job, 5);
        let image = h.images_dir().join(job).display().to_string();
        let f = h.fails(&["checkpoint", job, "--out", &image]);
        assert!(f.stderr.contains(says), "{job}: {}", f.stderr);
        assert!(!PathBuf::from(&image).exists(), "no image is left behind");
        // The job was never stopped: it goes on.
        let at = h.last_step(job).unwrap();
        h.wait_step(job, at + 5);
        assert_eq!(h.state_of(job), "running");
    }
}

fn a_device_that_is_not_here_is_refused_with_the_list(mode: &str) {
    let h = Hiber::new(&format!("ocl-baddev-{mode}"));
    let bin = program(&h, "stencil");
    start(&h, mode, "bd", &bin, &["100000", "4096", "0", "10"]);
    h.wait_step("bd", 5);
    let image = h.images_dir().join("bd").display().to_string();
    h.ok(&["checkpoint", "bd", "--out", &image]);
    let f = h.fails(&["restore", &image, "--opencl-device", "fast"]);
    assert!(f.stderr.contains("--opencl-device fast") && f.stderr.contains("hint: "), "{}", f.stderr);
    let out = h.command(&["restore", &image, "--name", "bd2", "--opencl-device", "0:7"]).env("POCL_DEVICES", DEVICES).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a restore onto device 0:7 cannot succeed");
    assert!(err.contains("no OpenCL device 0:7") && err.contains("0:1"), "names the devices here: {err}");
    // The image is intact: it restores where it can.
    restore(&h, &image, "bd3", &[]);
    wait("the copy to make progress", Duration::from_secs(30), || h.last_step("bd3").is_some());
}

/// clpeak (Debian's package; nobody here wrote it), checkpointed in the middle of its
/// bandwidth test and restored onto the other device, where it finishes its run.
fn clpeak_moves_mid_run_and_finishes(mode: &str) {
    let h = Hiber::new(&format!("ocl-clpeak-{mode}"));
    let args = ["-p", "0", "-d", "0", "--global-bandwidth", "--compute-sp", "--kernel-latency"];
    start(&h, mode, "cp", &PathBuf::from("clpeak"), &args);
    wait("clpeak to start its bandwidth test", Duration::from_secs(60), || h.log("cp").contains("Global memory bandwidth"));
    std::thread::sleep(Duration::from_secs(2));
    let image = h.images_dir().join("cp").display().to_string();
    h.ok(&["checkpoint", "cp", "--out", &image]);
    let before = h.log("cp");
    assert!(!before.contains("Kernel launch latency"), "checkpointed before its end: {before}");
    let s = opencl_section(&image);
    let p = &s["processes"][0];
    // Its bandwidth buffers, hundreds of MiB of them, went into the image.
    assert!(p["bytes"].as_u64().unwrap() >= 256 << 20, "{s}");
    assert!(p["objects"]["programs"].as_u64().unwrap() >= 1, "{s}");
    restore(&h, &image, "cp2", &["--opencl-device", "0:1"]);
    let state = h.wait_done("cp2", Duration::from_secs(180));
    let log = h.log("cp2");
    assert_eq!(state, "exited(0)", "{}", common::tail(&log));
    for section in ["Single-precision compute", "Kernel launch latency"] {
        assert!(log.contains(section), "the restored clpeak ran its {section} test: {}", common::tail(&log));
    }
}

/// A program made from a device's binary cannot move to another device, and the restore
/// says so; on its own device it restores.
fn a_binary_program_stays_on_its_device(mode: &str) {
    let h = Hiber::new(&format!("ocl-binary-{mode}"));
    let bin = program(&h, "stencil");
    let args = ["300", "4096", "0", "10", "binary"];
    start(&h, mode, "bn", &bin, &args);
    h.wait_step("bn", 10);
    let image = h.images_dir().join("bn").display().to_string();
    h.ok(&["checkpoint", "bn", "--out", &image]);
    let out = h.command(&["restore", &image, "--name", "bn-moved", "--opencl-device", "0:1"]).env("POCL_DEVICES", DEVICES).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a binary cannot move to another device");
    assert!(err.contains("binary") && err.contains("cannot move"), "{err}");
    restore(&h, &image, "bn2", &[]);
    h.assert_verified("bn2", Duration::from_secs(60));
    assert!(devices_in(&h.log("bn2"))[0].starts_with(BASIC));
}

/// hiber SIGKILLed after the layer released its objects (held at the `quiesced` barrier):
/// the program waits at the layer's gate, and `hiber recover` has the layer make its
/// objects again and loads their bytes back from the partial image; the program goes on
/// with the trajectory of an uninterrupted run.
fn hiber_killed_after_the_release_recovers(mode: &str) {
    let h = Hiber::new(&format!("ocl-recover-{mode}"));
    let bin = program(&h, "stencil");
    let args = ["200", "16384", "0", "10"];
    let want = reference(&bin, &args);
    start(&h, mode, "rv", &bin, &args);
    h.wait_step("rv", 20);
    let image = h.images_dir().join("rv").display().to_string();
    let mut hiber = h
        .command(&["checkpoint", "rv", "--leave-running", "--out", &image])
        .env("HIBER_PAUSE_AT", "quiesced")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    h.wait_journal("quiesced", "hiber to hold at the quiesced barrier");
    std::thread::sleep(Duration::from_millis(300));
    hiber.kill().unwrap();
    hiber.wait().unwrap();
    // The program's objects are released and its gate closed: it makes no progress.
    let at = h.last_step("rv").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(h.last_step("rv"), Some(at), "the program waits at the gate");
    let out = h.output(&["recover"]);
    let rec = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && rec.contains("running again"), "{rec}");
    h.assert_verified("rv", Duration::from_secs(60));
    assert_continues(&want, &h.progress("rv"), 1);
    assert!(!PathBuf::from(&image).exists(), "no image from the interrupted checkpoint");
}

/// A process the engine claimed that ends during the checkpoint (killed while hiber waits
/// at the `captured` barrier, after its device state was taken): the checkpoint fails, with
/// `--leave-running` and when it would stop the job, rather than commit an image whose
/// device state has no process to go back into; no image is left, and the rest of the job
/// runs on to its own check on an uninterrupted run's trajectory.
fn a_process_that_ends_during_the_checkpoint_fails_it(mode: &str) {
    let h = Hiber::new(&format!("ocl-ended-{mode}"));
    let bin = program(&h, "stencil");
    let args = ["1500", "4096", "0", "10"];
    let want = reference(&bin, &args);
    let cmd = format!("{b} {a} >/dev/null 2>&1 & {b} {a} >/dev/null 2>&1 & {b} {a}; wait", b = bin.display(), a = args.join(" "));
    let out = h
        .command(&["run", &format!("--opencl={mode}"), "--name", "ke", "--", "sh", "-c", &cmd])
        .env("POCL_DEVICES", DEVICES)
        .env("HIBER_OPENCL_POISON", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "hiber run failed: {}", String::from_utf8_lossy(&out.stderr));
    h.wait_step("ke", 20);
    let root = h.pid_of("ke");
    let children = || -> Vec<i32> {
        std::fs::read_to_string(format!("/proc/{root}/task/{root}/children")).unwrap_or_default().split_whitespace().filter_map(|p| p.parse().ok()).collect()
    };
    // The two in the background, started first; the third prints the job's progress.
    let mut background = children();
    background.sort_unstable();
    assert_eq!(background.len(), 3, "three programs under the shell: {background:?}");
    for (victim, mode) in background[..2].iter().zip(["--leave-running", "--stop"]) {
        let image = h.images_dir().join(format!("ke{victim}")).display().to_string();
        let mut argv = vec!["checkpoint", "ke", "--out", &image];
        if mode == "--leave-running" {
            argv.push(mode);
        }
        let mut hiber = h
            .command(&argv)
            .env("HIBER_PAUSE_AT", "captured")
            .env("HIBER_PAUSE_MS", "4000")
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Up to a minute on a loaded machine (three programs drained); a hiber that ends
        // before it gets there says why.
        let journal = h.state.join("journal");
        let at_captured =
            || std::fs::read_dir(&journal).into_iter().flatten().flatten().any(|e| std::fs::read_to_string(e.path()).is_ok_and(|t| t.contains("\"captured\"")));
        let start = std::time::Instant::now();
        while !at_captured() {
            if let Some(status) = hiber.try_wait().unwrap() {
                let mut err = String::new();
                std::io::Read::read_to_string(hiber.stderr.as_mut().unwrap(), &mut err).unwrap();
                panic!("{mode}: hiber ended ({status}) before the captured barrier: {err}");
            }
            assert!(start.elapsed() < Duration::from_secs(60), "{mode}: hiber did not reach the captured barrier in 60 s");
            std::thread::sleep(Duration::from_millis(25));
        }
        // SAFETY: kill has no memory preconditions; the PID is a child of the job's shell.
        assert_eq!(unsafe { libc::kill(*victim, libc::SIGKILL) }, 0);
        let out = hiber.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{mode}: the checkpoint must fail once a claimed process ended: {err}");
        assert!(err.contains(&format!("process {victim} ")) && err.contains("ended during the checkpoint"), "{mode}: {err}");
        assert!(!PathBuf::from(&image).exists(), "{mode}: no image");
        assert_eq!(h.state_of("ke"), "running", "{mode}: the job runs on");
    }
    h.assert_verified("ke", Duration::from_secs(120));
    assert_continues(&want, &h.progress("ke"), 1);
}

/// A program that enqueues without pause (so a checkpoint nearly always catches a thread
/// waiting at the layer's gate inside an enqueue), checkpointed with --leave-running three
/// times: every call after each replay must reach the new objects, which its own check of
/// every step against the host shows.
fn checkpoints_in_a_tight_enqueue_loop(mode: &str) {
    let h = Hiber::new(&format!("ocl-tight-{mode}"));
    let bin = program(&h, "stencil");
    // Long enough (about 6 s alone) to still run at the third checkpoint on a loaded
    // machine: with 4000 steps it once ended before (three test binaries at once).
    start(&h, mode, "tl", &bin, &["20000", "4096", "0", "0"]);
    h.wait_step("tl", 100);
    for i in 0..3 {
        let image = h.images_dir().join(format!("tl{i}")).display().to_string();
        let at = h.last_step("tl").unwrap();
        h.ok(&["checkpoint", "tl", "--leave-running", "--out", &image]);
        h.wait_step("tl", at + 200);
    }
    h.assert_verified("tl", Duration::from_secs(120));
}

/// PyOpenCL (Debian's python3-pyopencl): its arrays, its generated kernels and its events.
/// It keeps built programs in a cache and loads them as binaries, which cannot move to
/// another device (the restore says so); with its cache off (PYOPENCL_NO_CACHE) it builds
/// from source and moves.
fn pyopencl_restores_and_moves_without_its_binary_cache(mode: &str) {
    let h = Hiber::new(&format!("ocl-pyopencl-{mode}"));
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/opencl/pyopencl_loop.py");
    let python = PathBuf::from("/usr/bin/python3");
    let args = [script.to_str().unwrap(), "300", "0", "0.01"];
    // Warm its cache, so the job below loads its programs as binaries.
    let warm = Command::new(&python).args([script.to_str().unwrap(), "2", "0", "0"]).env("POCL_DEVICES", DEVICES).output().unwrap();
    assert!(warm.status.success(), "{}", String::from_utf8_lossy(&warm.stderr));
    start(&h, mode, "py", &python, &args);
    h.wait_step("py", 20);
    let image = h.images_dir().join("py").display().to_string();
    h.ok(&["checkpoint", "py", "--out", &image]);
    let out = h.command(&["restore", &image, "--name", "py-moved", "--opencl-device", "0:1"]).env("POCL_DEVICES", DEVICES).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("binary"), "a cached binary does not move: {err}");
    restore(&h, &image, "py2", &[]);
    h.assert_verified("py2", Duration::from_secs(90));

    let mut cmd = h.command(&["run", &format!("--opencl={mode}"), "--name", "nc", "--"]);
    cmd.arg(&python).args(args).env("POCL_DEVICES", DEVICES).env("HIBER_OPENCL_POISON", "1").env("PYOPENCL_NO_CACHE", "1");
    assert!(cmd.output().unwrap().status.success());
    h.wait_step("nc", 20);
    let image = h.images_dir().join("nc").display().to_string();
    h.ok(&["checkpoint", "nc", "--out", &image]);
    let at = h.last_step("nc").unwrap();
    restore(&h, &image, "nc2", &["--opencl-device", "0:1"]);
    h.assert_verified("nc2", Duration::from_secs(90));
    assert_eq!(h.progress("nc2")[0].0, at + 1);
    assert!(devices_in(&h.log("nc2"))[0].starts_with(PTHREAD), "{:?}", devices_in(&h.log("nc2")));
}

/// The preemption loop of an inference job, incrementally. The program keeps 160 MiB of
/// weights it never changes and a small state it updates every step. Its second checkpoint
/// shares the weights with the first image instead of writing them (the job's latest image
/// is the parent by default); the first image is then removed, and the second still
/// restores, and the program goes on identically. A job restored from an image takes that
/// image as the parent of its first checkpoint, and `--no-parent` writes everything.
fn an_unchanged_model_is_shared_with_the_parent_image_and_outlives_it(mode: &str) {
    let h = Hiber::new(&format!("ocl-weights-{mode}"));
    let bin = program(&h, "weights");
    // Long enough that the restored copy still runs through two more checkpoints on a loaded
    // machine (400 steps ended before the fourth, once, in CI).
    let args = ["1000", "160", "0", "10"];
    let want = reference(&bin, &args);
    start(&h, mode, "wt", &bin, &args);
    h.wait_step("wt", 20);
    let checkpoint = |job: &str, out: &str, extra: &[&str]| -> serde_json::Value {
        let mut a = vec!["checkpoint", job, "--out", out, "--json"];
        a.extend_from_slice(extra);
        serde_json::from_str(&h.ok(&a)).unwrap()
    };
    let weights = 160u64 << 20;
    let first = h.images_dir().join("wt1").display().to_string();
    let r1 = checkpoint("wt", &first, &["--leave-running"]);
    assert_eq!(r1["shared_bytes"], 0, "a job's first image is whole: {r1}");
    // Where the pause went, step by step, in order; together nearly all of it.
    let steps = r1["pause_steps"].as_array().unwrap();
    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
    assert_eq!(names, ["opencl quiesce", "opencl capture", "criu dump", "opencl resume"], "{r1}");
    let sum: f64 = steps.iter().map(|s| s["seconds"].as_f64().unwrap()).sum();
    let paused = r1["paused_seconds"].as_f64().unwrap();
    assert!(sum <= paused && paused - sum < 0.5, "the steps ({sum} s) are the pause ({paused} s): {r1}");
    h.wait_step("wt", h.last_step("wt").unwrap() + 10);
    let second = h.images_dir().join("wt2").display().to_string();
    let r2 = checkpoint("wt", &second, &["--leave-running"]);
    assert!(r2["shared_bytes"].as_u64().unwrap() >= weights, "the weights are shared: {r2}");
    assert_eq!(r2["parent"].as_str().unwrap(), first, "{r2}");
    let written = r2["image_bytes"].as_u64().unwrap() - r2["shared_bytes"].as_u64().unwrap();
    let ocl = opencl_section(&second)["processes"][0]["bytes"].as_u64().unwrap();
    assert!(ocl >= weights, "{ocl}");
    let inspect = h.ok(&["inspect", &second]);
    assert!(inspect.contains("parent ") && inspect.contains("shared with it"), "{inspect}");
    let ls = h.ok(&["ls"]);
    assert!(ls.lines().any(|l| l.contains("wt2") && l.contains("shared with wt1")), "{ls}");
    let whole = r1["image_bytes"].as_u64().unwrap();
    assert!(written + weights <= whole + (whole >> 4), "the second image wrote {written} bytes, the first {whole}");

    // The first image goes; the second is whole without it.
    h.ok(&["rm", "-f", "wt"]);
    h.ok(&["rm", &first]);
    assert!(!PathBuf::from(&first).exists());
    h.ok(&["inspect", &second]);
    restore(&h, &second, "wt3", &[]);
    h.wait_step("wt3", h.progress("wt3").first().map(|p| p.0).unwrap_or(0) + 5);
    let from = h.progress("wt3")[0].0;
    // The restored job's first checkpoint shares with the image it came from.
    let third = h.images_dir().join("wt3img").display().to_string();
    let r3 = checkpoint("wt3", &third, &["--leave-running"]);
    assert!(r3["shared_bytes"].as_u64().unwrap() >= weights, "{r3}");
    assert_eq!(r3["parent"].as_str().unwrap(), second);
    let fourth = h.images_dir().join("wt4img").display().to_string();
    let r4 = checkpoint("wt3", &fourth, &["--no-parent"]);
    assert_eq!(r4["shared_bytes"], 0, "{r4}");
    h.ok(&["rm", &second, &third]);
    restore(&h, &fourth, "wt4", &[]);
    h.assert_verified("wt4", Duration::from_secs(120));
    assert_continues(&want, &h.progress("wt3"), from);
    let last = h.progress("wt4");
    assert_continues(&want, &last, last[0].0);
}

/// `--compress`: the device data that compresses is stored as zstd frames (and the image
/// says so), what does not is stored as it is, and the program restores and goes on
/// identically.
fn compressed_chunks_restore_identically(mode: &str) {
    let h = Hiber::new(&format!("ocl-zstd-{mode}"));
    let bin = program(&h, "weights");
    let args = ["200", "64", "0", "10", "small"];
    let want = reference(&bin, &args);
    start(&h, mode, "wz", &bin, &args);
    h.wait_step("wz", 20);
    let image = h.images_dir().join("wz").display().to_string();
    let r: serde_json::Value = serde_json::from_str(&h.ok(&["checkpoint", "wz", "--out", &image, "--compress=3", "--json"])).unwrap();
    let at = h.last_step("wz").unwrap();
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(PathBuf::from(&image).join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["format"]["minor"], 2, "compressed images are format 1.2");
    let zstd: Vec<&serde_json::Value> = m["files"].as_array().unwrap().iter().filter(|f| f["encoding"] == "zstd").collect();
    assert!(!zstd.is_empty(), "the weights' chunks are compressed: {r}");
    let stored: u64 = zstd.iter().map(|f| f["size"].as_u64().unwrap()).sum();
    assert!(stored < (64 << 20) / 4, "64 MiB of small integers stored in {stored} bytes");
    let inspect = h.ok(&["inspect", &image]);
    assert!(inspect.contains("device data chunks with zstd"), "{inspect}");
    restore(&h, &image, "wz2", &[]);
    h.assert_verified("wz2", Duration::from_secs(120));
    assert_continues(&want, &h.progress("wz2"), at + 1);
}

/// Event callbacks survive a checkpoint: one registered on a user event before the
/// checkpoint runs, once, when the restored program sets the event; every step's kernel
/// event callback runs exactly once, including those whose command finished just before
/// the layer released the real events. Checked by the program itself, on the other device.
fn event_callbacks_run_once_across_a_checkpoint(mode: &str) {
    let h = Hiber::new(&format!("ocl-callbacks-{mode}"));
    let bin = program(&h, "callbacks");
    let args = ["300", "150", "0", "5"];
    let want = reference(&bin, &args);
    start(&h, mode, "cb", &bin, &args);
    h.wait_step("cb", 40);
    let image = h.images_dir().join("cb").display().to_string();
    h.ok(&["checkpoint", "cb", "--out", &image]);
    let at = h.last_step("cb").unwrap();
    assert!(at < 150, "the checkpoint falls before the user event is set (step {at})");
    restore(&h, &image, "cb2", &["--opencl-device", "0:1"]);
    h.assert_verified("cb2", Duration::from_secs(120));
    assert_continues(&want, &h.progress("cb2"), at + 1);
}

/// The host PIDs of `root` and its descendants.
fn tree_of(root: i32) -> Vec<i32> {
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        out.extend(children_of(out[i]));
        i += 1;
    }
    out
}

fn children_of(pid: i32) -> Vec<i32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    text.split_whitespace().filter_map(|p| p.parse().ok()).collect()
}

fn maps_of(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default()
}

fn alive(pid: i32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists() && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ")
}

/// The OpenCL proxy listener of the test's state directory (`hiber __opencl-proxy --listen`
/// on its socket).
fn listener_of(h: &Hiber) -> Option<i32> {
    let sock = h.state.join("opencl-proxy.sock").display().to_string();
    std::fs::read_dir("/proc").ok()?.flatten().filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok()).find(|pid| {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        args.contains(&&b"__opencl-proxy"[..]) && args.contains(&sock.as_bytes())
    })
}

/// Proxy mode, what it is for: no process of the job (a computing one, and a child that
/// only lists the platforms, as hwloc's OpenCL plugin does in launchers' daemons) ever
/// maps the platform's library; each has a proxy process of its own beside the job, outside
/// its tree, and none of them outlives the checkpoint. The image restores onto the other
/// device with a new proxy, and both programs carry on exactly.
#[test]
fn proxy_keeps_the_platform_out_of_the_job_and_its_image() {
    let h = Hiber::new("ocl-proxy-tree");
    let bin = program(&h, "stencil");
    let disc = program(&h, "discover");
    let args = ["300", "65536", "0", "10"];
    let want = reference(&bin, &args);
    let script = format!("{} 60 50 & d=$!; {} {}; s=$?; wait $d; [ $s = 0 ] && [ $? = 0 ]", disc.display(), bin.display(), args.join(" "));
    let out = h
        .command(&["run", "--opencl=proxy", "--name", "pt", "--", "sh", "-c", &script])
        .env("POCL_DEVICES", DEVICES)
        .env("HIBER_OPENCL_POISON", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "hiber run failed: {}", String::from_utf8_lossy(&out.stderr));
    h.wait_step("pt", 30);
    wait("the discovery child to list", Duration::from_secs(20), || h.log("pt").contains("listed 1 2"));
    let tree = tree_of(h.pid_of("pt"));
    assert!(tree.len() >= 3, "sh, the discovery child and the stencil: {tree:?}");
    for p in &tree {
        assert!(!maps_of(*p).contains("libpocl"), "process {p} of the job mapped the platform's library");
    }
    let listener = listener_of(&h).expect("the OpenCL proxy listens");
    assert!(!tree.contains(&listener), "the proxy is not in the job's tree");
    let workers = children_of(listener);
    assert_eq!(workers.len(), 2, "a proxy process for each process that called OpenCL: {workers:?}");
    for w in &workers {
        assert!(maps_of(*w).contains("libpocl"), "the platform is in the proxy process {w}");
    }

    let image = h.images_dir().join("pt").display().to_string();
    h.ok(&["checkpoint", "pt", "--out", &image]);
    let at = h.last_step("pt").unwrap();
    let alive_at: u64 = h.log("pt").lines().filter_map(|l| l.strip_prefix("alive ")?.parse().ok()).max().unwrap();
    // Each proxy process ended once its process let go of its objects; the listener ends
    // with the job.
    wait("the proxies to end", Duration::from_secs(10), || workers.iter().all(|w| !alive(*w)) && !alive(listener));
    let s = opencl_section(&image);
    let procs = s["processes"].as_array().unwrap();
    assert_eq!(procs.len(), 2, "{s}");
    assert!(procs.iter().all(|p| p["proxy"] == true), "{s}");

    restore(&h, &image, "pt2", &["--opencl-device", "0:1"]);
    h.wait_step("pt2", at + 5);
    for p in tree_of(h.pid_of("pt2")) {
        assert!(!maps_of(p).contains("libpocl"), "restored process {p} mapped the platform's library");
    }
    let listener2 = listener_of(&h).expect("the restored job has a proxy of its own");
    let log = h.assert_verified("pt2", Duration::from_secs(60));
    assert!(log.contains("listed again 1 2"), "the discovery child lists again after the restore:\n{log}");
    let resumed: u64 = log.lines().filter_map(|l| l.strip_prefix("alive ")?.parse().ok()).min().unwrap();
    assert_eq!(resumed, alive_at + 1, "the discovery child goes on where it stopped");
    assert!(devices_in(&log).iter().all(|d| d.starts_with(PTHREAD)), "{:?}", devices_in(&log));
    assert_continues(&want, &h.progress("pt2"), at + 1);
    wait("the restored job's proxy to end with it", Duration::from_secs(10), || !alive(listener2));
}

/// The proxy of a process killed while the process computes: the process's next call fails
/// with an OpenCL error (the program stops as it would on any OpenCL error), and the layer's
/// log says why. A process that runs on (one that only listed the platforms) shows in
/// `hiber ls` as broken.
#[test]
fn proxy_killed_mid_run_fails_the_next_call() {
    let h = Hiber::new("ocl-proxy-killed");
    let bin = program(&h, "stencil");
    let disc = program(&h, "discover");
    start(&h, "proxy", "pk", &bin, &["100000", "4096", "0", "10"]);
    start(&h, "proxy", "pd", &disc, &["100000", "50"]);
    h.wait_step("pk", 10);
    wait("the discovery job to list", Duration::from_secs(20), || h.log("pd").contains("listed 1 2"));
    let listener = listener_of(&h).expect("the OpenCL proxy listens");
    let workers = children_of(listener);
    assert_eq!(workers.len(), 2, "a proxy process for each job's process: {workers:?}");
    for w in workers {
        // SAFETY: kill(2) on a PID this test just read as the proxy's child.
        assert_eq!(unsafe { libc::kill(w, libc::SIGKILL) }, 0);
    }
    let state = h.wait_done("pk", Duration::from_secs(20));
    assert_ne!(state, "exited(0)");
    let stderr = std::fs::read_to_string(h.state.join("jobs/pk/stderr.log")).unwrap_or_default();
    assert!(stderr.contains("= -5"), "the program saw CL_OUT_OF_RESOURCES: {stderr}");
    let layer = std::fs::read_to_string(h.state.join("jobs/pk/opencl.log")).unwrap_or_default();
    assert!(layer.contains("OpenCL proxy did not answer") || layer.contains("OpenCL proxy did not take"), "{layer}");
    wait("hiber ls to show the discovery job broken", Duration::from_secs(10), || {
        let ls: serde_json::Value = serde_json::from_str(&h.ok(&["ls", "--json"])).unwrap();
        ls["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|j| j["name"] == "pd" && j["state"] == "running" && j["problem"].as_str().is_some_and(|b| b.contains("OpenCL proxy")))
    });
    assert!(h.ok(&["ls"]).contains("broken: the OpenCL proxy of process"), "{}", h.ok(&["ls"]));
}

/// Bulk transfers through the proxy (blocking writes and reads of 80 MiB: three of the
/// proxy's staging pieces, the last one short) go straight between the process's memory
/// and the proxy's, and every byte read back is the one written (bandwidth.c compares
/// them); with that path turned off they stream through the channel, with the same bytes.
/// Either way the context is destroyed when the program releases it (the proxy's staging
/// in it does not keep it alive).
#[test]
fn proxy_bulk_transfers_go_straight_to_the_processes_memory() {
    let h = Hiber::new("ocl-proxy-bulk");
    let bin = compile(&h, "bench/opencl", "bandwidth");
    for (name, peer) in [("bw", "1"), ("bwc", "0")] {
        let out = h
            .command(&["run", "--opencl=proxy", "--name", name, "--", &bin.display().to_string(), "2", "80", "1"])
            .env("POCL_DEVICES", DEVICES)
            .env("HIBER_OPENCL_PEER_MEMORY", peer)
            .output()
            .unwrap();
        assert!(out.status.success(), "hiber run failed: {}", String::from_utf8_lossy(&out.stderr));
        let state = h.wait_done(name, Duration::from_secs(120));
        let log = h.log(name);
        assert_eq!(state, "exited(0)", "{log}");
        assert_eq!(log.lines().filter(|l| l.starts_with("gbs ")).count(), 2, "{log}");
        // The proxy's page-locked staging in the context did not keep it alive.
        assert!(log.contains("context destroyed"), "{log}");
        let layer = std::fs::read_to_string(h.state.join(format!("jobs/{name}/opencl.log"))).unwrap_or_default();
        assert_eq!(layer.contains("bulk transfers go straight between"), peer == "1", "{name}: {layer}");
    }
}

/// A process that forks after its first OpenCL calls: the child's calls get a proxy of its
/// own, and the parent's go on through its own (a child that used its parent's connection
/// would break it). In inline mode the same program is the baseline.
fn a_child_forked_after_opencl_calls_opencl_too(mode: &str) {
    let h = Hiber::new(&format!("ocl-forks-{mode}"));
    let bin = program(&h, "forks");
    start(&h, mode, "fk", &bin, &["200", "20", "0", "10"]);
    let log = h.assert_verified("fk", Duration::from_secs(60));
    assert!(log.contains("child ok"), "{log}");
    assert_eq!(h.progress("fk").len(), 200, "{log}");
}

/// A child forked after its parent's OpenCL calls that never calls OpenCL itself (a
/// multiprocessing worker, say) holds nothing of its parent's proxy: the job is checkpointed
/// while both run, and its copy restores and finishes.
fn a_forked_child_that_never_calls_opencl_is_checkpointed(mode: &str) {
    let h = Hiber::new(&format!("ocl-forkidle-{mode}"));
    let bin = program(&h, "forks");
    let args = ["300", "20", "0", "10", "idle"];
    start(&h, mode, "fi", &bin, &args);
    h.wait_step("fi", 60);
    assert!(h.log("fi").contains("child idle"));
    let image = h.images_dir().join("fi").display().to_string();
    h.ok(&["checkpoint", "fi", "--leave-running", "--out", &image]);
    let at = h.last_step("fi").unwrap();
    h.assert_verified("fi", Duration::from_secs(60));
    restore(&h, &image, "fi2", &[]);
    h.assert_verified("fi2", Duration::from_secs(60));
    let resumed = h.progress("fi2");
    assert!(resumed.first().is_some_and(|(s, _)| *s <= at + 1) && resumed.last().is_some_and(|(s, _)| *s == 299), "{resumed:?}");
}

/// A job that runs one OpenCL program after another (a shell script), checkpointed during
/// the first and restored under a new name: the second program, started by the restored
/// shell, reaches the restored job's proxy (in proxy mode), not the first job's, which ended.
fn the_next_program_of_a_restored_job_finds_its_proxy(mode: &str) {
    let h = Hiber::new(&format!("ocl-next-{mode}"));
    let bin = program(&h, "stencil");
    let script = format!("{b} 100 4096 0 10 && {b} 50 4096 1 0", b = bin.display());
    let opencl = format!("--opencl={mode}");
    let out = h.command(&["run", &opencl, "--name", "nx", "--", "sh", "-c", &script]).env("POCL_DEVICES", DEVICES).output().unwrap();
    assert!(out.status.success(), "hiber run failed: {}", String::from_utf8_lossy(&out.stderr));
    h.wait_step("nx", 20);
    let image = h.images_dir().join("nx").display().to_string();
    h.ok(&["checkpoint", "nx", "--out", &image]);
    restore(&h, &image, "nx2", &[]);
    let log = h.assert_verified("nx2", Duration::from_secs(60));
    assert_eq!(log.lines().filter(|l| l.starts_with("verify ok")).count(), 2, "both programs ran to the end:\n{log}");
}

/// A queue released while its work waits on a user event that another thread sets later,
/// the main thread waiting on another queue meanwhile: every call returns, and the work ran.
/// (In proxy mode the release is posted; a platform that finishes the queue in its release
/// blocks there until the event is set, which is why setting it goes ahead of the posts.
/// PoCL's release does not block, so this passes here with or without that.)
fn a_user_event_set_while_a_release_waits_for_it(mode: &str) {
    let h = Hiber::new(&format!("ocl-userevent-{mode}"));
    let bin = program(&h, "userevent");
    start(&h, mode, "ue", &bin, &["1"]);
    h.assert_verified("ue", Duration::from_secs(30));
}

/// `--opencl` takes only its modes.
#[test]
fn a_bad_opencl_mode_is_refused() {
    let h = Hiber::new("ocl-badmode");
    let out = h.output(&["run", "--opencl=remote", "--", "true"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("invalid value 'remote'") && stderr.contains("proxy"), "{stderr}");
    assert!(!h.ok(&["ls"]).contains("true"), "a refused run leaves no job");
}

/// Every test above twice: with the layer calling the platform in the application
/// (`inline`), and through the job's OpenCL proxy (`proxy`).
macro_rules! in_both_modes {
    ($($name:ident),* $(,)?) => {
        mod inline {
            $(#[test] fn $name() { super::$name("inline") })*
        }
        mod proxy {
            $(#[test] fn $name() { super::$name("proxy") })*
        }
    };
}

in_both_modes!(
    a_user_event_set_while_a_release_waits_for_it,
    the_next_program_of_a_restored_job_finds_its_proxy,
    a_forked_child_that_never_calls_opencl_is_checkpointed,
    a_child_forked_after_opencl_calls_opencl_too,
    stencil_moves_to_the_other_device_and_goes_on_identically,
    two_queues_leave_running_then_two_restores,
    images_and_a_sampler_round_trip_and_move,
    a_chain_of_checkpoints_keeps_the_trajectory,
    features_it_cannot_recreate_are_refused_before_anything_stops,
    a_device_that_is_not_here_is_refused_with_the_list,
    clpeak_moves_mid_run_and_finishes,
    a_binary_program_stays_on_its_device,
    hiber_killed_after_the_release_recovers,
    a_process_that_ends_during_the_checkpoint_fails_it,
    checkpoints_in_a_tight_enqueue_loop,
    pyopencl_restores_and_moves_without_its_binary_cache,
    an_unchanged_model_is_shared_with_the_parent_image_and_outlives_it,
    compressed_chunks_restore_identically,
    event_callbacks_run_once_across_a_checkpoint,
);
