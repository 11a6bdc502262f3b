//! The engine's logic against a scripted driver: ordering, parallel lock, rollback.

use std::sync::Mutex;

use super::*;
use crate::coordinator::Local;
use crate::engine::CheckpointSession;

const H100: &str = "NVIDIA H100 80GB HBM3";
const UUID_A: &str = "GPU-11111111-2222-3333-4444-555555555555";
const UUID_B: &str = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";

fn gpu(index: u32, uuid: &str, name: &str, free_gib: u64) -> Gpu {
    Gpu { index, uuid: uuid.into(), name: name.into(), memory_total: 80 << 30, memory_free: free_gib << 30 }
}

/// A driver that keeps per-process states and a log of calls, failing where told.
struct FakeDriver {
    states: Mutex<BTreeMap<i32, ProcessState>>,
    log: Mutex<Vec<String>>,
    fail_lock: Option<i32>,
    fail_checkpoint: Option<i32>,
    gpus: Vec<(Gpu, Vec<(i32, u64)>)>,
    version: i32,
    restore_tid: Option<i32>,
    /// The restore answers CUDA_ERROR_INVALID_VALUE to fewer pairs than this.
    min_pairs: usize,
}

impl FakeDriver {
    fn new(pids: &[i32]) -> FakeDriver {
        FakeDriver {
            states: Mutex::new(pids.iter().map(|&p| (p, ProcessState::Running)).collect()),
            log: Mutex::new(Vec::new()),
            fail_lock: None,
            fail_checkpoint: None,
            gpus: vec![(gpu(0, UUID_A, H100, 70), pids.iter().map(|&p| (p, 1 << 30)).collect())],
            version: 13000,
            restore_tid: None,
            min_pairs: 0,
        }
    }
    fn state_of(&self, pid: i32) -> ProcessState {
        self.states.lock().unwrap()[&pid]
    }
    fn step(&self, pid: i32, call: &str, from: ProcessState, to: ProcessState) -> Result<(), CuError> {
        self.log.lock().unwrap().push(format!("{call} {pid}"));
        let mut s = self.states.lock().unwrap();
        let cur = s.get_mut(&pid).ok_or(CuError { code: 1, name: "CUDA_ERROR_INVALID_VALUE".into() })?;
        if *cur != from {
            return Err(CuError { code: 401, name: "CUDA_ERROR_ILLEGAL_STATE".into() });
        }
        *cur = to;
        Ok(())
    }
}

impl CheckpointApi for FakeDriver {
    fn driver_version(&self) -> i32 {
        self.version
    }
    fn state(&self, pid: i32) -> Result<ProcessState, CuError> {
        self.states.lock().unwrap().get(&pid).copied().ok_or(CuError { code: 1, name: "CUDA_ERROR_INVALID_VALUE".into() })
    }
    fn lock(&self, pid: i32, _timeout_ms: u32) -> Result<(), CuError> {
        if self.fail_lock == Some(pid) {
            return Err(CuError { code: 600, name: "CUDA_ERROR_NOT_READY".into() });
        }
        self.step(pid, "lock", ProcessState::Running, ProcessState::Locked)
    }
    fn checkpoint(&self, pid: i32) -> Result<(), CuError> {
        if self.fail_checkpoint == Some(pid) {
            return Err(CuError { code: 801, name: "CUDA_ERROR_NOT_SUPPORTED".into() });
        }
        self.step(pid, "checkpoint", ProcessState::Locked, ProcessState::Checkpointed)
    }
    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), CuError> {
        self.log.lock().unwrap().push(format!("pairs {}", pairs.len()));
        if pairs.len() < self.min_pairs {
            return Err(CuError { code: 1, name: "CUDA_ERROR_INVALID_VALUE".into() });
        }
        self.step(pid, "restore", ProcessState::Checkpointed, ProcessState::Locked)
    }
    fn unlock(&self, pid: i32) -> Result<(), CuError> {
        self.step(pid, "unlock", ProcessState::Locked, ProcessState::Running)
    }
    fn gpus(&self) -> Vec<(Gpu, Vec<(i32, u64)>)> {
        self.gpus.clone()
    }
    fn restore_thread(&self, _pid: i32) -> Result<Option<i32>, CuError> {
        Ok(self.restore_tid)
    }
    fn alive(&self, pid: i32) -> bool {
        self.states.lock().unwrap().contains_key(&pid)
    }
}

