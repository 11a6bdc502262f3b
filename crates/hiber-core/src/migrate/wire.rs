//! The migration protocol, over a [`crate::secure::Channel`]: messages as JSON, each
//! preceded by its length (4 bytes, big-endian); a file's bytes follow its [`Msg::File`].
//!
//! ```text
//! source                                   target (`hiber serve`)
//! Hello {version, job, name, bytes}  →
//!                                    ←     Accepted | Refused {reason, hint}
//!   (the source checkpoints; the tree stays frozen in CRIU's post-dump step)
//! File {path, size} + bytes ...      →     (into a private staging directory)
//! Log {stream, size} + bytes ...     →     (the job's output so far)
//! Sent                               →
//!                                    ←     Ready        (verified, restored, held stopped)
//!                                    ←     Failed {reason}   (nothing runs there)
//! Commit | Abort {reason}            →
//!                                    ←     Running {name, pid} | Failed {reason}
//! ```
//!
//! The source sends `Commit` only once its own tree is stopped and the image is on its job's
//! record; until `Commit` comes, the target drops its stopped copy whenever the source goes
//! away or says `Abort`. So the job never runs in two places.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

pub const VERSION: u32 = 1;
/// The longest message (not counting a file's bytes).
const MAX_MESSAGE: u32 = 1 << 20;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Msg {
    Hello { version: u32, job: String, name: String, bytes: u64, hiber: String },
    Accepted,
    Refused { reason: String, hint: Option<String> },
    File { path: String, size: u64 },
    Log { stream: LogStream, size: u64 },
    Sent,
    Ready,
    Commit,
    Abort { reason: String },
    Running { name: String, pid: i32 },
    Failed { reason: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogStream {
    Stdout,
    Stderr,
}

pub fn send(w: &mut impl Write, msg: &Msg) -> io::Result<()> {
    let body = serde_json::to_vec(msg).expect("a message serializes");
    w.write_all(&(body.len() as u32).to_be_bytes())?;
    w.write_all(&body)?;
    w.flush()
}

pub fn recv(r: &mut impl Read) -> io::Result<Msg> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len);
    if len > MAX_MESSAGE {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a message of {len} bytes is too long")));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("not a migration message: {e}")))
}

/// Copies exactly `size` bytes from `r` to `w`, in pieces of up to 1 MiB (an image's pages
/// cross the connection in full TLS records rather than `io::copy`'s 8 KiB at a time).
pub fn copy_exact(r: &mut impl Read, w: &mut impl Write, size: u64) -> io::Result<()> {
    let mut buf = vec![0u8; (1 << 20).min(size as usize).max(1)];
    let mut left = size;
    while left > 0 {
        let want = buf.len().min(left as usize);
        let n = match r.read(&mut buf[..want]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("the connection ended {left} bytes short"))),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        w.write_all(&buf[..n])?;
        left -= n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_long_ones_are_refused() {
        let mut buf = Vec::new();
        let msgs = [
            Msg::Hello { version: VERSION, job: "a".into(), name: "b".into(), bytes: 7, hiber: "0".into() },
            Msg::Ready,
            Msg::Running { name: "b".into(), pid: 3 },
        ];
        for m in &msgs {
            send(&mut buf, m).unwrap();
        }
        let mut r = &buf[..];
        for m in &msgs {
            assert_eq!(&recv(&mut r).unwrap(), m);
        }
        let mut long = (MAX_MESSAGE + 1).to_be_bytes().to_vec();
        long.extend_from_slice(b"{}");
        assert_eq!(recv(&mut &long[..]).unwrap_err().kind(), io::ErrorKind::InvalidData);
        let mut short = &b"abc"[..];
        assert!(copy_exact(&mut short, &mut Vec::new(), 4).is_err());
    }
}
