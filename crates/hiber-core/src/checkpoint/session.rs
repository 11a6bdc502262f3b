//! One checkpoint, phase by phase. See the module above for the order and what each
//! phase may touch.

use std::time::{Duration, Instant};

use super::{check_space, log_file_id, loopback_only_network, preflight, CheckpointError, CheckpointReport, CheckpointRequest};
use crate::coordinator::{Coordinator, Phase, Tracked};
use crate::criu::DumpOptions;
use crate::engine::{CheckpointOptions, CheckpointSession, EngineError, EngineKind};
use crate::image::{DeviceSection, FileEntry, ImageError, ImageSink, ImageWriter, Manifest, Source, FORMAT, MAGIC};
use crate::journal::{self, Claim, Entry, Journal};
use crate::proctree::{self, ProcessInfo};
use crate::{sys, Context};

/// An engine's session, with the kind that opened it.
type Engaged = (&'static dyn EngineKind, Box<dyn CheckpointSession>);

/// A checkpoint under way. Made by [`Checkpoint::prepare`]; each phase is a method, and
/// after a failed one [`Checkpoint::abort`] undoes what the others did.
pub struct Checkpoint<'a> {
    ctx: &'a Context,
    req: &'a CheckpointRequest,
    tree: Vec<ProcessInfo>,
    sink: ImageWriter,
    /// `None` once finished: removed on success or after a clean undo, kept on disk (for
    /// `hiber recover`) when the undo itself failed.
    journal: Option<Journal>,
    sessions: Vec<Engaged>,
    sections: Vec<DeviceSection>,
    /// With `--leave-running`: the manifest, waiting for the commit after resume.
    manifest: Option<Manifest>,
    started: Instant,
    devices: Duration,
    dump_start: Option<Instant>,
    /// When the first process was touched (quiesce), and how long until all ran again.
    quiesce_start: Option<Instant>,
    paused: Option<Duration>,
    criu: Option<crate::criu::DumpStats>,
    /// Where the pause went, step by step ("agent quiesce", "criu dump", ...).
    steps: Vec<(String, Duration)>,
    /// With `--leave-running`: CRIU's files in memory, waiting for the commit.
    stage: Option<super::stage::Stage>,
    criu_staged: bool,
}

