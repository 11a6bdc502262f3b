//! NCCL jobs: one cut across every rank before the agents quiesce, and the communicators
//! built again after they resume (the agent's side, and why, is in hiber-agent's
//! `nccl/`).
//!
//! The cut, over one connection to each rank's agent:
//! 1. `nccl-hold` every rank: no new submission, and the counts each reports are final;
//! 2. from the counts, the *limit* of every lane a rank is behind on ([`limits`]): a
//!    collective lane to what the furthest rank submitted, a send to what its peer
//!    received, and the other way round;
//! 3. `nccl-drain` every rank: each catches up to its limits and its device finishes;
//! 4. `nccl-down` every rank, once all drained: no rank's collective reads a peer's
//!    memory any more when that peer's communicator goes.
//!
//! Until step 4 a failure only ends the connections, which ends the hold (the job runs on
//! as before). From step 4 on the communicators are gone until [`rebuild`], which the undo
//! (and `--leave-running`, and a restore, and `hiber recover`) runs once every agent has its
//! memory back and its gate open: rank 0 of each communicator makes a fresh unique id, and
//! every rank builds its communicators at once (creation is collective). No rank's calls go
//! through (`nccl-open`) before every rank's rebuild succeeded; when one fails, every rank
//! is torn down again, to be rebuilt together by `hiber recover`.
//!
//! Every rank of a communicator must be in the job, or in the jobs of other hibers held
//! together with this one by a coordinator (`hiber coordinate`). Each step that needs every
//! rank is then a phase of the coordinator ([`Phase::NCCL_CUT`], [`Phase::NCCL_REBUILD`]):
//! each participant's counts are gathered (`nccl_held`) and every participant computes the
//! same [`limits`] and raises its own ranks' lanes; no participant tears down before all
//! drained (`nccl_drained`); at the rebuild, the torn-down ranks are gathered
//! (`nccl_listed`), the participant of each communicator's rank 0 draws its id
//! (`nccl_ids`), and none lets calls through before all built (`nccl_built`). A failure on
//! one participant fails the step everywhere with the same reason (`agree`). With one
//! hiber the phases are plain barriers (where faults may be injected).
//!
//! Communicators over NCCL's network transport (ranks in several hibers' jobs, or ranks that
//! are hosts of their own to NCCL) whose ranks share a GPU, or whose GPUs their agents could
//! not name, are refused unless [`NET_OPT_IN`]: after a rebuild two such ranks on one GPU
//! faulted a few steps later (gpu/RESULTS.md, 2026-11-25 to 28). With a GPU per rank, as
//! across hosts, they are cut and rebuilt (two namespace hosts on 2×H200, 2026-11-28).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use hiber_wire::agent::{Lane, Reply, Request};
use hiber_wire::socket;

use super::{connect, fail, ENGINE};
use crate::coordinator::{Coordinator, Phase};
use crate::engine::layer::Conn;
use crate::engine::EngineError;

/// Creation can take a while on a loaded machine (every rank connects to every other).
const REBUILD_MIN_TIMEOUT: Duration = Duration::from_secs(60);

/// One communicator as one rank reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommReport {
    pub key: u64,
    pub rank: i32,
    pub nranks: i32,
    /// Every rank in the one process (`ncclCommInitAll`): its agent rebuilds it alone.
    pub local: bool,
    /// The UUID of the rank's GPU; empty where its agent could not tell.
    pub gpu: String,
    pub lanes: BTreeMap<Lane, u64>,
}

/// The ranks of each communicator that spans processes, by key: process index and report.
type Members<'a> = BTreeMap<u64, Vec<(usize, &'a CommReport)>>;
/// Per process, the lanes to raise: (communicator key, lane, limit).
type Limits = Vec<Vec<(u64, Lane, u64)>>;

/// Reads `nccl-comm`/`nccl-lane` replies up to `done`.
fn read_reports(conn: &Conn) -> Result<Vec<CommReport>, EngineError> {
    let mut out: Vec<CommReport> = Vec::new();
    loop {
        match conn.recv::<Reply>()?.0 {
            Reply::NcclComm { key, rank, nranks, local, gpu } => out.push(CommReport { key, rank, nranks, local, gpu, lanes: BTreeMap::new() }),
            Reply::NcclLane { key, lane, count } => match out.last_mut() {
                Some(c) if c.key == key => {
                    c.lanes.insert(lane, count);
                }
                _ => return Err(fail(format!("agent of process {}: lane of an unannounced communicator", conn.pid), None)),
            },
            Reply::Done { count } if count == out.len() as u64 => return Ok(out),
            Reply::Err(m) => return Err(fail(format!("agent of process {}: {m}", conn.pid), None)),
            other => return Err(fail(format!("agent of process {}: unexpected {other:?}", conn.pid), None)),
        }
    }
}

/// A communicator's key as it travels between hibers (JSON numbers are not safe past 2^53).
fn key_hex(key: u64) -> String {
    format!("{key:016x}")
}

fn key_of(hex: &str) -> Option<u64> {
    u64::from_str_radix(hex, 16).ok()
}

impl CommReport {
    fn to_json(&self) -> serde_json::Value {
        let lanes: serde_json::Map<String, serde_json::Value> = self.lanes.iter().map(|(l, n)| (l.to_string(), (*n).into())).collect();
        serde_json::json!({"key": key_hex(self.key), "rank": self.rank, "nranks": self.nranks, "local": self.local, "gpu": self.gpu, "lanes": lanes})
    }

    fn from_json(v: &serde_json::Value) -> Option<CommReport> {
        let lanes = v.get("lanes")?.as_object()?.iter().map(|(l, n)| Some((l.parse().ok()?, n.as_u64()?))).collect::<Option<_>>()?;
        Some(CommReport {
            key: key_of(v.get("key")?.as_str()?)?,
            rank: i32::try_from(v.get("rank")?.as_i64()?).ok()?,
            nranks: i32::try_from(v.get("nranks")?.as_i64()?).ok()?,
            local: v.get("local")?.as_bool()?,
            gpu: v.get("gpu").and_then(|g| g.as_str()).unwrap_or_default().to_string(),
            lanes,
        })
    }
}

/// Every process's reports as JSON (each process a list).
fn reports_json(ranks: &[Vec<CommReport>]) -> serde_json::Value {
    ranks.iter().map(|r| r.iter().map(CommReport::to_json).collect::<Vec<_>>()).collect::<Vec<_>>().into()
}

/// Every participant's ranks (each process a list), where this participant's begin, and the
/// participant of each.
type Gathered = (Vec<Vec<CommReport>>, usize, Vec<usize>);

/// The ranks of every participant, one list after another in the participants' order, from
/// what each sent under `field` (null: none), where this participant's begin, and the
/// participant of each.
fn gathered_ranks(all: &[serde_json::Value], me: usize, field: &str) -> Result<Gathered, EngineError> {
    let mut out = Vec::new();
    let mut owners = Vec::new();
    let mut offset = 0;
    for (i, v) in all.iter().enumerate() {
        if i == me {
            offset = out.len();
        }
        let Some(list) = v.get(field) else { continue };
        let procs = list.as_array().ok_or_else(|| fail(format!("participant {i} sent unreadable NCCL ranks"), None))?;
        for p in procs {
            let comms = p.as_array().and_then(|c| c.iter().map(CommReport::from_json).collect::<Option<Vec<_>>>());
            out.push(comms.ok_or_else(|| fail(format!("participant {i} sent an unreadable NCCL communicator"), None))?);
            owners.push(i);
        }
    }
    Ok((out, offset, owners))
}

