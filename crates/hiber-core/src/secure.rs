//! An authenticated, encrypted connection between two hibers that hold the same token.
//!
//! An image holds a process's memory, secrets included, so whatever carries one across a
//! network (`hiber migrate` to a `hiber serve`) is encrypted and both ends prove they hold
//! the token, a secret of at least 128 bits in a file only its owner can read:
//!
//! - **The server proves it** with TLS 1.3 (rustls): its certificate is made from a key
//!   derived from the token, and the client accepts only that very certificate (made the
//!   same way on its side: Ed25519 signatures and rcgen's encoding are deterministic). A
//!   server without the token cannot finish the handshake, so the client never sends it
//!   anything.
//! - **The client proves it** inside the encrypted channel, with a keyed hash of the
//!   connection's exported keying material under a second key derived from the token: bound
//!   to this connection, useless elsewhere, and the token itself never crosses the wire.
//!
//! No certificate authority, no file of keys beside the token: a user who can copy one
//! file to two hosts can migrate between them.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, ClientConnection, DigitallySignedStruct, ServerConfig, ServerConnection, SignatureScheme, StreamOwned};

/// The least a token holds, in bytes of its file (trimmed): 32 characters, as base64 of 24
/// random bytes or hex of 16 (128 bits) make. Anyone who connects learns a public key derived
/// from the token, against which a short one could be guessed offline.
const MIN_TOKEN_BYTES: usize = 32;
/// How long the handshake and the client's proof may take, however slowly bytes trickle in.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);
/// The name the server's certificate is issued to and the client asks for.
const SERVER_NAME: &str = "hiber";
const EXPORTER_LABEL: &[u8] = b"EXPORTER-hiber-client-proof";

#[derive(Debug, thiserror::Error)]
pub enum SecureError {
    #[error("token file {path}: {source}")]
    TokenIo { path: PathBuf, source: io::Error },
    #[error("token file {path} can be read or written by others (mode {mode:o})")]
    TokenOpen { path: PathBuf, mode: u32 },
    #[error("token file {path} is not owned by this user")]
    TokenOwner { path: PathBuf },
    #[error("token file {path} holds {len} bytes; a token needs at least {MIN_TOKEN_BYTES}")]
    TokenShort { path: PathBuf, len: usize },
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: io::Error },
    #[error("{addr} does not hold this token (its TLS identity differs), or is not a hiber: {detail}")]
    Identity { addr: String, detail: String },
    #[error("the peer did not prove it holds the token")]
    Refused,
    #[error("TLS: {0}")]
    Tls(String),
    #[error("{0}")]
    Io(#[from] io::Error),
}

impl SecureError {
    pub fn hint(&self) -> Option<String> {
        match self {
            SecureError::TokenIo { .. } | SecureError::TokenShort { .. } => {
                Some("make one with `(umask 077; head -c 32 /dev/urandom | base64 > FILE)` and give both sides a copy".into())
            }
            SecureError::TokenOpen { path, .. } => Some(format!("chmod 600 {}", path.display())),
            SecureError::TokenOwner { .. } => Some("the token file must be this user's own".into()),
            SecureError::Identity { .. } => Some("give both sides a copy of the same token file".into()),
            SecureError::Connect { .. } => Some("start `hiber serve --listen ADDR --token-file FILE` on the target first".into()),
            _ => None,
        }
    }
}

/// A shared secret, read from its file. Never printed (its `Debug` hides it).
#[derive(Clone)]
pub struct Token {
    secret: Vec<u8>,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// Reads a token file, refusing one that others could read or write, or that is not
    /// this user's (as ssh refuses such keys). Surrounding whitespace is not part of it.
    pub fn from_file(path: &Path) -> Result<Token, SecureError> {
        use std::os::unix::fs::MetadataExt;
        let io_err = |source| SecureError::TokenIo { path: path.to_path_buf(), source };
        let mut file = std::fs::File::open(path).map_err(io_err)?;
        let meta = file.metadata().map_err(io_err)?;
        if !meta.is_file() {
            return Err(io_err(io::Error::other("not a regular file")));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(SecureError::TokenOpen { path: path.to_path_buf(), mode: meta.mode() & 0o7777 });
        }
        if meta.uid() != crate::sys::geteuid() {
            return Err(SecureError::TokenOwner { path: path.to_path_buf() });
        }
        let mut text = Vec::new();
        Read::take(&mut file, 64 << 10).read_to_end(&mut text).map_err(io_err)?;
        let secret = text.trim_ascii().to_vec();
        if secret.len() < MIN_TOKEN_BYTES {
            return Err(SecureError::TokenShort { path: path.to_path_buf(), len: secret.len() });
        }
        Ok(Token { secret })
    }

