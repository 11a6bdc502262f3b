//! What hiber and the layers it preloads into applications share: each layer's control
//! protocol ([`agent`], [`opencl`]) and their transport ([`socket`]: an abstract
//! `SOCK_SEQPACKET` socket, one ASCII message each way, descriptors beside some). Each
//! protocol's messages implement [`Message`]; replies implement [`Answer`]. What the layers
//! run on inside the application is `hiber-layer`'s.

pub mod agent;
pub mod opencl;
pub mod socket;

use std::fmt;

/// A GPU's name as NVML, nvidia-smi and hiber's manifests spell it, from the 16 bytes of
/// its CUuuid: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
pub fn gpu_uuid(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// Largest message either side sends.
pub const MAX_MESSAGE: usize = 512;

/// A message of one of the control protocols, as one line of text.
pub trait Message: Sized {
    fn encode(&self) -> String;
    fn parse(line: &str) -> Result<Self, ParseError>;
}

/// A reply, which may say that the request failed.
pub trait Answer: Message {
    /// The layer's reason, when the reply is an error.
    fn error(&self) -> Option<&str>;
}

macro_rules! message {
    ($($t:ty),*) => {$(
        impl $crate::Message for $t {
            fn encode(&self) -> String {
                <$t>::encode(self)
            }
            fn parse(line: &str) -> Result<Self, $crate::ParseError> {
                <$t>::parse(line)
            }
        }
    )*};
}
pub(crate) use message;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError(pub String);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad control message: {:?}", self.0)
    }
}

impl std::error::Error for ParseError {}

/// `text` as one line of at most `max` bytes (control characters dropped, cut at a
/// character boundary).
pub fn one_line(text: &str, max: usize) -> String {
    let mut m: String = text.chars().filter(|c| !c.is_control()).collect();
    let mut cut = m.len().min(max);
    while !m.is_char_boundary(cut) {
        cut -= 1;
    }
    m.truncate(cut);
    m
}

pub(crate) fn num<T: std::str::FromStr>(s: Option<&str>, line: &str) -> Result<T, ParseError> {
    s.and_then(|v| v.parse().ok()).ok_or_else(|| ParseError(line.into()))
}
