//! Checkpoint and restore of real process trees through a real CRIU. Every test asserts
//! the restored program's own state: it resumes at the next step, its checksums match
//! the original's trajectory, and its end-to-end self-check passes.

mod common;

use std::time::Duration;

use common::*;

const LONG: Duration = Duration::from_secs(120);

/// Checkpoint (stopping the job), restore, and check the copy finishes intact.
fn stop_and_restore(h: &Hiber, job: &str, at: u64) -> String {
    let pid = h.pid_of(job);
    h.wait_step(job, at);
    h.ok(&["checkpoint", job, "--out", h.images_dir().join(job).to_str().unwrap()]);
    wait("the original to stop", Duration::from_secs(10), || !alive(pid));
    assert_eq!(h.state_of(job), "checkpointed");
    let before = h.progress(job);
    let restored = format!("{job}-r");
    h.ok(&["restore", h.images_dir().join(job).to_str().unwrap(), "--name", &restored]);
    h.assert_verified(&restored, LONG);
    assert_continues(&before, &h.progress(&restored), before.last().unwrap().0 + 1);
    restored
}

#[test]
fn single_threaded_process() {
    let h = Hiber::new("single");
    h.start("single", &["cpu", "--steps", "120", "--mem-mib", "16"]);
    stop_and_restore(&h, "single", 20);
}

#[test]
fn multi_threaded_process() {
    let h = Hiber::new("threads");
    h.start("threads", &["threads", "--threads", "6", "--steps", "120"]);
    let image = h.images_dir().join("threads");
    h.wait_step("threads", 20);
    h.ok(&["checkpoint", "threads", "--out", image.to_str().unwrap()]);
    let inspect = h.ok(&["inspect", image.to_str().unwrap()]);
    assert!(inspect.contains("threads 7"), "1 main + 6 workers recorded:\n{inspect}");
    h.ok(&["restore", image.to_str().unwrap(), "--name", "threads-r"]);
    let log = h.assert_verified("threads-r", LONG);
    assert!(log.contains("verify ok threads 6 steps 120"), "{log}");
}

#[test]
fn process_tree_connected_by_a_pipe() {
    let h = Hiber::new("pipe");
    h.start("pipe", &["pipe", "--steps", "120"]);
    h.wait_step("pipe", 20);
    let image = h.images_dir().join("pipe");
    h.ok(&["checkpoint", "pipe", "--out", image.to_str().unwrap()]);
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(image.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["processes"].as_array().unwrap().len(), 2, "writer and reader are both in the image");
    let before = h.progress("pipe");
    h.ok(&["restore", image.to_str().unwrap(), "--name", "pipe-r"]);
    let log = h.assert_verified("pipe-r", LONG);
    // The reader checked every line it got through the restored pipe, in order.
    assert!(log.contains("reader ok received 120 of 120"), "{}", tail(&log));
    assert_continues(&before, &h.progress("pipe-r"), before.last().unwrap().0 + 1);
}

#[test]
fn process_with_open_regular_files() {
    let h = Hiber::new("files");
    let data = h.scratch.join("records.txt");
    h.start("files", &["files", "--path", data.to_str().unwrap(), "--steps", "120"]);
    stop_and_restore(&h, "files", 20);
    let text = std::fs::read_to_string(&data).unwrap();
    assert_eq!(text.lines().count(), 120, "every record exactly once");
}