fn proc_info(pid: i32, ns_pid: i32, nvidia: bool) -> ProcessInfo {
    ProcessInfo {
        pid,
        ppid: 1,
        ns_pid,
        comm: format!("p{pid}"),
        cmdline: vec![],
        threads: 1,
        tty_nr: 0,
        start_time: 0,
        uid: 0,
        rss_bytes: 0,
        anon_bytes: 0,
        kernel_thread: false,
        fds: vec![],
        device_files: if nvidia { vec!["/dev/nvidia0".into(), "/dev/nvidiactl".into()] } else { vec!["/dev/dri/card0".into()] },
    }
}

fn engine(d: &Arc<FakeDriver>) -> DriverEngine {
    DriverEngine::with_api(d.clone() as Arc<dyn CheckpointApi>)
}

/// The driver engine writes no files: a sink that refuses any shows it.
struct NoFiles;

impl ImageSink for NoFiles {
    fn criu_dir(&self) -> std::path::PathBuf {
        "/nonexistent".into()
    }
    fn create_file(&self, rel: &str) -> std::io::Result<std::fs::File> {
        panic!("the driver engine wrote {rel}")
    }
    fn has_file(&self, _rel: &str) -> bool {
        false
    }
    fn location(&self) -> &Path {
        Path::new("/nonexistent")
    }
}

fn session(e: &DriverEngine, tree: &[ProcessInfo]) -> Box<dyn CheckpointSession> {
    e.begin_checkpoint(tree, CheckpointOptions::default()).unwrap().expect("the engine claims a process")
}

/// A section captured from one CUDA process (pid 10, namespace pid 1).
fn captured(e: &DriverEngine) -> serde_json::Value {
    let tree = [proc_info(10, 1, true)];
    let mut s = session(e, &tree);
    s.quiesce(&NoFiles, &Local::default()).unwrap();
    s.capture(&tree).unwrap()
}

#[test]
fn checkpoint_then_resume_round_trip() {
    let d = Arc::new(FakeDriver::new(&[10, 11]));
    let e = engine(&d);
    let tree = vec![proc_info(10, 1, true), proc_info(11, 2, true), proc_info(12, 3, false)];
    let mut s = session(&e, &tree);
    assert_eq!(s.pids(), &[10, 11], "only processes holding NVIDIA files are claimed");
    s.quiesce(&NoFiles, &Local::default()).unwrap();
    let v = s.capture(&tree).unwrap();
    assert_eq!(d.state_of(10), ProcessState::Checkpointed);
    let section: Section = serde_json::from_value(v.clone()).unwrap();
    assert_eq!(section.processes.len(), 2);
    assert_eq!(section.processes[1].ns_pid, 2);
    assert_eq!(section.processes[0].gpus, vec![UUID_A.to_string()]);
    assert_eq!(section.processes[0].memory_bytes, 1 << 30);
    s.resume(&NoFiles, &Local::default()).unwrap();
    assert_eq!(d.state_of(10), ProcessState::Running);
    assert_eq!(d.state_of(11), ProcessState::Running);
    // Restore maps namespace PIDs onto the new host PIDs.
    let d2 = Arc::new(FakeDriver::new(&[20, 21]));
    d2.states.lock().unwrap().values_mut().for_each(|s| *s = ProcessState::Checkpointed);
    let e2 = engine(&d2);
    let mut r = e2.begin_restore(&v, &DeviceRestoreOptions::default()).unwrap();
    r.restore(&[RestoredPid { ns_pid: 1, pid: 20 }, RestoredPid { ns_pid: 2, pid: 21 }], &Local::default()).unwrap();
    assert_eq!(d2.state_of(20), ProcessState::Running);
    assert_eq!(d2.state_of(21), ProcessState::Running);
}

#[test]
fn a_process_that_died_is_not_resumed() {
    let d = Arc::new(FakeDriver::new(&[10, 11]));
    let e = engine(&d);
    let mut s = session(&e, &[proc_info(10, 1, true), proc_info(11, 2, true)]);
    s.quiesce(&NoFiles, &Local::default()).unwrap();
    d.states.lock().unwrap().remove(&11);
    s.resume(&NoFiles, &Local::default()).unwrap();
    assert_eq!(d.state_of(10), ProcessState::Running);
}

