//! A coordinator across processes and hosts: one `hiber coordinate` server, and each
//! participating hiber (`checkpoint` or `restore` with `--coordinator`) as its client.
//!
//! The protocol (version 4) is one JSON object per line, over TLS 1.3 (see below):
//!
//! ```text
//! participant → coordinator   {"v": 4, "hello": {"name": NAME}}
//! coordinator → participant   {"welcome": {"index": I, "participants": N, "timeout_s": T}}
//!                                                                   (once all N joined)
//! participant → coordinator   {"reached": PHASE}                                (after each phase)
//!                             {"reached": PHASE, "data": D}    (the same, with data to exchange)
//!                             {"failed": REASON}               (it failed: the others abort)
//! coordinator → participant   {"go": PHASE}   once every participant reached PHASE
//!                             {"gathered": {"phase": PHASE, "data": [D0, D1, ...]}}
//!                                             the same, when they sent data: every
//!                                             participant's, by index
//!                             {"abort": REASON}  when one failed, left, or reached another phase
//! ```
//!
//! The exchange is an all-gather at a barrier: every participant hears the same list, so
//! each can compute the same answer from it without a second round. It is what a cut of
//! NCCL communicators that span hosts runs on (see `engine/agent/nccl.rs`): each host's
//! ranks' collective counts gathered (`nccl_held`), from which every host derives the same
//! limits; every host drained before any tears down (`nccl_drained`); and at the rebuild,
//! the torn-down ranks (`nccl_listed`), the fresh unique id from the host of each
//! communicator's rank 0 (`nccl_ids`), and every host built before any lets calls through
//! (`nccl_built`). One participant's data is at most [`MAX_DATA`] bytes of JSON. At one
//! phase either every participant sends data or none does (the coordinator aborts a mix).
//! An index is the order in which participants joined, nothing more: a rank's host says
//! who it is in its data.
//!
//! **The undo round** (version 3). Once the coordinator has told everyone to abort, the
//! participants still connected go on passing the phases of their undo together: the NCCL
//! rebuild's (`nccl_listed`, `nccl_ids`, `nccl_built`), which bring back the communicators
//! a cut tore down on every host. Each such phase gathers from those still connected
//! (null in the place of one that left); a participant with nothing to undo just closes
//! its connection. A phase of the undo already under way when the abort comes (a rebuild
//! after `--leave-running`) goes on in the round with those who reached it: a participant
//! waiting there skips the abort and gets its answer. A participant that fails says so (`failed`) and stays for the round;
//! one that goes away is out of it, and the communicators it had ranks of cannot be built
//! again (their ranks elsewhere say so and wait for `hiber recover`). The round ends when
//! every participant has left, or at a phase's deadline.
//!
//! PHASE is a [`Phase`] in snake case (`prepared`, `quiesced`, `captured`, `dumped`,
//! `committed`; `restore_prepared`, `processes_restored`, `devices_restored`; the NCCL
//! phases above). A participant that fails says so, or closes its connection; the
//! coordinator then tells every other one to abort, and each undoes its own steps: the
//! applications run on, and no image of the cut is kept. After the last phase of an operation (`committed` or
//! `devices_restored`) the coordinator ends. Nothing in the protocol is tied to one host:
//! participants name themselves, and the coordinator knows them only by their connection.
//!
//! Time: the coordinator gives every phase one deadline, T seconds from the moment the
//! previous one passed (joining too), and aborts everyone when it passes; a participant
//! waits T plus a margin, so that it hears the abort rather than giving up on its own
//! while the others are told to go on.
//!
//! The session token keeps strangers out of a session (the coordinator listens on a TCP
//! port): a shared secret of at least 128 bits, never written to a log, and never sent.
//! Every connection is a [`crate::secure`] channel keyed by it, as `hiber migrate`'s: the
//! coordinator proves it holds the token with a TLS certificate made from it, each
//! participant proves it inside the encrypted channel, and what the session says (phases,
//! the NCCL ranks' ids and counts it exchanges) is encrypted on the wire. A participant
//! with another token, or a stranger, fails the handshake and is turned away; the session
//! waits on for its own.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{BarrierError, Coordinator, Local, Phase};
use crate::secure::{Channel, Duplex, SecureError, Token};

pub const PROTOCOL_VERSION: u32 = 5;
/// The most one participant sends in one exchange, as JSON.
pub const MAX_DATA: usize = 256 << 10;
/// The longest line the coordinator reads: a participant's message with its data.
const MAX_UP_LINE: u64 = MAX_DATA as u64 + (4 << 10);
/// The longest line a participant reads: every participant's data at once.
const MAX_DOWN_LINE: u64 = 64 << 20;
/// The longest the coordinator waits to hand one participant its answer.
const ANSWER_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long past the coordinator's deadline a participant waits before it gives up.
const PARTICIPANT_MARGIN: Duration = Duration::from_secs(60);
/// A token shorter than this (in characters) is refused.
pub const MIN_TOKEN_CHARS: usize = 32;

/// A fresh session token: 128 random bits, in hex.
pub fn session_token() -> std::io::Result<String> {
    let mut t = [0u8; 16];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut t)?;
    Ok(t.iter().map(|b| format!("{b:02x}")).collect())
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct Hello {
    pub name: String,
}

/// How long a connection has to finish its handshake and say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// What a participant sends (see the module's wire shapes).
#[derive(Debug, Clone, PartialEq)]
pub enum Up {
    Hello { v: u32, hello: Hello },
    Reached { reached: Phase, data: Option<serde_json::Value> },
    Failed { failed: String },
}

/// What the coordinator sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Down {
    Welcome { index: usize, participants: usize, timeout_s: u64 },
    Go(Phase),
    Gathered { phase: Phase, data: Vec<serde_json::Value> },
    Abort(String),
}