#[test]
fn one_gib_of_anonymous_memory() {
    let h = Hiber::new("bigmem");
    h.start("bigmem", &["cpu", "--steps", "80", "--mem-mib", "1024"]);
    h.wait_step("bigmem", 10);
    let image = h.images_dir().join("bigmem");
    h.ok(&["checkpoint", "bigmem", "--out", image.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&h.ok(&["inspect", "--json", image.to_str().unwrap()])).unwrap();
    let pages: u64 =
        v["manifest"]["files"].as_array().unwrap().iter().filter(|f| f["path"].as_str().unwrap().contains("pages-")).map(|f| f["size"].as_u64().unwrap()).sum();
    assert!(pages >= 1 << 30, "the image holds the 1 GiB buffer: {pages} bytes of pages");
    let before = h.progress("bigmem");
    h.ok(&["restore", image.to_str().unwrap(), "--name", "bigmem-r"]);
    // The workload compares all 2^27 words of its buffer with a replay.
    h.assert_verified("bigmem-r", LONG);
    assert_continues(&before, &h.progress("bigmem-r"), before.last().unwrap().0 + 1);
}

#[test]
fn leave_running_keeps_the_original_and_the_image_restores_as_a_second_copy() {
    let h = Hiber::new("leave");
    let pid = h.start("leave", &["cpu", "--steps", "150", "--mem-mib", "32"]);
    h.wait_step("leave", 20);
    let image = h.images_dir().join("leave");
    let report: serde_json::Value =
        serde_json::from_str(&h.ok(&["checkpoint", "leave", "--leave-running", "--json", "--out", image.to_str().unwrap()])).unwrap();
    assert!(alive(pid), "the original still runs");
    // CRIU's own figures: the workload's 32 MiB were written, and the application's pause
    // (quiesce to resume, as hiber saw it) covers the time CRIU kept the tree frozen.
    assert!(report["criu_memory_bytes"].as_u64().unwrap() >= 32 << 20, "{report}");
    let (paused, frozen) = (report["paused_seconds"].as_f64().unwrap(), report["criu_frozen_seconds"].as_f64().unwrap());
    assert!(frozen > 0.0 && paused >= frozen && paused <= report["total_seconds"].as_f64().unwrap(), "{report}");
    // Where the pause went: with no device engine, CRIU's dump is the one step, and it holds
    // the frozen time.
    let steps = report["pause_steps"].as_array().unwrap();
    assert_eq!(steps.iter().map(|s| s["step"].as_str().unwrap()).collect::<Vec<_>>(), ["criu dump"], "{report}");
    let dump = steps[0]["seconds"].as_f64().unwrap();
    assert!(dump >= frozen && dump <= paused, "{report}");
    // CRIU wrote into a tmpfs of its own (the tests run as root), which is gone once the
    // image is in place.
    assert_eq!(report["criu_staged"], serde_json::json!(true), "{report}");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&*h.state.join("stage").to_string_lossy()), "no staging area left mounted");
    assert_eq!(std::fs::read_dir(h.state.join("stage")).map(|d| d.count()).unwrap_or(0), 0);
    let at = h.last_step("leave").unwrap();
    h.wait_step("leave", at + 5);
    h.ok(&["restore", image.to_str().unwrap(), "--name", "leave-copy"]);
    assert_eq!(h.state_of("leave"), "running", "original and copy run side by side");
    // A third copy in a network namespace of its own.
    h.ok(&["restore", image.to_str().unwrap(), "--name", "leave-iso", "--isolate-net"]);
    let net = |pid: i32| std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    assert_ne!(net(h.pid_of("leave-iso")), net(pid), "--isolate-net gives the copy its own network namespace");
    assert_eq!(net(h.pid_of("leave-copy")), net(pid));
    h.assert_verified("leave", LONG);
    h.assert_verified("leave-copy", LONG);
    h.assert_verified("leave-iso", LONG);
    assert_eq!(h.progress("leave-iso"), h.progress("leave-copy"));
    let copy = h.progress("leave-copy");
    let first = copy[0].0;
    assert!(first > 20 && first <= at + 1, "copy resumes at the checkpoint ({first})");
    assert_continues(&h.progress("leave"), &copy, first);
}

/// A staging area too small for CRIU (capped at 1 MiB here; in use, memory the estimate did
/// not see): CRIU fills it, resumes the tree, and the dump is made again into the image's
/// directory. The checkpoint succeeds, and its image restores on the trajectory.
#[test]
fn a_staging_area_that_fills_falls_back_to_the_image_directory() {
    let h = Hiber::new("stage-full");
    let pid = h.start("full", &["cpu", "--steps", "150", "--mem-mib", "32"]);
    h.wait_step("full", 20);
    let image = h.images_dir().join("full");
    let out =
        h.command(&["checkpoint", "full", "--leave-running", "--json", "--out", image.to_str().unwrap()]).env("HIBER_CRIU_STAGE_MIB", "1").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("filled its staging area"), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["criu_staged"], serde_json::json!(false), "{report}");
    assert!(report["criu_memory_bytes"].as_u64().unwrap() >= 32 << 20, "{report}");
    assert!(alive(pid));
    assert_eq!(std::fs::read_dir(h.state.join("stage")).map(|d| d.count()).unwrap_or(0), 0, "the stage is gone");
    let at = h.last_step("full").unwrap();
    h.ok(&["restore", image.to_str().unwrap(), "--name", "full-copy"]);
    h.assert_verified("full", LONG);
    h.assert_verified("full-copy", LONG);
    let copy = h.progress("full-copy");
    assert!(copy[0].0 > 20 && copy[0].0 <= at + 1, "the copy resumes at the checkpoint ({})", copy[0].0);
    assert_continues(&h.progress("full"), &copy, copy[0].0);
}

