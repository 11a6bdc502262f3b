//! Abstract unix `SOCK_SEQPACKET` sockets that carry one message and at most one file
//! descriptor at a time. All of the protocol's unsafe code is here.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

fn address(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = name.as_bytes();
    if bytes.len() + 1 > addr.sun_path.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "socket name too long"));
    }
    // Abstract: sun_path[0] stays NUL, the name follows, and the length says where it ends.
    for (i, b) in bytes.iter().enumerate() {
        addr.sun_path[i + 1] = *b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + bytes.len();
    Ok((addr, len as libc::socklen_t))
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub fn listen(name: &str) -> io::Result<OwnedFd> {
    let s = socket()?;
    let (addr, len) = address(name)?;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
    if unsafe { libc::bind(s.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: plain syscall on our socket.
    if unsafe { libc::listen(s.as_raw_fd(), 4) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(s)
}

pub fn connect(name: &str) -> io::Result<OwnedFd> {
    let s = socket()?;
    let (addr, len) = address(name)?;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
    if unsafe { libc::connect(s.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(s)
}

pub fn accept(listener: &OwnedFd) -> io::Result<OwnedFd> {
    loop {
        // SAFETY: accept4 with null address pointers is allowed.
        let fd = unsafe { libc::accept4(listener.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC) };
        if fd >= 0 {
            // SAFETY: fresh descriptor.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Makes `recv` on `sock` fail with `TimedOut` after `timeout` (`None`: wait forever).
pub fn set_recv_timeout(sock: &OwnedFd, timeout: Option<std::time::Duration>) -> io::Result<()> {
    let t = timeout.unwrap_or_default();
    let tv = libc::timeval { tv_sec: t.as_secs() as libc::time_t, tv_usec: t.subsec_micros() as libc::suseconds_t };
    // SAFETY: `tv` is a valid timeval of the size given.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The user id of the process at the other end of `sock`.
pub fn peer_uid(sock: &OwnedFd) -> io::Result<u32> {
    Ok(peer_cred(sock.as_fd())?.uid)
}

/// The credentials (PID in this process's PID namespace, uid, gid) of the process at the
/// other end of the Unix socket `sock`, as it connected.
pub fn peer_cred(sock: std::os::fd::BorrowedFd<'_>) -> io::Result<libc::ucred> {
    // SAFETY: ucred is plain data; getsockopt fills at most `len` bytes of it.
    unsafe {
        let mut cred: libc::ucred = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        if libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(cred)
    }
}

/// Room for one descriptor's control message.
#[repr(C)]
union Control {
    buf: [u8; 64],
    _align: libc::cmsghdr,
}

/// Sends `msg`, and `fd` beside it when given.
pub fn send(sock: &OwnedFd, msg: &str, fd: Option<RawFd>) -> io::Result<()> {
    let mut iov = libc::iovec { iov_base: msg.as_ptr() as *mut libc::c_void, iov_len: msg.len() };
    let mut control = Control { buf: [0; 64] };
    // SAFETY: msghdr is plain data; zeroed is valid.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: the control buffer is large and aligned enough for one cmsghdr carrying
        // one int; CMSG_* compute offsets within it.
        unsafe {
            hdr.msg_control = control.buf.as_mut_ptr().cast();
            hdr.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as _;
            let c = libc::CMSG_FIRSTHDR(&hdr);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
        }
    }
    loop {
        // SAFETY: `hdr` points at live buffers for the duration of the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &hdr, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives one message and the descriptor that came with it. `Ok(None)`: the peer closed.
pub fn recv(sock: &OwnedFd) -> io::Result<Option<(String, Option<OwnedFd>)>> {
    let mut buf = [0u8; crate::MAX_MESSAGE];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut control = Control { buf: [0; 64] };
    // SAFETY: msghdr is plain data; zeroed is valid.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    // SAFETY: taking the address of the union's byte buffer.
    hdr.msg_control = unsafe { control.buf.as_mut_ptr().cast() };
    hdr.msg_controllen = 64;
    let n = loop {
        // SAFETY: `hdr` points at live buffers for the duration of the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut hdr, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Err(io::Error::new(io::ErrorKind::TimedOut, "no answer in time")),
            _ => return Err(e),
        }
    };
    let mut fd = None;
    // SAFETY: the kernel filled `hdr.msg_control*`; CMSG_* walk within it.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&hdr);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let raw = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>().add(i));
                    // The first is ours; any extra (the protocol never sends them) is closed.
                    let owned = OwnedFd::from_raw_fd(raw);
                    if fd.is_none() {
                        fd = Some(owned);
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&hdr, c);
        }
    }
    if n == 0 && fd.is_none() {
        return Ok(None);
    }
    if hdr.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "agent message too long"));
    }
    if hdr.msg_flags & libc::MSG_CTRUNC != 0 {
        // The kernel dropped a descriptor (the receiver's descriptor limit, say).
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a descriptor sent with the message was dropped (too many open files?)"));
    }
    Ok(Some((String::from_utf8_lossy(&buf[..n]).into_owned(), fd)))
}

/// A layer's control loop: accepts hiber's connections on `listener` forever, refuses any
/// peer but root and the process's own user, runs `session` on each (a panic in it is
/// caught, never unwound into the application), then `after` (the layer decides whether
/// its gate may open). Everything worth saying goes to `log`.
pub fn serve(listener: OwnedFd, log: impl Fn(&str), mut session: impl FnMut(&OwnedFd) -> io::Result<()>, mut after: impl FnMut()) -> ! {
    // SAFETY: getuid has no preconditions.
    let own_uid = unsafe { libc::getuid() };
    loop {
        match accept(&listener) {
            Ok(conn) => {
                // Only root (hiber) or the application's own user may take its memory.
                match peer_uid(&conn) {
                    Ok(uid) if uid == 0 || uid == own_uid => {}
                    other => {
                        log(&format!("refused a control connection from uid {other:?}"));
                        continue;
                    }
                }
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| session(&conn))) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => log(&format!("control connection: {e}")),
                    Err(_) => log("control connection: internal error"),
                }
                drop(conn);
                after();
            }
            Err(e) => {
                log(&format!("accept: {e}"));
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    #[test]
    fn messages_and_descriptors_cross() {
        let name = format!("hiber-wire-test.{}", std::process::id());
        let l = listen(&name).unwrap();
        let t = std::thread::spawn(move || {
            let c = accept(&l).unwrap();
            let (m, fd) = recv(&c).unwrap().unwrap();
            assert_eq!(m, "load 3");
            let mut f = std::fs::File::from(fd.expect("a descriptor came along"));
            f.seek(std::io::SeekFrom::Start(0)).unwrap();
            let mut s = String::new();
            f.read_to_string(&mut s).unwrap();
            send(&c, &format!("ok {s}"), None).unwrap();
            assert!(recv(&c).unwrap().is_none(), "peer closed");
        });
        let c = connect(&name).unwrap();
        let mut f = tempfile();
        f.write_all(b"payload").unwrap();
        send(&c, "load 3", Some(f.as_raw_fd())).unwrap();
        let (m, fd) = recv(&c).unwrap().unwrap();
        assert_eq!(m, "ok payload");
        assert!(fd.is_none());
        drop(c);
        t.join().unwrap();
        assert!(connect(&format!("hiber-wire-test-nobody.{}", std::process::id())).is_err());
    }

    fn tempfile() -> std::fs::File {
        let p = std::env::temp_dir().join(format!("hiber-wire-{}", std::process::id()));
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        f
    }
}