/// A message as the line that carries it.
fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let mut line = serde_json::to_vec(msg).expect("messages serialize");
    line.push(b'\n');
    line
}

fn send<T: Serialize>(w: &Duplex, msg: &T) -> std::io::Result<()> {
    w.write_all(&encode(msg))
}

/// Reads one message (at most `max` bytes); `None` at the end of the stream.
fn recv<T: for<'de> Deserialize<'de>, R: Read>(r: &mut BufReader<R>, max: u64) -> std::io::Result<Option<T>> {
    let mut line = String::new();
    if std::io::Read::take(&mut *r, max).read_line(&mut line)? == 0 {
        return Ok(None);
    }
    if !line.ends_with('\n') {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "a message too long, or cut short"));
    }
    serde_json::from_str(&line).map(Some).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("bad message: {e}")))
}

// The wire shapes: `{"v":2,"hello":{...}}`, `{"reached":"quiesced"}` (and `"data"` beside
// it), `{"welcome":{...}}`, `{"go":"quiesced"}`, `{"gathered":{...}}`, `{"abort":"..."}`.
// Untagged on the way up (two distinct shapes), externally tagged on the way down.
impl Up {
    fn to_value(&self) -> serde_json::Value {
        match self {
            Up::Hello { v, hello } => serde_json::json!({"v": v, "hello": hello}),
            Up::Reached { reached, data: None } => serde_json::json!({"reached": reached}),
            Up::Reached { reached, data: Some(d) } => serde_json::json!({"reached": reached, "data": d}),
            Up::Failed { failed } => serde_json::json!({"failed": failed}),
        }
    }

    fn from_value(v: &serde_json::Value) -> Option<Up> {
        if let Some(h) = v.get("hello") {
            return Some(Up::Hello { v: u32::try_from(v.get("v")?.as_u64()?).ok()?, hello: serde_json::from_value(h.clone()).ok()? });
        }
        if let Some(f) = v.get("failed") {
            return Some(Up::Failed { failed: f.as_str()?.to_string() });
        }
        Some(Up::Reached { reached: serde_json::from_value(v.get("reached")?.clone()).ok()?, data: v.get("data").cloned() })
    }
}

fn send_up(w: &mut Channel, msg: &Up) -> std::io::Result<()> {
    w.write_all(&encode(&msg.to_value()))?;
    w.flush()
}

fn recv_up<R: Read>(r: &mut BufReader<R>) -> std::io::Result<Option<Up>> {
    match recv::<serde_json::Value, R>(r, MAX_UP_LINE)? {
        None => Ok(None),
        Some(v) => Up::from_value(&v).map(Some).ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "not a participant's message")),
    }
}

/// A participant: each barrier reports the phase and waits for the coordinator's answer.
/// Faults injected through `HIBER_FAIL_AT` (the `local` hook) fail the barrier before it is
/// reported, as a real failure would.
pub struct Remote {
    local: Local,
    /// This participant's place in every gathered list.
    index: usize,
    conn: Mutex<BufReader<Channel>>,
    timeout: Duration,
    /// Told to abort, or failed: only the phases of the undo are passed from here on.
    aborted: std::sync::atomic::AtomicBool,
}

impl Remote {
    /// Joins session `session` of the coordinator at `addr` as `name`, waiting (up to
    /// `timeout`) until every participant has joined.
    pub fn join(addr: &str, session: &str, name: &str, timeout: Duration, local: Local) -> Result<Remote, BarrierError> {
        let err = |what: &str, e: &dyn std::fmt::Display| BarrierError(format!("{what} {addr}: {e}"));
        let token = Token::from_bytes(session.as_bytes());
        let mut ch = Channel::connect(addr, &token, HELLO_TIMEOUT).map_err(|e| match e {
            SecureError::Connect { source, .. } => err("cannot reach the coordinator at", &source),
            SecureError::Identity { .. } | SecureError::Refused => BarrierError(format!(
                "the coordinator at {addr} is not serving this session: not a participant of this session (another token, or a hiber that speaks another protocol version than {PROTOCOL_VERSION})"
            )),
            other => err("no secure connection to the coordinator at", &other),
        })?;
        send_up(&mut ch, &Up::Hello { v: PROTOCOL_VERSION, hello: Hello { name: name.into() } }).map_err(|e| err("cannot talk to the coordinator at", &e))?;
        ch.set_read_timeout(Some(timeout)).map_err(|e| err("socket", &e))?;
        let mut reader = BufReader::new(ch);
        let (index, timeout) = match recv::<Down, _>(&mut reader, MAX_DOWN_LINE) {
            Ok(Some(Down::Welcome { index, participants, timeout_s })) => {
                tracing::debug!(index, participants, "joined the coordinator's session");
                // Past the coordinator's own deadline: it aborts everyone before this one
                // would give up alone.
                let t = Duration::from_secs(timeout_s) + PARTICIPANT_MARGIN;
                reader.get_ref().set_read_timeout(Some(t)).map_err(|e| err("socket", &e))?;
                (index, t)
            }
            Ok(Some(Down::Abort(why))) => return Err(BarrierError(format!("the coordinator refused: {why}"))),
            Ok(other) => return Err(BarrierError(format!("the coordinator at {addr} answered {other:?}"))),
            Err(e) => return Err(err("no welcome from the coordinator at", &e)),
        };
        Ok(Remote { local, index, conn: Mutex::new(reader), timeout, aborted: false.into() })
    }

