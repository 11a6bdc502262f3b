//! A coordinator across processes and hosts: one `hiber coordinate` server, and each
//! participating hiber (`checkpoint` or `restore` with `--coordinator`) as its client.
//!
//! The protocol (version 1) is one JSON object per line over TCP:
//!
//! ```text
//! participant → coordinator   {"v": 1, "hello": {"session": TOKEN, "name": NAME}}
//! coordinator → participant   {"welcome": {"index": I, "participants": N}}    (once all N joined)
//! participant → coordinator   {"reached": PHASE}                                (after each phase)
//! coordinator → participant   {"go": PHASE}   once every participant reached PHASE
//!                             {"abort": REASON}  when one failed, left, or reached another phase
//! ```
//!
//! PHASE is a [`Phase`] in snake case (`prepared`, `quiesced`, `captured`, `dumped`,
//! `committed`; `restore_prepared`, `processes_restored`, `devices_restored`). A participant
//! that fails stops reporting and closes its connection; the coordinator then tells every
//! other one to abort, and each undoes its own steps: the applications run on, and no
//! image of the cut is kept. After the last phase of an operation (`committed` or
//! `devices_restored`) the coordinator ends. Nothing in the protocol is tied to one host:
//! participants name themselves, and the coordinator knows them only by their connection.
//!
//! The session token keeps strangers out of a session (the coordinator listens on a TCP
//! port); it is a shared secret, compared in full, and never written to a log.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{BarrierError, Coordinator, Local, Phase};

pub const PROTOCOL_VERSION: u32 = 1;

/// A fresh session token: 128 random bits, in hex.
pub fn session_token() -> std::io::Result<String> {
    let mut t = [0u8; 16];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut t)?;
    Ok(t.iter().map(|b| format!("{b:02x}")).collect())
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct Hello {
    pub session: String,
    pub name: String,
}

/// What a participant sends (see the module's wire shapes).
#[derive(Debug, Clone, PartialEq)]
pub enum Up {
    Hello { v: u32, hello: Hello },
    Reached { reached: Phase },
}

/// What the coordinator sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Down {
    Welcome { index: usize, participants: usize },
    Go(Phase),
    Abort(String),
}

fn send<T: Serialize>(mut w: &TcpStream, msg: &T) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(msg).expect("messages serialize");
    line.push(b'\n');
    w.write_all(&line)
}

/// Reads one message; `None` at the end of the stream.
fn recv<T: for<'de> Deserialize<'de>>(r: &mut BufReader<TcpStream>) -> std::io::Result<Option<T>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    serde_json::from_str(&line).map(Some).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("bad message: {e}")))
}

// The wire shapes: `{"v":1,"hello":{...}}`, `{"reached":"quiesced"}`, `{"welcome":{...}}`,
// `{"go":"quiesced"}`, `{"abort":"..."}`. Untagged on the way up (two distinct shapes),
// externally tagged on the way down.
impl Up {
    fn to_value(&self) -> serde_json::Value {
        match self {
            Up::Hello { v, hello } => serde_json::json!({"v": v, "hello": hello}),
            Up::Reached { reached } => serde_json::json!({"reached": reached}),
        }
    }

    fn from_value(v: &serde_json::Value) -> Option<Up> {
        if let Some(h) = v.get("hello") {
            return Some(Up::Hello { v: v.get("v")?.as_u64()? as u32, hello: serde_json::from_value(h.clone()).ok()? });
        }
        Some(Up::Reached { reached: serde_json::from_value(v.get("reached")?.clone()).ok()? })
    }
}

fn send_up(w: &TcpStream, msg: &Up) -> std::io::Result<()> {
    send(w, &msg.to_value())
}

fn recv_up(r: &mut BufReader<TcpStream>) -> std::io::Result<Option<Up>> {
    match recv::<serde_json::Value>(r)? {
        None => Ok(None),
        Some(v) => Up::from_value(&v).map(Some).ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "not a participant's message")),
    }
}

