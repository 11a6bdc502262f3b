//! Tests of the channel, most with the proxy in a process of its own: the test binary run
//! again with [`PROXY_ENV`] naming the socket it serves on.

use super::*;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicUsize;
use std::sync::{mpsc, Condvar};

const PROXY_ENV: &str = "HIBER_CHANNEL_TEST_PROXY";

/// Requests are an opcode byte and arguments.
#[derive(Default)]
struct TestHandler {
    log: Mutex<Vec<Vec<u8>>>,
    released: Mutex<bool>,
    cv: Condvar,
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).wrapping_add((i >> 12) as u8)).collect()
}

fn arg_u32(req: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(req[at..at + 4].try_into().unwrap())
}

impl Handler for TestHandler {
    fn handle(&self, req: &[u8], answer: &mut Vec<u8>, notifier: &Notifier) {
        match req.first() {
            // Echo.
            Some(b'E') => answer.extend_from_slice(&req[1..]),
            // Log (posted), and the log.
            Some(b'L') => self.log.lock().unwrap().push(req[1..].to_vec()),
            Some(b'G') => {
                for e in self.log.lock().unwrap().iter() {
                    answer.extend_from_slice(&(e.len() as u32).to_le_bytes());
                    answer.extend_from_slice(e);
                }
            }
            // Block until released.
            Some(b'B') => {
                let mut r = self.released.lock().unwrap();
                while !*r {
                    r = self.cv.wait(r).unwrap();
                }
                answer.extend_from_slice(b"released");
            }
            Some(b'R') => {
                *self.released.lock().unwrap() = true;
                self.cv.notify_all();
            }
            // Notify: `count` small ones, one of `big` bytes, and one from another thread.
            Some(b'N') => {
                for i in 0..arg_u32(req, 1) {
                    notifier.notify(&i.to_le_bytes()).unwrap();
                }
                notifier.notify(&pattern(arg_u32(req, 5) as usize, 7)).unwrap();
                let n = notifier.clone();
                std::thread::spawn(move || n.notify(b"from a thread").unwrap()).join().unwrap();
            }
            // Work that takes `n` microseconds.
            Some(b'S') => std::thread::sleep(Duration::from_micros(arg_u32(req, 1) as u64)),
            // An answer of `n` bytes.
            Some(b'D') => answer.extend_from_slice(&pattern(arg_u32(req, 1) as usize, 3)),
            _ => answer.extend_from_slice(b"?"),
        }
    }
}

fn sock_path(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    std::env::temp_dir().join(format!("hiber-chan-{}-{tag}-{}.sock", std::process::id(), N.fetch_add(1, Ordering::Relaxed)))
}

/// A proxy on a thread of this process, for one client.
fn proxy_thread(tag: &str) -> (PathBuf, std::thread::JoinHandle<io::Result<()>>) {
    let path = sock_path(tag);
    let l = UnixListener::bind(&path).unwrap();
    let t = std::thread::spawn(move || {
        let (s, _) = l.accept()?;
        serve(s, Arc::new(TestHandler::default()))
    });
    (path, t)
}

