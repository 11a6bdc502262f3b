//! Timers across checkpoint and restore: a program blocked on a periodic timerfd (20 ms),
//! with a one-shot timerfd always armed (tests/fixtures/timers.c). A checkpoint catches the
//! periodic timer expired with a tick pending (the program keeps it so 19 ms of every 20),
//! which CRIU 4.1.1 restores disarmed: the copy reads that tick, then blocks for good
//! (scripts/criu-patches/0003 arms it again). Each test asserts the restored copies go on
//! ticking, their counts going on from the checkpoint's, and their one-shot firing.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// How long a job has to tick `MORE` more times (0.4 s of ticks, on a busy machine).
const BOUND: Duration = Duration::from_secs(15);
const MORE: u64 = 20;

/// (tick, expirations) of every `tick N expirations E` line of a job's log.
fn ticks(h: &Hiber, job: &str) -> Vec<(u64, u64)> {
    h.log(job)
        .lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            ["tick", n, "expirations", e] => Some((n.parse().ok()?, e.parse().ok()?)),
            _ => None,
        })
        .collect()
}

/// (K, N) of every `oneshot K at tick N` line of a job's log.
fn oneshots(h: &Hiber, job: &str) -> Vec<(u64, u64)> {
    h.log(job)
        .lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            ["oneshot", k, "at", "tick", n] => Some((k.parse().ok()?, n.parse().ok()?)),
            _ => None,
        })
        .collect()
}

/// The count of the last one-shot a job's log shows, 0 for none.
fn last_oneshot(h: &Hiber, job: &str) -> u64 {
    oneshots(h, job).last().map_or(0, |o| o.0)
}

/// Waits until `job` has printed tick `tick` and a one-shot past `oneshot`; a job whose
/// periodic timer stopped firing is blocked in read and never gets there.
fn wait_ticking(h: &Hiber, job: &str, tick: u64, oneshot: u64) {
    let start = Instant::now();
    while ticks(h, job).last().is_none_or(|t| t.0 < tick) || last_oneshot(h, job) <= oneshot {
        assert!(
            start.elapsed() < BOUND,
            "job {job} did not reach tick {tick} with a one-shot past {oneshot} within {BOUND:?} (its periodic timerfd \
             stopped firing?); state {}, log tail:\n{}",
            h.state_of(job),
            tail(&h.log(job))
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Checks a restored copy's log: it goes on from the original's counts at tick `from` - 1
/// (the tick count and the expirations are process memory), one line per tick, and its
/// first one-shot is the one after the original's last before that tick.
fn assert_goes_on(original: &str, h: &Hiber, copy: &str) {
    let (orig, ours) = (ticks(h, original), ticks(h, copy));
    let (from, first_expirations) = ours[0];
    let before = orig.iter().find(|t| t.0 == from - 1).unwrap_or_else(|| panic!("{copy} starts at tick {from}, which {original} never reached + 1"));
    assert!(first_expirations > before.1, "{copy}: expirations go on from {} (tick {}), not {first_expirations}", before.1, before.0);
    for w in ours.windows(2) {
        assert!(w[1].0 == w[0].0 + 1 && w[1].1 > w[0].1, "{copy}: one line a tick, expirations growing: {w:?}");
    }
    let oneshot_before = oneshots(h, original).iter().rev().find(|o| o.1 < from).map_or(0, |o| o.0);
    assert_eq!(oneshots(h, copy).first().map(|o| o.0), Some(oneshot_before + 1), "{copy}: the one-shot count goes on from the checkpoint's");
}

#[test]
fn periodic_and_one_shot_timers_keep_firing_after_restore() {
    let h = Hiber::new("timers");
    let bin = h.build_fixture("cc", "timers");
    h.ok(&["run", "--name", "timers", "--", bin.to_str().unwrap()]);
    wait_ticking(&h, "timers", 25, 0);
    let image = h.images_dir().join("timers");
    let pid = h.pid_of("timers");
    h.ok(&["checkpoint", "timers", "--out", image.to_str().unwrap()]);
    wait("the original to stop", Duration::from_secs(10), || !alive(pid));
    let (last, expirations) = *ticks(&h, "timers").last().unwrap();
    let oneshot = last_oneshot(&h, "timers");
    h.ok(&["restore", image.to_str().unwrap(), "--name", "timers-r"]);
    wait_ticking(&h, "timers-r", last + MORE, oneshot);
    let ours = ticks(&h, "timers-r");
    assert_eq!(ours[0].0, last + 1, "the tick count goes on from the checkpoint's, not from 0");
    assert!(ours[0].1 > expirations, "the expirations go on from {expirations}: {:?}", ours[0]);
    assert_goes_on("timers", &h, "timers-r");
    assert_eq!(h.state_of("timers-r"), "running");
}

#[test]
fn leave_running_keeps_the_original_ticking_beside_two_restored_copies() {
    let h = Hiber::new("timers-leave");
    let bin = h.build_fixture("cc", "timers");
    h.ok(&["run", "--name", "orig", "--", bin.to_str().unwrap()]);
    wait_ticking(&h, "orig", 25, 0);
    let image = h.images_dir().join("orig");
    h.ok(&["checkpoint", "orig", "--leave-running", "--out", image.to_str().unwrap()]);
    let at = ticks(&h, "orig").last().unwrap().0;
    let oneshot = last_oneshot(&h, "orig");
    // The dump only read the timers: the original's go on.
    wait_ticking(&h, "orig", at + MORE, oneshot);
    for copy in ["copy-a", "copy-b"] {
        h.ok(&["restore", image.to_str().unwrap(), "--name", copy]);
    }
    let now = ticks(&h, "orig").last().unwrap().0;
    for copy in ["copy-a", "copy-b"] {
        wait(&format!("{copy}'s first tick"), BOUND, || !ticks(&h, copy).is_empty());
        let first = ticks(&h, copy)[0].0;
        assert!(first > 25 && first <= at + 1, "{copy} goes on from the checkpoint (tick {first}, checkpoint at {at})");
        wait_ticking(&h, copy, first + MORE, 0);
        assert_goes_on("orig", &h, copy);
    }
    // All three at once.
    wait_ticking(&h, "orig", now + MORE, 0);
    for job in ["orig", "copy-a", "copy-b"] {
        assert_eq!(h.state_of(job), "running", "{job}");
    }
}