#[test]
fn a_process_that_ends_mid_checkpoint_is_named_as_ended_not_as_a_driver_error() {
    let d = Arc::new(FakeDriver::new(&[10, 11]));
    let e = engine(&d);
    let mut s = session(&e, &[proc_info(10, 1, true), proc_info(11, 2, true)]);
    s.quiesce(&NoFiles, &Local::default()).unwrap();
    d.states.lock().unwrap().remove(&11);
    let err = s.capture(&[]).unwrap_err();
    assert!(err.to_string().contains("process 11 ended during the checkpoint"), "{err}");
    assert!(err.hint().unwrap().contains("no image is written"), "{err}");
    s.resume(&NoFiles, &Local::default()).unwrap();
    assert_eq!(d.state_of(10), ProcessState::Running, "the live process is given back");
}

#[test]
fn a_tree_without_cuda_opens_no_session() {
    let d = Arc::new(FakeDriver::new(&[10]));
    assert!(engine(&d).begin_checkpoint(&[proc_info(10, 1, false)], CheckpointOptions::default()).unwrap().is_none());
}

#[test]
fn failed_lock_is_rolled_back_by_resume() {
    let mut d = FakeDriver::new(&[10, 11]);
    d.fail_lock = Some(11);
    let d = Arc::new(d);
    let e = engine(&d);
    let mut s = session(&e, &[proc_info(10, 1, true), proc_info(11, 2, true)]);
    let err = s.quiesce(&NoFiles, &Local::default()).unwrap_err();
    assert!(err.to_string().contains("lock of process 11"), "{err}");
    assert_eq!(err.cuda_result(), Some(600), "the CUresult is kept, not only its text");
    assert!(err.hint().unwrap().contains("keeps running"));
    assert_eq!(d.state_of(10), ProcessState::Locked, "the other lock went through");
    s.resume(&NoFiles, &Local::default()).unwrap();
    assert_eq!(d.state_of(10), ProcessState::Running);
    assert_eq!(d.state_of(11), ProcessState::Running);
}

#[test]
fn failed_checkpoint_is_rolled_back_by_resume() {
    let mut d = FakeDriver::new(&[10, 11]);
    d.fail_checkpoint = Some(10);
    let d = Arc::new(d);
    let e = engine(&d);
    let mut s = session(&e, &[proc_info(10, 1, true), proc_info(11, 2, true)]);
    s.quiesce(&NoFiles, &Local::default()).unwrap();
    let err = s.capture(&[]).unwrap_err();
    assert!(err.hint().unwrap().contains("managed/UVM"), "{err}");
    assert!(std::error::Error::source(&err).is_some_and(|c| c.to_string().contains("CUDA_ERROR_NOT_SUPPORTED")), "the chain keeps the cause");
    s.resume(&NoFiles, &Local::default()).unwrap();
    assert_eq!(d.state_of(10), ProcessState::Running);
    assert_eq!(d.state_of(11), ProcessState::Running);
    let log = d.log.lock().unwrap().join(";");
    assert!(log.contains("restore 11") && log.contains("unlock 11") && log.contains("unlock 10"), "{log}");
}

#[test]
fn process_not_running_is_refused() {
    let d = Arc::new(FakeDriver::new(&[10]));
    d.states.lock().unwrap().insert(10, ProcessState::Locked);
    let err = engine(&d).begin_checkpoint(&[proc_info(10, 1, true)], CheckpointOptions::default()).err().expect("refused");
    assert!(err.to_string().contains("Locked"), "{err}");
}

#[test]
fn restore_checks_gpu_memory_before_committing() {
    let d = Arc::new(FakeDriver::new(&[10]));
    let e = engine(&d);
    let mut v = captured(&e);
    v["processes"][0]["memory_bytes"] = serde_json::json!(75u64 << 30);
    let err = e.begin_restore(&v, &DeviceRestoreOptions::default()).err().expect("refused");
    assert!(err.to_string().contains("MiB free"), "{err}");
}

