//! Coordinators: what holds a checkpoint or restore between its phases.
//!
//! A checkpoint of one job on one host runs its phases back to back ([`Local`]). A job of
//! several hosts (or several hibers) needs every participant to reach a phase before any
//! goes on: every rank quiesced before any is captured, every image committed before any
//! application resumes. The pipelines call [`Coordinator::barrier`] after each phase; a
//! coordinator that spans hosts answers once all participants reached it, or fails the
//! barrier, which aborts the operation everywhere (each participant undoes its own steps).

use serde::{Deserialize, Serialize};

pub mod net;

/// The phases of a checkpoint and of a restore, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Checkpoint: tree found, checks passed, engines' sessions opened; nothing touched.
    Prepared,
    /// Checkpoint: device work stopped in every claimed process.
    Quiesced,
    /// Checkpoint: device state moved where the dump takes it.
    Captured,
    /// Checkpoint: the process tree is dumped and frozen; the image is about to be committed.
    Dumped,
    /// Checkpoint: the image is complete and in place.
    Committed,
    /// Restore: image verified, this machine checked, engines' sessions opened.
    RestorePrepared,
    /// Restore: CRIU has made every process and socket, and holds them before it unlocks
    /// the network and resumes anything. No participant goes on before all are here: a
    /// connection between participants then has both its ends again before either end
    /// sends (a packet to a host whose end is not made yet is answered with a reset).
    SocketsRestored,
    /// Restore: the process tree is back (CRIU), devices not yet.
    ProcessesRestored,
    /// Restore: device state is back; the application runs.
    DevicesRestored,
    /// NCCL cut: every rank holds its submissions; each participant's ranks' counts go to
    /// all (from which each computes the same limits).
    NcclHeld,
    /// NCCL cut: every rank caught up to its limits and its device is idle; only now may
    /// any participant tear its communicators down.
    NcclDrained,
    /// NCCL rebuild: each participant's torn-down ranks and their communicators.
    NcclListed,
    /// NCCL rebuild: each communicator's fresh unique id, from the participant of its rank 0.
    NcclIds,
    /// NCCL rebuild: every participant's ranks built their communicators; only now may any
    /// let NCCL calls through.
    NcclBuilt,
}

impl Phase {
    /// The phases of an NCCL cut that spans participants, in order (see
    /// `engine/agent/nccl.rs`): each is an exchange.
    pub const NCCL_CUT: [Phase; 2] = [Phase::NcclHeld, Phase::NcclDrained];
    /// The phases of the rebuild that follows it, in order, each an exchange.
    pub const NCCL_REBUILD: [Phase; 3] = [Phase::NcclListed, Phase::NcclIds, Phase::NcclBuilt];

    /// Whether participants still pass this phase together after an abort: the rebuild of
    /// communicators that the cut tore down is part of every participant's undo.
    pub fn in_undo(self) -> bool {
        Phase::NCCL_REBUILD.contains(&self)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("coordinator: {0}")]
pub struct BarrierError(pub String);

pub trait Coordinator: Sync {
    /// Returns once every participant has reached `phase`; an error aborts the operation.
    fn barrier(&self, phase: Phase) -> Result<(), BarrierError>;

    /// A barrier that also gathers: returns once every participant has reached `phase`, with
    /// every participant's `data` in the order of their indices (the same list for all). One
    /// participant alone gets its own.
    fn exchange(&self, phase: Phase, data: serde_json::Value) -> Result<Vec<serde_json::Value>, BarrierError> {
        if self.is_shared() {
            // A coordinator of several that gathered nothing would hand back one part as all.
            return Err(BarrierError(format!("this coordinator cannot exchange data (at {phase:?})")));
        }
        self.barrier(phase)?;
        Ok(vec![data])
    }

    /// Whether other participants take part (an image then counts only once all committed).
    fn is_shared(&self) -> bool {
        false
    }

    /// This participant's place in every list [`Coordinator::exchange`] returns.
    fn index(&self) -> usize {
        0
    }

    /// Tells the other participants that this one failed (`why`), so that they abort at
    /// once; it stays in the session for the phases of the undo ([`Phase::in_undo`]).
    fn fail(&self, _why: &str) {}
}

/// A coordinator that remembers which phases were passed through it, so that a participant
/// can pass the ones its engines had no part in ([`Tracked::catch_up`]): where one
/// participant's ranks exchange their NCCL counts, every participant must, even one with
/// no rank at all.
pub struct Tracked<'a> {
    inner: &'a dyn Coordinator,
    passed: std::sync::Mutex<Vec<Phase>>,
}