/// A participant: each barrier reports the phase and waits for the coordinator's answer.
/// Faults injected through `HIBER_FAIL_AT` (the `local` hook) fail the barrier before it is
/// reported, as a real failure would.
pub struct Remote {
    local: Local,
    conn: Mutex<(TcpStream, BufReader<TcpStream>)>,
    timeout: Duration,
}

impl Remote {
    /// Joins session `session` of the coordinator at `addr` as `name`, waiting (up to
    /// `timeout`) until every participant has joined.
    pub fn join(addr: &str, session: &str, name: &str, timeout: Duration, local: Local) -> Result<Remote, BarrierError> {
        let err = |what: &str, e: &dyn std::fmt::Display| BarrierError(format!("{what} {addr}: {e}"));
        let sa = addr.to_socket_addrs().map_err(|e| err("cannot resolve", &e))?.next().ok_or_else(|| BarrierError(format!("{addr} names no address")))?;
        let stream = TcpStream::connect_timeout(&sa, Duration::from_secs(10)).map_err(|e| err("cannot reach the coordinator at", &e))?;
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(Some(timeout)).map_err(|e| err("socket", &e))?;
        let mut reader = BufReader::new(stream.try_clone().map_err(|e| err("socket", &e))?);
        send_up(&stream, &Up::Hello { v: PROTOCOL_VERSION, hello: Hello { session: session.into(), name: name.into() } })
            .map_err(|e| err("cannot talk to the coordinator at", &e))?;
        match recv::<Down>(&mut reader) {
            Ok(Some(Down::Welcome { index, participants })) => {
                tracing::debug!(index, participants, "joined the coordinator's session");
            }
            Ok(Some(Down::Abort(why))) => return Err(BarrierError(format!("the coordinator refused: {why}"))),
            Ok(other) => return Err(BarrierError(format!("the coordinator at {addr} answered {other:?}"))),
            Err(e) => return Err(err("no welcome from the coordinator at", &e)),
        }
        Ok(Remote { local, conn: Mutex::new((stream, reader)), timeout })
    }
}