    /// Reports `phase` (with `data`, if any) and waits for the coordinator's answer: every
    /// participant's data by index, or nothing when none sent any.
    fn report(&self, phase: Phase, data: Option<serde_json::Value>) -> Result<Option<Vec<serde_json::Value>>, BarrierError> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.aborted.load(SeqCst) && !phase.in_undo() {
            return Err(BarrierError(format!("the session was aborted before {phase:?}")));
        }
        self.local.barrier(phase)?;
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let reader = &mut *conn;
        send_up(reader.get_mut(), &Up::Reached { reached: phase, data }).map_err(|e| BarrierError(format!("lost the coordinator at {phase:?}: {e}")))?;
        loop {
            return match recv::<Down, _>(reader, MAX_DOWN_LINE) {
                Ok(Some(Down::Go(p))) if p == phase => Ok(None),
                Ok(Some(Down::Gathered { phase: p, data })) if p == phase => Ok(Some(data)),
                // In the undo round: the abort this one knows of already. Or an abort during
                // a phase of the undo (a rebuild of NCCL communicators): the coordinator goes
                // on with it in the undo round, and answers there.
                Ok(Some(Down::Abort(_))) if self.aborted.load(SeqCst) => continue,
                Ok(Some(Down::Abort(why))) if phase.in_undo() => {
                    tracing::warn!(%why, ?phase, "the session aborted; this phase goes on in the undo round");
                    self.aborted.store(true, SeqCst);
                    continue;
                }
                Ok(Some(Down::Abort(why))) => {
                    self.aborted.store(true, SeqCst);
                    Err(BarrierError(format!("another participant failed, so this one aborts too: {why}")))
                }
                Ok(Some(other)) => Err(BarrierError(format!("the coordinator answered {other:?} at {phase:?}"))),
                Ok(None) => Err(BarrierError(format!("the coordinator went away at {phase:?}"))),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    Err(BarrierError(format!("no answer from the coordinator within {} s at {phase:?}", self.timeout.as_secs())))
                }
                Err(e) => Err(BarrierError(format!("lost the coordinator at {phase:?}: {e}"))),
            };
        }
    }
}

impl Coordinator for Remote {
    fn is_shared(&self) -> bool {
        true
    }

    fn index(&self) -> usize {
        self.index
    }

    fn fail(&self, why: &str) {
        if self.aborted.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        // At most a line of it: the others only show it.
        let why: String = why.chars().take(1000).collect();
        if send_up(conn.get_mut(), &Up::Failed { failed: why }).is_err() {
            conn.get_ref().shutdown();
        }
    }

    fn barrier(&self, phase: Phase) -> Result<(), BarrierError> {
        // Where the others exchange data, the coordinator aborts: no list comes back here.
        self.report(phase, None).map(drop)
    }

    fn exchange(&self, phase: Phase, data: serde_json::Value) -> Result<Vec<serde_json::Value>, BarrierError> {
        let size = serde_json::to_vec(&data).map_err(|e| BarrierError(format!("cannot encode the data of {phase:?}: {e}")))?.len();
        if size > MAX_DATA {
            // Refused before it is reported, and the connection ended: the others hear at
            // once that this one failed, and abort.
            let conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
            conn.get_ref().shutdown();
            return Err(BarrierError(format!("{size} bytes to exchange at {phase:?}, more than the protocol's {MAX_DATA}")));
        }
        let index = self.index;
        match self.report(phase, Some(data))? {
            Some(all) if index < all.len() => Ok(all),
            Some(all) => Err(BarrierError(format!("the coordinator gathered {} participants' data at {phase:?}, without this one's ({index})", all.len()))),
            None => Err(BarrierError(format!("the coordinator gathered no data at {phase:?}"))),
        }
    }
}

/// How a coordinated operation ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Every participant passed every phase up to this last one.
    Done(Phase),
    /// The operation was aborted everywhere, for this reason.
    Aborted(String),
}

/// What a connection's reader thread hands the coordinator.
enum Heard {
    /// Participant I joined, by this name: its connection, for answers.
    Joined(usize, String, Arc<Duplex>),
    Reached(usize, Phase, Option<serde_json::Value>),
    /// A participant said it failed, and why.
    Failed(usize, String),
    /// A participant left, failed, or sent what it should not.
    Lost(usize, String),
}

