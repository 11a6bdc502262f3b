//! hiber's CRIU patch 0004: with `device_threads`, CRIU sends "checkpoint-devices" once it
//! holds the tree and "resume-devices" before it lets a tree that runs on go, and only the
//! listed threads run meanwhile (where the CUDA driver's restore thread takes and gives
//! back device state while every other thread of the process stays frozen). Checked with a
//! real CRIU and a program of two threads that count in a shared file.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hiber_core::criu::{Criu, DumpOptions};

const PROGRAM: &str = r#"
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
/* slot 0: the main thread's count, 1: the helper's, 2: the helper's thread id */
static volatile uint64_t *slots;
static void *helper(void *arg) {
    (void)arg;
    slots[2] = syscall(SYS_gettid);
    for (;;) { slots[1]++; usleep(1000); }
}
int main(int argc, char **argv) {
    int fd = open(argv[1], O_RDWR);
    slots = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    pthread_t t;
    pthread_create(&t, 0, helper, 0);
    for (;;) { slots[0]++; usleep(1000); }
}
"#;

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn private_dir(name: &str) -> Dir {
    let d = std::env::temp_dir().join(format!("hiber-devnotify-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&d).unwrap();
    Dir(d)
}

fn slots(file: &Path) -> [u64; 3] {
    let b = std::fs::read(file).unwrap();
    let at = |i: usize| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
    [at(0), at(1), at(2)]
}

/// How much each thread counted over 150 ms: (main, helper).
fn counted(file: &Path) -> (u64, u64) {
    let a = slots(file);
    std::thread::sleep(Duration::from_millis(150));
    let b = slots(file);
    (b[0] - a[0], b[1] - a[1])
}

/// A `--leave-running` dump of `pid` into `images`, logging to `work`, with `threads` run
/// alone for the device notifications.
fn leave_running<'a>(pid: u32, images: &'a Dir, work: &'a Dir, threads: Vec<i32>) -> DumpOptions<'a> {
    DumpOptions {
        pid: pid as i32,
        images_dir: &images.0,
        work_dir: &work.0,
        leave_running: true,
        external_mounts: false,
        external_files: Vec::new(),
        skip_network_lock: true,
        device_threads: threads,
    }
}

#[test]
fn the_listed_thread_runs_alone_while_criu_holds_the_tree() {
    let criu = Criu::locate().expect("CRIU (scripts/setup.sh builds hiber's)");
    let version = criu.version().expect("CRIU answers its version");
    assert!(version.device_notify(), "CRIU at {} is not hiber's patched one (0004): {version:?}", criu.path().display());
    let dir = private_dir("work");
    let (src, prog, file) = (dir.0.join("p.c"), dir.0.join("p"), dir.0.join("slots"));
    std::fs::write(&src, PROGRAM).unwrap();
    let st = Command::new("cc").args(["-O2", "-pthread", "-o"]).arg(&prog).arg(&src).status().expect("run cc");
    assert!(st.success());
    std::fs::write(&file, vec![0u8; 4096]).unwrap();
    // A session leader, as CRIU wants a tree's root (setsid(1) execs in place: the child
    // is not a group leader).
    let mut child = Command::new("setsid").arg(&prog).arg(&file).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let start = Instant::now();
    while slots(&file)[2] == 0 || slots(&file)[0] < 10 {
        assert!(start.elapsed() < Duration::from_secs(10), "the program counts");
        std::thread::sleep(Duration::from_millis(10));
    }
    let helper = slots(&file)[2] as i32;
    let (images, work) = (private_dir("images"), private_dir("log"));
    let mut seen: Vec<(String, (u64, u64))> = Vec::new();
    let opts = leave_running(child.id(), &images, &work, vec![helper]);
    let dumped = criu.dump(&opts, &mut |script| {
        if matches!(script, "checkpoint-devices" | "resume-devices" | "post-dump") {
            seen.push((script.to_string(), counted(&file)));
        }
        Ok(())
    });
    let after = counted(&file);
    let _ = child.kill();
    let _ = child.wait();
    dumped.unwrap_or_else(|e| panic!("dump: {e}"));
    let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["checkpoint-devices", "post-dump", "resume-devices"], "{seen:?}");
    for (name, (main, helper)) in &seen {
        match name.as_str() {
            "post-dump" => assert_eq!((*main, *helper), (0, 0), "nothing runs at post-dump"),
            _ => {
                assert_eq!(*main, 0, "{name}: the main thread stays frozen");
                assert!(*helper > 10, "{name}: the listed thread runs ({helper} counts in 150 ms)");
            }
        }
    }
    assert!(after.0 > 10 && after.1 > 10, "both run after the dump: {after:?}");
}

/// Without listed threads there is no device notification, and a thread that is not in
/// the tree fails the dump before anything is taken (the tree runs on).
#[test]
fn no_threads_no_notification_and_a_stranger_fails_the_dump() {
    let criu = Criu::locate().expect("CRIU");
    let mut child = Command::new("setsid").args(["sleep", "30"]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    for (threads, ok) in [(vec![], true), (vec![std::process::id() as i32], false)] {
        let (images, work) = (private_dir("images2"), private_dir("log2"));
        let mut seen = Vec::new();
        let opts = leave_running(child.id(), &images, &work, threads.clone());
        let r = criu.dump(&opts, &mut |script| {
            seen.push(script.to_string());
            Ok(())
        });
        assert_eq!(r.is_ok(), ok, "threads {threads:?}: {r:?}");
        assert!(!seen.iter().any(|s| s.ends_with("-devices")), "threads {threads:?}: {seen:?}");
    }
    let alive = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(alive, "the tree runs on");
}
