//! The keeper (`hiber __keep`, hiber_core::keeper) as a checkpoint uses it, with the real
//! binary and real processes: a descriptor given to it outlives the connection and every
//! other copy of it (as the device memory of a `--leave-running` checkpoint outlives a
//! killed hiber), comes back with the same contents, and the keeper goes once every process
//! is done or gone. Device memory itself needs a GPU: the GPU suite's
//! `agent_hiber_killed_before_the_hand_back_recovers` is that half.

use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use hiber_core::keeper::{Conn, Keeper, AT_REST};

const HIBER: &str = env!("CARGO_BIN_EXE_hiber");

/// A process for the keeper to keep things for, and its start time.
fn target() -> (Child, (i32, u64)) {
    let child = Command::new("sleep").arg("60").spawn().unwrap();
    let pid = child.id() as i32;
    let start = hiber_core::proctree::stat(pid).unwrap().start_time;
    (child, (pid, start))
}

/// A memory file holding `text`, as a stand-in for an allocation's descriptor.
fn memfd(text: &str) -> std::fs::File {
    // SAFETY: the name is a valid C string; the descriptor is owned by the File below.
    let fd = unsafe { libc::memfd_create(c"hiber-keeper-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let mut f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    f.write_all(text.as_bytes()).unwrap();
    f
}

fn contents(fd: OwnedFd) -> String {
    let mut f = std::fs::File::from(fd);
    f.rewind().unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    s
}

#[test]
fn what_it_holds_outlives_the_holder_and_comes_back_whole() {
    let (mut a, ta) = target();
    let (mut b, tb) = target();
    let keeper = Keeper::start(HIBER.as_ref(), &[ta, tb]).unwrap();
    // The checkpoint's side: hold, then every other copy goes (the connection, the file),
    // as when hiber is killed between the release and the hand-back.
    {
        let one = memfd("allocation 7 of a");
        let two = memfd("allocation 9 of a");
        let c = Conn::open(ta.0, ta.1, AT_REST).unwrap();
        c.hold(7, one.as_fd()).unwrap();
        c.hold(9, two.as_fd()).unwrap();
        Conn::open(tb.0, tb.1, AT_REST).unwrap().hold(1, memfd("allocation 1 of b").as_fd()).unwrap();
    }
    // `hiber recover`'s side, on a new connection.
    let c = Conn::open(ta.0, ta.1, AT_REST).unwrap();
    assert_eq!(contents(c.take(9).unwrap().expect("the keeper has allocation 9")), "allocation 9 of a");
    assert_eq!(contents(c.take(7).unwrap().expect("the keeper has allocation 7")), "allocation 7 of a");
    assert!(c.take(8).unwrap().is_none(), "nothing it was not given");
    // Not another process's.
    assert!(Conn::open(tb.0, tb.1, AT_REST).unwrap().take(7).unwrap().is_none());
    c.done().unwrap();
    assert!(Conn::open(ta.0, ta.1, AT_REST).unwrap().take(9).unwrap().is_none(), "done lets go");
    // The other process is done too: nothing left, the keeper goes.
    let c = Conn::open(tb.0, tb.1, AT_REST).unwrap();
    assert_eq!(contents(c.take(1).unwrap().unwrap()), "allocation 1 of b");
    c.done().unwrap();
    let pid = keeper.pid();
    drop(keeper);
    assert!(!alive(pid), "the keeper exits once every process is done");
    for t in [&mut a, &mut b] {
        let _ = t.kill();
        let _ = t.wait();
    }
}

#[test]
fn it_goes_once_its_processes_are_gone() {
    let (mut a, ta) = target();
    let keeper = Keeper::start(HIBER.as_ref(), &[ta]).unwrap();
    Conn::open(ta.0, ta.1, AT_REST).unwrap().hold(3, memfd("kept").as_fd()).unwrap();
    let pid = keeper.pid();
    std::thread::sleep(Duration::from_millis(2500));
    assert!(alive(pid), "it keeps what it holds while the process lives");
    a.kill().unwrap();
    a.wait().unwrap();
    let mut gone = false;
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until && !gone {
        gone = !alive(pid);
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(gone, "the keeper exits once the process it kept memory for is gone");
    drop(keeper);
}

#[test]
fn a_bad_target_is_refused_at_start() {
    let out = Command::new(HIBER).args(["__keep", "12:x"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("bad target"));
}

/// Alive and not a zombie (a keeper this test started is reaped by Keeper's drop or not at
/// all while the test runs).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
}

/// A keeper whose hiber is gone before it held anything (hiber killed before the agents
/// released their memory) has nothing to keep: it goes, rather than live as long as the job
/// and keep its socket's name from the next checkpoint's keeper.
#[test]
fn an_orphan_that_holds_nothing_goes() {
    let (mut a, ta) = target();
    // Started by a shell that exits soon after (once the keeper is surely up), as a killed
    // hiber's keeper is left.
    let out = Command::new("sh").arg("-c").arg(format!("{HIBER} __keep {}:{} >/dev/null 2>&1 & echo $!; sleep 1", ta.0, ta.1)).output().unwrap();
    let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until && alive(pid) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!alive(pid), "an orphaned keeper that holds nothing exits");
    let _ = a.kill();
    let _ = a.wait();
}

/// Another user's socket under a keeper's name (the name can be worked out from /proc) is
/// not taken for the keeper: hiber would otherwise hand the job whatever it passed.
#[test]
fn another_users_socket_is_not_a_keeper() {
    let (mut a, ta) = target();
    let name = hiber_core::keeper::name(ta.0, ta.1);
    let script = format!(
        "import socket, time\ns = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\ns.bind(b'\\0{name}')\ns.listen(4)\nprint('up', flush=True)\ntime.sleep(30)"
    );
    let mut impostor = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("setpriv (util-linux) and /usr/bin/python3 (scripts/setup.sh installs python3-protobuf)");
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(impostor.stdout.take().unwrap()), &mut line).unwrap();
    assert_eq!(line.trim(), "up");
    let err = Conn::open(ta.0, ta.1, AT_REST).err().expect("refused");
    assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
    assert!(err.to_string().contains("uid 65534"), "{err}");
    let _ = impostor.kill();
    let _ = impostor.wait();
    let _ = a.kill();
    let _ = a.wait();
}
