//! CRIU, driven through its RPC interface (`criu swrk`), never through its text output.
//!
//! Each request runs in its own `criu swrk` child connected over a `SOCK_SEQPACKET` pair.
//! CRIU's notifications ("post-dump", "pre-resume", ...) are answered by a callback, which
//! is how hiber finishes an image while the tree is still frozen: if the callback fails,
//! CRIU resumes the tree instead of killing it.

mod client;

pub use client::{Criu, CriuError, CriuVersion, DumpOptions, RestoreOptions};

/// Types generated from CRIU's `images/rpc.proto`.
#[allow(clippy::all)]
pub mod rpc {
    include!(concat!(env!("OUT_DIR"), "/_.rs"));
}

/// The oldest CRIU that works on current kernels (3.x fails on kernels after 6.12).
pub const MIN_VERSION: (i32, i32) = (4, 0);