#[test]
fn restore_after_the_original_was_killed() {
    let h = Hiber::new("killed");
    let pid = h.start("killed", &["cpu", "--steps", "120", "--mem-mib", "16"]);
    h.wait_step("killed", 20);
    let image = h.images_dir().join("killed");
    h.ok(&["checkpoint", "killed", "--leave-running", "--out", image.to_str().unwrap()]);
    let original = h.progress("killed");
    h.ok(&["rm", "-f", "killed"]);
    assert!(!alive(pid));
    h.ok(&["restore", image.to_str().unwrap(), "--name", "revived"]);
    h.assert_verified("revived", LONG);
    let copy = h.progress("revived");
    assert_continues(&original, &copy, copy[0].0);
}

#[test]
fn two_copies_restored_side_by_side() {
    let h = Hiber::new("twins");
    h.start("twins", &["cpu", "--steps", "150", "--mem-mib", "16"]);
    h.wait_step("twins", 20);
    let image = h.images_dir().join("twins");
    h.ok(&["checkpoint", "twins", "--out", image.to_str().unwrap()]);
    let before = h.progress("twins");
    h.ok(&["restore", image.to_str().unwrap(), "--name", "a"]);
    h.ok(&["restore", image.to_str().unwrap(), "--name", "b"]);
    let (pa, pb) = (h.pid_of("a"), h.pid_of("b"));
    assert_ne!(pa, pb);
    assert!(alive(pa) && alive(pb), "both copies run at once");
    h.assert_verified("a", LONG);
    h.assert_verified("b", LONG);
    let next = before.last().unwrap().0 + 1;
    assert_continues(&before, &h.progress("a"), next);
    assert_continues(&before, &h.progress("b"), next);
    assert_eq!(h.progress("a"), h.progress("b"), "each copy has its own log, with the same trajectory");
}

#[test]
fn images_are_private_and_verified() {
    let h = Hiber::new("private");
    h.start("private", &["cpu", "--steps", "100", "--mem-mib", "8"]);
    h.wait_step("private", 5);
    h.ok(&["checkpoint", "private", "--leave-running"]);
    let images: Vec<_> = std::fs::read_dir(h.images_dir()).unwrap().flatten().collect();
    assert_eq!(images.len(), 1, "one image, no temporary left");
    let image = images[0].path();
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&image), 0o700);
    assert_eq!(mode(&image.join("criu")), 0o700);
    for f in std::fs::read_dir(image.join("criu")).unwrap().flatten() {
        assert_eq!(mode(&f.path()), 0o600, "{}", f.path().display());
    }
    assert_eq!(mode(&image.join("manifest.json")), 0o600);
    assert_eq!(mode(&image.join("manifest.blake3")), 0o600);
    let out = h.ok(&["inspect", image.to_str().unwrap()]);
    assert!(out.contains("format      1.1") && out.contains("verified    all"), "{out}");
    let ls = h.ok(&["ls"]);
    assert!(ls.contains("private") && ls.contains("running"), "{ls}");
}

