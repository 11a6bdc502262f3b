//! How `hiber coordinate` scales (#38): N participants, each on a thread of its own with its
//! own TLS connection (the library's `Remote`, as a `hiber checkpoint --coordinator` uses),
//! against a real `hiber coordinate` process. For each size it times every phase of one
//! checkpoint's session from the moment all participants are released at once until the
//! last one has the coordinator's answer: plain barriers (Prepared, Captured, Committed)
//! and exchanges (Quiesced, Dumped: each participant sends 64 bytes and gets all N back, as
//! the NCCL cut's counts are gathered), the CPU time the coordinator process spent in each
//! phase but the last (its own share, apart from the participants', which here share its
//! machine; the last phase's would take in the coordinator's exit), and its peak memory
//! (VmHWM). A phase's time runs from the first participant leaving the release to the last
//! one holding the answer.
//!
//! Usage: coordinator_scale HIBER SESSIONS SIZE... > results.json
//! Prints one JSON object: `{"coordinator": [{"participants", "samples": {"phase_ms",
//! "exchange_ms", "phase_cpu_ms", "exchange_cpu_ms"}, "join_s", "coordinator_hwm_mib",
//! "coordinator_threads"}]}`.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use hiber_core::coordinator::net::{session_token, Remote};
use hiber_core::coordinator::{Coordinator, Local, Phase};

/// The phases of one checkpoint's session, and whether each carries data.
const PHASES: [(Phase, bool); 5] =
    [(Phase::Prepared, false), (Phase::Quiesced, true), (Phase::Captured, false), (Phase::Dumped, true), (Phase::Committed, false)];

/// Participants start this far apart: joining (a TLS handshake each) is not what is
/// measured, and thousands at once on a small machine would run past the handshake's own
/// timeout. (A participant's `join` returns only once all have joined.)
const STAGGER: Duration = Duration::from_millis(2);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: coordinator_scale HIBER SESSIONS SIZE...");
        std::process::exit(2);
    }
    // A participant that fails would leave the others at a barrier for ever: any panic ends
    // the run (the coordinator then hears every connection close, and aborts).
    std::panic::set_hook(Box::new(|info| {
        eprintln!("coordinator_scale: {info}");
        std::process::exit(1);
    }));
    let hiber = &args[1];
    let sessions: usize = args[2].parse().expect("SESSIONS is a number");
    let mut rows = Vec::new();
    for size in &args[3..] {
        let n: usize = size.parse().expect("SIZE is a number");
        let mut phase_ms = Vec::new();
        let mut exchange_ms = Vec::new();
        let mut phase_cpu_ms = Vec::new();
        let mut exchange_cpu_ms = Vec::new();
        let mut join_s = Vec::new();
        let mut hwm = 0u64;
        let mut threads = 0u64;
        for _ in 0..sessions {
            let s = session(hiber, n);
            phase_ms.extend(s.phase_ms);
            exchange_ms.extend(s.exchange_ms);
            phase_cpu_ms.extend(s.phase_cpu_ms);
            exchange_cpu_ms.extend(s.exchange_cpu_ms);
            join_s.push(s.join_s);
            hwm = hwm.max(s.hwm_kib);
            threads = threads.max(s.threads);
            eprintln!("{n} participants: join {:.1} s, phases {:?} ms", s.join_s, s.all_ms);
        }
        rows.push(serde_json::json!({
            "participants": n,
            "sessions": sessions,
            "samples": {"phase_ms": phase_ms, "exchange_ms": exchange_ms, "phase_cpu_ms": phase_cpu_ms, "exchange_cpu_ms": exchange_cpu_ms},
            "join_s": join_s,
            "coordinator_hwm_mib": hwm as f64 / 1024.0,
            "coordinator_threads": threads,
        }));
    }
    println!("{}", serde_json::json!({ "coordinator": rows }));
}

struct Session {
    phase_ms: Vec<f64>,
    exchange_ms: Vec<f64>,
    phase_cpu_ms: Vec<f64>,
    exchange_cpu_ms: Vec<f64>,
    all_ms: Vec<u64>,
    join_s: f64,
    hwm_kib: u64,
    threads: u64,
}

