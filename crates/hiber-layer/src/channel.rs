//! The shared-memory transport of hiber's API proxy: an application process forwards its
//! calls to a proxy process that owns the GPU (the design of CheCL and NVCR), through one
//! memory segment both map, with Linux futexes as doorbells.
//!
//! The proxy accepts the application on a unix stream socket, creates the segment (a memfd)
//! and passes it over `SCM_RIGHTS`. The socket then stays open for one more reason: each side
//! learns the other's death from it (a futex in shared memory cannot tell). Every wait sleeps
//! on its futex for at most [`WAIT_SLICE`], then the application polls the socket for a hang-up
//! and the proxy's reader thread sees end-of-file and shuts its side down.
//!
//! # Segment layout (version [`VERSION`])
//!
//! ```text
//! 0                   header: magic, version, size; posts handled (+ its bell);
//!                     whether the application reads notifications
//! SLOTS_OFF           NSLOTS call slots, each SLOT_HDR bytes of header (turn, bell, piece
//!                     length and flags, the post sequence the call waits for) and
//!                     SLOT_BUF bytes of buffer
//! POST_OFF            post ring (application → proxy): head + its bell, tail + its bell,
//!                     then POST_CAP bytes of frames
//! NOTIFY_OFF          notification ring (proxy → application), the same, NOTIFY_CAP bytes
//! ```
//!
//! A call slot belongs to one application thread at a time and to one proxy thread. Its turn
//! word says which side owns the buffer; each side writes one piece (at most [`SLOT_BUF`]
//! bytes, flagged first and/or last) and hands the turn over. A request of several pieces is
//! acknowledged piece by piece with empty turns, so is an answer: any length goes through.
//! Rings carry frames of an 8-byte header (length, last) and data, so that a message larger
//! than the ring is streamed as well; each ring has one reader, and its writers take a lock.
//!
//! Posts and calls are ordered by a count: the application numbers its posts (under the post
//! lock), a call carries the number of posts issued before it, and the proxy thread of the
//! call waits until the post thread has handled that many.
//!
//! A wait spins for [`SPIN`] before it sleeps, so that two busy processes trade a small call in
//! a few microseconds and an idle one costs nothing.

use std::cell::RefCell;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

/// "hiberCH1", little-endian.
const MAGIC: u64 = u64::from_le_bytes(*b"hiberCH1");
const VERSION: u32 = 1;

/// Call slots: the most application threads that hold one at once (a thread holds its slot
/// until it exits).
pub const NSLOTS: usize = 64;
/// The largest piece of a call's request or answer that crosses at once.
pub const SLOT_BUF: usize = 256 << 10;
const SLOT_HDR: usize = 64;
const SLOT_STRIDE: usize = SLOT_HDR + SLOT_BUF;
const HEADER_SIZE: usize = 4096;
const RING_HDR: usize = 4096;
const POST_CAP: usize = 8 << 20;
const NOTIFY_CAP: usize = 1 << 20;
const SLOTS_OFF: usize = HEADER_SIZE;
const POST_OFF: usize = page_up(SLOTS_OFF + NSLOTS * SLOT_STRIDE);
const NOTIFY_OFF: usize = POST_OFF + RING_HDR + POST_CAP;
const SEGMENT_SIZE: usize = NOTIFY_OFF + RING_HDR + NOTIFY_CAP;

/// How long a wait spins before it sleeps on its futex.
const SPIN: Duration = Duration::from_micros(20);
/// How long a wait then yields its CPU before it sleeps.
const YIELD: Duration = Duration::from_micros(50);
/// A call behind more posts than this waits for its answer asleep, without spinning: the
/// posts take long enough that a futex wake-up costs little next to them, and a spinning
/// waiter (the application's, and the proxy's call thread) would take CPUs, or the SMT
/// siblings of CPUs, that the post thread and the platform run on.
const LONG_GAP: u64 = 32;
/// How long a futex sleep lasts before the sleeper checks that its peer lives.
const WAIT_SLICE: Duration = Duration::from_millis(50);

/// Ring frame header: data length (u32) and whether it ends the message (u32).
const FRAME: usize = 8;
/// A writer waits for room for this much data at least (or the rest of its message), so
/// that a big message does not trickle through in tiny frames.
const MIN_FRAME_DATA: usize = 64 << 10;

/// Slot turns and piece flags.
const TURN_CLIENT: u32 = 0;
const TURN_PROXY: u32 = 1;
const PIECE_FIRST: u32 = 1;
const PIECE_LAST: u32 = 2;

/// The segment's seals: its size is fixed for good.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

const fn page_up(n: usize) -> usize {
    (n + 4095) & !4095
}

// ---------------------------------------------------------------------------------------
// Futex doorbells

/// A futex word: bit 0 says a waiter sleeps (or is about to), the rest counts rings. A ring
/// with nobody asleep costs one atomic add and no system call.
#[repr(transparent)]
struct Bell(AtomicU32);

impl Bell {
    /// Tells the waiters that what they wait for may have changed (after it did).
    fn ring(&self) {
        let old = self.0.fetch_add(2, Ordering::SeqCst);
        if old & 1 != 0 {
            self.0.fetch_and(!1, Ordering::SeqCst);
            futex_wake(&self.0);
        }
    }

    /// Waits until `ready`, spinning first, then sleeping in slices of [`WAIT_SLICE`];
    /// `check(timed_out)` runs before each sleep and after a slice ran out, and its error
    /// ends the wait.
    fn wait(&self, ready: impl Fn() -> bool, check: &dyn Fn(bool) -> io::Result<()>) -> io::Result<()> {
        self.wait_armed(ready, check, &|| {}, true)
    }

