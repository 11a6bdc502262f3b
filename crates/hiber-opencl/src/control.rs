//! The layer's control thread: started the first time a process calls OpenCL, it answers
//! hiber on the job's abstract socket (see `hiber_wire::opencl` for the protocol).
//! Processes that never call OpenCL get no thread and no socket.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::time::Duration;

use hiber_layer::control::{ControlThread, Spec};
use hiber_layer::gate;
use hiber_wire::opencl::{Reply, Request, Status};
use hiber_wire::socket;

use crate::objects::{self as o, Kind};
use crate::{log, replay};

static CONTROL: ControlThread = ControlThread::new();

/// Starts the control thread once per process. Without `HIBER_OPENCL_TOKEN` the layer
/// only virtualizes.
pub fn start() {
    let spec = Spec {
        token_env: hiber_wire::opencl::TOKEN_ENV,
        socket_name: hiber_wire::opencl::socket_name,
        thread: "hiber-opencl",
        log,
        without: "hiber cannot checkpoint this process's OpenCL state",
    };
    CONTROL.start(&spec, serve);
}

fn serve(listener: OwnedFd) {
    socket::serve(listener, log, session, || {
        // A session that ends before the objects were released (hiber gave up, timed out or
        // died) leaves the application running, not waiting. One that ends with objects
        // released, or re-created without their bytes, leaves it waiting for `hiber
        // recover`: it must not run on without its data.
        let held = {
            let reg = o::registry();
            reg.released || !reg.pending.is_empty()
        };
        if gate::is_closed() && !held {
            replay::open_gate();
        }
    })
}

fn reply(conn: &OwnedFd, r: Reply) -> std::io::Result<()> {
    socket::send(conn, &r.encode(), None)
}

pub fn status() -> Status {
    let objects = o::all_live();
    let count = |k: Kind| objects.iter().filter(|x| x.kind == k).count() as u64;
    let saved = replay::saved_mems();
    let reg = o::registry();
    Status {
        active: reg.active,
        contexts: count(Kind::Context),
        queues: count(Kind::Queue),
        programs: count(Kind::Program),
        kernels: count(Kind::Kernel),
        mems: saved.len() as u64,
        mem_bytes: saved.iter().map(|(_, s, _)| *s as u64).sum(),
        samplers: count(Kind::Sampler),
        events: count(Kind::Event),
        mapped: objects.iter().filter(|x| x.kind == Kind::Mem).map(|x| x.maps.load(Ordering::Relaxed).max(0) as u64).sum(),
        gate_closed: gate::is_closed(),
        released: reg.released,
        pending: reg.pending.len() as u64,
        refused: reg.refused.iter().map(|s| s.split_whitespace().next().unwrap_or(s).to_string()).collect(),
        proxy: crate::remote::enabled(),
    }
}

/// Serves one connection. Returns after a successful `release`, closing the connection,
/// so that no socket to hiber is open when CRIU dumps the process.
fn session(conn: &OwnedFd) -> std::io::Result<()> {
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
            Request::Release if !quiesced => reply(conn, Reply::Err("release without quiesce".into()))?,
            Request::Release => match replay::release() {
                Ok(()) => {
                    // Proxy mode: nothing of the proxy stays open in the process either.
                    if crate::remote::enabled() {
                        crate::proxy::disconnect();
                    }
                    reply(conn, Reply::Ok)?;
                    return Ok(());
                }
                Err(e) => reply(conn, Reply::Err(e))?,
            },
            Request::Replay { device, proxy } => {
                if let Some(p) = &proxy {
                    crate::proxy::set_path(p);
                }
                let r = replay::replay(device.as_deref());
                if let Err(e) = &r {
                    log(&format!("replay: {e}"));
                }
                reply(conn, r.map_or_else(Reply::Err, |()| Reply::Ok))?;
            }
            Request::Load { id } => {
                let r = match fd {
                    Some(fd) => replay::write_mem(id, fd),
                    None => Err("load without a descriptor".into()),
                };
                reply(conn, r.map_or_else(Reply::Err, |()| Reply::Ok))?;
            }
            Request::Resume => {
                let (released, pending) = {
                    let reg = o::registry();
                    (reg.released, reg.pending.len())
                };
                if released {
                    reply(conn, Reply::Err("the OpenCL objects are not re-created yet; replay first".into()))?;
                } else if pending > 0 {
                    reply(conn, Reply::Err(format!("{pending} memory objects are not written back yet; load them first")))?;
                } else {
                    replay::open_gate();
                    quiesced = false;
                    reply(conn, Reply::Ok)?;
                }
            }
        }
    }
    Ok(())
}

/// Closes the gate, drains the queues, and sends every memory object. `Ok(true)` when the
/// application is quiesced and hiber has all its bytes.
fn quiesce(conn: &OwnedFd, timeout: Duration) -> std::io::Result<bool> {
    if o::registry().released {
        return reply(conn, Reply::Err("the OpenCL objects are released already (a checkpoint is under way)".into())).map(|()| false);
    }
    if let Err(n) = gate::close(timeout) {
        return reply(conn, Reply::Err(format!("{n} OpenCL calls still running after {} ms", timeout.as_millis()))).map(|()| false);
    }
    let fail = |conn: &OwnedFd, msg: String| {
        gate::open();
        reply(conn, Reply::Err(msg)).map(|()| false)
    };
    let s = status();
    if !s.refused.is_empty() {
        return fail(conn, format!("the process used {}, which hiber cannot checkpoint", s.refused.join(", ")));
    }
    if s.mapped > 0 {
        return fail(conn, format!("{} memory objects are mapped into host memory (clEnqueueMap*)", s.mapped));
    }
    if let Err(e) = replay::drain(timeout) {
        return fail(conn, e);
    }
    for (kind, name) in replay::used_devices() {
        if let Err(e) = reply(conn, Reply::Device { kind, name }) {
            gate::open();
            return Err(e);
        }
    }
    let mems = replay::saved_mems();
    for (m, size, kind) in &mems {
        let fd = match replay::read_mem(m, *size) {
            Ok(fd) => fd,
            Err(e) => return fail(conn, e),
        };
        if let Err(e) = socket::send(conn, &Reply::Mem { id: m.seq, size: *size as u64, kind: *kind }.encode(), Some(fd.as_raw_fd())) {
            gate::open();
            return Err(e);
        }
    }
    reply(conn, Reply::Done { count: mems.len() as u64 }).map(|()| true)
}
