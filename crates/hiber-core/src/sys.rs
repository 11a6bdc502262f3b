//! Thin wrappers over the few raw system calls hiber needs that std does not offer: safe
//! where they can be, `unsafe fn` with a `# Safety` section where the caller must promise
//! something (a single thread, descriptors nobody owns).
//!
//! Nearly every `unsafe` block of the core crate outside the CUDA FFI lives here; the
//! others call the `unsafe fn`s below, or set up a child's descriptors between fork and
//! exec (`pre_exec`).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// A connected `AF_UNIX`/`SOCK_SEQPACKET` pair, close-on-exec on both ends.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid, writable array of two ints, as socketpair(2) requires.
    cvt(unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) })?;
    // SAFETY: socketpair succeeded, so both descriptors are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A close-on-exec pipe: (read end, write end).
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid, writable array of two ints, as pipe2(2) requires.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Waits up to `timeout` for the other end of the pipe `fd` reads from to close (every
/// writer gone); whether it did.
pub fn wait_hangup(fd: BorrowedFd<'_>, timeout: std::time::Duration) -> io::Result<bool> {
    let deadline = std::time::Instant::now() + timeout;
    let mut buf = [0u8; 64];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: `pfd` is one valid pollfd, as the count of 1 says.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Ok(false);
        }
        // Readable: data (read and dropped) or end of file.
        // SAFETY: `buf` is valid for writes of its length; `fd` is open (borrowed).
        match unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } {
            0 => return Ok(true),
            n if n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted => return Err(io::Error::last_os_error()),
            _ => {}
        }
    }
}

/// Clears close-on-exec so that `fd` survives into an exec'd child.
pub fn clear_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFD/F_SETFD only read and set flags of a descriptor number; an invalid
    // number is reported as EBADF.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFD) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) })?;
    Ok(())
}

/// Sets close-on-exec on `fd`.
pub fn set_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: as in `clear_cloexec`.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFD) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) })?;
    Ok(())
}

/// Makes standard descriptor `to` (0, 1 or 2) a copy of `from`.
///
/// Only standard descriptors may be replaced: std never owns them, and they stay open, as
/// std assumes. Replacing any other number could close a descriptor that an object owns.
pub fn replace_stdio(from: BorrowedFd<'_>, to: RawFd) -> io::Result<()> {
    if !(0..=2).contains(&to) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "only 0, 1 and 2 may be replaced"));
    }
    // SAFETY: `from` is open for the duration of the call; `to` is a standard descriptor,
    // which no object of this process owns (see above).
    cvt(unsafe { libc::dup2(from.as_raw_fd(), to) })?;
    Ok(())
}

/// Restores SIGPIPE's default action (terminate) for the calling process and what it execs.
pub fn default_sigpipe() -> io::Result<()> {
    // SAFETY: setting a signal's disposition to SIG_DFL installs no handler and touches no
    // memory of the caller.
    if unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) } == libc::SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

pub fn setsid() -> io::Result<()> {
    // SAFETY: setsid has no memory-safety preconditions.
    cvt(unsafe { libc::setsid() })?;
    Ok(())
}

