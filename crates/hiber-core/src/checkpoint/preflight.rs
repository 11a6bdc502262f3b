//! What CRIU will refuse, found before anything is stopped.
//!
//! CRIU fails a dump on a descriptor or a mapping it has no code for, and it finds out
//! only in the middle of the dump, after the device engines locked and checkpointed the
//! GPU processes. Undoing that is not always possible (the driver cannot always restore
//! what it checkpointed), so `prepare` looks first: every process of the tree that no
//! device engine claimed must hold nothing CRIU cannot dump. Of the processes an engine
//! claimed, only what no driver releases is checked (an io_uring, say): the driver takes
//! its own descriptors and mappings away before the dump.
//!
//! The rules follow CRIU 4.1's `files.c` and `proc_parse.c`: of the anonymous inodes it
//! dumps eventfd, eventpoll, inotify, fanotify, signalfd, timerfd and pidfd; of character
//! devices the memory devices (`/dev/null`, `/dev/zero`, ...), terminals, tun and autofs;
//! of device mappings only `/dev/zero`.

use super::CheckpointError;
use crate::proctree::ProcessInfo;

/// The anonymous-inode descriptors CRIU 4.1 dumps.
const DUMPABLE_ANON: [&str; 7] = ["[eventfd]", "[eventpoll]", "inotify", "[fanotify]", "[signalfd]", "[timerfd]", "[pidfd]"];

/// Anonymous-inode kinds that no device driver creates or releases: refused in every
/// process, claimed or not (an engine's checkpoint does not make them go away).
const NEVER_DUMPABLE_ANON: [&str; 3] = ["[io_uring]", "[perf_event]", "[userfaultfd]"];

/// Character devices CRIU dumps: memory devices (major 1), terminals (4, 5, 136-143), and
/// of the misc devices (10) tun (minor 200) and autofs (235).
fn dumpable_char(major: u32, minor: u32) -> bool {
    matches!(major, 1 | 4 | 5 | 136..=143) || (major == 10 && matches!(minor, 200 | 235))
}

/// Why CRIU cannot dump something a process holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Undumpable {
    /// An anonymous-inode descriptor of a kind CRIU has no code for (`[io_uring]`, say).
    AnonInode { fd: i32, kind: String },
    /// A device file (open or mapped) that no engine takes care of.
    Device { path: String },
    /// NVIDIA's driver, held by its OpenCL platform (`libnvidia-opencl`): the driver's
    /// checkpoint API does not know such a process, and releasing the OpenCL objects does
    /// not let go of the driver.
    NvidiaOpenCl { path: String },
    /// An NCCL communicator, known by the shared memory of its proxy (`/dev/shm/nccl-*`) or
    /// by the socket its proxy passes peer memory handles through (`@/tmp/nccl-socket-*`).
    Collective { path: String },
    /// Device contexts on several GPUs, with the driver alone to restore them: the driver
    /// (580) checkpoints such a process that enabled peer access between its GPUs, then
    /// refuses its restore (CUDA_ERROR_INVALID_VALUE, in place or not; suite, 2×H200).
    /// From outside the process peer access cannot be told apart, so every such process
    /// counts; and resuming the original after `--leave-running` is a restore too.
    SeveralGpus { gpus: usize },
    /// A SysV shared memory segment attached in the host's IPC namespace: CRIU dumps such
    /// segments only with an IPC namespace of the tree's own (`hiber run` gives one unless
    /// `--host-ipc`).
    SysvShmOutsideJob { segment: String },
}

/// The path of NCCL's shared memory (`/dev/shm/nccl-XXXXXX`, from `ncclShmOpen`) that
/// process `pid` maps or holds open: every communicator with a peer in another process
/// has one for its proxy (NCCL's `src/misc/shmutils.cc`, `src/proxy.cc`).
fn nccl_shared_memory(pid: i32, fds: &[crate::proctree::OpenFd]) -> Option<String> {
    const PREFIX: &str = "/dev/shm/nccl-";
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let mapped = maps.lines().filter_map(|l| l.split_whitespace().nth(5));
    fds.iter().map(|f| f.target.as_str()).chain(mapped).find(|p| p.starts_with(PREFIX)).map(|p| p.trim_end_matches(" (deleted)").to_string())
}

