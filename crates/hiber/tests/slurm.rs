//! Slurm drives hiber (#38): a batch job run through `scripts/hiber-slurm`, the documented
//! pattern, on a one-node Slurm cluster each test starts (Debian's slurmctld and slurmd,
//! their own configuration, state and ports). When Slurm says the job must stop (its time
//! limit's warning signal, or a preemption by a job of a higher partition) the program is
//! checkpointed and the job requeued; Slurm starts it again, and it is restored and runs to
//! its end. Its output in Slurm's file is the whole uninterrupted trajectory, each step once.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use common::hosts::Hosts;
use common::{progress_in, wait, Hiber, HIBER};

/// slurmctld and slurmd in the foreground, killed when dropped.
struct Cluster {
    daemons: Vec<Child>,
    conf: PathBuf,
    /// The network namespace of the controller's host, where Slurm's commands run (none:
    /// this host's).
    ns: Option<String>,
}

impl Cluster {
    /// A cluster of this machine as one node of 2 CPUs, with `partitions` (lines of
    /// slurm.conf naming `{node}`) and any other `settings`.
    fn start(h: &Hiber, settings: &str, partitions: &str) -> Cluster {
        let node = String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout).unwrap().trim().to_string();
        let nodes = format!("NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN\n{settings}\n{}", partitions.replace("{node}", &node));
        let conf = Cluster::configure(h, &format!("{node}(127.0.0.1)"), &nodes);
        let spawn = |prog: &str, args: &[&str]| {
            Command::new(prog).args(args).env("SLURM_CONF", &conf).spawn().unwrap_or_else(|e| panic!("{prog}: {e} (scripts/setup.sh installs Slurm)"))
        };
        let daemons = vec![spawn("slurmctld", &["-D", "-c"]), spawn("slurmd", &["-D"])];
        let c = Cluster { daemons, conf, ns: None };
        wait("the Slurm node to be idle", Duration::from_secs(60), || c.run("sinfo", &["-h", "-o", "%T"]).trim() == "idle");
        c
    }

    /// A cluster of two nodes of one CPU each, `nodea` and `nodeb`: the two `hosts`, each
    /// with its own slurmd (its own network namespace, and a UTS namespace with the node's
    /// name), the controller on `nodea`. Its `partitions` name both as `{node}`.
    fn two_nodes(h: &Hiber, hosts: &Hosts, settings: &str, partitions: &str) -> Cluster {
        let nodes = format!(
            "NodeName=nodea NodeAddr={} CPUs=1 State=UNKNOWN\nNodeName=nodeb NodeAddr={} CPUs=1 State=UNKNOWN\n{settings}\n{}",
            hosts.a_addr,
            hosts.b_addr,
            partitions.replace("{node}", "nodea,nodeb")
        );
        let conf = Cluster::configure(h, &format!("nodea({})", hosts.a_addr), &nodes);
        let spawn = |ns: &str, node: &str, daemon: &str| {
            Command::new("nsenter")
                .args([&format!("--net={ns}"), "unshare", "--uts", "sh", "-c", &format!("hostname {node} && exec {daemon} -D")])
                .env("SLURM_CONF", &conf)
                .spawn()
                .unwrap_or_else(|e| panic!("{daemon}: {e} (scripts/setup.sh installs Slurm)"))
        };
        let daemons = vec![spawn(&hosts.a, "nodea", "slurmctld -c"), spawn(&hosts.a, "nodea", "slurmd"), spawn(&hosts.b, "nodeb", "slurmd")];
        let c = Cluster { daemons, conf, ns: Some(hosts.a.clone()) };
        // A line per node and partition.
        wait("both Slurm nodes to be idle", Duration::from_secs(60), || {
            let states = c.run("sinfo", &["-h", "-N", "-o", "%N %T"]);
            ["nodea idle", "nodeb idle"].iter().all(|n| states.contains(n)) && states.lines().all(|l| l.ends_with(" idle"))
        });
        c
    }

    /// Writes the cluster's slurm.conf (its controller `ctld`, its `nodes` lines) in the
    /// scratch directory of `h`, with directories and ports of its own.
    fn configure(h: &Hiber, ctld: &str, nodes: &str) -> PathBuf {
        let dir = h.scratch.join("slurm");
        for d in ["state", "log"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        // Two ports for each cluster of each test process.
        static CLUSTERS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let port = 17000 + (std::process::id() % 1000) * 4 + CLUSTERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) * 2;
        let d = dir.display();
        let conf = dir.join("slurm.conf");
        // Every slurmd's files are its node's own (`%n`).
        std::fs::write(
            &conf,
            format!(
                "ClusterName=hibertest\nSlurmctldHost={ctld}\nAuthType=auth/none\nCredType=cred/none\n\
                 AuthInfo=cred_expire=10\n\
                 SlurmUser=root\nSlurmdUser=root\nStateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool-%n\n\
                 SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd-%n.pid\n\
                 SlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd-%n.log\n\
                 SlurmctldPort={port}\nSlurmdPort={}\nProctrackType=proctrack/pgid\nTaskPlugin=task/none\n\
                 SchedulerType=sched/backfill\nSchedulerParameters=bf_interval=1\n\
                 SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n\
                 JobAcctGatherType=jobacct_gather/none\nMpiDefault=none\nReturnToService=2\n{nodes}\n",
                port + 1,
            ),
        )
        .unwrap();
        conf
    }

    /// One of Slurm's commands, talking to this cluster (from the controller's host).
    fn command(&self, prog: &str) -> Command {
        let mut c = match &self.ns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net={ns}")).arg(prog);
                c
            }
            None => Command::new(prog),
        };
        c.env("SLURM_CONF", &self.conf);
        c
    }

    fn run(&self, prog: &str, args: &[&str]) -> String {
        let out = self.command(prog).args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.run("scancel", &["-u", "root"]);
        // Until the jobs are gone: a job's slurmstepd whose slurmd is killed first waits for
        // it for good, and every run left one or two behind.
        let start = std::time::Instant::now();
        while !self.run("squeue", &["-h"]).trim().is_empty() && start.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(250));
        }
        for d in &mut self.daemons {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
}