/// Set to 1, `HIBER_NCCL_NET` lets hiber cut communicators that go over NCCL's network
/// transport with ranks sharing a GPU (see [`shared_gpu_over_network`]), to try them.
pub const NET_OPT_IN: &str = "HIBER_NCCL_NET";

const NET_REASON: &str = "after hiber builds such a communicator again, two of its ranks on one GPU fault a few \
     steps later (CUDA 'unspecified launch failure', Xid 109; NCCL 2.28.9, socket transport, H100 and H200), \
     so it is not cut";

/// Why the communicators of `ranks` (one job's) would go over NCCL's network transport, if
/// they would: their ranks are hosts of their own to NCCL (`NCCL_HOSTID`), or have its
/// peer-to-peer and shared-memory transports both off. Ranks of one host otherwise talk
/// through the GPUs and shared memory.
fn network_transport(ranks: &[Rank]) -> Option<String> {
    let var = |pid, key| crate::proctree::env_var(pid, key);
    let off = |pid, key| var(pid, key).is_some_and(|v| v.trim() == "1");
    ranks.iter().find_map(|r| {
        let why = if let Some(id) = var(r.pid, "NCCL_HOSTID") {
            format!("sets NCCL_HOSTID={id}")
        } else if off(r.pid, "NCCL_P2P_DISABLE") && off(r.pid, "NCCL_SHM_DISABLE") {
            "turns NCCL's peer-to-peer and shared-memory transports off".to_string()
        } else {
            return None;
        };
        Some(format!("NCCL rank process {} {why}", r.pid))
    })
}

/// Why a communicator among `everyone`'s (the ranks of every participant, `owners[i]` the
/// participant of process i, `net[p]` why participant p's ranks go over NCCL's network
/// transport, if they do) would be cut over the network transport with two ranks on one
/// GPU, or with a rank whose GPU is unknown: the one shape that faults after a rebuild. A
/// communicator goes over the network transport when its ranks are in several
/// participants' jobs, or its participant's ranks are hosts of their own to NCCL.
fn shared_gpu_over_network(everyone: &[Vec<CommReport>], owners: &[usize], net: &[Option<String>]) -> Option<String> {
    members(everyone).into_iter().find_map(|(key, m)| {
        let mut parts: Vec<usize> = m.iter().map(|(i, _)| owners[*i]).collect();
        parts.sort_unstable();
        parts.dedup();
        let over = if parts.len() > 1 {
            "has ranks in the jobs of several hibers, so it goes over NCCL's network transport".to_string()
        } else {
            let why = net.get(parts[0]).cloned().flatten()?;
            format!("goes over NCCL's network transport ({why})")
        };
        let mut gpus: Vec<&str> = m.iter().map(|(_, c)| c.gpu.as_str()).collect();
        if gpus.contains(&"") {
            return Some(format!("NCCL communicator {key:016x} {over}, and the GPU of one of its ranks is not known: {NET_REASON}"));
        }
        gpus.sort_unstable();
        let shared = gpus.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])?;
        Some(format!("NCCL communicator {key:016x} {over}, with two of its ranks on {shared}: {NET_REASON}"))
    })
}

/// One step that every participant passes together: this one's `mine` (or its failure) goes
/// to all at `phase`, and the step fails everywhere when it failed anywhere, with the same
/// reason. With no other participant, `peers` only sees the phase (faults may be injected
/// there). Returns every participant's data, by index.
fn agree(peers: &dyn Coordinator, phase: Phase, mine: Result<serde_json::Value, EngineError>) -> Result<Vec<serde_json::Value>, EngineError> {
    let (data, own) = match mine {
        Ok(v) => (v, None),
        Err(e) => (serde_json::json!({"error": e.to_string()}), Some(e)),
    };
    let all = peers.exchange(phase, data).map_err(|e| fail(e.to_string(), None))?;
    if let Some(e) = own {
        return Err(e);
    }
    match all.iter().enumerate().find_map(|(i, v)| v.get("error").and_then(|e| e.as_str()).map(|e| (i, e))) {
        Some((i, why)) => Err(fail(format!("participant {i} of the coordinated NCCL job: {why}"), None)),
        None => Ok(all),
    }
}

/// The ranks of each communicator that spans processes, by key.
fn members(ranks: &[Vec<CommReport>]) -> Members<'_> {
    let mut keys: Members = BTreeMap::new();
    for (i, comms) in ranks.iter().enumerate() {
        for c in comms.iter().filter(|c| !c.local) {
            keys.entry(c.key).or_default().push((i, c));
        }
    }
    keys
}

/// Why communicator `key` is not whole among `members` (a rank missing or twice).
fn incomplete(key: u64, members: &[(usize, &CommReport)]) -> Option<String> {
    let nranks = members[0].1.nranks;
    let mut seen: Vec<i32> = members.iter().map(|(_, c)| c.rank).collect();
    seen.sort_unstable();
    seen.dedup();
    let whole = nranks > 0 && seen.len() == members.len() && seen.len() == nranks as usize && seen.iter().all(|r| (0..nranks).contains(r));
    (!whole).then(|| {
        format!(
            "NCCL communicator {key:016x} has {} of its {nranks} ranks in this checkpoint (every rank's process must be in the job, or in a job checkpointed with it through `hiber coordinate`)",
            members.len()
        )
    })
}

/// The ranks of each communicator that spans processes, checked whole.
fn by_key(ranks: &[Vec<CommReport>]) -> Result<Members<'_>, String> {
    let keys = members(ranks);
    match keys.iter().find_map(|(key, m)| incomplete(*key, m)) {
        Some(why) => Err(why),
        None => Ok(keys),
    }
}

/// For each process (as indexed in `ranks`), the lanes it must catch up on: (key, lane,
/// limit). A collective lane goes to the most any rank submitted; a send to a peer to what
/// that peer received from it, and the other way round.
pub fn limits(ranks: &[Vec<CommReport>]) -> Result<Limits, String> {
    let keys = by_key(ranks)?;
    let mut out = vec![Vec::new(); ranks.len()];
    for (key, members) in keys {
        let by_rank: HashMap<i32, (usize, &CommReport)> = members.iter().map(|(i, c)| (c.rank, (*i, *c))).collect();
        let mut need: BTreeMap<(i32, Lane), u64> = BTreeMap::new();
        let collectives = members.iter().map(|(_, c)| c.lanes.get(&Lane::Coll).copied().unwrap_or(0)).max().unwrap_or(0);
        for (_, c) in &members {
            need.insert((c.rank, Lane::Coll), collectives);
            for (&lane, &n) in &c.lanes {
                let (mine, theirs) = match lane {
                    Lane::Coll => continue,
                    Lane::Send(p) => ((c.rank, Lane::Send(p)), (p, Lane::Recv(c.rank))),
                    Lane::Recv(p) => ((c.rank, Lane::Recv(p)), (p, Lane::Send(c.rank))),
                };
                if !by_rank.contains_key(&theirs.0) {
                    return Err(format!("NCCL communicator {key:016x}: rank {} talks to rank {}, which it does not have", c.rank, theirs.0));
                }
                for k in [mine, theirs] {
                    let e = need.entry(k).or_default();
                    *e = (*e).max(n);
                }
            }
        }
        for ((rank, lane), limit) in need {
            let (i, c) = by_rank[&rank];
            if c.lanes.get(&lane).copied().unwrap_or(0) < limit {
                out[i].push((key, lane, limit));
            }
        }
    }
    Ok(out)
}

/// A process whose agent keeps NCCL communicators.
#[derive(Debug, Clone)]
pub struct Rank {
    pub pid: i32,
    /// Its agent's socket name.
    pub name: String,
}