    /// A token of these bytes (tests).
    pub fn from_bytes(secret: &[u8]) -> Token {
        Token { secret: secret.to_vec() }
    }

    fn derive(&self, purpose: &str) -> [u8; 32] {
        blake3::derive_key(&format!("hiber 2026-11 secure channel: {purpose}"), &self.secret)
    }

    /// The server's certificate and key, both functions of the token alone.
    fn identity(&self) -> Result<(CertificateDer<'static>, PrivatePkcs8KeyDer<'static>), SecureError> {
        // An Ed25519 private key in PKCS#8 v1 is this fixed prefix and the 32-byte seed
        // (RFC 8410, section 7).
        const ED25519_PKCS8_PREFIX: [u8; 16] = [0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];
        let mut der = ED25519_PKCS8_PREFIX.to_vec();
        der.extend_from_slice(&self.derive("server key"));
        let key = PrivatePkcs8KeyDer::from(der);
        let pair = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&key, &rcgen::PKCS_ED25519).map_err(|e| SecureError::Tls(e.to_string()))?;
        let mut params = rcgen::CertificateParams::new(vec![SERVER_NAME.to_string()]).map_err(|e| SecureError::Tls(e.to_string()))?;
        params.serial_number = Some(rcgen::SerialNumber::from(1u64));
        let cert = params.self_signed(&pair).map_err(|e| SecureError::Tls(e.to_string()))?;
        Ok((cert.der().clone(), key))
    }

    /// What the client sends to prove it holds the token, for the connection whose
    /// exported keying material is `ekm`.
    fn proof(&self, ekm: &[u8; 32]) -> [u8; 32] {
        *blake3::keyed_hash(&self.derive("client proof"), ekm).as_bytes()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Accepts exactly one certificate: the one the token makes.
#[derive(Debug)]
struct Pinned {
    cert: CertificateDer<'static>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if intermediates.is_empty() && end_entity.as_ref() == self.cert.as_ref() {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General("the server's certificate is not the one this token makes".into()))
        }
    }

    fn verify_tls12_signature(&self, _: &[u8], _: &CertificateDer<'_>, _: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not offered".into()))
    }

    fn verify_tls13_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

/// One end of an authenticated, encrypted connection.
pub enum Channel {
    Client(Box<StreamOwned<ClientConnection, TcpStream>>),
    Server(Box<StreamOwned<ServerConnection, TcpStream>>),
}

impl Channel {
    /// Connects to `addr` and authenticates both ways with `token`.
    pub fn connect(addr: &str, token: &Token, timeout: Duration) -> Result<Channel, SecureError> {
        let mut stream = Self::handshake(addr, token, timeout)?;
        let ekm = stream.conn.export_keying_material([0u8; 32], EXPORTER_LABEL, None).map_err(|e| SecureError::Tls(e.to_string()))?;
        stream.write_all(&token.proof(&ekm))?;
        stream.flush()?;
        // The server answers one byte once it checked the proof.
        let mut ok = [0u8; 1];
        stream.read_exact(&mut ok).map_err(|_| SecureError::Refused)?;
        if ok[0] != 1 {
            return Err(SecureError::Refused);
        }
        Ok(Channel::Client(Box::new(stream)))
    }

