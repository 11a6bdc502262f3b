//! The control protocol between hiber and the agent inside an application.
//!
//! The agent listens on an abstract unix `SOCK_SEQPACKET` socket named after a token
//! `hiber run` gives the job (`HIBER_AGENT_TOKEN`) and the process's PID in its namespace,
//! so hiber finds it from `/proc/PID/environ` and the PID, and a restored process listens
//! under the same name. Abstract names live in the network namespace; hiber connects from
//! inside the process's namespace when it differs (a copy restored with `--isolate-net`).
//!
//! One request per message, one reply per message, ASCII. Device memory travels as file
//! descriptors (SCM_RIGHTS) beside `alloc` and `load` messages. A conversation:
//!
//! ```text
//! hiber → quiesce 10000          agent closes its gate, waits for calls in flight, syncs
//! agent → alloc 1 1073741824 0   + fd, one per tracked allocation (id, bytes, device)
//! agent → done 1
//! hiber → release                hiber holds references now; agent unmaps and releases
//! agent → ok                     and closes the connection before any CRIU dump
//! ...
//! hiber → load 1                 + fd: map this memory where allocation 1 was
//! agent → ok
//! hiber → resume                 agent opens its gate
//! agent → ok
//! ```
//!
//! On restore, `create ID` asks the agent to make allocation ID's memory itself (where it
//! moves to a GPU the process's `CUDA_VISIBLE_DEVICES` hid from it): `alloc` + fd, which
//! hiber fills and hands back with `load`.
//!
//! `list` asks an agent whose hiber died mid-checkpoint what it released: one `evacuated`
//! (id, bytes, GPU UUID) per allocation, then `done`; `hiber recover` loads them back.
//!
//! NCCL communicators (see the agent's `nccl/`) are cut and torn down before `quiesce`,
//! with every rank of the job in step, and built again after `resume`:
//!
//! ```text
//! hiber → nccl-hold 10000           no new submission; the counts are final
//! agent → nccl-comm KEY RANK NRANKS LOCAL, nccl-lane KEY LANE COUNT ..., done N
//! hiber → nccl-limit KEY LANE COUNT  (each lane a rank is behind on), then nccl-drain 10000
//! agent → ok                        every lane at its limit, the device idle
//! hiber → nccl-down                 (once every rank drained) communicators torn down
//! ...
//! hiber → nccl-new-id KEY           (rank 0 of each communicator) agent → nccl-id KEY HEX
//! hiber → nccl-set-id KEY HEX, then nccl-rebuild 10000 (every rank at once)
//! ```
//!
//! `nccl-open` undoes a hold, and after a rebuild lets calls through (hiber opens no rank
//! before every rank's rebuild succeeded); a hold also ends with its connection.
//! `nccl-list` reports the communicators without holding them. `nccl-fail KEY` ends a
//! torn-down communicator that cannot be rebuilt (one of its ranks' processes is gone): its
//! calls fail as they would after a peer's death in NCCL, instead of waiting for ever; the
//! agent's other communicators are rebuilt and opened as usual.

use std::fmt;

use crate::{message, num, one_line, Answer, ParseError, MAX_MESSAGE};

/// The environment variable `hiber run` sets for the agent.
pub const TOKEN_ENV: &str = "HIBER_AGENT_TOKEN";
/// Where the agent may log (never the application's stdout or stderr).
pub const LOG_ENV: &str = "HIBER_AGENT_LOG";