    /// As [`Bell::wait`], with `armed` run before each sleep once this waiter is marked
    /// asleep: a ring from then on wakes it, so what `armed` publishes for the ringer (the
    /// count it waits for) cannot be missed by a ring that comes meanwhile. Without `spin`
    /// it goes to sleep at once: for a wait known to be long (behind many posts), where
    /// spinning would only take a CPU from the threads it waits for.
    fn wait_armed(&self, ready: impl Fn() -> bool, check: &dyn Fn(bool) -> io::Result<()>, armed: &dyn Fn(), spin: bool) -> io::Result<()> {
        if ready() {
            return Ok(());
        }
        if spin {
            let start = Instant::now();
            loop {
                for _ in 0..64 {
                    std::hint::spin_loop();
                    if ready() {
                        return Ok(());
                    }
                }
                if start.elapsed() >= SPIN {
                    break;
                }
            }
            // The peer may be waiting for this very CPU (a loaded machine, or the scheduler
            // put both on one): let it run for a while before paying a futex sleep and wake-up.
            while start.elapsed() < SPIN + YIELD {
                // SAFETY: sched_yield has no preconditions.
                unsafe { libc::sched_yield() };
                if ready() {
                    return Ok(());
                }
            }
        }
        let mut timed_out = false;
        loop {
            check(timed_out)?;
            let seen = self.0.fetch_or(1, Ordering::SeqCst) | 1;
            armed();
            if ready() {
                return Ok(());
            }
            timed_out = futex_wait(&self.0, seen, WAIT_SLICE);
            if ready() {
                return Ok(());
            }
        }
    }
}

/// Sleeps while `word` holds `expected`, for at most `timeout`; true when the time ran out.
/// Shared (not `_PRIVATE`) futex operations: the word is in memory two processes map.
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> bool {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: `word` is a live, aligned 32-bit atomic; the kernel only reads it and `ts`
    // (both outlive the call); the other arguments are unused by FUTEX_WAIT.
    let r = unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec, std::ptr::null::<u32>(), 0u32) };
    r == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT)
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAKE touches no memory.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, std::ptr::null::<libc::timespec>(), std::ptr::null::<u32>(), 0u32) };
}

// ---------------------------------------------------------------------------------------
// The segment

#[repr(C)]
struct Header {
    magic: u64,
    version: u32,
    nslots: u32,
    size: u64,
    _pad0: [u8; 40],
    /// Posts the proxy has handled.
    posts_done: AtomicU64,
    posts_done_bell: Bell,
    /// Set by the application once a thread reads notifications.
    notify_reader: AtomicU32,
    _pad1: [u8; 48],
}

#[repr(C)]
struct SlotHeader {
    turn: AtomicU32,
    bell: Bell,
    /// Length and flags of the piece in the buffer.
    len: AtomicU32,
    flags: AtomicU32,
    /// With the first piece of a request: the posts the call must see handled.
    post_seq: AtomicU64,
    _pad: [u8; 40],
}

#[repr(C)]
struct RingHeader {
    /// Bytes ever written; the writer's.
    head: AtomicU64,
    data_bell: Bell,
    _pad0: [u8; 52],
    /// Bytes ever read; the reader's.
    tail: AtomicU64,
    space_bell: Bell,
    _pad1: [u8; 52],
}

const _: () = assert!(std::mem::size_of::<Header>() == 128 && std::mem::size_of::<Header>() <= HEADER_SIZE);
const _: () = assert!(std::mem::size_of::<SlotHeader>() == SLOT_HDR);
const _: () = assert!(std::mem::size_of::<RingHeader>() == 128 && std::mem::size_of::<RingHeader>() <= RING_HDR);

/// One mapping of the segment (unmapped on drop).
struct Segment {
    base: *mut u8,
    /// The memfd's inode (tests look for leftovers by it).
    #[cfg_attr(not(test), allow(dead_code))]
    ino: u64,
}

// SAFETY: the mapping is plain shared memory; every access goes through atomics or through
// byte copies whose exclusive owner the slot turns and ring counters decide.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates the segment (the proxy's side) and returns it with its memfd.
    fn create() -> io::Result<(Segment, OwnedFd)> {
        // SAFETY: the name is a NUL-terminated literal; memfd_create returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(c"hiber-channel".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own fd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), SEGMENT_SIZE as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // Sealed at its size, so that neither side can make the other's accesses fault.
        // SAFETY: fcntl on our own fd, with an int argument.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let seg = Segment::map(&fd)?;
        // SAFETY: the header lies at the start of the fresh (zeroed) mapping, which nobody
        // else has yet.
        unsafe {
            let h = seg.base as *mut Header;
            (*h).magic = MAGIC;
            (*h).version = VERSION;
            (*h).nslots = NSLOTS as u32;
            (*h).size = SEGMENT_SIZE as u64;
        }
        Ok((seg, fd))
    }

    /// Maps the segment of `fd`, after checking its size (and, for the application, its header).
    fn map(fd: &OwnedFd) -> io::Result<Segment> {
        // SAFETY: an all-zero stat is a valid value for fstat to fill.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a valid out-pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fcntl on a live fd, no argument.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if st.st_size as u64 != SEGMENT_SIZE as u64 || seals < 0 || seals & SEALS != SEALS {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the channel segment has the wrong size or is not sealed"));
        }
        // SAFETY: a new shared mapping of the whole file; the kernel picks the address.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), SEGMENT_SIZE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Segment { base: p.cast(), ino: st.st_ino })
    }

    fn check_header(&self) -> io::Result<()> {
        // SAFETY: the header's plain fields were written by the proxy before it sent the fd.
        let (magic, version, nslots, size) = unsafe {
            let h = self.base as *const Header;
            ((*h).magic, (*h).version, (*h).nslots, (*h).size)
        };
        if magic != MAGIC || version != VERSION || nslots as usize != NSLOTS || size != SEGMENT_SIZE as u64 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the channel segment has another format"));
        }
        Ok(())
    }

    fn header(&self) -> &Header {
        // SAFETY: the header is at offset 0, aligned (page), inside the mapping, which lives
        // as long as `self`; its shared fields are atomics.
        unsafe { &*(self.base as *const Header) }
    }

    fn slot(&self, i: usize) -> Slot<'_> {
        debug_assert!(i < NSLOTS);
        let off = SLOTS_OFF + i * SLOT_STRIDE;
        // SAFETY: `i < NSLOTS`, so the slot's header (64-byte aligned: every offset is a
        // multiple of 64) and buffer lie inside the mapping, which lives as long as `self`.
        unsafe { Slot { hdr: &*(self.base.add(off) as *const SlotHeader), data: self.base.add(off + SLOT_HDR) } }
    }

    fn post_ring(&self) -> Ring<'_> {
        self.ring(POST_OFF, POST_CAP)
    }

    fn notify_ring(&self) -> Ring<'_> {
        self.ring(NOTIFY_OFF, NOTIFY_CAP)
    }

    fn ring(&self, off: usize, cap: usize) -> Ring<'_> {
        // SAFETY: both rings' headers (page-aligned) and data lie inside the mapping, which
        // lives as long as `self`.
        unsafe { Ring { hdr: &*(self.base.add(off) as *const RingHeader), data: self.base.add(off + RING_HDR), cap } }
    }

    /// Wakes every sleeper on the segment's bells (in both processes), so that they look at
    /// their side's state again.
    fn ring_all(&self) {
        for i in 0..NSLOTS {
            self.slot(i).hdr.bell.ring();
        }
        for r in [self.post_ring(), self.notify_ring()] {
            r.hdr.data_bell.ring();
            r.hdr.space_bell.ring();
        }
        self.header().posts_done_bell.ring();
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `base` is our mapping of SEGMENT_SIZE bytes; nothing borrows it any more
        // (every borrow is tied to `self`).
        unsafe { libc::munmap(self.base.cast(), SEGMENT_SIZE) };
    }
}

