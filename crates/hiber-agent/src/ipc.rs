//! Legacy CUDA IPC for the memory the agent serves.
//!
//! `torch.multiprocessing` shares a CUDA tensor by `cudaIpcGetMemHandle` on its block's base
//! in one process and `cudaIpcOpenMemHandle` in another. The driver makes no such handle for
//! VMM memory, which is what the agent serves, and no checkpoint of the process that opened
//! one could take it (the memory is another process's). So the agent does legacy IPC
//! itself, on VMM's terms:
//! - **export**: the 64-byte handle names the allocation: a tag, the exporter's PID (as the
//!   job's PID namespace sees it), a nonce of its agent, the allocation's id and size. A
//!   thread of the exporter's agent answers on an abstract socket of the job with a
//!   descriptor for that memory (`cuMemExportToShareableHandle`), only to root or the
//!   process's own user, and only for a handle with its nonce.
//! - **open**: the importer maps that memory into a reservation of its own and returns its
//!   address; opening one handle again counts a reference, as the driver does.
//! - **checkpoint**: the importer asks each exporter whether it still holds the memory (one
//!   freed by its exporter but still open here would be in no process's image: refused),
//!   then unmaps and releases what it imported, keeping the reservation. The exporter's
//!   checkpoint takes the memory, once.
//! - **resume and restore**: hiber hands every process its own memory back before it
//!   resumes any ([`crate::control`]'s `resume`); the importer then maps the exporter's
//!   memory again at the same address, before its gate opens.
//! - **events**: an interprocess event's handle is made after the event has completed
//!   (`cuEventSynchronize` in the exporter), and opening it gives a fresh event of the
//!   importer's that was never recorded, which streams and hosts wait on without waiting.
//!   The wait the application asked for has then already happened in the exporter. Events
//!   are created without the interprocess flag, which the driver's checkpoint would meet.
//!
//! Memory the agent does not serve (below [`crate::memory::SERVE_MIN`]) goes through the
//! driver's own IPC, which hiber still refuses to checkpoint.

use std::collections::hash_map::RandomState;
use std::ffi::c_int;
use std::hash::{BuildHasher, Hasher};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use hiber_wire::socket;

use crate::cuda::{self, AccessDesc, CuResult, DevPtr, Driver, Handle};
use crate::{log, memory};

const MEM_TAG: &[u8; 8] = b"hiberIPC";
const EVENT_TAG: &[u8; 8] = b"hiberEVT";
pub const HANDLE_SIZE: usize = hiber_cuda_sys::CU_IPC_HANDLE_SIZE;

/// What an exported handle names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exported {
    pub pid: u32,
    pub nonce: u64,
    pub id: u64,
    pub size: u64,
}

