//! Discovers a process tree and what each process holds, from /proc.

use std::collections::{BTreeMap, VecDeque};
use std::fs;
use std::io;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

const PF_KTHREAD: u64 = 0x0020_0000;

#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("no process with PID {0}")]
    NoSuchProcess(i32),
    #[error("reading /proc/{pid}/{file}: {source}")]
    Proc { pid: i32, file: &'static str, source: io::Error },
}

/// What one process of a tree looks like at discovery time.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ProcessInfo {
    /// PID as seen from hiber's namespace.
    pub pid: i32,
    pub ppid: i32,
    /// PID inside the process's own (innermost) PID namespace; what CRIU restores.
    pub ns_pid: i32,
    pub comm: String,
    pub cmdline: Vec<String>,
    pub threads: u32,
    /// Controlling terminal (`tty_nr` of /proc/PID/stat), 0 when none.
    pub tty_nr: i32,
    pub start_time: u64,
    pub uid: u32,
    pub rss_bytes: u64,
    pub anon_bytes: u64,
    pub kernel_thread: bool,
    pub fds: Vec<OpenFd>,
    /// Device files it holds open or mapped (not `/dev/null` and the like): what tells an
    /// engine the process may have device state (1.0 images had `uses_nvidia` instead).
    #[serde(default)]
    pub device_files: Vec<String>,
}

impl ProcessInfo {
    /// Whether it holds a device file whose path starts with `prefix`.
    pub fn holds_device(&self, prefix: &str) -> bool {
        self.device_files.iter().any(|f| f.starts_with(prefix))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OpenFd {
    pub fd: i32,
    /// The `/proc/PID/fd` link: a path, or `pipe:[ino]`, `socket:[ino]`, ...
    pub target: String,
    /// Size of a regular file when it was checkpointed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// The file lives on a mount of the tree's own, no copy of one of hiber's mount
    /// namespace (a job's /dev/shm, its /proc, what it mounted itself), which CRIU restores
    /// with the tree: a restore does not look for it on the host.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub own_mount: bool,
}

impl OpenFd {
    /// A path on a filesystem (not a pipe, socket or anonymous inode).
    pub fn is_path(&self) -> bool {
        self.target.starts_with('/')
    }

    pub fn is_regular_file(&self) -> bool {
        self.size.is_some()
    }
}

fn read(pid: i32, file: &'static str) -> Result<String, TreeError> {
    fs::read_to_string(format!("/proc/{pid}/{file}")).map_err(|source| {
        if source.kind() == io::ErrorKind::NotFound {
            TreeError::NoSuchProcess(pid)
        } else {
            TreeError::Proc { pid, file, source }
        }
    })
}

/// Fields of /proc/PID/stat that hiber uses.
#[derive(Debug, Clone, PartialEq)]
pub struct Stat {
    pub comm: String,
    pub state: char,
    pub ppid: i32,
    pub tty_nr: i32,
    pub flags: u64,
    pub threads: u32,
    pub start_time: u64,
}

/// Parses /proc/PID/stat. The command name may hold spaces and parentheses, so the
/// fields are found after the *last* ')'.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_string();
    let rest: Vec<&str> = text.get(close + 1..)?.split_whitespace().collect();
    Some(Stat {
        comm,
        state: rest.first()?.chars().next()?,
        ppid: rest.get(1)?.parse().ok()?,
        tty_nr: rest.get(4)?.parse().ok()?,
        flags: rest.get(6)?.parse().ok()?,
        threads: rest.get(17)?.parse().ok()?,
        start_time: rest.get(19)?.parse().ok()?,
    })
}

pub fn stat(pid: i32) -> Result<Stat, TreeError> {
    let text = read(pid, "stat")?;
    parse_stat(&text).ok_or_else(|| TreeError::Proc { pid, file: "stat", source: io::Error::new(io::ErrorKind::InvalidData, "unparsable") })
}

/// Whether `pid` is still the process that started at `start_time` (PIDs are reused).
pub fn is_same_process(pid: i32, start_time: u64) -> bool {
    matches!(stat(pid), Ok(s) if s.start_time == start_time && s.state != 'Z')
}

fn status_field<'a>(status: &'a str, key: &str) -> Option<&'a str> {
    status.lines().find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(':')).map(str::trim))
}

fn kib(field: Option<&str>) -> u64 {
    field.and_then(|v| v.split_whitespace().next()).and_then(|n| n.parse::<u64>().ok()).unwrap_or(0) * 1024
}

