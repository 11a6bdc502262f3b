//! The target of migrations: `hiber serve --listen ADDR --token-file F` accepts jobs that
//! other hosts' hibers move here ([`super::migrate`]), one thread per connection.
//!
//! An incoming image goes into a private staging directory (`$STATE/incoming`, 0700, files
//! 0600, paths checked to stay inside it), is verified and restored as any image is, and
//! the restored tree is held stopped until the source says `Commit`. Whatever goes wrong
//! before that word (the source gone, its `Abort`, a failed restore) leaves nothing here:
//! the stopped copy is killed and the job and staging directory removed.

use std::io;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use super::wire::{self, LogStream, Msg};
use crate::coordinator::{BarrierError, Coordinator, Phase};
use crate::jobs::Registry;
use crate::restore::{restore_with, RestoreRequest};
use crate::secure::{Channel, Token};
use crate::Context;

pub struct ServeOptions {
    pub token: Token,
    /// How long a connection may stay silent (the source's checkpoint included).
    pub timeout: Duration,
}

/// Removes what migrations into this state directory left when their `hiber serve` was
/// killed (images half received, or held while the source decided); returns how many.
pub fn sweep(state: &crate::state::StateDir) -> usize {
    let Ok(entries) = std::fs::read_dir(state.root().join("incoming")) else { return 0 };
    let mut n = 0;
    for e in entries.flatten() {
        if crate::state::made_by_a_gone_hiber(&e.file_name().to_string_lossy()) && std::fs::remove_dir_all(e.path()).is_ok() {
            n += 1;
        }
    }
    n
}

/// Accepts migrations on `listener` for ever (each on its own thread). Returns only if
/// accepting fails.
pub fn serve(ctx: &Context, listener: &TcpListener, opts: &ServeOptions) -> io::Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    /// Connections served at once; more are closed at once (a flood of them must not take
    /// every descriptor, which would end the server).
    const MAX_CONNECTIONS: usize = 64;
    sweep(&ctx.state);
    let active = AtomicUsize::new(0);
    std::thread::scope(|scope| loop {
        let (tcp, peer) = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "accept");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(%peer, "too many connections at once: closed");
            continue;
        }
        let active = &active;
        scope.spawn(move || {
            serve_one(ctx, tcp, peer, opts);
            active.fetch_sub(1, Ordering::AcqRel);
        });
    })
}

fn serve_one(ctx: &Context, tcp: std::net::TcpStream, peer: std::net::SocketAddr, opts: &ServeOptions) {
    let ch = match Channel::accept(tcp, &opts.token, opts.timeout) {
        Ok(ch) => ch,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "refused a connection");
            return;
        }
    };
    match receive(ctx, ch, opts) {
        Ok(Some((name, pid))) => eprintln!("hiber serve: job {name} moved here from {peer}; it runs as pid {pid}"),
        Ok(None) => {}
        Err(e) => eprintln!("hiber serve: a migration from {peer} failed: {e}"),
    }
}