impl Exported {
    pub fn encode(&self) -> [u8; HANDLE_SIZE] {
        let mut b = [0u8; HANDLE_SIZE];
        b[..8].copy_from_slice(MEM_TAG);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..20].copy_from_slice(&self.nonce.to_le_bytes());
        b[20..28].copy_from_slice(&self.id.to_le_bytes());
        b[28..36].copy_from_slice(&self.size.to_le_bytes());
        b
    }

    /// `None`: not a handle of the agent's (one of the driver's, to pass to it).
    pub fn decode(b: &[u8; HANDLE_SIZE]) -> Option<Exported> {
        if &b[..8] != MEM_TAG {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Some(Exported { pid: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")), nonce: u64_at(12), id: u64_at(20), size: u64_at(28) })
    }

    fn key(&self) -> (u32, u64, u64) {
        (self.pid, self.nonce, self.id)
    }
}

pub fn event_handle() -> [u8; HANDLE_SIZE] {
    let mut b = [0u8; HANDLE_SIZE];
    b[..8].copy_from_slice(EVENT_TAG);
    b
}

pub fn is_event_handle(b: &[u8; HANDLE_SIZE]) -> bool {
    &b[..8] == EVENT_TAG
}

/// The job's agent token, read once, from the application's thread that first used IPC
/// (the agent's own threads never read the environment, which the application may be
/// changing).
static TOKEN: OnceLock<String> = OnceLock::new();

fn token() -> &'static str {
    TOKEN.get_or_init(|| std::env::var(hiber_wire::agent::TOKEN_ENV).unwrap_or_else(|_| "-".into()))
}

/// The exporter's socket: per job (its agent token) and process.
fn socket_name(pid: u32) -> String {
    format!("hiber-ipc.{}.{pid}", token())
}

// ---- the exporter --------------------------------------------------------------------

/// The process whose export thread runs (a forked child starts its own), its nonce, and
/// the listening socket (closed in a forked child, whose thread did not come along).
static SERVER_PID: AtomicU32 = AtomicU32::new(0);
static NONCE: AtomicU64 = AtomicU64::new(0);
static LISTENER: AtomicI32 = AtomicI32::new(-1);
static STARTING: Mutex<()> = Mutex::new(());

/// The handle for the served allocation whose base is `p`, starting the export thread the
/// first time. `None`: not served memory (the driver answers). `Some(Err)`: served, but no
/// handle can be made.
pub fn export(p: DevPtr) -> Option<Result<[u8; HANDLE_SIZE], CuResult>> {
    let (id, size) = memory::with(|t| t.served_containing(p).map(|e| (e.id, e.size as u64)))?;
    let pid = std::process::id();
    let nonce = match server(pid) {
        Ok(n) => n,
        Err(e) => {
            log(&format!("cannot export memory through CUDA IPC: {e}"));
            return Some(Err(cuda::ERROR_INVALID_VALUE));
        }
    };
    Some(Ok(Exported { pid, nonce, id, size }.encode()))
}

fn server(pid: u32) -> std::io::Result<u64> {
    let _one = STARTING.lock().unwrap_or_else(|e| e.into_inner());
    if SERVER_PID.load(Ordering::SeqCst) == pid {
        return Ok(NONCE.load(Ordering::SeqCst));
    }
    let listener = socket::listen(&socket_name(pid))?;
    let nonce = RandomState::new().build_hasher().finish() | 1;
    LISTENER.store(listener.as_raw_fd(), Ordering::SeqCst);
    let spawned = std::thread::Builder::new().name("hiber-agent-ipc".into()).spawn(move || serve(listener, nonce));
    if let Err(e) = spawned {
        LISTENER.store(-1, Ordering::SeqCst);
        return Err(e);
    }
    NONCE.store(nonce, Ordering::SeqCst);
    SERVER_PID.store(pid, Ordering::SeqCst);
    Ok(nonce)
}

/// In a forked child (called from the fork handler: no locks): closes the parent's export
/// socket, whose thread did not come along; the child starts its own if it exports.
pub(crate) fn forget_in_child() {
    let fd = LISTENER.swap(-1, Ordering::SeqCst);
    if fd >= 0 {
        crate::close_fd(fd);
    }
    SERVER_PID.store(0, Ordering::SeqCst);
}

fn serve(listener: OwnedFd, nonce: u64) {
    socket::serve(listener, log, |conn| answer(conn, nonce), || {})
}

/// One request per connection: `fd NONCE ID` (a descriptor for the memory) or `has NONCE
/// ID` (whether this process still holds it). Answers: `ok` (with the descriptor), `held`,
/// `wait` (the memory is with hiber, not yet handed back), `gone`, `err REASON`.
fn answer(conn: &OwnedFd, nonce: u64) -> std::io::Result<()> {
    socket::set_recv_timeout(conn, Some(Duration::from_secs(2)))?;
    let Some((msg, _)) = socket::recv(conn)? else { return Ok(()) };
    let f: Vec<&str> = msg.split_whitespace().collect();
    let parsed = match f.as_slice() {
        [verb, n, id] => n.parse::<u64>().ok().zip(id.parse::<u64>().ok()).map(|(n, id)| (*verb, n, id)),
        _ => None,
    };
    let Some((verb, n, id)) = parsed else { return socket::send(conn, "err malformed request", None) };
    if n != nonce {
        return socket::send(conn, "gone", None);
    }
    let Some(d) = cuda::driver() else { return socket::send(conn, "err libcuda is not loaded", None) };
    let reply: Result<(&str, Option<c_int>), String> = memory::with(|t| match t.entries.get(&id) {
        None => Ok(("gone", None)),
        Some(_) if verb == "has" => Ok(("held", None)),
        Some(e) if e.evacuated => Ok(("wait", None)),
        Some(e) if verb == "fd" => memory::export_fd(d, e).map(|fd| ("ok", Some(fd))).map_err(|r| format!("exporting allocation {id}: CUDA error {r}")),
        Some(_) => Err(format!("unknown request {verb}")),
    });
    match reply {
        Ok((word, fd)) => {
            let sent = socket::send(conn, word, fd);
            if let Some(fd) = fd {
                crate::close_fd(fd);
            }
            sent
        }
        Err(m) => socket::send(conn, &format!("err {m}"), None),
    }
}

// ---- the importer --------------------------------------------------------------------

/// Memory of another process this process opened.
#[derive(Debug)]
struct Import {
    from: Exported,
    /// Where it is mapped: a reservation of the agent's, kept across checkpoints.
    va: DevPtr,
    handle: Handle,
    access: AccessDesc,
    refs: u32,
    /// Unmapped and released for a checkpoint: mapped again at resume.
    evacuated: bool,
}

static IMPORTS: Mutex<Vec<Import>> = Mutex::new(Vec::new());
/// The process whose imports `IMPORTS` holds: a forked child (which cannot use CUDA)
/// never takes the lock, which a thread it lacks may have held at the fork.
static IMPORTS_PID: AtomicU32 = AtomicU32::new(0);

fn imports() -> Option<MutexGuard<'static, Vec<Import>>> {
    let pid = std::process::id();
    match IMPORTS_PID.load(Ordering::SeqCst) {
        0 => {
            let _ = IMPORTS_PID.compare_exchange(0, pid, Ordering::SeqCst, Ordering::SeqCst);
        }
        p if p != pid => return None,
        _ => {}
    }
    (IMPORTS_PID.load(Ordering::SeqCst) == pid).then(|| IMPORTS.lock().unwrap_or_else(|e| e.into_inner()))
}