/// Cuts every rank's NCCL work at one point and tears the communicators down: `ranks` are
/// this participant's; with other participants (`peers`), their ranks are cut at the same
/// point, each participant tearing its own down once every rank of every participant has
/// drained. `Err` with `true` when some were torn down (the caller must [`rebuild`] them),
/// `false` when the job runs on untouched.
///
/// Communicators over NCCL's network transport (ranks of several participants, or of one
/// job as hosts of their own) with two ranks on one GPU are refused once held, before
/// anything drains, unless `network` (see [`NET_OPT_IN`]).
pub fn cut(ranks: &[Rank], timeout_ms: u64, peers: &dyn Coordinator, network: bool) -> Result<(), (EngineError, bool)> {
    let untouched = |e| (e, false);
    let started = std::time::Instant::now();
    let net_hint = Some("give each rank a GPU of its own; HIBER_NCCL_NET=1 tries it anyway, at the risk of that fault");
    let net = network_transport(ranks);
    // Holding: a failure here or on another participant leaves every rank as it was (the
    // connections end, and with them the holds).
    let held = (|| {
        let conns: Vec<Conn> = ranks.iter().map(|r| connect(r.pid, &r.name)).collect::<Result<_, _>>()?;
        // Each reply is bounded: a hold or drain waits inside the agent for at most the timeout.
        for c in &conns {
            let _ = socket::set_recv_timeout(&c.sock, Some(Duration::from_millis(timeout_ms + 2_000)));
        }
        let mut reports = Vec::new();
        for c in &conns {
            c.send(&Request::NcclHold { timeout_ms }, None)?;
            reports.push(read_reports(c).map_err(|e| fail(format!("holding NCCL work: {e}"), None))?);
        }
        Ok((conns, reports))
    })();
    let (conns, reports, mine) = match held {
        Ok((conns, reports)) => {
            let mine = serde_json::json!({ "ranks": reports_json(&reports), "network": network, "net": net });
            (conns, reports, Ok(mine))
        }
        Err(e) => (Vec::new(), Vec::new(), Err(e)),
    };
    let all = agree(peers, Phase::NcclHeld, mine).map_err(untouched)?;
    let held = started.elapsed();
    // Every participant computes the same limits from the same reports, and raises its own.
    let (everyone, offset, owners) = gathered_ranks(&all, peers.index(), "ranks").map_err(untouched)?;
    // One hiber that does not try the network transport decides for all (each sees the same).
    let network = network && all.iter().all(|v| v.get("network").and_then(|n| n.as_bool()) != Some(false));
    if !network {
        // Every participant finds the same, and all stop here, untouched.
        let nets: Vec<Option<String>> = all.iter().map(|v| v.get("net").and_then(|n| n.as_str()).map(String::from)).collect();
        if let Some(why) = shared_gpu_over_network(&everyone, &owners, &nets) {
            return Err(untouched(fail(why, net_hint)));
        }
    }
    let limits = limits(&everyone).map_err(|m| {
        untouched(fail(m, Some("checkpoint every rank of an NCCL job together: from the job's root process, or each job through `hiber coordinate`")))
    })?;
    let limits = limits.get(offset..offset + conns.len()).ok_or_else(|| untouched(fail("this participant's ranks are not among those gathered", None)))?;
    let drained = (|| {
        for (c, lanes) in conns.iter().zip(limits) {
            for &(key, lane, count) in lanes {
                c.call::<Reply>(&Request::NcclLimit { key, lane, count }, None)?;
            }
        }
        for c in &conns {
            c.call::<Reply>(&Request::NcclDrain { timeout_ms }, None).map_err(|e| {
                fail(format!("bringing NCCL ranks to one cut: {e}"), Some("the application keeps running; retry, or raise HIBER_AGENT_QUIESCE_TIMEOUT_MS"))
            })?;
        }
        Ok(serde_json::Value::Null)
    })();
    // No participant tears down before every one has drained.
    agree(peers, Phase::NcclDrained, drained).map_err(untouched)?;
    let raised: usize = limits.iter().map(Vec::len).sum();
    let drained = started.elapsed();
    // Every rank is at the cut with its device idle: now the communicators go, on all of
    // them even if one fails (an agent always ends torn down), all ranks at once: two
    // ranks' teardowns one after the other took 1.16 s of the job's pause on 2xH200.
    let downs: Vec<Result<Reply, EngineError>> = std::thread::scope(|s| {
        let handles: Vec<_> = conns.iter().map(|c| s.spawn(move || c.call::<Reply>(&Request::NcclDown, None))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(fail("an NCCL teardown thread panicked", None)))).collect()
    });
    let first = downs.into_iter().find_map(Result::err);
    tracing::info!(
        ranks = ranks.len(),
        communicators = reports.iter().map(Vec::len).sum::<usize>(),
        lanes_raised = raised,
        hold_s = held.as_secs_f64(),
        drain_s = (drained - held).as_secs_f64(),
        down_s = (started.elapsed() - drained).as_secs_f64(),
        "NCCL work cut and torn down"
    );
    if let Some(e) = first {
        return Err((e, true));
    }
    // NCCL's proxy sockets and shared memory went with the communicators; anything left
    // would fail the dump.
    for r in ranks {
        if let Some(path) = crate::proctree::read_process(r.pid).ok().and_then(|p| crate::checkpoint::preflight::nccl_member(r.pid, &p.fds)) {
            return Err((fail(format!("process {} still holds NCCL state ({path}) after its communicators were torn down", r.pid), None), true));
        }
    }
    Ok(())
}