#[test]
fn missing_gpu_names_it_and_suggests_a_map() {
    let d = Arc::new(FakeDriver::new(&[10]));
    let v = captured(&engine(&d));
    let mut other = FakeDriver::new(&[]);
    other.gpus = vec![(gpu(0, UUID_B, H100, 70), vec![])];
    let e2 = engine(&Arc::new(other));
    let err = e2.begin_restore(&v, &DeviceRestoreOptions::default()).err().expect("refused");
    assert!(err.to_string().contains(UUID_A), "{err}");
    assert!(err.hint().unwrap().contains("--gpu-map"));
    let opts = DeviceRestoreOptions { gpu_map: vec![(UUID_A.into(), "0".into())], ..Default::default() };
    e2.begin_restore(&v, &opts).unwrap();
    let (_, map) = e2.resolve(&DriverEngine::section(&v).unwrap(), &opts).unwrap();
    assert_eq!(e2.pairs(&map).unwrap().len(), 1);
}

#[test]
fn a_restore_onto_other_gpus_passes_the_whole_permutation() {
    let mut d = FakeDriver::new(&[10]);
    d.gpus.push((gpu(1, UUID_B, H100, 70), vec![]));
    // The driver refuses fewer pairs than GPUs (as driver 580 did the visible GPU's alone).
    d.min_pairs = 2;
    let d = Arc::new(d);
    let e = engine(&d);
    let mut v = captured(&e);
    // The process used GPU B (as one started with CUDA_VISIBLE_DEVICES=1 does).
    v["processes"][0]["gpus"] = serde_json::json!([UUID_B]);
    let opts = DeviceRestoreOptions { gpu_map: vec![("1".into(), "0".into())], ..Default::default() };
    let mut session = e.begin_restore(&v, &opts).unwrap();
    d.states.lock().unwrap().insert(10, ProcessState::Checkpointed);
    session.restore(&[RestoredPid { ns_pid: 1, pid: 10 }], &Local::default()).unwrap();
    assert_eq!(d.state_of(10), ProcessState::Running);
    assert!(d.log.lock().unwrap().contains(&"pairs 2".to_string()), "{:?}", d.log.lock().unwrap());
}

#[test]
fn remapping_needs_cuda_13() {
    let mut d = FakeDriver::new(&[10]);
    d.version = 12080;
    let d = Arc::new(d);
    let e = engine(&d);
    let v = captured(&e);
    let opts = DeviceRestoreOptions { gpu_map: vec![("0".into(), "0".into())], ..Default::default() };
    assert!(e.begin_restore(&v, &opts).err().expect("refused").to_string().contains("CUDA 13.0"));
}

#[test]
fn gpu_map_parsing_and_resolution() {
    assert_eq!(parse_gpu_map("0=1, GPU-x=GPU-y").unwrap(), vec![("0".into(), "1".into()), ("GPU-x".into(), "GPU-y".into())]);
    assert!(parse_gpu_map("0").is_err());
    assert!(parse_gpu_map("=1").is_err());
    let recorded = vec![gpu(0, UUID_A, H100, 0), gpu(1, UUID_B, H100, 0)];
    let here = vec![gpu(0, UUID_B, H100, 70), gpu(1, UUID_A, H100, 70), gpu(2, "GPU-99999999-9999-9999-9999-999999999999", "NVIDIA H200", 100)];
    // A lands where B is; B, left out, takes the GPU nothing else went to (A's): a swap.
    let m = resolve_gpu_map(&[("0".into(), "0".into())], &recorded, &here, &[UUID_A]).unwrap();
    assert_eq!((m[UUID_A].as_str(), m[UUID_B].as_str()), (UUID_B, UUID_A));
    // Two GPUs onto one is refused.
    let m = resolve_gpu_map(&[("0".into(), "0".into()), ("1".into(), "0".into())], &recorded, &here, &[UUID_A]).unwrap_err();
    assert!(matches!(m, GpuMapError::Collision { .. }), "{m:?}");
    let m = resolve_gpu_map(&[("0".into(), "0".into()), ("1".into(), "1".into())], &recorded, &here, &[UUID_A, UUID_B]).unwrap();
    assert_eq!(m[UUID_A], UUID_B);
    assert_eq!(m[UUID_B], UUID_A);
    assert!(matches!(resolve_gpu_map(&[("0".into(), "2".into())], &recorded, &here, &[UUID_A]), Err(GpuMapError::ChipMismatch { .. })));
    assert!(matches!(resolve_gpu_map(&[("7".into(), "0".into())], &recorded, &here, &[UUID_A]), Err(GpuMapError::UnknownOld(_))));
    assert!(matches!(resolve_gpu_map(&[("0".into(), "9".into())], &recorded, &here, &[UUID_A]), Err(GpuMapError::UnknownNew(_))));
    assert!(resolve_gpu_map(&[], &recorded, &here, &[UUID_A]).unwrap().is_empty());
}