/// The abstract socket name (without the leading NUL) of the agent in process `ns_pid`.
pub fn socket_name(token: &str, ns_pid: i32) -> String {
    format!("hiber-agent.{token}.{ns_pid}")
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Status,
    Quiesce {
        timeout_ms: u64,
    },
    Release,
    /// While the application runs: a descriptor for every allocation (`alloc` each, then
    /// `done`), the gate left open, so that hiber can look at the memory before it stops
    /// the application (what changed since the parent image, to size its copies).
    Peek,
    Load {
        id: u64,
    },
    /// On restore: the agent makes allocation `id`'s memory itself and sends it (`alloc`).
    Create {
        id: u64,
    },
    Resume,
    List,
    NcclHold {
        timeout_ms: u64,
    },
    NcclLimit {
        key: u64,
        lane: Lane,
        count: u64,
    },
    NcclDrain {
        timeout_ms: u64,
    },
    NcclDown,
    NcclOpen,
    NcclFail {
        key: u64,
    },
    NcclList,
    NcclNewId {
        key: u64,
    },
    NcclSetId {
        key: u64,
        id: String,
    },
    NcclRebuild {
        timeout_ms: u64,
    },
}

/// Where a rank's submissions on one NCCL communicator go: its collectives, its sends to
/// and receives from one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lane {
    Coll,
    Send(i32),
    Recv(i32),
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Lane::Coll => f.write_str("c"),
            Lane::Send(p) => write!(f, "s{p}"),
            Lane::Recv(p) => write!(f, "r{p}"),
        }
    }
}

impl std::str::FromStr for Lane {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Lane, ParseError> {
        let bad = || ParseError(s.into());
        match s.split_at_checked(1).ok_or_else(bad)? {
            ("c", "") => Ok(Lane::Coll),
            ("s", p) => p.parse().map(Lane::Send).map_err(|_| bad()),
            ("r", p) => p.parse().map(Lane::Recv).map_err(|_| bad()),
            _ => Err(bad()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Status(Status),
    Alloc {
        id: u64,
        size: u64,
        device: i32,
    },
    Evacuated {
        id: u64,
        size: u64,
        gpu: String,
    },
    Done {
        count: u64,
    },
    /// One communicator of the rank: `gpu` is the UUID of its device, empty where the agent
    /// cannot tell (sent as `-`; an older agent sends nothing).
    NcclComm {
        key: u64,
        rank: i32,
        nranks: i32,
        local: bool,
        gpu: String,
    },
    NcclLane {
        key: u64,
        lane: Lane,
        count: u64,
    },
    NcclId {
        key: u64,
        id: String,
    },
    Ok,
    Err(String),
}

/// What an agent tracks and what it left to the driver.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Status {
    pub tracked: u64,
    pub tracked_bytes: u64,
    pub gate_closed: bool,
    pub evacuated: u64,
    pub passthrough_calls: u64,
    pub passthrough_bytes: u64,
    pub small: u64,
    pub pitch: u64,
    pub stream_ordered: u64,
    pub managed: u64,
    pub vmm_not_exportable: u64,
    /// Legacy CUDA IPC memory of another process, open now.
    pub ipc_imports: u64,
    /// Peer access between contexts, enabled now.
    pub peer_access: u64,
    /// Allocations imported from a shareable handle (another process's VMM memory), open now.
    pub shared_imports: u64,
    /// Allocations of another process opened through the agent's own CUDA IPC, open now
    /// (these go with checkpoints).
    pub agent_ipc: u64,
    /// NCCL communicators the agent keeps for the application.
    pub nccl: u64,
    /// Whether hiber left them torn down.
    pub nccl_down: bool,
}

message!(Request, Reply);

impl Answer for Reply {
    fn error(&self) -> Option<&str> {
        match self {
            Reply::Err(m) => Some(m),
            _ => None,
        }
    }
}

/// A communicator's key, in hex.
fn key(s: Option<&str>, line: &str) -> Result<u64, ParseError> {
    s.and_then(|v| u64::from_str_radix(v, 16).ok()).ok_or_else(|| ParseError(line.into()))
}

/// An `ncclUniqueId` in hex: 128 bytes.
fn unique_id(s: Option<&str>, line: &str) -> Result<String, ParseError> {
    match s {
        Some(v) if v.len() == 256 && v.bytes().all(|b| b.is_ascii_hexdigit()) => Ok(v.to_string()),
        _ => Err(ParseError(line.into())),
    }
}

impl Request {
    pub fn encode(&self) -> String {
        match self {
            Request::Status => "status".into(),
            Request::Quiesce { timeout_ms } => format!("quiesce {timeout_ms}"),
            Request::Release => "release".into(),
            Request::Peek => "peek".into(),
            Request::Load { id } => format!("load {id}"),
            Request::Create { id } => format!("create {id}"),
            Request::Resume => "resume".into(),
            Request::List => "list".into(),
            Request::NcclHold { timeout_ms } => format!("nccl-hold {timeout_ms}"),
            Request::NcclLimit { key, lane, count } => format!("nccl-limit {key:016x} {lane} {count}"),
            Request::NcclDrain { timeout_ms } => format!("nccl-drain {timeout_ms}"),
            Request::NcclDown => "nccl-down".into(),
            Request::NcclFail { key } => format!("nccl-fail {key:016x}"),
            Request::NcclOpen => "nccl-open".into(),
            Request::NcclList => "nccl-list".into(),
            Request::NcclNewId { key } => format!("nccl-new-id {key:016x}"),
            Request::NcclSetId { key, id } => format!("nccl-set-id {key:016x} {id}"),
            Request::NcclRebuild { timeout_ms } => format!("nccl-rebuild {timeout_ms}"),
        }
    }

