//! The agent's control thread: started in a process the first time it initializes CUDA,
//! it answers hiber on the job's abstract socket (see `hiber_wire` for the protocol).
//! Processes that never initialize CUDA get no thread and no socket.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use hiber_wire::{socket, Reply, Request, Status};

use crate::{cuda, gate, log, memory};

static STARTED_IN: AtomicI32 = AtomicI32::new(0);

/// Starts the control thread once per process (a forked child that initializes CUDA gets
/// its own). Without `HIBER_AGENT_TOKEN` the agent only serves allocations.
pub fn start() {
    let pid = std::process::id() as i32;
    if STARTED_IN.swap(pid, Ordering::SeqCst) == pid {
        return;
    }
    let Ok(token) = std::env::var(hiber_wire::TOKEN_ENV) else { return };
    let name = hiber_wire::socket_name(&token, pid);
    let listener = match socket::listen(&name) {
        Ok(l) => l,
        Err(e) => {
            log(&format!("pid {pid}: cannot listen on @{name}: {e}; checkpoints will use the driver alone"));
            return;
        }
    };
    let spawned = std::thread::Builder::new().name("hiber-agent".into()).spawn(move || serve(listener));
    if let Err(e) = spawned {
        log(&format!("pid {pid}: cannot start the control thread: {e}"));
    }
}

fn serve(listener: OwnedFd) {
    loop {
        match socket::accept(&listener) {
            Ok(conn) => {
                if let Err(e) = session(&conn) {
                    log(&format!("control connection: {e}"));
                }
            }
            Err(e) => {
                log(&format!("accept: {e}"));
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn reply(conn: &OwnedFd, r: Reply) -> std::io::Result<()> {
    socket::send(conn, &r.encode(), None)
}

fn status() -> Status {
    memory::with(|t| Status {
        tracked: t.entries.len() as u64,
        tracked_bytes: t.tracked_bytes(),
        gate_closed: gate::is_closed(),
        evacuated: t.entries.values().filter(|e| e.evacuated).count() as u64,
        passthrough_calls: t.passthrough.calls,
        passthrough_bytes: t.passthrough.bytes,
        small: t.passthrough.small,
        pitch: t.passthrough.pitch,
        stream_ordered: t.passthrough.stream_ordered,
        managed: t.passthrough.managed,
        vmm_not_exportable: t.passthrough.vmm_not_exportable,
    })
}

/// Serves one connection. Returns after a successful `release`, closing the connection,
/// so that no socket to hiber is open when CRIU dumps the process.
fn session(conn: &OwnedFd) -> std::io::Result<()> {
    while let Some((msg, fd)) = socket::recv(conn)? {
        let req = match Request::parse(&msg) {
            Ok(r) => r,
            Err(e) => {
                reply(conn, Reply::Err(e.to_string()))?;
                continue;
            }
        };
        match req {
            Request::Status => reply(conn, Reply::Status(status()))?,
            Request::Quiesce { timeout_ms } => quiesce(conn, Duration::from_millis(timeout_ms))?,
            Request::Release => match cuda::driver().map(memory::evacuate) {
                Some(Ok(())) => {
                    reply(conn, Reply::Ok)?;
                    return Ok(());
                }
                Some(Err((id, r))) => reply(conn, Reply::Err(format!("releasing allocation {id}: CUDA error {r}")))?,
                None => reply(conn, Reply::Err("libcuda is not loaded".into()))?,
            },
            Request::Load { id } => {
                let r = match (cuda::driver(), fd) {
                    (Some(d), Some(fd)) => match memory::bring_back(d, id, fd.as_raw_fd()) {
                        Ok(()) => Reply::Ok,
                        Err(r) => Reply::Err(format!("mapping allocation {id}: CUDA error {r}")),
                    },
                    (None, _) => Reply::Err("libcuda is not loaded".into()),
                    (_, None) => Reply::Err("load without a descriptor".into()),
                };
                reply(conn, r)?;
            }
            Request::List => {
                let list: Vec<(u64, u64, i32)> = memory::with(|t| t.entries.values().filter(|e| e.evacuated).map(|e| (e.id, e.size as u64, e.dev)).collect());
                for (id, size, dev) in &list {
                    let gpu = cuda::driver().and_then(|d| d.device_uuid(*dev).ok()).unwrap_or_else(|| "unknown".into());
                    reply(conn, Reply::Evacuated { id: *id, size: *size, gpu })?;
                }
                reply(conn, Reply::Done { count: list.len() as u64 })?;
            }
            Request::Resume => {
                let evacuated = memory::with(|t| t.entries.values().filter(|e| e.evacuated).count());
                if evacuated > 0 {
                    reply(conn, Reply::Err(format!("{evacuated} allocations are still with hiber; load them first")))?;
                } else {
                    gate::open();
                    reply(conn, Reply::Ok)?;
                }
            }
        }
    }
    Ok(())
}

fn quiesce(conn: &OwnedFd, timeout: Duration) -> std::io::Result<()> {
    let Some(d) = cuda::driver() else { return reply(conn, Reply::Err("libcuda is not loaded".into())) };
    if memory::with(|t| t.entries.values().any(|e| e.evacuated)) {
        return reply(conn, Reply::Err("device memory is with hiber already".into()));
    }
    if let Err(n) = gate::close(timeout) {
        return reply(conn, Reply::Err(format!("{n} CUDA calls still running after {} ms", timeout.as_millis())));
    }
    let fail = |conn: &OwnedFd, msg: String| {
        gate::open();
        reply(conn, Reply::Err(msg))
    };
    for dev in memory::with(|t| t.devices()) {
        if let Err(r) = d.synchronize_device(dev) {
            return fail(conn, format!("synchronizing device {dev}: CUDA error {r}"));
        }
    }
    let entries: Vec<(u64, u64, i32, u64)> = memory::with(|t| t.entries.values().map(|e| (e.id, e.size as u64, e.dev, e.handle)).collect());
    for (id, size, dev, handle) in &entries {
        let fd = match d.export_fd(*handle) {
            Ok(fd) => fd,
            Err(r) => return fail(conn, format!("exporting allocation {id}: CUDA error {r}")),
        };
        let sent = socket::send(conn, &Reply::Alloc { id: *id, size: *size, device: *dev }.encode(), Some(fd));
        crate::close_fd(fd);
        if let Err(e) = sent {
            gate::open();
            return Err(e);
        }
    }
    reply(conn, Reply::Done { count: entries.len() as u64 })
}