/// The abstract unix socket of NCCL's that process `pid` holds: the proxy of a communicator
/// whose peers share device memory by cuMem handles (NVLink, NCCL's default since 2.19)
/// passes them through it. Such a communicator needs no `/dev/shm` file, so this is how the
/// two-rank DDP job of the GPU suite on 2×H200 is known. NCCL's `src/misc/ipcsocket.cc`
/// formats `/tmp/nccl-socket-RANK-HASH` into the address and makes it abstract by
/// overwriting its first byte, so the name is `tmp/nccl-socket-RANK-HASH` and NUL padding
/// (`@tmp/nccl-socket-0-3b6c1d5db6a19e47@@@...` in /proc/net/unix, as NCCL 2.28.9 had it).
fn nccl_socket(pid: i32, fds: &[crate::proctree::OpenFd]) -> Option<String> {
    crate::proctree::abstract_socket_names(pid, fds).into_iter().find(|n| n.starts_with("@tmp/nccl-socket-"))
}

/// Where process `pid` shows that it takes part in an NCCL communicator, if it does.
pub fn nccl_member(pid: i32, fds: &[crate::proctree::OpenFd]) -> Option<String> {
    nccl_shared_memory(pid, fds).or_else(|| nccl_socket(pid, fds))
}

/// Refuses a tree with a process in an NCCL communicator that no engine session cuts and
/// rebuilds (`cut`: the agent's, for communicators it made), before any engine touches it:
/// its peer mappings and proxy connections are state that neither CRIU nor the driver can
/// take, and the driver's checkpoint of such a process cannot always be undone (driver
/// 580 answers CUDA_ERROR_NOT_SUPPORTED).
pub fn refuse_collectives(tree: &[ProcessInfo], cut: &[i32]) -> Result<(), CheckpointError> {
    for p in tree.iter().filter(|p| !cut.contains(&p.pid)) {
        if let Some(path) = nccl_member(p.pid, &p.fds) {
            return Err(CheckpointError::Undumpable { pid: p.pid, comm: p.comm.clone(), what: Undumpable::Collective { path } });
        }
    }
    Ok(())
}

/// Refuses a process on several GPUs (`several`: pid and GPU count) whose restore would
/// rest on the driver alone (not one of `served`). Also with `--leave-running`: resuming
/// the original is a driver restore too, so the job itself would be at stake.
pub fn refuse_several_gpus(tree: &[ProcessInfo], several: &[(i32, usize)], served: &[i32]) -> Result<(), CheckpointError> {
    match several.iter().find(|(p, _)| !served.contains(p)) {
        Some(&(pid, gpus)) => {
            let comm = tree.iter().find(|p| p.pid == pid).map(|p| p.comm.clone()).unwrap_or_default();
            Err(CheckpointError::Undumpable { pid, comm, what: Undumpable::SeveralGpus { gpus } })
        }
        None => Ok(()),
    }
}

/// The first thing of `p` that CRIU cannot dump; `device_of` gives a device file's
/// (major, minor) (`None` when it is not a character device). A process an engine
/// `claimed` is checked only for what no engine's checkpoint releases: its device files
/// and the driver's own descriptors are the engine's to take away.
pub fn undumpable(p: &ProcessInfo, claimed: bool, device_of: impl Fn(&str) -> Option<(u32, u32)>) -> Option<Undumpable> {
    for f in &p.fds {
        if let Some(kind) = f.target.strip_prefix("anon_inode:") {
            let refused = if claimed { NEVER_DUMPABLE_ANON.contains(&kind) } else { !DUMPABLE_ANON.contains(&kind) };
            if refused {
                return Some(Undumpable::AnonInode { fd: f.fd, kind: kind.to_string() });
            }
        }
    }
    if claimed {
        return None;
    }
    p.device_files.iter().find(|d| device_of(d).is_some_and(|(major, minor)| !dumpable_char(major, minor))).map(|d| Undumpable::Device { path: d.clone() })
}