    pub fn parse(line: &str) -> Result<Request, ParseError> {
        let mut w = line.split_ascii_whitespace();
        Ok(match w.next() {
            Some("status") => Request::Status,
            Some("quiesce") => Request::Quiesce { timeout_ms: num(w.next(), line)? },
            Some("release") => Request::Release,
            Some("peek") => Request::Peek,
            Some("load") => Request::Load { id: num(w.next(), line)? },
            Some("create") => Request::Create { id: num(w.next(), line)? },
            Some("resume") => Request::Resume,
            Some("list") => Request::List,
            Some("nccl-hold") => Request::NcclHold { timeout_ms: num(w.next(), line)? },
            Some("nccl-limit") => Request::NcclLimit { key: key(w.next(), line)?, lane: num(w.next(), line)?, count: num(w.next(), line)? },
            Some("nccl-drain") => Request::NcclDrain { timeout_ms: num(w.next(), line)? },
            Some("nccl-down") => Request::NcclDown,
            Some("nccl-fail") => Request::NcclFail { key: key(w.next(), line)? },
            Some("nccl-open") => Request::NcclOpen,
            Some("nccl-list") => Request::NcclList,
            Some("nccl-new-id") => Request::NcclNewId { key: key(w.next(), line)? },
            Some("nccl-set-id") => Request::NcclSetId { key: key(w.next(), line)?, id: unique_id(w.next(), line)? },
            Some("nccl-rebuild") => Request::NcclRebuild { timeout_ms: num(w.next(), line)? },
            _ => return Err(ParseError(line.into())),
        })
    }
}

impl Status {
    fn fields(&self) -> [(&'static str, u64); 17] {
        [
            ("tracked", self.tracked),
            ("bytes", self.tracked_bytes),
            ("closed", self.gate_closed as u64),
            ("evacuated", self.evacuated),
            ("pt_calls", self.passthrough_calls),
            ("pt_bytes", self.passthrough_bytes),
            ("small", self.small),
            ("pitch", self.pitch),
            ("stream_ordered", self.stream_ordered),
            ("managed", self.managed),
            ("vmm_not_exportable", self.vmm_not_exportable),
            ("ipc", self.ipc_imports),
            ("peer", self.peer_access),
            ("imports", self.shared_imports),
            ("nccl", self.nccl),
            ("nccl_down", self.nccl_down as u64),
            ("agent_ipc", self.agent_ipc),
        ]
    }
}

impl Reply {
    pub fn encode(&self) -> String {
        match self {
            Reply::Status(s) => {
                let mut out = String::from("status");
                for (k, v) in s.fields() {
                    out.push_str(&format!(" {k}={v}"));
                }
                out
            }
            Reply::Alloc { id, size, device } => format!("alloc {id} {size} {device}"),
            Reply::Evacuated { id, size, gpu } => format!("evacuated {id} {size} {gpu}"),
            Reply::Done { count } => format!("done {count}"),
            Reply::NcclComm { key, rank, nranks, local, gpu } => {
                format!("nccl-comm {key:016x} {rank} {nranks} {} {}", *local as u8, if gpu.is_empty() { "-" } else { gpu })
            }
            Reply::NcclLane { key, lane, count } => format!("nccl-lane {key:016x} {lane} {count}"),
            Reply::NcclId { key, id } => format!("nccl-id {key:016x} {id}"),
            Reply::Ok => "ok".into(),
            Reply::Err(m) => format!("err {}", one_line(m, MAX_MESSAGE - 8)),
        }
    }

