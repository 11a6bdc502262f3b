//! What every layer hiber preloads into applications (the CUDA agent, the OpenCL layer) runs
//! on inside them: the [`gate`] in front of the application's calls, the [`table`] of the
//! virtual handles it gives the application, the [`control`] thread that answers hiber over
//! the layer's protocol (`hiber_wire`), and the layer's [`log`]. An API proxy's layer also
//! reaches its proxy process through the shared-memory [`channel`].
//!
//! Rules for code here: it runs inside someone else's program. It never writes to the
//! application's stdout or stderr, never unwinds across `extern "C"`, and starts no thread
//! until the application uses what the layer stands in front of.

pub mod channel;
pub mod control;
pub mod fork;
pub mod gate;
pub mod table;

use std::io::Write;

/// Appends `line` to the file named by the environment variable `env`, when hiber gave the
/// layer one, as `who[PID]: line`.
pub fn log(env: &str, who: &str, line: &str) {
    let Some(path) = std::env::var_os(env) else { return };
    let f = std::fs::OpenOptions::new().append(true).create(true).open(path);
    if let Ok(mut f) = f {
        let _ = writeln!(f, "{who}[{}]: {line}", std::process::id());
    }
}