/// Whether process `pid` has NVIDIA's OpenCL platform loaded (the ICD loader loads every
/// vendor it is given when a program first lists platforms, used or not).
fn maps_nvidia_opencl(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|m| m.contains("libnvidia-opencl"))
}

fn char_device(path: &str) -> Option<(u32, u32)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::metadata(path).ok()?;
    let dev = meta.rdev();
    // major(3) and minor(3) of a Linux dev_t.
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
    meta.file_type().is_char_device().then_some((major as u32, minor as u32))
}

/// Refuses a tree in a network namespace of its own when CRIU would fail to dump that
/// namespace for want of iproute2's `ip` (it saves addresses and routes with it), and one
/// with a tmpfs of its own (a hiber job's /dev/shm) when `tar` is missing (CRIU archives
/// the tmpfs with it).
pub fn refuse_missing_tools(criu: &crate::criu::Criu, root: i32) -> Result<(), CheckpointError> {
    if crate::proctree::has_own_namespace(root, "net") && criu.helper_tool("ip").is_none() {
        return Err(CheckpointError::MissingTool { pid: root, tool: "ip", why: "to save the network namespace of its own it lives in" });
    }
    if criu.helper_tool("tar").is_none() && has_own_tmpfs(root) {
        return Err(CheckpointError::MissingTool { pid: root, tool: "tar", why: "to save the /dev/shm of its own (`hiber run --host-shm` jobs have none)" });
    }
    Ok(())
}

/// The devices (`major:minor`) of the tmpfs mounts in a mountinfo text.
fn tmpfs_devices(mountinfo: &str) -> Vec<&str> {
    mountinfo
        .lines()
        .filter_map(|l| {
            let (mount, fs) = l.split_once(" - ")?;
            (fs.split_whitespace().next() == Some("tmpfs")).then(|| mount.split_whitespace().nth(2)).flatten()
        })
        .collect()
}

/// Whether `pid` sees a tmpfs this process does not: one CRIU dumps with its content.
fn has_own_tmpfs(pid: i32) -> bool {
    let (Ok(theirs), Ok(ours)) = (std::fs::read_to_string(format!("/proc/{pid}/mountinfo")), std::fs::read_to_string("/proc/self/mountinfo")) else {
        return false;
    };
    let ours = tmpfs_devices(&ours);
    tmpfs_devices(&theirs).iter().any(|d| !ours.contains(d))
}

/// The first SysV shared memory segment `pid` has attached (`/SYSV0000002a (deleted)` in
/// its maps), where it lives in hiber's own IPC namespace.
fn sysv_shm_in_host_namespace(pid: i32) -> Option<String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let segment = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| p.starts_with("/SYSV"))?.to_string();
    (!crate::proctree::has_own_namespace(pid, "ipc")).then_some(segment)
}

/// Refuses the tree if a process holds something CRIU cannot dump (see [`undumpable`]).
pub fn refuse_undumpable(tree: &[ProcessInfo], claimed: &[i32]) -> Result<(), CheckpointError> {
    for p in tree {
        if let Some(segment) = sysv_shm_in_host_namespace(p.pid) {
            return Err(CheckpointError::Undumpable { pid: p.pid, comm: p.comm.clone(), what: Undumpable::SysvShmOutsideJob { segment } });
        }
        if let Some(what) = undumpable(p, claimed.contains(&p.pid), char_device) {
            let what = match what {
                Undumpable::Device { path } if path.starts_with("/dev/nvidia") && maps_nvidia_opencl(p.pid) => Undumpable::NvidiaOpenCl { path },
                what => what,
            };
            return Err(CheckpointError::Undumpable { pid: p.pid, comm: p.comm.clone(), what });
        }
    }
    Ok(())
}

