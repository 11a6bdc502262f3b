//! How much a process shares with other processes and GPUs, as the agent's counted entry
//! points (`hooks`) saw it: what hiber refuses to checkpoint, read by `control`'s status.
//! A decrement is an addition of `u64::MAX`, wrapping.

use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

/// Memory of another process opened through legacy CUDA IPC, not yet closed.
pub static IPC: AtomicU64 = AtomicU64::new(0);
/// Peer access enabled between contexts, not yet disabled.
pub static PEER: AtomicU64 = AtomicU64::new(0);
/// Handles imported from a shareable handle (another process's VMM memory), not yet
/// released.
static IMPORTED: Mutex<BTreeSet<u64>> = Mutex::new(BTreeSet::new());

pub fn imported(handle: u64) {
    IMPORTED.lock().unwrap_or_else(|e| e.into_inner()).insert(handle);
}

/// Forgets `handle` once the driver released it (a no-op for handles never imported).
pub fn released(handle: u64) {
    IMPORTED.lock().unwrap_or_else(|e| e.into_inner()).remove(&handle);
}

pub fn imports() -> u64 {
    IMPORTED.lock().unwrap_or_else(|e| e.into_inner()).len() as u64
}