struct Slot<'a> {
    hdr: &'a SlotHeader,
    data: *mut u8,
}

impl Slot<'_> {
    /// Writes a piece into the buffer (the caller holds the turn).
    fn put(&self, piece: &[u8], flags: u32) {
        debug_assert!(piece.len() <= SLOT_BUF);
        // SAFETY: the buffer is SLOT_BUF bytes inside the mapping and `piece` is no longer;
        // the turn makes this side its only writer now.
        unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr(), self.data, piece.len()) };
        self.hdr.len.store(piece.len() as u32, Ordering::Relaxed);
        self.hdr.flags.store(flags, Ordering::Relaxed);
    }

    /// Appends the piece in the buffer to `out` and returns its flags (the caller holds the turn).
    fn take(&self, out: &mut Vec<u8>) -> io::Result<u32> {
        let len = self.hdr.len.load(Ordering::Relaxed) as usize;
        if len > SLOT_BUF {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a channel piece is longer than its slot"));
        }
        out.reserve(len);
        // SAFETY: `len <= SLOT_BUF` bytes of the buffer are read into the spare capacity
        // just reserved, then counted as initialized.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data, out.as_mut_ptr().add(out.len()), len);
            out.set_len(out.len() + len);
        }
        Ok(self.hdr.flags.load(Ordering::Relaxed))
    }

    fn hand_to(&self, turn: u32) {
        self.hdr.turn.store(turn, Ordering::Release);
        self.hdr.bell.ring();
    }

    fn wait_for(&self, turn: u32, check: &dyn Fn(bool) -> io::Result<()>) -> io::Result<()> {
        self.wait_long(turn, check, false)
    }

    /// As `wait_for`; a `long` wait sleeps at once (see [`Bell::wait_armed`]).
    fn wait_long(&self, turn: u32, check: &dyn Fn(bool) -> io::Result<()>, long: bool) -> io::Result<()> {
        self.hdr.bell.wait_armed(|| self.hdr.turn.load(Ordering::Acquire) == turn, check, &|| {}, !long)
    }
}

/// A byte ring of frames with one reader; its writers hold a lock.
struct Ring<'a> {
    hdr: &'a RingHeader,
    data: *mut u8,
    cap: usize,
}

