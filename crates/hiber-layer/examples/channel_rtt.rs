//! Round trips through the proxy channel (`hiber_layer::channel`) against a plain unix
//! socket: runs itself again as the proxy process, then times 100k small calls (16 bytes
//! each way), 1 GiB streamed each way through `call`, and 100k 16-byte round trips on a
//! unix stream socket.
//!
//! `cargo run --release -p hiber-layer --example channel_rtt`

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hiber_layer::channel::{self, Client, Handler, Notifier};

const PROXY_ENV: &str = "HIBER_CHANNEL_RTT_PROXY";
const CALLS: usize = 100_000;
const STREAM_TOTAL: usize = 1 << 30;
const STREAM_CALL: usize = 16 << 20;

/// `D` + u32: an answer of that many bytes; anything else: its first 16 bytes back.
struct Bench;

impl Handler for Bench {
    fn handle(&self, req: &[u8], answer: &mut Vec<u8>, _: &Notifier) {
        if req.len() == 5 && req[0] == b'D' {
            answer.resize(u32::from_le_bytes([req[1], req[2], req[3], req[4]]) as usize, 0x5a);
        } else {
            answer.extend_from_slice(&req[..req.len().min(16)]);
        }
    }
}

/// The proxy process: one channel client, then one plain-socket client (echo of 16 bytes).
fn proxy(path: &Path) -> std::io::Result<()> {
    let l = UnixListener::bind(path)?;
    let (s, _) = l.accept()?;
    channel::serve(s, Arc::new(Bench))?;
    let (mut s, _) = l.accept()?;
    let mut b = [0u8; 16];
    while s.read_exact(&mut b).is_ok() {
        s.write_all(&b)?;
    }
    Ok(())
}

fn connect<T>(path: &Path, f: impl Fn(&Path) -> std::io::Result<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match f(path) {
            Ok(c) => return c,
            Err(e) if Instant::now() > deadline => panic!("cannot connect to the proxy: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn percentiles(mut ns: Vec<u64>) -> (f64, f64) {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    (at(0.5), at(0.99))
}

fn main() -> std::io::Result<()> {
    if let Some(path) = std::env::var_os(PROXY_ENV) {
        return proxy(Path::new(&path));
    }
    let path = std::env::temp_dir().join(format!("hiber-channel-rtt-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let mut child = Command::new(std::env::current_exe()?).env(PROXY_ENV, &path).stdin(Stdio::null()).spawn()?;

    let c = connect(&path, Client::connect);
    let req = [7u8; 16];
    for _ in 0..10_000 {
        c.call(&req)?;
    }
    let mut ns = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let t = Instant::now();
        let a = c.call(&req)?;
        ns.push(t.elapsed().as_nanos() as u64);
        assert_eq!(a.len(), 16);
    }
    let (chan_p50, chan_p99) = percentiles(ns);

    let big = vec![0xa5u8; STREAM_CALL];
    let t = Instant::now();
    for _ in 0..STREAM_TOTAL / STREAM_CALL {
        c.call(&big)?;
    }
    let up = STREAM_TOTAL as f64 / t.elapsed().as_secs_f64() / 1e6;
    let mut down_req = vec![b'D'];
    down_req.extend_from_slice(&(STREAM_CALL as u32).to_le_bytes());
    let t = Instant::now();
    for _ in 0..STREAM_TOTAL / STREAM_CALL {
        assert_eq!(c.call(&down_req)?.len(), STREAM_CALL);
    }
    let down = STREAM_TOTAL as f64 / t.elapsed().as_secs_f64() / 1e6;
    c.close();

    let mut s = connect(&path, |p| UnixStream::connect(p));
    let mut b = [0u8; 16];
    for _ in 0..10_000 {
        s.write_all(&req)?;
        s.read_exact(&mut b)?;
    }
    let mut ns = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let t = Instant::now();
        s.write_all(&req)?;
        s.read_exact(&mut b)?;
        ns.push(t.elapsed().as_nanos() as u64);
    }
    let (sock_p50, sock_p99) = percentiles(ns);
    drop(s);
    child.wait()?;
    let _ = std::fs::remove_file(&path);

    println!("{CALLS} round trips of 16 bytes each way:");
    println!("  {:<28} median {:>7.2} µs   p99 {:>7.2} µs", "shared-memory channel", chan_p50, chan_p99);
    println!("  {:<28} median {:>7.2} µs   p99 {:>7.2} µs", "unix socket (SOCK_STREAM)", sock_p50, sock_p99);
    println!("1 GiB through call, in calls of {} MiB:", STREAM_CALL >> 20);
    println!("  request  (app -> proxy)  {up:>8.0} MB/s");
    println!("  answer   (proxy -> app)  {down:>8.0} MB/s");
    Ok(())
}
