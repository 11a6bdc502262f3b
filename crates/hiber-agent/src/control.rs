//! The agent's control thread: started in a process the first time it initializes CUDA,
//! it answers hiber on the job's abstract socket (see `hiber_wire::agent` for the protocol).
//! Processes that never initialize CUDA get no thread and no socket.

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hiber_layer::control::{ControlThread, Spec};
use hiber_wire::agent::{Reply, Request, Status};
use hiber_wire::socket;

use crate::{cuda, gate, ipc, log, memory, nccl, stack};

/// How long a process waits at resume for the memory it opened through CUDA IPC to be
/// back in its exporter (hiber hands every process its memory before it resumes any).
const IPC_PATIENCE: Duration = Duration::from_secs(30);

static CONTROL: ControlThread = ControlThread::new();

/// Starts the control thread once per process (a forked child that initializes CUDA gets
/// its own). Without `HIBER_AGENT_TOKEN` the agent only serves allocations.
pub fn start() {
    let spec = Spec {
        token_env: hiber_wire::agent::TOKEN_ENV,
        socket_name: hiber_wire::agent::socket_name,
        thread: "hiber-agent",
        log,
        without: "checkpoints will use the driver alone",
    };
    CONTROL.start(&spec, serve);
}

/// Whether this process has initialized CUDA through the agent.
pub(crate) fn started() -> bool {
    CONTROL.started()
}

/// In a forked child: closes the parent's control socket, whose thread did not come along.
pub(crate) fn forget_listener() {
    CONTROL.forget_listener();
}

fn serve(listener: OwnedFd) {
    socket::serve(listener, log, session, || {
        // A hold of NCCL submissions does not outlive the hiber that asked for it (a
        // teardown does: only a rebuild undoes it).
        nccl::release_hold();
        if let Some(d) = cuda::driver() {
            memory::drop_created(d);
        }
        // A session that ends with nothing handed over (hiber gave up, timed out or died
        // after quiesce) leaves the application running, not waiting.
        if gate::is_closed() && memory::with(|t| !t.entries.values().any(|e| e.evacuated)) && !ipc::any_evacuated() {
            gate::open();
        }
    })
}

fn reply(conn: &OwnedFd, r: Reply) -> std::io::Result<()> {
    socket::send(conn, &r.encode(), None)
}

fn status() -> Status {
    let agent_ipc = ipc::count();
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
        ipc_imports: crate::sharing::IPC.load(Ordering::Relaxed),
        peer_access: crate::sharing::PEER.load(Ordering::Relaxed),
        shared_imports: crate::sharing::imports(),
        agent_ipc,
        nccl: nccl::count(),
        nccl_down: nccl::is_down(),
    })
}