impl Ring<'_> {
    fn used(&self, head: u64) -> usize {
        head.wrapping_sub(self.hdr.tail.load(Ordering::Acquire)) as usize
    }

    fn copy_in(&self, pos: u64, src: &[u8]) {
        let at = (pos % self.cap as u64) as usize;
        let first = src.len().min(self.cap - at);
        // SAFETY: both copies stay inside the ring's `cap` bytes of data; the counters give
        // these bytes to the writer until it publishes `head`.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data.add(at), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data, src.len() - first);
        }
    }

    fn copy_out(&self, pos: u64, dst: &mut [u8]) {
        let at = (pos % self.cap as u64) as usize;
        let first = dst.len().min(self.cap - at);
        // SAFETY: as in `copy_in`; these bytes are the reader's until it publishes `tail`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data.add(at), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data, dst.as_mut_ptr().add(first), dst.len() - first);
        }
    }

    /// Writes one message (the caller holds the writers' lock), in frames as room allows.
    fn write(&self, msg: &[u8], check: &dyn Fn(bool) -> io::Result<()>) -> io::Result<()> {
        let mut off = 0;
        loop {
            check(false)?;
            let rest = msg.len() - off;
            let head = self.hdr.head.load(Ordering::Relaxed);
            let want = FRAME + rest.min(MIN_FRAME_DATA);
            self.hdr.space_bell.wait(|| self.cap.saturating_sub(self.used(head)) >= want, check)?;
            // The reader's counter is the other process's to write: never trusted past the ring.
            let used = self.used(head);
            if used > self.cap - want {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "a channel ring's read counter is past its write counter"));
            }
            let n = rest.min(self.cap - used - FRAME);
            let last = off + n == msg.len();
            let mut frame = [0u8; FRAME];
            frame[..4].copy_from_slice(&(n as u32).to_le_bytes());
            frame[4..].copy_from_slice(&u32::from(last).to_le_bytes());
            self.copy_in(head, &frame);
            self.copy_in(head + FRAME as u64, &msg[off..off + n]);
            self.hdr.head.store(head + (FRAME + n) as u64, Ordering::Release);
            self.hdr.data_bell.ring();
            off += n;
            if last {
                return Ok(());
            }
        }
    }

    /// Reads one message into `out` (the ring's one reader).
    fn read(&self, out: &mut Vec<u8>, check: &dyn Fn(bool) -> io::Result<()>) -> io::Result<()> {
        out.clear();
        loop {
            check(false)?;
            let tail = self.hdr.tail.load(Ordering::Relaxed);
            let avail = || self.hdr.head.load(Ordering::Acquire).wrapping_sub(tail) as usize;
            self.hdr.data_bell.wait(|| avail() >= FRAME, check)?;
            let mut frame = [0u8; FRAME];
            self.copy_out(tail, &mut frame);
            let n = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
            let last = frame[4] != 0;
            // The writer's counter and frames are the other process's to write: never trusted
            // past the ring (a frame longer than the ring would be copied past its end).
            let written = avail();
            if written > self.cap || n > written - FRAME {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "a channel ring frame runs past what was written"));
            }
            let at = out.len();
            out.resize(at + n, 0);
            self.copy_out(tail + FRAME as u64, &mut out[at..]);
            self.hdr.tail.store(tail + (FRAME + n) as u64, Ordering::Release);
            self.hdr.space_bell.ring();
            if last {
                return Ok(());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The socket: passing the memfd, the peer's credentials, its death

fn send_fd(sock: &UnixStream, fd: RawFd, bytes: &[u8]) -> io::Result<()> {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let mut cbuf = [0u64; 8];
    // SAFETY: an all-zero msghdr is valid (no buffers).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is arithmetic.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as _;
    // SAFETY: `msg` points at `cbuf` (64 bytes, 8-aligned), room for one cmsghdr and an fd;
    // CMSG_FIRSTHDR returns its start, and CMSG_DATA the fd's place inside it.
    let r = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut libc::c_int, fd);
        libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    if r as usize != bytes.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "short write of the channel hello"));
    }
    Ok(())
}

/// Receives `bytes.len()` bytes and the fd that comes with them.
fn recv_fd(sock: &UnixStream, bytes: &mut [u8]) -> io::Result<OwnedFd> {
    let mut fd = None;
    let mut got = 0;
    while got < bytes.len() {
        let mut iov = libc::iovec { iov_base: bytes[got..].as_mut_ptr().cast(), iov_len: bytes.len() - got };
        let mut cbuf = [0u64; 8];
        // SAFETY: an all-zero msghdr is valid (no buffers).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
        // SAFETY: `msg` describes live buffers (`bytes[got..]`, `cbuf`) the kernel fills.
        let r = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::Error::new(io::ErrorKind::ConnectionReset, "the proxy closed the channel socket before sending its segment"));
        }
        got += r as usize;
        // SAFETY: the kernel filled `msg`'s control part; the CMSG macros walk it within
        // `msg_controllen`, and an SCM_RIGHTS message holds fds (newly ours) as c_ints.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c) as *const libc::c_int;
                    let n = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<libc::c_int>();
                    for k in 0..n {
                        let got_fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(k)));
                        if fd.is_none() {
                            fd = Some(got_fd);
                        }
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
    }
    fd.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "the proxy sent no segment"))
}

fn peer_uid(sock: &UnixStream) -> io::Result<libc::uid_t> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid out-pointers of the sizes given.
    let r = unsafe { libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Whether a peer of uid `peer` may use a proxy running as `me`: the same user, or root.
fn peer_allowed(peer: libc::uid_t, me: libc::uid_t) -> bool {
    peer == me || peer == 0
}

/// Whether the other end of `fd` hung up (without waiting).
fn peer_gone(fd: RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd, no timeout.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r > 0 && p.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

/// Writes all of `bytes` without raising SIGPIPE (the application may not ignore it).
fn send_all(fd: RawFd, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: `bytes` is a live buffer of the length given.
        let r = unsafe { libc::send(fd, bytes.as_ptr().cast(), bytes.len(), libc::MSG_NOSIGNAL) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        bytes = &bytes[r as usize..];
    }
    Ok(())
}

fn hello() -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&MAGIC.to_le_bytes());
    h[8..].copy_from_slice(&(SEGMENT_SIZE as u64).to_le_bytes());
    h
}

// ---------------------------------------------------------------------------------------
// Application side

const OPEN: u8 = 0;
const CLOSED: u8 = 1;
const GONE: u8 = 2;

fn closed_error() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the proxy channel is closed")
}

fn gone_error() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, "the proxy is gone")
}

/// What a live client holds: the mapping and the socket, dropped (unmapped, closed) with
/// the last reference.
struct Conn {
    seg: Segment,
    sock: UnixStream,
    state: AtomicU8,
    /// Posts issued (numbered under `post_lock`, in ring order).
    posts_issued: AtomicU64,
    post_lock: Mutex<()>,
}

impl Conn {
    fn check(&self, timed_out: bool) -> io::Result<()> {
        match self.state.load(Ordering::Acquire) {
            OPEN => {}
            CLOSED => return Err(closed_error()),
            _ => return Err(gone_error()),
        }
        if timed_out && peer_gone(self.sock.as_raw_fd()) {
            if self.state.compare_exchange(OPEN, GONE, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                // The other waiters need not wait for their own slice to learn it.
                self.seg.ring_all();
            }
            return self.check(false);
        }
        Ok(())
    }
}

/// Slots of a client free for threads, and those the proxy serves already.
struct SlotPool {
    free: Mutex<(Vec<u32>, u64)>,
}

