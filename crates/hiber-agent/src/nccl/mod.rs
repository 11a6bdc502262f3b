//! NCCL communicators that outlive a checkpoint.
//!
//! A communicator holds what neither the driver nor CRIU can take: peer memory mapped from
//! other processes, proxy threads, sockets. So the agent exports NCCL's API itself
//! (PyTorch links `libnccl.so.2` dynamically, so a preloaded library stands in front of it)
//! and hands the application *synthetic* `ncclComm_t`s, the virtual handles of
//! `hiber_layer::table` (as the OpenCL layer's objects are), behind which the
//! real communicator can be torn down before a checkpoint and built again after it (with
//! `--leave-running`, after a failed checkpoint, or in a restored process), from a record
//! of how it was made and a fresh unique id that hiber passes between the ranks.
//!
//! **The cut.** Ranks wait on each other inside collectives, so they cannot simply be
//! stopped one by one. Every communicator counts what each rank submitted on each *lane*:
//! its collectives, and its sends to and receives from each peer. hiber asks every rank to
//! *hold* (no new submission; the counts it reports are final), raises each lane's limit to
//! what the furthest rank reached (a receive to what the peer sent, and so on), lets the
//! ranks that are behind *drain* up to the limits, and only then tears the communicators
//! down, when every rank has submitted the same work and the device has finished it.
//! A submission is an ungrouped call or a whole `ncclGroupStart`..`ncclGroupEnd`: the hold
//! applies at the outermost `ncclGroupStart`, never inside a group, so a group is never cut.
//!
//! The limit is only ever a *count*, which needs every rank to call collectives of one
//! communicator in the same order (as NCCL itself requires).
//!
//! Programs that resolve NCCL with `dlsym` (XLA's NCCL stub `dlopen`s `libnccl.so.2` and
//! looks up each entry point, so JAX reaches NCCL so) get the agent's exports too: the
//! agent's `dlsym` answers `nccl*` names that NCCL defines with the agent's export of the
//! same name ([`redirect_dlsym`]). `HIBER_NCCL_DLSYM=0` turns that off (see
//! `dlsym_redirect_on`); hiber then refuses such processes, as it does programs that link
//! NCCL statically.
//!
//! Not covered: registered buffers, windows and the device API (the handles they return
//! would not survive a rebuild): a communicator that used them refuses the checkpoint.
//! Programs that link NCCL statically bypass the agent; hiber sees their NCCL sockets and
//! refuses them.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{cuda, log};

pub type NcclResult = c_int;
pub const SUCCESS: NcclResult = 0;
const SYSTEM_ERROR: NcclResult = 2;
const INVALID_ARGUMENT: NcclResult = 4;
const INVALID_USAGE: NcclResult = 5;
const REMOTE_ERROR: NcclResult = 6;
const IN_PROGRESS: NcclResult = 7;

/// `ncclComm_t`: the real one (NCCL's pointer) or a synthetic one (the agent's handle).
pub type Comm = *mut c_void;
/// `ncclDataType_t`, `ncclRedOp_t`: C enums.
type Enum = c_int;
type Stream = *mut c_void;

/// `ncclUniqueId`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [u8; 128],
}

/// `ncclTeam_t` (device API), returned by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Team {
    n_ranks: c_int,
    rank: c_int,
    stride: c_int,
}

/// How often the agent looks at a communicator that initializes in the background.
const INIT_POLL: Duration = Duration::from_millis(1);
/// How long a teardown waits for calls that hold a communicator.
const DOWN_WAIT: Duration = Duration::from_secs(5);

#[macro_use]
mod real;
mod api;
mod cut;
mod rebuild;
mod table;