    /// The client's TLS handshake with a server that must hold `token`.
    fn handshake(addr: &str, token: &Token, timeout: Duration) -> Result<StreamOwned<ClientConnection, TcpStream>, SecureError> {
        let connect_err = |source| SecureError::Connect { addr: addr.to_string(), source };
        let sock_addr =
            std::net::ToSocketAddrs::to_socket_addrs(addr).map_err(connect_err)?.next().ok_or_else(|| connect_err(io::Error::other("no address")))?;
        let tcp = TcpStream::connect_timeout(&sock_addr, timeout).map_err(connect_err)?;
        tcp.set_read_timeout(Some(timeout))?;
        tcp.set_write_timeout(Some(timeout))?;
        tcp.set_nodelay(true)?;
        let (cert, _) = token.identity()?;
        let provider = provider();
        let config = ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| SecureError::Tls(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Pinned { cert, provider }))
            .with_no_client_auth();
        let name = ServerName::try_from(SERVER_NAME).map_err(|e| SecureError::Tls(e.to_string()))?;
        let conn = ClientConnection::new(Arc::new(config), name).map_err(|e| SecureError::Tls(e.to_string()))?;
        let mut stream = StreamOwned::new(conn, tcp);
        while stream.conn.is_handshaking() {
            stream.conn.complete_io(&mut stream.sock).map_err(|e| SecureError::Identity { addr: addr.to_string(), detail: e.to_string() })?;
        }
        Ok(stream)
    }

    /// The server's side of [`Channel::connect`] on an accepted connection. The handshake
    /// and the proof must come within [`HANDSHAKE_DEADLINE`]; `timeout` is each later read's
    /// and write's.
    pub fn accept(tcp: TcpStream, token: &Token, timeout: Duration) -> Result<Channel, SecureError> {
        let deadline = std::time::Instant::now() + HANDSHAKE_DEADLINE;
        let left = || {
            let d = deadline.saturating_duration_since(std::time::Instant::now());
            if d.is_zero() {
                Err(SecureError::Refused)
            } else {
                Ok(d)
            }
        };
        tcp.set_read_timeout(Some(left()?))?;
        tcp.set_write_timeout(Some(left()?))?;
        tcp.set_nodelay(true)?;
        let (cert, key) = token.identity()?;
        let config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| SecureError::Tls(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(vec![cert], PrivateKeyDer::Pkcs8(key))
            .map_err(|e| SecureError::Tls(e.to_string()))?;
        let conn = ServerConnection::new(Arc::new(config)).map_err(|e| SecureError::Tls(e.to_string()))?;
        let mut stream = StreamOwned::new(conn, tcp);
        while stream.conn.is_handshaking() {
            stream.sock.set_read_timeout(Some(left()?))?;
            stream.conn.complete_io(&mut stream.sock).map_err(|e| SecureError::Tls(e.to_string()))?;
        }
        let ekm = stream.conn.export_keying_material([0u8; 32], EXPORTER_LABEL, None).map_err(|e| SecureError::Tls(e.to_string()))?;
        let mut proof = [0u8; 32];
        let mut got = 0;
        while got < proof.len() {
            stream.sock.set_read_timeout(Some(left()?))?;
            match stream.read(&mut proof[got..]) {
                Ok(0) | Err(_) => return Err(SecureError::Refused),
                Ok(n) => got += n,
            }
        }
        if !constant_time_eq(&proof, &token.proof(&ekm)) {
            return Err(SecureError::Refused);
        }
        stream.write_all(&[1])?;
        stream.flush()?;
        stream.sock.set_read_timeout(Some(timeout))?;
        stream.sock.set_write_timeout(Some(timeout))?;
        Ok(Channel::Server(Box::new(stream)))
    }

    fn tcp(&self) -> &TcpStream {
        match self {
            Channel::Client(s) => &s.sock,
            Channel::Server(s) => &s.sock,
        }
    }

    /// How long a read waits (`None`: for ever).
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp().set_read_timeout(t)
    }

    /// Closes the connection at once (both directions), as a lost one would be.
    pub fn shutdown(&self) {
        let _ = self.tcp().shutdown(std::net::Shutdown::Both);
    }

    pub fn peer(&self) -> String {
        self.tcp().peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into())
    }
}

impl Read for Channel {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Channel::Client(s) => s.read(buf),
            Channel::Server(s) => s.read(buf),
        }
    }
}

impl Write for Channel {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Channel::Client(s) => s.write(buf),
            Channel::Server(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Channel::Client(s) => s.flush(),
            Channel::Server(s) => s.flush(),
        }
    }
}

/// An established [`Channel`] that a reader thread and writers on other threads use at
/// once (the coordinator reads each participant on a thread of its own and answers from
/// another). The TLS state is shared under a lock that no blocking socket read holds: a
/// read waits for bytes on its own clone of the socket, then feeds them in.
pub struct Duplex {
    tls: std::sync::Mutex<Shared>,
    /// Writes (under the lock).
    sock: TcpStream,
    /// Reads (outside it).
    rsock: TcpStream,
}