/// Serves one connection. Returns after a successful `release`, closing the connection,
/// so that no socket to hiber is open when CRIU dumps the process.
fn session(conn: &OwnedFd) -> std::io::Result<()> {
    // `release` only follows a `quiesce` that succeeded on this same connection.
    let mut quiesced = false;
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
            Request::Quiesce { timeout_ms } => quiesced = quiesce(conn, Duration::from_millis(timeout_ms))?,
            Request::Peek => peek(conn)?,
            Request::Release if !quiesced => reply(conn, Reply::Err("release without quiesce".into()))?,
            Request::Release => match cuda::driver().map(release) {
                Some(Ok(())) => {
                    reply(conn, Reply::Ok)?;
                    return Ok(());
                }
                Some(Err(m)) => reply(conn, Reply::Err(m))?,
                None => reply(conn, Reply::Err("libcuda is not loaded".into()))?,
            },
            Request::Load { id } => {
                let r = match (cuda::driver(), fd) {
                    (Some(d), Some(fd)) => match memory::bring_back(d, id, fd) {
                        Ok(()) => Reply::Ok,
                        Err(r) => Reply::Err(format!("mapping allocation {id}: CUDA error {r}")),
                    },
                    (None, _) => Reply::Err("libcuda is not loaded".into()),
                    (_, None) => Reply::Err("load without a descriptor".into()),
                };
                reply(conn, r)?;
            }
            Request::Create { id } => match cuda::driver().map(|d| memory::create_for(d, id)) {
                Some(Ok((size, device, fd))) => {
                    let sent = socket::send(conn, &Reply::Alloc { id, size: size as u64, device }.encode(), Some(fd));
                    crate::close_fd(fd);
                    sent?;
                }
                Some(Err(r)) => reply(conn, Reply::Err(format!("making memory for allocation {id}: CUDA error {r}")))?,
                None => reply(conn, Reply::Err("libcuda is not loaded".into()))?,
            },
            Request::List => {
                let list: Vec<(u64, u64, i32)> = memory::with(|t| t.entries.values().filter(|e| e.evacuated).map(|e| (e.id, e.size as u64, e.dev)).collect());
                for (id, size, dev) in &list {
                    let gpu = cuda::driver().and_then(|d| d.device_uuid(*dev).ok()).unwrap_or_else(|| "unknown".into());
                    reply(conn, Reply::Evacuated { id: *id, size: *size, gpu })?;
                }
                reply(conn, Reply::Done { count: list.len() as u64 })?;
            }
            Request::NcclHold { timeout_ms } => match nccl::hold(Duration::from_millis(timeout_ms)) {
                Ok(comms) => send_reports(conn, &comms)?,
                Err(m) => reply(conn, Reply::Err(m))?,
            },
            Request::NcclList => send_reports(conn, &nccl::list())?,
            Request::NcclLimit { key, lane, count } => reply(conn, done(nccl::limit(key, lane, count)))?,
            Request::NcclDrain { timeout_ms } => reply(conn, done(nccl::drain(Duration::from_millis(timeout_ms))))?,
            Request::NcclDown => reply(conn, done(nccl::down()))?,
            Request::NcclOpen => reply(conn, done(nccl::open()))?,
            Request::NcclFail { key } => reply(conn, done(nccl::fail(key)))?,
            Request::NcclNewId { key } => {
                let r = match nccl::unique_id() {
                    Ok(id) => Reply::NcclId { key, id: id.internal.iter().map(|b| format!("{b:02x}")).collect() },
                    Err(m) => Reply::Err(m),
                };
                reply(conn, r)?;
            }
            Request::NcclSetId { key, id } => {
                let mut u = nccl::UniqueId { internal: [0; 128] };
                for (i, b) in u.internal.iter_mut().enumerate() {
                    *b = u8::from_str_radix(&id[2 * i..2 * i + 2], 16).unwrap_or(0);
                }
                reply(conn, done(nccl::set_id(key, u)))?;
            }
            Request::NcclRebuild { timeout_ms } => reply(conn, done(nccl::rebuild(Duration::from_millis(timeout_ms))))?,
            Request::Resume => {
                let evacuated = memory::with(|t| t.entries.values().filter(|e| e.evacuated).count());
                if evacuated > 0 {
                    reply(conn, Reply::Err(format!("{evacuated} allocations are still with hiber; load them first")))?;
                } else if let Some(Err(m)) = cuda::driver().map(|d| ipc::bring_back(d, IPC_PATIENCE)) {
                    // Memory of another process is not mapped again: the application's
                    // kernels would fault on it, so its calls keep waiting.
                    reply(conn, Reply::Err(format!("memory opened through CUDA IPC: {m}")))?;
                } else {
                    if let Some(d) = cuda::driver() {
                        stack::restore(d);
                    }
                    gate::open();
                    reply(conn, Reply::Ok)?;
                }
            }
        }
    }
    Ok(())
}

/// Hands the device memory over: its own, then what it opened of other processes' once
/// their exporters said they still hold it. Nothing is released when the check fails; an
/// import that cannot be let go of leaves the imports mapped (and hiber hands the memory
/// back). Once all is handed over, the kernels' stack memory is shrunk for the driver's
/// checkpoint ([`stack`]; `Resume` sets it back).
fn release(d: &'static cuda::Driver) -> Result<(), String> {
    ipc::check_exporters()?;
    memory::evacuate(d).map_err(|(id, r)| format!("releasing allocation {id}: CUDA error {r}"))?;
    ipc::evacuate(d)?;
    stack::lower(d);
    Ok(())
}

fn done(r: Result<(), String>) -> Reply {
    match r {
        Ok(()) => Reply::Ok,
        Err(m) => Reply::Err(m),
    }
}

/// One `nccl-comm` per communicator, its lanes after it, then `done`.
fn send_reports(conn: &OwnedFd, comms: &[nccl::Report]) -> std::io::Result<()> {
    for c in comms {
        reply(conn, Reply::NcclComm { key: c.key, rank: c.rank, nranks: c.nranks, local: c.local, gpu: c.gpu.clone() })?;
        for &(lane, count) in &c.lanes {
            reply(conn, Reply::NcclLane { key: c.key, lane, count })?;
        }
    }
    reply(conn, Reply::Done { count: comms.len() as u64 })
}

