//! A small client for `criu swrk`.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use prost::Message;

use super::rpc::{self, CriuReqType};
use crate::sys;

/// CRIU's standard error, in the work directory beside its log.
const STDERR_FILE: &str = "criu.stderr";
/// Processes whose pages hiber's CRIU writes at once, each into its own image file, while
/// it goes on with the next process (scripts/criu-patches/0002): a fourth of the CPUs, at
/// most 16. `HIBER_CRIU_WRITERS` overrides it; 0 has CRIU write every page itself, as
/// upstream CRIU does (which ignores the variable).
fn page_writers() -> usize {
    std::env::var("HIBER_CRIU_WRITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() / 4).clamp(1, 16))
}
/// How much disk a deleted file that a process still holds open (a ghost) may take for
/// CRIU to copy it into the image: 1 GiB of allocated blocks (holes cost nothing). Such
/// files are ordinary (tmpfile(3), Python's `TemporaryFile`, sort's and databases' spill
/// files, a log rotated away under its writer) and often pass CRIU's default, 1 MiB, which
/// fails the dump; the image is the only place their content survives, and the restore
/// needs it. Past 1 GiB the file is more likely a forgotten log or data set than scratch,
/// and copying it would hold the tree frozen for seconds: the dump fails, naming the file.
const GHOST_LIMIT: u32 = 1 << 30;
/// How CRIU keeps TCP connections quiet while it dumps and restores them: nftables,
/// through the libnftables CRIU is built with (its default, iptables, needs the iptables
/// program, which neither Debian's minimal images nor the GPU machines have).
const NETWORK_LOCK: rpc::CriuNetworkLockMethod = rpc::CriuNetworkLockMethod::Nftables;

#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    #[error("CRIU was not found (looked at $HIBER_CRIU, next to hiber, and on PATH)")]
    NotFound,
    #[error("could not start {path}: {source}")]
    Spawn { path: PathBuf, source: io::Error },
    #[error("CRIU RPC {step}: {source}")]
    Io { step: &'static str, source: io::Error },
    #[error("CRIU RPC: {0}")]
    Protocol(String),
    #[error("CRIU {version} is too old: hiber needs {}.{} or newer", super::MIN_VERSION.0, super::MIN_VERSION.1)]
    TooOld { version: String },
    #[error("criu {op} failed{}{}", errno_text(*.errno), detail_text(.detail))]
    Failed { op: &'static str, errno: Option<i32>, detail: Option<String>, log: Option<PathBuf> },
    /// A failure of a CRIU run by another process (a job's shim), as it reported it.
    #[error("{message}")]
    Reported { message: String, log: Option<PathBuf> },
}

fn errno_text(errno: Option<i32>) -> String {
    match errno {
        Some(e) if e != 0 => format!(" ({})", io::Error::from_raw_os_error(e)),
        _ => String::new(),
    }
}

fn detail_text(detail: &Option<String>) -> String {
    detail.as_ref().map(|d| format!(": {d}")).unwrap_or_default()
}

impl CriuError {
    /// The errno CRIU reported, if any.
    pub fn errno(&self) -> Option<i32> {
        match self {
            CriuError::Failed { errno, .. } => *errno,
            _ => None,
        }
    }

    /// The CRIU log of a failed request, where there is one.
    pub fn log(&self) -> Option<&Path> {
        match self {
            CriuError::Failed { log, .. } | CriuError::Reported { log, .. } => log.as_deref(),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CriuVersion {
    pub major: i32,
    pub minor: i32,
    pub sublevel: i32,
    pub gitid: Option<String>,
    /// The name the version reply gives: hiber's patched CRIU names itself
    /// `DEVICE_NOTIFY` (scripts/criu-patches/0004).
    #[serde(default)]
    pub name: Option<String>,
}

/// The name of a CRIU that sends the device notifications: with `CRIU_DEVICE_THREADS` set,
/// "checkpoint-devices" once it holds the tree and "resume-devices" before it lets a tree
/// that runs on go, the listed threads running alone meanwhile.
pub const DEVICE_NOTIFY: &str = "hiber-device-notify";

impl CriuVersion {
    /// Whether this CRIU lets hiber take device state while it holds the tree.
    pub fn device_notify(&self) -> bool {
        self.name.as_deref() == Some(DEVICE_NOTIFY)
    }
}

impl std::fmt::Display for CriuVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)?;
        if self.sublevel != 0 {
            write!(f, ".{}", self.sublevel)?;
        }
        Ok(())
    }
}

/// What a dump request carries besides the pid.
pub struct DumpOptions<'a> {
    pub pid: i32,
    pub images_dir: &'a Path,
    /// Where CRIU writes `dump.log`; kept apart from the image so the image holds only
    /// what a restore reads.
    pub work_dir: &'a Path,
    pub leave_running: bool,
    /// The tree has a mount namespace of its own whose mounts are the host's (a hiber
    /// job): dump them as external mounts, to be bind-mounted back on restore.
    pub external_mounts: bool,
    /// Open files CRIU dumps as external (`file[MNT_ID:INODE]`), to be handed back with
    /// `inherit_fd` under the same key on restore.
    pub external_files: Vec<String>,
    /// Dump without locking the network (CRIU locks it with iptables or nftables): for a
    /// tree whose network namespace has only loopback, where no traffic comes from outside.
    pub skip_network_lock: bool,
    /// Threads of the tree that run alone while hiber takes device state inside CRIU's
    /// freeze (the "checkpoint-devices" and "resume-devices" notifications; a CRIU with
    /// [`CriuVersion::device_notify`]). Empty: no such notification.
    pub device_threads: Vec<i32>,
}

pub struct RestoreOptions<'a> {
    pub images_dir: &'a Path,
    pub work_dir: &'a Path,
    /// `(key, fd)`: CRIU opens this descriptor in place of the file named by `key` (for a
    /// regular file, its path without the leading '/'; for one dumped as external, its
    /// `file[MNT_ID:INODE]`).
    pub inherit: Vec<(String, RawFd)>,
    /// See [`DumpOptions::external_mounts`]; the namespace is rebuilt on `/`.
    pub external_mounts: bool,
    /// Leave every restored process stopped (SIGSTOP), for device state to be restored
    /// before any of its threads runs.
    pub leave_stopped: bool,
}