/// What the lock holds: the connection, and bytes read from the socket that it did not take
/// yet (rustls takes a few KiB at a time).
struct Shared {
    conn: rustls::Connection,
    unread: Vec<u8>,
    eof: bool,
}

impl Duplex {
    pub fn new(ch: Channel) -> io::Result<Duplex> {
        let (conn, sock): (rustls::Connection, TcpStream) = match ch {
            Channel::Client(s) => {
                let s = *s;
                (s.conn.into(), s.sock)
            }
            Channel::Server(s) => {
                let s = *s;
                (s.conn.into(), s.sock)
            }
        };
        let rsock = sock.try_clone()?;
        Ok(Duplex { tls: std::sync::Mutex::new(Shared { conn, unread: Vec::new(), eof: false }), sock, rsock })
    }

    fn tls(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.tls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends what the connection has ready for the socket.
    fn flush_tls(&self, conn: &mut rustls::Connection) -> io::Result<()> {
        while conn.wants_write() {
            conn.write_tls(&mut &self.sock)?;
        }
        Ok(())
    }

    /// Writes all of `buf`, encrypted. The connection buffers a limited amount, so it is
    /// sent to the socket as it fills.
    pub fn write_all(&self, buf: &[u8]) -> io::Result<()> {
        let mut tls = self.tls();
        let mut rest = buf;
        while !rest.is_empty() {
            let n = tls.conn.writer().write(rest)?;
            rest = &rest[n..];
            let full = n == 0 && !tls.conn.wants_write();
            self.flush_tls(&mut tls.conn)?;
            if full {
                return Err(io::Error::new(io::ErrorKind::WriteZero, "the TLS connection took nothing"));
            }
        }
        Ok(())
    }

    /// How long a read waits for the peer (`None`: for ever).
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.rsock.set_read_timeout(t)
    }