impl SlotPool {
    fn take(&self, conn: &Conn) -> io::Result<u32> {
        let mut g = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let (free, opened) = &mut *g;
        let Some(slot) = free.pop() else {
            return Err(io::Error::new(io::ErrorKind::OutOfMemory, format!("all {NSLOTS} proxy channel slots are held by live threads")));
        };
        if *opened & (1 << slot) == 0 {
            if let Err(e) = send_all(conn.sock.as_raw_fd(), &slot.to_le_bytes()) {
                free.push(slot);
                return Err(if peer_gone(conn.sock.as_raw_fd()) { gone_error() } else { e });
            }
            *opened |= 1 << slot;
        }
        Ok(slot)
    }

    fn give_back(&self, slot: u32) {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).0.push(slot);
    }
}

/// A thread's hold on a slot of one client, given back when the thread exits.
struct Lease {
    generation: u64,
    slot: u32,
    pool: Weak<SlotPool>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give_back(self.slot);
        }
    }
}

thread_local! {
    static LEASES: RefCell<Vec<Lease>> = const { RefCell::new(Vec::new()) };
}

/// Client generations, so that a thread's slot of a closed client is not taken for a later one's.
static GENERATION: AtomicU64 = AtomicU64::new(1);

/// The socket and mapping of each live client, for a child forked from this process to drop
/// at once (`drop_inherited`): a child that kept them would hold a connection to a proxy
/// outside its tree, which CRIU refuses to dump, and share its parent's slots. Lock-free:
/// the fork handler cannot take locks another thread of the parent held.
struct Inherited {
    fd: AtomicI32,
    base: AtomicUsize,
}

const INHERITED_MAX: usize = 16;
static INHERITED: [Inherited; INHERITED_MAX] = [const { Inherited { fd: AtomicI32::new(-1), base: AtomicUsize::new(0) } }; INHERITED_MAX];

/// Runs in a child right after `fork` (one thread, the parent's other threads gone): closes
/// every client's socket and unmaps its segment. The child's `Client`s then fail every call
/// and are leaked, never dropped (see `Client::made_in`).
extern "C" fn drop_inherited() {
    for e in &INHERITED {
        let fd = e.fd.swap(-1, Ordering::AcqRel);
        let base = e.base.swap(0, Ordering::AcqRel);
        if fd >= 0 && base != 0 {
            // SAFETY: `fd` and the mapping at `base` (SEGMENT_SIZE bytes) were a live client's
            // in the parent, copied into this child by fork; no thread of the child uses them
            // (it has one thread, in fork), and its Client never touches them again.
            unsafe {
                libc::close(fd);
                libc::munmap(base as *mut libc::c_void, SEGMENT_SIZE);
            }
        }
    }
}

fn track_for_fork(fd: RawFd, base: usize) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a child handler that only makes async-signal-safe system calls.
        unsafe { libc::pthread_atfork(None, None, Some(drop_inherited)) };
    });
    for e in &INHERITED {
        if e.fd.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            e.base.store(base, Ordering::Release);
            return;
        }
    }
    // More clients than the table holds: a child forked now keeps this one's (documented).
}

fn untrack_for_fork(fd: RawFd) {
    for e in &INHERITED {
        if e.fd.compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            e.base.store(0, Ordering::Release);
        }
    }
}

type NotifyFn = Arc<dyn Fn(&[u8]) + Send + Sync>;

/// Application side of the channel. `Send + Sync`: many threads call through one client,
/// each in a slot of its own (taken on its first call, given back when the thread exits; at
/// most [`NSLOTS`] threads hold one at once, and a call from one more fails).
pub struct Client {
    /// The process that connected: in a child forked from it the client is dead (its socket
    /// and mapping are gone, see `drop_inherited`), fails every call and is never dropped.
    made_in: crate::fork::Epoch,
    generation: u64,
    conn: RwLock<Option<Arc<Conn>>>,
    pool: Arc<SlotPool>,
    notify_fn: Arc<RwLock<Option<NotifyFn>>>,
    notify_started: AtomicBool,
}