/// Serves one session on `listener`: waits for `participants` to join with `session`, then
/// holds them at each barrier until all reach it, and tells all to abort when one fails,
/// leaves, reaches another phase, or the phase's deadline (`timeout` after the last one)
/// passes. Ends after the last phase of the operation. Every connection has a reader
/// thread of its own, so that neither a slow participant nor a stranger holds the others.
pub fn serve(listener: &TcpListener, participants: usize, session: &str, timeout: Duration) -> std::io::Result<Outcome> {
    let (tx, rx) = std::sync::mpsc::channel::<Heard>();
    let joined = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let accept = listener.try_clone()?;
    accept.set_nonblocking(false)?;
    // Handshakes: each connection on its own thread, which then keeps reading for it.
    {
        let (tx, joined, token) = (tx.clone(), joined.clone(), Arc::new(Token::from_bytes(session.as_bytes())));
        std::thread::Builder::new().name("hiber-coordinator-accept".into()).spawn(move || {
            while joined.load(std::sync::atomic::Ordering::SeqCst) < participants {
                let Ok((stream, peer)) = accept.accept() else { return };
                let (tx, joined, token) = (tx.clone(), joined.clone(), token.clone());
                let _ = std::thread::Builder::new()
                    .name("hiber-coordinator-conn".into())
                    .spawn(move || handshake_then_read(stream, peer, &token, participants, &joined, &tx));
            }
        })?;
    }
    drop(tx);
    let abort = |conns: &[(String, Arc<Duplex>)], why: String| {
        for (_, s) in conns {
            let _ = send(s, &Down::Abort(why.clone()));
        }
        Ok(Outcome::Aborted(why))
    };
    let deadline = std::time::Instant::now() + timeout;
    let mut slots: Vec<Option<(String, Arc<Duplex>)>> = (0..participants).map(|_| None).collect();
    let mut early: Vec<Heard> = Vec::new();
    while slots.iter().any(Option::is_none) {
        match rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
            Ok(Heard::Joined(i, name, stream)) => slots[i] = Some((name, stream)),
            // A participant that reports before all joined is answered once they have.
            Ok(h) => early.push(h),
            Err(_) => {
                let joined: Vec<(String, Arc<Duplex>)> = slots.into_iter().flatten().collect();
                return abort(&joined, format!("only {} of {participants} participants joined within {} s", joined.len(), timeout.as_secs()));
            }
        }
    }
    let conns: Vec<(String, Arc<Duplex>)> = slots.into_iter().flatten().collect();
    for (i, (_, s)) in conns.iter().enumerate() {
        send(s, &Down::Welcome { index: i, participants, timeout_s: timeout.as_secs() })?;
    }
    let mut pending = early.into_iter();
    // After welcome, an abort is followed by the undo round.
    // `gone`: a participant known to have left, which the round does not wait for. `carry`:
    // the phase under way, when it is one of the undo's (a rebuild of NCCL communicators),
    // with who reached it: the round goes on with it rather than making them start over.
    let abort_from = |conns: &[(String, Arc<Duplex>)], why: String, gone: Option<usize>, carry: Option<Carried>| {
        for (_, s) in conns {
            let _ = send(s, &Down::Abort(why.clone()));
        }
        undo_round(conns, gone, carry, &rx, timeout);
        Ok(Outcome::Aborted(why))
    };
    loop {
        let deadline = std::time::Instant::now() + timeout;
        let mut phase: Option<Phase> = None;
        let mut reached = vec![false; participants];
        let mut data: Vec<Option<serde_json::Value>> = vec![None; participants];
        let carried = |phase: Option<Phase>, reached: &[bool], data: &[Option<serde_json::Value>]| {
            phase.filter(|p| p.in_undo()).map(|p| Carried { phase: p, reached: reached.to_vec(), data: data.to_vec() })
        };
        let abort = |conns: &[(String, Arc<Duplex>)], why: String, phase: Option<Phase>, reached: &[bool], data: &[Option<serde_json::Value>]| {
            abort_from(conns, why, None, carried(phase, reached, data))
        };
        while reached.iter().any(|r| !r) {
            let heard = match pending.next() {
                Some(h) => h,
                None => match rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
                    Ok(h) => h,
                    Err(_) => {
                        let late: Vec<&str> = conns.iter().zip(&reached).filter(|(_, r)| !**r).map(|((n, _), _)| n.as_str()).collect();
                        return abort(
                            &conns,
                            format!("{} did not reach {} within {} s", late.join(", "), next_name(phase), timeout.as_secs()),
                            phase,
                            &reached,
                            &data,
                        );
                    }
                },
            };
            match heard {
                Heard::Reached(i, got, d) => {
                    let name = &conns[i].0;
                    match phase {
                        None => phase = Some(got),
                        Some(p) if p == got => {}
                        Some(p) => {
                            return abort(&conns, format!("participant '{name}' reached {got:?} while the others reached {p:?}"), phase, &reached, &data)
                        }
                    }
                    if reached[i] {
                        return abort(&conns, format!("participant '{name}' reported {got:?} twice"), phase, &reached, &data);
                    }
                    reached[i] = true;
                    data[i] = d;
                }
                Heard::Lost(i, why) => {
                    return abort_from(
                        &conns,
                        format!("participant '{}' {why} before {}", conns[i].0, next_name(phase)),
                        Some(i),
                        carried(phase, &reached, &data),
                    )
                }
                Heard::Failed(i, why) => return abort(&conns, format!("participant '{}' failed: {why}", conns[i].0), phase, &reached, &data),
                Heard::Joined(..) => {}
            }
        }
        let p = phase.expect("at least one participant");
        // Every participant is waiting for this answer; one that cannot be told makes the
        // rest abort (those told to go already have: a connection lost in these
        // microseconds is the one case the protocol cannot make whole).
        let sent = data.iter().filter(|d| d.is_some()).count();
        if sent > 0 && sent < participants {
            // A host that skipped an exchange the others made would go on without its part.
            let silent: Vec<&str> = conns.iter().zip(&data).filter(|(_, d)| d.is_none()).map(|((n, _), _)| n.as_str()).collect();
            return abort(&conns, format!("{} passed {p:?} without the data the others exchanged there", silent.join(", ")), None, &reached, &data);
        }
        let answer = if sent > 0 { Down::Gathered { phase: p, data: data.into_iter().flatten().collect() } } else { Down::Go(p) };
        // Encoded once for all (it may be megabytes), and within what a participant reads.
        let line = encode(&answer);
        if line.len() as u64 > MAX_DOWN_LINE {
            return abort(&conns, format!("the data gathered at {p:?} is {} bytes, more than the protocol's {MAX_DOWN_LINE}", line.len()), None, &[], &[]);
        }
        for (i, (name, s)) in conns.iter().enumerate() {
            if let Err(e) = s.write_all(&line) {
                // Those told already hear the abort at their next phase.
                return abort_from(&conns, format!("participant '{name}' could not be told to go on past {p:?}: {e}"), Some(i), None);
            }
        }
        tracing::info!(phase = ?p, "every participant passed");
        if matches!(p, Phase::Committed | Phase::DevicesRestored) {
            return Ok(Outcome::Done(p));
        }
    }
}

/// A phase of the undo under way when the coordinator aborted: who reached it, with what.
struct Carried {
    phase: Phase,
    reached: Vec<bool>,
    data: Vec<Option<serde_json::Value>>,
}

