//! Open MPI jobs on one host, started as users start them (`mpirun -np N PROGRAM` under
//! `hiber run`): mpirun and its ranks are one job, whose shared-memory transport, PMIx
//! sockets and session directory CRIU takes with it. The program (tests/fixtures/mpi_ring.c)
//! prints a trajectory that depends on every rank's state at every step; each restore must
//! go on from the step after its checkpoint, on the trajectory of an uninterrupted run.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::hosts::{hiber_in, net_of, Coordinator, Hosts};
use common::{assert_continues, progress_in, Hiber, HIBER};

/// Held by the tests whose jobs run in this host's network namespace. Open MPI's TCP
/// transport listens on the first free port from 1024 up: a job started while another's
/// original had ended would take its ports, which that one's in-place restore needs
/// (refused, "Address already in use", as two users' jobs on one host would fight over
/// them). The two-host test runs in namespaces of its own.
static HOST_PORTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn host_ports() -> std::sync::MutexGuard<'static, ()> {
    HOST_PORTS.lock().unwrap_or_else(|e| e.into_inner())
}

const RANKS: &str = "3";
const STEPS: &str = "150";

/// `mpirun` of `ranks` ranks as root on a machine with fewer cores than ranks, as a user
/// there would type it.
fn mpirun(bin: &Path, ranks: &str, pause_ms: &str) -> Vec<String> {
    ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", ranks, bin.to_str().unwrap(), STEPS, pause_ms].map(String::from).to_vec()
}

/// The uninterrupted trajectory of `ranks` ranks, run outside hiber.
fn reference(bin: &Path, ranks: &str) -> Vec<(u64, String)> {
    let args = mpirun(bin, ranks, "0");
    let out = Command::new(&args[0]).args(&args[1..]).output().expect("run mpirun");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("verify ok"), "the reference run failed: {}\n{}", text, String::from_utf8_lossy(&out.stderr));
    let p = progress_in(&text);
    assert_eq!(p.len(), STEPS.parse::<usize>().unwrap());
    p
}

fn run(h: &Hiber, name: &str, bin: &Path) {
    let mut args = vec!["run", "--name", name, "--"];
    let cmd = mpirun(bin, RANKS, "40");
    args.extend(cmd.iter().map(String::as_str));
    h.ok(&args);
}

/// The processes of a job's image (mpirun and every rank).
fn processes(h: &Hiber, image: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(&h.ok(&["inspect", image, "--json"])).unwrap();
    v["manifest"]["processes"].as_array().map_or(0, |a| a.len() as u64)
}

/// Stopped, restored, stopped again and restored again (a job preempted twice): each copy
/// goes on from the step after its checkpoint and the whole run is the uninterrupted one.
#[test]
fn an_open_mpi_job_is_preempted_twice_and_finishes_on_its_trajectory() {
    let _ports = host_ports();
    let h = Hiber::new("mpi");
    let bin = h.build_fixture("mpicc", "mpi_ring");
    let reference = reference(&bin, RANKS);
    run(&h, "mpi", &bin);
    h.wait_step("mpi", 15);
    let first = h.images_dir().join("mpi-1");
    h.ok(&["checkpoint", "mpi", "--out", first.to_str().unwrap()]);
    assert_eq!(processes(&h, first.to_str().unwrap()), 1 + RANKS.parse::<u64>().unwrap(), "mpirun and its ranks are in the image");
    let at = h.last_step("mpi").unwrap();
    // Meanwhile the host opens terminals, which take the lowest free numbers: those mpirun's
    // ranks had, had they been the host's. The restore gives the ranks theirs back all the
    // same (they are numbered in the job's own /dev/pts).
    let host_terminals: Vec<std::fs::File> = (0..8).map(|_| std::fs::OpenOptions::new().read(true).write(true).open("/dev/ptmx").unwrap()).collect();
    h.ok(&["restore", first.to_str().unwrap(), "--name", "mpi-r"]);
    drop(host_terminals);
    h.wait_step("mpi-r", at + 15);
    let second = h.images_dir().join("mpi-2");
    h.ok(&["checkpoint", "mpi-r", "--out", second.to_str().unwrap()]);
    let at2 = h.last_step("mpi-r").unwrap();
    h.ok(&["restore", second.to_str().unwrap(), "--name", "mpi-r2"]);
    h.assert_verified("mpi-r2", Duration::from_secs(60));
    assert_continues(&reference, &h.progress("mpi"), 1);
    assert_continues(&reference, &h.progress("mpi-r"), at + 1);
    assert_continues(&reference, &h.progress("mpi-r2"), at2 + 1);
    assert_eq!(h.last_step("mpi-r2"), Some(STEPS.parse().unwrap()), "it ran to its last step");
}