/// A located CRIU binary.
#[derive(Debug, Clone)]
pub struct Criu {
    path: PathBuf,
}

impl Criu {
    /// Finds CRIU: `$HIBER_CRIU`, then next to the hiber executable, then on PATH and in
    /// the sbin directories (which a root shell has but `sudo` may not).
    pub fn locate() -> Result<Criu, CriuError> {
        if let Some(p) = std::env::var_os("HIBER_CRIU") {
            return Ok(Criu { path: PathBuf::from(p) });
        }
        let mut dirs: Vec<PathBuf> = Vec::new();
        if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
            dirs.push(dir);
        }
        if let Some(path) = std::env::var_os("PATH") {
            dirs.extend(std::env::split_paths(&path));
        }
        dirs.extend(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from));
        dirs.into_iter().map(|d| d.join("criu")).find(|p| p.is_file()).map(|path| Criu { path }).ok_or(CriuError::NotFound)
    }

    /// The CRIU binary at `path`, as [`Criu::path`] gave it.
    pub fn at(path: PathBuf) -> Criu {
        Criu { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A program CRIU runs for some images (`ip` from iproute2 for a network namespace),
    /// where CRIU will find it: beside the CRIU binary (a carried bundle puts it there and
    /// on CRIU's PATH), or on PATH.
    pub fn helper_tool(&self, name: &str) -> Option<PathBuf> {
        let beside = self.path.parent().map(|d| d.join(name));
        let on_path = std::env::var_os("PATH").into_iter().flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).map(|d| d.join(name));
        beside.into_iter().chain(on_path).find(|p| p.is_file())
    }

    pub fn version(&self) -> Result<CriuVersion, CriuError> {
        // A private directory for CRIU's stderr: never a fixed name in a shared /tmp.
        let dir = private_temp_dir("hiber-criu-version").map_err(|source| CriuError::Io { step: "create a private directory", source })?;
        let resp = self.call(request(CriuReqType::Version, None), (&[], &[]), &mut |_| Ok(()), "version", &dir, None);
        let _ = std::fs::remove_dir_all(&dir);
        let resp = resp?;
        let v = resp.version.ok_or_else(|| CriuError::Protocol("VERSION reply without a version".into()))?;
        Ok(CriuVersion { major: v.major_number, minor: v.minor_number, sublevel: v.sublevel.unwrap_or(0), gitid: v.gitid, name: v.name })
    }

    /// Fails with [`CriuError::TooOld`] unless the CRIU found is recent enough.
    pub fn require_supported(&self) -> Result<CriuVersion, CriuError> {
        let v = self.version()?;
        if (v.major, v.minor) < super::MIN_VERSION {
            return Err(CriuError::TooOld { version: v.to_string() });
        }
        Ok(v)
    }

    /// `criu check` over RPC: whether this kernel has what CRIU needs.
    pub fn check(&self, work_dir: &Path) -> Result<(), CriuError> {
        let dir = File::open(work_dir).map_err(|source| CriuError::Io { step: "open work dir", source })?;
        let opts = rpc::CriuOpts {
            images_dir_fd: dir.as_raw_fd(),
            work_dir_fd: Some(dir.as_raw_fd()),
            log_file: Some("check.log".into()),
            log_level: Some(4),
            ..Default::default()
        };
        self.call(request(CriuReqType::Check, Some(opts)), (&[], &[]), &mut |_| Ok(()), "check", work_dir, Some("check.log")).map(|_| ())
    }

    /// Dumps the tree rooted at `opts.pid`. `on_notify` is called for each of CRIU's
    /// notifications with the script name; an `Err` makes CRIU fail the dump and resume
    /// the tree.
    pub fn dump(&self, opts: &DumpOptions<'_>, on_notify: &mut dyn FnMut(&str) -> Result<(), String>) -> Result<(), CriuError> {
        let work = File::open(opts.work_dir).map_err(|source| CriuError::Io { step: "open work dir", source })?;
        let images = File::open(opts.images_dir).map_err(|source| CriuError::Io { step: "open images dir", source })?;
        let o = rpc::CriuOpts {
            images_dir_fd: images.as_raw_fd(),
            pid: Some(opts.pid),
            leave_running: Some(opts.leave_running),
            file_locks: Some(true),
            ext_unix_sk: Some(true),
            tcp_established: Some(true),
            // Connections a listening socket has not accepted yet (their handshake done by
            // the kernel, or under way) are left out of the image, where CRIU's default
            // fails the whole dump. Their clients see what a server restart shows them:
            // when the checkpoint stops the tree, the kernel resets those connections
            // (ECONNRESET at the client's next read or write) and the client connects
            // again, to the restored server; with --leave-running the original keeps and
            // serves them, and a restored copy starts with an empty accept queue.
            tcp_skip_in_flight: Some(true),
            ghost_limit: Some(GHOST_LIMIT),
            // A file still named but mapped under a name since removed (glibc's sem_open
            // maps a semaphore under a temporary name, then links it to its own): CRIU
            // links it back for the dump. In a job's own /dev/shm that link goes into the
            // image with the tmpfs, and CRIU removes it from the running job afterwards.
            link_remap: Some(true),
            notify_scripts: Some(true),
            auto_ext_mnt: Some(opts.external_mounts),
            ext_sharing: Some(opts.external_mounts),
            ext_masters: Some(opts.external_mounts),
            external: opts.external_files.clone(),
            network_lock: Some(if opts.skip_network_lock { rpc::CriuNetworkLockMethod::Skip } else { NETWORK_LOCK } as i32),
            work_dir_fd: Some(work.as_raw_fd()),
            log_file: Some("dump.log".into()),
            log_level: Some(4),
            ..Default::default()
        };
        let threads: Vec<String> = opts.device_threads.iter().map(i32::to_string).collect();
        let env: Vec<(&str, String)> = if threads.is_empty() { Vec::new() } else { vec![("CRIU_DEVICE_THREADS", threads.join(","))] };
        self.call(request(CriuReqType::Dump, Some(o)), (&[], &env), on_notify, "dump", opts.work_dir, Some("dump.log")).map(|_| ())
    }

    /// Restores an image as a child of the calling process and returns its root's PID.
    pub fn restore(&self, opts: &RestoreOptions<'_>, on_notify: &mut dyn FnMut(&str) -> Result<(), String>) -> Result<i32, CriuError> {
        let work = File::open(opts.work_dir).map_err(|source| CriuError::Io { step: "open work dir", source })?;
        // CRIU inherits the descriptors under the numbers they have here (see `spawn`).
        let inherit: Vec<rpc::InheritFd> = opts.inherit.iter().map(|(key, fd)| rpc::InheritFd { key: key.clone(), fd: *fd }).collect();
        let fds: Vec<RawFd> = opts.inherit.iter().map(|(_, fd)| *fd).collect();
        let images = File::open(opts.images_dir).map_err(|source| CriuError::Io { step: "open images dir", source })?;
        let o = rpc::CriuOpts {
            images_dir_fd: images.as_raw_fd(),
            rst_sibling: Some(true),
            file_locks: Some(true),
            ext_unix_sk: Some(true),
            tcp_established: Some(true),
            notify_scripts: Some(true),
            inherit_fd: inherit,
            auto_ext_mnt: Some(opts.external_mounts),
            ext_sharing: Some(opts.external_mounts),
            ext_masters: Some(opts.external_mounts),
            root: opts.external_mounts.then(|| "/".to_string()),
            network_lock: Some(NETWORK_LOCK as i32),
            leave_stopped: Some(opts.leave_stopped),
            work_dir_fd: Some(work.as_raw_fd()),
            log_file: Some("restore.log".into()),
            log_level: Some(4),
            ..Default::default()
        };
        let resp = self.call(request(CriuReqType::Restore, Some(o)), (&fds, &[]), on_notify, "restore", opts.work_dir, Some("restore.log"))?;
        resp.restore.map(|r| r.pid).ok_or_else(|| CriuError::Protocol("RESTORE reply without a pid".into()))
    }

    fn spawn(&self, inherit: &[RawFd], env: &[(&str, String)], work_dir: &Path) -> Result<(Child, File), CriuError> {
        // What CRIU prints before its log file is set up goes here.
        let stderr = File::create(work_dir.join(STDERR_FILE)).map_err(|source| CriuError::Io { step: "create stderr file", source })?;
        let (ours, theirs) = sys::seqpacket_pair().map_err(|source| CriuError::Io { step: "socketpair", source })?;
        // CRIU gets the RPC socket and the inherited descriptors under the numbers they have
        // here (never 0 to 2, which the child's stdio replaces).
        let mut pass = vec![theirs.as_raw_fd()];
        pass.extend_from_slice(inherit);
        if let Some(fd) = pass.iter().find(|&&fd| fd < 3) {
            return Err(CriuError::Protocol(format!("descriptor {fd} cannot be passed to CRIU")));
        }
        let mut cmd = Command::new(&self.path);
        cmd.arg("swrk").arg(theirs.as_raw_fd().to_string()).stdin(Stdio::null()).stdout(Stdio::null()).stderr(stderr);
        cmd.env("CRIU_MEMWRITE_WRITERS", page_writers().to_string());
        cmd.env_remove("CRIU_DEVICE_THREADS").envs(env.iter().map(|(k, v)| (k, v)));
        // CRIU outlives a killed hiber: in its own process group, a signal to hiber's group
        // does not reach it, so it can finish and resume the tree (see the journal).
        cmd.process_group(0);
        // SAFETY: the closure runs in the forked child before exec and calls only fcntl,
        // which is async-signal-safe; it allocates nothing (`pass` was built before the
        // fork). The descriptors stay open here until `spawn` returns, and only the child's
        // copies lose close-on-exec.
        unsafe {
            cmd.pre_exec(move || {
                for fd in &pass {
                    sys::clear_cloexec(*fd)?;
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|source| CriuError::Spawn { path: self.path.clone(), source })?;
        drop(theirs);
        Ok((child, File::from(ours)))
    }

    fn call(
        &self,
        req: rpc::CriuReq,
        (inherit, env): (&[RawFd], &[(&str, String)]),
        on_notify: &mut dyn FnMut(&str) -> Result<(), String>,
        op: &'static str,
        work_dir: &Path,
        log: Option<&str>,
    ) -> Result<rpc::CriuResp, CriuError> {
        let (mut child, mut sock) = self.spawn(inherit, env, work_dir)?;
        let log = log.map(|l| work_dir.join(l));
        let result = exchange(&mut sock, req, on_notify, op, log);
        drop(sock);
        let _ = child.wait();
        result
    }
}

/// A number that differs between calls in one process.
fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A new 0700 directory `PREFIX-…` in the temporary directory. The name's pid can be an
/// earlier hiber's, killed before it removed its own (a fresh-clone CI run met one), so a
/// name that exists is passed over, never reused.
fn private_temp_dir(prefix: &str) -> std::io::Result<PathBuf> {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let mut last = None;
    for _ in 0..64 {
        let dir = std::env::temp_dir().join(format!("{prefix}-{}-{nanos}-{}", std::process::id(), unique()));
        match std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::from(std::io::ErrorKind::AlreadyExists)))
}

fn request(kind: CriuReqType, opts: Option<rpc::CriuOpts>) -> rpc::CriuReq {
    rpc::CriuReq { r#type: kind as i32, opts, ..Default::default() }
}

fn exchange(
    sock: &mut File,
    req: rpc::CriuReq,
    on_notify: &mut dyn FnMut(&str) -> Result<(), String>,
    op: &'static str,
    log: Option<PathBuf>,
) -> Result<rpc::CriuResp, CriuError> {
    send(sock, &req)?;
    loop {
        let resp = recv(sock)?;
        if resp.r#type == CriuReqType::Notify as i32 {
            let script = resp.notify.as_ref().and_then(|n| n.script.clone()).unwrap_or_default();
            let outcome = on_notify(&script);
            if let Err(reason) = &outcome {
                tracing::debug!(script, reason, "refusing CRIU notification; the error that caused it is reported");
            }
            let ack = rpc::CriuReq { r#type: CriuReqType::Notify as i32, notify_success: Some(outcome.is_ok()), ..Default::default() };
            send(sock, &ack)?;
            continue;
        }
        if resp.success {
            return Ok(resp);
        }
        // The log's last error says why it failed; CRIU's cr_errmsg is its first error,
        // often a harmless one.
        let detail = log
            .as_deref()
            .and_then(last_error_line)
            .or_else(|| log.as_deref().and_then(|l| last_error_line(&l.with_file_name(STDERR_FILE))))
            .or_else(|| resp.cr_errmsg.clone().filter(|m| !m.is_empty()));
        return Err(CriuError::Failed { op, errno: resp.cr_errno, detail, log });
    }
}

fn send(sock: &mut File, msg: &rpc::CriuReq) -> Result<(), CriuError> {
    sock.write_all(&msg.encode_to_vec()).map_err(|source| CriuError::Io { step: "send", source })
}

fn recv(sock: &mut File) -> Result<rpc::CriuResp, CriuError> {
    let mut buf = vec![0u8; 1 << 20];
    let n = sock.read(&mut buf).map_err(|source| CriuError::Io { step: "receive", source })?;
    if n == 0 {
        return Err(CriuError::Protocol("criu swrk closed the connection (crashed or was killed?)".into()));
    }
    rpc::CriuResp::decode(&buf[..n]).map_err(|e| CriuError::Protocol(format!("undecodable reply: {e}")))
}

/// Whether a CRIU error message only passes on a failure logged before it: a restored
/// process that exited, a descriptor that could not be opened, a dump step that failed.
fn relays_failure(message: &str) -> bool {
    message.starts_with("Unable to open fd=") || message.contains(" exited, status=") || message.ends_with("failed with -1")
}

/// The last two errors of a CRIU log, oldest first, for a one-line reason: the last is
/// often the consequence ("Can't open master pty"), the one before it the cause ("Can't
/// bind ... Address already in use"); messages that only pass a failure on are skipped.
/// CRIU is driven over RPC; its log is read only to explain a failure to a person.
fn last_error_line(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    // CRIU logs an error for an RLIMIT_NOFILE it may not raise and carries on: not a cause.
    let mut errors: Vec<&str> = text
        .lines()
        .rev()
        .filter(|l| l.contains("Error (") && !l.contains("Dumping FAILED") && !l.contains("Restoring FAILED") && !l.contains("RLIMIT_NOFILE"))
        // "(00.123456)  1: Error (criu/foo.c:12): message" -> "message"
        .map(|l| l.split_once("): ").map(|(_, m)| m).unwrap_or(l).trim())
        .filter(|m| !relays_failure(m))
        .take(2)
        .collect();
    errors.dedup();
    errors.reverse();
    (!errors.is_empty()).then(|| errors.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_line_is_taken_from_the_end_of_the_log() {
        let dir = std::env::temp_dir().join(format!("hiber-criu-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("dump.log");
        std::fs::write(
            &log,
            "(00.000100) Error (criu/a.c:1): first\n(00.000200) Error (criu/files-reg.c:2175): File tmp/x has bad size 3 (expect 4)\n(00.000250) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n(00.000300) Error (criu/cr-dump.c:2111): Dumping FAILED.\n",
        )
        .unwrap();
        assert_eq!(last_error_line(&log).as_deref(), Some("first; File tmp/x has bad size 3 (expect 4)"));
        // A restore whose child failed: the cause, not the failures it passed on.
        std::fs::write(
            &log,
            "(00.037056)      3: Error (criu/tty.c:625): tty: Unable to open dev/ptmx with specified index 0\n(00.037082)      3: Error (criu/tty.c:1092): tty: Can't open master pty 0x21 (index 0)\n(00.037084)      3: Error (criu/files.c:1221): Unable to open fd=101 id=0x21\n(00.037877)      1: Error (criu/cr-restore.c:1258): 3 exited, status=1\n(00.038591) Error (criu/cr-restore.c:2320): Restoring FAILED.\n",
        )
        .unwrap();
        assert_eq!(last_error_line(&log).as_deref(), Some("tty: Unable to open dev/ptmx with specified index 0; tty: Can't open master pty 0x21 (index 0)"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn version_display() {
        let v = CriuVersion { major: 4, minor: 1, sublevel: 1, gitid: None, name: None };
        assert_eq!(v.to_string(), "4.1.1");
        assert!((v.major, v.minor) >= crate::criu::MIN_VERSION);
    }
}