    /// How long a write waits for the peer to take it.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.sock.set_write_timeout(t)
    }

    /// Closes the connection at once (both directions), as a lost one would be.
    pub fn shutdown(&self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

impl Read for &Duplex {
    /// Decrypted bytes; `Ok(0)` once the peer closed, with or without saying so.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            {
                let mut tls = self.tls();
                let Shared { conn, unread, eof } = &mut *tls;
                // Feed what was read and not taken yet, until there is something to return
                // (rustls holds at most 16 KiB of it: the rest waits here).
                while !unread.is_empty() {
                    let n = conn.read_tls(&mut &unread[..])?;
                    unread.drain(..n);
                    let state = match conn.process_new_packets() {
                        Ok(state) => state,
                        Err(e) => {
                            // The alert it queued tells the peer why.
                            let _ = self.flush_tls(conn);
                            return Err(io::Error::new(io::ErrorKind::InvalidData, e));
                        }
                    };
                    if n == 0 || state.plaintext_bytes_to_read() > 0 {
                        break;
                    }
                }
                self.flush_tls(conn)?;
                match conn.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock && !*eof => {}
                    Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::UnexpectedEof) => return Ok(0),
                    Err(e) => return Err(e),
                }
                if *eof && unread.is_empty() {
                    return Ok(0);
                }
            }
            let mut raw = vec![0u8; 16 << 10];
            let n = (&self.rsock).read(&mut raw)?;
            let mut tls = self.tls();
            if n == 0 {
                // The peer's end of the stream: what is buffered is read above, then 0.
                tls.eof = true;
                if tls.unread.is_empty() {
                    tls.conn.read_tls(&mut io::empty())?;
                }
            } else {
                tls.unread.extend_from_slice(&raw[..n]);
            }
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair(server_token: Token, client_token: Token) -> (Result<Channel, SecureError>, Result<Channel, SecureError>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (tcp, _) = listener.accept().unwrap();
            Channel::accept(tcp, &server_token, Duration::from_secs(5))
        });
        let client = Channel::connect(&addr, &client_token, Duration::from_secs(5));
        (client, server.join().unwrap())
    }

    #[test]
    fn the_same_token_makes_the_same_certificate() {
        let t = Token::from_bytes(b"0123456789abcdef0123");
        assert_eq!(t.identity().unwrap().0, t.identity().unwrap().0);
        assert_ne!(t.identity().unwrap().0, Token::from_bytes(b"0123456789abcdef0124").identity().unwrap().0);
    }

    #[test]
    fn holders_of_one_token_talk() {
        let t = Token::from_bytes(b"a token of twenty-odd bytes");
        let (client, server) = pair(t.clone(), t);
        let (mut client, mut server) = (client.unwrap(), server.unwrap());
        client.write_all(b"hello over TLS\n").unwrap();
        client.flush().unwrap();
        let mut got = [0u8; 15];
        server.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello over TLS\n");
    }

    #[test]
    fn a_server_without_the_token_is_not_trusted() {
        let (client, server) = pair(Token::from_bytes(b"the server's own token"), Token::from_bytes(b"the client's other token"));
        assert!(matches!(client, Err(SecureError::Identity { .. })), "{:?}", client.err());
        assert!(server.is_err());
    }

    /// A client that gets through the handshake (it knows the server's certificate, which is
    /// no secret) but cannot prove it holds the token is refused.
    #[test]
    fn a_client_without_the_proof_is_refused() {
        let t = Token::from_bytes(b"the one token of this test, long enough");
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server_token = t.clone();
        let server = std::thread::spawn(move || {
            let mut results = Vec::new();
            for _ in 0..2 {
                let (tcp, _) = listener.accept().unwrap();
                results.push(Channel::accept(tcp, &server_token, Duration::from_secs(5)).map(|_| ()));
            }
            results
        });
        // A wrong proof, then none at all (the connection closed after the handshake).
        let mut wrong = Channel::handshake(&addr, &t, Duration::from_secs(5)).unwrap();
        wrong.write_all(&[0u8; 32]).unwrap();
        wrong.flush().unwrap();
        let mut answer = [0u8; 1];
        assert!(wrong.read_exact(&mut answer).is_err(), "no answer to a wrong proof");
        drop(Channel::handshake(&addr, &t, Duration::from_secs(5)).unwrap());
        let results = server.join().unwrap();
        assert!(results.iter().all(|r| matches!(r, Err(SecureError::Refused))), "{results:?}");
    }

    /// A peer that sends message after message without waiting: every byte comes out of a
    /// `Duplex` in order, however the socket's reads cut the records.
    #[test]
    fn a_duplex_reads_back_to_back_messages_whole() {
        let t = Token::from_bytes(b"a token for the duplex test, long enough");
        let (client, server) = pair(t.clone(), t);
        let (mut client, server) = (client.unwrap(), Duplex::new(server.unwrap()).unwrap());
        let sent: Vec<u8> = (0..(600 << 10)).map(|i: usize| (i * 31 % 251) as u8).collect();
        let writer = std::thread::spawn(move || {
            for piece in sent.chunks(100 << 10) {
                client.write_all(piece).unwrap();
            }
            client.flush().unwrap();
            (client, sent)
        });
        // Let the whole of it pile up in the socket before the first read.
        std::thread::sleep(Duration::from_millis(300));
        // In small reads, as a line reader makes them: decrypted bytes wait between reads.
        let mut got = vec![0u8; 600 << 10];
        for piece in got.chunks_mut(3000) {
            (&server).read_exact(piece).unwrap();
        }
        let (mut client, sent) = writer.join().unwrap();
        assert!(got == sent, "the bytes differ");
        // And back the other way, larger than rustls buffers.
        let back: Vec<u8> = sent.iter().rev().copied().collect();
        server.write_all(&back).unwrap();
        let mut echo = vec![0u8; back.len()];
        client.read_exact(&mut echo).unwrap();
        assert!(echo == back);
    }

    #[test]
    fn token_files_must_be_private_and_long_enough() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("hiber-token-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("token");
        std::fs::write(&f, "  0123456789abcdef0123456789abcdef\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(Token::from_file(&f), Err(SecureError::TokenOpen { mode: 0o644, .. })));
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(Token::from_file(&f).unwrap().secret, b"0123456789abcdef0123456789abcdef");
        std::fs::write(&f, "short\n").unwrap();
        assert!(matches!(Token::from_file(&f), Err(SecureError::TokenShort { len: 5, .. })));
        assert!(matches!(Token::from_file(&dir.join("none")), Err(SecureError::TokenIo { .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