/// One migration, from hello to the job running here (`Some((name, pid))`), or to
/// nothing left behind.
fn receive(ctx: &Context, mut ch: Channel, opts: &ServeOptions) -> Result<Option<(String, i32)>, String> {
    let hello = wire::recv(&mut ch).map_err(|e| e.to_string())?;
    let Msg::Hello { version, job, name, bytes, .. } = hello else { return Err(format!("expected a hello, got {hello:?}")) };
    let incoming = match admit(ctx, version, &name, bytes) {
        Ok(dir) => dir,
        Err((reason, hint)) => {
            let _ = wire::send(&mut ch, &Msg::Refused { reason: reason.clone(), hint });
            return Err(format!("refused job {job}: {reason}"));
        }
    };
    wire::send(&mut ch, &Msg::Accepted).map_err(|e| e.to_string())?;
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Named after this hiber, so that what a killed one left is told apart ([`sweep`]).
    let tag = crate::state::hiber_tag().map_err(|e| e.to_string())?;
    let staging = Staging(incoming.join(format!("{tag}-{n}-{name}")));
    ctx.state.ensure(&staging.0).map_err(|e| e.to_string())?;
    // The checkpoint at the source may take a while before the first file comes.
    let _ = ch.set_read_timeout(Some(opts.timeout));
    let (image_dir, logs_dir) = (staging.0.join("image"), staging.0.join("logs"));
    for d in [&image_dir, &logs_dir] {
        ctx.state.ensure(d).map_err(|e| e.to_string())?;
    }
    let logs = match take_image(&mut ch, &image_dir, &logs_dir, bytes) {
        Ok(Some(logs)) => logs,
        Ok(None) => return Ok(None),
        Err(e) => {
            let _ = wire::send(&mut ch, &Msg::Failed { reason: e.clone() });
            return Err(e);
        }
    };
    let registry = Registry::new(&ctx.state);
    let holder = Holder { ch: Mutex::new(&mut ch), logs, registry: &registry, name: &name, inject: crate::coordinator::from_env() };
    let req = RestoreRequest {
        image: image_dir.clone(),
        name: Some(name.clone()),
        devices: Default::default(),
        isolate_net: false,
        trust_image: false,
        hold_stopped: true,
    };
    let restored = restore_with(ctx, &req, &holder);
    drop(holder);
    match restored {
        Ok(report) => {
            // The job outlives its image here: nothing of it points at the staging directory.
            let mut job = report.job;
            job.restored_from = Some(format!("migration of job {job_name}", job_name = job.name));
            job.last_image = None;
            let _ = registry.save(&job);
            // The source may be gone by now: the job runs here whether it hears or not.
            let _ = wire::send(&mut ch, &Msg::Running { name: job.name.clone(), pid: job.pid });
            Ok(Some((job.name, job.pid)))
        }
        Err(e) => {
            let _ = wire::send(&mut ch, &Msg::Failed { reason: e.to_string() });
            Err(e.to_string())
        }
    }
}

/// Whether this host takes job `name` of about `bytes`, and where its image is staged:
/// refused with a reason and a hint.
fn admit(ctx: &Context, version: u32, name: &str, bytes: u64) -> Result<PathBuf, (String, Option<String>)> {
    if version != wire::VERSION {
        return Err((format!("migration protocol version {version}; this hiber speaks {}", wire::VERSION), Some("run the same hiber on both hosts".into())));
    }
    crate::jobs::validate_name(name).map_err(|e| (e.to_string(), None))?;
    let registry = Registry::new(&ctx.state);
    if registry.dir_of(name).exists() {
        return Err((format!("a job named '{name}' exists on the target"), Some("pick another with --name, or `hiber rm` it there".into())));
    }
    let dir = ctx.state.root().join("incoming");
    if let Err(available) = crate::checkpoint::room_for(&dir, bytes) {
        return Err((
            format!("no room on the target: the image needs about {} MiB, its state directory has {} MiB free", bytes >> 20, available >> 20),
            Some("free space in the target's state directory ($HIBER_STATE)".into()),
        ));
    }
    Ok(dir)
}

