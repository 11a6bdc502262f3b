//! The kernel's socket table, through sock_diag (netlink): the TCP connections of this
//! network namespace that their program closed and the kernel still finishes, and ending
//! one (`SOCK_DESTROY`, what `ss -K` does).
//!
//! A program that closed a connection first leaves it in TIME_WAIT on its own address for
//! a minute (or in FIN_WAIT while its peer has not closed, CLOSING, LAST_ACK). If the
//! program is stopped by a checkpoint, or a failed restore killed its restored copy, and
//! it is restored in place within that minute, CRIU binds the program's sockets to their
//! addresses again, and such a connection holds the port where it was made without
//! `SO_REUSEADDR` (Open MPI's TCP transport listens so): the restore fails with "Address
//! already in use". Those connections are the program's own past; the restore ends them
//! first (see `restore::free_ports_of`).

use std::io;
use std::net::{IpAddr, SocketAddr};

use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP, SOCK_DESTROY};
use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_sys::protocols::NETLINK_SOCK_DIAG;
use netlink_sys::{Socket, SocketAddr as NetlinkAddr};

/// A TCP connection that no program holds any more (its socket has no inode), which the
/// kernel keeps until its closing handshake or TIME_WAIT ends.
#[derive(Debug, Clone)]
pub struct Closed {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// TIME_WAIT, FIN_WAIT1, FIN_WAIT2, CLOSING or LAST_ACK.
    pub state: &'static str,
    id: SocketId,
    family: u8,
}

/// The states of a connection closed by its program and not yet gone.
fn closing_states() -> StateFlags {
    StateFlags::TIME_WAIT | StateFlags::FIN_WAIT1 | StateFlags::FIN_WAIT2 | StateFlags::CLOSING | StateFlags::LAST_ACK
}

fn state_name(state: u8) -> &'static str {
    use netlink_packet_sock_diag::constants::*;
    match state {
        TCP_TIME_WAIT => "TIME_WAIT",
        TCP_FIN_WAIT1 => "FIN_WAIT1",
        TCP_FIN_WAIT2 => "FIN_WAIT2",
        TCP_CLOSING => "CLOSING",
        TCP_LAST_ACK => "LAST_ACK",
        _ => "another state",
    }
}

/// A sock_diag socket of this network namespace.
pub struct SockDiag {
    socket: Socket,
    seq: u32,
}

impl SockDiag {
    pub fn open() -> io::Result<SockDiag> {
        let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
        socket.bind_auto()?;
        socket.connect(&NetlinkAddr::new(0, 0))?;
        Ok(SockDiag { socket, seq: 0 })
    }

    /// Every TCP connection (IPv4 and IPv6) closed by its program and not yet gone. A
    /// socket a program still holds (half-closed with `shutdown`, say) is not one of them.
    pub fn closed(&mut self) -> io::Result<Vec<Closed>> {
        let mut all = Vec::new();
        for (family, any) in [(AF_INET, SocketId::new_v4()), (AF_INET6, SocketId::new_v6())] {
            let replies = self.request(NLM_F_REQUEST | NLM_F_DUMP, None, inet_request(family, any, closing_states()))?;
            for r in replies.into_iter().filter(|r| r.header.inode == 0) {
                let id = r.header.socket_id;
                all.push(Closed {
                    local: SocketAddr::new(id.source_address, id.source_port),
                    remote: SocketAddr::new(id.destination_address, id.destination_port),
                    state: state_name(r.header.state),
                    id,
                    family,
                });
            }
        }
        Ok(all)
    }