impl Client {
    /// Connects to a proxy listening on the unix stream socket at `path` (a filesystem path).
    /// The proxy answers with the shared-memory segment (a memfd, over SCM_RIGHTS) that both map.
    pub fn connect(path: &Path) -> io::Result<Client> {
        let sock = UnixStream::connect(path)?;
        sock.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut h = [0u8; 16];
        let fd = recv_fd(&sock, &mut h)?;
        sock.set_read_timeout(None)?;
        if h != hello() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the proxy speaks another channel format"));
        }
        let seg = Segment::map(&fd)?;
        drop(fd);
        seg.check_header()?;
        let conn = Conn { seg, sock, state: AtomicU8::new(OPEN), posts_issued: AtomicU64::new(0), post_lock: Mutex::new(()) };
        track_for_fork(conn.sock.as_raw_fd(), conn.seg.base as usize);
        Ok(Client {
            made_in: crate::fork::epoch(),
            generation: GENERATION.fetch_add(1, Ordering::Relaxed),
            conn: RwLock::new(Some(Arc::new(conn))),
            pool: Arc::new(SlotPool { free: Mutex::new(((0..NSLOTS as u32).rev().collect(), 0)) }),
            notify_fn: Arc::new(RwLock::new(None)),
            notify_started: AtomicBool::new(false),
        })
    }

    fn conn(&self) -> io::Result<Arc<Conn>> {
        if !self.made_in.is_current() {
            return Err(io::Error::new(io::ErrorKind::NotConnected, "the proxy channel belongs to the parent process (inherited by fork)"));
        }
        let c = self.conn.read().unwrap_or_else(|e| e.into_inner()).clone().ok_or_else(closed_error)?;
        c.check(false)?;
        Ok(c)
    }

    /// This thread's slot of this client, taken on its first call.
    fn my_slot(&self, conn: &Conn) -> io::Result<usize> {
        let r = LEASES.try_with(|leases| {
            let Ok(mut leases) = leases.try_borrow_mut() else {
                return Err(io::Error::other("proxy channel slot lookup reentered"));
            };
            if let Some(l) = leases.iter().find(|l| l.generation == self.generation) {
                return Ok(l.slot as usize);
            }
            leases.retain(|l| l.pool.strong_count() > 0);
            let slot = self.pool.take(conn)?;
            leases.push(Lease { generation: self.generation, slot, pool: Arc::downgrade(&self.pool) });
            Ok(slot as usize)
        });
        r.unwrap_or_else(|_| Err(io::Error::other("a thread that is exiting has no proxy channel slot")))
    }

    /// Sends `req` (any length: larger than the slot's buffer is streamed in pieces) and waits
    /// for the answer (any length). Many threads may call at once: each thread gets its own
    /// slot (channel) in the segment, so a call blocked in the proxy (say a wait on an event that
    /// another application thread will set) never blocks another thread's call.
    /// Before the request is handled, every `post` made earlier by ANY thread of this client has
    /// been handled (the proxy handles posts in order; a call waits for the posts sent before it).
    pub fn call(&self, req: &[u8]) -> io::Result<Vec<u8>> {
        self.call_ordered(req, true)
    }

    /// As [`Client::call`], but handled without waiting for the posts made before it: for a
    /// call that can only unblock the platform (a user event set), which a post blocked in the
    /// platform (say a release that finishes its queue) may be waiting for.
    pub fn call_unordered(&self, req: &[u8]) -> io::Result<Vec<u8>> {
        self.call_ordered(req, false)
    }

    fn call_ordered(&self, req: &[u8], after_posts: bool) -> io::Result<Vec<u8>> {
        let conn = self.conn()?;
        let slot = conn.seg.slot(self.my_slot(&conn)?);
        let check = |t: bool| conn.check(t);
        let seq = if after_posts { conn.posts_issued.load(Ordering::Acquire) } else { 0 };
        slot.hdr.post_seq.store(seq, Ordering::Relaxed);
        let mut off = 0;
        let mut flags = PIECE_FIRST;
        loop {
            let n = (req.len() - off).min(SLOT_BUF);
            if off + n == req.len() {
                flags |= PIECE_LAST;
            }
            slot.put(&req[off..off + n], flags);
            slot.hand_to(TURN_PROXY);
            off += n;
            // An acknowledgement, or (after the last piece) the answer's first piece, which
            // comes only once the proxy has handled the posts before this call.
            let long = flags & PIECE_LAST != 0 && seq.saturating_sub(conn.seg.header().posts_done.load(Ordering::Acquire)) > LONG_GAP;
            slot.wait_long(TURN_CLIENT, &check, long)?;
            if flags & PIECE_LAST != 0 {
                break;
            }
            flags = 0;
            // A close stops a long stream between pieces too.
            conn.check(false)?;
        }
        let mut answer = Vec::new();
        while slot.take(&mut answer)? & PIECE_LAST == 0 {
            conn.check(false)?;
            slot.hand_to(TURN_PROXY);
            slot.wait_for(TURN_CLIENT, &check)?;
        }
        Ok(answer)
    }

    /// Queues `req` (any length) and returns without waiting for it to be handled; handled in
    /// the order posted, by one proxy thread. Blocks only when the post ring is full.
    pub fn post(&self, req: &[u8]) -> io::Result<()> {
        let conn = self.conn()?;
        let _g = conn.post_lock.lock().unwrap_or_else(|e| e.into_inner());
        conn.seg.post_ring().write(req, &|t| conn.check(t))?;
        conn.posts_issued.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// Has `f` run, on one thread of the client's (started on first use of this method), for
    /// each notification the proxy sends, in order (used for callbacks: an event completed).
    /// A later `f` replaces an earlier one. Notifications sent before the first `f` wait in
    /// the ring (the proxy's `notify` fails once it is full). While `f` runs no notification
    /// is read: an `f` that waits on the proxy (a call after a post whose handler notifies)
    /// can stall the proxy once the ring is full.
    #[allow(clippy::type_complexity)] // The signature the proxy layers were written against.
    pub fn on_notify(&self, f: Box<dyn Fn(&[u8]) + Send + Sync>) {
        *self.notify_fn.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::from(f));
        if self.notify_started.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(conn) = self.conn() else { return };
        let weak = Arc::downgrade(&conn);
        let f = self.notify_fn.clone();
        drop(conn);
        let spawned = std::thread::Builder::new().name("hiber-notify".into()).spawn(move || notify_loop(weak, f));
        match spawned {
            Ok(_) => {
                if let Ok(conn) = self.conn() {
                    conn.seg.header().notify_reader.store(1, Ordering::Release);
                }
            }
            Err(_) => self.notify_started.store(false, Ordering::Release),
        }
    }

    /// Closes everything this client holds (socket, memfd mapping, its threads stop) so that no
    /// file descriptor or shared mapping of it remains in the process (CRIU dumps the process
    /// right after). Calls made after or during close fail with an error, never hang.
    ///
    /// Returns once the calls in flight have failed (within [`WAIT_SLICE`] or so) and the
    /// notification thread let go; that thread ends after the `f` it may be running returns.
    pub fn close(&self) {
        if !self.made_in.is_current() {
            // Inherited by fork: gone already, and nothing of it may be touched.
            return;
        }
        let Some(conn) = self.conn.write().unwrap_or_else(|e| e.into_inner()).take() else { return };
        untrack_for_fork(conn.sock.as_raw_fd());
        let _ = conn.state.compare_exchange(OPEN, CLOSED, Ordering::AcqRel, Ordering::Acquire);
        conn.seg.ring_all();
        // The threads in calls notice within a spin or a futex slice; wait for them to let go
        // of the mapping. (A thread that is itself in `call` on this client cannot be here.)
        while Arc::strong_count(&conn) > 1 {
            conn.seg.ring_all();
            std::thread::sleep(Duration::from_micros(200));
        }
        drop(conn);
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if !self.made_in.is_current() {
            // Inherited by fork: its descriptor and mapping were dropped at the fork, and their
            // numbers may be another's now.
            if let Some(c) = self.conn.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
                std::mem::forget(c);
            }
            return;
        }
        self.close();
    }
}