/// The preemption loop: a job checkpointed and restored again and again, its copies
/// checkpointed in turn, stopping and `--leave-running` alternating, a leave-running copy
/// restored beside its still-running original, one in a network namespace of its own. After every cycle the copy must go on from
/// where the checkpoint caught it with the original's trajectory; the last one finishes
/// and verifies every word of its memory.
#[test]
fn six_checkpoint_restore_cycles_of_one_job() {
    let h = Hiber::new("cycles");
    h.start("c0", &["cpu", "--steps", "900", "--mem-mib", "16", "--interval-ms", "30"]);
    h.wait_step("c0", 5);
    let mut prev = "c0".to_string();
    for i in 1..=6 {
        let image = h.images_dir().join(format!("cycle{i}"));
        let copy = format!("c{i}");
        let leave_running = i % 2 == 0;
        let from = h.last_step(&prev).unwrap();
        let mut args = vec!["checkpoint", prev.as_str(), "--out", image.to_str().unwrap()];
        if leave_running {
            args.push("--leave-running");
        }
        h.ok(&args);
        let until = h.last_step(&prev).unwrap();
        if leave_running {
            assert_eq!(h.state_of(&prev), "running", "cycle {i}: the original runs on");
        } else {
            assert_eq!(h.state_of(&prev), "checkpointed", "cycle {i}: the original is stopped");
        }
        // One copy gets a network namespace of its own: it and its own copies (CRIU
        // restores that namespace) must go on cycling too.
        let mut restore = vec!["restore", image.to_str().unwrap(), "--name", copy.as_str()];
        if i == 4 {
            restore.push("--isolate-net");
        }
        h.ok(&restore);
        h.wait_step(&copy, until + 3);
        let ours = h.progress(&copy);
        let first = ours[0].0;
        assert!(first > from && first <= until + 1, "cycle {i}: the copy resumes where the checkpoint caught the job ({from} < {first} <= {}+1)", until);
        assert_continues(&h.progress(&prev), &ours, first);
        if leave_running {
            // Side by side for a while, then the original gives way to its copy.
            h.wait_step(&prev, until + 3);
            assert_continues(&h.progress(&prev), &h.progress(&copy), first);
            h.ok(&["rm", "-f", &prev]);
        }
        prev = copy;
    }
    let net = |pid: i32| std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    assert_ne!(net(h.pid_of(&prev)), net(std::process::id() as i32), "copies of an isolated copy stay isolated");
    h.assert_verified(&prev, LONG);
}

/// A job talking to itself over an established loopback TCP connection (the shape of a
/// launcher and its store, or a server and its client): CRIU dumps the sockets (which needs
/// hiber's CRIU patch on Linux 6.16 and newer, where SO_PASSCRED and SO_PASSSEC cannot be
/// read from a TCP socket) and restores the connection, with the job's own state: every
/// answer after restore is the one the exchange's running sum says it must be.
#[test]
fn established_tcp_connection_survives() {
    let h = Hiber::new("tcp");
    h.ok(&["run", "--name", "tcp", "--", "python3", "-c", TCP_PAIR]);
    let ticks = |h: &Hiber, job: &str| h.log(job).lines().filter(|l| l.starts_with("tick ")).map(str::to_string).collect::<Vec<_>>();
    wait("ticks", Duration::from_secs(20), || ticks(&h, "tcp").len() >= 10);
    let img = h.images_dir().join("tcp");
    h.ok(&["checkpoint", "tcp", "--out", img.to_str().unwrap()]);
    let last: u64 = ticks(&h, "tcp").last().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    h.ok(&["restore", img.to_str().unwrap(), "--name", "tcp-r"]);
    wait("ticks after restore", Duration::from_secs(20), || ticks(&h, "tcp-r").len() >= 10);
    let after = ticks(&h, "tcp-r");
    assert!(after.iter().all(|l| l.ends_with(" ok")), "{after:?}");
    assert_eq!(after[0], format!("tick {} ok", last + 1), "the exchange goes on from where it stopped");
}

/// The path a GPU image's restore takes (CRIU leaves the tree stopped, device state is
/// restored, then the tree is continued), forced on a CPU job with HIBER_RESTORE_STOPPED:
/// both processes of a pipe-connected pair continue whole, from where they were.
#[test]
fn restore_through_a_stopped_tree() {
    let h = Hiber::new("stopped");
    h.start("stopped", &["pipe", "--steps", "120"]);
    h.wait_step("stopped", 20);
    let image = h.images_dir().join("stopped");
    h.ok(&["checkpoint", "stopped", "--out", image.to_str().unwrap()]);
    let before = h.progress("stopped");
    let out = h.command(&["restore", image.to_str().unwrap(), "--name", "stopped-r"]).env("HIBER_RESTORE_STOPPED", "1").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let log = h.assert_verified("stopped-r", LONG);
    assert!(log.contains("reader ok received 120 of 120"), "{}", tail(&log));
    assert_continues(&before, &h.progress("stopped-r"), before.last().unwrap().0 + 1);
}

