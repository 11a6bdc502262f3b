//! The kernels' stack memory, kept out of the driver's checkpoint.
//!
//! The driver reserves local memory for the stack of every thread a device can run at once
//! (on an H100: 132 multiprocessors × 2048 threads × the per-thread limit). It raises the
//! limit for each kernel that needs more and never lowers it by itself. A PyTorch rank that
//! ran DDP steps sits at 1760 B: 454 MiB per device, which the driver's checkpoint copies
//! into host memory, CRIU dumps and the driver's restore copies back, all inside the pause
//! (`bench/probes/context_memory.py`).
//!
//! Once the application is quiesced and its memory handed over, the agent sets the limit of
//! each device the process uses to 0, which frees that memory at once. Before the
//! application's calls go on, it sets each limit back to what it was, so the application
//! finds the limit it had (and no kernel of its runs in between: its calls are held).

use std::ffi::c_int;
use std::sync::Mutex;

use crate::cuda::Driver;

/// (device, the limit it had), for each device whose limit the agent lowered.
static LOWERED: Mutex<Vec<(c_int, usize)>> = Mutex::new(Vec::new());

/// Lowers the stack limit of every device with an active context to 0. Best effort: a
/// device whose limit cannot be read or set keeps it (and the driver moves its memory).
pub fn lower(d: &Driver) {
    let mut lowered = LOWERED.lock().unwrap_or_else(|e| e.into_inner());
    if !lowered.is_empty() {
        return;
    }
    for dev in d.active_devices() {
        match d.with_device(dev, || {
            let old = d.stack_limit()?;
            if old > 0 {
                d.set_stack_limit(0)?;
            }
            Ok(old)
        }) {
            Ok(Ok(0)) => {}
            Ok(Ok(old)) => lowered.push((dev, old)),
            Ok(Err(r)) | Err(r) => crate::log(&format!("device {dev}: the stack limit stays as it is: CUDA error {r}")),
        }
    }
    if !lowered.is_empty() {
        let what: Vec<String> = lowered.iter().map(|(dev, old)| format!("device {dev} from {old} B")).collect();
        crate::log(&format!("stack limit lowered to 0 for the checkpoint: {}", what.join(", ")));
    }
}

/// Sets back every limit [`lower`] changed. A limit that cannot be set back is logged: the
/// driver raises it again for the first kernel that needs it.
pub fn restore(d: &Driver) {
    let lowered = std::mem::take(&mut *LOWERED.lock().unwrap_or_else(|e| e.into_inner()));
    for (dev, old) in lowered {
        if let Err(r) = d.with_device(dev, || d.set_stack_limit(old)).and_then(|r| r) {
            crate::log(&format!("device {dev}: setting the stack limit back to {old} B: CUDA error {r}"));
        }
    }
}