impl std::fmt::Display for Undumpable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Undumpable::AnonInode { fd, kind } => write!(f, "descriptor {fd} (anon_inode:{kind}), which CRIU cannot dump"),
            Undumpable::Device { path } if path.starts_with("/dev/nvidia") => write!(
                f,
                "{path}, and no engine here checkpoints its device state (a process forked after CUDA started inherits CUDA's mappings without a context), which CRIU cannot dump"
            ),
            Undumpable::Device { path } => write!(f, "{path}, a device no engine of this hiber checkpoints"),
            Undumpable::NvidiaOpenCl { path } => write!(
                f,
                "{path} through NVIDIA's OpenCL platform (libnvidia-opencl), whose driver state neither CRIU nor the driver's checkpoint API takes, even with every OpenCL object released"
            ),
            Undumpable::Collective { path } => {
                write!(f, "an NCCL communicator ({path}) that the agent did not make, whose peer memory and proxy connections neither CRIU nor the driver can take")
            }
            Undumpable::SeveralGpus { gpus } => write!(
                f,
                "CUDA contexts on {gpus} GPUs without the agent: if it enabled peer access between them (JAX and multi-GPU PyTorch do), the driver checkpoints it but refuses to restore it, into a new process or into itself"
            ),
            Undumpable::SysvShmOutsideJob { segment } => {
                write!(f, "SysV shared memory ({segment}) of the host's IPC namespace, which CRIU dumps only with an IPC namespace of the job's own")
            }
        }
    }
}

