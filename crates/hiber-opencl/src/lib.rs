//! hiber's OpenCL layer, preloaded by `hiber run` into jobs (`--no-opencl` opts out).
//!
//! It exports every entry point of the OpenCL ICD loader ([`api`]), so the application's
//! calls reach it first. The application gets virtual handles ([`objects`]): each stands for
//! a real object and keeps a record of how it was made. At checkpoint, over a control
//! socket ([`control`]), hiber has the layer drain every queue, hand over the bytes of every
//! memory object, and release every real object, so the platform's device state never
//! enters the image; at restore (or when a `--leave-running` checkpoint ends) the layer
//! re-creates the objects from their records ([`replay`]), on the same device or another,
//! and hiber writes the bytes back.
//!
//! In proxy mode (`HIBER_OPENCL_PROXY`, `hiber run --opencl=proxy`), the layer's calls to
//! the real OpenCL go to a proxy process beside the job instead of the vendor's library
//! ([`remote`] marshals them, [`proxy`] holds the connection): the application never loads
//! the vendor's library, so a platform that keeps device files open leaves none in it.
//!
//! Rules for code in this crate: it runs inside someone else's program. It never writes to
//! the application's stdout or stderr (only to `HIBER_OPENCL_LOG`), never unwinds across
//! `extern "C"`, and adds no thread until the process calls OpenCL. Unsafe code lives in
//! [`cl`], [`api`], [`objects`], [`remote`] and [`replay`].

pub mod api;
pub mod cl;
pub mod control;
pub mod objects;
pub mod proxy;
pub mod remote;
pub mod replay;

/// Appends a line to the layer's log file, when hiber gave it one.
pub(crate) fn log(line: &str) {
    hiber_layer::log(hiber_wire::opencl::LOG_ENV, "hiber-opencl", line);
}
