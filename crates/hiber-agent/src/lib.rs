//! hiber's agent, preloaded by `hiber run` into GPU applications.
//!
//! It serves device allocations from VMM reservations it owns and tracks the
//! application's own VMM allocations ([`memory`]), through one table of intercepted driver
//! entry points ([`hooks`]) that also gates work submission ([`gate`]). When hiber
//! checkpoints, it asks the agent over a control socket ([`control`]) to quiesce and hand
//! over its device memory; hiber moves that memory at PCIe speed itself, and the driver's
//! checkpoint takes only the small remainder, made smaller still by lowering the kernels'
//! stack limit for its duration ([`stack`]).
//!
//! Rules for code in this crate: it runs inside someone else's program. It never writes to
//! the application's stdout or stderr (only to `HIBER_AGENT_LOG`), never panics or unwinds
//! across `extern "C"`, and adds no thread or memory to a process until that process
//! initializes CUDA. A child forked after that is detached from the driver ([`fork`]).
//! Unsafe code lives in [`cuda`], [`hooks`], [`nccl`], [`poll`], [`fork`] and
//! `hiber_wire::socket`.

pub mod control;
pub mod cuda;
pub mod fork;
pub use hiber_layer::gate;
pub mod hooks;
pub mod ipc;
pub mod memory;
pub mod nccl;
pub mod poll;
pub mod sharing;
pub mod stack;

/// Appends a line to the agent's log file, when hiber gave it one.
pub(crate) fn log(line: &str) {
    hiber_layer::log(hiber_wire::agent::LOG_ENV, "hiber-agent", line);
}

pub(crate) fn close_fd(fd: std::ffi::c_int) {
    use std::os::fd::FromRawFd;
    // SAFETY: `fd` is a descriptor the driver just created for the agent and nobody else
    // holds; dropping the OwnedFd closes it once.
    drop(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
}