/// The driver takes a bijection over every GPU the process could see: `--gpu-map 0=1` on a
/// two-GPU machine becomes the swap, a four-GPU machine keeps the other two where they are.
#[test]
fn a_partial_map_is_completed_into_a_bijection() {
    let uuids: Vec<String> = (0..4).map(|i| format!("GPU-{i}{i}{i}{i}{i}{i}{i}{i}-2222-3333-4444-555555555555")).collect();
    let four: Vec<Gpu> = uuids.iter().enumerate().map(|(i, u)| gpu(i as u32, u, H100, 70)).collect();
    let m = resolve_gpu_map(&[("0".into(), "1".into())], &four[..2], &four[..2], &[&uuids[0]]).unwrap();
    assert_eq!(m.len(), 2);
    assert_eq!((m[&uuids[0]].as_str(), m[&uuids[1]].as_str()), (uuids[1].as_str(), uuids[0].as_str()));
    let m = resolve_gpu_map(&[("0".into(), "1".into())], &four, &four, &[&uuids[0]]).unwrap();
    let want: BTreeMap<String, String> = [(0, 1), (1, 0), (2, 2), (3, 3)].iter().map(|&(a, b): &(usize, usize)| (uuids[a].clone(), uuids[b].clone())).collect();
    assert_eq!(m, want);
    // A swap given whole stays as it is.
    let m = resolve_gpu_map(&[("0".into(), "1".into()), ("1".into(), "0".into())], &four[..2], &four[..2], &[&uuids[0], &uuids[1]]).unwrap();
    assert_eq!((m[&uuids[0]].as_str(), m[&uuids[1]].as_str()), (uuids[1].as_str(), uuids[0].as_str()));
    // Onto another machine: the GPUs left out take the free ones of their type.
    let other: Vec<Gpu> = (0..2).map(|i| gpu(i, &format!("GPU-{i}{i}{i}{i}{i}{i}{i}{i}-9999-3333-4444-555555555555"), H100, 70)).collect();
    let m = resolve_gpu_map(&[("1".into(), "0".into())], &four[..2], &other, &[&uuids[1]]).unwrap();
    assert_eq!((m[&uuids[1]].as_str(), m[&uuids[0]].as_str()), (other[0].uuid.as_str(), other[1].uuid.as_str()));
    // A used GPU finds a place before unused ones do: three GPUs onto two, the third used.
    let m = resolve_gpu_map(&[("0".into(), "0".into())], &four[..3], &other, &[&uuids[2]]).unwrap();
    assert_eq!((m[&uuids[0]].as_str(), m[&uuids[2]].as_str()), (other[0].uuid.as_str(), other[1].uuid.as_str()));
    assert!(!m.contains_key(&uuids[1]), "the unused one is left out");
    // A job that used two GPUs, onto a machine with one: refused, saying so.
    let e = resolve_gpu_map(&[], &four[..2], &other[..1], &[&uuids[0], &uuids[1]]).unwrap_err();
    assert!(matches!(e, GpuMapError::TooFew { used: 2, here: 1, .. }), "{e:?}");
    assert!(e.to_string().contains("used 2 GPUs") && e.hint().unwrap().contains("as many GPUs"), "{e}");
    // One GPU of another type: still a question of which GPU, not how many.
    let h200 = vec![gpu(0, "GPU-99999999-9999-9999-9999-999999999999", "NVIDIA H200", 100)];
    assert!(matches!(resolve_gpu_map(&[], &four[..1], &h200, &[&uuids[0]]), Err(GpuMapError::Missing { .. })));
}

#[test]
fn uuid_parsing() {
    let u = gpumap::uuid_bytes(UUID_A).unwrap();
    assert_eq!(u.bytes[0], 0x11);
    assert_eq!(u.bytes[15], 0x55);
    assert!(gpumap::uuid_bytes("GPU-123").is_err());
    assert!(gpumap::uuid_bytes("GPU-zz111111-2222-3333-4444-555555555555").is_err());
    assert!(gpumap::uuid_bytes("GPU-ééééééééééééééé11111111111111").is_err(), "multi-byte characters, no panic");
}