/// A program that binds a socket named as CUDA's driver names the one it binds in every
/// CUDA process (`cuda-uvmfd-NS-PID`, NS its PID namespace's inode number), then counts.
const CUDA_LIKE: &str = r#"
import os, socket, time
ns = os.readlink("/proc/self/ns/pid")[5:-1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind("\0cuda-uvmfd-%s-%d" % (ns, os.getpid()))
s.listen(1)
print("ns", ns, flush=True)
n = 0
while True:
    print("tick", n, flush=True)
    n += 1
    time.sleep(0.05)
"#;

/// The preemption loop with other jobs in between: a job holding a CUDA-like socket is
/// checkpointed (stopping) and new jobs of the same kind start before it is restored. The
/// kernel would hand the stopped job's PID namespace number to the next new job, whose
/// socket would then take the name the restore binds again; `hiber run` keeps new jobs out
/// of namespaces whose numbers an image of this machine names (the machine's record, kept
/// by every checkpoint whatever its state directory), so the restore succeeds.
#[test]
fn new_jobs_leave_an_image_its_cuda_socket_names() {
    let h = Hiber::new("cudans");
    let ns_of = |h: &Hiber, job: &str| {
        wait("the job to bind its socket", Duration::from_secs(20), || h.log(job).starts_with("ns "));
        h.log(job).lines().next().unwrap().trim_start_matches("ns ").to_string()
    };
    h.ok(&["run", "--name", "first", "--", "python3", "-c", CUDA_LIKE]);
    let first = ns_of(&h, "first");
    let image = h.images_dir().join("first");
    let pid = h.pid_of("first");
    h.ok(&["checkpoint", "first", "--out", image.to_str().unwrap()]);
    wait("the original to stop", Duration::from_secs(10), || !alive(pid));
    // The kernel frees a namespace's number after an RCU grace period.
    std::thread::sleep(Duration::from_secs(1));
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(image.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["source"]["cuda_namespaces"], serde_json::json!([first.parse::<u64>().unwrap()]), "{}", manifest["source"]);
    // The first new job runs under another state directory: the record is the machine's.
    let elsewhere = Hiber::new("cudans-elsewhere");
    for i in 0..3 {
        let job = format!("other{i}");
        let h = if i == 0 { &elsewhere } else { &h };
        h.ok(&["run", "--name", &job, "--", "python3", "-c", CUDA_LIKE]);
        assert_ne!(ns_of(h, &job), first, "job {job} got the namespace number the image's socket is named after");
    }
    h.ok(&["restore", image.to_str().unwrap(), "--name", "first-r"]);
    let ticks = |h: &Hiber| h.log("first-r").lines().filter(|l| l.starts_with("tick")).count();
    let now = ticks(&h);
    wait("the restored job to go on", Duration::from_secs(20), || ticks(&h) > now + 5);
    assert_eq!(h.state_of("first-r"), "running");
}

/// Python's multiprocessing with the spawn start method (what torch.multiprocessing needs
/// for CUDA): its Queue's locks are named POSIX semaphores in /dev/shm, which glibc maps
/// under a temporary name it then removes while the semaphore keeps its own. hiber gives
/// each job a /dev/shm of its own, which goes into the image: the job is checkpointed with
/// `--leave-running`, and its image restores twice side by side, each copy's parent and
/// child going on with their exchange from where it was.
#[test]
fn multiprocessing_spawn_with_named_semaphores() {
    let h = Hiber::new("spawn");
    let script = [
        "import multiprocessing as mp, time",
        "def child(q, a):",
        "    total = 0",
        "    while (n := q.get()) is not None:",
        "        total += n",
        "        a.put(total)",
        "if __name__ == '__main__':",
        "    ctx = mp.get_context('spawn')",
        "    q, a = ctx.Queue(), ctx.Queue()",
        "    lock = ctx.Lock()",
        "    p = ctx.Process(target=child, args=(q, a)); p.start()",
        "    for n in range(1, 100000):",
        "        with lock:",
        "            q.put(n)",
        "            back = a.get()",
        "        print('tick', n, 'ok' if back == n * (n + 1) // 2 else f'BAD {back}', flush=True)",
        "        time.sleep(0.02)",
    ]
    .join("\n");
    let file = h.scratch.join("spawn.py");
    std::fs::write(&file, script).unwrap();
    h.ok(&["run", "--name", "spawn", "--", "python3", file.to_str().unwrap()]);
    let ticks = |h: &Hiber, job: &str| h.log(job).lines().filter(|l| l.starts_with("tick ")).map(str::to_string).collect::<Vec<_>>();
    wait("ticks", Duration::from_secs(30), || ticks(&h, "spawn").len() >= 10);
    let img = h.images_dir().join("spawn");
    h.ok(&["checkpoint", "spawn", "--leave-running", "--out", img.to_str().unwrap()]);
    let at = ticks(&h, "spawn").len();
    wait("ticks after the checkpoint", Duration::from_secs(20), || ticks(&h, "spawn").len() >= at + 10);
    assert!(ticks(&h, "spawn").iter().all(|l| l.ends_with(" ok")), "the original goes on undisturbed");
    h.ok(&["rm", "-f", "spawn"]);
    for copy in ["spawn-a", "spawn-b"] {
        h.ok(&["restore", img.to_str().unwrap(), "--name", copy]);
    }
    for copy in ["spawn-a", "spawn-b"] {
        wait("ticks after restore", Duration::from_secs(20), || ticks(&h, copy).len() >= 10);
        let after = ticks(&h, copy);
        assert!(after.iter().all(|l| l.ends_with(" ok")), "{copy}: {after:?}");
        let first: usize = after[0].split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(first > 10 && first <= at + 1, "{copy} goes on from the checkpoint (tick {first})");
    }
}

/// The lines of CRIU's log of each dump, oldest first (`HIBER_KEEP_CRIU_LOG=1` keeps them).
fn dump_logs(h: &Hiber) -> Vec<String> {
    let mut dirs: Vec<_> = std::fs::read_dir(h.state.join("logs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("dump-"))
        .collect();
    dirs.sort();
    dirs.iter().map(|d| std::fs::read_to_string(d.join("dump.log")).unwrap()).collect()
}

/// hiber's CRIU writes each process's pages from a writer of its own while it dumps the
/// next one (scripts/criu-patches/0002): a tree of two processes gets two writers, and its
/// image restores on the trajectory. With `HIBER_CRIU_WRITERS=0`, CRIU writes them itself.
#[test]
fn each_process_has_its_pages_written_by_a_writer_of_its_own() {
    let h = Hiber::new("writers");
    h.start("writers", &["pipe", "--steps", "120"]);
    h.wait_step("writers", 20);
    let checkpoint = |writers: &str, out: &str, extra: &[&str]| {
        let image = h.images_dir().join(out);
        let mut args = vec!["checkpoint", "writers", "--out", image.to_str().unwrap()];
        args.extend_from_slice(extra);
        let done = h.command(&args).env("HIBER_KEEP_CRIU_LOG", "1").env("HIBER_CRIU_WRITERS", writers).output().unwrap();
        assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    };
    checkpoint("0", "plain", &["--leave-running"]);
    checkpoint("2", "writers", &[]);
    let count = |what: &str| -> Vec<usize> { dump_logs(&h).iter().map(|log| log.lines().filter(|l| l.contains(what)).count()).collect() };
    assert_eq!(count("A page writer for"), vec![0, 2], "no writer with HIBER_CRIU_WRITERS=0, then one per process");
    // The page the parasite's cure writes into is taken again once the writers are done.
    assert_eq!(count("written again, after the parasite's cure"), vec![0, 2]);
    let before = h.progress("writers");
    h.ok(&["restore", h.images_dir().join("writers").to_str().unwrap(), "--name", "writers-r"]);
    let log = h.assert_verified("writers-r", LONG);
    assert!(log.contains("reader ok received 120 of 120"), "{}", tail(&log));
    assert_continues(&before, &h.progress("writers-r"), before.last().unwrap().0 + 1);
}
