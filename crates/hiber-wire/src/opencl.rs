//! The control protocol between hiber and the OpenCL layer preloaded into an application.
//!
//! Same transport as the agent's (an abstract `SOCK_SEQPACKET` socket, one ASCII message
//! each way, descriptors beside `mem` and `load`), under its own name and token, so a
//! process can have both. A checkpoint:
//!
//! ```text
//! hiber → quiesce 10000     layer closes its gate, waits for calls in flight, drains
//!                           every queue (clFinish), reads every memory object
//! layer → device cpu PoCL / pthread-haswell   one per device its contexts use
//! layer → mem 7 4096 buffer                   + memfd holding the object's bytes
//! layer → done 1
//! hiber → release           layer releases every real OpenCL object, keeps its records
//! layer → ok                and closes the connection before the CRIU dump
//! ```
//!
//! A restore (or the end of a `--leave-running` checkpoint):
//!
//! ```text
//! hiber → replay 0:1        re-create every object from its record, on platform 0,
//! layer → ok                device 1 (`cpu`, `gpu`, or `-` for the devices it had);
//!                           in proxy mode `replay 0:1 proxy=SOCKET` names the new job's
//!                           proxy, which the layer connects to first
//! hiber → load 7            + memfd: write these bytes into memory object 7
//! layer → ok
//! hiber → resume            layer opens its gate
//! layer → ok
//! ```

use std::fmt;

use crate::{message, num, one_line, Answer, ParseError, MAX_MESSAGE};

/// The environment variable `hiber run` sets for the OpenCL layer.
pub const TOKEN_ENV: &str = "HIBER_OPENCL_TOKEN";
/// Where the layer may log (never the application's stdout or stderr).
pub const LOG_ENV: &str = "HIBER_OPENCL_LOG";
/// Proxy mode: the socket of the job's OpenCL proxy. With it the layer never loads the
/// ICD loader itself; every call to the platform goes to a proxy process.
pub const PROXY_ENV: &str = "HIBER_OPENCL_PROXY";

/// The abstract socket name (without the leading NUL) of the layer in process `ns_pid`.
pub fn socket_name(token: &str, ns_pid: i32) -> String {
    format!("hiber-opencl.{token}.{ns_pid}")
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Status,
    Quiesce {
        timeout_ms: u64,
    },
    Release,
    /// Re-create the objects; `None` keeps each device, `Some` names the one to move to.
    /// `proxy`: in proxy mode, the socket of the proxy to make them through from now on
    /// (`None`: the one the layer used before).
    Replay {
        device: Option<String>,
        proxy: Option<String>,
    },
    Load {
        id: u64,
    },
    Resume,
}

/// What kind of memory object a `mem` message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    Buffer,
    Image,
}

impl fmt::Display for MemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemKind::Buffer => "buffer",
            MemKind::Image => "image",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Status(Status),
    /// A device the process's contexts use: its type (`cpu`, `gpu`, `other`) and
    /// "PLATFORM / DEVICE" names.
    Device {
        kind: String,
        name: String,
    },
    Mem {
        id: u64,
        size: u64,
        kind: MemKind,
    },
    Done {
        count: u64,
    },
    Ok,
    Err(String),
}

/// What the layer of one process holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Status {
    /// The process has called OpenCL.
    pub active: bool,
    pub contexts: u64,
    pub queues: u64,
    pub programs: u64,
    pub kernels: u64,
    pub mems: u64,
    pub mem_bytes: u64,
    pub samplers: u64,
    pub events: u64,
    /// Memory objects mapped into host memory now (clEnqueueMap*).
    pub mapped: u64,
    pub gate_closed: bool,
    /// The real objects are released (a checkpoint is under way or was interrupted).
    pub released: bool,
    /// Memory objects re-created whose bytes are not written back yet.
    pub pending: u64,
    /// OpenCL features the process used that hiber cannot checkpoint, by API name.
    pub refused: Vec<String>,
    /// The layer sends the platform's calls to a proxy process (proxy mode).
    pub proxy: bool,
}

impl Request {
    pub fn encode(&self) -> String {
        match self {
            Request::Status => "status".into(),
            Request::Quiesce { timeout_ms } => format!("quiesce {timeout_ms}"),
            Request::Release => "release".into(),
            Request::Replay { device, proxy } => {
                let mut line = format!("replay {}", device.as_deref().unwrap_or("-"));
                if let Some(p) = proxy {
                    // The rest of the line: a path may hold spaces.
                    line.push_str(&format!(" proxy={}", one_line(p, MAX_MESSAGE - 64)));
                }
                line
            }
            Request::Load { id } => format!("load {id}"),
            Request::Resume => "resume".into(),
        }
    }