/// Sends one `alloc` (with its descriptor) per `(id, size, device, fd)`, closing every
/// descriptor, then `done` when all went.
fn send_allocs(conn: &OwnedFd, fds: Vec<(u64, u64, i32, std::ffi::c_int)>) -> std::io::Result<()> {
    let count = fds.len() as u64;
    let mut sent = Ok(());
    for (id, size, dev, fd) in fds {
        if sent.is_ok() {
            sent = socket::send(conn, &Reply::Alloc { id, size, device: dev }.encode(), Some(fd));
        }
        crate::close_fd(fd);
    }
    sent?;
    reply(conn, Reply::Done { count })
}

/// Sends a descriptor for every allocation while the application runs on: what hiber
/// reads through them is a glimpse, not a checkpoint (the application may be writing it).
fn peek(conn: &OwnedFd) -> std::io::Result<()> {
    let Some(d) = cuda::driver() else { return reply(conn, Reply::Err("libcuda is not loaded".into())) };
    let fds: Vec<(u64, u64, i32, std::ffi::c_int)> = memory::with(|t| {
        t.entries.values().filter(|e| !e.evacuated).filter_map(|e| memory::export_fd(d, e).ok().map(|fd| (e.id, e.size as u64, e.dev, fd))).collect()
    });
    send_allocs(conn, fds)
}

/// Closes the gate, waits for device work, and sends every allocation. `Ok(true)` when the
/// application is quiesced and hiber has all descriptors.
fn quiesce(conn: &OwnedFd, timeout: Duration) -> std::io::Result<bool> {
    let Some(d) = cuda::driver() else { return reply(conn, Reply::Err("libcuda is not loaded".into())).map(|()| false) };
    if memory::with(|t| t.entries.values().any(|e| e.evacuated)) {
        return reply(conn, Reply::Err("device memory is with hiber already".into())).map(|()| false);
    }
    // Memory of another process (NCCL's peers' buffers, before its teardown) cannot be
    // handed over: it is not this process's to checkpoint.
    let (ipc, imports) = (crate::sharing::IPC.load(Ordering::Relaxed), crate::sharing::imports());
    if ipc > 0 || imports > 0 {
        let m = format!("{ipc} allocations of another process are open through CUDA IPC and {imports} imported from a shareable handle");
        return reply(conn, Reply::Err(m)).map(|()| false);
    }
    let started = std::time::Instant::now();
    if let Err(n) = gate::close(timeout) {
        return reply(conn, Reply::Err(format!("{n} CUDA calls still running after {} ms", timeout.as_millis()))).map(|()| false);
    }
    let fail = |conn: &OwnedFd, msg: String| {
        gate::open();
        reply(conn, Reply::Err(msg)).map(|()| false)
    };
    // Device work may wait on something only a thread held at the gate would do (a host
    // function, a stream waiting on a value): the wait is bounded, on a thread of its own
    // that is left to finish by itself if it overruns.
    let devices = memory::with(|t| t.devices());
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new().name("hiber-agent-sync".into()).spawn(move || {
        let r = devices.iter().try_for_each(|&dev| d.synchronize_device(dev).map_err(|r| (dev, r)));
        let _ = tx.send(r);
    });
    if spawned.is_err() {
        return fail(conn, "cannot start a thread to wait for the device".into());
    }
    match rx.recv_timeout(timeout.saturating_sub(started.elapsed())) {
        Ok(Ok(())) => {}
        Ok(Err((dev, r))) => return fail(conn, format!("synchronizing device {dev}: CUDA error {r}")),
        Err(_) => return fail(conn, format!("device work still running after {} ms", timeout.as_millis())),
    }
    let fds: Result<Vec<(u64, u64, i32, std::ffi::c_int)>, String> = memory::with(|t| {
        let mut out = Vec::new();
        for e in t.entries.values() {
            match memory::export_fd(d, e) {
                Ok(fd) => out.push((e.id, e.size as u64, e.dev, fd)),
                Err(r) => {
                    for (_, _, _, fd) in out {
                        crate::close_fd(fd);
                    }
                    return Err(format!("exporting allocation {}: CUDA error {r}", e.id));
                }
            }
        }
        Ok(out)
    });
    let fds = match fds {
        Ok(f) => f,
        Err(m) => return fail(conn, m),
    };
    if let Err(e) = send_allocs(conn, fds) {
        gate::open();
        return Err(e);
    }
    Ok(true)
}