/// Moves the caller into a new mount namespace whose mounts no longer propagate to or
/// from the host's, and its *children* into a new PID namespace; with `ipc`, the caller
/// into a new IPC namespace too (SysV shared memory, semaphores and message queues).
pub fn unshare_job_namespaces(ipc: bool) -> io::Result<()> {
    let ipc = if ipc { libc::CLONE_NEWIPC } else { 0 };
    // SAFETY: unshare has no memory-safety preconditions.
    cvt(unsafe { libc::unshare(libc::CLONE_NEWPID | libc::CLONE_NEWNS | ipc) })?;
    // SAFETY: every pointer is either NULL or a NUL-terminated literal.
    cvt(unsafe { libc::mount(std::ptr::null(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()) })?;
    Ok(())
}

/// Gives the caller's (private) mount namespace a `/dev/shm` of its own: a new tmpfs as
/// large as the host's, in place of the host's. What a job keeps there (named POSIX
/// semaphores and shared memory) is then the job's, and CRIU carries it in the image.
/// Without a `/dev/shm` on the host there is nothing to replace.
pub fn private_dev_shm() -> io::Result<()> {
    // SAFETY: statvfs is plain data; all-zero is a valid value, and the call fills it.
    let mut host: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated literal path and a valid out-pointer.
    if unsafe { libc::statvfs(c"/dev/shm".as_ptr(), &mut host) } != 0 {
        return Ok(());
    }
    let size = (host.f_blocks as u64).saturating_mul(host.f_frsize as u64);
    // The host's mounts there (some hosts stack several) leave this namespace only
    // (propagation is private here), so that the job's is the only one: CRIU refuses open
    // files on a mount that another hides.
    for _ in 0..8 {
        // SAFETY: a NUL-terminated literal path.
        if unsafe { libc::umount2(c"/dev/shm".as_ptr(), libc::MNT_DETACH) } != 0 {
            break;
        }
    }
    let data = std::ffi::CString::new(format!("mode=1777,size={size}")).map_err(io::Error::other)?;
    // SAFETY: NUL-terminated strings, and `data` is the option string tmpfs reads.
    cvt(unsafe { libc::mount(c"tmpfs".as_ptr(), c"/dev/shm".as_ptr(), c"tmpfs".as_ptr(), libc::MS_NOSUID | libc::MS_NODEV, data.as_ptr().cast()) })?;
    Ok(())
}

/// Gives the caller's (private) mount namespace a `/dev/pts` of its own: a new devpts
/// instance in place of the host's. The pseudo-terminals a job opens (mpirun gives one to
/// each rank) are then numbered in it from 0, and a restore, which must give each its old
/// number, finds those numbers free, whatever the host opened since and whatever another
/// copy of the job holds. Opening `/dev/ptmx` reaches the instance at `/dev/pts` of the
/// opener's mount namespace (Linux 4.7 and newer). Without a devpts at `/dev/pts` on the
/// host there is nothing to replace.
pub fn private_dev_pts() -> io::Result<()> {
    // SAFETY: statfs is plain data; all-zero is a valid value, and the call fills it.
    let mut host: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated literal path and a valid out-pointer.
    if unsafe { libc::statfs(c"/dev/pts".as_ptr(), &mut host) } != 0 || host.f_type != libc::DEVPTS_SUPER_MAGIC {
        return Ok(());
    }
    // As for /dev/shm: the host's mounts there leave this namespace only.
    for _ in 0..8 {
        // SAFETY: a NUL-terminated literal path.
        if unsafe { libc::umount2(c"/dev/pts".as_ptr(), libc::MNT_DETACH) } != 0 {
            break;
        }
    }
    // A terminal's group is tty (5) and its mode 0620, as on the host; anyone may open ptmx.
    let data = c"newinstance,ptmxmode=0666,mode=0620,gid=5";
    // SAFETY: NUL-terminated strings; `data` is the option string devpts reads.
    cvt(unsafe { libc::mount(c"devpts".as_ptr(), c"/dev/pts".as_ptr(), c"devpts".as_ptr(), libc::MS_NOSUID | libc::MS_NOEXEC, data.as_ptr().cast()) })?;
    Ok(())
}

/// Mounts a new tmpfs at `target` with `options` (tmpfs's option string: size, mode,
/// huge, ...), with no devices, set-id files or programs on it.
pub fn mount_tmpfs(target: &Path, options: &str) -> io::Result<()> {
    let t = CString::new(target.as_os_str().as_encoded_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    let data = CString::new(options).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "options contain NUL"))?;
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // SAFETY: NUL-terminated strings that outlive the call; `data` is the option string
    // tmpfs reads.
    cvt(unsafe { libc::mount(c"tmpfs".as_ptr(), t.as_ptr(), c"tmpfs".as_ptr(), flags, data.as_ptr().cast()) })?;
    Ok(())
}

/// Detaches the mount at `target` (lazily: files still open keep it until closed).
pub fn umount_detach(target: &Path) -> io::Result<()> {
    let t = CString::new(target.as_os_str().as_encoded_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    // SAFETY: a NUL-terminated path that outlives the call.
    cvt(unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) })?;
    Ok(())
}

/// Waits for an advisory lock on `f` (shared or exclusive), held until `f` is closed.
pub fn flock(f: &std::fs::File, exclusive: bool) -> io::Result<()> {
    let op = if exclusive { libc::LOCK_EX } else { libc::LOCK_SH };
    // SAFETY: flock on a descriptor the borrowed File keeps open.
    cvt(unsafe { libc::flock(f.as_raw_fd(), op) })?;
    Ok(())
}