fn session(hiber: &str, n: usize) -> Session {
    let token = session_token().expect("a session token");
    // A free port, handed to the coordinator (a race with another program is possible and
    // fails loudly).
    let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let addr = format!("127.0.0.1:{port}");
    let mut coord = Command::new(hiber)
        .args(["coordinate", "--participants", &n.to_string(), "--listen", &addr, "--timeout", "300"])
        .env("HIBER_SESSION", &token)
        .env("HIBER_LOG", "error")
        .stdout(Stdio::null())
        .spawn()
        .expect("hiber coordinate starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(Instant::now() < deadline, "the coordinator did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    let start = Instant::now();
    // All participants wait here before each phase, and the main thread with them.
    let release = Arc::new(Barrier::new(n + 1));
    // When each participant left the release of each phase, and when it had its answer.
    let released: Arc<Mutex<Vec<Vec<Instant>>>> = Arc::new(Mutex::new(vec![Vec::new(); PHASES.len()]));
    let done: Arc<Mutex<Vec<Vec<Instant>>>> = Arc::new(Mutex::new(vec![Vec::new(); PHASES.len()]));
    let mut handles = Vec::new();
    for i in 0..n {
        let (addr, token, release, released, done) = (addr.clone(), token.clone(), release.clone(), released.clone(), done.clone());
        let h = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || {
                // Returns at the welcome, once every participant has joined.
                let r = Remote::join(&addr, &token, &format!("p{i}"), Duration::from_secs(300), Local::default())
                    .unwrap_or_else(|e| panic!("participant {i}: {e}"));
                for (k, (phase, data)) in PHASES.iter().enumerate() {
                    release.wait();
                    released.lock().unwrap()[k].push(Instant::now());
                    if *data {
                        let all =
                            r.exchange(*phase, serde_json::json!({ "rank": i, "pad": "x".repeat(40) })).unwrap_or_else(|e| panic!("participant {i}: {e}"));
                        assert_eq!(all.len(), n, "every participant's data comes back");
                    } else {
                        r.barrier(*phase).unwrap_or_else(|e| panic!("participant {i}: {e}"));
                    }
                    done.lock().unwrap()[k].push(Instant::now());
                }
            })
            .expect("a participant thread");
        handles.push(h);
        std::thread::sleep(STAGGER);
    }
    let mut all_ms = Vec::new();
    let mut phase_ms = Vec::new();
    let mut exchange_ms = Vec::new();
    let mut phase_cpu_ms = Vec::new();
    let mut exchange_cpu_ms = Vec::new();
    let mut join_s = 0.0;
    let mut hwm_kib = 0;
    let mut threads = 0;
    let last_phase = PHASES.len() - 1;
    for (k, (_, data)) in PHASES.iter().enumerate() {
        release.wait();
        // After the release: the first phase's window must not take in the last joins.
        let cpu0 = cpu_ms(coord.id());
        if k == 0 {
            join_s = start.elapsed().as_secs_f64();
        }
        // Every participant has its answer when the last one records it.
        let deadline = Instant::now() + Duration::from_secs(600);
        while done.lock().unwrap()[k].len() < n {
            assert!(Instant::now() < deadline, "the participants did not pass phase {k} within 600 s");
            std::thread::sleep(Duration::from_micros(200));
        }
        // From the first participant out of the release to the last one answered.
        let t0 = *released.lock().unwrap()[k].iter().min().expect("n > 0");
        let last = *done.lock().unwrap()[k].iter().max().expect("n > 0");
        let ms = last.duration_since(t0).as_secs_f64() * 1e3;
        all_ms.push(ms.round() as u64);
        // The coordinator has answered everyone: what it spent on this phase is counted. Not
        // for the last one: the coordinator ends right after it, and its end would be in it.
        let cpu = (k < last_phase).then(|| cpu_ms(coord.id()) - cpu0);
        if *data {
            exchange_ms.push(ms);
            exchange_cpu_ms.extend(cpu);
        } else {
            phase_ms.push(ms);
            phase_cpu_ms.extend(cpu);
        }
        if k == PHASES.len() - 2 {
            // Before the last phase, while the coordinator still runs.
            let status = std::fs::read_to_string(format!("/proc/{}/status", coord.id())).unwrap_or_default();
            let field =
                |name: &str| status.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0);
            hwm_kib = field("VmHWM:");
            threads = field("Threads:");
        }
    }
    for h in handles {
        h.join().expect("a participant passed every phase");
    }
    let st = coord.wait().expect("the coordinator ends");
    assert!(st.success(), "the coordinator ended with {st}");
    Session { phase_ms, exchange_ms, phase_cpu_ms, exchange_cpu_ms, all_ms, join_s, hwm_kib, threads }
}

/// The CPU time (user and system) process `pid` has used, in milliseconds.
fn cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command's closing parenthesis: state is field 3, utime 14 and stime 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest.split_whitespace().map(|v| v.parse().unwrap_or(0.0)).collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    if f.len() < 13 || hz <= 0.0 {
        return 0.0;
    }
    (f[11] + f[12]) * 1000.0 / hz
}
