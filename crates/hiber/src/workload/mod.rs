//! Built-in workloads: programs whose state proves a restore was exact.
//!
//! Each prints one progress line per step (`step N checksum X t MS`, with MS the wall
//! clock in milliseconds, so a gap in progress can be measured from the outside; parsed
//! by `progress.rs`, which the end-to-end tests share) and, at
//! the end, replays its whole computation from scratch and compares: `verify ok ...` or
//! `verify FAILED ...` (exit 1). A restore that lost or altered any state fails that check.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::cli_error::{CliError, FAILED};

mod gpu;
mod progress;

pub use progress::progress_of;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    kind: Kind,
}

#[derive(clap::Subcommand)]
enum Kind {
    /// One thread updating a buffer of known content and a running checksum.
    Cpu(CpuArgs),
    /// Several threads, each with its own counter and checksum chain.
    Threads(ThreadArgs),
    /// A parent sending numbered lines through a pipe to a child that checks them.
    Pipe(PipeArgs),
    /// The reading end of `pipe` (started by it).
    PipeReader(PipeArgs),
    /// Appends records to a file while reading them back through a second descriptor.
    Files(FileArgs),
    /// Device memory advanced by a kernel each step and verified word by word at the end
    /// (PTX JIT-compiled by the driver: no CUDA toolkit needed).
    Gpu(GpuArgs),
    /// Prints the CUDA checkpoint structs' layout as hiber uses it (compared with cuda.h
    /// by the GPU suite).
    CudaAbi,
}

#[derive(clap::Args, Clone)]
struct GpuArgs {
    #[arg(long, default_value_t = 200)]
    steps: u64,
    #[arg(long, default_value_t = 20)]
    interval_ms: u64,
    /// Device memory to hold.
    #[arg(long, default_value_t = 1024)]
    mem_mib: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: i32,
}

#[derive(clap::Args, Clone)]
struct CpuArgs {
    #[arg(long, default_value_t = 200)]
    steps: u64,
    #[arg(long, default_value_t = 20)]
    interval_ms: u64,
    /// Size of the buffer of known content.
    #[arg(long, default_value_t = 64)]
    mem_mib: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(clap::Args, Clone)]
struct ThreadArgs {
    #[arg(long, default_value_t = 4)]
    threads: u64,
    #[arg(long, default_value_t = 200)]
    steps: u64,
    #[arg(long, default_value_t = 20)]
    interval_ms: u64,
}

#[derive(clap::Args, Clone)]
struct PipeArgs {
    #[arg(long, default_value_t = 200)]
    steps: u64,
    #[arg(long, default_value_t = 20)]
    interval_ms: u64,
}

#[derive(clap::Args, Clone)]
struct FileArgs {
    #[arg(long)]
    path: std::path::PathBuf,
    #[arg(long, default_value_t = 200)]
    steps: u64,
    #[arg(long, default_value_t = 20)]
    interval_ms: u64,
}

pub fn run(args: Args) -> Result<(), CliError> {
    let ok = match args.kind {
        Kind::Cpu(a) => cpu(&a),
        Kind::Threads(a) => threads(&a),
        Kind::Pipe(a) => pipe_writer(&a)?,
        Kind::PipeReader(a) => pipe_reader(&a),
        Kind::Files(a) => files(&a)?,
        Kind::CudaAbi => {
            for (k, v) in hiber_core::engine::cuda::abi_layout() {
                println!("{k} {v}");
            }
            true
        }
        Kind::Gpu(a) => gpu::run(&gpu::GpuRun { mem_mib: a.mem_mib, steps: a.steps, interval_ms: a.interval_ms, seed: a.seed, device: a.device })
            .map_err(|e| CliError::new(FAILED, format!("gpu workload: {e}")))?,
    };
    if ok {
        Ok(())
    } else {
        Err(CliError::new(FAILED, "workload verification failed"))
    }
}

/// splitmix64's finalizer: a cheap, well-mixing step function.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0)
}

/// One line to stdout, flushed at once: each line is one write(2), so a checkpoint never
/// splits one.
fn line(s: std::fmt::Arguments<'_>) {
    println!("{s}");
    let _ = std::io::stdout().flush();
}

const TOUCH_PER_STEP: u64 = 1024;

/// The words of the CPU workload's buffer touched at `step`.
fn touched(step: u64, words: u64) -> impl Iterator<Item = u64> {
    let base = mix(step) % words;
    (0..TOUCH_PER_STEP).map(move |k| (base + k * 4099) % words)
}

fn initial_word(seed: u64, i: u64) -> u64 {
    mix(seed ^ i.wrapping_mul(0x2545_f491_4f6c_dd1d))
}