impl<'a> Checkpoint<'a> {
    /// Finds the tree and refuses what cannot be checkpointed, opens the image and the
    /// journal, and lets each engine claim its processes. Nothing of the application is
    /// touched; an error here leaves nothing behind.
    pub fn prepare(ctx: &'a Context, req: &'a CheckpointRequest) -> Result<Checkpoint<'a>, CheckpointError> {
        let started = Instant::now();
        let tree = preflight(req.pid)?;
        check_space(&req.dest, &tree)?;
        super::preflight::refuse_missing_tools(&ctx.criu, req.pid)?;
        let mut sink = ImageWriter::create(&req.dest)?;
        if let Some(level) = req.compress {
            sink.compress(level);
        }
        if req.transient {
            sink.transient();
        }
        if let Some(parent) = &req.parent {
            sink.share_with(parent).map_err(|source| CheckpointError::Parent { path: parent.clone(), source })?;
        }
        let me = proctree::stat(sys::getpid())?;
        let entry = Entry {
            hiber_pid: sys::getpid(),
            hiber_start_time: me.start_time,
            root_pid: req.pid,
            tmp_dir: sink.location().to_path_buf(),
            dest: req.dest.clone(),
            leave_running: req.leave_running,
            claims: Vec::new(),
            phase: journal::Phase::Started,
            coordinated: false,
            cut_passed: false,
        };
        let mut journal = Journal::begin(&ctx.state, entry).map_err(CheckpointError::Journal)?;
        // The driver's checkpoint inside CRIU's freeze, wherever hiber's CRIU can hold it
        // there (`HIBER_DEVICE_IN_FREEZE=0` takes the checkpoint before the dump instead).
        let in_freeze = ctx.criu_version.device_notify() && std::env::var_os("HIBER_DEVICE_IN_FREEZE").is_none_or(|v| v != "0");
        let opts = CheckpointOptions { leave_running: req.leave_running, in_freeze };
        let mut sessions: Vec<Engaged> = Vec::new();
        for engine in &ctx.engines {
            match engine.begin_checkpoint(&tree, opts) {
                Ok(Some(s)) => sessions.push((engine.kind(), s)),
                Ok(None) => {}
                Err(e) => {
                    journal.finish();
                    return Err(e.into());
                }
            }
        }
        // NCCL state in a process no session cuts and rebuilds (a job without the agent).
        let cut: Vec<i32> = sessions.iter().flat_map(|(_, s)| s.collectives()).collect();
        if let Err(e) = super::preflight::refuse_collectives(&tree, &cut) {
            journal.finish();
            return Err(e);
        }
        // Processes on several GPUs that only the driver would restore.
        let served: Vec<i32> = sessions.iter().filter(|(_, s)| s.restores_peer_access()).flat_map(|(_, s)| s.pids().to_vec()).collect();
        let several: Vec<(i32, usize)> = sessions.iter().flat_map(|(_, s)| s.on_several_gpus()).collect();
        if let Err(e) = super::preflight::refuse_several_gpus(&tree, &several, &served) {
            journal.finish();
            return Err(e);
        }
        // What CRIU would refuse mid-dump, after the engines touched the GPU processes. A
        // process counts as claimed where an engine takes its device files away (the
        // driver's); a layer's engine (the agent's, OpenCL's) does not.
        let claimed: Vec<i32> = sessions.iter().filter(|(_, s)| s.releases_device_files()).flat_map(|(_, s)| s.pids().to_vec()).collect();
        if let Err(e) = super::preflight::refuse_undumpable(&tree, &claimed) {
            journal.finish();
            return Err(e);
        }
        let claims = sessions.iter().map(|(k, s)| Claim { engine: k.name().into(), pids: s.pids().to_vec() }).collect();
        if let Err(e) = journal.update(|e| e.claims = claims) {
            journal.finish();
            return Err(CheckpointError::Journal(e));
        }
        Ok(Checkpoint {
            ctx,
            req,
            tree,
            sink,
            journal: Some(journal),
            sessions,
            sections: Vec::new(),
            manifest: None,
            started,
            devices: Duration::ZERO,
            dump_start: None,
            quiesce_start: None,
            paused: None,
            criu: None,
            steps: Vec::new(),
            stage: None,
            criu_staged: false,
        })
    }

    fn advance(&mut self, phase: journal::Phase) -> Result<(), CheckpointError> {
        match &mut self.journal {
            Some(j) => j.update(|e| e.phase = phase).map_err(CheckpointError::Journal),
            None => Ok(()),
        }
    }

    /// Stops device work in every claimed process, engine after engine. With other
    /// participants (`coord`), work that spans them (NCCL) is cut with theirs; a participant
    /// without such work passes the cut's phases with nothing to say.
    pub fn quiesce(&mut self, coord: &Tracked<'_>) -> Result<(), CheckpointError> {
        let start = Instant::now();
        if !self.sessions.is_empty() {
            self.ctx.phase("preparing");
        }
        for (_, s) in &mut self.sessions {
            s.prepare(&self.sink);
        }
        // The pause is counted from here: what `prepare` did, the application ran through.
        self.quiesce_start = Some(Instant::now());
        if !self.sessions.is_empty() {
            self.ctx.phase("quiescing GPU processes");
        }
        // Without NCCL ranks of its own, it passes the cut's phases first: the other
        // participants' ranks are held until it has. (A session with ranks passes them in
        // its quiesce, or fails it.)
        if self.sessions.iter().all(|(_, s)| s.collectives().is_empty()) {
            coord.catch_up(&Phase::NCCL_CUT)?;
        }
        for (kind, s) in &mut self.sessions {
            let t = Instant::now();
            let r = s.quiesce(&self.sink, coord);
            self.steps.push((format!("{} quiesce", kind.name()), t.elapsed()));
            r?;
        }
        self.devices += start.elapsed();
        self.advance(journal::Phase::DevicesQuiesced)
    }

    /// Moves device state where the dump takes it, and collects the engines' sections.
    pub fn capture(&mut self) -> Result<(), CheckpointError> {
        let start = Instant::now();
        if !self.sessions.is_empty() {
            self.ctx.phase("checkpointing GPU state");
        }
        for (kind, s) in &mut self.sessions {
            let t = Instant::now();
            let state = s.capture(&self.tree);
            self.steps.push((format!("{} capture", kind.name()), t.elapsed()));
            let state = state?;
            self.sections.push(DeviceSection { engine: kind.name().into(), version: kind.section_version(), state });
        }
        self.devices += start.elapsed();
        self.advance(journal::Phase::Captured)
    }

    fn manifest(&self) -> Manifest {
        let (kernel, host) = sys::uname();
        let root = &self.tree[0];
        let std_path = |fd: i32| root.fds.iter().find(|f| f.fd == fd && f.is_regular_file()).map(|f| f.target.clone());
        Manifest {
            magic: MAGIC.into(),
            format: FORMAT,
            created: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
            host,
            kernel,
            criu_version: self.ctx.criu_version.to_string(),
            hiber_version: env!("CARGO_PKG_VERSION").into(),
            source: Source {
                job: self.req.job.as_ref().map(|j| j.name.clone()),
                pid: self.req.pid,
                leave_running: self.req.leave_running,
                pid_namespace: root.ns_pid == 1 && root.pid != 1,
                mount_namespace: proctree::has_own_namespace(self.req.pid, "mnt"),
                stdout: std_path(1),
                stderr: std_path(2),
                stdout_external: std_path(1).and(log_file_id(root.pid, 1)),
                stderr_external: std_path(2).and(log_file_id(root.pid, 2)),
                cuda_namespaces: cuda_namespaces(&self.tree),
            },
            processes: self.tree.clone(),
            devices: self.sections.clone(),
            frozen_seconds: 0.0,
            parent: None,
            files: Vec::new(),
        }
    }

    /// Has CRIU dump the tree. When the checkpoint stops the application, the image is
    /// committed inside CRIU's post-dump notification, while the tree is still frozen
    /// (after `coord`'s `Dumped` barrier): if that fails, CRIU resumes the tree rather than
    /// stop it. With `--leave-running` the commit waits for [`Checkpoint::commit`].
    pub fn dump(&mut self, coord: &dyn Coordinator) -> Result<(), CheckpointError> {
        self.advance(journal::Phase::Dumping)?;
        let work = self.ctx.criu_work_dir("dump").map_err(CheckpointError::Journal)?;
        let mut manifest = self.manifest();
        let dump_start = Instant::now();
        self.dump_start = Some(dump_start);
        // With --leave-running, CRIU writes into memory while the application waits, and
        // its files go into the image after the application runs again.
        let pids: Vec<i32> = self.tree.iter().map(|p| p.pid).collect();
        let mut stage = if self.req.leave_running { super::stage::Stage::open(&self.ctx.state, self.req.pid, &pids) } else { None };
        let external_files: Vec<_> = [&manifest.source.stdout_external, &manifest.source.stderr_external].into_iter().flatten().cloned().collect();
        let (external_mounts, skip_network_lock) = (manifest.source.mount_namespace, loopback_only_network(&self.tree));
        // Every process whose device state an engine took must still be there once CRIU has
        // the tree: one that ended since (a rank killed mid-checkpoint) would leave device
        // state in the image with no process to go back into.
        let claimed: Vec<(i32, u64, String)> = self
            .sessions
            .iter()
            .flat_map(|(_, s)| s.stateful())
            .filter_map(|pid| self.tree.iter().find(|p| p.pid == pid))
            .map(|p| (p.pid, p.start_time, p.comm.clone()))
            .collect();
        let (ctx, leave_running, dest) = (self.ctx, self.req.leave_running, &self.req.dest);
        let root = (self.req.pid, self.tree[0].start_time);
        // Threads that run alone while device state is taken inside CRIU's freeze.
        let device_threads: Vec<i32> = self.sessions.iter().flat_map(|(_, s)| s.frozen_threads()).collect();
        let (sink, journal, sessions) = (&mut self.sink, &mut self.journal, &mut self.sessions);
        let mut commit_error: Option<CheckpointError> = None;
        ctx.phase("dumping process state (CRIU)");
        let dumped = loop {
            let criu_dir = stage.as_ref().map_or_else(|| sink.criu_dir(), |s| s.dir().to_path_buf());
            let opts = DumpOptions {
                pid: root.0,
                images_dir: &criu_dir,
                work_dir: &work,
                leave_running,
                external_mounts,
                external_files: external_files.clone(),
                skip_network_lock,
                device_threads: device_threads.clone(),
            };
            let dumped = ctx.criu.dump(&opts, &mut |script| {
                match script {
                    "checkpoint-devices" => return checkpoint_frozen(sessions, &mut manifest),
                    "resume-devices" => return resume_frozen(sessions),
                    "post-dump" => {}
                    _ => return Ok(()),
                }
                // Refusing the notification fails the dump, and CRIU resumes the tree.
                let still_there = |&&(pid, start, _): &&(i32, u64, String)| proctree::stat(pid).is_ok_and(|s| s.start_time == start) && proctree::alive(pid);
                if let Some((pid, _, comm)) = claimed.iter().find(|c| !still_there(c)) {
                    let e = CheckpointError::Exited { pid: *pid, comm: comm.clone() };
                    let msg = e.to_string();
                    commit_error = Some(e);
                    return Err(msg);
                }
                if leave_running {
                    return Ok(());
                }
                ctx.phase("finishing the image (checksums, fsync) while the tree is frozen");
                manifest.frozen_seconds = dump_start.elapsed().as_secs_f64();
                let committed = coord.barrier(Phase::Dumped).map_err(CheckpointError::from).and_then(|()| commit(sink, journal, sessions, manifest.clone()));
                // Every participant committed, or none keeps its image: refusing the notification
                // makes CRIU resume the tree instead of stopping it.
                let committed = committed.and_then(|()| {
                    coord.barrier(Phase::Committed).map_err(|e| {
                        let _ = std::fs::remove_dir_all(dest);
                        CheckpointError::from(e)
                    })
                });
                if committed.is_ok() {
                    if let Some(j) = journal {
                        let _ = j.update(|e| e.cut_passed = true);
                    }
                }
                committed.map_err(|e| {
                    let msg = e.to_string();
                    commit_error = Some(e);
                    msg
                })
            });
            // A staging area too small after all (memory CRIU found beyond the estimate): CRIU
            // resumed the tree, and the dump is made again into the image's directory.
            match (&dumped, &stage) {
                (Err(e), Some(s)) if commit_error.is_none() && s.filled(&work.join("dump.log")) => {
                    tracing::warn!(error = %e, "CRIU filled its staging area; dumping again into the image directory");
                    stage = None;
                }
                _ => break dumped,
            }
        };
        self.criu_staged = stage.is_some();
        self.steps.push(("criu dump".into(), dump_start.elapsed()));
        if let Some(e) = commit_error {
            return Err(e);
        }
        if let Err(e) = dumped {
            if self.sink.is_committed() {
                if !proctree::is_same_process(root.0, root.1) {
                    // CRIU reported an error after it had the finished image and stopped the
                    // tree (a lost connection at the very end, say): the checkpoint happened.
                    tracing::warn!(error = %e, "CRIU reported an error after the image was complete and the tree had stopped");
                    let _ = std::fs::remove_dir_all(&work);
                    return Ok(());
                }
                // The tree runs on, so an image in place would be a checkpoint that did not
                // happen.
                let _ = std::fs::remove_dir_all(&self.req.dest);
            }
            return Err(e.into());
        }
        self.criu = crate::criu::read_dump_stats(&work);
        if let Some(st) = &self.criu {
            tracing::info!(
                frozen_s = st.frozen.as_secs_f64(),
                memdump_s = st.memdump.as_secs_f64(),
                memwrite_s = st.memwrite.as_secs_f64(),
                written_mib = st.bytes_written >> 20,
                "CRIU dump"
            );
        }
        // `HIBER_KEEP_CRIU_LOG=1` keeps CRIU's log of a dump that passed (under
        // `$HIBER_STATE/logs`), for a look at where its time went.
        if std::env::var_os("HIBER_KEEP_CRIU_LOG").is_none_or(|v| v != "1") {
            let _ = std::fs::remove_dir_all(&work);
        }
        if leave_running {
            manifest.frozen_seconds = dump_start.elapsed().as_secs_f64();
            self.manifest = Some(manifest);
            self.stage = stage;
            coord.barrier(Phase::Dumped)?;
        }
        Ok(())
    }

    /// With `--leave-running`, once the application runs again: the engines write what
    /// they still hold, and the image is committed. A failure costs the image only.
    pub fn commit(&mut self) -> Result<(), CheckpointError> {
        let Some(manifest) = self.manifest.take() else { return Ok(()) };
        self.ctx.phase("finishing the image (device memory, checksums, fsync)");
        if let Some(stage) = self.stage.take() {
            let (t, dest) = (Instant::now(), self.sink.criu_dir());
            let bytes =
                stage.move_into(&dest).map_err(|source| ImageError::Io { path: dest.clone(), step: "copy CRIU's files from its staging area", source })?;
            tracing::info!(mib = bytes >> 20, seconds = t.elapsed().as_secs_f64(), "CRIU's files copied into the image");
        }
        commit(&mut self.sink, &mut self.journal, &mut self.sessions, manifest)
    }

    /// Brings every engine's processes back to running, in reverse order. If any cannot
    /// be, the journal and the partial image stay for `hiber recover`. Where the NCCL cut
    /// tore communicators down (on any participant), the rebuild's phases are passed here
    /// too, with nothing to say when no rank of this participant was torn down.
    pub fn resume(&mut self, coord: &Tracked<'_>) -> Result<(), CheckpointError> {
        self.resume_all(coord, false)
    }

    /// [`resume`](Self::resume); in an `undo`, processes that ended while the job was held
    /// leave nothing to retry (the others got back all they can), so that is said, not
    /// failed on.
    fn resume_all(&mut self, coord: &Tracked<'_>, undo: bool) -> Result<(), CheckpointError> {
        if !self.sessions.is_empty() {
            self.ctx.phase("resuming GPU processes");
        }
        let mut failed = None;
        for (kind, s) in self.sessions.iter_mut().rev() {
            let t = Instant::now();
            let r = s.resume(&self.sink, coord);
            self.steps.push((format!("{} resume", kind.name()), t.elapsed()));
            match r {
                Ok(()) => {}
                Err(e @ EngineError::ProcessesGone { .. }) if undo => {
                    tracing::warn!(engine = kind.name(), error = %e, "processes of the job ended while it was held");
                }
                Err(e) => {
                    tracing::error!(engine = kind.name(), error = %e, "could not resume device state");
                    failed.get_or_insert(e);
                }
            }
        }
        if coord.passed(Phase::NcclDrained) {
            // This participant's own processes run: the others' rebuild is theirs to report.
            if let Err(e) = coord.catch_up(&Phase::NCCL_REBUILD) {
                tracing::warn!(error = %e, "the other participants' NCCL rebuild");
            }
        }
        match failed {
            None => {
                self.paused = self.quiesce_start.map(|t| t.elapsed());
                if let Some(p) = self.paused {
                    let mut steps: Vec<String> = self.steps.iter().map(|(n, d)| format!("{n} {:.3}s", d.as_secs_f64())).collect();
                    let between = p.saturating_sub(self.steps.iter().map(|(_, d)| *d).sum());
                    steps.push(format!("between the steps {:.3}s", between.as_secs_f64()));
                    tracing::info!(paused_s = p.as_secs_f64(), steps = %steps.join(", "), "where the pause went");
                }
                Ok(())
            }
            Some(e) => {
                // Device memory an engine could not hand back may be in the partial image.
                self.sink.keep_partial();
                self.journal = None;
                Err(CheckpointError::Resume { source: e, after: None })
            }
        }
    }

    /// After a failed phase: undoes what the others did. The application runs as before,
    /// and the partial image and the journal go, unless the undo itself failed.
    pub fn abort(mut self, cause: &CheckpointError, coord: &Tracked<'_>) -> Result<(), CheckpointError> {
        if let Err(e) = self.resume_all(coord, true) {
            tracing::error!(%cause, "the checkpoint failed, and so did its undo");
            return Err(match e {
                CheckpointError::Resume { source, .. } => CheckpointError::Resume { source, after: Some(cause.to_string()) },
                other => other,
            });
        }
        self.close();
        Ok(())
    }

    /// Ends a checkpoint whose application runs (again) and has nothing left to undo,
    /// successful or not: the journal entry goes.
    /// Marks the journal entry as part of a cut of several hibers: `hiber recover` keeps
    /// its image only once the cut passed.
    pub fn coordinated(&mut self) -> Result<(), CheckpointError> {
        match &mut self.journal {
            Some(j) => j.update(|e| e.coordinated = true).map_err(CheckpointError::Journal),
            None => Ok(()),
        }
    }

    pub fn close(&mut self) {
        if let Some(j) = self.journal.take() {
            j.finish();
        }
    }

    /// Ends a successful checkpoint: the journal goes, and the report says what was done.
    pub fn finish(mut self) -> CheckpointReport {
        self.close();
        let image_bytes = crate::image::Image::open(&self.req.dest).map(|i| i.total_bytes()).unwrap_or(0);
        CheckpointReport {
            image: self.req.dest.clone(),
            processes: self.tree.len(),
            devices: self.devices,
            dump: self.dump_start.map(|d| d.elapsed()).unwrap_or_default(),
            total: self.started.elapsed(),
            image_bytes,
            shared_bytes: self.sink.shared().1,
            paused: self.paused,
            criu: self.criu,
            steps: self.steps,
            criu_staged: self.criu_staged,
        }
    }
}

