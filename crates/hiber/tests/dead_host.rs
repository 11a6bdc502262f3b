//! A host of a coordinated job dies (#38, failure): during a checkpoint, and before a
//! restore. The hosts are network namespaces joined by a veth pair, each with its own hiber
//! and a job; `hiber coordinate` runs on host A. Host B "dies" the way a machine does: its
//! hiber stops answering in the middle of the cut (held at a phase) and its link goes down,
//! so no FIN or RST ever reaches the coordinator, only silence.

mod common;

use std::io::Read;
use std::process::Command;
use std::time::{Duration, Instant};

use common::hosts::{hiber_in, Coordinator, Hosts};
use common::*;

const WORKLOAD: [&str; 5] = ["cpu", "--steps", "3000", "--mem-mib", "16"];

fn run_in(ns: &str, h: &Hiber, name: &str) {
    let mut args = vec!["run", "--name", name, "--", HIBER, "workload"];
    args.extend(WORKLOAD);
    args.extend(["--interval-ms", "40"]);
    let out = hiber_in(ns, h, &args).output().unwrap();
    assert!(out.status.success(), "hiber run {name}: {}", String::from_utf8_lossy(&out.stderr));
    h.wait_step(name, 3);
}

/// The workload's uninterrupted trajectory.
fn reference() -> Vec<(u64, String)> {
    let out = Command::new(HIBER).arg("workload").args(WORKLOAD).args(["--interval-ms", "0"]).output().unwrap();
    progress_in(&String::from_utf8_lossy(&out.stdout))
}

fn has_entries(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir).map(|mut d| d.next().is_some()).unwrap_or(false)
}

/// The phase timeout of the sessions below: how long the coordinator waits for a silent host.
const PHASE_S: u64 = 6;

/// A checkpoint cut across two hosts, host B dying once its job is dumped: the coordinator
/// hears nothing more from it, aborts the cut when the phase's time is up, and host A's
/// hiber gives its job back running, commits no image and leaves no partial one. Then a
/// restore of an earlier cut of both, with host B still gone: it fails on host A, saying a
/// participant is missing, before anything is restored.
#[test]
fn a_host_that_dies_in_a_cut_fails_it_everywhere_and_the_others_run_on() {
    let hosts = Hosts::new();
    let (ha, hb) = (Hiber::new("dead-a"), Hiber::new("dead-b"));
    run_in(&hosts.a, &ha, "wa");
    run_in(&hosts.b, &hb, "wb");

    // A cut of both, for the restore below.
    let first = Coordinator::start(&hosts, &ha, 2, 7501, 60);
    let (ia, ib) = (ha.images_dir().join("wa-1"), hb.images_dir().join("wb-1"));
    let a = first.participant(&hosts.a, &ha, &["checkpoint", "wa", "--leave-running", "--out", ia.to_str().unwrap()]).spawn().unwrap();
    let b = first.participant(&hosts.b, &hb, &["checkpoint", "wb", "--leave-running", "--out", ib.to_str().unwrap()]).spawn().unwrap();
    for c in [a, b] {
        let out = c.wait_with_output().unwrap();
        assert!(out.status.success(), "the first cut: {}", String::from_utf8_lossy(&out.stderr));
    }
    assert!(first.child.wait_with_output().unwrap().status.success());

    // The second cut: B's hiber is held once its job is dumped (before it says so), then its
    // host goes silent.
    let coord = Coordinator::start(&hosts, &ha, 2, 7502, PHASE_S);
    let (ia2, ib2) = (ha.images_dir().join("wa-2"), hb.images_dir().join("wb-2"));
    let b_err = hb.scratch.join("b.err");
    let mut b = coord
        .participant(&hosts.b, &hb, &["checkpoint", "wb", "--out", ib2.to_str().unwrap()])
        .env("HIBER_PAUSE_AT", "dumped")
        .stderr(std::fs::File::create(&b_err).unwrap())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let a = coord.participant(&hosts.a, &ha, &["checkpoint", "wa", "--out", ia2.to_str().unwrap()]).spawn().unwrap();
    wait("host B's hiber to be held at Dumped", Duration::from_secs(60), || std::fs::read_to_string(&b_err).unwrap_or_default().contains("paused at Dumped"));
    let link = Command::new("nsenter").arg(format!("--net={}", hosts.b)).args(["ip", "-o", "link", "show"]).output().unwrap();
    let veth = String::from_utf8_lossy(&link.stdout)
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap().to_string())
        .find(|n| n != "lo")
        .unwrap();
    let down = Command::new("nsenter").arg(format!("--net={}", hosts.b)).args(["ip", "link", "set", &veth, "down"]).status().unwrap();
    assert!(down.success());

    let out = a.wait_with_output().unwrap();
    let took = t0.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "host A's checkpoint of a cut that lost a host succeeded");
    assert!(err.contains("another participant failed") && err.contains("the application keeps running"), "host A says why: {err}");
    assert!(!err.contains("panicked"), "{err}");
    // The coordinator waits one phase's time for the silent host, then aborts everyone.
    assert!(took < Duration::from_secs(PHASE_S * 4 + 30), "host A waited {took:?} for a dead host");
    let left: Vec<_> = std::fs::read_dir(ha.images_dir()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left, ["wa-1"], "no image, whole or partial, of the failed cut on host A");
    let mut said = String::new();
    let mut c = coord.child;
    let status = c.wait().unwrap();
    c.stderr.take().unwrap().read_to_string(&mut said).unwrap();
    assert!(!status.success() && said.contains("did not reach"), "the coordinator names the silent host: {said}");
    // Host A's job was given back and computes on, on its trajectory.
    assert_eq!(ha.state_of("wa"), "running");
    let now = ha.last_step("wa").unwrap();
    ha.wait_step("wa", now + 3);
    let got = ha.progress("wa");
    assert_eq!(got, reference()[..got.len()], "host A's job is on its uninterrupted trajectory");
    assert!(!has_entries(&ha.state.join("journal")), "host A's journal entry is finished");
    let _ = b.kill();
    let _ = b.wait();

    // A coordinated restore of the first cut, host B still gone: refused on A before
    // anything runs.
    let coord = Coordinator::start(&hosts, &ha, 2, 7503, PHASE_S);
    let out = coord.participant(&hosts.a, &ha, &["restore", ia.to_str().unwrap(), "--name", "wa-r"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a restore with a participant missing succeeded");
    assert!(err.contains("1 of 2 participants joined"), "host A says a participant is missing: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(ha.state_of("wa-r"), "", "nothing of the restore runs on host A");
    let out = coord.child.wait_with_output().unwrap();
    assert!(!out.status.success());
    // The image is still good: restored alone (without a coordinator), it goes on from
    // where the first cut caught it.
    ha.ok(&["restore", ia.to_str().unwrap(), "--name", "wa-alone"]);
    wait("the restored copy to compute", Duration::from_secs(60), || ha.progress("wa-alone").len() >= 3);
    let copy = ha.progress("wa-alone");
    let r = reference();
    let at = r.iter().position(|p| p.0 == copy[0].0).unwrap();
    assert_eq!(copy, r[at..at + copy.len()], "the copy goes on from the first cut, on the trajectory");
}