/// `--leave-running`: the job pauses for the dump and goes on, on the uninterrupted
/// trajectory, to its end, and so does a copy restored beside it.
#[test]
fn an_open_mpi_job_runs_on_after_a_leave_running_checkpoint() {
    let _ports = host_ports();
    let h = Hiber::new("mpil");
    let bin = h.build_fixture("mpicc", "mpi_ring");
    let reference = reference(&bin, RANKS);
    run(&h, "mpil", &bin);
    h.wait_step("mpil", 15);
    let img = h.images_dir().join("mpil");
    let before = h.last_step("mpil").unwrap();
    h.ok(&["checkpoint", "mpil", "--leave-running", "--out", img.to_str().unwrap()]);
    let after = h.last_step("mpil").unwrap();
    // A copy beside the running original (its connections in a network namespace of its
    // own): CRIU gives each terminal mpirun opened for its ranks its old number, which the
    // original still holds on the host; in the job's own /dev/pts, both have them.
    h.ok(&["restore", img.to_str().unwrap(), "--name", "mpil-copy", "--isolate-net"]);
    h.assert_verified("mpil", Duration::from_secs(60));
    assert_continues(&reference, &h.progress("mpil"), 1);
    assert_eq!(h.last_step("mpil"), Some(STEPS.parse().unwrap()));
    h.assert_verified("mpil-copy", Duration::from_secs(60));
    let copy = h.progress("mpil-copy");
    let first = copy.first().map(|p| p.0).unwrap_or(0);
    assert!(first > before && first <= after + 1, "the copy goes on from the checkpoint (between steps {before} and {after}), not from {first}");
    assert_continues(&reference, &copy, first);
    // Once the original has ended (and mpirun removed what it kept on the host), the image
    // still restores: mpirun's session directory is in the job's /dev/shm, in the image.
    h.ok(&["restore", img.to_str().unwrap(), "--name", "mpil-later"]);
    h.assert_verified("mpil-later", Duration::from_secs(60));
    let later = h.progress("mpil-later");
    let first = later.first().map(|p| p.0).unwrap_or(0);
    assert!(first > before && first <= after + 1, "the copy goes on from the checkpoint (between steps {before} and {after}), not from {first}");
    assert_continues(&reference, &later, first);
}

/// Two Open MPI jobs started at once: every job's mpirun is PID 1 in its own PID namespace,
/// and Open MPI names its session directory after that PID. Both must start, run and end.
#[test]
fn two_open_mpi_jobs_start_side_by_side() {
    let _ports = host_ports();
    let h = Hiber::new("mpi2");
    let bin = h.build_fixture("mpicc", "mpi_ring");
    let reference = reference(&bin, RANKS);
    let names = ["mpi-a", "mpi-b", "mpi-c"];
    std::thread::scope(|s| {
        for name in names {
            let (h, bin) = (&h, &bin);
            s.spawn(move || run(h, name, bin));
        }
    });
    for name in names {
        h.assert_verified(name, Duration::from_secs(60));
        assert_continues(&reference, &h.progress(name), 1);
    }
}

/// A host's sshd stand-in (`fixtures/sshd_standin.py`) in network namespace `ns`; killed
/// when dropped.
/// The commands it runs see that host's hiber (`HIBER_STATE`), as a host's own would.
struct Sshd(std::process::Child);