pub use api::*;
pub use cut::*;
pub use real::*;
pub use rebuild::*;
pub use table::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lane_admits_up_to_its_limit_and_a_torn_down_one_nothing() {
        let mut s = State::new();
        let c = s.register(0x1000 as Comm, 7, 0, 2, Origin::Ranks { config: None });
        assert_ne!(c, 0x1000 as Comm, "the application gets the agent's handle");
        let h = seq_of(c).expect("the agent's handle is known as one");
        s.comms.get_mut(&h).unwrap().lanes.insert(Lane::Coll, 3);
        assert!(s.admits(h, Lane::Coll) && s.admits(h, Lane::Send(1)));
        s.phase = Phase::Held;
        assert!(!s.admits(h, Lane::Coll) && !s.admits(h, Lane::Send(1)), "held: no lane grows");
        assert!(!s.behind(), "nothing to catch up on: groups wait too");
        s.limits.insert((h, Lane::Coll), 5);
        assert!(s.admits(h, Lane::Coll) && s.behind());
        assert!(!s.admits(h, Lane::Send(1)), "only the raised lane");
        s.comms.get_mut(&h).unwrap().lanes.insert(Lane::Coll, 5);
        assert!(!s.admits(h, Lane::Coll) && !s.behind(), "at the limit");
        s.phase = Phase::Down;
        assert!(!s.admits(h, Lane::Coll));
        s.comms.remove(&h);
        release_handle(c);
    }

    #[test]
    fn handles_are_told_from_nccls_own_communicators_and_die_with_their_entry() {
        // What NCCL's `ncclComm` starts with (its `startMagic`), behind a real communicator.
        let ncclcomm = Box::new([0x0280_0280_0280_0280u64, 0]);
        let real = &*ncclcomm as *const [u64; 2] as Comm;
        assert!(!is_synthetic(real) && !is_synthetic(std::ptr::null_mut()));
        let mut s = State::new();
        let c = s.register(real, 3, 0, 1, Origin::Ranks { config: None });
        assert!(is_synthetic(c));
        let h = seq_of(c).unwrap();
        let e = s.comms.get(&h).unwrap();
        assert_eq!((e.real(), e.key()), (real as usize, 3));
        assert_eq!(e.take_real(), real as usize);
        assert_eq!(e.real(), 0, "torn down");
        e.set_real(0x5000);
        assert_eq!(e.real(), 0x5000, "rebuilt behind the same handle");
        let weak = std::sync::Arc::downgrade(&e.obj);
        release_handle(c);
        assert!(weak.upgrade().is_some(), "the entry still holds it");
        s.comms.remove(&h);
        assert!(weak.upgrade().is_none(), "gone with its entry and handle");
    }

    /// The only test that touches the process's own state (the agent's `STATE`).
    #[test]
    fn calls_go_through_again_only_once_every_communicator_is_rebuilt_or_fail_once_ended() {
        let (c, h) = {
            let mut s = lock();
            let c = s.register(0x1000 as Comm, 9, 0, 2, Origin::Ranks { config: None });
            let h = seq_of(c).unwrap();
            s.phase = Phase::Down;
            s.comms.get_mut(&h).unwrap().set_real(0);
            (c, h)
        };
        assert!(open().is_err(), "torn down, not rebuilt: calls must keep waiting");
        assert!(is_down());
        lock().comms.get_mut(&h).unwrap().set_real(0x2000);
        assert!(is_down(), "rebuilt but not opened: calls still wait (hiber opens every rank together)");
        open().unwrap();
        assert!(!is_down());
        assert!(fail(9).is_err(), "only torn-down communicators can be ended for good");
        // Torn down again, and a rank of communicator 9 is gone for good: its calls fail as
        // after a peer's death; another communicator of the process waits for its rebuild.
        let (oc, other) = {
            let mut s = lock();
            let oc = s.register(0x3000 as Comm, 4, 1, 2, Origin::Ranks { config: None });
            let other = seq_of(oc).unwrap();
            s.phase = Phase::Down;
            s.comms.get_mut(&h).unwrap().set_real(0);
            s.comms.get_mut(&other).unwrap().set_real(0);
            (oc, other)
        };
        assert!(fail(5).is_err(), "no such communicator");
        fail(9).unwrap();
        assert_eq!(count(), 1, "only the other communicator counts for a cut or a rebuild");
        assert!(list().iter().all(|r| r.key == 4));
        assert_eq!(submit(c, Lane::Coll).err(), Some(REMOTE_ERROR));
        assert_eq!(real_of(c).err(), Some(REMOTE_ERROR));
        assert!(open().is_err() && is_down(), "the other one is not rebuilt yet");
        lock().comms.get_mut(&other).unwrap().set_real(0x4000);
        open().unwrap();
        assert!(!is_down());
        assert_eq!(submit(c, Lane::Coll).err(), Some(REMOTE_ERROR), "still failed once open");
        let (r, _sub) = submit(oc, Lane::Coll).unwrap();
        assert_eq!(r, 0x4000 as Comm, "the other one's calls reach its rebuilt communicator");
        drop(_sub);
        lock().comms.remove(&other);
        lock().comms.remove(&h);
        release_handle(oc);
        release_handle(c);
    }

    #[test]
    fn keys_depend_on_every_part() {
        let a = name_of(&[b"init", &[1, 2, 3]]);
        assert_eq!(a, name_of(&[b"init", &[1, 2, 3]]));
        assert_ne!(a, name_of(&[b"init", &[1, 2, 4]]));
        assert_ne!(name_of(&[b"ab", b"c"]), name_of(&[b"a", b"bc"]), "parts are delimited");
    }

    #[test]
    fn a_config_copy_keeps_its_strings() {
        let net = CString::new("Socket").unwrap();
        let mut raw = [0u64; 10];
        raw[0] = 80;
        raw[1] = 0xcafebeef;
        raw[CONFIG_NET_NAME] = net.as_ptr() as u64;
        // SAFETY: `raw` is an 80-byte config whose size field says so.
        let mut c = unsafe { Config::capture(raw.as_ptr() as *const c_void) }.unwrap();
        drop(net);
        let p = c.as_ptr() as *const u64;
        // SAFETY: the copy is 80 bytes, and its netName points at the agent's own string.
        unsafe {
            assert_eq!(*p, 80);
            assert_eq!(*p.add(1), 0xcafebeef);
            assert_eq!(CStr::from_ptr(*p.add(CONFIG_NET_NAME) as *const c_char).to_str().unwrap(), "Socket");
            assert_eq!(*p.add(CONFIG_COMM_NAME), 0);
        }
        raw[0] = 8;
        // SAFETY: as above; a size too small to be a config is refused before reading more.
        assert!(unsafe { Config::capture(raw.as_ptr() as *const c_void) }.is_none());
    }
}