    pub fn parse(line: &str) -> Result<Request, ParseError> {
        let mut w = line.split_ascii_whitespace();
        Ok(match w.next() {
            Some("status") => Request::Status,
            Some("quiesce") => Request::Quiesce { timeout_ms: num(w.next(), line)? },
            Some("release") => Request::Release,
            Some("replay") => {
                let device = match w.next() {
                    Some("-") => None,
                    Some(d) => Some(d.to_string()),
                    None => return Err(ParseError(line.into())),
                };
                let proxy = line.split_once(" proxy=").map(|(_, p)| p.to_string()).filter(|p| !p.is_empty());
                Request::Replay { device, proxy }
            }
            Some("load") => Request::Load { id: num(w.next(), line)? },
            Some("resume") => Request::Resume,
            _ => return Err(ParseError(line.into())),
        })
    }
}

impl Status {
    fn fields(&self) -> [(&'static str, u64); 14] {
        [
            ("active", self.active as u64),
            ("contexts", self.contexts),
            ("queues", self.queues),
            ("programs", self.programs),
            ("kernels", self.kernels),
            ("mems", self.mems),
            ("bytes", self.mem_bytes),
            ("samplers", self.samplers),
            ("events", self.events),
            ("mapped", self.mapped),
            ("closed", self.gate_closed as u64),
            ("released", self.released as u64),
            ("pending", self.pending),
            ("proxy", self.proxy as u64),
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
                if !s.refused.is_empty() {
                    out.push_str(&format!(" refused={}", s.refused.join(",")));
                }
                out
            }
            Reply::Device { kind, name } => format!("device {kind} {}", one_line(name, MAX_MESSAGE - 32)),
            Reply::Mem { id, size, kind } => format!("mem {id} {size} {kind}"),
            Reply::Done { count } => format!("done {count}"),
            Reply::Ok => "ok".into(),
            Reply::Err(m) => format!("err {}", one_line(m, MAX_MESSAGE - 8)),
        }
    }

    pub fn parse(line: &str) -> Result<Reply, ParseError> {
        let bad = || ParseError(line.into());
        let (head, rest) = line.split_once(' ').unwrap_or((line, ""));
        let mut w = rest.split_ascii_whitespace();
        Ok(match head {
            "status" => {
                let mut s = Status::default();
                for kv in w {
                    let (k, v) = kv.split_once('=').ok_or_else(bad)?;
                    if k == "refused" {
                        s.refused = v.split(',').filter(|x| !x.is_empty()).map(String::from).collect();
                        continue;
                    }
                    let v: u64 = v.parse().map_err(|_| bad())?;
                    match k {
                        "active" => s.active = v != 0,
                        "contexts" => s.contexts = v,
                        "queues" => s.queues = v,
                        "programs" => s.programs = v,
                        "kernels" => s.kernels = v,
                        "mems" => s.mems = v,
                        "bytes" => s.mem_bytes = v,
                        "samplers" => s.samplers = v,
                        "events" => s.events = v,
                        "mapped" => s.mapped = v,
                        "closed" => s.gate_closed = v != 0,
                        "released" => s.released = v != 0,
                        "pending" => s.pending = v,
                        "proxy" => s.proxy = v != 0,
                        _ => {} // newer layers may say more
                    }
                }
                Reply::Status(s)
            }
            "device" => {
                let (kind, name) = rest.split_once(' ').ok_or_else(bad)?;
                Reply::Device { kind: kind.to_string(), name: name.to_string() }
            }
            "mem" => {
                let id = num(w.next(), line)?;
                let size = num(w.next(), line)?;
                let kind = match w.next() {
                    Some("buffer") => MemKind::Buffer,
                    Some("image") => MemKind::Image,
                    _ => return Err(bad()),
                };
                Reply::Mem { id, size, kind }
            }
            "done" => Reply::Done { count: num(w.next(), line)? },
            "ok" => Reply::Ok,
            "err" => Reply::Err(rest.to_string()),
            _ => return Err(bad()),
        })
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        for r in [
            Request::Status,
            Request::Quiesce { timeout_ms: 5 },
            Request::Release,
            Request::Replay { device: None, proxy: None },
            Request::Replay { device: Some("0:1".into()), proxy: None },
            Request::Replay { device: None, proxy: Some("/var/lib/hiber state/jobs/a/opencl-proxy.sock".into()) },
            Request::Load { id: 9 },
            Request::Resume,
        ] {
            assert_eq!(Request::parse(&r.encode()).unwrap(), r);
        }
        assert!(Request::parse("replay").is_err());
        assert!(Request::parse("load x").is_err());
    }

    #[test]
    fn replies_round_trip() {
        let s = Status {
            active: true,
            contexts: 1,
            mems: 3,
            mem_bytes: 12288,
            refused: vec!["clSVMAlloc".into(), "clCreateFromGLBuffer".into()],
            proxy: true,
            ..Status::default()
        };
        for r in [
            Reply::Status(s),
            Reply::Status(Status::default()),
            Reply::Device { kind: "cpu".into(), name: "Portable Computing Language / pthread-haswell-AMD EPYC".into() },
            Reply::Mem { id: 7, size: 4096, kind: MemKind::Image },
            Reply::Done { count: 2 },
            Reply::Ok,
            Reply::Err("queue 3 still busy".into()),
        ] {
            assert_eq!(Reply::parse(&r.encode()).unwrap(), r);
        }
        assert!(Reply::parse("mem 1 2 texture").is_err());
    }
}
