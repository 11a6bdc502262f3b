//! Bad input gets a one-line reason and a hint, a documented exit code, and loses nothing:
//! the application keeps running and no partial image is left.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

const NOT_FOUND: i32 = 3;
const INVALID_IMAGE: i32 = 4;

fn still_progressing(h: &Hiber, job: &str) {
    let now = h.last_step(job).unwrap_or(0);
    h.wait_step(job, now + 3);
    assert_eq!(h.state_of(job), "running");
}

/// A finished checkpoint of a small job, for tampering with.
fn image(h: &Hiber, name: &str) -> std::path::PathBuf {
    h.start(name, &["cpu", "--steps", "400", "--mem-mib", "8"]);
    h.wait_step(name, 3);
    let img = h.images_dir().join(name);
    h.ok(&["checkpoint", name, "--leave-running", "--out", img.to_str().unwrap()]);
    img
}

#[test]
fn unknown_job_and_pid() {
    let h = Hiber::new("unknown");
    let f = h.fails(&["checkpoint", "no-such-job"]);
    assert_eq!(f.code, NOT_FOUND, "{}", f.stderr);
    assert!(f.stderr.contains("no job named 'no-such-job'"), "{}", f.stderr);
    let f = h.fails(&["checkpoint", "999999"]);
    assert_eq!(f.code, NOT_FOUND, "{}", f.stderr);
    assert!(f.stderr.contains("no process with PID 999999"), "{}", f.stderr);
    let f = h.fails(&["logs", "nope"]);
    assert_eq!(f.code, NOT_FOUND);
    let f = h.fails(&["restore", "/nonexistent/image"]);
    assert_eq!(f.code, NOT_FOUND, "{}", f.stderr);
    let f = h.fails(&["rm", "nothing-here"]);
    assert_eq!(f.code, NOT_FOUND);
}