/// Takes an exclusive advisory lock on `f` if nobody holds one: `Ok(false)` when another
/// open file description holds it (no waiting).
pub fn try_flock_exclusive(f: &std::fs::File) -> io::Result<bool> {
    // SAFETY: flock on a descriptor the borrowed File keeps open.
    match cvt(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The inode number of process `pid`'s PID namespace.
pub fn pid_namespace_of(pid: i32) -> io::Result<u64> {
    let link = std::fs::read_link(format!("/proc/{pid}/ns/pid"))?;
    let s = link.to_string_lossy();
    s.strip_prefix("pid:[")
        .and_then(|r| r.strip_suffix(']'))
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| io::Error::other(format!("unexpected namespace link {s}")))
}

/// Gives the caller's next children a new PID namespace in place of the one it made for
/// them before (by `unshare`), whose init has come and gone.
pub fn renew_pid_namespace_for_children() -> io::Result<()> {
    let own = std::fs::File::open("/proc/self/ns/pid")?;
    // SAFETY: setns on an open namespace file: back to the caller's own PID namespace for
    // its children (the kernel refuses a second unshare while another one is pending).
    cvt(unsafe { libc::setns(own.as_raw_fd(), libc::CLONE_NEWPID) })?;
    // SAFETY: unshare has no memory-safety preconditions.
    cvt(unsafe { libc::unshare(libc::CLONE_NEWPID) })?;
    Ok(())
}

/// Moves the caller into a new network namespace and brings its loopback up.
pub fn unshare_network_namespace() -> io::Result<()> {
    // SAFETY: unshare has no memory-safety preconditions.
    cvt(unsafe { libc::unshare(libc::CLONE_NEWNET) })?;
    // SAFETY: socket takes plain integers.
    let sock = cvt(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `sock` was just opened and is owned here.
    let sock = unsafe { OwnedFd::from_raw_fd(sock) };
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as libc::c_char;
    }
    // SAFETY: `req` names the interface; SIOCGIFFLAGS fills its flags union member.
    cvt(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) })?;
    // SAFETY: reading and writing the flags member that SIOCGIFFLAGS filled.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: `req` holds the name and the new flags.
    cvt(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) })?;
    Ok(())
}

/// Runs `f` on a thread of its own inside `pid`'s network namespace (where abstract unix
/// socket names live), or on the caller's thread when that is hiber's own.
pub fn in_network_namespace_of<T: Send>(pid: i32, f: impl FnOnce() -> T + Send) -> io::Result<T> {
    let theirs = std::fs::read_link(format!("/proc/{pid}/ns/net"))?;
    if std::fs::read_link("/proc/self/ns/net").ok().as_ref() == Some(&theirs) {
        return Ok(f());
    }
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::scope(|s| {
        s.spawn(move || {
            // SAFETY: setns on a thread of our own, which ends with `f`; `ns` is an open
            // namespace file.
            cvt(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) })?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("thread panicked")))
    })
}

/// setenv(3), for a child about to exec.
///
/// # Safety
///
/// No other thread may read or change the environment meanwhile (getenv(3) hands out
/// pointers that setenv may free): in practice, the process must be single-threaded.
pub unsafe fn setenv(key: &std::ffi::CStr, value: &std::ffi::CStr) -> io::Result<()> {
    // SAFETY: both are NUL-terminated; the caller guarantees that nothing reads the
    // environment concurrently.
    cvt(unsafe { libc::setenv(key.as_ptr(), value.as_ptr(), 1) })?;
    Ok(())
}