/// CRIU's "checkpoint-devices": the engines take the device state that must not be away
/// while the process runs, the tree held (their sections in the manifest updated). An
/// error refuses the notification, and CRIU fails the dump and gives the state back.
/// (Their time is part of CRIU's dump in the pause's steps.)
fn checkpoint_frozen(sessions: &mut [Engaged], manifest: &mut Manifest) -> Result<(), String> {
    for (kind, s) in sessions.iter_mut() {
        let t = Instant::now();
        let r = s.checkpoint_frozen();
        tracing::info!(engine = kind.name(), seconds = t.elapsed().as_secs_f64(), ok = r.is_ok(), "device state taken inside CRIU's freeze");
        match r {
            Ok(Some(state)) => {
                if let Some(d) = manifest.devices.iter_mut().find(|d| d.engine == kind.name()) {
                    d.state = state;
                }
            }
            Ok(None) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}

/// CRIU's "resume-devices": device state back before CRIU lets the tree run, in reverse
/// order. What fails here is retried by the resume that follows the dump.
fn resume_frozen(sessions: &mut [Engaged]) -> Result<(), String> {
    let mut first = None;
    for (kind, s) in sessions.iter_mut().rev() {
        let t = Instant::now();
        let r = s.resume_frozen();
        tracing::info!(engine = kind.name(), seconds = t.elapsed().as_secs_f64(), ok = r.is_ok(), "device state back inside CRIU's freeze");
        if let Err(e) = r {
            tracing::warn!(engine = kind.name(), error = %e, "device state not back inside CRIU's freeze");
            first.get_or_insert(e.to_string());
        }
    }
    first.map_or(Ok(()), Err)
}

/// Lets every engine write what it still holds, then commits the image and advances the
/// journal.
fn commit(sink: &mut ImageWriter, journal: &mut Option<Journal>, sessions: &mut [Engaged], manifest: Manifest) -> Result<(), CheckpointError> {
    let mut known: Vec<FileEntry> = Vec::new();
    for (_, s) in sessions.iter_mut() {
        known.extend(s.finish(sink)?);
    }
    let numbers = manifest.source.cuda_namespaces.clone();
    sink.commit(manifest, &known).map_err(|e: ImageError| CheckpointError::Image(e))?;
    // So that no job of this machine takes them before this image is restored (the image
    // is committed: a failure here costs only that care).
    if let Err(e) = crate::image::record_cuda_namespaces(sink.dest(), &numbers) {
        tracing::warn!(error = %e, "cannot record the image's CUDA namespace numbers");
    }
    if let Some(j) = journal {
        let _ = j.update(|e| e.phase = journal::Phase::Committed);
    }
    Ok(())
}

/// The PID namespace numbers the tree's CUDA sockets are named after (see
/// [`Source::cuda_namespaces`]).
fn cuda_namespaces(tree: &[ProcessInfo]) -> Vec<u64> {
    let mut ns: Vec<u64> =
        tree.iter().flat_map(|p| proctree::abstract_socket_names(p.pid, &p.fds)).filter_map(|n| proctree::cuda_socket_namespace(&n)).collect();
    ns.sort_unstable();
    ns.dedup();
    ns
}