/// Where the CPU workload's words live: the live buffer, or the replay's sparse copy.
trait Words {
    fn get(&self, p: u64) -> u64;
    fn set(&mut self, p: u64, v: u64);
}

impl Words for Vec<u64> {
    fn get(&self, p: u64) -> u64 {
        self[p as usize]
    }
    fn set(&mut self, p: u64, v: u64) {
        self[p as usize] = v;
    }
}

/// The replay keeps only the words it changed; the rest are still their initial value.
struct Sparse {
    seed: u64,
    changed: HashMap<u64, u64>,
}

impl Words for Sparse {
    fn get(&self, p: u64) -> u64 {
        self.changed.get(&p).copied().unwrap_or_else(|| initial_word(self.seed, p))
    }
    fn set(&mut self, p: u64, v: u64) {
        self.changed.insert(p, v);
    }
}

/// One step; shared by the live run and the replay.
fn cpu_step(step: u64, words: u64, checksum: u64, store: &mut dyn Words) -> u64 {
    let mut c = checksum;
    for p in touched(step, words) {
        let v = mix(store.get(p) ^ step);
        store.set(p, v);
        c = mix(c ^ v);
    }
    c
}

fn cpu(a: &CpuArgs) -> bool {
    let words = (a.mem_mib.max(1) << 20) / 8;
    let mut buf: Vec<u64> = (0..words).map(|i| initial_word(a.seed, i)).collect();
    let mut checksum = a.seed;
    line(format_args!("start cpu steps {} mem_mib {} pid {}", a.steps, a.mem_mib, std::process::id()));
    for step in 0..a.steps {
        checksum = cpu_step(step, words, checksum, &mut buf);
        line(format_args!("step {step} checksum {checksum:016x} t {}", now_ms()));
        std::thread::sleep(Duration::from_millis(a.interval_ms));
    }
    // Replay from scratch, then compare the checksum and every word of the buffer.
    let mut replay = Sparse { seed: a.seed, changed: HashMap::new() };
    let mut expect = a.seed;
    for step in 0..a.steps {
        expect = cpu_step(step, words, expect, &mut replay);
    }
    let bad_words = (0..words).filter(|&p| buf[p as usize] != replay.get(p)).count();
    if expect == checksum && bad_words == 0 {
        line(format_args!("verify ok steps {} checksum {checksum:016x}", a.steps));
        true
    } else {
        line(format_args!("verify FAILED checksum {checksum:016x} expected {expect:016x} bad_words {bad_words}"));
        false
    }
}

/// The workload's final verdict, if it printed one.
pub fn verdict_of(log: &str) -> Option<bool> {
    log.lines().rev().find_map(|l| {
        if l.starts_with("verify ok") {
            Some(true)
        } else if l.starts_with("verify FAILED") {
            Some(false)
        } else {
            None
        }
    })
}

fn chain(thread: u64, upto: u64) -> u64 {
    (0..upto).fold(thread, |h, i| mix(h ^ i ^ (thread << 32)))
}

fn threads(a: &ThreadArgs) -> bool {
    line(format_args!("start threads {} steps {} pid {}", a.threads, a.steps, std::process::id()));
    let counters: Arc<Vec<AtomicU64>> = Arc::new((0..a.threads).map(|_| AtomicU64::new(0)).collect());
    let handles: Vec<_> = (0..a.threads)
        .map(|t| {
            let counters = counters.clone();
            let a = a.clone();
            std::thread::spawn(move || {
                let mut h = t;
                for i in 0..a.steps {
                    h = mix(h ^ i ^ (t << 32));
                    counters[t as usize].store(i + 1, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(a.interval_ms));
                }
                h == chain(t, a.steps)
            })
        })
        .collect();
    let mut step = 0;
    while counters.iter().any(|c| c.load(Ordering::SeqCst) < a.steps) {
        let counts: Vec<u64> = counters.iter().map(|c| c.load(Ordering::SeqCst)).collect();
        let min = counts.iter().min().copied().unwrap_or(0);
        line(format_args!("step {step} checksum {:016x} t {} counts {counts:?}", mix(min), now_ms()));
        step += 1;
        std::thread::sleep(Duration::from_millis(a.interval_ms));
    }
    let all_ok = handles.into_iter().all(|h| h.join().unwrap_or(false));
    if all_ok {
        line(format_args!("verify ok threads {} steps {}", a.threads, a.steps));
    } else {
        line(format_args!("verify FAILED threads {}", a.threads));
    }
    all_ok
}