/// Raises the soft limit on open files to the hard limit.
pub fn raise_open_files_limit() {
    // SAFETY: rlimit is plain data, filled by getrlimit before setrlimit reads it.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// Mounts a /proc for the caller's PID namespace over the inherited one.
pub fn mount_private_proc() -> io::Result<()> {
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // SAFETY: every pointer is either NULL or a NUL-terminated literal.
    cvt(unsafe { libc::mount(c"proc".as_ptr(), c"/proc".as_ptr(), c"proc".as_ptr(), flags, std::ptr::null()) })?;
    Ok(())
}

/// Opens a file for a job's stdio: read-only, or write-only appending (created 0600).
/// The descriptor is close-on-exec; [`replace_stdio`] copies it onto 0, 1 or 2.
pub fn open_for_stdio(path: &std::ffi::CStr, write: bool) -> io::Result<OwnedFd> {
    let flags = libc::O_CLOEXEC | if write { libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT } else { libc::O_RDONLY };
    // SAFETY: `path` is NUL-terminated; the mode argument is read only with O_CREAT.
    let fd = cvt(unsafe { libc::open(path.as_ptr(), flags, 0o600 as libc::c_uint) })?;
    // SAFETY: open succeeded, so the descriptor is open and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub enum Fork {
    Child,
    Parent(i32),
}

/// Forks the calling process.
///
/// # Safety
///
/// The calling process must be single-threaded. The child has only the calling thread;
/// a lock that another thread held at the fork (the allocator's, stdout's, the
/// environment's) would stay locked in it forever, and the child runs ordinary Rust
/// code. (A child of a multi-threaded process may only make async-signal-safe calls
/// until it execs: use `std::process::Command`, with `pre_exec` if need be.)
pub unsafe fn fork() -> io::Result<Fork> {
    // SAFETY: the caller guarantees that no other thread exists, so the child inherits no
    // lock in a locked state.
    let pid = cvt(unsafe { libc::fork() })?;
    Ok(if pid == 0 { Fork::Child } else { Fork::Parent(pid) })
}

/// How many threads the calling process has.
pub fn thread_count() -> io::Result<usize> {
    Ok(std::fs::read_dir("/proc/self/task")?.count())
}

/// Ends the process immediately, without running destructors or atexit handlers: what a
/// forked child must do so that it does not flush or drop state that belongs to its parent.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns and has no preconditions.
    unsafe { libc::_exit(code) }
}

/// Installs a seccomp filter on the calling thread (and so on everything it execs and
/// forks). Needs CAP_SYS_ADMIN (hiber runs as root), so that no_new_privs is left alone
/// and setuid programs of the job work as before.
pub fn install_seccomp_filter(program: &[libc::sock_filter]) -> io::Result<()> {
    let len = u16::try_from(program.len()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "seccomp program too long"))?;
    let prog = libc::sock_fprog { len, filter: program.as_ptr() as *mut libc::sock_filter };
    // SAFETY: `prog` points at `len` filter instructions, which outlive the call (the
    // kernel copies and checks the program).
    cvt(unsafe { libc::syscall(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, 0, &prog as *const libc::sock_fprog) } as i32)?;
    Ok(())
}

/// Replaces the process image; returns only on failure.
pub fn execvp(argv: &[CString]) -> io::Error {
    let mut ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    // SAFETY: `ptrs` is a NULL-terminated array of pointers to NUL-terminated strings that
    // outlive the call (owned by `argv`).
    unsafe { libc::execvp(ptrs[0], ptrs.as_ptr()) };
    io::Error::last_os_error()
}

/// Exit status of a waited-for child, as the shell would report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitStatus {
    Code(i32),
    Signal(i32),
}

pub fn waitpid(pid: i32) -> io::Result<ExitStatus> {
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: `status` is a valid out-pointer for waitpid.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        break;
    }
    Ok(if libc::WIFSIGNALED(status) { ExitStatus::Signal(libc::WTERMSIG(status)) } else { ExitStatus::Code(libc::WEXITSTATUS(status)) })
}

/// Waits until child `pid` has exited and returns its status, but leaves it a zombie
/// (`WNOWAIT`): until the caller reaps it with [`waitpid`], its PID stays taken, so others
/// can tell "still exiting" from "gone".
pub fn wait_exited_keep_zombie(pid: i32) -> io::Result<ExitStatus> {
    loop {
        // SAFETY: siginfo_t is plain old data; all-zero is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a valid out-pointer for waitid.
        let r = unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOWAIT) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: waitid filled `info` for a CLD_* event, for which si_status is valid.
        let status = unsafe { info.si_status() };
        return Ok(if info.si_code == libc::CLD_EXITED { ExitStatus::Code(status) } else { ExitStatus::Signal(status) });
    }
}