    /// Ends one such connection (one not in TIME_WAIT gets a reset, as `ss -K` sends).
    /// `Ok` also where it had ended by itself meanwhile. Fails with `EOPNOTSUPP` on a kernel
    /// built without `CONFIG_INET_DIAG_DESTROY`.
    pub fn destroy(&mut self, c: &Closed) -> io::Result<()> {
        let states = closing_states();
        match self.request(NLM_F_REQUEST | NLM_F_ACK, Some(SOCK_DESTROY), inet_request(c.family, c.id.clone(), states)) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            r => r.map(|_| ()),
        }
    }

    /// Sends one request and reads its replies up to the end of a dump or an
    /// acknowledgement; a negative acknowledgement is the error.
    fn request(&mut self, flags: u16, message_type: Option<u16>, req: InetRequest) -> io::Result<Vec<netlink_packet_sock_diag::inet::InetResponse>> {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, SockDiagMessage::InetRequest(req).into());
        packet.finalize();
        // The crate writes every request as SOCK_DIAG_BY_FAMILY; SOCK_DESTROY has the same
        // body (the socket's full identity).
        if let Some(t) = message_type {
            packet.header.message_type = t;
        }
        let mut buf = vec![0; packet.buffer_len()];
        packet.serialize(&mut buf);
        self.socket.send(&buf, 0)?;
        let mut out = Vec::new();
        let mut rx = vec![0u8; 64 * 1024];
        loop {
            let n = self.socket.recv(&mut &mut rx[..], 0)?;
            let mut at = 0;
            while at < n {
                let msg = NetlinkMessage::<SockDiagMessage>::deserialize(&rx[at..n]).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                let len = msg.header.length as usize;
                if msg.header.sequence_number == self.seq {
                    match msg.payload {
                        NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => out.push(*r),
                        NetlinkPayload::Done(_) => return Ok(out),
                        NetlinkPayload::Error(e) if e.code.is_none() => return Ok(out),
                        NetlinkPayload::Error(e) => return Err(e.to_io()),
                        _ => {}
                    }
                }
                if len == 0 {
                    break;
                }
                at += (len + 3) & !3;
            }
        }
    }
}

fn inet_request(family: u8, socket_id: SocketId, states: StateFlags) -> InetRequest {
    InetRequest { family, protocol: IPPROTO_TCP, extensions: ExtensionFlags::empty(), states, socket_id }
}

/// Whether a socket bound to `a` and one bound to `b` contend for one port: the same port,
/// and the same address or either one a wildcard (an IPv6 wildcard also takes IPv4's, and
/// an IPv4-mapped IPv6 address is its IPv4 address).
pub fn contend(a: SocketAddr, b: SocketAddr) -> bool {
    fn plain(ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        }
    }
    a.port() == b.port() && (a.ip().is_unspecified() || b.ip().is_unspecified() || plain(a.ip()) == plain(b.ip()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ports_contend_on_the_same_or_a_wildcard_address() {
        assert!(contend(sa("0.0.0.0:1024"), sa("10.0.0.1:1024")));
        assert!(contend(sa("10.0.0.1:1024"), sa("10.0.0.1:1024")));
        assert!(contend(sa("[::]:80"), sa("127.0.0.1:80")));
        assert!(contend(sa("[::ffff:127.0.0.1]:80"), sa("127.0.0.1:80")));
        assert!(!contend(sa("10.0.0.1:1024"), sa("10.0.0.2:1024")));
        assert!(!contend(sa("0.0.0.0:1024"), sa("0.0.0.0:1025")));
    }

    /// A connection closed first by its server side is in TIME_WAIT on the server's
    /// port, is listed, and is gone once ended (ending sockets needs CAP_NET_ADMIN: the
    /// tests run as root).
    #[test]
    fn a_time_wait_connection_is_listed_and_ended() {
        use std::net::{TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap();
        let client = TcpStream::connect(port).unwrap();
        let (server_side, _) = listener.accept().unwrap();
        drop(server_side);
        drop(client);
        let mut diag = SockDiag::open().unwrap();
        let mut held = Vec::new();
        for _ in 0..100 {
            held = diag.closed().unwrap().into_iter().filter(|t| t.local == port).collect();
            if !held.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(held.len(), 1, "the server's side waits on its port");
        assert_eq!(held[0].state, "TIME_WAIT");
        diag.destroy(&held[0]).unwrap();
        assert!(!diag.closed().unwrap().iter().any(|t| t.local == port), "ended");
        diag.destroy(&held[0]).expect("ending it again is not an error");
    }

    /// A connection its program closed while the peer keeps its side open waits in
    /// FIN_WAIT2 with no owner, and is listed and ended; the peer's side, still held by
    /// its program, is not listed.
    #[test]
    fn a_connection_closed_on_one_side_only_is_listed_by_its_closed_side() {
        use std::net::{TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_side, _) = listener.accept().unwrap();
        let (closed_at, held_at) = (server_side.local_addr().unwrap(), client.local_addr().unwrap());
        drop(server_side);
        let mut diag = SockDiag::open().unwrap();
        let mut found = Vec::new();
        for _ in 0..100 {
            found = diag.closed().unwrap().into_iter().filter(|c| c.local == closed_at && c.remote == held_at).collect();
            if found.first().is_some_and(|c| c.state == "FIN_WAIT2") {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].state, "FIN_WAIT2");
        assert!(!diag.closed().unwrap().iter().any(|c| c.local == held_at), "the side a program holds is not listed");
        diag.destroy(&found[0]).unwrap();
        assert!(!diag.closed().unwrap().iter().any(|c| c.local == closed_at), "ended");
        drop(client);
    }
}
