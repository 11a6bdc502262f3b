//! hiber's end of a control connection to a layer preloaded into an application (the
//! CUDA agent, the OpenCL layer): one request, one reply, descriptors beside some.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use hiber_wire::{socket, Answer, Message};

use super::EngineError;

/// One control connection to the layer in host process `pid`.
pub struct Conn {
    pub sock: OwnedFd,
    pub pid: i32,
    /// The engine's name, for errors.
    engine: &'static str,
    /// What the layer is called in messages ("agent", "OpenCL layer").
    layer: &'static str,
    /// What a reply that times out means, with its hint.
    timeout: (&'static str, &'static str),
}

impl Conn {
    /// Connects to abstract socket `name`, from inside `pid`'s network namespace.
    pub fn open(engine: &'static str, layer: &'static str, timeout: (&'static str, &'static str), pid: i32, name: &str) -> Result<Conn, EngineError> {
        let name = name.to_string();
        let sock = crate::sys::in_network_namespace_of(pid, move || socket::connect(&name)).and_then(|r| r).map_err(|source| EngineError::Io {
            engine,
            what: format!("cannot reach the {layer} of process {pid}"),
            source,
            hint: None,
        })?;
        Ok(Conn { sock, pid, engine, layer, timeout })
    }

    fn fail(&self, message: String, hint: Option<&str>) -> EngineError {
        EngineError::failed(self.engine, message, hint)
    }

    pub fn send(&self, r: &impl Message, fd: Option<&OwnedFd>) -> Result<(), EngineError> {
        socket::send(&self.sock, &r.encode(), fd.map(|f| f.as_raw_fd())).map_err(|source| EngineError::Io {
            engine: self.engine,
            what: format!("{} of process {}", self.layer, self.pid),
            source,
            hint: None,
        })
    }

    pub fn recv<R: Answer>(&self) -> Result<(R, Option<OwnedFd>), EngineError> {
        match socket::recv(&self.sock) {
            Ok(Some((msg, fd))) => Ok((R::parse(&msg).map_err(|e| self.fail(format!("{} of process {}: {e}", self.layer, self.pid), None))?, fd)),
            Ok(None) => Err(self.fail(format!("the {} of process {} closed the connection", self.layer, self.pid), None)),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Err(self.fail(
                format!("the {} of process {} could not quiesce it: {}; the application keeps running", self.layer, self.pid, self.timeout.0),
                Some(self.timeout.1),
            )),
            Err(source) => Err(EngineError::Io { engine: self.engine, what: format!("{} of process {}", self.layer, self.pid), source, hint: None }),
        }
    }

    /// Sends a request and returns its reply, or the layer's error as an error.
    pub fn call<R: Answer>(&self, r: &impl Message, fd: Option<&OwnedFd>) -> Result<R, EngineError> {
        self.send(r, fd)?;
        let reply: R = self.recv()?.0;
        if let Some(m) = reply.error() {
            return Err(self.fail(format!("{} of process {}: {m}", self.layer, self.pid), None));
        }
        Ok(reply)
    }

    /// Waits for the layer to close its end (it does after `release`).
    pub fn wait_closed(&self) {
        while let Ok(Some(_)) = socket::recv(&self.sock) {}
    }
}

/// A fresh random token naming a job's layer sockets.
pub fn token() -> Option<String> {
    let mut token = [0u8; 8];
    std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut token)).ok()?;
    Some(token.iter().map(|b| format!("{b:02x}")).collect())
}

/// Where a layer's library is: `$env` if set, else `file` beside the hiber binary.
pub fn library(env: &str, file: &str) -> Option<PathBuf> {
    match std::env::var_os(env) {
        Some(p) => Some(PathBuf::from(p)),
        None => Some(std::env::current_exe().ok()?.parent()?.join(file)),
    }
}

/// `LD_PRELOAD` with `lib` first and whatever hiber's own environment preloads after it.
pub fn preload(lib: &Path) -> (String, String) {
    let v = match std::env::var("LD_PRELOAD") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", lib.display()),
        _ => lib.display().to_string(),
    };
    ("LD_PRELOAD".into(), v)
}

/// Runs `f` for every PID, all of them even after a failure; the first error.
pub fn each(pids: &[i32], mut f: impl FnMut(i32) -> Result<(), EngineError>) -> Result<(), EngineError> {
    let mut first = None;
    for &pid in pids {
        if let Err(e) = f(pid) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}
