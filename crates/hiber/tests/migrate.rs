//! `hiber migrate` between two "hosts": network namespaces joined by a veth pair, each with
//! a hiber of its own (its own state directory); the target runs `hiber serve`. The jobs
//! are real processes, their state checked after the move (every step's checksum, an
//! established TCP connection's running sums).

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::hosts::{hiber_in, net_of, Hosts};
use common::*;

fn run_in(ns: &str, h: &Hiber, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    hiber_in(ns, h, args).envs(env.iter().copied()).output().unwrap()
}

/// A `hiber serve` in `ns`; killed when dropped.
struct Server {
    child: Child,
}

impl Server {
    fn start(ns: &str, h: &Hiber, listen: &str, token: &Path, env: &[(&str, &str)]) -> Server {
        let mut cmd = hiber_in(ns, h, &["serve", "--listen", listen, "--token-file", token.to_str().unwrap(), "--timeout", "60"]);
        cmd.envs(env.iter().copied());
        Server::spawn(cmd)
    }

    fn spawn(mut cmd: Command) -> Server {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(line.starts_with("receiving jobs on"), "hiber serve did not start: {line:?}");
        Server { child }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Files a migration staged for this server and left in its state directory.
    fn leftovers(&self, h: &Hiber) -> usize {
        walk(&h.state.join("incoming"))
    }
}

/// Regular files under `dir` (none if it does not exist).
fn walk(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.flatten().map(|e| if e.path().is_dir() { walk(&e.path()) } else { 1 }).sum())
}

fn token(h: &Hiber, name: &str, secret: &str) -> PathBuf {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = h.scratch.join(name);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).unwrap();
    writeln!(f, "{secret}").unwrap();
    path
}

fn jobs(h: &Hiber) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(&h.ok(&["ls", "--json"])).unwrap();
    v["jobs"].as_array().unwrap().iter().map(|j| j["name"].as_str().unwrap().to_string()).collect()
}

/// The progress lines of a log have every step once, in order, from 0.
fn assert_whole_trajectory(steps: &[(u64, String)]) {
    for (i, (step, _)) in steps.iter().enumerate() {
        assert_eq!(*step, i as u64, "step {i} missing or repeated");
    }
}

