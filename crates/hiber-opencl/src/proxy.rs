//! Proxy mode, the application's side: the connection to the job's OpenCL proxy.
//!
//! With `HIBER_OPENCL_PROXY` set (`hiber run --opencl=proxy`), the layer never loads the ICD
//! loader: [`crate::remote`]'s stubs stand in for the platform's entry points and send each
//! call to a proxy process that hiber started beside the job, outside the tree CRIU dumps.
//! The connection (a Unix socket and a shared-memory segment, `hiber_layer::channel`) is
//! made on the first call that needs the platform, closed once a checkpoint has released
//! every real object (so the process holds nothing of it when CRIU dumps), and made again,
//! to the proxy hiber names, when the objects are replayed.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use hiber_layer::channel::Client;
use hiber_layer::fork::{self, Epoch};

use crate::remote::{self, Transport};

/// The proxy's socket: from the environment at first, then whatever `replay` names.
static PATH: Mutex<Option<PathBuf>> = Mutex::new(None);
/// The open connection, so a checkpoint can close it, and the process that made it.
static CLIENT: Mutex<Option<(Arc<Client>, Epoch)>> = Mutex::new(None);

/// A connection, and the process that made it: a child forked after its parent's first
/// OpenCL call inherits the connection, and makes one of its own instead (the platform's
/// objects it inherited are its parent's, and fail there, as OpenCL objects do after fork).
struct Channel(Arc<Client>, Epoch);

impl Transport for Channel {
    fn call(&self, req: &[u8]) -> std::io::Result<Vec<u8>> {
        self.0.call(req)
    }

    fn post(&self, req: &[u8]) -> std::io::Result<()> {
        self.0.post(req)
    }

    fn call_unordered(&self, req: &[u8]) -> std::io::Result<Vec<u8>> {
        self.0.call_unordered(req)
    }

    fn inherited(&self) -> bool {
        !self.1.is_current()
    }
}

fn path() -> Option<PathBuf> {
    let mut p = PATH.lock().unwrap_or_else(|e| e.into_inner());
    if p.is_none() {
        *p = std::env::var_os(hiber_wire::opencl::PROXY_ENV).filter(|v| !v.is_empty()).map(PathBuf::from);
    }
    p.clone()
}

/// Where the next connection goes (a restore's proxy), and where the processes this one
/// starts from now on find theirs: a job restored from another state directory's image
/// (another machine's, say) has its proxy elsewhere than its environment named.
pub fn set_path(path: &str) {
    *PATH.lock().unwrap_or_else(|e| e.into_inner()) = Some(PathBuf::from(path));
    // The variable is there already (proxy mode): glibc replaces an existing entry's value
    // in place and never frees the old one, so a thread reading the environment meanwhile
    // sees the old value or the new. The application's OpenCL calls are held at the gate.
    std::env::set_var(hiber_wire::opencl::PROXY_ENV, path);
}

/// Connects to the proxy; the remote stubs call this when they have no connection.
pub fn connect() -> Option<Arc<dyn Transport>> {
    let path = path()?;
    let client = match Client::connect(&path) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            crate::log(&format!("cannot reach the OpenCL proxy at {}: {e}", path.display()));
            return None;
        }
    };
    client.on_notify(Box::new(remote::on_notify));
    let me = fork::epoch();
    if let Some((old, made_in)) = CLIENT.lock().unwrap_or_else(|e| e.into_inner()).replace((client.clone(), me)) {
        if made_in != me {
            // The parent's (see `Channel`): left as it is.
            std::mem::forget(old);
        }
    }
    crate::log(&format!("connected to the OpenCL proxy at {}", path.display()));
    Some(Arc::new(Channel(client, me)))
}

/// Closes the connection (after a checkpoint released every real object): the proxy process
/// then ends, and with it the platform's state, and this process holds no descriptor or
/// mapping of it.
pub fn disconnect() {
    remote::set_transport(None);
    if let Some((c, made_in)) = CLIENT.lock().unwrap_or_else(|e| e.into_inner()).take() {
        if made_in.is_current() {
            c.close();
            crate::log("disconnected from the OpenCL proxy");
        } else {
            std::mem::forget(c);
        }
    }
}