/// Receives the image's files into `dir` and the job's logs into `logs_dir`: `Some` with the
/// logs' paths once all came, `None` when the source aborted. What the source sends is
/// bounded by what it announced (`budget`), with some slack, and by a number of files.
fn take_image(ch: &mut Channel, dir: &Path, logs_dir: &Path, budget: u64) -> Result<Option<[PathBuf; 2]>, String> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    const MAX_FILES: usize = 100_000;
    let logs = [logs_dir.join("stdout.log"), logs_dir.join("stderr.log")];
    let mut received = 0u64;
    let mut files = 0usize;
    let mut started: Option<std::time::Instant> = None;
    // What the estimate missed (page tables of a big mapping, say) gets some slack, not
    // an unbounded disk.
    let limit = budget.saturating_mul(2).saturating_add(256 << 20);
    let mut count = |size: u64| {
        received = received.saturating_add(size);
        files += 1;
        if received > limit || files > MAX_FILES {
            return Err(format!("the source sent more than it announced ({} MiB, {MAX_FILES} files at most)", limit >> 20));
        }
        Ok(())
    };
    loop {
        let msg = wire::recv(ch).map_err(|e| format!("the connection to the source: {e}"))?;
        match msg {
            Msg::File { path, size } => {
                started.get_or_insert_with(std::time::Instant::now);
                if !crate::image::is_inside_path(&path) {
                    return Err(format!("the source sent a file named '{path}', which is not a path inside an image"));
                }
                count(size)?;
                let dest = dir.join(&path);
                if let Some(parent) = dest.parent() {
                    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(parent).map_err(|e| e.to_string())?;
                }
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&dest)
                    .map_err(|e| format!("{}: {e}", dest.display()))?;
                if super::drop_at("receiving") {
                    ch.shutdown();
                }
                // Not synced: the staging directory lives only until the job runs, and a crash
                // of this host before then fails the migration, whose source resumes.
                wire::copy_exact(ch, &mut f, size).map_err(|e| format!("receiving {path}: {e}"))?;
            }
            Msg::Log { stream, size } => {
                count(size)?;
                let path = &logs[if stream == LogStream::Stdout { 0 } else { 1 }];
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(path)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                wire::copy_exact(ch, &mut f, size).map_err(|e| format!("receiving the job's log: {e}"))?;
            }
            Msg::Sent => {
                let seconds = started.map(|t| t.elapsed().as_secs_f64()).unwrap_or_default();
                tracing::info!(mib = received >> 20, seconds, dir = %dir.display(), "image received");
                return Ok(Some(logs));
            }
            Msg::Abort { reason } => {
                eprintln!("hiber serve: the source gave up: {reason}");
                return Ok(None);
            }
            other => return Err(format!("unexpected message from the source: {other:?}")),
        }
    }
}

/// The staging directory, removed however the migration ends.
struct Staging(PathBuf);

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The restore's coordinator on the target: with the tree restored and stopped, puts the
/// job's earlier output in its logs, says `Ready`, and lets the tree run only on `Commit`.
/// Also fails the barrier named in `$HIBER_FAIL_AT` (fault-injection tests).
struct Holder<'a> {
    ch: Mutex<&'a mut Channel>,
    /// The job's logs as the source sent them (absent: none).
    logs: [PathBuf; 2],
    registry: &'a Registry,
    name: &'a str,
    inject: crate::coordinator::Local,
}

impl Holder<'_> {
    fn hold(&self) -> Result<(), BarrierError> {
        // Nothing of the tree has run yet: its output so far goes first in its logs.
        for (from, path) in self.logs.iter().zip([self.registry.stdout_of(self.name), self.registry.stderr_of(self.name)]) {
            let Ok(mut text) = std::fs::File::open(from) else { continue };
            let mut f = std::fs::OpenOptions::new().append(true).open(&path).map_err(|e| BarrierError(format!("{}: {e}", path.display())))?;
            std::io::copy(&mut text, &mut f).map_err(|e| BarrierError(format!("{}: {e}", path.display())))?;
        }
        let mut ch = self.ch.lock().unwrap_or_else(|e| e.into_inner());
        wire::send(&mut **ch, &Msg::Ready).map_err(|e| BarrierError(format!("the connection to the source: {e}")))?;
        match wire::recv(&mut **ch) {
            Ok(Msg::Commit) => Ok(()),
            Ok(Msg::Abort { reason }) => Err(BarrierError(format!("the source gave up: {reason}"))),
            Ok(other) => Err(BarrierError(format!("unexpected message from the source: {other:?}"))),
            Err(e) => Err(BarrierError(format!("the connection to the source: {e}"))),
        }
    }
}

impl Coordinator for Holder<'_> {
    fn barrier(&self, phase: Phase) -> Result<(), BarrierError> {
        self.inject.barrier(phase)?;
        match phase {
            Phase::ProcessesRestored => self.hold(),
            _ => Ok(()),
        }
    }
}