/// A job moves from host A to host B, carries on from its step with the same checksums,
/// and is gone from A; its output so far comes with it. A second job, talking to itself over
/// an established TCP connection and checking every answer, moves too.
#[test]
fn a_job_moves_to_another_host_and_carries_on() {
    let (src, dst) = (Hiber::new("mig-src"), Hiber::new("mig-dst"));
    let hosts = Hosts::new();
    let tok = token(&src, "token", "0123456789abcdef0123456789abcdef");
    let listen = format!("{}:7301", hosts.b_addr);
    let server = Server::start(&hosts.b, &dst, &listen, &tok, &[]);
    let out = run_in(&hosts.a, &src, &["run", "--name", "w", "--", HIBER, "workload", "cpu", "--steps", "250", "--mem-mib", "32"], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    src.wait_step("w", 20);
    let out = run_in(&hosts.a, &src, &["migrate", "w", "--to", &listen, "--token-file", tok.to_str().unwrap(), "--json"], &[]);
    assert!(out.status.success(), "migrate failed: {}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["job"], "w");
    assert!(report["sent_bytes"].as_u64().unwrap() > 32 << 20, "{report}");
    assert!(jobs(&src).is_empty(), "the job is gone from the source: {:?}", jobs(&src));
    assert_eq!(net_of(dst.pid_of("w")), Hosts::net_inode(&hosts.b), "the job runs in host B's network namespace");
    let log = dst.assert_verified("w", Duration::from_secs(120));
    assert!(log.starts_with("start cpu"), "the output from before the move came along:\n{}", tail(&log));
    assert_whole_trajectory(&dst.progress("w"));
    assert_eq!(server.leftovers(&dst), 0, "nothing staged is left on the target");

    // A server and its client in one job, over an established TCP connection.

    let out = run_in(&hosts.a, &src, &["run", "--name", "tcp", "--", "python3", "-c", TCP_PAIR], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ticks = |h: &Hiber| h.log("tcp").lines().filter(|l| l.starts_with("tick ")).map(str::to_string).collect::<Vec<_>>();
    wait("ticks", Duration::from_secs(20), || ticks(&src).len() >= 10);
    let out = run_in(&hosts.a, &src, &["migrate", "tcp", "--to", &listen, "--token-file", tok.to_str().unwrap()], &[]);
    assert!(out.status.success(), "migrate failed: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(walk(&src.state.join("migrations")), 0, "the source's staged image is gone");
    let before = ticks(&dst).len();
    wait("ticks after the move", Duration::from_secs(20), || ticks(&dst).len() >= before + 10);
    let all = ticks(&dst);
    for (i, line) in all.iter().enumerate() {
        assert_eq!(line, &format!("tick {} ok", i + 1), "every answer right, none lost or repeated across the move");
    }
}

/// What the target would refuse is refused before the job stops: a wrong token, a name
/// taken there, no room there. The job runs on at the source, the same process, to its end.
#[test]
fn a_wrong_token_a_taken_name_or_no_room_is_refused_before_the_job_stops() {
    let (src, dst) = (Hiber::new("mig-refuse-src"), Hiber::new("mig-refuse-dst"));
    let hosts = Hosts::new();
    let tok = token(&src, "token", "the target's token, 32 bytes long");
    let wrong = token(&src, "wrong", "some other token of enough bytes");
    let listen = format!("{}:7302", hosts.b_addr);
    let out = run_in(&hosts.a, &src, &["run", "--name", "w", "--", HIBER, "workload", "cpu", "--steps", "300", "--mem-mib", "48"], &[]);
    assert!(out.status.success());
    let pid = src.pid_of("w");
    src.wait_step("w", 5);
    let migrate = |token: &Path, env: &[(&str, &str)]| {
        let out = run_in(&hosts.a, &src, &["migrate", "w", "--to", &listen, "--token-file", token.to_str().unwrap()], env);
        assert!(!out.status.success(), "the migration should have been refused");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(err.starts_with("hiber: ") && err.lines().count() <= 2 && !err.contains("panicked"), "{err}");
        err
    };
    {
        let _server = Server::start(&hosts.b, &dst, &listen, &tok, &[]);
        let err = migrate(&wrong, &[]);
        assert!(err.contains("does not hold this token"), "{err}");
        // A token file others can read is refused before anything else.
        let loose = token(&src, "loose", "0123456789abcdef0123456789abcdef");
        std::fs::set_permissions(&loose, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        let err = migrate(&loose, &[]);
        assert!(err.contains("can be read or written by others"), "{err}");
        // A job of that name on the target.
        assert!(dst.command(&["run", "--name", "w", "--", "sleep", "600"]).status().unwrap().success());
        let err = migrate(&tok, &[]);
        assert!(err.contains("a job named 'w' exists on the target"), "{err}");
        dst.ok(&["rm", "-f", "w"]);
    }
    // The target's state directory on a filesystem too small for the image, mounted in a
    // mount namespace of the target's own: a mount that comes and goes in this one would be
    // in the namespaces of jobs other tests start meanwhile, which CRIU needs at restore.
    {
        let small = dst.scratch.join("small");
        std::fs::create_dir_all(&small).unwrap();
        let script = format!(
            "mount -t tmpfs -o size=16m tmpfs {0} && exec nsenter -F --net={1} {HIBER} serve --listen {listen} --token-file {2} --timeout 60",
            small.display(),
            hosts.b,
            tok.display()
        );
        let mut cmd = Command::new("unshare");
        cmd.args(["--mount", "--propagation", "private", "sh", "-c", &script]).env("HIBER_STATE", small.join("state")).env_remove("HIBER_LOG");
        let _server = Server::spawn(cmd);
        let err = migrate(&tok, &[]);
        assert!(err.contains("no room on the target"), "{err}");
    }
    assert_eq!(src.pid_of("w"), pid, "the job never stopped");
    let log = src.assert_verified("w", Duration::from_secs(120));
    assert_whole_trajectory(&src.progress("w"));
    assert!(log.contains("verify ok"));
}

/// A failure at each step of a migration, before the source hands the job over, leaves the
/// job running at the source, the same process, with nothing left on the target; a target
/// killed mid-way leaves a stopped copy that its own `hiber recover` removes. Lost word
/// after the hand-over: the job runs at the target only, and the source keeps its image.
#[test]
fn failures_at_each_step_leave_the_job_running_at_the_source() {
    let (src, dst) = (Hiber::new("mig-fail-src"), Hiber::new("mig-fail-dst"));
    let hosts = Hosts::new();
    let tok = token(&src, "token", "0123456789abcdef0123456789abcdef");
    let listen = format!("{}:7303", hosts.b_addr);
    let out = run_in(&hosts.a, &src, &["run", "--name", "w", "--", HIBER, "workload", "cpu", "--steps", "2000", "--mem-mib", "16"], &[]);
    assert!(out.status.success());
    let pid = src.pid_of("w");
    src.wait_step("w", 5);
    type Env<'a> = &'a [(&'a str, &'a str)];
    let cases: [(&str, Env, Env); 5] = [
        ("the target's restore fails", &[("HIBER_FAIL_AT", "processes_restored")], &[]),
        ("the target drops the connection while receiving", &[("HIBER_MIGRATE_DROP_AT", "receiving")], &[]),
        ("the source drops the connection while sending", &[], &[("HIBER_MIGRATE_DROP_AT", "sending")]),
        ("the connection drops before the target is ready", &[], &[("HIBER_MIGRATE_DROP_AT", "ready")]),
        ("the source fails once dumped", &[], &[("HIBER_FAIL_AT", "dumped")]),
    ];
    for (what, target_env, source_env) in cases {
        let server = Server::start(&hosts.b, &dst, &listen, &tok, target_env);
        let step = src.last_step("w").unwrap();
        let out = run_in(&hosts.a, &src, &["migrate", "w", "--to", &listen, "--token-file", tok.to_str().unwrap()], source_env);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: the migration should fail");
        assert!(err.starts_with("hiber: ") && !err.contains("panicked"), "{what}: {err}");
        assert_eq!(src.pid_of("w"), pid, "{what}: the job is the same process at the source");
        assert_eq!(src.state_of("w"), "running", "{what}");
        wait(&format!("{what}: the job to go on"), Duration::from_secs(20), || src.last_step("w").unwrap() > step + 3);
        // The target's thread settles once its connection is gone.
        wait(&format!("{what}: nothing left on the target"), Duration::from_secs(20), || jobs(&dst).is_empty() && server.leftovers(&dst) == 0);
        drop(server);
    }

    // The target killed while it holds the restored copy: the source's tree resumes; the
    // copy, stopped, dies with its hiber, and `hiber recover` there removes the job.
    let mut server = Server::start(&hosts.b, &dst, &listen, &tok, &[("HIBER_PAUSE_AT", "processes_restored")]);
    let mut migrate =
        hiber_in(&hosts.a, &src, &["migrate", "w", "--to", &listen, "--token-file", tok.to_str().unwrap()]).stderr(Stdio::piped()).spawn().unwrap();
    // The restored root is on record (`root.json`, written by its shim once CRIU restored the
    // tree): the target holds its copy, paused at the barrier.
    wait("the target to hold the restored copy", Duration::from_secs(30), || dst.state.join("jobs/w/root.json").exists());
    let _ = server.child.kill();
    let _ = server.child.wait();
    assert!(!migrate.wait().unwrap().success());
    assert_eq!(src.pid_of("w"), pid, "the job is the same process at the source");
    assert_eq!(src.state_of("w"), "running");
    dst.ok(&["recover"]);
    wait("the target's copy to be gone", Duration::from_secs(20), || jobs(&dst).is_empty());
    assert_eq!(server.leftovers(&dst), 0, "`hiber recover` removed what the killed target had received");
    drop(server);

    // That job has served its purpose; a shorter one, checked to its end, for the last case.
    src.ok(&["rm", "-f", "w"]);
    let out = run_in(&hosts.a, &src, &["run", "--name", "v", "--", HIBER, "workload", "cpu", "--steps", "300", "--mem-mib", "16"], &[]);
    assert!(out.status.success());
    src.wait_step("v", 5);

    // The word after the hand-over lost: the job runs at the target, the source keeps its
    // image and says so; never both.
    let _server = Server::start(&hosts.b, &dst, &listen, &tok, &[]);
    let out = run_in(&hosts.a, &src, &["migrate", "v", "--to", &listen, "--token-file", tok.to_str().unwrap()], &[("HIBER_MIGRATE_DROP_AT", "running")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("did not confirm"), "{err}");
    let kept = src.job("v")["checkpointed_to"].as_str().unwrap().to_string();
    assert!(Path::new(&kept).join("manifest.json").exists(), "the source keeps the image: {kept}");
    assert_ne!(src.state_of("v"), "running", "the source's tree is gone");
    // The target may still be finishing the restore it was told to complete.
    wait("the target to run the job", Duration::from_secs(30), || dst.state_of("v").starts_with("running") || dst.state_of("v").starts_with("exited"));
    let log = dst.assert_verified("v", Duration::from_secs(120));
    assert!(log.contains("verify ok"));
    assert_whole_trajectory(&dst.progress("v"));
}

/// `hiber migrate` killed after the target holds its copy and the source's tree has stopped,
/// before it says `Commit`: the target drops its copy, and the image on the source's record
/// restores the job there, on its trajectory. It never runs in two places, and is not lost.
#[test]
fn a_migration_killed_before_the_word_loses_nothing() {
    let (src, dst) = (Hiber::new("mig-kill-src"), Hiber::new("mig-kill-dst"));
    let hosts = Hosts::new();
    let tok = token(&src, "token", "0123456789abcdef0123456789abcdef");
    let listen = format!("{}:7304", hosts.b_addr);
    let server = Server::start(&hosts.b, &dst, &listen, &tok, &[]);
    let out = run_in(&hosts.a, &src, &["run", "--name", "w", "--", HIBER, "workload", "cpu", "--steps", "400", "--mem-mib", "16"], &[]);
    assert!(out.status.success());
    let pid = src.pid_of("w");
    src.wait_step("w", 10);
    let mut migrate = hiber_in(&hosts.a, &src, &["migrate", "w", "--to", &listen, "--token-file", tok.to_str().unwrap()])
        .env("HIBER_MIGRATE_PAUSE_AT", "commit")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Once paused before the word: the source's tree stopped, its image on the job's record,
    // and the target holding its copy. (On failure, hiber is killed: left paused, it would
    // hold the test harness's pipes open.)
    let recorded = || src.job("w")["checkpointed_to"].as_str().map(str::to_string);
    let held = || !alive(pid) && recorded().is_some() && dst.state.join("jobs/w/root.json").exists();
    let start = std::time::Instant::now();
    while !held() && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(25));
    }
    if !held() {
        let _ = migrate.kill();
        panic!("the source's tree did not stop with its image recorded while the target held its copy");
    }
    let image = recorded().unwrap();
    let hiber_pid = migrate.id() as i32;
    let _ = migrate.kill();
    let _ = migrate.wait();
    assert!(!alive(hiber_pid), "hiber migrate is gone");
    // Well within the target's 60 s read timeout: it drops its copy because the connection
    // closed, not because it gave up waiting.
    wait("the target to drop its copy", Duration::from_secs(30), || jobs(&dst).is_empty() && server.leftovers(&dst) == 0);
    let before = src.progress("w");
    let out = run_in(&hosts.a, &src, &["restore", &image, "--name", "w-back"], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    src.assert_verified("w-back", Duration::from_secs(60));
    assert_continues(&before, &src.progress("w-back"), before.last().unwrap().0 + 1);
}