/// After an abort: the participants still connected pass the phases of their undo
/// ([`Phase::in_undo`]) together, each hearing what every other one there sent (null in the
/// place of one that left or has nothing to undo). Returns once every participant has left,
/// or when a phase's deadline passes.
fn undo_round(conns: &[(String, Arc<Duplex>)], gone: Option<usize>, carry: Option<Carried>, rx: &std::sync::mpsc::Receiver<Heard>, timeout: Duration) {
    let n = conns.len();
    let mut live: Vec<bool> = (0..n).map(|i| Some(i) != gone).collect();
    undo_phases(conns, &mut live, carry, rx, timeout);
    // Every connection ends here (its reader thread would keep it open): a participant
    // still waiting hears that the session is over.
    for (_, s) in conns {
        s.shutdown();
    }
}

fn undo_phases(conns: &[(String, Arc<Duplex>)], live: &mut [bool], mut carry: Option<Carried>, rx: &std::sync::mpsc::Receiver<Heard>, timeout: Duration) {
    let n = conns.len();
    loop {
        let deadline = std::time::Instant::now() + timeout;
        let (mut phase, mut reached, mut data) = match carry.take() {
            Some(c) => (Some(c.phase), c.reached, c.data),
            None => (None, vec![false; n], vec![None; n]),
        };
        while live.iter().zip(&reached).any(|(l, r)| *l && !*r) {
            let Ok(heard) = rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) else {
                tracing::warn!("the undo round ended at its deadline");
                return;
            };
            match heard {
                Heard::Reached(i, p, d) if p.in_undo() && live[i] && !reached[i] => {
                    if phase.is_some_and(|q| q != p) {
                        // Out of step with the others: it cannot take part.
                        live[i] = false;
                        conns[i].1.shutdown();
                        continue;
                    }
                    phase = Some(p);
                    reached[i] = true;
                    data[i] = d;
                }
                Heard::Lost(i, _) => live[i] = false,
                // A phase of the aborted operation, or its failure: it was told to abort.
                _ => {}
            }
        }
        let Some(p) = phase else { return };
        // What one that left sent is not passed on: its part will not happen.
        let data = data.into_iter().zip(live.iter()).map(|(d, l)| if *l { d.unwrap_or_default() } else { serde_json::Value::Null }).collect();
        let line = encode(&Down::Gathered { phase: p, data });
        for (i, (_, s)) in conns.iter().enumerate() {
            if reached[i] && live[i] && s.write_all(&line).is_err() {
                live[i] = false;
            }
        }
        tracing::info!(phase = ?p, "the participants undoing passed");
    }
}

/// One connection: its handshake (turned away without the session's token) and hello,
/// then every message it sends, as [`Heard`], until it ends.
fn handshake_then_read(
    stream: TcpStream,
    peer: std::net::SocketAddr,
    token: &Token,
    participants: usize,
    joined: &std::sync::atomic::AtomicUsize,
    tx: &std::sync::mpsc::Sender<Heard>,
) {
    let conn = match Channel::accept(stream, token, HELLO_TIMEOUT).and_then(|ch| Duplex::new(ch).map_err(SecureError::from)) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            // A stranger, or a participant of another session: turned away, the session
            // waits on.
            tracing::warn!(%peer, error = %e, "a connection without this session's token was turned away");
            return;
        }
    };
    let _ = conn.set_read_timeout(Some(HELLO_TIMEOUT));
    let stream = conn.clone();
    let mut reader = BufReader::new(&*conn);
    let name = match recv_up(&mut reader) {
        Ok(Some(Up::Hello { v, hello })) if v == PROTOCOL_VERSION => hello.name,
        Ok(Some(Up::Hello { v, .. })) => {
            let _ = send(&stream, &Down::Abort(format!("protocol version {v}; this coordinator speaks {PROTOCOL_VERSION}")));
            return;
        }
        _ => {
            tracing::warn!(%peer, "a participant that did not say hello was turned away");
            let _ = send(&stream, &Down::Abort("no hello".into()));
            return;
        }
    };
    let index = joined.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    if index >= participants {
        let _ = send(&stream, &Down::Abort(format!("the session already has its {participants} participants")));
        return;
    }
    tracing::info!(%name, %peer, "participant joined");
    let _ = stream.set_read_timeout(None);
    // A participant that stops reading must not hold the others' answers for ever.
    let _ = stream.set_write_timeout(Some(ANSWER_WRITE_TIMEOUT));
    if tx.send(Heard::Joined(index, name, stream.clone())).is_err() {
        return;
    }
    loop {
        let heard = match recv_up(&mut reader) {
            Ok(Some(Up::Reached { reached, data })) => Heard::Reached(index, reached, data),
            Ok(Some(Up::Failed { failed })) => Heard::Failed(index, failed),
            Ok(None) => Heard::Lost(index, "failed or left".into()),
            Ok(Some(other)) => Heard::Lost(index, format!("sent {other:?}")),
            Err(e) => Heard::Lost(index, format!("broke the protocol ({e})")),
        };
        let lost = matches!(heard, Heard::Lost(..));
        if tx.send(heard).is_err() || lost {
            return;
        }
    }
}

