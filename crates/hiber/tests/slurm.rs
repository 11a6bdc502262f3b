//! Slurm drives hiber (#38): a batch job run through `scripts/hiber-slurm`, the documented
//! pattern, on a one-node Slurm cluster this test starts (Debian's slurmctld and slurmd,
//! their own configuration, state and ports). At the time limit's warning signal
//! (`--signal=B:USR1@45`) the program is checkpointed and the job requeued; Slurm starts it
//! again, and it is restored and runs to its end. Its output in Slurm's file is the whole
//! uninterrupted trajectory, each step once. (slurmctld looks at time limits every half
//! minute or so: the program runs 50 s, longer than the signal can be late.)

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use common::{progress_in, wait, Hiber, HIBER};

/// slurmctld and slurmd in the foreground, killed when dropped.
struct Cluster {
    daemons: Vec<Child>,
    conf: PathBuf,
}

impl Cluster {
    fn start(h: &Hiber) -> Cluster {
        let dir = h.scratch.join("slurm");
        for d in ["state", "spool", "log"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let node = String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout).unwrap().trim().to_string();
        let port = 17000 + (std::process::id() % 1000) * 2;
        let d = dir.display();
        let conf = dir.join("slurm.conf");
        std::fs::write(
            &conf,
            format!(
                "ClusterName=hibertest\nSlurmctldHost={node}(127.0.0.1)\nAuthType=auth/none\nCredType=cred/none\n\
                 SlurmUser=root\nSlurmdUser=root\nStateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\n\
                 SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd.pid\n\
                 SlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd.log\n\
                 SlurmctldPort={port}\nSlurmdPort={}\nProctrackType=proctrack/pgid\nTaskPlugin=task/none\n\
                 SchedulerType=sched/backfill\nSelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n\
                 JobAcctGatherType=jobacct_gather/none\nMpiDefault=none\nReturnToService=2\n\
                 NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN\n\
                 PartitionName=batch Nodes={node} Default=YES MaxTime=INFINITE State=UP\n",
                port + 1
            ),
        )
        .unwrap();
        let spawn = |prog: &str, args: &[&str]| {
            Command::new(prog).args(args).env("SLURM_CONF", &conf).spawn().unwrap_or_else(|e| panic!("{prog}: {e} (scripts/setup.sh installs Slurm)"))
        };
        let daemons = vec![spawn("slurmctld", &["-D", "-c"]), spawn("slurmd", &["-D"])];
        let c = Cluster { daemons, conf };
        wait("the Slurm node to be idle", Duration::from_secs(60), || c.run("sinfo", &["-h", "-o", "%T"]).trim() == "idle");
        c
    }

    fn run(&self, prog: &str, args: &[&str]) -> String {
        let out = Command::new(prog).args(args).env("SLURM_CONF", &self.conf).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.run("scancel", &["-u", "root"]);
        for d in &mut self.daemons {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
}

#[test]
fn a_batch_job_is_checkpointed_at_its_time_limit_requeued_and_restored() {
    let h = Hiber::new("slurm");
    let cluster = Cluster::start(&h);
    let workload = ["workload", "cpu", "--steps", "500", "--mem-mib", "16", "--interval-ms", "100"];
    let reference = {
        let out = Command::new(HIBER).args(&workload[..6]).args(["--interval-ms", "0"]).output().unwrap();
        progress_in(&String::from_utf8_lossy(&out.stdout))
    };
    assert_eq!(reference.len(), 500, "the reference run");
    let helper = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/hiber-slurm");
    let out = h.scratch.join("job.out");
    let script = h.scratch.join("job.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/bash\n#SBATCH --requeue --time=1 --signal=B:USR1@45 --open-mode=append -o {}\nexec {} -- {HIBER} {}\n",
            out.display(),
            helper.display(),
            workload.join(" ")
        ),
    )
    .unwrap();
    let images = h.scratch.join("images");
    let submitted = Command::new("sbatch")
        .arg(&script)
        .env("SLURM_CONF", &cluster.conf)
        .env("HIBER", HIBER)
        .env("HIBER_STATE", &h.state)
        .env("HIBER_SLURM_DIR", &images)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&submitted.stdout);
    let id = said.trim().rsplit(' ').next().unwrap().to_string();
    assert!(submitted.status.success() && id.parse::<u64>().is_ok(), "sbatch: {said} {}", String::from_utf8_lossy(&submitted.stderr));
    // Slurm holds a requeued batch job about two minutes before it starts it again.
    let log = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    wait("the job to end after its restarts", Duration::from_secs(600), || log(&out).contains("hiber-slurm: the program ended"));
    let text = log(&out);
    let said: Vec<&str> = text.lines().filter(|l| l.starts_with("hiber-slurm:")).collect();
    let context = || format!("{said:#?}\n{}", cluster.run("scontrol", &["show", "job", &id]));
    // Each start says which it is; a start may get the warning again (the requeued job has
    // the same time limit), and a warning that comes as the program ends finds nothing to
    // checkpoint. What must hold: it started from scratch once, was checkpointed and
    // restored at least once, and the program ended well.
    let starts: Vec<&&str> = said.iter().filter(|l| l.contains(": start ")).collect();
    assert!(starts[0].contains("start 1: no complete image, starting from scratch"), "{}", context());
    for (n, l) in starts.iter().enumerate().skip(1) {
        assert!(l.contains(&format!("start {}: restoring from", n + 1)), "start {} restores: {}", n + 1, context());
    }
    assert!(starts.len() >= 2, "the job was requeued and restored: {}", context());
    let checkpointed = said.iter().filter(|l| l.ends_with("checkpointed; Slurm starts the job again from there")).count();
    assert_eq!(checkpointed, starts.len() - 1, "one checkpoint before each restart: {}", context());
    assert_eq!(said.last().copied(), Some("hiber-slurm: the program ended: exited(0)"), "{}", context());
    let job = cluster.run("scontrol", &["show", "job", &id]);
    assert!(job.contains(&format!("Restarts={}", starts.len() - 1)), "Slurm started the job as often as it said: {}", context());
    assert!(text.contains("verify ok"), "the program checked its memory at the end: {text}");
    assert_eq!(progress_in(&text), reference, "Slurm's output holds the uninterrupted trajectory, each step once");
    assert!(!images.join(format!("job-{id}")).exists(), "the image goes once the program has ended");
}