/// The workload every test runs under Slurm (`STEPS` steps 100 ms apart), and its
/// uninterrupted trajectory.
fn workload(steps: u32) -> (String, Vec<(u64, String)>) {
    let steps = steps.to_string();
    let args = ["workload", "cpu", "--steps", &steps, "--mem-mib", "16"];
    let out = Command::new(HIBER).args(args).args(["--interval-ms", "0"]).output().unwrap();
    let reference = progress_in(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(reference.len().to_string(), steps, "the reference run");
    (format!("{HIBER} {} --interval-ms 100", args.join(" ")), reference)
}

fn helper() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/hiber-slurm")
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// Submits `script` (written to the scratch directory) with hiber's state, the helper's
/// image directory and `env` in its environment (sbatch passes its own on to the job);
/// returns the job id.
fn submit(h: &Hiber, cluster: &Cluster, name: &str, script: &str, env: &[(&str, &str)]) -> String {
    let path = h.scratch.join(name);
    std::fs::write(&path, script).unwrap();
    let submitted = cluster
        .command("sbatch")
        .arg(&path)
        .envs(env.iter().copied())
        .env("HIBER", HIBER)
        .env("HIBER_STATE", &h.state)
        .env("HIBER_SLURM_DIR", h.scratch.join("images"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&submitted.stdout);
    let id = said.trim().rsplit(' ').next().unwrap().to_string();
    assert!(submitted.status.success() && id.parse::<u64>().is_ok(), "sbatch: {said} {}", String::from_utf8_lossy(&submitted.stderr));
    id
}

/// Waits (10 minutes at most) for the helper in job `id` to say that the program ended,
/// then checks what it said at each start, against Slurm's restart count, and the
/// program's trajectory against `reference`. Returns the helper's lines.
fn check_cycles(h: &Hiber, cluster: &Cluster, id: &str, out: &Path, reference: &[(u64, String)]) -> Vec<String> {
    let start = std::time::Instant::now();
    while !read(out).contains("hiber-slurm: the program ended") {
        // On a timeout, what the job and Slurm said, so that the cause is in the failure.
        if start.elapsed() > Duration::from_secs(600) {
            panic!(
                "timed out waiting for job {id} to end after its restarts\njob output:\n{}\n{}\nslurmctld:\n{}",
                read(out),
                cluster.run("scontrol", &["show", "job", id]),
                common::tail(&read(&h.scratch.join("slurm/log/slurmctld.log")))
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let text = read(out);
    let said: Vec<String> = text.lines().filter(|l| l.starts_with("hiber-slurm:")).map(String::from).collect();
    let context = || format!("{said:#?}\n{}", cluster.run("scontrol", &["show", "job", id]));
    // Each start says which it is; a start may get the warning again (the requeued job has
    // the same time limit), and a warning that comes as the program ends finds nothing to
    // checkpoint. What must hold: it started from scratch once, was checkpointed and
    // restored at least once, and the program ended well.
    let starts: Vec<&String> = said.iter().filter(|l| l.contains(": start ")).collect();
    assert!(starts[0].contains("start 1: no complete image, starting from scratch"), "{}", context());
    for (n, l) in starts.iter().enumerate().skip(1) {
        assert!(l.contains(&format!("start {}: restoring from", n + 1)), "start {} restores: {}", n + 1, context());
    }
    assert!(starts.len() >= 2, "the job was requeued and restored: {}", context());
    let checkpointed = said.iter().filter(|l| l.ends_with("checkpointed; Slurm starts the job again from there")).count();
    assert_eq!(checkpointed, starts.len() - 1, "one checkpoint before each restart: {}", context());
    assert_eq!(said.last().map(String::as_str), Some("hiber-slurm: the program ended: exited(0)"), "{}", context());
    let job = cluster.run("scontrol", &["show", "job", id]);
    assert!(job.contains(&format!("Restarts={}", starts.len() - 1)), "Slurm started the job as often as it said: {}", context());
    assert!(text.contains("verify ok"), "the program checked its memory at the end: {text}");
    assert_eq!(progress_in(&text), reference, "Slurm's output holds the uninterrupted trajectory, each step once");
    assert!(!h.scratch.join("images").join(format!("job-{id}")).exists(), "the image goes once the program has ended");
    said
}

/// Slurm holds a requeued batch job until its credentials expire (`cred_expire`, 120 s unless
/// set) before it starts it again: 10 s here.
const QUICK_REQUEUE: &str = "AuthInfo=cred_expire=10";

/// The time limit: the warning signal to the batch shell (`--signal=B:USR1@45`), the helper
/// as the batch script. slurmctld looks at time limits every 30 s, and sends the warning at
/// the first look once the time left is under the warning time plus those 30 s: with a
/// 1-minute limit, at the first look after each start. So each start runs up to 30 s, and
/// the program runs 40 s: its first start is always warned.
#[test]
fn a_batch_job_is_checkpointed_at_its_time_limit_requeued_and_restored() {
    let h = Hiber::new("slurm");
    let cluster = Cluster::start(&h, QUICK_REQUEUE, "PartitionName=batch Nodes={node} Default=YES MaxTime=INFINITE State=UP");
    let (program, reference) = workload(400);
    let out = h.scratch.join("job.out");
    let script = format!(
        "#!/bin/bash\n#SBATCH --requeue --time=1 --signal=B:USR1@45 --open-mode=append -o {}\nexec {} -- {program}\n",
        out.display(),
        helper().display()
    );
    let id = submit(&h, &cluster, "job.sh", &script, &[]);
    check_cycles(&h, &cluster, &id, &out, &reference);
}

/// A one-node cluster whose `low` partition (the default; its jobs have `grace_s` seconds
/// once preempted) is preempted by jobs of its `high` one, requeued.
fn preempting_cluster(h: &Hiber, grace_s: u32) -> Cluster {
    let (settings, partitions) = preemption(grace_s);
    Cluster::start(h, &settings, &partitions)
}

/// The settings and partitions (naming the nodes `{node}`) of a cluster whose `low`
/// partition (the default; `grace_s` seconds once preempted) is preempted by jobs of its
/// `high` one, requeued.
fn preemption(grace_s: u32) -> (String, String) {
    (
        format!("{QUICK_REQUEUE}\nPreemptType=preempt/partition_prio\nPreemptMode=REQUEUE"),
        format!(
            "PartitionName=low Nodes={{node}} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={grace_s}\n\
             PartitionName=high Nodes={{node}} MaxTime=INFINITE State=UP PriorityTier=2"
        ),
    )
}

/// Submits `program` as a `low` job on both CPUs, through the helper as a step; once it is
/// past step 50, a `high` job that needs both CPUs and says so in `high.out`. Returns the
/// low job's id and output file, and the high job's id.
fn low_job_preempted(h: &Hiber, cluster: &Cluster, program: &str, env: &[(&str, &str)]) -> (String, PathBuf, String) {
    let out = h.scratch.join("low.out");
    let script = format!("#!/bin/bash\n#SBATCH -p low -c 2 --requeue --open-mode=append -o {}\nsrun {} -- {program}\n", out.display(), helper().display());
    let id = submit(h, cluster, "low.sh", &script, env);
    wait("the low job's program to reach step 50", Duration::from_secs(120), || progress_in(&read(&out)).len() >= 50);
    let high_out = h.scratch.join("high.out");
    let high = submit(h, cluster, "high.sh", &format!("#!/bin/bash\n#SBATCH -p high -c 2 -o {}\necho preemptor ran; sleep 3\n", high_out.display()), &[]);
    (id, out, high)
}

/// Preemption: `PreemptMode=REQUEUE` with a grace time, and a job of a partition of a higher
/// tier that needs the node. Slurm sends SIGTERM to the running job's steps at once (its
/// batch shell only when the grace time is over), so the helper runs as a step (`srun`): it
/// checkpoints within the grace time and requeues the job, the preempting job runs, and the
/// preempted one is restored once the node is free again.
#[test]
fn a_preempted_job_is_checkpointed_in_its_grace_time_and_resumes_after_the_preemptor() {
    let h = Hiber::new("slurm-preempt");
    let cluster = preempting_cluster(&h, 60);
    let (program, reference) = workload(300);
    let (id, out, high) = low_job_preempted(&h, &cluster, &program, &[]);
    let said = check_cycles(&h, &cluster, &id, &out, &reference);
    assert!(said.iter().any(|l| l.starts_with("hiber-slurm: SIGTERM: checkpointing")), "checkpointed on the preemption's SIGTERM: {said:#?}");
    assert_eq!(read(&h.scratch.join("high.out")).trim(), "preemptor ran");
    let high_job = cluster.run("scontrol", &["show", "job", &high]);
    assert!(high_job.contains("JobState=COMPLETED"), "{high_job}");
}

/// Slurm kills a preempted job before its checkpoint ends (the grace time runs out: here
/// the checkpoint is held once CRIU has dumped, `HIBER_PAUSE_AT`). The next start finds no
/// complete image, says so, and runs the program from scratch, to its end (whatever the
/// killed checkpoint left of the first start's program is removed first).
#[test]
fn a_job_killed_in_its_checkpoint_starts_again_from_scratch_and_says_so() {
    let h = Hiber::new("slurm-killed");
    let cluster = preempting_cluster(&h, 5);
    let (program, reference) = workload(300);
    // Every checkpoint in the job is held.
    let (id, out, _) = low_job_preempted(&h, &cluster, &program, &[("HIBER_PAUSE_AT", "dumped")]);
    // (The first start, killed in its checkpoint, may say that its program ended too: as
    // the step is killed, the held checkpoint fails and leaves the program stopped.)
    wait("the second start's program to end", Duration::from_secs(300), || {
        read(&out).split_once(": start 2:").is_some_and(|(_, after)| after.contains("hiber-slurm: the program ended"))
    });
    let text = read(&out);
    let said: Vec<&str> = text.lines().filter(|l| l.starts_with("hiber-slurm:")).collect();
    let context = || format!("{said:#?}\n{}", cluster.run("scontrol", &["show", "job", &id]));
    let starts: Vec<&&str> = said.iter().filter(|l| l.contains(": start ")).collect();
    assert_eq!(starts.len(), 2, "{}", context());
    assert!(said.iter().any(|l| l.starts_with("hiber-slurm: SIGTERM: checkpointing")), "{}", context());
    assert!(!said.iter().any(|l| l.contains("checkpointed;")), "no checkpoint completed: {}", context());
    assert!(starts[1].contains("start 2: no complete image, starting from scratch"), "{}", context());
    assert_eq!(said.last().copied(), Some("hiber-slurm: the program ended: exited(0)"), "{}", context());
    let second = &text[text.find("start 2:").unwrap()..];
    assert_eq!(progress_in(second), reference, "the second start ran the whole program");
}

/// The two-task program of the tests of two nodes (`fixtures/slurm_pair.py`, `steps` steps)
/// and its uninterrupted trajectory (the two tasks on this host, over loopback): the
/// program's path and port, and the trajectory.
fn pair_program(steps: &str) -> (PathBuf, String, Vec<(u64, String)>) {
    let pair = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/slurm_pair.py");
    static PORTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let port = (30000 + (std::process::id() % 1000) * 4 + PORTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)).to_string();
    let tasks: Vec<_> = (0..2)
        .map(|t| {
            Command::new("python3")
                .args([pair.to_str().unwrap(), steps, "0", &port])
                .env("SLURM_PROCID", t.to_string())
                .env("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = tasks.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    let reference = progress_in(&String::from_utf8_lossy(&outs[0].stdout));
    assert!(outs.iter().all(|o| o.status.success()) && reference.len().to_string() == steps, "the reference run");
    (pair, port, reference)
}

/// Waits (10 minutes at most) for both tasks of two-node job `id` to say that their program
/// ended, then checks what each said at each start against Slurm's restart count, and the
/// trajectory against `reference`. Returns the job's output.
fn check_two_node_cycles(h: &Hiber, cluster: &Cluster, id: &str, out: &Path, reference: &[(u64, String)]) -> String {
    let start = std::time::Instant::now();
    while !(0..2).all(|t| read(out).contains(&format!("hiber-slurm[{t}]: the program ended"))) {
        if start.elapsed() > Duration::from_secs(600) {
            panic!("timed out waiting for job {id} to end\njob output:\n{}\n{}", read(out), cluster.run("scontrol", &["show", "job", id]));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let text = read(out);
    let context = || format!("{text}\n{}", cluster.run("scontrol", &["show", "job", id]));
    assert!(text.contains("task 0 of 2 on nodea") && text.contains("task 1 of 2 on nodeb"), "a task on each node: {}", context());
    let mut restarts = None;
    for t in 0..2 {
        let tag = format!("hiber-slurm[{t}]:");
        let said: Vec<&str> = text.lines().filter(|l| l.starts_with(&tag)).collect();
        let starts: Vec<&&str> = said.iter().filter(|l| l.contains(": start ")).collect();
        assert!(starts.len() >= 2, "task {t} was requeued and restored: {}", context());
        assert!(starts[0].ends_with("start 1: no complete image, starting from scratch"), "{}", context());
        for (n, l) in starts.iter().enumerate().skip(1) {
            // Start n + 1 restores the cut the start before it took (gen-(n-1)).
            assert!(
                l.ends_with(&format!("start {}: restoring from {}/job-{id}/gen-{}/task-{t}", n + 1, h.scratch.join("images").display(), n - 1)),
                "{}",
                context()
            );
        }
        let done = if t == 0 { "checkpointed; Slurm starts the job again from there" } else { "checkpointed; task 0 requeues the job" };
        assert_eq!(said.iter().filter(|l| l.ends_with(done)).count(), starts.len() - 1, "task {t}: one checkpoint before each restart: {}", context());
        assert_eq!(said.last().copied(), Some(format!("{tag} the program ended: exited(0)").as_str()), "{}", context());
        assert!(restarts.is_none_or(|r| r == starts.len() - 1), "both tasks started as often: {}", context());
        restarts = Some(starts.len() - 1);
    }
    let job = cluster.run("scontrol", &["show", "job", id]);
    assert!(job.contains(&format!("Restarts={}", restarts.unwrap())), "Slurm started the job as often as the tasks said: {}", context());
    assert!(text.contains("verify ok both tasks"), "both tasks replayed the run and agree: {}", context());
    assert_eq!(progress_in(&text), reference, "Slurm's output holds the uninterrupted trajectory, each step once");
    wait("the job's images to go", Duration::from_secs(10), || !h.scratch.join("images").join(format!("job-{id}")).exists());
    text
}

/// A job of two nodes (#38): `srun hiber-slurm -- PROGRAM` runs one task on each of two
/// Slurm nodes, each node a host of its own (a network namespace with its address, veth
/// between them, and its own slurmd), and each task's program a job of its node's hiber.
/// The two programs talk over TCP between the nodes every step (`fixtures/slurm_pair.py`).
/// At the time limit's warning (`--signal=USR1@45`, to both tasks) the two are checkpointed
/// as one cut through `hiber coordinate`, which task 0 runs on its node; task 0 requeues the
/// job once both images are complete; Slurm starts it again and both are restored together,
/// their connection with them. The program's output is the uninterrupted trajectory, each
/// step once, and both tasks end agreeing.
#[test]
fn a_job_of_two_nodes_is_cut_as_one_at_its_time_limit_requeued_and_restored_on_both() {
    let h = Hiber::new("slurm-nodes");
    let hosts = Hosts::new();
    let cluster = Cluster::two_nodes(&h, &hosts, QUICK_REQUEUE, "PartitionName=batch Nodes={node} Default=YES MaxTime=INFINITE State=UP");
    let (pair, port, reference) = pair_program("400");
    let out = h.scratch.join("nodes.out");
    let script = format!(
        "#!/bin/bash\n#SBATCH -N 2 --requeue --time=1 --signal=USR1@45 --open-mode=append -o {}\nsrun {} -- python3 {} 400 100 {port}\n",
        out.display(),
        helper().display(),
        pair.display()
    );
    let id = submit(&h, &cluster, "nodes.sh", &script, &[]);
    check_two_node_cycles(&h, &cluster, &id, &out, &reference);
}

/// Preemption of a job of two nodes: the same two-node job in a `low` partition (a grace
/// time of 60 s), preempted by a `high` job that needs both nodes. Slurm sends SIGTERM to
/// both tasks at once: they are cut as one, task 0 requeues the job, the preemptor runs,
/// and the job is restored on both nodes once they are free, to the end of the
/// uninterrupted trajectory.
#[test]
fn a_preempted_job_of_two_nodes_is_cut_as_one_in_its_grace_time_and_resumes_after_the_preemptor() {
    let h = Hiber::new("slurm-nodes-preempt");
    let hosts = Hosts::new();
    let (settings, partitions) = preemption(60);
    let cluster = Cluster::two_nodes(&h, &hosts, &settings, &partitions);
    let (pair, port, reference) = pair_program("300");
    let out = h.scratch.join("low.out");
    let script = format!(
        "#!/bin/bash\n#SBATCH -p low -N 2 --requeue --open-mode=append -o {}\nsrun {} -- python3 {} 300 100 {port}\n",
        out.display(),
        helper().display(),
        pair.display()
    );
    let id = submit(&h, &cluster, "low.sh", &script, &[]);
    wait("the low job's program to reach step 50", Duration::from_secs(120), || progress_in(&read(&out)).len() >= 50);
    let high_out = h.scratch.join("high.out");
    let high = submit(&h, &cluster, "high.sh", &format!("#!/bin/bash\n#SBATCH -p high -N 2 -o {}\necho preemptor ran; sleep 3\n", high_out.display()), &[]);
    let text = check_two_node_cycles(&h, &cluster, &id, &out, &reference);
    for t in 0..2 {
        assert!(
            text.lines().any(|l| l.starts_with(&format!("hiber-slurm[{t}]: SIGTERM: checkpointing"))),
            "task {t} checkpointed on the preemption's SIGTERM: {text}"
        );
    }
    assert_eq!(read(&high_out).trim(), "preemptor ran");
    let high_job = cluster.run("scontrol", &["show", "job", &high]);
    assert!(high_job.contains("JobState=COMPLETED"), "{high_job}");
}