#[test]
fn processes_hiber_may_not_trace() {
    let h = Hiber::new("untraceable");
    // kthreadd: a kernel thread.
    let f = h.fails(&["checkpoint", "2"]);
    assert!(f.stderr.contains("kernel thread"), "{}", f.stderr);
    // This test process is an ancestor of the hiber it runs.
    let f = h.fails(&["checkpoint", &std::process::id().to_string()]);
    assert!(f.stderr.contains("hiber itself or one of its ancestors"), "{}", f.stderr);
    // A process with a controlling terminal, made with script(1).
    let marker = h.scratch.join("tty-pid");
    let mut script = Command::new("script")
        .args(["-qfc", &format!("sh -c 'echo $$ > {}; exec sleep 60'", marker.display()), "/dev/null"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("script(1) from util-linux");
    wait("the terminal process", Duration::from_secs(10), || std::fs::read_to_string(&marker).is_ok_and(|s| s.trim().parse::<i32>().is_ok()));
    let pid: i32 = std::fs::read_to_string(&marker).unwrap().trim().parse().unwrap();
    let f = h.fails(&["checkpoint", &pid.to_string()]);
    assert!(f.stderr.contains("controlling terminal") && f.stderr.contains("hint: "), "{}", f.stderr);
    assert!(alive(pid), "refusing did not harm it");
    let _ = script.kill();
    let _ = script.wait();
}

#[test]
fn corrupt_truncated_newer_and_foreign_images() {
    let h = Hiber::new("badimg");
    let img = image(&h, "badimg");
    let pages = std::fs::read_dir(img.join("criu"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().unwrap().to_str().unwrap().starts_with("pages-"))
        .unwrap();
    let original = std::fs::read(&pages).unwrap();

    // One flipped byte.
    let mut bytes = original.clone();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&pages, &bytes).unwrap();
    let f = h.fails(&["inspect", img.to_str().unwrap()]);
    assert_eq!(f.code, INVALID_IMAGE);
    assert!(f.stderr.contains("checksum mismatch") && f.stderr.contains(pages.file_name().unwrap().to_str().unwrap()), "{}", f.stderr);
    let f = h.fails(&["restore", img.to_str().unwrap(), "--name", "never"]);
    assert_eq!(f.code, INVALID_IMAGE);
    assert!(!h.state.join("jobs/never").exists(), "a refused restore creates no job");

    // Truncated.
    std::fs::write(&pages, &original[..original.len() / 3]).unwrap();
    let f = h.fails(&["restore", img.to_str().unwrap()]);
    assert_eq!(f.code, INVALID_IMAGE);
    assert!(f.stderr.contains("truncated") && f.stderr.contains("pages-"), "{}", f.stderr);
    std::fs::write(&pages, &original).unwrap();
    h.ok(&["inspect", img.to_str().unwrap()]);

    // Missing and extra files.
    std::fs::rename(&pages, h.scratch.join("aside")).unwrap();
    assert!(h.fails(&["inspect", img.to_str().unwrap()]).stderr.contains("missing"));
    std::fs::rename(h.scratch.join("aside"), &pages).unwrap();
    std::fs::write(img.join("criu/stray.img"), b"x").unwrap();
    assert!(h.fails(&["inspect", img.to_str().unwrap()]).stderr.contains("not listed"));
    std::fs::remove_file(img.join("criu/stray.img")).unwrap();

    // From a newer format.
    let mpath = img.join("manifest.json");
    let manifest = std::fs::read_to_string(&mpath).unwrap();
    std::fs::write(&mpath, manifest.replacen("\"major\": 1", "\"major\": 2", 1)).unwrap();
    let f = h.fails(&["restore", img.to_str().unwrap()]);
    assert_eq!(f.code, INVALID_IMAGE);
    assert!(f.stderr.contains("format 2.1 is not supported"), "{}", f.stderr);
    std::fs::write(&mpath, &manifest).unwrap();

    // Not an image at all: a plain directory, a file, garbage in the manifest.
    let f = h.fails(&["restore", h.scratch.to_str().unwrap()]);
    assert_eq!(f.code, INVALID_IMAGE);
    assert!(f.stderr.contains("not a hiber image"), "{}", f.stderr);
    let f = h.fails(&["inspect", "/etc/hostname"]);
    assert_eq!(f.code, INVALID_IMAGE);
    std::fs::write(&mpath, b"\x7fELF garbage").unwrap();
    assert!(h.fails(&["inspect", img.to_str().unwrap()]).stderr.contains("manifest is corrupt"));
    // rm refuses to delete what is not an image.
    let f = h.fails(&["rm", h.scratch.to_str().unwrap()]);
    assert!(f.stderr.contains("not removing"), "{}", f.stderr);
    assert!(h.scratch.exists());
}

#[test]
fn restore_whose_open_files_are_missing() {
    let h = Hiber::new("missingfile");
    let data = h.scratch.join("data.txt");
    h.start("mf", &["files", "--path", data.to_str().unwrap(), "--steps", "100"]);
    h.wait_step("mf", 10);
    let img = h.images_dir().join("mf");
    h.ok(&["checkpoint", "mf", "--out", img.to_str().unwrap()]);
    let aside = h.scratch.join("data.aside");
    std::fs::rename(&data, &aside).unwrap();
    let f = h.fails(&["restore", img.to_str().unwrap(), "--name", "mf-r"]);
    assert!(f.stderr.contains(data.to_str().unwrap()) && f.stderr.contains("is missing"), "{}", f.stderr);
    assert!(f.stderr.contains("hint: put the file back"), "{}", f.stderr);
    assert!(!h.state.join("jobs/mf-r").exists());
    // Put back, the same image restores and finishes intact.
    std::fs::rename(&aside, &data).unwrap();
    h.ok(&["restore", img.to_str().unwrap(), "--name", "mf-r"]);
    h.assert_verified("mf-r", Duration::from_secs(60));
}

#[test]
fn output_directory_that_exists() {
    let h = Hiber::new("exists");
    h.start("ex", &["cpu", "--steps", "400", "--mem-mib", "8"]);
    h.wait_step("ex", 3);
    let out = h.scratch.join("taken");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("precious"), b"keep me").unwrap();
    let f = h.fails(&["checkpoint", "ex", "--out", out.to_str().unwrap()]);
    assert!(f.stderr.contains("already exists"), "{}", f.stderr);
    assert_eq!(std::fs::read(out.join("precious")).unwrap(), b"keep me");
    still_progressing(&h, "ex");
}

#[test]
fn a_parent_that_is_no_image_is_refused_before_anything_stops() {
    let h = Hiber::new("badparent");
    h.start("bp", &["cpu", "--steps", "400", "--mem-mib", "8"]);
    h.wait_step("bp", 3);
    let junk = h.scratch.join("junk");
    std::fs::create_dir(&junk).unwrap();
    let out = h.scratch.join("img");
    for parent in [junk.to_str().unwrap(), "no-such-image"] {
        let f = h.fails(&["checkpoint", "bp", "--out", out.to_str().unwrap(), "--parent", parent]);
        assert!(f.stderr.contains("the parent image cannot be used"), "{}", f.stderr);
        assert!(f.stderr.contains("--no-parent"), "the hint names the way out: {}", f.stderr);
        assert!(!out.exists(), "no image");
        still_progressing(&h, "bp");
    }
    // --parent and --no-parent contradict each other.
    let o = h.output(&["checkpoint", "bp", "--parent", "x", "--no-parent"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("cannot be used with"));
    still_progressing(&h, "bp");
}

/// `hiber ARGS` with a tmpfs of `size` at `small`, mounted in a mount namespace of its own.
/// Returns its output and how many entries it left in the tmpfs. A job sees the host's
/// mounts as they were when it started, and CRIU needs them again at restore: a mount that
/// came and went on the host would break the restore of every job another test started
/// meanwhile (seen in CI: "Can't stat mountpoint .../scratch/small").
fn on_small_fs(h: &Hiber, small: &Path, size: &str, args: &[&str], env: &[(&str, &str)]) -> (std::process::Output, usize) {
    std::fs::create_dir_all(small).unwrap();
    let script = format!("mount -t tmpfs -o size={size} tmpfs \"$0\" || exit 99; \"$@\"; rc=$?; echo \"left-in-tmpfs $(ls -A \"$0\" | wc -l)\" >&2; exit $rc");
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .arg(small)
        .arg(HIBER)
        .args(args)
        .env("HIBER_STATE", &h.state)
        .env_remove("HIBER_LOG")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(99), "mount a small tmpfs (needs root): {stderr}");
    let left = stderr.lines().rev().find_map(|l| l.strip_prefix("left-in-tmpfs ")).and_then(|n| n.trim().parse().ok()).expect("the tmpfs was listed");
    (out, left)
}

#[test]
fn full_disk_during_checkpoint() {
    let h = Hiber::new("full");
    let small = h.scratch.join("small");
    h.start("full", &["cpu", "--steps", "600", "--mem-mib", "96"]);
    h.wait_step("full", 3);
    let out = small.join("img");
    let args = ["checkpoint", "full", "--out", out.to_str().unwrap()];
    // Refused up front when the image clearly cannot fit...
    let (f, _) = on_small_fs(&h, &small, "48m", &args, &[]);
    let stderr = String::from_utf8_lossy(&f.stderr);
    assert!(!f.status.success() && stderr.contains("not enough space"), "{stderr}");
    still_progressing(&h, "full");
    // ...and when the disk fills during the dump itself, CRIU fails, the tree resumes and
    // the partial image is removed.
    let (out2, left) = on_small_fs(&h, &small, "48m", &args, &[("HIBER_NO_SPACE_CHECK", "1")]);
    let stderr = String::from_utf8_lossy(&out2.stderr);
    assert!(!out2.status.success());
    assert!(stderr.contains("checkpoint failed") && stderr.contains("keeps running") && !stderr.contains("panicked"), "{stderr}");
    assert_eq!(left, 0, "no partial image left");
    still_progressing(&h, "full");
    // With room, the same job checkpoints fine and its image verifies.
    let img = h.images_dir().join("full");
    h.ok(&["checkpoint", "full", "--leave-running", "--out", img.to_str().unwrap()]);
    h.ok(&["inspect", img.to_str().unwrap()]);
}

#[test]
fn usage_errors_and_names() {
    let h = Hiber::new("usage");
    let out = h.output(&["checkpoint"]);
    assert_eq!(out.status.code(), Some(2));
    let f = h.fails(&["run", "--name", "../escape", "--", "true"]);
    assert!(f.stderr.contains("not a valid job name"), "{}", f.stderr);
    let f = h.fails(&["run", "--", "/no/such/program"]);
    assert!(f.stderr.contains("cannot run '/no/such/program'"), "{}", f.stderr);
    assert!(!h.ok(&["ls"]).contains("program"), "a failed run leaves no job");
    h.start("dup", &["cpu", "--steps", "400", "--mem-mib", "1"]);
    let f = h.fails(&["run", "--name", "dup", "--", "true"]);
    assert!(f.stderr.contains("already exists"), "{}", f.stderr);
    let f = h.fails(&["rm", "dup"]);
    assert!(f.stderr.contains("is running") && f.stderr.contains("rm -f dup"), "{}", f.stderr);
    let f = h.fails(&["restore", "x", "--gpu-map", "nonsense"]);
    assert!(f.stderr.contains("--gpu-map"), "{}", f.stderr);
    // A mistyped option of hiber's is refused as one, not run as the command; the
    // command's own options after its name still reach it.
    let out = h.output(&["run", "--bogus", "--", "sleep", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("unexpected argument '--bogus'") && !stderr.contains("cannot run"), "{stderr}");
    assert!(!h.ok(&["ls"]).contains("bogus"), "a refused run leaves no job");
    h.ok(&["run", "--name", "own-options", "sh", "-c", "echo its-own-options"]);
    wait("the job's output", Duration::from_secs(10), || h.log("own-options").contains("its-own-options"));
}

/// A restore refuses an image that another user could have written (as sshd refuses keys
/// others can write): CRIU would run what it holds as root. `--trust-image` restores a
/// private copy instead, verified where nobody else can change it.
#[test]
fn images_others_could_write_are_refused_unless_trusted() {
    let h = Hiber::new("trust");
    let img = image(&h, "trust");
    let before = h.progress("trust");
    h.ok(&["rm", "-f", "trust"]);
    let path = img.to_str().unwrap();
    let chmod = |p: &Path, mode: u32| std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    let manifest = img.join("manifest.json");
    let criu = img.join("criu");
    for (what, p, bad, good) in [("image directory", &img, 0o777, 0o700), ("criu/", &criu, 0o777, 0o700), ("manifest", &manifest, 0o666, 0o600)] {
        chmod(p, bad);
        let f = h.fails(&["restore", path, "--name", "never"]);
        assert_eq!(f.code, INVALID_IMAGE, "{what}: {}", f.stderr);
        assert!(f.stderr.contains("not trusted") && f.stderr.contains("writable by others"), "{what}: {}", f.stderr);
        assert!(f.stderr.contains("--trust-image"), "{what}: the hint names the override: {}", f.stderr);
        assert!(!h.state.join("jobs/never").exists(), "a refused restore creates no job");
        chmod(p, good);
    }
    std::os::unix::fs::chown(&manifest, Some(65534), None).unwrap();
    let f = h.fails(&["restore", path, "--name", "never"]);
    assert!(f.stderr.contains("owned by uid 65534"), "{}", f.stderr);
    // Trusted explicitly: restored from a private copy, which is gone afterwards.
    chmod(&img, 0o777);
    h.ok(&["restore", path, "--name", "trusted", "--trust-image"]);
    assert_eq!(h.job("trusted")["restored_from"], path, "the job names the image the user gave");
    assert!(std::fs::read_dir(h.state.join("untrusted-copies")).unwrap().next().is_none(), "the private copy is removed");
    // One a killed restore left (named after its hiber, gone) goes at the next command.
    let stale = h.state.join("untrusted-copies/999999999-1");
    std::fs::create_dir_all(stale.join("criu")).unwrap();
    h.ok(&["ls"]);
    assert!(!stale.exists(), "a killed restore's private copy is swept");
    h.wait_step("trusted", before.last().unwrap().0 + 5);
    // The image was taken with --leave-running, a little before `before` ends.
    let first = h.progress("trusted")[0].0;
    assert!(first > 1 && first <= before.last().unwrap().0 + 1, "the copy goes on from the checkpoint, not from the start ({first})");
    assert_continues(&before, &h.progress("trusted"), first);
}

/// A manifest (its checksum made to match) that names a file outside the image is an
/// invalid image, named as such, not "a missing file".
#[test]
fn a_manifest_naming_a_path_outside_the_image_is_invalid() {
    let h = Hiber::new("escape");
    let img = image(&h, "escape");
    let mpath = img.join("manifest.json");
    let text = std::fs::read_to_string(&mpath).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    m["files"][0]["path"] = "../../etc/passwd".into();
    let crafted = serde_json::to_vec_pretty(&m).unwrap();
    std::fs::write(&mpath, &crafted).unwrap();
    std::fs::write(img.join("manifest.blake3"), format!("{}\n", blake3::hash(&crafted).to_hex())).unwrap();
    for verb in ["inspect", "restore"] {
        let f = h.fails(&[verb, img.to_str().unwrap()]);
        assert_eq!(f.code, INVALID_IMAGE, "{}", f.stderr);
        assert!(f.stderr.contains("'../../etc/passwd', which is not a path inside the image") && !f.stderr.contains("missing"), "{verb}: {}", f.stderr);
    }
}

/// A job allowed io_uring (`--allow-io-uring`) that holds one is refused before anything is
/// stopped, with the process and the descriptor named; the job runs on untouched.
#[test]
fn io_uring_is_refused_before_anything_is_stopped() {
    let h = Hiber::new("uring");
    let script = [
        "import ctypes, os, time",
        "libc = ctypes.CDLL(None, use_errno=True)",
        "params = ctypes.create_string_buffer(120)",
        "fd = libc.syscall(425, 4, params)  # io_uring_setup(4 entries)",
        "print('ring', fd, os.readlink(f'/proc/self/fd/{fd}'), flush=True)",
        "n = 0",
        "while True:",
        "    n += 1",
        "    print('tick', n, flush=True)",
        "    time.sleep(0.05)",
    ]
    .join("\n");
    h.ok(&["run", "--name", "uring", "--allow-io-uring", "--", "python3", "-c", &script]);
    wait("the ring to open", Duration::from_secs(20), || h.log("uring").contains("ring "));
    let ring_line = h.log("uring").lines().find(|l| l.starts_with("ring ")).unwrap().to_string();
    assert!(ring_line.ends_with("anon_inode:[io_uring]"), "the kernel gave an io_uring: {ring_line}");
    let fd = ring_line.split_whitespace().nth(1).unwrap().to_string();
    let img = h.images_dir().join("uring");
    let f = h.fails(&["checkpoint", "uring", "--out", img.to_str().unwrap()]);
    assert_eq!(f.code, 1, "{}", f.stderr);
    assert!(f.stderr.contains(&format!("holds descriptor {fd} (anon_inode:[io_uring])")), "{}", f.stderr);
    assert!(f.stderr.contains("(python3)") && f.stderr.contains("the application keeps running"), "{}", f.stderr);
    assert!(f.stderr.contains("hint: ") && f.stderr.contains("without --allow-io-uring"), "{}", f.stderr);
    assert!(!img.exists() && std::fs::read_dir(h.images_dir()).map(|mut d| d.next().is_none()).unwrap_or(true), "no image, no partial image");
    let ticks = |h: &Hiber| h.log("uring").lines().filter(|l| l.starts_with("tick ")).count();
    let before = ticks(&h);
    wait("the job to go on ticking", Duration::from_secs(10), || ticks(&h) >= before + 3);
    assert_eq!(h.state_of("uring"), "running");
}

/// By default a job is kept off io_uring: the kernel answers ENOSYS (as without io_uring),
/// in the job and in the children it starts, before and after a checkpoint and restore
/// (CRIU carries the seccomp filter), and the job checkpoints as any other.
#[test]
fn jobs_are_kept_off_io_uring_through_checkpoint_and_restore() {
    let h = Hiber::new("noring");
    let script = [
        "import ctypes, os, subprocess, sys, time",
        "libc = ctypes.CDLL(None, use_errno=True)",
        "def ring():",
        "    r = libc.syscall(425, 4, ctypes.create_string_buffer(120))  # io_uring_setup(4 entries)",
        "    return f'{r} errno {ctypes.get_errno()}'",
        "child = subprocess.run([sys.executable, '-c', 'import ctypes; l = ctypes.CDLL(None, use_errno=True); print(l.syscall(425, 4, ctypes.create_string_buffer(120)), ctypes.get_errno())'], capture_output=True, text=True).stdout.strip()",
        "def errno_of(nr, *args):",
        "    libc.syscall(nr, *args)",
        "    return ctypes.get_errno()",
        "# Its neighbours pass the filter: pidfd_send_signal (424) and open_tree (428) fail on their bad arguments.",
        "print('neighbours', errno_of(424, -1, 0, None, 0), errno_of(428, -1, b'', 0), flush=True)",
        "print('ring', ring(), 'child', child, flush=True)",
        "n = 0",
        "while True:",
        "    n += 1",
        "    if n % 10 == 0:",
        "        print('ring', ring(), flush=True)",
        "    print('tick', n, flush=True)",
        "    time.sleep(0.02)",
    ]
    .join("\n");
    h.ok(&["run", "--name", "noring", "--", "python3", "-c", &script]);
    wait("the first ring attempt", Duration::from_secs(20), || h.log("noring").contains("ring "));
    let enosys = "38"; // ENOSYS on x86_64 and aarch64
    let first = h.log("noring").lines().find(|l| l.starts_with("ring ")).unwrap().to_string();
    assert_eq!(first, format!("ring -1 errno {enosys} child -1 {enosys}"), "the job and its child get ENOSYS");
    let neighbours = h.log("noring").lines().find(|l| l.starts_with("neighbours ")).unwrap().to_string();
    assert!(neighbours.split_whitespace().skip(1).all(|e| e != enosys && e != "0"), "only io_uring is refused: {neighbours}");
    let img = h.images_dir().join("noring");
    h.ok(&["checkpoint", "noring", "--out", img.to_str().unwrap()]);
    h.ok(&["restore", img.to_str().unwrap(), "--name", "noring-r"]);
    let rings = |h: &Hiber| h.log("noring-r").lines().filter(|l| l.starts_with("ring ")).map(str::to_string).collect::<Vec<_>>();
    wait("the restored job to try again", Duration::from_secs(20), || !rings(&h).is_empty());
    assert!(rings(&h).iter().all(|l| *l == format!("ring -1 errno {enosys}")), "still off io_uring after restore: {:?}", rings(&h));
    let pid = h.pid_of("noring-r");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.lines().any(|l| l.replace(char::is_whitespace, "") == "Seccomp:2"), "the filter is in place:\n{status}");
}

/// A copy in a network namespace of its own needs iproute2's `ip` for CRIU to save that
/// namespace: without it, the checkpoint is refused before anything is stopped.
#[test]
fn isolated_copy_without_iproute2_is_refused_up_front() {
    let h = Hiber::new("noip");
    let img = image(&h, "noip");
    h.ok(&["restore", img.to_str().unwrap(), "--name", "noip-iso", "--isolate-net"]);
    let stderr = refused_without_tools(&h, "noip-iso", "ip");
    assert!(stderr.contains("network namespace of its own") && stderr.contains("`ip`") && stderr.contains("iproute2"), "{stderr}");
}

/// `hiber checkpoint JOB` with CRIU found but nothing on PATH (no `tool` beside CRIU
/// either): it must fail, leave no image, and the job must go on. Returns its stderr.
fn refused_without_tools(h: &Hiber, job: &str, tool: &str) -> String {
    let criu = Command::new("sh").args(["-c", "command -v criu"]).output().unwrap();
    let criu = String::from_utf8_lossy(&criu.stdout).trim().to_string();
    assert!(!criu.is_empty() && !Path::new(&criu).with_file_name(tool).exists(), "this test needs a CRIU without {tool} beside it: {criu}");
    let out = h
        .command(&["checkpoint", job, "--out", h.scratch.join("never").to_str().unwrap()])
        .env("PATH", "/nonexistent")
        .env("HIBER_CRIU", &criu)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!h.scratch.join("never").exists());
    still_progressing(h, job);
    stderr
}