pub fn read_process(pid: i32) -> Result<ProcessInfo, TreeError> {
    let st = stat(pid)?;
    let status = read(pid, "status")?;
    let cmdline = fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| raw.split(|&b| b == 0).filter(|s| !s.is_empty()).map(|s| String::from_utf8_lossy(s).into_owned()).collect())
        .unwrap_or_default();
    let ns_pid = status_field(&status, "NSpid").and_then(|v| v.split_whitespace().last()).and_then(|v| v.parse().ok()).unwrap_or(pid);
    let uid = status_field(&status, "Uid").and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse().ok()).unwrap_or(0);
    let fds = open_fds(pid);
    let device_files = device_files(pid, &fds);
    Ok(ProcessInfo {
        pid,
        ppid: st.ppid,
        ns_pid,
        comm: st.comm,
        cmdline,
        threads: st.threads,
        tty_nr: st.tty_nr,
        start_time: st.start_time,
        uid,
        rss_bytes: kib(status_field(&status, "VmRSS")),
        anon_bytes: kib(status_field(&status, "RssAnon")),
        kernel_thread: st.flags & PF_KTHREAD != 0,
        fds,
        device_files,
    })
}

fn open_fds(pid: i32) -> Vec<OpenFd> {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/fd")) else { return Vec::new() };
    // Read only for a process with a regular file open, once.
    let mut mounts: Option<OwnMounts> = None;
    let mut fds: Vec<OpenFd> = dir
        .filter_map(Result::ok)
        .filter_map(|e| {
            let fd: i32 = e.file_name().to_str()?.parse().ok()?;
            let target = fs::read_link(e.path()).ok()?.to_string_lossy().into_owned();
            let size = fs::metadata(e.path()).ok().filter(|m| m.is_file()).map(|m| m.len());
            let own_mount = size.is_some() && mounts.get_or_insert_with(|| OwnMounts::of(pid)).holds_fd(pid, fd);
            Some(OpenFd { fd, target, size, own_mount })
        })
        .collect();
    fds.sort_by_key(|f| f.fd);
    fds
}

/// The mounts a process sees that are no copy of one of hiber's mount namespace: those of
/// a job's own (its /dev/shm tmpfs, its /proc, what it mounted itself), by mount ID.
struct OwnMounts {
    ids: Vec<u64>,
}

impl OwnMounts {
    fn of(pid: i32) -> OwnMounts {
        // hiber's own mounts, read once per hiber: the job's copies were made from mounts
        // that hiber's namespace already had.
        static OURS: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let ours = OURS.get_or_init(|| fs::read_to_string("/proc/self/mountinfo").unwrap_or_default());
        let theirs = fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
        if ours.is_empty() || theirs.is_empty() {
            // Unknown: every open file is then looked for on the host, as before.
            return OwnMounts { ids: Vec::new() };
        }
        OwnMounts { ids: own_mount_ids(&theirs, ours) }
    }

    /// Whether descriptor `fd` of `pid` is a file on one of them (its fdinfo's `mnt_id`).
    fn holds_fd(&self, pid: i32, fd: i32) -> bool {
        if self.ids.is_empty() {
            return false;
        }
        let info = fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).unwrap_or_default();
        let mnt = info.lines().find_map(|l| l.strip_prefix("mnt_id:")).and_then(|v| v.trim().parse::<u64>().ok());
        mnt.is_some_and(|m| self.ids.contains(&m))
    }
}

/// The mount IDs of `theirs` (a mountinfo text) that are no copy of a mount of `ours`: a
/// copy (what a new mount namespace starts with) has the same device (`major:minor`), root
/// within its filesystem and mount point, though not the same ID. A new tmpfs or proc gets
/// a device of its own; a filesystem the job mounted again elsewhere (its own cgroup2
/// mount, say) keeps the device but not the place.
fn own_mount_ids(theirs: &str, ours: &str) -> Vec<u64> {
    let fields = |l: &str| {
        let mut f = l.split_whitespace();
        let id = f.next()?.parse::<u64>().ok()?;
        let place = (f.nth(1)?.to_string(), f.next()?.to_string(), f.next()?.to_string());
        Some((id, place))
    };
    let ours: Vec<(String, String, String)> = ours.lines().filter_map(fields).map(|(_, p)| p).collect();
    theirs.lines().filter_map(fields).filter(|(_, p)| !ours.contains(p)).map(|(id, _)| id).collect()
}