    pub fn parse(line: &str) -> Result<Reply, ParseError> {
        let (head, rest) = line.split_once(' ').unwrap_or((line, ""));
        let mut w = rest.split_ascii_whitespace();
        Ok(match head {
            "status" => {
                let mut s = Status::default();
                for kv in w {
                    let (k, v) = kv.split_once('=').ok_or_else(|| ParseError(line.into()))?;
                    let v: u64 = v.parse().map_err(|_| ParseError(line.into()))?;
                    match k {
                        "tracked" => s.tracked = v,
                        "bytes" => s.tracked_bytes = v,
                        "closed" => s.gate_closed = v != 0,
                        "evacuated" => s.evacuated = v,
                        "pt_calls" => s.passthrough_calls = v,
                        "pt_bytes" => s.passthrough_bytes = v,
                        "small" => s.small = v,
                        "pitch" => s.pitch = v,
                        "stream_ordered" => s.stream_ordered = v,
                        "managed" => s.managed = v,
                        "vmm_not_exportable" => s.vmm_not_exportable = v,
                        "ipc" => s.ipc_imports = v,
                        "peer" => s.peer_access = v,
                        "imports" => s.shared_imports = v,
                        "nccl" => s.nccl = v,
                        "nccl_down" => s.nccl_down = v != 0,
                        "agent_ipc" => s.agent_ipc = v,
                        _ => {} // newer agents may say more
                    }
                }
                Reply::Status(s)
            }
            "alloc" => Reply::Alloc { id: num(w.next(), line)?, size: num(w.next(), line)?, device: num(w.next(), line)? },
            "evacuated" => {
                Reply::Evacuated { id: num(w.next(), line)?, size: num(w.next(), line)?, gpu: w.next().ok_or_else(|| ParseError(line.into()))?.to_string() }
            }
            "done" => Reply::Done { count: num(w.next(), line)? },
            "nccl-comm" => Reply::NcclComm {
                key: key(w.next(), line)?,
                rank: num(w.next(), line)?,
                nranks: num(w.next(), line)?,
                local: num::<u8>(w.next(), line)? != 0,
                gpu: w.next().filter(|g| *g != "-").unwrap_or("").to_string(),
            },
            "nccl-lane" => Reply::NcclLane { key: key(w.next(), line)?, lane: num(w.next(), line)?, count: num(w.next(), line)? },
            "nccl-id" => Reply::NcclId { key: key(w.next(), line)?, id: unique_id(w.next(), line)? },
            "ok" => Reply::Ok,
            "err" => Reply::Err(rest.to_string()),
            _ => return Err(ParseError(line.into())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        let id = "0a".repeat(128);
        for r in [
            Request::Status,
            Request::Quiesce { timeout_ms: 10_000 },
            Request::Release,
            Request::Peek,
            Request::Load { id: 7 },
            Request::Create { id: 8 },
            Request::Resume,
            Request::List,
            Request::NcclHold { timeout_ms: 5 },
            Request::NcclLimit { key: u64::MAX, lane: Lane::Recv(3), count: 9 },
            Request::NcclDrain { timeout_ms: 5 },
            Request::NcclDown,
            Request::NcclOpen,
            Request::NcclFail { key: 7 },
            Request::NcclList,
            Request::NcclNewId { key: 1 },
            Request::NcclSetId { key: 0xabc, id: id.clone() },
            Request::NcclRebuild { timeout_ms: 7 },
        ] {
            assert_eq!(Request::parse(&r.encode()).unwrap(), r);
        }
        assert!(Request::parse("nccl-set-id 1 abcd").is_err(), "an id is 128 bytes");
        assert!(Request::parse("nccl-limit 1 x2 3").is_err());
        assert!(Request::parse(&format!("nccl-set-id 1 {}", "zz".repeat(128))).is_err());
        assert!(Request::parse("quiesce").is_err());
        assert!(Request::parse("quiesce soon").is_err());
        assert!(Request::parse("format c:").is_err());
    }

    #[test]
    fn replies_round_trip() {
        let s = Status {
            tracked: 3,
            tracked_bytes: 1 << 30,
            gate_closed: true,
            stream_ordered: 2,
            passthrough_bytes: 99,
            ipc_imports: 1,
            peer_access: 2,
            shared_imports: 3,
            agent_ipc: 4,
            nccl: 2,
            nccl_down: true,
            ..Status::default()
        };
        for r in [
            Reply::Status(s),
            Reply::Alloc { id: 1, size: 2 << 20, device: 0 },
            Reply::Evacuated { id: 2, size: 4 << 20, gpu: "GPU-9e84469c-e099-5433-f3cd-0b11f8729f86".into() },
            Reply::Done { count: 4 },
            Reply::NcclComm { key: 0xfeed, rank: 1, nranks: 2, local: false, gpu: "GPU-9e84469c-e099-5433-f3cd-0b11f8729f86".into() },
            Reply::NcclComm { key: 0xfeed, rank: 1, nranks: 2, local: true, gpu: String::new() },
            Reply::NcclLane { key: 0xfeed, lane: Lane::Send(0), count: 12 },
            Reply::NcclId { key: 3, id: "ff".repeat(128) },
            Reply::Ok,
            Reply::Err("in flight".into()),
        ] {
            assert_eq!(Reply::parse(&r.encode()).unwrap(), r);
        }
        assert_eq!(Reply::parse("status tracked=1 future_field=5").unwrap(), Reply::Status(Status { tracked: 1, ..Status::default() }));
        // An agent from before the GPU was sent.
        assert_eq!(
            Reply::parse("nccl-comm 00000000000000ff 0 2 0").unwrap(),
            Reply::NcclComm { key: 0xff, rank: 0, nranks: 2, local: false, gpu: String::new() }
        );
        assert!(Reply::parse("alloc 1 two 0").is_err());
    }

    #[test]
    fn uuids_print_like_nvidia_smi() {
        let b: [u8; 16] = [0x9e, 0x84, 0x46, 0x9c, 0xe0, 0x99, 0x54, 0x33, 0xf3, 0xcd, 0x0b, 0x11, 0xf8, 0x72, 0x9f, 0x86];
        assert_eq!(crate::gpu_uuid(&b), "GPU-9e84469c-e099-5433-f3cd-0b11f8729f86");
    }

    #[test]
    fn error_text_is_one_bounded_line() {
        let e = Reply::Err(format!("a\nb{}", "x".repeat(2000))).encode();
        assert!(!e.contains('\n') && e.len() <= MAX_MESSAGE);
        let e = Reply::Err("é".repeat(600)).encode();
        assert!(e.len() <= MAX_MESSAGE, "cut at a character boundary");
    }
}
