//! `sys::ptrace::RunningThread`: one thread of a stopped process runs while the others
//! stay stopped, and it returns to the stop when done; the process then continues whole.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hiber_core::sys;

fn state(pid: u32, tid: i32) -> char {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).unwrap();
    s.rsplit_once(')').unwrap().1.split_whitespace().next().unwrap().chars().next().unwrap()
}

fn threads(pid: u32) -> Vec<i32> {
    let mut t: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().map(|e| e.unwrap().file_name().to_str().unwrap().parse().unwrap()).collect();
    t.sort();
    t
}

fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn one_thread_runs_while_the_others_stay_stopped() {
    // Two threads that each count, in files of their own, as they run.
    let dir = std::env::temp_dir().join(format!("hiber-ptrace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = "import sys, threading, time\n\
                  def count(path):\n\
                  \x20   n = 0\n\
                  \x20   while True:\n\
                  \x20       n += 1\n\
                  \x20       open(path, 'w').write(str(n))\n\
                  \x20       time.sleep(0.005)\n\
                  threading.Thread(target=count, args=(sys.argv[1] + '/worker',), daemon=True).start()\n\
                  count(sys.argv[1] + '/main')\n";
    let mut child = Command::new("python3").args(["-c", script, dir.to_str().unwrap()]).stdin(Stdio::null()).spawn().unwrap();
    let pid = child.id();
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok().and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    wait_for("both threads to count", || read("main") > 3 && read("worker") > 3 && threads(pid).len() == 2);
    let (main, worker) = (threads(pid)[0], threads(pid)[1]);
    assert!(sys::kill(pid as i32, libc::SIGSTOP).unwrap());
    wait_for("the stop", || state(pid, main) == 'T' && state(pid, worker) == 'T');
    std::thread::sleep(Duration::from_millis(50));
    let (m0, w0) = (read("main"), read("worker"));

    let running = sys::ptrace::RunningThread::start(worker).unwrap();
    wait_for("the worker alone to count on", || read("worker") > w0 + 5);
    assert_eq!(read("main"), m0, "the main thread stays stopped");
    assert_eq!(state(pid, main), 'T');
    running.stop().unwrap();
    wait_for("the worker to stop again", || state(pid, worker) == 'T');
    let w1 = read("worker");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(read("worker"), w1, "stopped again after detach");

    assert!(sys::kill(pid as i32, libc::SIGCONT).unwrap());
    wait_for("both to count after SIGCONT", || read("main") > m0 + 3 && read("worker") > w1 + 3);
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