/// Device files that carry device state: ordinary devices that every process may hold
/// (`/dev/null`, terminals, `/dev/shm`, ...) are left out.
fn is_device_file(path: &str) -> bool {
    const ORDINARY: [&str; 6] = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"];
    path.starts_with("/dev/") && !ORDINARY.contains(&path) && !path.starts_with("/dev/pts/") && !path.starts_with("/dev/shm/")
}

/// The device files `pid` holds open or mapped, sorted, each once: how engines tell the
/// processes whose device state they may have to take (`/dev/nvidia*` for the CUDA ones).
fn device_files(pid: i32, fds: &[OpenFd]) -> Vec<String> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let mapped = maps.lines().filter_map(|l| l.split_whitespace().nth(5));
    let mut out: Vec<String> = fds.iter().map(|f| f.target.as_str()).chain(mapped).filter(|p| is_device_file(p)).map(String::from).collect();
    out.sort();
    out.dedup();
    out
}

/// PID -> parent PID of every process on the system.
fn parents() -> BTreeMap<i32, i32> {
    let Ok(dir) = fs::read_dir("/proc") else { return BTreeMap::new() };
    dir.filter_map(Result::ok).filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok()).filter_map(|pid| Some((pid, stat(pid).ok()?.ppid))).collect()
}