enum Answer {
    Fd(OwnedFd),
    Held,
    Wait,
    Gone,
}

/// Asks the exporter of `from` (`verb`: `fd` or `has`).
fn ask(from: &Exported, verb: &str) -> Result<Answer, String> {
    let who = format!("process {}", from.pid);
    let conn = socket::connect(&socket_name(from.pid)).map_err(|e| format!("{who} does not answer for its CUDA IPC memory: {e}"))?;
    socket::set_recv_timeout(&conn, Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    socket::send(&conn, &format!("{verb} {} {}", from.nonce, from.id), None).map_err(|e| format!("asking {who}: {e}"))?;
    match socket::recv(&conn).map_err(|e| format!("asking {who}: {e}"))? {
        Some((w, Some(fd))) if w == "ok" => Ok(Answer::Fd(fd)),
        Some((w, _)) if w == "held" => Ok(Answer::Held),
        Some((w, _)) if w == "wait" => Ok(Answer::Wait),
        Some((w, _)) if w == "gone" => Ok(Answer::Gone),
        Some((w, _)) => Err(format!("{who}: {w}")),
        None => Err(format!("{who} closed the connection")),
    }
}

/// The exporter's descriptor for `from`, waiting up to `patience` while hiber still holds
/// that memory (or the exporter's socket is not back yet).
fn fetch(from: &Exported, patience: Duration) -> Result<OwnedFd, String> {
    let start = Instant::now();
    loop {
        let again = match ask(from, "fd") {
            Ok(Answer::Fd(fd)) => return Ok(fd),
            Ok(Answer::Gone) => return Err(format!("process {} no longer holds allocation {}", from.pid, from.id)),
            Ok(Answer::Held) => return Err(format!("process {}: unexpected answer", from.pid)),
            Ok(Answer::Wait) => format!("process {}'s memory is not back yet", from.pid),
            Err(e) => e,
        };
        if start.elapsed() >= patience {
            return Err(again);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Maps the memory behind `fd` at `va` (reserved, `size` bytes) with `access`.
fn map_at(d: &Driver, fd: &OwnedFd, va: DevPtr, size: usize, access: &AccessDesc) -> Result<Handle, CuResult> {
    let h = d.import_fd(fd.as_raw_fd())?;
    if let Err(r) = d.map(va, size, 0, h) {
        let _ = d.release(h);
        return Err(r);
    }
    if let Err(r) = d.set_access(va, size, std::slice::from_ref(access)) {
        let _ = d.unmap(va, size);
        let _ = d.release(h);
        return Err(r);
    }
    Ok(h)
}

/// `cuIpcOpenMemHandle` of a handle the agent made (in another process): the address of the
/// allocation's base in this one.
pub fn open(d: &Driver, from: Exported) -> Result<DevPtr, CuResult> {
    if from.pid == std::process::id() {
        // The driver refuses a process's own handles too.
        return Err(cuda::ERROR_INVALID_VALUE);
    }
    let opened = |list: &mut Vec<Import>| {
        list.iter_mut().find(|i| i.from.key() == from.key()).map(|i| {
            i.refs += 1;
            i.va
        })
    };
    if let Some(va) = opened(&mut *imports().ok_or(cuda::ERROR_INVALID_VALUE)?) {
        return Ok(va);
    }
    let Some((_ctx, dev)) = d.current_device() else { return Err(hiber_cuda_sys::CUDA_ERROR_NOT_INITIALIZED) };
    let size = usize::try_from(from.size).map_err(|_| cuda::ERROR_INVALID_VALUE)?;
    // Asked without the lock: a checkpoint's look at the imports does not wait for it.
    let fd = fetch(&from, Duration::from_secs(2)).map_err(|e| {
        log(&format!("cuIpcOpenMemHandle: {e}"));
        cuda::ERROR_INVALID_VALUE
    })?;
    let mut list = imports().ok_or(cuda::ERROR_INVALID_VALUE)?;
    // Another thread opened it meanwhile.
    if let Some(va) = opened(&mut list) {
        return Ok(va);
    }
    let va = d.reserve(size)?;
    let access = AccessDesc::read_write(dev);
    match map_at(d, &fd, va, size, &access) {
        Ok(handle) => {
            list.push(Import { from, va, handle, access, refs: 1, evacuated: false });
            Ok(va)
        }
        Err(r) => {
            let _ = d.free_reservation(va, size);
            Err(r)
        }
    }
}

/// `cuIpcCloseMemHandle(va)`. `None`: not memory the agent imported.
pub fn close(d: &Driver, va: DevPtr) -> Option<CuResult> {
    let mut list = imports()?;
    let at = list.iter().position(|i| i.va == va)?;
    if list[at].refs > 1 {
        list[at].refs -= 1;
        return Some(cuda::SUCCESS);
    }
    // Work still reading the memory must be done before it goes.
    let _ = d.synchronize_current();
    let i = &list[at];
    let size = i.from.size as usize;
    if !i.evacuated {
        // A failed unmap leaves the import as it was: still open, still counted.
        if let Err(r) = d.unmap(va, size) {
            return Some(r);
        }
    }
    let mut r = Ok(());
    if !i.evacuated {
        r = d.release(i.handle);
    }
    r = r.and(d.free_reservation(va, size));
    if let Err(e) = r {
        log(&format!("closing memory opened through CUDA IPC at {va:#x}: CUDA error {e}; its reservation or handle is left"));
    }
    list.remove(at);
    Some(r.err().unwrap_or(cuda::SUCCESS))
}

/// How many allocations of other processes are open here through the agent.
pub fn count() -> u64 {
    imports().map_or(0, |l| l.len() as u64)
}

/// For a checkpoint: every exporter still holds what this process imported (else the
/// memory would be in no image).
pub fn check_exporters() -> Result<(), String> {
    let Some(list) = imports() else { return Ok(()) };
    for i in list.iter().filter(|i| !i.evacuated) {
        match ask(&i.from, "has")? {
            Answer::Held => {}
            _ => {
                return Err(format!(
                    "{} MiB at {:#x} opened through CUDA IPC from process {} were freed there and live only in this process",
                    i.from.size >> 20,
                    i.va,
                    i.from.pid
                ))
            }
        }
    }
    Ok(())
}

/// For a checkpoint, after [`check_exporters`]: each import is unmapped and released; the
/// reservations stay. An unmap that fails maps back what went before it.
pub fn evacuate(d: &Driver) -> Result<(), String> {
    let Some(mut list) = imports() else { return Ok(()) };
    let mut done: Vec<usize> = Vec::new();
    for (n, i) in list.iter().enumerate().filter(|(_, i)| !i.evacuated) {
        let size = i.from.size as usize;
        if let Err(r) = d.unmap(i.va, size) {
            for &m in &done {
                let j = &list[m];
                let _ = d.map(j.va, j.from.size as usize, 0, j.handle).and_then(|()| d.set_access(j.va, j.from.size as usize, std::slice::from_ref(&j.access)));
            }
            return Err(format!("unmapping memory opened through CUDA IPC: CUDA error {r}"));
        }
        done.push(n);
    }
    for n in done {
        let i = &mut list[n];
        if let Err(r) = d.release(i.handle) {
            log(&format!("releasing memory opened through CUDA IPC: CUDA error {r}"));
        }
        i.evacuated = true;
    }
    Ok(())
}

/// After resume or restore: maps every evacuated import again at its address, from its
/// exporter, waiting up to `patience` for each exporter's memory to be back.
pub fn bring_back(d: &Driver, patience: Duration) -> Result<(), String> {
    let Some(mut list) = imports() else { return Ok(()) };
    for i in list.iter_mut().filter(|i| i.evacuated) {
        let fd = fetch(&i.from, patience)?;
        i.handle =
            map_at(d, &fd, i.va, i.from.size as usize, &i.access).map_err(|r| format!("mapping memory of process {} again: CUDA error {r}", i.from.pid))?;
        i.evacuated = false;
    }
    Ok(())
}

/// Whether an import waits to be mapped again.
pub fn any_evacuated() -> bool {
    imports().is_some_and(|l| l.iter().any(|i| i.evacuated))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_others_are_left_to_the_driver() {
        let e = Exported { pid: 4242, nonce: 0x1234_5678_9abc_def1, id: 17, size: 64 << 20 };
        let b = e.encode();
        assert_eq!(Exported::decode(&b), Some(e));
        assert!(!is_event_handle(&b));
        let mut driver_made = [0u8; HANDLE_SIZE];
        driver_made[..8].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(Exported::decode(&driver_made), None);
        assert!(is_event_handle(&event_handle()));
        assert_eq!(Exported::decode(&event_handle()), None);
    }
}