/// Sends `sig` to `pid`. `Ok(false)` when the process no longer exists.
pub fn kill(pid: i32, sig: i32) -> io::Result<bool> {
    // SAFETY: kill has no memory-safety preconditions.
    match cvt(unsafe { libc::kill(pid, sig) }) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(false),
        Err(e) => Err(e),
    }
}

pub fn geteuid() -> u32 {
    // SAFETY: geteuid cannot fail and has no preconditions.
    unsafe { libc::geteuid() }
}

pub fn getpid() -> i32 {
    std::process::id() as i32
}

/// The size of a memory page.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions; _SC_PAGESIZE is always answered.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).unwrap_or(4096)
}

/// Bytes available to an unprivileged writer on the filesystem holding `path`.
/// A new anonymous memory file of `size` bytes (close-on-exec).
pub fn memfd(name: &std::ffi::CStr, size: u64) -> io::Result<OwnedFd> {
    // SAFETY: `name` is NUL-terminated; the new descriptor is owned below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and nobody else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sizing the file owned above.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// A shared mapping of a whole file, unmapped on drop.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; access goes through & and &mut.
unsafe impl Send for Mapping {}
// SAFETY: as above; shared access is read-only.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `fd`, read-only or read-write.
    pub fn new(fd: BorrowedFd<'_>, len: usize, writable: bool) -> io::Result<Mapping> {
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: a shared mapping of `len` bytes of an open file at an address the kernel
        // picks; unmapped once, in Drop.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len.max(1), prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: ptr as *mut u8, len })
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` mapped bytes, alive as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable (a mapping made read-only faults on write).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` mapped bytes, borrowed mutably through self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len.max(1)) };
    }
}

/// Private anonymous memory on 2 MiB boundaries, asked to be backed by transparent huge
/// pages, and faulted in up front by several threads. Huge pages make faulting in and
/// pinning it for the GPU about ten times faster than 4 KiB pages (bench/staging/).
pub struct Anon {
    base: *mut u8,
    map_len: usize,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; writers go through raw pointers
// handed out by `ptr_at`, whose callers keep their ranges disjoint.
unsafe impl Send for Anon {}
// SAFETY: as above.
unsafe impl Sync for Anon {}

const HUGE: usize = 2 << 20;

impl Anon {
    /// Maps `len` bytes and faults them in with `threads` threads.
    pub fn populated(len: usize, threads: usize) -> io::Result<Anon> {
        let map_len = len.checked_add(HUGE).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a new private anonymous mapping at an address the kernel picks; unmapped
        // once, in Drop.
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1, 0)
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = base as *mut u8;
        let ptr = base.wrapping_add((base as usize).next_multiple_of(HUGE) - base as usize);
        let me = Anon { base, map_len, ptr, len };
        // Not inherited by children: hiber forks (CRIU, shims) while the memory is pinned,
        // and the kernel copies pinned private pages into the child at fork, which for tens
        // of GiB took most of a minute, with the application stopped.
        // SAFETY: the whole mapping, which this value owns.
        cvt(unsafe { libc::madvise(base as *mut libc::c_void, map_len, libc::MADV_DONTFORK) })?;
        // SAFETY: [ptr, ptr+len) lies inside the mapping (the extra HUGE bytes cover the
        // alignment). Only advice: without huge pages the memory still works.
        unsafe { libc::madvise(ptr as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        if len == 0 {
            return Ok(me);
        }
        let slice = len.div_ceil(threads.max(1)).next_multiple_of(HUGE);
        let addr = ptr as usize;
        let failed = std::thread::scope(|s| {
            let workers: Vec<_> = (0..len.div_ceil(slice))
                .map(|i| {
                    s.spawn(move || {
                        let (off, n) = (i * slice, slice.min(len - i * slice));
                        // SAFETY: a range inside the mapping; populating only faults pages in.
                        if unsafe { libc::madvise((addr + off) as *mut libc::c_void, n, libc::MADV_POPULATE_WRITE) } == 0 {
                            return Ok(());
                        }
                        let e = io::Error::last_os_error();
                        if e.raw_os_error() != Some(libc::EINVAL) {
                            // Out of memory, most likely: said, not pressed on page by page.
                            return Err(e);
                        }
                        // Kernels before 5.14: touch each page instead.
                        for p in (off..off + n).step_by(4096) {
                            // SAFETY: inside the mapping, and no one else reads it yet.
                            unsafe { std::ptr::write_volatile((addr + p) as *mut u8, 0) };
                        }
                        Ok(())
                    })
                })
                .collect();
            let mut first = None;
            for w in workers {
                let r = w.join().unwrap_or_else(|_| Err(io::Error::other("a thread faulting in memory panicked")));
                if let Err(e) = r {
                    first.get_or_insert(e);
                }
            }
            first
        });
        match failed {
            Some(e) => Err(e),
            None => Ok(me),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of byte `off`; `off + n <= len` for whatever range the caller touches.
    pub fn ptr_at(&self, off: usize) -> *mut u8 {
        assert!(off <= self.len);
        self.ptr.wrapping_add(off)
    }

    /// `n` bytes from `off`.
    ///
    /// # Safety
    ///
    /// Nothing may write that range while the slice lives.
    pub unsafe fn slice(&self, off: usize, n: usize) -> &[u8] {
        assert!(off.checked_add(n).is_some_and(|end| end <= self.len));
        // SAFETY: inside the mapping (checked above); no writer meanwhile (the contract).
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), n) }
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `populated`, unmapped once.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.map_len) };
    }
}