fn notify_loop(conn: Weak<Conn>, f: Arc<RwLock<Option<NotifyFn>>>) {
    let mut msg = Vec::new();
    loop {
        {
            // Held only while reading, never while `f` runs, so that `close` never waits on `f`.
            let Some(conn) = conn.upgrade() else { return };
            if conn.seg.notify_ring().read(&mut msg, &|t| conn.check(t)).is_err() {
                return;
            }
        }
        let cb = f.read().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(cb) = cb {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(&msg)));
        }
        if msg.capacity() > 4 * NOTIFY_CAP {
            msg = Vec::new();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Proxy side

/// Proxy side: what handles the application's calls and posts.
pub trait Handler: Send + Sync {
    /// Handles one request; writes the answer (for posts the answer is dropped).
    fn handle(&self, req: &[u8], answer: &mut Vec<u8>, notifier: &Notifier);
}

/// The proxy's side of one client's segment.
struct ProxyConn {
    seg: Segment,
    shutdown: AtomicBool,
    notify_lock: Mutex<()>,
}

impl ProxyConn {
    fn check(&self) -> io::Result<()> {
        if self.shutdown.load(Ordering::Acquire) {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the application left the proxy channel"));
        }
        Ok(())
    }
}

/// Sends notifications to the client (cloneable, usable from any thread, e.g. from a
/// callback the vendor library runs on its own thread).
#[derive(Clone)]
pub struct Notifier {
    conn: Arc<ProxyConn>,
}

impl Notifier {
    /// Queues `msg` (any length) for the application's notification thread, waiting for
    /// room while it reads. Fails once the client is gone, or with `WouldBlock` when the
    /// ring is full and the application reads no notifications.
    pub fn notify(&self, msg: &[u8]) -> io::Result<()> {
        let c = &self.conn;
        c.check()?;
        let _g = c.notify_lock.lock().unwrap_or_else(|e| e.into_inner());
        let hdr = c.seg.header();
        // With nobody reading, a full ring fails after one futex slice.
        let check = |timed_out: bool| {
            c.check()?;
            if timed_out && hdr.notify_reader.load(Ordering::Acquire) == 0 {
                return Err(io::Error::new(io::ErrorKind::WouldBlock, "the application reads no notifications and the ring is full"));
            }
            Ok(())
        };
        c.seg.notify_ring().write(msg, &check)
    }
}

struct Serving {
    conn: Arc<ProxyConn>,
    handler: Arc<dyn Handler>,
    notifier: Notifier,
    /// A second handle on the socket, to hang up on the application when a handler panics.
    sock: UnixStream,
    panicked: AtomicBool,
    /// Which threads are inside the handler (slots, then the post thread): `serve` does not
    /// wait for those once the client is gone.
    in_handler: [AtomicBool; NSLOTS + 1],
    /// The lowest count of handled posts that a call thread sleeping on the posts' bell
    /// waits for (`u64::MAX`: none). The post thread rings only once it gets there: ringing
    /// after every post woke the sleeper (a system call and a context switch) for each one,
    /// which cost about 2 µs a post on NVIDIA's platform.
    posts_wake_at: AtomicU64,
}

impl Serving {
    fn handle(&self, thread: usize, req: &[u8], answer: &mut Vec<u8>) -> io::Result<()> {
        answer.clear();
        self.in_handler[thread].store(true, Ordering::Release);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.handler.handle(req, answer, &self.notifier)));
        self.in_handler[thread].store(false, Ordering::Release);
        if r.is_err() {
            // The application must not wait for an answer that never comes.
            self.panicked.store(true, Ordering::Release);
            let _ = self.sock.shutdown(std::net::Shutdown::Both);
            return Err(io::Error::other("a proxy channel handler panicked"));
        }
        Ok(())
    }

    fn serve_posts(&self) -> io::Result<()> {
        let mut stats = std::env::var_os(STATS_ENV).filter(|p| !p.is_empty()).map(|p| (p, PostStats::default()));
        let r = self.post_loop(stats.as_mut().map(|(_, s)| s));
        if let Some((path, s)) = stats {
            s.append_to(Path::new(&path));
        }
        r
    }

    fn post_loop(&self, mut stats: Option<&mut PostStats>) -> io::Result<()> {
        let seg = &self.conn.seg;
        let check = |_: bool| self.conn.check();
        let (mut req, mut answer) = (Vec::new(), Vec::new());
        loop {
            let t0 = stats.is_some().then(Instant::now);
            seg.post_ring().read(&mut req, &check)?;
            let t1 = stats.is_some().then(Instant::now);
            self.handle(NSLOTS, &req, &mut answer)?;
            if let (Some(s), Some(t0), Some(t1)) = (stats.as_deref_mut(), t0, t1) {
                s.posts += 1;
                s.waiting += t1 - t0;
                s.handling += t1.elapsed();
            }
            let done = seg.header().posts_done.fetch_add(1, Ordering::SeqCst) + 1;
            let wake_at = self.posts_wake_at.load(Ordering::SeqCst);
            if done >= wake_at {
                // A waiter that lowered it meanwhile is woken now too, and looks again.
                let _ = self.posts_wake_at.compare_exchange(wake_at, u64::MAX, Ordering::SeqCst, Ordering::SeqCst);
                seg.header().posts_done_bell.ring();
            }
            shrink(&mut req);
            shrink(&mut answer);
        }
    }

    fn serve_slot(&self, i: usize) -> io::Result<()> {
        let seg = &self.conn.seg;
        let slot = seg.slot(i);
        let check = |_: bool| self.conn.check();
        let (mut req, mut answer) = (Vec::new(), Vec::new());
        loop {
            req.clear();
            let mut seq = 0;
            loop {
                slot.wait_for(TURN_PROXY, &check)?;
                let flags = slot.take(&mut req)?;
                if flags & PIECE_FIRST != 0 {
                    seq = slot.hdr.post_seq.load(Ordering::Relaxed);
                }
                if flags & PIECE_LAST != 0 {
                    break;
                }
                slot.hand_to(TURN_CLIENT);
            }
            let h = seg.header();
            // Before each sleep, once marked asleep, say how far the posts must get for this
            // thread (the post thread rings then). Every ring wakes every sleeper, which says
            // it again: a ring that reset the count before this thread said it changes the
            // bell's word, and the sleep does not begin.
            let ask = || {
                self.posts_wake_at.fetch_min(seq, Ordering::SeqCst);
            };
            let long = seq.saturating_sub(h.posts_done.load(Ordering::SeqCst)) > LONG_GAP;
            h.posts_done_bell.wait_armed(|| h.posts_done.load(Ordering::SeqCst) >= seq, &check, &ask, !long)?;
            self.handle(i, &req, &mut answer)?;
            let mut off = 0;
            let mut flags = PIECE_FIRST;
            loop {
                let n = (answer.len() - off).min(SLOT_BUF);
                if off + n == answer.len() {
                    flags |= PIECE_LAST;
                }
                slot.put(&answer[off..off + n], flags);
                slot.hand_to(TURN_CLIENT);
                off += n;
                if flags & PIECE_LAST != 0 {
                    break;
                }
                slot.wait_for(TURN_PROXY, &check)?;
                flags = 0;
            }
            shrink(&mut req);
            shrink(&mut answer);
        }
    }
}