impl Undumpable {
    pub fn hint(&self) -> String {
        match self {
            Undumpable::AnonInode { kind, .. } if kind == "[io_uring]" => "io_uring instances cannot be checkpointed: start the job with `hiber run` without --allow-io-uring (hiber then keeps it off io_uring, and libuv, torchrun's store and other users fall back to epoll), or turn io_uring off in the program's own settings".into(),
            Undumpable::AnonInode { .. } => "close that descriptor before checkpointing, or keep it out of the job".into(),
            Undumpable::Device { path } if path.starts_with("/dev/nvidia") => "run the job with the agent (`hiber run` without --no-agent), which detaches children forked after CUDA started from the driver; or start such workers with the 'spawn' or 'forkserver' start method (for PyTorch: DataLoader(..., multiprocessing_context='spawn'))".into(),
            Undumpable::Device { .. } => "close the device before checkpointing, or keep it out of the job".into(),
            Undumpable::NvidiaOpenCl { .. } => "OpenCL jobs checkpoint on platforms whose state is process memory (PoCL); the ICD loader loads every vendor it is given, used or not, so give a job that does not run on NVIDIA's GPU its other vendors alone (OCL_ICD_FILENAMES=libpocl.so.2, or an OCL_ICD_VENDORS directory without NVIDIA's); one that runs on it cannot be checkpointed yet".into(),
            Undumpable::Collective { .. } => "start the job with `hiber run` and the agent (not --no-agent), which cuts NCCL jobs consistently and rebuilds their communicators; NCCL linked statically or loaded with dlsym bypasses the agent".into(),
            Undumpable::SysvShmOutsideJob { .. } => "start the job with `hiber run` without --host-ipc: it then has an IPC namespace of its own, which its images carry".into(),
            Undumpable::SeveralGpus { .. } => "run the job with the agent (`hiber run` without --no-agent), whose processes restore with peer access; or keep each process of the job on one GPU (CUDA_VISIBLE_DEVICES)".into(),
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn tmpfs_devices_are_read_from_mountinfo() {
        let info = "59 58 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24683656k\n\
                    60 59 0:39 / /dev/shm rw,nosuid,nodev,relatime shared:1 - tmpfs tmpfs rw\n\
                    58 43 0:6 / /dev rw - devtmpfs devtmpfs rw\n";
        assert_eq!(tmpfs_devices(info), vec!["0:23", "0:39"]);
        assert!(tmpfs_devices("garbage\n").is_empty());
    }
    use super::*;
    use crate::proctree::OpenFd;

    fn process(fds: &[&str], devices: &[&str]) -> ProcessInfo {
        let mut p = crate::proctree::read_process(std::process::id() as i32).unwrap();
        p.fds = fds.iter().enumerate().map(|(i, t)| OpenFd { fd: i as i32 + 3, target: t.to_string(), size: None, own_mount: false }).collect();
        p.device_files = devices.iter().map(|d| d.to_string()).collect();
        p
    }

    fn devices(path: &str) -> Option<(u32, u32)> {
        match path {
            "/dev/nvidia0" => Some((195, 0)),
            "/dev/nvidiactl" => Some((195, 255)),
            "/dev/nvidia-uvm" => Some((508, 0)),
            "/dev/dri/renderD128" => Some((226, 128)),
            "/dev/kmsg" => Some((1, 11)),
            "/dev/ptmx" => Some((5, 2)),
            "/dev/net/tun" => Some((10, 200)),
            "/dev/kvm" => Some((10, 232)),
            _ => None,
        }
    }

    #[test]
    fn nccl_shared_memory_is_found_open_or_mapped() {
        let _own = OWN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
        use std::os::fd::AsRawFd;
        let me = std::process::id() as i32;
        let path = format!("/dev/shm/nccl-hibertest{me}");
        let f = std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&path).unwrap();
        f.set_len(4096).unwrap();
        let fds = vec![OpenFd { fd: f.as_raw_fd(), target: path.clone(), size: None, own_mount: false }];
        assert_eq!(nccl_shared_memory(me, &fds), Some(path.clone()), "held open");
        // SAFETY: maps the file just created (4096 bytes) shared, read-only; unmapped below.
        let at = unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0) };
        assert_ne!(at, libc::MAP_FAILED);
        std::fs::remove_file(&path).unwrap();
        drop(f);
        assert_eq!(nccl_shared_memory(me, &[]), Some(path), "mapped, unlinked (as NCCL leaves it)");
        // SAFETY: unmaps the mapping made above.
        unsafe { libc::munmap(at, 4096) };
        assert_eq!(nccl_shared_memory(me, &[]), None);
    }

    #[test]
    fn an_nccl_proxy_socket_is_found_by_its_abstract_name() {
        use std::os::fd::AsRawFd;
        use std::os::linux::net::SocketAddrExt;
        let me = std::process::id() as i32;
        let held = |l: &std::os::unix::net::UnixListener| {
            let fd = l.as_raw_fd();
            vec![OpenFd { fd, target: std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap().to_string_lossy().into_owned(), size: None, own_mount: false }]
        };
        // As NCCL names it: the path with its first byte made NUL, and NUL padding.
        let name = format!("tmp/nccl-socket-0-{me:016x}\0\0\0\0");
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let l = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        assert_eq!(nccl_member(me, &held(&l)), Some(format!("@tmp/nccl-socket-0-{me:016x}")));
        assert_eq!(nccl_member(me, &[]), None, "a socket the process does not hold is not its own");
        let other = std::os::unix::net::SocketAddr::from_abstract_name(format!("hiber-agent.test{me:x}").as_bytes()).unwrap();
        let l2 = std::os::unix::net::UnixListener::bind_addr(&other).unwrap();
        assert_eq!(nccl_member(me, &held(&l2)), None, "other abstract sockets are not NCCL's");
    }

    #[test]
    fn io_uring_and_other_unknown_anon_inodes_are_refused() {
        let p = process(&["/dev/null", "anon_inode:[eventfd]", "anon_inode:[eventpoll]", "anon_inode:inotify", "pipe:[12]"], &[]);
        assert_eq!(undumpable(&p, false, devices), None);
        let p = process(&["anon_inode:[timerfd]", "anon_inode:[io_uring]"], &[]);
        let u = undumpable(&p, false, devices).unwrap();
        assert_eq!(u, Undumpable::AnonInode { fd: 4, kind: "[io_uring]".into() });
        assert!(u.to_string().contains("descriptor 4 (anon_inode:[io_uring])"), "{u}");
        assert!(u.hint().contains("--allow-io-uring"));
        assert!(undumpable(&process(&["anon_inode:[perf_event]"], &[]), false, devices).is_some());
        // A process an engine claimed: its driver's descriptors are the engine's to release,
        // an io_uring is not.
        assert_eq!(undumpable(&process(&["anon_inode:[nvidia-something]"], &["/dev/nvidia0"]), true, devices), None);
        assert!(undumpable(&process(&["anon_inode:[io_uring]"], &["/dev/nvidia0"]), true, devices).is_some());
    }

    #[test]
    fn devices_only_an_engine_takes_are_refused() {
        assert_eq!(undumpable(&process(&[], &["/dev/kmsg", "/dev/ptmx", "/dev/net/tun", "/tmp/not-a-device"]), false, devices), None);
        let u = undumpable(&process(&[], &["/dev/nvidia-uvm", "/dev/nvidia0"]), false, devices).unwrap();
        assert!(u.to_string().contains("without a context"), "{u}");
        assert!(u.hint().contains("spawn"));
        assert!(undumpable(&process(&[], &["/dev/dri/renderD128"]), false, devices).is_some());
        assert!(undumpable(&process(&[], &["/dev/kvm"]), false, devices).is_some(), "of the misc devices CRIU knows tun and autofs only");
        assert_eq!(undumpable(&process(&[], &["/dev/nvidia0"]), true, devices), None, "a claimed process's devices are its engine's");
    }

    /// Held by the tests that check this test process itself, while one of them maps a file
    /// that the others would see.
    static OWN_PROCESS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn claimed_processes_are_checked_only_for_what_no_engine_releases() {
        let _own = OWN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
        let mut p = process(&[], &[]);
        p.device_files = vec!["/dev/null".into()];
        // A real /dev/null (major 1) is dumpable; an unclaimed process passes.
        refuse_undumpable(std::slice::from_ref(&p), &[]).unwrap();
        p.fds.push(OpenFd { fd: 9, target: "anon_inode:[some-driver-object]".into(), size: None, own_mount: false });
        assert!(refuse_undumpable(std::slice::from_ref(&p), &[]).is_err());
        refuse_undumpable(std::slice::from_ref(&p), &[p.pid]).unwrap();
        p.fds.push(OpenFd { fd: 10, target: "anon_inode:[io_uring]".into(), size: None, own_mount: false });
        assert!(refuse_undumpable(std::slice::from_ref(&p), &[p.pid]).is_err(), "an engine does not take an io_uring away");
    }

    #[test]
    fn a_process_on_several_gpus_is_refused_unless_the_agent_serves_it() {
        let tree = [process(&[], &["/dev/nvidia0", "/dev/nvidia1"])];
        let pid = tree[0].pid;
        match refuse_several_gpus(&tree, &[(pid, 2)], &[]) {
            Err(CheckpointError::Undumpable { pid: p, what: Undumpable::SeveralGpus { gpus: 2 }, .. }) => assert_eq!(p, pid),
            other => panic!("expected a refusal, got {other:?}"),
        }
        let e = refuse_several_gpus(&tree, &[(pid, 2)], &[]).unwrap_err();
        assert!(e.to_string().contains("2 GPUs without the agent") && e.hint().unwrap().contains("agent"), "{e}");
        assert!(refuse_several_gpus(&tree, &[(pid, 2)], &[pid]).is_ok(), "the agent's processes restore with peer access");
        assert!(refuse_several_gpus(&tree, &[], &[]).is_ok());
    }

    #[test]
    fn char_device_reads_the_device_number() {
        assert_eq!(char_device("/dev/null"), Some((1, 3)));
        assert_eq!(char_device("/etc/hostname"), None);
    }
}