/// A job's own /dev/shm goes into its image through CRIU's `tar`: without it, the
/// checkpoint is refused before anything is stopped.
#[test]
fn job_without_tar_is_refused_up_front() {
    let h = Hiber::new("notar");
    h.start("notar", &["cpu", "--steps", "400", "--mem-mib", "8"]);
    h.wait_step("notar", 3);
    let stderr = refused_without_tools(&h, "notar", "tar");
    assert!(stderr.contains("`tar`") && stderr.contains("/dev/shm") && stderr.contains("install tar"), "{stderr}");
}

/// A user who is not root is told that permission was denied, and to run hiber as root,
/// where hiber once said "no job named X" or "not a hiber image".
#[test]
fn a_user_who_is_not_root_is_told_permission_was_denied() {
    let h = Hiber::new("nonroot");
    let img = image(&h, "mine");
    // A copy of the binary that user may run, and an image whose manifest only root reads.
    let bin = h.scratch.join("hiber");
    std::fs::copy(HIBER, &bin).unwrap();
    let open = |p: &Path, mode: u32| std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    open(&h.scratch, 0o755);
    open(&bin, 0o755);
    let readable = h.scratch.join("readable");
    std::fs::create_dir(&readable).unwrap();
    open(&readable, 0o755);
    std::fs::write(readable.join("manifest.json"), b"{}").unwrap();
    open(&readable.join("manifest.json"), 0o600);
    let as_nobody = |args: &[&str]| {
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&bin)
            .args(args)
            .env("HIBER_STATE", &h.state)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} should fail for nobody");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    for args in
        [&["checkpoint", "mine"][..], &["rm", "-f", "mine"], &["logs", "mine"], &["inspect", img.to_str().unwrap()], &["inspect", readable.to_str().unwrap()]]
    {
        let stderr = as_nobody(args);
        assert!(stderr.contains("Permission denied") && stderr.contains("hint: hiber's jobs and images are root's"), "{args:?}: {stderr}");
        assert!(!stderr.contains("no job named") && !stderr.contains("not a hiber image") && !stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    assert_eq!(h.state_of("mine"), "running", "the job runs on");
}

/// A job record or a journal entry that cannot be read is named once, with its path, by
/// `hiber ls` and `hiber recover`, instead of being skipped in silence; the other jobs are
/// listed as before.
#[test]
fn corrupt_job_records_and_journal_entries_are_named() {
    let h = Hiber::new("corrupt-records");
    h.start("fine", &["cpu", "--steps", "400", "--mem-mib", "1"]);
    let broken = h.start("broken", &["cpu", "--steps", "400", "--mem-mib", "1"]);
    let record = h.state.join("jobs/broken/job.json");
    std::fs::write(&record, b"{ not json").unwrap();
    std::fs::create_dir_all(h.state.join("journal")).unwrap();
    let entry = h.state.join("journal/checkpoint-1-2.json");
    std::fs::write(&entry, b"\x00garbage").unwrap();
    for (args, lists) in [(&["ls"][..], true), (&["ls", "--json"], true), (&["recover"], false)] {
        let out = h.output(args);
        assert!(out.status.success(), "{args:?}");
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(stderr.contains(&format!("hiber: skipped {}", record.display())), "{args:?}: {stderr}");
        assert_eq!(stderr.matches(record.to_str().unwrap()).count(), 1, "said once: {stderr}");
        if args[0] == "recover" {
            assert!(stderr.contains(&format!("hiber: skipped {}", entry.display())) && stderr.contains("corrupt"), "{stderr}");
            assert!(!stdout.contains("nothing to recover"), "not 'nothing' when something was skipped: {stdout}");
        }
        if lists {
            assert!(stdout.contains("fine") && !stdout.contains("\"broken\""), "{args:?}: {stdout}");
        }
    }
    // SAFETY: kill with a PID of this test's own job.
    unsafe { libc::kill(broken, libc::SIGKILL) };
}

/// A reader that went away (`hiber ls | head`) ends a verb that only prints as it ends other
/// tools, by SIGPIPE: no panic, no backtrace.
#[test]
fn a_closed_pipe_ends_printing_verbs_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let h = Hiber::new("epipe");
    h.ok(&["run", "--name", "p", "--", "sleep", "600"]);
    for verb in [&["ls"][..], &["logs", "p"][..], &["ls", "--json"][..]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = h.command(verb).stdout(writer).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "hiber {verb:?} panicked on a closed pipe:\n{stderr}");
        if verb[0] == "ls" {
            assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "hiber {verb:?}: {:?}", out.status);
        }
    }
}