fn pipe_writer(a: &PipeArgs) -> Result<bool, CliError> {
    let exe = std::env::current_exe()?;
    let mut child = std::process::Command::new(exe)
        .args(["workload", "pipe-reader", "--steps", &a.steps.to_string(), "--interval-ms", &a.interval_ms.to_string()])
        .stdin(std::process::Stdio::piped())
        .spawn()?;
    let mut to_child = child.stdin.take().expect("piped");
    line(format_args!("start pipe steps {} writer {} reader {}", a.steps, std::process::id(), child.id()));
    let mut checksum = 0u64;
    for step in 0..a.steps {
        checksum = mix(checksum ^ step);
        writeln!(to_child, "{step} {checksum:016x}")?;
        line(format_args!("step {step} checksum {checksum:016x} t {}", now_ms()));
        std::thread::sleep(Duration::from_millis(a.interval_ms));
    }
    drop(to_child);
    let status = child.wait()?;
    if status.success() {
        line(format_args!("verify ok pipe steps {}", a.steps));
        Ok(true)
    } else {
        line(format_args!("verify FAILED pipe reader {status}"));
        Ok(false)
    }
}

fn pipe_reader(a: &PipeArgs) -> bool {
    let mut expect_checksum = 0u64;
    let mut next = 0u64;
    for l in BufReader::new(std::io::stdin()).lines() {
        let Ok(l) = l else { break };
        expect_checksum = mix(expect_checksum ^ next);
        if l != format!("{next} {expect_checksum:016x}") {
            line(format_args!("reader FAILED at {next}: got '{l}'"));
            return false;
        }
        next += 1;
    }
    let ok = next == a.steps;
    line(format_args!("reader {} received {next} of {}", if ok { "ok" } else { "FAILED" }, a.steps));
    ok
}

fn files(a: &FileArgs) -> Result<bool, CliError> {
    let mut w = std::fs::OpenOptions::new().create(true).append(true).open(&a.path)?;
    let mut r = std::fs::File::open(&a.path)?;
    r.seek(SeekFrom::End(0))?;
    let base = r.stream_position()?;
    line(format_args!("start files path {} steps {} base {base}", a.path.display(), a.steps));
    let mut pending = Vec::new();
    for step in 0..a.steps {
        let rec = format!("record {step} {:016x}\n", mix(step));
        w.write_all(rec.as_bytes())?;
        // The reading descriptor follows the writes: its offset is process state too.
        let mut got = vec![0u8; rec.len()];
        r.read_exact(&mut got)?;
        pending.push(got == rec.as_bytes());
        line(format_args!("step {step} checksum {:016x} t {}", mix(step), now_ms()));
        std::thread::sleep(Duration::from_millis(a.interval_ms));
    }
    let mut text = String::new();
    std::fs::File::open(&a.path)?.read_to_string(&mut text)?;
    let body = &text[base as usize..];
    let expected: String = (0..a.steps).map(|s| format!("record {s} {:016x}\n", mix(s))).collect();
    let ok = body == expected && pending.iter().all(|&b| b);
    line(format_args!("verify {} records {}", if ok { "ok" } else { "FAILED" }, a.steps));
    Ok(ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touched_words_are_distinct_within_a_step() {
        for words in [8192u64, 131072, 1 << 27] {
            for step in 0..5 {
                let v: std::collections::HashSet<u64> = touched(step, words).collect();
                assert_eq!(v.len() as u64, TOUCH_PER_STEP, "words {words} step {step}");
            }
        }
    }

    #[test]
    fn cpu_workload_verifies_itself() {
        assert!(cpu(&CpuArgs { steps: 5, interval_ms: 0, mem_mib: 1, seed: 3 }));
    }

    #[test]
    fn verdict_is_the_last_verify_line() {
        assert_eq!(verdict_of("start cpu\nstep 0 checksum 0a t 1000\nverify ok steps 1\n"), Some(true));
        assert_eq!(verdict_of("verify FAILED x"), Some(false));
        assert_eq!(verdict_of("step 1"), None);
    }

    #[test]
    fn altered_memory_fails_verification() {
        // The replay must notice a single changed word: flip one and compare.
        let words = (1u64 << 20) / 8;
        let mut buf: Vec<u64> = (0..words).map(|i| initial_word(1, i)).collect();
        let mut replay = Sparse { seed: 1, changed: HashMap::new() };
        let (mut c, mut e) = (1, 1);
        for step in 0..3 {
            c = cpu_step(step, words, c, &mut buf);
            e = cpu_step(step, words, e, &mut replay);
        }
        assert_eq!(c, e);
        buf[12345] ^= 1;
        assert_eq!((0..words).filter(|&p| buf[p as usize] != replay.get(p)).count(), 1);
    }

    #[test]
    fn thread_chain_matches() {
        assert!(threads(&ThreadArgs { threads: 2, steps: 3, interval_ms: 1 }));
    }
}