/// A proxy process for one client, and a client connected to it.
#[allow(clippy::zombie_processes)] // Returned to the test, which waits for it.
fn proxy_process(tag: &str) -> (Child, Client, PathBuf) {
    let path = sock_path(tag);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "channel::tests::proxy_process_entry", "--test-threads=1"])
        .env(PROXY_ENV, &path)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if std::fs::metadata(&path).is_ok_and(|m| m.file_type().is_socket()) {
            if let Ok(c) = Client::connect(&path) {
                return (child, c, path);
            }
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the proxy process never listened");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The proxy process's body (does nothing in a normal test run).
#[test]
fn proxy_process_entry() {
    let Some(path) = std::env::var_os(PROXY_ENV) else { return };
    let l = UnixListener::bind(&path).unwrap();
    let (s, _) = l.accept().unwrap();
    let _ = std::fs::remove_file(&path);
    serve(s, Arc::new(TestHandler::default())).unwrap();
}

fn echo(c: &Client, data: &[u8]) -> io::Result<Vec<u8>> {
    let mut req = Vec::with_capacity(data.len() + 1);
    req.push(b'E');
    req.extend_from_slice(data);
    c.call(&req)
}

#[test]
fn echoes_small_and_large_messages_across_processes() {
    let (mut child, c, _) = proxy_process("echo");
    assert_eq!(echo(&c, b"hello").unwrap(), b"hello");
    assert_eq!(echo(&c, b"").unwrap(), b"");
    assert_eq!(c.call(b"").unwrap(), b"?", "an empty request");
    assert_eq!(c.call(b"Lx").unwrap(), b"", "an empty answer");
    for n in [SLOT_BUF - 1, SLOT_BUF, SLOT_BUF + 1, 20 << 20] {
        let big = pattern(n, 1);
        assert!(echo(&c, &big).unwrap() == big, "echo of {n} bytes");
        let mut req = vec![b'D'];
        req.extend_from_slice(&(n as u32).to_le_bytes());
        assert!(c.call(&req).unwrap() == pattern(n, 3), "answer of {n} bytes");
    }
    c.close();
    assert!(child.wait().unwrap().success());
}

#[test]
fn a_call_blocked_in_the_proxy_blocks_no_other_thread() {
    let (mut child, c, _) = proxy_process("threads");
    let c = Arc::new(c);
    let (tx, rx) = mpsc::channel();
    let mut threads = Vec::new();
    let echoed = Arc::new(std::sync::Barrier::new(7));
    for t in 0..8 {
        let (c, tx, echoed) = (c.clone(), tx.clone(), echoed.clone());
        threads.push(std::thread::spawn(move || {
            if t == 0 {
                tx.send((t, c.call(b"B").unwrap())).unwrap();
                return;
            }
            for k in 0..200u32 {
                let msg = format!("{t}:{k}");
                assert_eq!(echo(&c, msg.as_bytes()).unwrap(), msg.as_bytes());
            }
            tx.send((t, Vec::new())).unwrap();
            if echoed.wait().is_leader() {
                c.call(b"R").unwrap();
            }
        }));
    }
    let mut done = [false; 8];
    for _ in 0..8 {
        let (t, answer) = rx.recv_timeout(Duration::from_secs(60)).expect("a thread hangs");
        if t == 0 {
            assert_eq!(answer, b"released");
            assert!(done[1..].iter().all(|d| *d), "released only by the last thread");
        }
        done[t] = true;
    }
    for t in threads {
        t.join().unwrap();
    }
    drop(c);
    assert!(child.wait().unwrap().success());
}

fn parse_log(mut log: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while !log.is_empty() {
        let n = arg_u32(log, 0) as usize;
        out.push(log[4..4 + n].to_vec());
        log = &log[4 + n..];
    }
    out
}

#[test]
fn posts_are_handled_in_order_and_before_a_later_call_of_another_thread() {
    let (mut child, c, _) = proxy_process("posts");
    let c = Arc::new(c);
    let big = pattern(POST_CAP + (1 << 20), 9);
    let mut big_post = vec![b'L'];
    big_post.extend_from_slice(&big);
    let (tx, rx) = mpsc::channel();
    let poster = {
        let (c, big_post) = (c.clone(), big_post.clone());
        std::thread::spawn(move || {
            for k in 0..2000 {
                c.post(format!("La{k}").as_bytes()).unwrap();
                if k == 1000 {
                    c.post(&big_post).unwrap();
                }
            }
            tx.send(()).unwrap();
        })
    };
    let other = {
        let c = c.clone();
        std::thread::spawn(move || {
            for k in 0..500 {
                c.post(format!("Lb{k}").as_bytes()).unwrap();
            }
        })
    };
    let reader = {
        let c = c.clone();
        std::thread::spawn(move || {
            rx.recv().unwrap();
            parse_log(&c.call(b"G").unwrap())
        })
    };
    poster.join().unwrap();
    let log = reader.join().unwrap();
    other.join().unwrap();
    let mine: Vec<&Vec<u8>> = log.iter().filter(|e| e.first() != Some(&b'b')).collect();
    assert_eq!(mine.len(), 2001, "every post of the first thread is handled before the call");
    for (i, e) in mine.iter().enumerate() {
        let want = match i {
            ..=1000 => format!("a{i}").into_bytes(),
            1001 => big.clone(),
            _ => format!("a{}", i - 1).into_bytes(),
        };
        assert!(**e == want, "post {i} out of order");
    }
    let theirs: Vec<&Vec<u8>> = log.iter().filter(|e| e.first() == Some(&b'b')).collect();
    for (i, e) in theirs.iter().enumerate() {
        assert_eq!(**e, format!("b{i}").into_bytes());
    }
    drop(c);
    assert!(child.wait().unwrap().success());
}

#[test]
fn notifications_arrive_in_order() {
    let (mut child, c, _) = proxy_process("notify");
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    let tx = Mutex::new(tx);
    c.on_notify(Box::new(move |m| tx.lock().unwrap().send(m.to_vec()).unwrap()));
    let count = 3000u32;
    let big = 3 * NOTIFY_CAP as u32;
    let mut req = vec![b'N'];
    req.extend_from_slice(&count.to_le_bytes());
    req.extend_from_slice(&big.to_le_bytes());
    c.call(&req).unwrap();
    for i in 0..count {
        assert_eq!(rx.recv_timeout(Duration::from_secs(20)).unwrap(), i.to_le_bytes());
    }
    assert!(rx.recv_timeout(Duration::from_secs(20)).unwrap() == pattern(big as usize, 7));
    assert_eq!(rx.recv_timeout(Duration::from_secs(20)).unwrap(), b"from a thread");
    c.close();
    assert!(child.wait().unwrap().success());
}

#[test]
fn a_call_fails_fast_when_the_proxy_is_killed() {
    let (mut child, c, _) = proxy_process("kill");
    let c = Arc::new(c);
    assert_eq!(echo(&c, b"up").unwrap(), b"up");
    let (tx, rx) = mpsc::channel();
    let c2 = c.clone();
    std::thread::spawn(move || tx.send(c2.call(b"B")).unwrap());
    std::thread::sleep(Duration::from_millis(200));
    child.kill().unwrap();
    let killed = Instant::now();
    let r = rx.recv_timeout(Duration::from_secs(1)).expect("the call still waits a second after the proxy died");
    assert_eq!(r.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
    assert!(killed.elapsed() < Duration::from_secs(1));
    assert_eq!(echo(&c, b"again").unwrap_err().kind(), io::ErrorKind::ConnectionReset);
    assert!(c.post(b"Lx").is_err());
    child.wait().unwrap();
}

fn socket_inode(s: &UnixStream) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let fd = s.as_raw_fd();
    std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap().ino()
}

#[test]
fn close_fails_calls_in_flight_and_later_and_leaves_no_fd_or_mapping() {
    let (mut child, c, _) = proxy_process("close");
    let c = Arc::new(c);
    c.on_notify(Box::new(|_| {}));
    assert_eq!(echo(&c, b"up").unwrap(), b"up");
    let (seg_ino, sock_ino) = {
        let conn = c.conn().unwrap();
        (conn.seg.ino, socket_inode(&conn.sock))
    };
    let (tx, rx) = mpsc::channel();
    let c2 = c.clone();
    std::thread::spawn(move || tx.send(c2.call(b"B")).unwrap());
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    c.close();
    assert!(t.elapsed() < Duration::from_secs(1), "close took {:?}", t.elapsed());
    let r = rx.recv_timeout(Duration::from_secs(1)).expect("a call in flight still waits after close");
    assert_eq!(r.unwrap_err().kind(), io::ErrorKind::NotConnected);
    assert_eq!(echo(&c, b"after").unwrap_err().kind(), io::ErrorKind::NotConnected);
    assert_eq!(c.post(b"Lx").unwrap_err().kind(), io::ErrorKind::NotConnected);
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert!(!maps.lines().any(|l| l.contains("memfd:hiber-channel") && l.split_whitespace().nth(4) == Some(&seg_ino.to_string())), "{maps}");
    for e in std::fs::read_dir("/proc/self/fd").unwrap() {
        let link = std::fs::read_link(e.unwrap().path()).unwrap_or_default();
        assert_ne!(link.to_string_lossy(), format!("socket:[{sock_ino}]"));
    }
    assert!(child.wait().unwrap().success(), "the proxy returns when the client closes");
}

#[test]
fn slots_of_exited_threads_are_reused_and_clients_do_not_share_them() {
    let (path, proxy) = proxy_thread("reuse");
    let c = Arc::new(Client::connect(&path).unwrap());
    for k in 0..(NSLOTS * 2) {
        let c = c.clone();
        std::thread::spawn(move || assert_eq!(echo(&c, format!("{k}").as_bytes()).unwrap(), format!("{k}").as_bytes())).join().unwrap();
    }
    c.close();
    proxy.join().unwrap().unwrap();
    let _ = std::fs::remove_file(&path);
    // A second client on the same thread gets a slot of its own.
    let (path, proxy) = proxy_thread("again");
    let c = Client::connect(&path).unwrap();
    assert_eq!(echo(&c, b"second").unwrap(), b"second");
    drop(c);
    proxy.join().unwrap().unwrap();
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_peer_of_another_uid_is_refused() {
    assert!(peer_allowed(1000, 1000));
    assert!(peer_allowed(0, 1000));
    assert!(!peer_allowed(1001, 1000));
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return; // Only root can connect as another user.
    }
    let path = sock_path("uid");
    let l = UnixListener::bind(&path).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    // SAFETY: an all-zero sockaddr_un is valid; the path fits (it is a short temp path).
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(path.as_os_str().as_encoded_bytes()) {
        *d = *s as libc::c_char;
    }
    // SAFETY: the child runs only async-signal-safe system calls, then _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: as above; `addr` was built before the fork.
        unsafe {
            if libc::setuid(65534) != 0 {
                libc::_exit(2);
            }
            let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if libc::connect(s, (&addr as *const libc::sockaddr_un).cast(), std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t) != 0 {
                libc::_exit(3);
            }
            let mut b = [0u8; 64];
            while libc::read(s, b.as_mut_ptr().cast(), b.len()) > 0 {}
            libc::_exit(0);
        }
    }
    assert!(pid > 0);
    let (s, _) = l.accept().unwrap();
    let err = serve(s, Arc::new(TestHandler::default())).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
    let mut status = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the peer got no hang-up: {status}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_handler_panic_cuts_the_client_off() {
    struct Panicky;
    impl Handler for Panicky {
        fn handle(&self, _: &[u8], _: &mut Vec<u8>, _: &Notifier) {
            panic!("handler bug");
        }
    }
    let path = sock_path("panic");
    let l = UnixListener::bind(&path).unwrap();
    let proxy = std::thread::spawn(move || serve(l.accept()?.0, Arc::new(Panicky)));
    let c = Client::connect(&path).unwrap();
    assert_eq!(c.call(b"x").unwrap_err().kind(), io::ErrorKind::ConnectionReset);
    assert!(proxy.join().unwrap().is_err());
    let _ = std::fs::remove_file(&path);
}

#[test]
fn notifications_sent_before_on_notify_wait_for_it() {
    let (path, proxy) = proxy_thread("early");
    let c = Client::connect(&path).unwrap();
    let mut req = vec![b'N'];
    req.extend_from_slice(&3u32.to_le_bytes());
    req.extend_from_slice(&0u32.to_le_bytes());
    c.call(&req).unwrap();
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    let tx = Mutex::new(tx);
    c.on_notify(Box::new(move |m| tx.lock().unwrap().send(m.to_vec()).unwrap()));
    let got: Vec<Vec<u8>> = (0..5).map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
    let want: Vec<Vec<u8>> = vec![0u32.to_le_bytes().to_vec(), 1u32.to_le_bytes().to_vec(), 2u32.to_le_bytes().to_vec(), Vec::new(), b"from a thread".to_vec()];
    assert_eq!(got, want);
    c.close();
    proxy.join().unwrap().unwrap();
    let _ = std::fs::remove_file(&path);
}

/// A call made after many slow posts waits for them asleep, and is woken once they are
/// done, not once per post: waking it after every post cost a system call and a context
/// switch each (about 2 µs a post through NVIDIA's OpenCL).
#[test]
fn a_call_waiting_for_slow_posts_is_not_woken_for_each() {
    let (child, c, _path) = proxy_process("wake");
    let mut child = child;
    let posts = 400u32;
    let mut req = vec![b'S'];
    req.extend_from_slice(&300u32.to_le_bytes());
    for _ in 0..posts {
        c.post(&req).unwrap();
    }
    let rings = |c: &Client| c.conn().unwrap().seg.header().posts_done_bell.0.load(Ordering::SeqCst) >> 1;
    let before = rings(&c);
    assert_eq!(echo(&c, b"after").unwrap(), b"after");
    let woken = rings(&c).wrapping_sub(before);
    assert!(woken < posts / 10, "the posts' bell rang {woken} times for {posts} posts");
    drop(c);
    child.kill().unwrap();
    child.wait().unwrap();
}