/// What this process's memory cgroup (v2) and each of its ancestors (a slice, a pod) still
/// allow, the least of them: `memory.max` less `memory.current`; `None` without a limit.
pub fn cgroup_memory_left() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let root = Path::new("/sys/fs/cgroup");
    let mut dir = root.join(path.trim_start_matches('/'));
    let mut least: Option<u64> = None;
    loop {
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok()?.trim().parse::<u64>().ok();
        // "max" does not parse: no limit at this level.
        if let Some(max) = read("memory.max") {
            let left = max.saturating_sub(read("memory.current").unwrap_or(0));
            least = Some(least.map_or(left, |l| l.min(left)));
        }
        if dir == root || !dir.pop() || !dir.starts_with(root) {
            return least;
        }
    }
}

/// `MemAvailable` of /proc/meminfo and `MemTotal`, in bytes.
pub fn host_memory() -> io::Result<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
            .map(|kib| kib << 10)
            .ok_or_else(|| io::Error::other(format!("/proc/meminfo has no {name}")))
    };
    Ok((field("MemAvailable:")?, field("MemTotal:")?))
}

pub fn available_bytes(path: &Path) -> io::Result<u64> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    // SAFETY: statvfs is plain old data; all-zero is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` is a valid out-pointer.
    cvt(unsafe { libc::statvfs(c.as_ptr(), &mut st) })?;
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Bytes in use on the filesystem holding `path`.
pub fn used_bytes(path: &Path) -> io::Result<u64> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    // SAFETY: statvfs is plain old data; all-zero is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` is a valid out-pointer.
    cvt(unsafe { libc::statvfs(c.as_ptr(), &mut st) })?;
    Ok((st.f_blocks as u64).saturating_sub(st.f_bfree as u64) * st.f_frsize as u64)
}