#[test]
fn visible_gpus_follow_cuda_visible_devices() {
    let two = vec![gpu(0, UUID_A, H100, 70), gpu(1, UUID_B, H100, 70)];
    assert_eq!(visible_gpus(None, &two), vec![UUID_A, UUID_B], "unset: all of them");
    assert_eq!(visible_gpus(Some("1"), &two), vec![UUID_B]);
    assert_eq!(visible_gpus(Some("1,0"), &two), vec![UUID_B, UUID_A]);
    assert_eq!(visible_gpus(Some("GPU-aaaa"), &two), vec![UUID_B], "a unique UUID prefix");
    assert_eq!(visible_gpus(Some("0,7,1"), &two), vec![UUID_A], "the list ends at an entry that names no GPU");
    assert!(visible_gpus(Some(""), &two).is_empty());
    assert!(visible_gpus(Some("GPU-"), &two).is_empty(), "an ambiguous prefix names none");
}

/// A real process, stopped by SIGSTOP as CRIU leaves a restored one: (child, pid).
fn stopped_child() -> (std::process::Child, i32) {
    let child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
    let pid = child.id() as i32;
    crate::sys::kill(pid, libc::SIGSTOP).unwrap();
    let start = std::time::Instant::now();
    while !crate::proctree::is_stopped(pid) {
        assert!(start.elapsed().as_secs() < 10, "the child stops");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    (child, pid)
}

/// A restored process CRIU left stopped, for which the driver names no restore thread (an
/// older driver): it is continued and restored running, as before the stopped-tree restore.
#[test]
fn a_stopped_process_without_a_restore_thread_is_continued_then_restored() {
    let (mut child, pid) = stopped_child();
    let d = Arc::new(FakeDriver::new(&[pid]));
    d.states.lock().unwrap().insert(pid, ProcessState::Checkpointed);
    let e = engine(&d);
    e.resume_restored(pid, &[]).unwrap();
    assert_eq!(d.states.lock().unwrap()[&pid], ProcessState::Running);
    assert!(!crate::proctree::is_stopped(pid), "continued");
    let log = d.log.lock().unwrap().join(" ");
    assert!(log.contains("restore") && log.contains("unlock"), "{log}");
    let _ = child.kill();
    let _ = child.wait();
}

/// A restored process CRIU left stopped: the driver's restore thread runs alone for the
/// restore and unlock, and the process is left stopped for the tree to be continued whole.
#[test]
fn a_stopped_process_is_restored_with_its_restore_thread_alone() {
    let (mut child, pid) = stopped_child();
    let mut d = FakeDriver::new(&[pid]);
    d.restore_tid = Some(pid);
    let d = Arc::new(d);
    d.states.lock().unwrap().insert(pid, ProcessState::Checkpointed);
    let restored = engine(&d).resume_restored(pid, &[]);
    // Detached, the thread goes back into its process's stop (the kernel moves it there
    // before it returns to user code).
    let start = std::time::Instant::now();
    while !crate::proctree::is_stopped(pid) && start.elapsed().as_secs() < 5 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let stopped = crate::proctree::is_stopped(pid);
    let _ = child.kill();
    let _ = child.wait();
    restored.unwrap();
    assert_eq!(d.states.lock().unwrap()[&pid], ProcessState::Running);
    assert!(stopped, "still stopped, for the tree to be continued");
}

#[test]
fn processes_on_several_gpus_are_named_with_their_count() {
    // Process 10 has contexts on both GPUs, 11 on one; 12 is not claimed (no device files).
    let mut d = FakeDriver::new(&[10, 11]);
    d.gpus =
        vec![(gpu(0, UUID_A, H100, 70), vec![(10, 1 << 30), (11, 1 << 30), (12, 1 << 30)]), (gpu(1, UUID_B, H100, 70), vec![(10, 1 << 30), (12, 1 << 30)])];
    let d = Arc::new(d);
    let s = session(&engine(&d), &[proc_info(10, 1, true), proc_info(11, 2, true), proc_info(12, 3, false)]);
    assert_eq!(s.on_several_gpus(), vec![(10, 2)]);
    assert!(!s.restores_peer_access(), "the driver alone does not restore peer access");
}

/// With a CRIU that holds the tree for it, a process whose restore thread the driver names
/// is only locked at capture, checkpointed inside the freeze (the restore thread named to
/// CRIU), and its state given back inside it; the resume after CRIU unlocks it.
#[test]
fn with_criu_holding_the_tree_the_checkpoint_happens_inside_the_freeze() {
    let mut d = FakeDriver::new(&[10, 11]);
    d.restore_tid = Some(77);
    let d = Arc::new(d);
    let e = engine(&d);
    let tree = [proc_info(10, 1, true), proc_info(11, 2, true)];
    let mut s = e.begin_checkpoint(&tree, CheckpointOptions { leave_running: true, in_freeze: true }).unwrap().unwrap();
    s.quiesce(&NoFiles, &Local::default()).unwrap();
    s.capture(&tree).unwrap();
    assert_eq!(d.state_of(10), ProcessState::Locked, "not checkpointed before CRIU holds the tree");
    assert_eq!(s.frozen_threads(), vec![77, 77]);
    let section: Section = serde_json::from_value(s.checkpoint_frozen().unwrap().expect("the section, with the freeze's time")).unwrap();
    assert_eq!(section.processes.len(), 2);
    assert_eq!((d.state_of(10), d.state_of(11)), (ProcessState::Checkpointed, ProcessState::Checkpointed));
    s.resume_frozen().unwrap();
    assert_eq!((d.state_of(10), d.state_of(11)), (ProcessState::Locked, ProcessState::Locked), "back, still locked");
    // A dump made again (CRIU's staging area was too small) checkpoints them again.
    s.checkpoint_frozen().unwrap();
    s.resume_frozen().unwrap();
    s.resume(&NoFiles, &Local::default()).unwrap();
    assert_eq!((d.state_of(10), d.state_of(11)), (ProcessState::Running, ProcessState::Running));
}

/// A checkpoint inside the freeze that fails for one process is given back whole: CRIU
/// then sends "resume-devices", which restores what was checkpointed; the undo unlocks.
#[test]
fn a_failed_checkpoint_inside_the_freeze_is_given_back() {
    let mut d = FakeDriver::new(&[10, 11]);
    d.restore_tid = Some(77);
    d.fail_checkpoint = Some(11);
    let d = Arc::new(d);
    let e = engine(&d);
    let tree = [proc_info(10, 1, true), proc_info(11, 2, true)];
    let mut s = e.begin_checkpoint(&tree, CheckpointOptions { leave_running: false, in_freeze: true }).unwrap().unwrap();
    s.quiesce(&NoFiles, &Local::default()).unwrap();
    s.capture(&tree).unwrap();
    let err = s.checkpoint_frozen().unwrap_err();
    assert!(err.to_string().contains("checkpoint of process 11"), "{err}");
    s.resume_frozen().unwrap();
    assert_eq!((d.state_of(10), d.state_of(11)), (ProcessState::Locked, ProcessState::Locked));
    s.resume(&NoFiles, &Local::default()).unwrap();
    assert_eq!((d.state_of(10), d.state_of(11)), (ProcessState::Running, ProcessState::Running));
}

/// With a CRIU that does not hold the tree for it, or a driver that names no restore
/// thread, the process is checkpointed at capture, as before.
#[test]
fn without_the_freeze_or_a_restore_thread_capture_checkpoints() {
    for (in_freeze, tid) in [(false, Some(77)), (true, None)] {
        let mut d = FakeDriver::new(&[10]);
        d.restore_tid = tid;
        let d = Arc::new(d);
        let tree = [proc_info(10, 1, true)];
        let mut s = engine(&d).begin_checkpoint(&tree, CheckpointOptions { leave_running: false, in_freeze }).unwrap().unwrap();
        s.quiesce(&NoFiles, &Local::default()).unwrap();
        s.capture(&tree).unwrap();
        assert_eq!(d.state_of(10), ProcessState::Checkpointed, "in_freeze {in_freeze}, restore thread {tid:?}");
        assert!(s.frozen_threads().is_empty());
        assert!(s.checkpoint_frozen().unwrap().is_none());
    }
}