/// Builds the communicators of `ranks` again: every rank's agent must have its memory back
/// and its gate open. With other participants (`peers`), their torn-down ranks are built
/// with these: the participant of each communicator's rank 0 draws its id, and none lets
/// NCCL calls through before every one has built.
pub fn rebuild(ranks: &[Rank], timeout_ms: u64, peers: &dyn Coordinator) -> Result<(), EngineError> {
    if ranks.is_empty() {
        return Ok(());
    }
    let timeout = Duration::from_millis(timeout_ms).max(REBUILD_MIN_TIMEOUT);
    let started = std::time::Instant::now();
    let mut conns: Vec<Conn> = Vec::new();
    let mut gone = Vec::new();
    let mut reports = Vec::new();
    let listed = (|| {
        for r in ranks {
            match connect(r.pid, &r.name) {
                Ok(c) => conns.push(c),
                Err(_) if !crate::proctree::alive(r.pid) => gone.push(r.pid),
                Err(e) => return Err(e),
            }
        }
        for c in &conns {
            // NCCL's creation makes gated driver calls: a rank whose memory is not back would
            // keep every other waiting for it.
            if let Reply::Status(s) = c.call::<Reply>(&Request::Status, None)? {
                if s.gate_closed {
                    return Err(fail(format!("process {} does not run yet (its device memory is not back)", c.pid), Some("`hiber recover` retries")));
                }
            }
            c.send(&Request::NcclList, None)?;
            reports.push(read_reports(c)?);
        }
        Ok(())
    })();
    if listed.is_ok() && conns.is_empty() && !peers.is_shared() {
        return Ok(());
    }
    // A communicator lacks ranks here when an earlier rebuild built every rank's and opened
    // the others but not these (their peers are not torn down, so not among `ranks`), when
    // ranks' processes are gone, or when its other ranks are another participant's. The
    // first kind only needs opening: an agent opens only when every communicator of its is
    // built, so a rank whose open succeeds is done, with every communicator it is a rank of.
    let mut done = vec![false; conns.len()];
    let mut open_error = None;
    if listed.is_ok() {
        let waiting: BTreeSet<usize> =
            members(&reports).iter().filter(|(k, m)| incomplete(**k, m).is_some()).flat_map(|(_, m)| m.iter().map(|(i, _)| *i)).collect();
        for i in waiting {
            match conns[i].call::<Reply>(&Request::NcclOpen, None) {
                Ok(_) => done[i] = true,
                Err(e) => {
                    open_error.get_or_insert(e);
                }
            }
        }
    }
    if done.iter().any(|d| *d) {
        tracing::info!(ranks = done.iter().filter(|d| **d).count(), "NCCL communicators built by an earlier rebuild opened");
    }
    let opened: BTreeSet<String> = reports.iter().zip(&done).filter(|(_, d)| **d).flat_map(|(r, _)| r.iter().map(|c| key_hex(c.key))).collect();
    // From here on, only the ranks not done: `conns[todo[j]]` is this participant's j-th.
    let todo: Vec<usize> = (0..conns.len()).filter(|&i| !done[i]).collect();
    let mine = listed.map(|()| {
        let left: Vec<Vec<CommReport>> = todo.iter().map(|&i| reports[i].clone()).collect();
        serde_json::json!({ "ranks": reports_json(&left), "gone": !gone.is_empty(), "opened": opened })
    });
    let listed = agree(peers, Phase::NcclListed, mine)?;
    let (everyone, offset, _) = gathered_ranks(&listed, peers.index(), "ranks")?;
    let any_gone = listed.iter().any(|v| v.get("gone").and_then(|g| g.as_bool()) == Some(true));
    let opened_anywhere: BTreeSet<u64> = listed.iter().filter_map(|v| v.get("opened")?.as_array()).flatten().filter_map(|k| key_of(k.as_str()?)).collect();
    let here = |g: usize| (offset..offset + todo.len()).contains(&g).then(|| &conns[todo[g - offset]]);
    let (mut keys, mut broken): (Members, Members) = members(&everyone).into_iter().partition(|(key, m)| incomplete(*key, m).is_none());
    keys.retain(|k, _| !opened_anywhere.contains(k));
    broken.retain(|k, _| !opened_anywhere.contains(k));
    if let Some((key, m)) = broken.iter().next() {
        if !any_gone {
            let why = incomplete(*key, m).unwrap_or_default();
            return Err(match open_error {
                Some(e) => fail(format!("{why}; opening it: {e}"), Some("`hiber recover` retries")),
                None => fail(why, None),
            });
        }
    }
    // With processes gone, every communicator still lacking ranks is taken to have lost them
    // with those processes (the cut records no rank's process, so it cannot tell them apart).
    let lost_keys = broken;
    let mut lost = None;
    let ids = (|| {
        if let Some((key, m)) = lost_keys.iter().next() {
            let why = incomplete(*key, m).unwrap_or_default();
            // Communicators that lack ranks whose processes are gone: nothing can bring those
            // back, and waiting for a rebuild would hold the others for ever. Their calls fail
            // instead, as after a peer's death in NCCL, and the job's own error handling
            // (PyTorch's watchdog, the launcher) takes over. The ranks' other communicators
            // are built again as usual.
            let ends: BTreeSet<(usize, u64)> =
                lost_keys.iter().flat_map(|(key, m)| m.iter().filter(|(g, _)| here(*g).is_some()).map(move |(g, _)| (*g, *key))).collect();
            for (g, key) in ends {
                let c = here(g).expect("a rank of this participant");
                // A rank that could not end one would fail its rebuild (no id for it): stop
                // here, with every rank still torn down, for `hiber recover`.
                c.call::<Reply>(&Request::NcclFail { key }, None)
                    .map_err(|e| fail(format!("ending NCCL communicator {key:016x} of process {}: {e}", c.pid), Some("`hiber recover` retries")))?;
            }
            let whose = if gone.is_empty() { "of another participant".to_string() } else { format!("{gone:?} of the job") };
            lost = Some(EngineError::ProcessesGone {
                engine: ENGINE,
                message: format!(
                    "{why}: process(es) {whose} are gone, so {} of its communicators cannot be built again; their calls on the other ranks now fail, as after a peer's death in NCCL",
                    lost_keys.len()
                ),
                hint: Some("the job's launcher decides what follows (torchrun stops the other ranks); restore the job from an image".into()),
            });
        }
        // Each communicator's rank 0 draws its id, on whichever participant it is.
        let mut ids = serde_json::Map::new();
        for (key, members) in &keys {
            let (root, _) = members.iter().find(|(_, c)| c.rank == 0).expect("a whole communicator has its rank 0");
            let Some(root) = here(*root) else { continue };
            match root.call::<Reply>(&Request::NcclNewId { key: *key }, None)? {
                Reply::NcclId { id, .. } => ids.insert(key_hex(*key), id.into()),
                other => return Err(fail(format!("agent of process {}: unexpected {other:?}", root.pid), None)),
            };
        }
        Ok(serde_json::json!({ "ids": ids }))
    })();
    let all = agree(peers, Phase::NcclIds, ids)?;
    let ids: BTreeMap<u64, &str> =
        all.iter().filter_map(|v| v.get("ids")?.as_object()).flatten().filter_map(|(k, v)| Some((key_of(k)?, v.as_str()?))).collect();
    let todo: Vec<&Conn> = todo.iter().map(|&i| &conns[i]).collect();
    let timeout_ms = timeout.as_millis() as u64;
    let built = (|| {
        for (key, members) in &keys {
            let id = ids.get(key).ok_or_else(|| fail(format!("no unique id came for NCCL communicator {key:016x}"), None))?;
            for c in members.iter().filter_map(|(g, _)| here(*g)) {
                c.call::<Reply>(&Request::NcclSetId { key: *key, id: id.to_string() }, None)?;
            }
        }
        let results: Vec<Result<(), EngineError>> = std::thread::scope(|s| {
            let handles: Vec<_> = todo
                .iter()
                .map(|&c| {
                    s.spawn(move || {
                        let _ = socket::set_recv_timeout(&c.sock, Some(timeout + Duration::from_secs(2)));
                        c.call::<Reply>(&Request::NcclRebuild { timeout_ms }, None).map(|_| ())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(fail("an NCCL rebuild thread panicked", None)))).collect()
        });
        results.into_iter().collect::<Result<(), _>>().map(|()| serde_json::json!({ "built": todo.len() }))
    })();
    // No rank, here or anywhere, submits work before every rank has its communicators. A
    // participant with ranks to build that says nothing here (it left, in the undo round)
    // did not build them.
    let built = agree(peers, Phase::NcclBuilt, built).and_then(|done| {
        let silent = listed.iter().zip(&done).position(|(l, d)| l.get("ranks").and_then(|r| r.as_array()).is_some_and(|r| !r.is_empty()) && d.is_null());
        match silent {
            Some(i) => Err(fail(format!("participant {i} of the coordinated NCCL job left before its ranks built their communicators"), None)),
            None => Ok(()),
        }
    });
    if let Err(e) = built {
        // Ranks whose creation finished would submit work that a rank without communicators
        // never joins: every rank goes back to torn down, to be rebuilt together.
        for c in &todo {
            let _ = c.call::<Reply>(&Request::NcclDown, None);
        }
        return Err(fail(format!("building NCCL communicators again: {e}"), Some("the job's NCCL calls wait; `hiber recover` retries")));
    }
    // Every rank is opened even if one fails (a later `hiber recover` rebuilds and opens
    // that one).
    let opened: Vec<Result<Reply, EngineError>> = todo.iter().map(|c| c.call::<Reply>(&Request::NcclOpen, None)).collect();
    if let Some(e) = opened.into_iter().find_map(Result::err) {
        return Err(fail(format!("letting NCCL calls through again: {e}"), Some("`hiber recover` retries")));
    }
    tracing::info!(
        ranks = todo.len(),
        communicators = keys.len(),
        failed = lost_keys.len(),
        seconds = started.elapsed().as_secs_f64(),
        "NCCL communicators rebuilt"
    );
    lost.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::Local;

    /// One hiber, no other participant.
    fn alone() -> Local {
        Local::default()
    }

    fn comm(key: u64, rank: i32, nranks: i32, lanes: &[(Lane, u64)]) -> CommReport {
        CommReport { key, rank, nranks, local: false, gpu: String::new(), lanes: lanes.iter().copied().collect() }
    }

    #[test]
    fn ranks_behind_catch_up_to_the_furthest() {
        // Rank 1 has submitted two all-reduces fewer than rank 0 (it is still computing).
        let ranks = vec![vec![comm(7, 0, 2, &[(Lane::Coll, 12)])], vec![comm(7, 1, 2, &[(Lane::Coll, 10)])]];
        assert_eq!(limits(&ranks).unwrap(), vec![vec![], vec![(7, Lane::Coll, 12)]]);
        // In step: nothing to raise.
        let ranks = vec![vec![comm(7, 0, 2, &[(Lane::Coll, 3)])], vec![comm(7, 1, 2, &[(Lane::Coll, 3)])]];
        assert_eq!(limits(&ranks).unwrap(), vec![vec![], vec![]]);
    }

    #[test]
    fn sends_and_receives_match_per_peer() {
        // A pipeline: rank 0 sent 5 to rank 1, which received 4; rank 1 sent 2 to rank 2,
        // which has not received anything yet (no lane at all).
        let ranks = vec![vec![comm(9, 0, 3, &[(Lane::Send(1), 5)])], vec![comm(9, 1, 3, &[(Lane::Recv(0), 4), (Lane::Send(2), 2)])], vec![comm(9, 2, 3, &[])]];
        let l = limits(&ranks).unwrap();
        assert_eq!(l[0], vec![]);
        assert_eq!(l[1], vec![(9, Lane::Recv(0), 5)]);
        assert_eq!(l[2], vec![(9, Lane::Recv(1), 2)]);
    }

    #[test]
    fn each_communicator_is_cut_on_its_own() {
        let ranks = vec![
            vec![comm(1, 0, 2, &[(Lane::Coll, 4)]), comm(2, 1, 2, &[(Lane::Coll, 1)])],
            vec![comm(1, 1, 2, &[(Lane::Coll, 5)]), comm(2, 0, 2, &[(Lane::Coll, 1)])],
        ];
        assert_eq!(limits(&ranks).unwrap(), vec![vec![(1, Lane::Coll, 5)], vec![]]);
    }

    #[test]
    fn a_communicator_missing_ranks_is_refused() {
        let ranks = vec![vec![comm(7, 0, 2, &[])]];
        let e = limits(&ranks).unwrap_err();
        assert!(e.contains("1 of its 2 ranks"), "{e}");
        let dup = vec![vec![comm(7, 0, 2, &[])], vec![comm(7, 0, 2, &[])]];
        assert!(limits(&dup).is_err(), "two rank 0s");
        let stranger = vec![vec![comm(7, 0, 2, &[(Lane::Send(5), 1)])], vec![comm(7, 1, 2, &[])]];
        assert!(limits(&stranger).unwrap_err().contains("rank 5"));
    }

    /// An agent that answers the NCCL part of the protocol from a script and records what
    /// hiber asked, on an abstract socket of this process.
    struct ScriptedAgent {
        asked: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
        rank: Rank,
    }

    fn scripted(name: &str, comms: Vec<CommReport>, fail: &'static str) -> ScriptedAgent {
        let name = format!("hiber-test-nccl-{}-{name}", std::process::id());
        let listener = socket::listen(&name).unwrap();
        let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = asked.clone();
        // As a real agent: torn down until a rebuild ("built": already rebuilt, not opened),
        // and it opens only when every communicator not ended for good is built.
        let mut built = fail == "built";
        let mut live: Vec<u64> = comms.iter().map(|c| c.key).collect();
        std::thread::spawn(move || loop {
            let Ok(conn) = socket::accept(&listener) else { return };
            while let Ok(Some((msg, _))) = socket::recv(&conn) {
                log.lock().unwrap().push(msg.clone());
                let send = |r: Reply| socket::send(&conn, &r.encode(), None).unwrap();
                match Request::parse(&msg).unwrap() {
                    _ if msg.split(' ').next() == Some(fail) => send(Reply::Err("scripted failure".into())),
                    Request::NcclHold { .. } | Request::NcclList => {
                        for c in &comms {
                            send(Reply::NcclComm { key: c.key, rank: c.rank, nranks: c.nranks, local: c.local, gpu: c.gpu.clone() });
                            for (&lane, &count) in &c.lanes {
                                send(Reply::NcclLane { key: c.key, lane, count });
                            }
                        }
                        send(Reply::Done { count: comms.len() as u64 });
                    }
                    Request::NcclNewId { key } => send(Reply::NcclId { key, id: format!("{key:02x}").repeat(128)[..256].to_string() }),
                    Request::NcclRebuild { .. } => {
                        built = true;
                        send(Reply::Ok)
                    }
                    Request::NcclFail { key } => {
                        live.retain(|k| *k != key);
                        send(Reply::Ok)
                    }
                    Request::NcclOpen if !built && !live.is_empty() => send(Reply::Err("NCCL communicators are torn down; rebuild them".into())),
                    Request::Status => {
                        send(Reply::Status(hiber_wire::agent::Status { gate_closed: fail == "closed", nccl: comms.len() as u64, ..Default::default() }))
                    }
                    _ => send(Reply::Ok),
                }
            }
        });
        ScriptedAgent { asked, rank: Rank { pid: std::process::id() as i32, name } }
    }

    impl ScriptedAgent {
        fn asked(&self) -> Vec<String> {
            self.asked.lock().unwrap().clone()
        }

        fn verbs(&self) -> Vec<String> {
            self.asked().iter().map(|m| m.split(' ').next().unwrap().to_string()).collect()
        }
    }

    #[test]
    fn a_cut_raises_the_ranks_behind_and_tears_every_rank_down_after_all_drained() {
        let a = scripted("cut-a", vec![comm(7, 0, 2, &[(Lane::Coll, 12)])], "");
        let b = scripted("cut-b", vec![comm(7, 1, 2, &[(Lane::Coll, 10)])], "");
        cut(&[a.rank.clone(), b.rank.clone()], 1000, &alone(), true).unwrap();
        assert_eq!(a.verbs(), ["nccl-hold", "nccl-drain", "nccl-down"]);
        assert_eq!(b.verbs(), ["nccl-hold", "nccl-limit", "nccl-drain", "nccl-down"]);
        assert_eq!(b.asked()[1], "nccl-limit 0000000000000007 c 12");
    }

    #[test]
    fn a_rank_that_cannot_drain_leaves_every_communicator_up() {
        let a = scripted("drain-a", vec![comm(7, 0, 2, &[(Lane::Coll, 3)])], "");
        let b = scripted("drain-b", vec![comm(7, 1, 2, &[(Lane::Coll, 3)])], "nccl-drain");
        let (e, down) = cut(&[a.rank.clone(), b.rank.clone()], 1000, &alone(), true).unwrap_err();
        assert!(!down, "nothing torn down: {e}");
        assert!(!a.verbs().contains(&"nccl-down".to_string()) && !b.verbs().contains(&"nccl-down".to_string()));
    }

    #[test]
    fn a_failed_teardown_still_reaches_every_rank_and_asks_for_a_rebuild() {
        let a = scripted("down-a", vec![comm(7, 0, 2, &[])], "nccl-down");
        let b = scripted("down-b", vec![comm(7, 1, 2, &[])], "");
        let (_, down) = cut(&[a.rank.clone(), b.rank.clone()], 1000, &alone(), true).unwrap_err();
        assert!(down, "the caller must rebuild");
        assert_eq!(b.verbs().last().unwrap(), "nccl-down", "the other rank was torn down too");
    }

    #[test]
    fn a_job_missing_a_rank_is_refused_before_any_limit() {
        let a = scripted("alone", vec![comm(7, 0, 2, &[(Lane::Coll, 1)])], "");
        let (e, down) = cut(std::slice::from_ref(&a.rank), 1000, &alone(), true).unwrap_err();
        assert!(!down && e.to_string().contains("1 of its 2 ranks"), "{e}");
        assert_eq!(a.verbs(), ["nccl-hold"]);
    }

    #[test]
    fn a_rebuild_takes_rank_0s_id_to_every_rank() {
        let a = scripted("re-a", vec![comm(9, 1, 2, &[])], "");
        let b = scripted("re-b", vec![comm(9, 0, 2, &[])], "");
        rebuild(&[a.rank.clone(), b.rank.clone()], 1000, &alone()).unwrap();
        assert_eq!(b.verbs(), ["status", "nccl-list", "nccl-new-id", "nccl-set-id", "nccl-rebuild", "nccl-open"], "rank 0 draws the id");
        assert_eq!(a.verbs(), ["status", "nccl-list", "nccl-set-id", "nccl-rebuild", "nccl-open"]);
        assert_eq!(a.asked()[2], b.asked()[3], "the same id");
    }

    #[test]
    fn a_rebuild_failed_on_one_rank_opens_none_and_tears_every_rank_down_again() {
        let a = scripted("refail-a", vec![comm(9, 0, 2, &[])], "");
        let b = scripted("refail-b", vec![comm(9, 1, 2, &[])], "nccl-rebuild");
        let e = rebuild(&[a.rank.clone(), b.rank.clone()], 1000, &alone()).unwrap_err();
        assert!(e.to_string().contains("building NCCL communicators again"), "{e}");
        for agent in [&a, &b] {
            let verbs = agent.verbs();
            assert!(!verbs.contains(&"nccl-open".to_string()), "no rank may submit work: {verbs:?}");
            assert_eq!(verbs.last().unwrap(), "nccl-down", "{verbs:?}");
        }
    }

    #[test]
    fn a_rank_that_is_gone_makes_the_others_fail_their_calls_instead_of_waiting() {
        let a = scripted("gone-a", vec![comm(9, 0, 2, &[])], "");
        // A process that has exited, and been reaped: its agent can never answer.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id() as i32;
        child.wait().unwrap();
        let gone = Rank { pid: dead, name: format!("hiber-test-nccl-{}-gone-b", std::process::id()) };
        let e = rebuild(&[a.rank.clone(), gone.clone()], 1000, &alone()).unwrap_err();
        assert!(e.to_string().contains("are gone") && e.to_string().contains(&dead.to_string()), "{e}");
        assert_eq!(
            a.verbs(),
            ["status", "nccl-list", "nccl-open", "nccl-fail", "nccl-rebuild", "nccl-open"],
            "not built (its open is refused): the survivor's communicator ends, and its calls go on (to fail)"
        );
        assert_eq!(a.asked()[3], "nccl-fail 0000000000000009");
        // Only the communicators the gone process was a rank of end: the survivors' others
        // are built again. A process of the job that is gone but was no rank changes nothing.
        let b = scripted("gone-c", vec![comm(5, 0, 2, &[]), comm(6, 0, 2, &[])], "");
        let c = scripted("gone-d", vec![comm(5, 1, 2, &[])], "");
        let e = rebuild(&[b.rank.clone(), c.rank.clone(), gone.clone()], 1000, &alone()).unwrap_err();
        assert!(e.to_string().contains("1 of its communicators"), "{e}");
        assert_eq!(b.verbs(), ["status", "nccl-list", "nccl-open", "nccl-fail", "nccl-new-id", "nccl-set-id", "nccl-rebuild", "nccl-open"]);
        assert_eq!(b.asked()[3], "nccl-fail 0000000000000006", "not communicator 5");
        assert_eq!(c.verbs(), ["status", "nccl-list", "nccl-set-id", "nccl-rebuild", "nccl-open"]);
        let d = scripted("gone-e", vec![comm(5, 0, 2, &[])], "");
        let f = scripted("gone-f", vec![comm(5, 1, 2, &[])], "");
        rebuild(&[d.rank.clone(), f.rank.clone(), gone], 1000, &alone()).unwrap();
        assert_eq!(d.verbs().last().unwrap(), "nccl-open");
    }

    #[test]
    fn a_rank_left_unopened_by_an_earlier_rebuild_is_opened_alone() {
        // Its peer opened; only it is torn down, with its communicators built.
        let a = scripted("late-a", vec![comm(9, 1, 2, &[])], "built");
        rebuild(std::slice::from_ref(&a.rank), 1000, &alone()).unwrap();
        assert_eq!(a.verbs(), ["status", "nccl-list", "nccl-open"], "nothing rebuilt");
        // Not built (the agent refuses to open): the communicator's missing rank is the error.
        let b = scripted("late-b", vec![comm(9, 1, 2, &[])], "nccl-open");
        let e = rebuild(std::slice::from_ref(&b.rank), 1000, &alone()).unwrap_err();
        assert!(e.to_string().contains("1 of its 2 ranks"), "{e}");
    }

    #[test]
    fn a_rank_opened_alone_leaves_the_others_to_be_rebuilt() {
        // Process a: rebuilt and left unopened earlier (its peer runs); b and c: a second
        // communicator of the job, torn down, built again as usual.
        let a = scripted("mix-a", vec![comm(9, 1, 2, &[])], "built");
        let b = scripted("mix-b", vec![comm(4, 0, 2, &[])], "");
        let c = scripted("mix-c", vec![comm(4, 1, 2, &[])], "");
        rebuild(&[a.rank.clone(), b.rank.clone(), c.rank.clone()], 1000, &alone()).unwrap();
        assert_eq!(a.verbs(), ["status", "nccl-list", "nccl-open"], "opened, not rebuilt");
        assert_eq!(b.verbs(), ["status", "nccl-list", "nccl-new-id", "nccl-set-id", "nccl-rebuild", "nccl-open"]);
        assert_eq!(c.verbs(), ["status", "nccl-list", "nccl-set-id", "nccl-rebuild", "nccl-open"]);
    }

    #[test]
    fn every_rank_is_opened_even_when_one_fails_to() {
        let a = scripted("open-a", vec![comm(9, 0, 2, &[])], "nccl-open");
        let b = scripted("open-b", vec![comm(9, 1, 2, &[])], "");
        let e = rebuild(&[a.rank.clone(), b.rank.clone()], 1000, &alone()).unwrap_err();
        assert!(e.to_string().contains("letting NCCL calls through again"), "{e}");
        assert_eq!(b.verbs().last().unwrap(), "nccl-open");
    }

    #[test]
    fn no_rebuild_while_a_rank_is_held() {
        let a = scripted("held-a", vec![comm(9, 0, 2, &[])], "");
        let b = scripted("held-b", vec![comm(9, 1, 2, &[])], "closed");
        let e = rebuild(&[a.rank.clone(), b.rank.clone()], 1000, &alone()).unwrap_err();
        assert!(e.to_string().contains("does not run yet"), "{e}");
        assert!(!a.verbs().contains(&"nccl-new-id".to_string()) && !a.verbs().contains(&"nccl-rebuild".to_string()));
    }

    #[test]
    fn local_communicators_need_no_peers() {
        let mut c = comm(3, 0, 4, &[(Lane::Coll, 2)]);
        c.local = true;
        assert_eq!(limits(&[vec![c]]).unwrap(), vec![vec![]]);
    }

    /// A coordinator on loopback for `n` hibers, and a way for each to join it.
    fn session(n: usize) -> (String, std::thread::JoinHandle<crate::coordinator::net::Outcome>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        (addr, std::thread::spawn(move || crate::coordinator::net::serve(&l, n, "secret", Duration::from_secs(20)).unwrap()))
    }

    fn join(addr: &str, name: &str) -> crate::coordinator::net::Remote {
        crate::coordinator::net::Remote::join(addr, "secret", name, Duration::from_secs(20), Local::default()).unwrap()
    }

    #[test]
    fn a_communicator_of_two_hibers_is_cut_and_built_again_across_them() {
        // Two jobs (two hosts, say), one rank each, one hiber each; a third hiber's job has
        // no NCCL rank and passes the same phases with nothing to say.
        let a = scripted("two-a", vec![comm(7, 0, 2, &[(Lane::Coll, 12)])], "");
        let b = scripted("two-b", vec![comm(7, 1, 2, &[(Lane::Coll, 10)])], "");
        let (addr, server) = session(3);
        let run = |rank: Rank, name: &'static str| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let r = join(&addr, name);
                r.barrier(Phase::Prepared).unwrap();
                cut(std::slice::from_ref(&rank), 1000, &r, true).map_err(|(e, _)| e).unwrap();
                rebuild(&[rank], 1000, &r).unwrap();
                r.barrier(Phase::Committed).unwrap();
            })
        };
        let (ta, tb) = (run(a.rank.clone(), "a"), run(b.rank.clone(), "b"));
        let c = join(&addr, "c");
        let tracked = crate::coordinator::Tracked::new(&c);
        tracked.barrier(Phase::Prepared).unwrap();
        tracked.catch_up(&Phase::NCCL_CUT).unwrap();
        tracked.catch_up(&Phase::NCCL_REBUILD).unwrap();
        tracked.barrier(Phase::Committed).unwrap();
        ta.join().unwrap();
        tb.join().unwrap();
        assert_eq!(server.join().unwrap(), crate::coordinator::net::Outcome::Done(Phase::Committed));
        // b was two all-reduces behind a, which is on another hiber: raised all the same.
        assert_eq!(
            b.verbs(),
            ["nccl-hold", "nccl-limit", "nccl-drain", "nccl-down", "status", "nccl-list", "nccl-open", "nccl-set-id", "nccl-rebuild", "nccl-open"]
        );
        assert_eq!(b.asked()[1], "nccl-limit 0000000000000007 c 12");
        // Rank 0's hiber draws the id; the other's rank builds with that same id.
        assert_eq!(
            a.verbs(),
            ["nccl-hold", "nccl-drain", "nccl-down", "status", "nccl-list", "nccl-open", "nccl-new-id", "nccl-set-id", "nccl-rebuild", "nccl-open"]
        );
        let set = |x: &ScriptedAgent| x.asked().into_iter().find(|m| m.starts_with("nccl-set-id")).unwrap();
        assert_eq!(set(&a), set(&b));
    }

    #[test]
    fn a_rank_of_another_hiber_that_cannot_drain_leaves_every_communicator_up() {
        let a = scripted("xdrain-a", vec![comm(7, 0, 2, &[(Lane::Coll, 3)])], "");
        let b = scripted("xdrain-b", vec![comm(7, 1, 2, &[(Lane::Coll, 3)])], "nccl-drain");
        let (addr, server) = session(2);
        let tb = {
            let (addr, rank) = (addr.clone(), b.rank.clone());
            std::thread::spawn(move || cut(&[rank], 1000, &join(&addr, "b"), true).unwrap_err())
        };
        let (e, down) = cut(std::slice::from_ref(&a.rank), 1000, &join(&addr, "a"), true).unwrap_err();
        assert!(!down && e.to_string().contains("bringing NCCL ranks to one cut"), "{e}");
        assert!(!tb.join().unwrap().1);
        assert!(!a.verbs().contains(&"nccl-down".to_string()) && !b.verbs().contains(&"nccl-down".to_string()));
        drop(server);
    }

    #[test]
    fn after_an_abort_the_hibers_build_their_ranks_again_together() {
        // Both cut; then b's hiber fails (its dump, say) and says so. a, waiting at the next
        // barrier, is told to abort; both undo, which builds the communicator again across
        // them in the coordinator's undo round.
        let a = scripted("undo-a", vec![comm(9, 0, 2, &[])], "");
        let b = scripted("undo-b", vec![comm(9, 1, 2, &[])], "");
        let (addr, server) = session(2);
        let tb = {
            let (addr, rank) = (addr.clone(), b.rank.clone());
            std::thread::spawn(move || {
                let r = join(&addr, "b");
                cut(std::slice::from_ref(&rank), 1000, &r, true).map_err(|(e, _)| e).unwrap();
                r.fail("injected: the dump failed");
                rebuild(&[rank], 1000, &r)
            })
        };
        let r = join(&addr, "a");
        cut(std::slice::from_ref(&a.rank), 1000, &r, true).map_err(|(e, _)| e).unwrap();
        let e = r.barrier(Phase::Quiesced).unwrap_err();
        assert!(e.0.contains("injected: the dump failed"), "{}", e.0);
        rebuild(std::slice::from_ref(&a.rank), 1000, &r).unwrap();
        tb.join().unwrap().unwrap();
        drop(r);
        assert!(matches!(server.join().unwrap(), crate::coordinator::net::Outcome::Aborted(why) if why.contains("'b' failed")));
        for x in [&a, &b] {
            assert_eq!(x.verbs().last().unwrap(), "nccl-open", "{:?}", x.verbs());
            assert!(x.verbs().contains(&"nccl-rebuild".to_string()));
        }
    }

    #[test]
    fn a_hiber_that_went_away_leaves_the_others_ranks_torn_down_with_a_reason() {
        let a = scripted("away-a", vec![comm(9, 0, 2, &[])], "");
        let b = scripted("away-b", vec![comm(9, 1, 2, &[])], "");
        let (addr, server) = session(2);
        let tb = {
            let (addr, rank) = (addr.clone(), b.rank.clone());
            std::thread::spawn(move || {
                let r = join(&addr, "b");
                cut(&[rank], 1000, &r, true).map_err(|(e, _)| e).unwrap();
                // Its hiber dies here: the connection ends.
            })
        };
        let r = join(&addr, "a");
        cut(std::slice::from_ref(&a.rank), 1000, &r, true).map_err(|(e, _)| e).unwrap();
        tb.join().unwrap();
        assert!(r.barrier(Phase::Quiesced).is_err());
        let e = rebuild(std::slice::from_ref(&a.rank), 1000, &r).unwrap_err();
        assert!(e.to_string().contains("1 of its 2 ranks"), "{e}");
        // Its open alone was refused (never built); nothing was built.
        let verbs = a.verbs();
        assert!(!verbs.contains(&"nccl-set-id".to_string()) && !verbs.contains(&"nccl-rebuild".to_string()), "{verbs:?}");
        drop(r);
        assert!(matches!(server.join().unwrap(), crate::coordinator::net::Outcome::Aborted(_)));
    }

    #[test]
    fn reports_travel_as_json_unchanged() {
        let c = on_gpu(comm(0xfedc_ba98_7654_3210, 3, 8, &[(Lane::Coll, 5), (Lane::Send(2), 7), (Lane::Recv(4), 1)]), "GPU-9e84469c");
        assert_eq!(CommReport::from_json(&c.to_json()), Some(c.clone()));
        let all = vec![
            serde_json::json!({"ranks": reports_json(&[vec![c.clone()]])}),
            serde_json::Value::Null,
            serde_json::json!({"ranks": reports_json(&[vec![], vec![c.clone()]])}),
        ];
        let (ranks, offset, owners) = gathered_ranks(&all, 2, "ranks").unwrap();
        assert_eq!((ranks.len(), offset), (3, 1), "participant 1 sent nothing; 2's ranks follow 0's");
        assert_eq!(owners, [0, 2, 2]);
        assert!(gathered_ranks(&[serde_json::json!({"ranks": [[{"key": 1}]]})], 0, "ranks").is_err());
    }

    fn on_gpu(mut c: CommReport, gpu: &str) -> CommReport {
        c.gpu = gpu.into();
        c
    }

    #[test]
    fn communicators_over_the_network_transport_with_ranks_on_one_gpu_are_refused_before_anything_drains() {
        // Ranks of two hibers whose GPUs the agents could not name: both find it in the
        // gathered counts, and neither drains.
        let a = scripted("net-a", vec![comm(7, 0, 2, &[(Lane::Coll, 3)])], "");
        let b = scripted("net-b", vec![comm(7, 1, 2, &[(Lane::Coll, 3)])], "");
        let (addr, server) = session(2);
        let tb = {
            let (addr, rank) = (addr.clone(), b.rank.clone());
            std::thread::spawn(move || cut(&[rank], 1000, &join(&addr, "b"), false).unwrap_err())
        };
        let (e, down) = cut(std::slice::from_ref(&a.rank), 1000, &join(&addr, "a"), false).unwrap_err();
        assert!(!down && e.to_string().contains("jobs of several hibers") && e.to_string().contains("not known"), "{e}");
        assert!(e.hint().unwrap().contains("HIBER_NCCL_NET=1"), "{e}");
        assert!(!tb.join().unwrap().1);
        assert_eq!(a.verbs(), ["nccl-hold"]);
        assert_eq!(b.verbs(), ["nccl-hold"]);
        drop(server);
        // Two hibers' ranks on one GPU; one hiber told to try it and the other not: both
        // refuse, neither drains.
        let c = scripted("net-c", vec![on_gpu(comm(8, 0, 2, &[(Lane::Coll, 3)]), "GPU-same")], "");
        let d = scripted("net-d", vec![on_gpu(comm(8, 1, 2, &[(Lane::Coll, 3)]), "GPU-same")], "");
        let (addr, server) = session(2);
        let td = {
            let (addr, rank) = (addr.clone(), d.rank.clone());
            std::thread::spawn(move || cut(&[rank], 1000, &join(&addr, "d"), false).unwrap_err())
        };
        let (e, down) = cut(std::slice::from_ref(&c.rank), 1000, &join(&addr, "c"), true).unwrap_err();
        assert!(!down && e.to_string().contains("jobs of several hibers") && e.to_string().contains("two of its ranks on GPU-same"), "{e}");
        assert!(!td.join().unwrap().1);
        assert_eq!((c.verbs(), d.verbs()), (vec!["nccl-hold".to_string()], vec!["nccl-hold".to_string()]));
        drop(server);
        // One job whose two ranks are hosts of their own to NCCL, on one GPU: refused once
        // held; on a GPU each, cut.
        let mut child = std::process::Command::new("sleep").arg("30").env("NCCL_HOSTID", "elsewhere").spawn().unwrap();
        // Its environment reads empty until its exec is through.
        while crate::proctree::env_var(child.id() as i32, "NCCL_HOSTID").is_none() {
            std::thread::sleep(Duration::from_millis(5));
        }
        let as_hosts = |a: &ScriptedAgent| Rank { pid: child.id() as i32, name: a.rank.name.clone() };
        let e = scripted("host-e", vec![on_gpu(comm(9, 0, 2, &[(Lane::Coll, 3)]), "GPU-one")], "");
        let f = scripted("host-f", vec![on_gpu(comm(9, 1, 2, &[(Lane::Coll, 3)]), "GPU-one")], "");
        let (err, down) = cut(&[as_hosts(&e), as_hosts(&f)], 1000, &alone(), false).unwrap_err();
        assert!(!down && err.to_string().contains("NCCL_HOSTID=elsewhere") && err.to_string().contains("two of its ranks on GPU-one"), "{err}");
        assert_eq!((e.verbs(), f.verbs()), (vec!["nccl-hold".to_string()], vec!["nccl-hold".to_string()]));
        let g = scripted("host-g", vec![on_gpu(comm(10, 0, 2, &[(Lane::Coll, 3)]), "GPU-one")], "");
        let h = scripted("host-h", vec![on_gpu(comm(10, 1, 2, &[(Lane::Coll, 3)]), "GPU-two")], "");
        cut(&[as_hosts(&g), as_hosts(&h)], 1000, &alone(), false).unwrap();
        assert_eq!(g.verbs(), ["nccl-hold", "nccl-drain", "nccl-down"]);
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn ranks_of_several_hibers_on_a_gpu_each_are_cut_without_being_told_to_try() {
        // The shape of a job across hosts: each hiber's rank on a GPU of its own.
        let a = scripted("gpus-a", vec![on_gpu(comm(11, 0, 2, &[(Lane::Coll, 5)]), "GPU-a")], "");
        let b = scripted("gpus-b", vec![on_gpu(comm(11, 1, 2, &[(Lane::Coll, 4)]), "GPU-b")], "");
        let (addr, server) = session(2);
        let tb = {
            let (addr, rank) = (addr.clone(), b.rank.clone());
            std::thread::spawn(move || cut(&[rank], 1000, &join(&addr, "b"), false))
        };
        cut(std::slice::from_ref(&a.rank), 1000, &join(&addr, "a"), false).unwrap();
        tb.join().unwrap().unwrap();
        assert_eq!(a.verbs(), ["nccl-hold", "nccl-drain", "nccl-down"]);
        assert_eq!(b.verbs(), ["nccl-hold", "nccl-limit", "nccl-drain", "nccl-down"]);
        drop(server);
    }

    #[test]
    fn a_hiber_lost_during_the_rebuild_leaves_the_others_building_in_the_undo_round() {
        // a and b share a communicator; c has no rank. After the cut, c's hiber dies while a
        // and b build again: the coordinator aborts, and their rebuild goes on in the undo
        // round, where it began, to the end.
        let a = scripted("lost-a", vec![comm(9, 0, 2, &[])], "");
        let b = scripted("lost-b", vec![comm(9, 1, 2, &[])], "");
        let (addr, server) = session(3);
        let run = |rank: Rank, name: &'static str| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let r = join(&addr, name);
                cut(std::slice::from_ref(&rank), 1000, &r, true).map_err(|(e, _)| e).unwrap();
                let rebuilt = rebuild(&[rank], 1000, &r);
                (rebuilt, r.barrier(Phase::Committed))
            })
        };
        let (ta, tb) = (run(a.rank.clone(), "a"), run(b.rank.clone(), "b"));
        let c = join(&addr, "c");
        let tracked = crate::coordinator::Tracked::new(&c);
        tracked.catch_up(&Phase::NCCL_CUT).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        drop(tracked);
        drop(c);
        for t in [ta, tb] {
            let (rebuilt, committed) = t.join().unwrap();
            rebuilt.unwrap();
            assert!(committed.is_err(), "the cut as a whole was aborted");
        }
        for x in [&a, &b] {
            assert_eq!(x.verbs().last().unwrap(), "nccl-open", "{:?}", x.verbs());
        }
        assert!(matches!(server.join().unwrap(), crate::coordinator::net::Outcome::Aborted(_)));
    }
}