/// The tree rooted at `root`, root first, then breadth-first.
pub fn discover_tree(root: i32) -> Result<Vec<ProcessInfo>, TreeError> {
    let root_info = read_process(root)?;
    let parents = parents();
    let mut out = vec![root_info];
    let mut queue = VecDeque::from([root]);
    while let Some(p) = queue.pop_front() {
        for (&child, _) in parents.iter().filter(|(_, &pp)| pp == p) {
            // A child that exited since the scan is no longer part of the tree.
            match read_process(child) {
                Ok(info) => {
                    out.push(info);
                    queue.push_back(child);
                }
                Err(TreeError::NoSuchProcess(_)) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(out)
}

/// PIDs of `pid` and all its ancestors, for refusing to checkpoint hiber's own lineage.
pub fn ancestors_of(pid: i32) -> Vec<i32> {
    let mut out = vec![pid];
    let mut cur = pid;
    while let Ok(st) = stat(cur) {
        if st.ppid <= 0 || out.contains(&st.ppid) {
            break;
        }
        out.push(st.ppid);
        cur = st.ppid;
    }
    out
}

/// The names of the abstract unix sockets among `fds` (process `pid`'s), as
/// `/proc/PID/net/unix` shows them for the process's network namespace: `@NAME`, without
/// the NUL padding it shows as trailing '@'s.
pub fn abstract_socket_names(pid: i32, fds: &[OpenFd]) -> Vec<String> {
    let inodes: std::collections::HashSet<&str> = fds.iter().filter_map(|f| f.target.strip_prefix("socket:[")?.strip_suffix(']')).collect();
    if inodes.is_empty() {
        return Vec::new();
    }
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/unix")).unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 8 && inodes.contains(f[6]) && f[7].starts_with('@')).then(|| f[7].trim_end_matches('@').to_string())
        })
        .collect()
}

/// The PID namespace number in the name of the socket CUDA's driver binds in each CUDA
/// process (`@cuda-uvmfd-NS-PID`, NS the inode number of the process's PID namespace when
/// CUDA started in it: a restored process keeps the name).
pub fn cuda_socket_namespace(name: &str) -> Option<u64> {
    name.strip_prefix("@cuda-uvmfd-")?.split('-').next()?.parse().ok()
}

/// A variable of a process's initial environment (what it was started with: a later
/// setenv inside the process is not seen).
pub fn env_var(pid: i32, key: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let key = format!("{key}=");
    env.split(|b| *b == 0).find_map(|kv| kv.strip_prefix(key.as_bytes())).map(|v| String::from_utf8_lossy(v).into_owned())
}

/// Whether the process is stopped by a signal (state `T` in /proc/PID/stat).
pub fn is_stopped(pid: i32) -> bool {
    matches!(stat(pid), Ok(s) if s.state == 'T')
}

/// Whether every thread of the process is stopped by a signal or a tracer (a process that
/// is gone counts as stopped: it has nothing left to run).
pub fn all_threads_stopped(pid: i32) -> bool {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/task")) else { return true };
    dir.filter_map(Result::ok)
        .all(|t| fs::read_to_string(t.path().join("stat")).ok().and_then(|text| parse_stat(&text)).is_none_or(|s| matches!(s.state, 'T' | 't')))
}

/// Whether `pid` runs: it exists and is no zombie (one that exited and that its parent has
/// not reaped yet runs nothing and answers nobody, so it counts as gone). A process whose
/// main thread ended (`pthread_exit`) shows as a zombie while its other threads run: it is
/// alive as long as one of them is.
pub fn alive(pid: i32) -> bool {
    let running = |s: &Stat| !matches!(s.state, 'Z' | 'X');
    match stat(pid) {
        Ok(s) if running(&s) => true,
        Ok(_) => fs::read_dir(format!("/proc/{pid}/task"))
            .map(|d| d.filter_map(Result::ok).any(|t| fs::read_to_string(t.path().join("stat")).ok().and_then(|x| parse_stat(&x)).is_some_and(|s| running(&s))))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// The identity of `pid`'s namespace of `kind` ("net", "mnt", ...), as /proc names it
/// (`net:[4026531833]`); `pid` may also be "self".
pub fn namespace(pid: &str, kind: &str) -> Option<PathBuf> {
    fs::read_link(format!("/proc/{pid}/ns/{kind}")).ok()
}

/// Whether `pid` lives in a namespace of `kind` other than hiber's.
pub fn has_own_namespace(pid: i32, kind: &str) -> bool {
    matches!((namespace(&pid.to_string(), kind), namespace("self", kind)), (Some(a), Some(b)) if a != b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_mounts_are_those_that_are_no_copy_of_hiber_s() {
        let ours = "22 1 259:1 / / rw - ext4 /dev/root rw\n30 22 0:26 / /dev/shm rw - tmpfs tmpfs rw\n31 22 0:21 / /proc rw - proc proc rw\n";
        // The job's copies of the host's mounts have new IDs but the same devices; its
        // /dev/shm and /proc are new filesystems.
        // /mnt/hostshm: the host's /dev/shm filesystem, mounted again by the job elsewhere.
        let theirs = "400 390 259:1 / / rw - ext4 /dev/root rw\n401 400 0:61 / /dev/shm rw - tmpfs tmpfs rw\n402 400 0:62 / /proc rw - proc proc rw\n403 400 0:26 / /mnt/hostshm rw - tmpfs tmpfs rw\n404 400 259:1 / /srv rw - ext4 /dev/root rw\n";
        assert_eq!(own_mount_ids(theirs, ours), vec![401, 402, 403, 404]);
        assert!(own_mount_ids(ours, ours).is_empty());
    }

    #[test]
    fn stat_with_spaces_and_parens_in_comm() {
        let line = "4242 (my (odd) prog) S 1 4242 4242 34816 4242 4194560 100 0 0 0 5 3 0 0 20 0 3 0 987654 1000 100 18446744073709551615";
        let st = parse_stat(line).unwrap();
        assert_eq!(st.comm, "my (odd) prog");
        assert_eq!(st.state, 'S');
        assert_eq!(st.ppid, 1);
        assert_eq!(st.tty_nr, 34816);
        assert_eq!(st.threads, 3);
        assert_eq!(st.start_time, 987654);
    }

    #[test]
    fn stat_rejects_garbage() {
        assert!(parse_stat("garbage").is_none());
        assert!(parse_stat("1 (x) S").is_none());
    }

    #[test]
    fn device_files_leave_ordinary_devices_out() {
        assert!(is_device_file("/dev/nvidia0") && is_device_file("/dev/nvidiactl") && is_device_file("/dev/dri/renderD128"));
        assert!(!is_device_file("/dev/null") && !is_device_file("/dev/pts/3") && !is_device_file("/dev/shm/x") && !is_device_file("/tmp/dev/x"));
        let _null = std::fs::File::open("/dev/null").unwrap();
        let me = read_process(std::process::id() as i32).unwrap();
        assert!(!me.device_files.iter().any(|f| f == "/dev/null"), "{:?}", me.device_files);
        assert!(!me.holds_device("/dev/nvidia"));
    }

    #[test]
    fn reads_own_process() {
        let me = read_process(std::process::id() as i32).unwrap();
        assert!(me.threads >= 1);
        assert!(!me.kernel_thread);
        assert!(me.rss_bytes > 0);
        assert!(is_same_process(me.pid, me.start_time));
        assert!(!is_same_process(me.pid, me.start_time + 1));
    }

    #[test]
    fn discovers_children() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let tree = discover_tree(std::process::id() as i32).unwrap();
        assert!(tree.iter().any(|p| p.pid == child.id() as i32));
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