/// The kernel's `uname` release and node name.
pub fn uname() -> (String, String) {
    // SAFETY: utsname is plain old data; all-zero is a valid value.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid out-pointer; on success its fields are NUL-terminated.
    if unsafe { libc::uname(&mut u) } != 0 {
        return ("unknown".into(), "unknown".into());
    }
    let field = |f: &[libc::c_char]| {
        let bytes: Vec<u8> = f.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    (field(&u.release), field(&u.nodename))
}

pub fn chdir(dir: &std::ffi::CStr) -> io::Result<()> {
    // SAFETY: `dir` is a valid NUL-terminated string.
    cvt(unsafe { libc::chdir(dir.as_ptr()) })?;
    Ok(())
}

/// Closes every descriptor from `first` up except those in `keep`, so that a shim or a
/// job holds only what hiber gave it.
///
/// # Safety
///
/// No object that the process uses afterwards may own a descriptor this closes (a
/// `File`, say): it would read, write or close whatever takes the number next. Fit for a
/// process that has just started, or a child about to exec.
pub unsafe fn close_from_except(first: RawFd, keep: &[RawFd]) {
    let close_range = |lo: RawFd, hi: libc::c_uint| {
        if lo < 0 || (lo as libc::c_uint) > hi {
            return;
        }
        // SAFETY: close_range only closes descriptors; the caller guarantees that nothing
        // it goes on using owns any of them.
        let r = unsafe { libc::syscall(libc::SYS_close_range, lo as libc::c_uint, hi, 0 as libc::c_uint) };
        if r != 0 {
            for fd in lo..(hi.min(4095) as RawFd + 1) {
                // SAFETY: as above; closing a number that is not open is harmless (EBADF).
                unsafe { libc::close(fd) };
            }
        }
    };
    let mut keep: Vec<RawFd> = keep.iter().copied().filter(|&k| k >= first).collect();
    keep.sort_unstable();
    keep.dedup();
    let mut lo = first;
    for k in keep {
        if k > lo {
            close_range(lo, k as libc::c_uint - 1);
        }
        lo = k + 1;
    }
    close_range(lo, libc::c_uint::MAX);
}

/// Renames `from` to `to`, failing with `AlreadyExists` rather than replacing `to`.
pub fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let c = |p: &Path| CString::new(p.as_os_str().as_encoded_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"));
    let (f, t) = (c(from)?, c(to)?);
    // SAFETY: both paths are NUL-terminated and outlive the call.
    cvt(unsafe { libc::renameat2(libc::AT_FDCWD, f.as_ptr(), libc::AT_FDCWD, t.as_ptr(), libc::RENAME_NOREPLACE) })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replace_stdio_refuses_other_descriptors() {
        let f = std::fs::File::open("/dev/null").unwrap();
        let e = replace_stdio(std::os::fd::AsFd::as_fd(&f), f.as_raw_fd()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    /// The lines of /proc/self/smaps about the mapping that holds `addr`.
    fn smaps_of(addr: usize) -> Vec<String> {
        let text = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut out = Vec::new();
        let mut inside = false;
        for l in text.lines() {
            let range = l
                .split_whitespace()
                .next()
                .and_then(|r| r.split_once('-'))
                .and_then(|(a, b)| Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?)));
            match range {
                Some((a, b)) => inside = a <= addr && addr < b,
                None if inside => out.push(l.to_string()),
                None => {}
            }
        }
        assert!(!out.is_empty(), "no mapping holds {addr:x}");
        out
    }

    #[test]
    fn anon_memory_is_faulted_in_aligned_and_zero() {
        let len = (9 << 20) + 4096;
        let m = Anon::populated(len, 3).unwrap();
        assert_eq!(m.len(), len);
        assert_eq!(m.ptr_at(0) as usize % (2 << 20), 0, "2 MiB aligned, for huge pages");
        // SAFETY: nothing else writes `m`.
        assert!(unsafe { m.slice(0, len) }.iter().all(|&b| b == 0));
        // Faulted in: resident without being touched here.
        let rss_kb: usize = smaps_of(m.ptr_at(0) as usize).iter().find_map(|l| l.strip_prefix("Rss:")?.trim().strip_suffix("kB")?.trim().parse().ok()).unwrap();
        assert!(rss_kb * 1024 >= len, "only {rss_kb} kB of {len} bytes resident");
    }

    #[test]
    fn empty_anon_memory_is_fine() {
        let m = Anon::populated(0, 4).unwrap();
        assert!(m.is_empty());
    }

    #[test]
    fn anon_memory_is_not_inherited_by_children() {
        let m = Anon::populated(4 << 20, 1).unwrap();
        let flags = smaps_of(m.ptr_at(0) as usize).into_iter().find_map(|l| l.strip_prefix("VmFlags:").map(String::from)).unwrap();
        // "dc": do not copy this area on fork.
        assert!(flags.split_whitespace().any(|f| f == "dc"), "{flags}");
    }

    #[test]
    fn host_memory_reads_meminfo() {
        let (available, total) = host_memory().unwrap();
        assert!(available > 0 && available <= total, "{available} of {total}");
    }

    #[test]
    fn cloexec_flags() {
        let f = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: F_GETFD only reads the flags of a descriptor this test owns.
        let cloexec = || unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFD) } & libc::FD_CLOEXEC != 0;
        assert!(cloexec());
        clear_cloexec(f.as_raw_fd()).unwrap();
        assert!(!cloexec());
        set_cloexec(f.as_raw_fd()).unwrap();
        assert!(cloexec());
    }

    #[test]
    fn rename_noreplace_refuses_to_replace() {
        let dir = std::env::temp_dir().join(format!("hiber-sys-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("a")).unwrap();
        std::fs::create_dir_all(dir.join("b")).unwrap();
        let e = rename_noreplace(&dir.join("a"), &dir.join("b")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        rename_noreplace(&dir.join("a"), &dir.join("c")).unwrap();
        assert!(dir.join("c").exists() && !dir.join("a").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Running one thread of a stopped process while its other threads stay stopped.
pub mod ptrace {
    use std::io;
    use std::time::{Duration, Instant};

    use super::cvt;

    /// How long a traced thread may take to report a stop.
    const STOP_WAIT: Duration = Duration::from_secs(10);

    /// A thread of a process that a signal stopped (SIGSTOP: every thread in group-stop),
    /// seized by the calling thread and running alone, with every signal blocked so that it
    /// handles none meanwhile. Every call on it must come from the thread that started it.
    #[derive(Debug)]
    pub struct RunningThread {
        tid: i32,
        mask: u64,
    }

    fn ptrace(req: libc::c_uint, tid: i32, addr: usize, data: usize) -> io::Result<()> {
        // SAFETY: the requests used here (SEIZE, INTERRUPT, CONT, DETACH, GET/SETSIGMASK)
        // read or write at most `addr` bytes at `data`, which the callers point at a u64 of
        // their own for the mask requests, and take no pointer otherwise.
        cvt(unsafe { libc::ptrace(req, tid, addr as *mut libc::c_void, data as *mut libc::c_void) } as i32)?;
        Ok(())
    }

    /// Reaps the stop `tid` reports, waiting at most `STOP_WAIT` (`must`: an error if none
    /// comes; else a stop reported already or not at all is fine).
    fn wait_stop(tid: i32, must: bool) -> io::Result<()> {
        let start = Instant::now();
        loop {
            let mut status = 0;
            // SAFETY: `status` is a valid out-pointer.
            let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL | libc::WNOHANG) };
            if r == tid {
                if libc::WIFSTOPPED(status) {
                    return Ok(());
                }
                return Err(io::Error::other(format!("thread {tid} ended while traced (status {status:#x})")));
            }
            if r < 0 {
                return Err(io::Error::last_os_error());
            }
            if !must || start.elapsed() > STOP_WAIT {
                return if must { Err(io::Error::other(format!("thread {tid} did not stop within {STOP_WAIT:?}"))) } else { Ok(()) };
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    impl RunningThread {
        pub fn start(tid: i32) -> io::Result<RunningThread> {
            // Seizing a thread in group-stop makes the kernel move it into a ptrace stop
            // before PTRACE_SEIZE returns; the notification of that stop is reaped if there.
            ptrace(libc::PTRACE_SEIZE, tid, 0, 0)?;
            let run = || -> io::Result<u64> {
                // The caller saw the thread stopped, so that stop is reported now.
                wait_stop(tid, true)?;
                let mut mask: u64 = 0;
                ptrace(libc::PTRACE_GETSIGMASK, tid, 8, &mut mask as *mut u64 as usize)?;
                let all: u64 = !0;
                ptrace(libc::PTRACE_SETSIGMASK, tid, 8, &all as *const u64 as usize)?;
                ptrace(libc::PTRACE_CONT, tid, 0, 0)?;
                Ok(mask)
            };
            match run() {
                Ok(mask) => Ok(RunningThread { tid, mask }),
                Err(e) => {
                    let _ = ptrace(libc::PTRACE_DETACH, tid, 0, 0);
                    Err(e)
                }
            }
        }

        /// Stops the thread again, gives it its signal mask back and detaches: it returns to
        /// the group-stop of its process, to run when the process is continued.
        pub fn stop(self) -> io::Result<()> {
            let tid = self.tid;
            ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0)?;
            wait_stop(tid, true)?;
            let restored = ptrace(libc::PTRACE_SETSIGMASK, tid, 8, &self.mask as *const u64 as usize);
            ptrace(libc::PTRACE_DETACH, tid, 0, 0)?;
            restored
        }
    }
}