impl<'a> Tracked<'a> {
    pub fn new(inner: &'a dyn Coordinator) -> Tracked<'a> {
        Tracked { inner, passed: std::sync::Mutex::new(Vec::new()) }
    }

    pub fn passed(&self, phase: Phase) -> bool {
        self.passed.lock().unwrap_or_else(|e| e.into_inner()).contains(&phase)
    }

    fn record(&self, phase: Phase) {
        self.passed.lock().unwrap_or_else(|e| e.into_inner()).push(phase);
    }

    /// With other participants, passes those of `phases` not passed yet, in order, with
    /// nothing to say (null): what a participant without NCCL ranks contributes.
    pub fn catch_up(&self, phases: &[Phase]) -> Result<(), BarrierError> {
        if !self.inner.is_shared() {
            return Ok(());
        }
        for &p in phases.iter().filter(|p| !self.passed(**p)) {
            self.exchange(p, serde_json::Value::Null)?;
        }
        Ok(())
    }
}

impl Coordinator for Tracked<'_> {
    fn barrier(&self, phase: Phase) -> Result<(), BarrierError> {
        self.inner.barrier(phase)?;
        self.record(phase);
        Ok(())
    }

    fn exchange(&self, phase: Phase, data: serde_json::Value) -> Result<Vec<serde_json::Value>, BarrierError> {
        let all = self.inner.exchange(phase, data)?;
        self.record(phase);
        Ok(all)
    }

    fn is_shared(&self) -> bool {
        self.inner.is_shared()
    }

    fn index(&self) -> usize {
        self.inner.index()
    }

    fn fail(&self, why: &str) {
        self.inner.fail(why)
    }
}

/// What a [`Local`] coordinator runs at each barrier.
type Hook = Box<dyn Fn(Phase) -> Result<(), BarrierError> + Sync>;

/// One participant: every barrier passes at once. An optional hook sees each phase (tests
/// use it to fail a checkpoint at a chosen point).
#[derive(Default)]
pub struct Local {
    hook: Option<Hook>,
}

impl Local {
    pub fn with_hook(hook: impl Fn(Phase) -> Result<(), BarrierError> + Sync + 'static) -> Local {
        Local { hook: Some(Box::new(hook)) }
    }
}

impl Coordinator for Local {
    fn barrier(&self, phase: Phase) -> Result<(), BarrierError> {
        tracing::debug!(?phase, "barrier");
        match &self.hook {
            Some(h) => h(phase),
            None => Ok(()),
        }
    }
}

/// A coordinator that fails the barrier of the phase named in `$HIBER_FAIL_AT`, or holds
/// hiber at the one named in `$HIBER_PAUSE_AT` (for fault-injection tests of whole hiber
/// commands): for `$HIBER_PAUSE_MS` milliseconds and then goes on (a test does something to
/// the application meanwhile), or without it for ever (a test kills hiber there); else
/// passes every barrier.
pub fn from_env() -> Local {
    let phase = |var: &str| std::env::var(var).ok().and_then(|v| serde_json::from_value::<Phase>(serde_json::Value::String(v)).ok());
    let pause_ms = std::env::var("HIBER_PAUSE_MS").ok().and_then(|v| {
        let ms = v.parse::<u64>().ok();
        if ms.is_none() {
            eprintln!("hiber: HIBER_PAUSE_MS={v:?} is not a number of milliseconds: a pause holds for ever");
        }
        ms
    });
    match (phase("HIBER_FAIL_AT"), phase("HIBER_PAUSE_AT")) {
        (Some(at), _) => Local::with_hook(move |p| if p == at { Err(BarrierError(format!("injected failure at {p:?} (HIBER_FAIL_AT)"))) } else { Ok(()) }),
        (None, Some(at)) => Local::with_hook(move |p| {
            if p == at {
                eprintln!("hiber: paused at {p:?} (HIBER_PAUSE_AT)");
                match pause_ms {
                    Some(ms) => std::thread::sleep(std::time::Duration::from_millis(ms)),
                    None => loop {
                        std::thread::park();
                    },
                }
            }
            Ok(())
        }),
        (None, None) => Local::default(),
    }
}