impl Coordinator for Remote {
    fn barrier(&self, phase: Phase) -> Result<(), BarrierError> {
        self.local.barrier(phase)?;
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let (stream, reader) = &mut *conn;
        send_up(stream, &Up::Reached { reached: phase }).map_err(|e| BarrierError(format!("lost the coordinator at {phase:?}: {e}")))?;
        match recv::<Down>(reader) {
            Ok(Some(Down::Go(p))) if p == phase => Ok(()),
            Ok(Some(Down::Abort(why))) => Err(BarrierError(format!("another participant failed, so this one aborts too: {why}"))),
            Ok(Some(other)) => Err(BarrierError(format!("the coordinator answered {other:?} at {phase:?}"))),
            Ok(None) => Err(BarrierError(format!("the coordinator went away at {phase:?}"))),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                Err(BarrierError(format!("no answer from the coordinator within {} s at {phase:?}", self.timeout.as_secs())))
            }
            Err(e) => Err(BarrierError(format!("lost the coordinator at {phase:?}: {e}"))),
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

/// Serves one session on `listener`: waits for `participants` to join with `session`, then
/// holds them at each barrier until all reach it, and tells all to abort when one fails,
/// leaves, or reaches another phase. Ends after the last phase of the operation.
pub fn serve(listener: &TcpListener, participants: usize, session: &str, timeout: Duration) -> std::io::Result<Outcome> {
    let mut conns: Vec<(String, TcpStream, BufReader<TcpStream>)> = Vec::new();
    while conns.len() < participants {
        let (stream, peer) = listener.accept()?;
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut reader = BufReader::new(stream.try_clone()?);
        match recv_up(&mut reader) {
            Ok(Some(Up::Hello { v, hello })) if v == PROTOCOL_VERSION && hello.session == session => {
                tracing::info!(name = %hello.name, %peer, "participant joined");
                stream.set_read_timeout(Some(timeout))?;
                conns.push((hello.name, stream, reader));
            }
            Ok(Some(Up::Hello { v, .. })) if v != PROTOCOL_VERSION => {
                let _ = send(&stream, &Down::Abort(format!("protocol version {v}; this coordinator speaks {PROTOCOL_VERSION}")));
            }
            // A stranger, or a participant of another session: turned away, the session waits on.
            _ => {
                tracing::warn!(%peer, "a connection without this session's token was turned away");
                let _ = send(&stream, &Down::Abort("not a participant of this session".into()));
            }
        }
    }
    for (i, (_, s, _)) in conns.iter().enumerate() {
        send(s, &Down::Welcome { index: i, participants })?;
    }
    let abort = |conns: &[(String, TcpStream, BufReader<TcpStream>)], why: String| {
        for (_, s, _) in conns {
            let _ = send(s, &Down::Abort(why.clone()));
        }
        Ok(Outcome::Aborted(why))
    };
    loop {
        let mut phase = None;
        for i in 0..conns.len() {
            let name = conns[i].0.clone();
            let got = match recv_up(&mut conns[i].2) {
                Ok(Some(Up::Reached { reached })) => reached,
                Ok(None) => return abort(&conns, format!("participant '{name}' failed or left before {}", next_name(phase))),
                Ok(Some(other)) => return abort(&conns, format!("participant '{name}' sent {other:?}")),
                Err(e) => return abort(&conns, format!("participant '{name}': {e}")),
            };
            match phase {
                None => phase = Some(got),
                Some(p) if p == got => {}
                Some(p) => return abort(&conns, format!("participant '{name}' reached {got:?} while the others reached {p:?}")),
            }
        }
        let p = phase.expect("at least one participant");
        for (_, s, _) in &conns {
            send(s, &Down::Go(p))?;
        }
        tracing::info!(phase = ?p, "every participant passed");
        if matches!(p, Phase::Committed | Phase::DevicesRestored) {
            return Ok(Outcome::Done(p));
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

    #[test]
    fn all_participants_pass_every_phase_together() {
        let (addr, server) = coordinator(3);
        let parts: Vec<_> = (0..3)
            .map(|i| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let r = Remote::join(&addr, "secret", &format!("p{i}"), Duration::from_secs(20), Local::default()).unwrap();
                    CHECKPOINT.iter().map(|&p| r.barrier(p)).collect::<Result<Vec<_>, _>>()
                })
            })
            .collect();
        for p in parts {
            p.join().unwrap().unwrap();
        }
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
    fn strangers_and_other_versions_are_turned_away() {
        let (addr, server) = coordinator(1);
        let e = Remote::join(&addr, "wrong", "x", Duration::from_secs(5), Local::default()).err().unwrap();
        assert!(e.0.contains("not a participant of this session"), "{}", e.0);
        // The session still waits for its participant, who then finishes alone.
        let r = Remote::join(&addr, "secret", "ok", Duration::from_secs(5), Local::default()).unwrap();
        for p in [Phase::RestorePrepared, Phase::ProcessesRestored, Phase::DevicesRestored] {
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

    #[test]
    fn wire_format_is_the_documented_one() {
        assert_eq!(Up::Reached { reached: Phase::Quiesced }.to_value(), serde_json::json!({"reached": "quiesced"}));
        assert_eq!(
            Up::Hello { v: 1, hello: Hello { session: "s".into(), name: "n".into() } }.to_value(),
            serde_json::json!({"v": 1, "hello": {"session": "s", "name": "n"}})
        );
        assert_eq!(serde_json::to_value(Down::Go(Phase::DevicesRestored)).unwrap(), serde_json::json!({"go": "devices_restored"}));
        assert_eq!(serde_json::to_value(Down::Welcome { index: 1, participants: 2 }).unwrap(), serde_json::json!({"welcome": {"index": 1, "participants": 2}}));
        assert_eq!(serde_json::to_value(Down::Abort("x".into())).unwrap(), serde_json::json!({"abort": "x"}));
    }
}