impl Sshd {
    fn start(ns: &str, addr: &str, port: u16, hiber: &Hiber) -> Sshd {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sshd_standin.py");
        let mut child = Command::new("nsenter")
            .arg(format!("--net={ns}"))
            .args(["python3", script.to_str().unwrap(), addr, &port.to_string()])
            .env("HIBER_STATE", &hiber.state)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start the sshd stand-in");
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.as_mut().unwrap()), &mut line).unwrap();
        assert_eq!(line.trim(), "listening", "the sshd stand-in on {addr} listens");
        Sshd(child)
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `hiber coordinate` in host A's namespace and one hiber per side (its state, its host's
/// namespace, its arguments), all at once: every one must succeed.
fn coordinated(hosts: &Hosts, sides: [(&Hiber, &str, Vec<String>); 2], port: u16) {
    let coord = Coordinator::start(hosts, sides[0].0, 2, port, 60);
    let children: Vec<_> =
        sides.iter().map(|(h, ns, args)| coord.participant(ns, h, &args.iter().map(String::as_str).collect::<Vec<_>>()).spawn().unwrap()).collect();
    for (c, (_, _, args)) in children.into_iter().zip(&sides) {
        let out = c.wait_with_output().unwrap();
        assert!(out.status.success(), "hiber {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let out = coord.child.wait_with_output().unwrap();
    assert!(out.status.success(), "the coordinator failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// An Open MPI job across two hosts (network namespaces, ranks talking over TCP between
/// them): mpirun and two ranks on host A, started as a job of A's hiber; the daemon mpirun
/// starts on host B through the rsh agent ("ssh") as `hiber run --name orted -- orted ...`
/// (Open MPI's `orte_launch_agent`), with its two ranks, a job of B's hiber.
/// The two hibers cut it as one through `hiber coordinate`: with `--leave-running` (it runs
/// on), then stopping, and the two images are restored in place together; stopped again,
/// and restored on two new machines that took the old ones' addresses. It ends on the
/// trajectory of an uninterrupted run, every rank agreeing.
#[test]
fn an_open_mpi_job_across_two_hosts_is_cut_as_one_and_restored_in_place_and_on_other_hosts() {
    let hosts = Hosts::new();
    let (ha, hb) = (Hiber::new("mpix-a"), Hiber::new("mpix-b"));
    let bin = ha.build_fixture("mpicc", "mpi_ring");
    // The same trajectory, whichever hosts its ranks run on.
    let reference = reference(&bin, "4");
    let port = 2222;
    let _sshd = [Sshd::start(&hosts.a, &hosts.a_addr, port, &ha), Sshd::start(&hosts.b, &hosts.b_addr, port, &hb)];
    let agent = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mpi_rsh_agent.sh");
    let host_list = format!("{}:2,{}:2", hosts.a_addr, hosts.b_addr);
    // Open MPI starts its daemon on every other host as `LAUNCH_AGENT ARGS` over the rsh
    // agent: there, that is a job of the host's own hiber.
    let launch = format!("{HIBER} run --name orted -- orted");
    let job = [
        "run",
        "--name",
        "mpix",
        "--",
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "--host",
        &host_list,
        "-np",
        "4",
        "--mca",
        "plm_rsh_agent",
        agent.to_str().unwrap(),
        "--mca",
        "orte_launch_agent",
        &launch,
        "--mca",
        "btl",
        "tcp,self",
        "--mca",
        "btl_tcp_if_include",
        &hosts.net,
        "--mca",
        "oob_tcp_if_include",
        &hosts.net,
        bin.to_str().unwrap(),
        STEPS,
        "40",
    ];
    let out = hiber_in(&hosts.a, &ha, &job).env("HIBER_MPI_SSHD_PORT", port.to_string()).output().unwrap();
    assert!(out.status.success(), "hiber run: {}", String::from_utf8_lossy(&out.stderr));
    ha.wait_step("mpix", 10);
    assert_eq!(ha.state_of("mpix"), "running");
    assert_eq!(hb.state_of("orted"), "running", "the daemon on host B is a job of B's hiber");
    assert_eq!(net_of(hb.pid_of("orted")), Hosts::net_inode(&hosts.b), "and it runs on host B");

    // One cut, the job running on.
    let (ia, ib) = (ha.images_dir().join("a-1"), hb.images_dir().join("b-1"));
    let args = |job: &str, img: &PathBuf, extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["checkpoint", job, "--out", img.to_str().unwrap()].map(String::from).to_vec();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    coordinated(&hosts, [(&ha, &hosts.a, args("mpix", &ia, &["--leave-running"])), (&hb, &hosts.b, args("orted", &ib, &["--leave-running"]))], 7401);
    let now = ha.last_step("mpix").unwrap();
    ha.wait_step("mpix", now + 10);

    // Preempted: both stop at one cut, and come back in place together.
    let (sa, sb) = (ha.images_dir().join("a-2"), hb.images_dir().join("b-2"));
    coordinated(&hosts, [(&ha, &hosts.a, args("mpix", &sa, &[])), (&hb, &hosts.b, args("orted", &sb, &[]))], 7402);
    let at = ha.last_step("mpix").unwrap();
    let restore = |img: &PathBuf, name: &str| -> Vec<String> { ["restore", img.to_str().unwrap(), "--name", name].map(String::from).to_vec() };
    coordinated(&hosts, [(&ha, &hosts.a, restore(&sa, "mpix-r")), (&hb, &hosts.b, restore(&sb, "orted-r"))], 7403);
    ha.wait_step("mpix-r", at + 10);

    // Preempted again, and brought back on two other machines that took the hosts'
    // addresses (the old namespaces are gone with everything in them).
    let (ma, mb) = (ha.images_dir().join("a-3"), hb.images_dir().join("b-3"));
    coordinated(&hosts, [(&ha, &hosts.a, args("mpix-r", &ma, &[])), (&hb, &hosts.b, args("orted-r", &mb, &[]))], 7404);
    let at2 = ha.last_step("mpix-r").unwrap();
    drop(_sshd);
    let hosts = Hosts::taking_over(hosts);
    coordinated(&hosts, [(&ha, &hosts.a, restore(&ma, "mpix-m")), (&hb, &hosts.b, restore(&mb, "orted-m"))], 7405);
    assert_eq!(net_of(ha.pid_of("mpix-m")), Hosts::net_inode(&hosts.a), "mpirun runs on the new host A");
    assert_eq!(net_of(hb.pid_of("orted-m")), Hosts::net_inode(&hosts.b), "the daemon runs on the new host B");
    ha.assert_verified("mpix-m", Duration::from_secs(90));
    assert_continues(&reference, &ha.progress("mpix"), 1);
    assert_continues(&reference, &ha.progress("mpix-r"), at + 1);
    assert_continues(&reference, &ha.progress("mpix-m"), at2 + 1);
    assert_eq!(ha.last_step("mpix-m"), Some(STEPS.parse().unwrap()), "it ran to its last step");
}