fn next_name(after: Option<Phase>) -> String {
    match after {
        None => "reaching the next phase".into(),
        Some(p) => format!("{p:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coordinator(n: usize) -> (String, std::thread::JoinHandle<Outcome>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        (addr, std::thread::spawn(move || serve(&l, n, "secret", Duration::from_secs(20)).unwrap()))
    }

    const CHECKPOINT: [Phase; 5] = [Phase::Prepared, Phase::Quiesced, Phase::Captured, Phase::Dumped, Phase::Committed];

    /// `n` participants join the session at `addr` and pass every phase of a checkpoint.
    fn all_pass_every_checkpoint_phase(addr: &str, n: usize) {
        let parts: Vec<_> = (0..n)
            .map(|i| {
                let addr = addr.to_string();
                std::thread::spawn(move || {
                    let r = Remote::join(&addr, "secret", &format!("p{i}"), Duration::from_secs(20), Local::default()).unwrap();
                    CHECKPOINT.iter().map(|&p| r.barrier(p)).collect::<Result<Vec<_>, _>>()
                })
            })
            .collect();
        for p in parts {
            p.join().unwrap().unwrap();
        }
    }

    #[test]
    fn all_participants_pass_every_phase_together() {
        let (addr, server) = coordinator(3);
        all_pass_every_checkpoint_phase(&addr, 3);
        assert_eq!(server.join().unwrap(), Outcome::Done(Phase::Committed));
    }

    #[test]
    fn one_failure_aborts_every_participant_at_that_phase() {
        let (addr, server) = coordinator(2);
        let a = {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let r = Remote::join(&addr, "secret", "a", Duration::from_secs(20), Local::default()).unwrap();
                CHECKPOINT.iter().map(|&p| r.barrier(p).map(|()| p)).collect::<Vec<_>>()
            })
        };
        // b fails after it was prepared (its quiesce fails): it reports nothing more and
        // closes its connection, as a hiber that aborts and exits does.
        let b = std::thread::spawn(move || {
            let r = Remote::join(
                &addr,
                "secret",
                "b",
                Duration::from_secs(20),
                Local::with_hook(|p| if p == Phase::Quiesced { Err(BarrierError("injected".into())) } else { Ok(()) }),
            )
            .unwrap();
            assert!(r.barrier(Phase::Prepared).is_ok());
            let e = r.barrier(Phase::Quiesced).unwrap_err();
            drop(r);
            e
        });
        assert_eq!(b.join().unwrap().0, "injected");
        let got = a.join().unwrap();
        assert!(got[0].is_ok(), "both were prepared");
        let e = got[1].as_ref().unwrap_err();
        assert!(e.0.contains("another participant failed") && e.0.contains("'b'"), "{}", e.0);
        assert!(matches!(server.join().unwrap(), Outcome::Aborted(_)));
    }

    #[test]
    fn an_exchange_gives_every_participant_everyones_data_by_index() {
        let (addr, server) = coordinator(3);
        let parts: Vec<_> = (0..3)
            .map(|i| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let r = Remote::join(&addr, "secret", &format!("host{i}"), Duration::from_secs(20), Local::default()).unwrap();
                    r.barrier(Phase::Prepared).unwrap();
                    // What a host of an NCCL job would send: its ranks' counts (here, made
                    // up from its name, which the others cannot know).
                    let mine = serde_json::json!({"host": format!("host{i}"), "counts": [i, 10 * i]});
                    let all = r.exchange(Phase::Quiesced, mine.clone()).unwrap();
                    // A phase where only some have something to say: the rest are null.
                    let ids = r.exchange(Phase::Captured, if i == 1 { serde_json::json!("id-from-rank-0") } else { serde_json::Value::Null }).unwrap();
                    for p in [Phase::Dumped, Phase::Committed] {
                        r.barrier(p).unwrap();
                    }
                    (r.index(), mine, all, ids)
                })
            })
            .collect();
        let got: Vec<_> = parts.into_iter().map(|p| p.join().unwrap()).collect();
        assert_eq!(server.join().unwrap(), Outcome::Done(Phase::Committed));
        for (index, mine, all, ids) in &got {
            assert_eq!(all.len(), 3);
            assert_eq!(&all[*index], mine, "a participant's own data is at its index");
            assert_eq!(all, &got[0].2, "every participant gathered the same list");
            assert_eq!(ids.iter().filter(|v| **v == serde_json::json!("id-from-rank-0")).count(), 1);
            assert_eq!(ids, &got[0].3);
        }
        let mut hosts: Vec<_> = got[0].2.iter().map(|v| v["host"].as_str().unwrap().to_string()).collect();
        hosts.sort();
        assert_eq!(hosts, ["host0", "host1", "host2"]);
    }

    /// Messages much larger than a TLS record, both ways: each participant sends 200 KiB
    /// and hears every one's (600 KiB at once), byte for byte.
    #[test]
    fn large_exchanges_cross_the_encrypted_channel_intact() {
        let (addr, server) = coordinator(3);
        let parts: Vec<_> = (0..3u8)
            .map(|i| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let r = Remote::join(&addr, "secret", &format!("h{i}"), Duration::from_secs(20), Local::default()).unwrap();
                    r.barrier(Phase::Prepared).unwrap();
                    let mine: String = (0..200 << 10).map(|k| char::from(b'a' + ((k * 7 + usize::from(i)) % 26) as u8)).collect();
                    let all = r.exchange(Phase::Quiesced, serde_json::json!(mine)).unwrap();
                    for p in [Phase::Captured, Phase::Dumped, Phase::Committed] {
                        r.barrier(p).unwrap();
                    }
                    (r.index(), mine, all)
                })
            })
            .collect();
        let got: Vec<_> = parts.into_iter().map(|p| p.join().unwrap()).collect();
        assert_eq!(server.join().unwrap(), Outcome::Done(Phase::Committed));
        for (index, mine, all) in &got {
            assert_eq!(all.len(), 3);
            assert_eq!(all[*index], serde_json::json!(mine));
            assert_eq!(all, &got[0].2);
        }
    }

    #[test]
    fn too_much_to_exchange_fails_that_participant_and_aborts_the_others() {
        let (addr, server) = coordinator(2);
        let a = {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let r = Remote::join(&addr, "secret", "a", Duration::from_secs(20), Local::default()).unwrap();
                r.exchange(Phase::Prepared, serde_json::json!(1))
            })
        };
        let b = Remote::join(&addr, "secret", "b", Duration::from_secs(20), Local::default()).unwrap();
        let e = b.exchange(Phase::Prepared, serde_json::json!("x".repeat(MAX_DATA))).unwrap_err();
        assert!(e.0.contains("more than the protocol's"), "{}", e.0);
        drop(b);
        let e = a.join().unwrap().unwrap_err();
        assert!(e.0.contains("another participant failed") && e.0.contains("'b'"), "{}", e.0);
        assert!(matches!(server.join().unwrap(), Outcome::Aborted(_)));
    }

    #[test]
    fn a_participant_that_skips_an_exchange_aborts_every_one() {
        let (addr, server) = coordinator(2);
        let a = {
            let addr = addr.clone();
            std::thread::spawn(move || {
                Remote::join(&addr, "secret", "a", Duration::from_secs(20), Local::default()).unwrap().exchange(Phase::Prepared, serde_json::json!(1))
            })
        };
        let b = Remote::join(&addr, "secret", "b", Duration::from_secs(20), Local::default()).unwrap().barrier(Phase::Prepared);
        assert!(b.is_err() && a.join().unwrap().is_err());
        assert!(matches!(server.join().unwrap(), Outcome::Aborted(why) if why.contains("b passed Prepared without the data")));
    }

    #[test]
    fn strangers_and_other_versions_are_turned_away() {
        let (addr, server) = coordinator(1);
        let e = Remote::join(&addr, "wrong", "x", Duration::from_secs(5), Local::default()).err().unwrap();
        assert!(e.0.contains("not a participant of this session"), "{}", e.0);
        // A hiber of the protocol before TLS says hello in plain JSON, token and all: it
        // hears nothing it can take for a welcome.
        let mut old = TcpStream::connect(&addr).unwrap();
        old.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        old.write_all(b"{\"v\":3,\"hello\":{\"session\":\"secret\",\"name\":\"old\"}}\n").unwrap();
        let mut heard = String::new();
        let _ = std::io::Read::read_to_string(&mut old, &mut heard);
        assert!(!heard.contains("welcome"), "{heard}");
        // The session still waits for its participant, who then finishes alone.
        let r = Remote::join(&addr, "secret", "ok", Duration::from_secs(5), Local::default()).unwrap();
        for p in [Phase::RestorePrepared, Phase::SocketsRestored, Phase::ProcessesRestored, Phase::DevicesRestored] {
            r.barrier(p).unwrap();
        }
        assert_eq!(server.join().unwrap(), Outcome::Done(Phase::DevicesRestored));
    }

    #[test]
    fn participants_at_different_phases_abort() {
        let (addr, server) = coordinator(2);
        let a = {
            let addr = addr.clone();
            std::thread::spawn(move || Remote::join(&addr, "secret", "a", Duration::from_secs(20), Local::default()).unwrap().barrier(Phase::Prepared))
        };
        let b =
            std::thread::spawn(move || Remote::join(&addr, "secret", "b", Duration::from_secs(20), Local::default()).unwrap().barrier(Phase::RestorePrepared));
        assert!(a.join().unwrap().is_err());
        assert!(b.join().unwrap().is_err());
        assert!(matches!(server.join().unwrap(), Outcome::Aborted(why) if why.contains("while the others reached")));
    }

    /// Relays every connection to `to`, keeping a copy of what crosses in both directions.
    fn tap(to: String) -> (String, Arc<Mutex<Vec<u8>>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let keep = seen.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(a) = c else { return };
                let b = TcpStream::connect(&to).unwrap();
                for (mut from, mut into) in [(a.try_clone().unwrap(), b.try_clone().unwrap()), (b, a)] {
                    let keep = keep.clone();
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 4096];
                        while let Ok(n) = std::io::Read::read(&mut from, &mut buf) {
                            if n == 0 || into.write_all(&buf[..n]).is_err() {
                                break;
                            }
                            keep.lock().unwrap().extend_from_slice(&buf[..n]);
                        }
                        let _ = into.shutdown(std::net::Shutdown::Write);
                    });
                }
            }
        });
        (addr, seen)
    }

    #[test]
    fn the_session_is_encrypted_and_its_token_never_crosses_the_wire() {
        let (addr, server) = coordinator(2);
        let (tapped, seen) = tap(addr);
        let parts: Vec<_> = (0..2)
            .map(|i| {
                let addr = tapped.clone();
                std::thread::spawn(move || {
                    let r = Remote::join(&addr, "secret", &format!("participant-{i}"), Duration::from_secs(20), Local::default()).unwrap();
                    r.barrier(Phase::Prepared).unwrap();
                    r.exchange(Phase::Quiesced, serde_json::json!({"nccl_unique_id": "plain-text-marker"})).unwrap();
                    for p in [Phase::Captured, Phase::Dumped, Phase::Committed] {
                        r.barrier(p).unwrap();
                    }
                })
            })
            .collect();
        for p in parts {
            p.join().unwrap();
        }
        assert_eq!(server.join().unwrap(), Outcome::Done(Phase::Committed));
        let wire = seen.lock().unwrap().clone();
        assert!(wire.len() > 1000, "the tap saw the session ({} bytes)", wire.len());
        for plain in ["secret", "participant-", "quiesced", "plain-text-marker", "welcome"] {
            assert!(!wire.windows(plain.len()).any(|w| w == plain.as_bytes()), "'{plain}' crossed the wire in the clear");
        }
    }

    #[test]
    fn silent_or_endless_strangers_do_not_hold_the_session() {
        let (addr, server) = coordinator(2);
        // One connects and says nothing; another sends a line that never ends.
        let _silent = TcpStream::connect(&addr).unwrap();
        let mut endless = TcpStream::connect(&addr).unwrap();
        let _ = endless.write_all(&vec![b'a'; MAX_UP_LINE as usize + (64 << 10)]);
        all_pass_every_checkpoint_phase(&addr, 2);
        assert_eq!(server.join().unwrap(), Outcome::Done(Phase::Committed));
    }

    #[test]
    fn a_participant_that_never_arrives_aborts_the_others_at_the_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || serve(&l, 2, "secret", Duration::from_secs(1)).unwrap());
        let a = {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let r = Remote::join(&addr, "secret", "a", Duration::from_secs(20), Local::default()).unwrap();
                r.barrier(Phase::Prepared).unwrap();
                r.barrier(Phase::Quiesced)
            })
        };
        // b is prepared, then hangs (a stuck quiesce): it never reports again.
        let b = Remote::join(&addr, "secret", "b", Duration::from_secs(20), Local::default()).unwrap();
        b.barrier(Phase::Prepared).unwrap();
        let e = a.join().unwrap().unwrap_err();
        assert!(e.0.contains("'b'") || e.0.contains("b did not reach"), "{}", e.0);
        assert!(matches!(server.join().unwrap(), Outcome::Aborted(why) if why.contains("did not reach")));
        drop(b);
    }

    #[test]
    fn after_a_failure_those_still_connected_pass_the_undo_phases_together() {
        let (addr, server) = coordinator(3);
        let parts: Vec<_> = ["a", "b", "c"]
            .into_iter()
            .map(|name| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let r = Remote::join(&addr, "secret", name, Duration::from_secs(20), Local::default()).unwrap();
                    r.barrier(Phase::Prepared).unwrap();
                    if name == "c" {
                        // c fails (its quiesce, say) and says so, then undoes with the others.
                        r.fail("its quiesce failed");
                    } else {
                        let e = r.barrier(Phase::Quiesced).unwrap_err();
                        assert!(e.0.contains("'c' failed: its quiesce failed"), "{}", e.0);
                    }
                    // A phase of the aborted operation is not passed any more.
                    assert!(r.barrier(Phase::Captured).is_err());
                    if name == "b" {
                        // b has nothing to undo together: it leaves.
                        return None;
                    }
                    let all = r.exchange(Phase::NcclListed, serde_json::json!(name)).unwrap();
                    let ids = r.exchange(Phase::NcclIds, serde_json::json!({"from": name})).unwrap();
                    Some((r.index(), all, ids))
                })
            })
            .collect();
        let got: Vec<_> = parts.into_iter().filter_map(|p| p.join().unwrap()).collect();
        assert!(matches!(server.join().unwrap(), Outcome::Aborted(why) if why.contains("'c' failed")));
        assert_eq!(got.len(), 2);
        for (index, all, ids) in &got {
            assert_eq!(all.len(), 3);
            assert_eq!(all.iter().filter(|v| v.is_null()).count(), 1, "b's place is null: {all:?}");
            assert_eq!(all, &got[0].1, "both gathered the same list");
            assert!(!all[*index].is_null());
            assert_eq!(ids.iter().filter(|v| !v.is_null()).count(), 2);
        }
    }

    #[test]
    fn a_phase_of_the_undo_under_way_at_an_abort_goes_on_in_the_undo_round() {
        // a and b are rebuilding (nccl_listed) when c goes away: they are answered there and
        // go on with the next phase, rather than starting over out of step.
        let (addr, server) = coordinator(3);
        let parts: Vec<_> = ["a", "b"]
            .into_iter()
            .map(|name| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let r = Remote::join(&addr, "secret", name, Duration::from_secs(20), Local::default()).unwrap();
                    r.barrier(Phase::Prepared).unwrap();
                    let listed = r.exchange(Phase::NcclListed, serde_json::json!(name)).unwrap();
                    let ids = r.exchange(Phase::NcclIds, serde_json::json!(name)).unwrap();
                    (listed, ids, r.barrier(Phase::Committed).is_err())
                })
            })
            .collect();
        let c = Remote::join(&addr, "secret", "c", Duration::from_secs(20), Local::default()).unwrap();
        c.barrier(Phase::Prepared).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        drop(c);
        for p in parts {
            let (listed, ids, aborted) = p.join().unwrap();
            assert_eq!(listed.iter().filter(|v| !v.is_null()).count(), 2, "{listed:?}");
            assert_eq!(ids.iter().filter(|v| !v.is_null()).count(), 2, "{ids:?}");
            assert!(aborted, "the operation itself is aborted");
        }
        assert!(matches!(server.join().unwrap(), Outcome::Aborted(why) if why.contains("'c'")));
    }

    #[test]
    fn wire_format_is_the_documented_one() {
        assert_eq!(Up::Failed { failed: "why".into() }.to_value(), serde_json::json!({"failed": "why"}));
        assert_eq!(Up::from_value(&serde_json::json!({"failed": "why"})), Some(Up::Failed { failed: "why".into() }));
        assert_eq!(Up::Reached { reached: Phase::Quiesced, data: None }.to_value(), serde_json::json!({"reached": "quiesced"}));
        let d = serde_json::json!({"ranks": [0, 1]});
        assert_eq!(Up::Reached { reached: Phase::Quiesced, data: Some(d.clone()) }.to_value(), serde_json::json!({"reached": "quiesced", "data": d}));
        assert_eq!(
            serde_json::to_value(Down::Gathered { phase: Phase::Prepared, data: vec![d.clone(), serde_json::Value::Null] }).unwrap(),
            serde_json::json!({"gathered": {"phase": "prepared", "data": [d, null]}})
        );
        assert_eq!(Up::Hello { v: 4, hello: Hello { name: "n".into() } }.to_value(), serde_json::json!({"v": 4, "hello": {"name": "n"}}));
        assert_eq!(serde_json::to_value(Down::Go(Phase::DevicesRestored)).unwrap(), serde_json::json!({"go": "devices_restored"}));
        assert_eq!(
            serde_json::to_value(Down::Welcome { index: 1, participants: 2, timeout_s: 5 }).unwrap(),
            serde_json::json!({"welcome": {"index": 1, "participants": 2, "timeout_s": 5}})
        );
        assert_eq!(serde_json::to_value(Down::Abort("x".into())).unwrap(), serde_json::json!({"abort": "x"}));
    }
}
