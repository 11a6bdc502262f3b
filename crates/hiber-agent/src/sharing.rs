//! How much a process shares with other processes and GPUs, as the agent's counted entry
//! points (`hooks`) saw it: what hiber refuses to checkpoint, read by `control`'s status.
//! A decrement is an addition of `u64::MAX`, wrapping.

use std::sync::atomic::AtomicU64;

/// Memory of another process opened through legacy CUDA IPC, not yet closed.
pub static IPC: AtomicU64 = AtomicU64::new(0);
/// Peer access enabled between contexts, not yet disabled.
pub static PEER: AtomicU64 = AtomicU64::new(0);
/// Allocations imported from a shareable handle (another process's VMM memory), ever.
pub static IMPORTS: AtomicU64 = AtomicU64::new(0);