/// Names a file to which each connection's post thread appends, when it ends, how many posts
/// it handled and where its time went (a diagnostic: two clock reads a post).
pub const STATS_ENV: &str = "HIBER_CHANNEL_STATS";

#[derive(Default)]
struct PostStats {
    posts: u64,
    /// In the handler.
    handling: Duration,
    /// Waiting for the next post (and reading it).
    waiting: Duration,
}

impl PostStats {
    fn append_to(&self, path: &Path) {
        use std::io::Write;
        let per = |d: Duration| d.as_secs_f64() * 1e6 / self.posts.max(1) as f64;
        let line = format!(
            "pid {} posts {} handling_s {:.6} waiting_s {:.6} handling_us_per_post {:.3} waiting_us_per_post {:.3}\n",
            std::process::id(),
            self.posts,
            self.handling.as_secs_f64(),
            self.waiting.as_secs_f64(),
            per(self.handling),
            per(self.waiting)
        );
        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).create(true).open(path) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// Lets go of a buffer a big message grew, so that an idle thread does not hold it.
fn shrink(v: &mut Vec<u8>) {
    if v.capacity() > 4 * SLOT_BUF {
        *v = Vec::new();
    }
}

/// Serves one client that connected on `stream` (an accepted UnixStream): creates the segment,
/// sends it, and serves calls (one proxy thread per client slot, started when the slot is
/// first used), posts (one thread, in order) and notifications until the client closes or
/// dies; then returns. Checks the peer's uid (SO_PEERCRED) is this process's uid or 0.
///
/// Returns once the client's proxy threads have stopped, but for those inside the handler
/// (they finish it, then stop, on their own); `Err` when the peer is refused, the
/// segment cannot be set up, or a handler panicked (the client is then cut off).
pub fn serve(stream: UnixStream, handler: Arc<dyn Handler>) -> io::Result<()> {
    let uid = peer_uid(&stream)?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !peer_allowed(uid, me) {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, format!("uid {uid} may not use a proxy of uid {me}")));
    }
    let (seg, fd) = Segment::create()?;
    send_fd(&stream, fd.as_raw_fd(), &hello())?;
    drop(fd);
    let conn = Arc::new(ProxyConn { seg, shutdown: AtomicBool::new(false), notify_lock: Mutex::new(()) });
    let serving = Arc::new(Serving {
        conn: conn.clone(),
        handler,
        notifier: Notifier { conn: conn.clone() },
        sock: stream.try_clone()?,
        panicked: AtomicBool::new(false),
        in_handler: std::array::from_fn(|_| AtomicBool::new(false)),
        posts_wake_at: AtomicU64::new(u64::MAX),
    });
    let mut threads = Vec::new();
    let s = serving.clone();
    let spawned = std::thread::Builder::new().name("hiber-posts".into()).spawn(move || s.serve_posts());
    let mut result = spawned.map(|t| threads.push((NSLOTS, t)));
    // The application tells which slots it starts using; end-of-file is its close or death.
    let mut started = 0u64;
    let mut stream = stream;
    let mut msg = [0u8; 4];
    while result.is_ok() && stream.read_exact(&mut msg).is_ok() {
        let i = u32::from_le_bytes(msg) as usize;
        if i >= NSLOTS {
            result = Err(io::Error::new(io::ErrorKind::InvalidData, "the application named a channel slot that does not exist"));
            break;
        }
        if started & (1 << i) != 0 {
            continue;
        }
        started |= 1 << i;
        let s = serving.clone();
        match std::thread::Builder::new().name(format!("hiber-call-{i}")).spawn(move || s.serve_slot(i)) {
            Ok(t) => threads.push((i, t)),
            Err(e) => result = Err(e),
        }
    }
    conn.shutdown.store(true, Ordering::Release);
    conn.seg.ring_all();
    let _ = stream.shutdown(std::net::Shutdown::Both);
    // The idle threads stop at once (woken above). One inside the handler may wait for
    // something only the gone client would have done: it is left to finish on its own,
    // holding the segment until then.
    while !threads.is_empty() {
        threads.retain(|(i, t)| !t.is_finished() && !serving.in_handler[*i].load(Ordering::Acquire));
        std::thread::sleep(Duration::from_millis(1));
    }
    if serving.panicked.load(Ordering::Acquire) {
        return Err(io::Error::other("a proxy channel handler panicked"));
    }
    result
}

#[cfg(test)]
mod tests;
