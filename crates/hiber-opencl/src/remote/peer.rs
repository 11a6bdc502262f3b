//! Bulk transfers without the channel: the proxy reads the bytes of a large buffer write
//! straight from the application's memory, and writes a large read's bytes straight into
//! it (`process_vm_readv`/`process_vm_writev`), so they are copied once between the two
//! processes, as NVCR's shared transfer buffer does, but without the application's data
//! having to live in a shared segment first. The channel streams them otherwise, in
//! pieces, several times slower (bench/opencl/overhead.py's bandwidth row).
//!
//! The kernel lets the proxy do this when it may ptrace the application: the same user
//! without Yama's restriction, or root. The application checks once per connection
//! ([`Probe`]) and falls back to the channel when the proxy cannot; `HIBER_OPENCL_PEER_MEMORY=0`
//! turns it off.

use std::io;

/// Transfers of at least this many bytes go by peer memory when the proxy can.
pub const PEER_MIN: usize = 64 << 10;
/// The proxy's staging pieces: a transfer moves through two of them in turn, so that its
/// copy between the processes overlaps the device's.
pub const PIECE: usize = 32 << 20;
/// Turns the path off (`0`), for tests of the channel's and as a way out.
pub const ENV: &str = "HIBER_OPENCL_PEER_MEMORY";

/// Copies `out.len()` bytes at `addr` in process `pid` into `out`, on up to [`LANES`]
/// threads at once for a large piece (one thread's copy between processes runs at a few
/// GB/s, under a device's DMA).
pub fn read(pid: i32, addr: u64, out: &mut [u8]) -> io::Result<()> {
    let base = out.as_mut_ptr() as usize;
    // SAFETY: each lane is a distinct range of `out`, which we hold mutably for the call.
    in_lanes(out.len(), |at, len| unsafe { copy(pid, addr + at as u64, base + at, len, true) })
}

/// Copies `data` to `addr` in process `pid`, on several threads as [`read`].
pub fn write(pid: i32, addr: u64, data: &[u8]) -> io::Result<()> {
    let base = data.as_ptr() as usize;
    // SAFETY: each lane is a range of `data`, which the kernel only reads.
    in_lanes(data.len(), |at, len| unsafe { copy(pid, addr + at as u64, base + at, len, false) })
}

/// The most threads one piece is copied on.
pub const LANES: usize = 4;
/// The least each thread copies.
const LANE_MIN: usize = 2 << 20;

/// How many bytes each thread copies of a piece of `len` bytes (`len` itself: one thread).
fn lane_len(len: usize) -> usize {
    let lanes = (len / LANE_MIN).clamp(1, LANES);
    len.div_ceil(lanes).next_multiple_of(4096)
}

/// Runs `copy(at, len)` for each lane of `[0, len)`: on this thread for one lane, else on a
/// thread each. The first error fails it.
fn in_lanes(len: usize, copy: impl Fn(usize, usize) -> io::Result<()> + Sync) -> io::Result<()> {
    let lane = lane_len(len);
    if lane >= len {
        return copy(0, len);
    }
    let copy = &copy;
    std::thread::scope(|s| {
        let lanes: Vec<_> = (0..len).step_by(lane).map(|at| s.spawn(move || copy(at, lane.min(len - at)))).collect();
        lanes.into_iter().try_for_each(|t| t.join().unwrap_or_else(|_| Err(io::Error::other("a copy thread panicked"))))
    })
}

/// Copies `len` bytes between `local` here and `addr` in process `pid`: into `local` when
/// `into_here`, out of it otherwise.
///
/// # Safety
/// `[local, local + len)` is memory of this process that stays valid for the call, and
/// that nothing else touches meanwhile when `into_here` (the kernel writes it).
unsafe fn copy(pid: i32, addr: u64, local: usize, len: usize, into_here: bool) -> io::Result<()> {
    let mut done = 0;
    while done < len {
        let here = libc::iovec { iov_base: (local + done) as *mut libc::c_void, iov_len: len - done };
        let there = libc::iovec { iov_base: (addr as usize + done) as *mut libc::c_void, iov_len: len - done };
        // SAFETY: `here` is ours as the caller promises; `there` names memory in another
        // process, which the kernel checks (EFAULT) and never touches here.
        let n = unsafe {
            if into_here {
                libc::process_vm_readv(pid, &here, 1, &there, 1, 0)
            } else {
                libc::process_vm_writev(pid, &here, 1, &there, 1, 0)
            }
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => return Err(io::Error::from_raw_os_error(libc::EFAULT)),
            _ => return Err(io::Error::last_os_error()),
        }
    }
    Ok(())
}

/// What the application sends to find out whether its proxy reaches its memory: the
/// address of 16 bytes it knows, which the proxy reads and sends back.
pub struct Probe {
    bytes: [u8; 16],
}

impl Probe {
    /// 16 bytes unlikely to be found at that address in another process (this process's
    /// pid, the time and the address itself).
    pub fn new() -> Box<Probe> {
        let mut p = Box::new(Probe { bytes: [0; 16] });
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let a = std::ptr::addr_of!(p.bytes) as u64;
        p.bytes[..8].copy_from_slice(&(t ^ a.rotate_left(17)).to_le_bytes());
        p.bytes[8..].copy_from_slice(&(u64::from(std::process::id()) ^ a).to_le_bytes());
        p
    }

    pub fn addr(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }

    pub fn matches(&self, echoed: &[u8]) -> bool {
        echoed == self.bytes
    }
}

/// Whether the environment leaves the path on.
pub fn allowed() -> bool {
    std::env::var_os(ENV).is_none_or(|v| v != "0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_pieces_go_on_several_threads_and_arrive_whole() {
        let me = std::process::id() as i32;
        // Not a multiple of a lane: the last thread copies less.
        let src: Vec<u8> = (0..(9 << 20) + 12345).map(|i| (i * 13 % 253) as u8).collect();
        assert!(lane_len(src.len()) < src.len());
        let mut got = vec![0u8; src.len()];
        read(me, src.as_ptr() as u64, &mut got).unwrap();
        assert!(got == src);
        let mut dst = vec![0u8; src.len()];
        write(me, dst.as_mut_ptr() as u64, &src).unwrap();
        assert!(dst == src);
        // A bad address in one lane fails the whole copy.
        assert!(read(me, 8, &mut got).is_err());
    }

    #[test]
    fn reads_and_writes_this_process() {
        let me = std::process::id() as i32;
        let src: Vec<u8> = (0..(3 << 20)).map(|i| (i * 7 % 251) as u8).collect();
        let mut got = vec![0u8; src.len()];
        read(me, src.as_ptr() as u64, &mut got).unwrap();
        assert_eq!(got, src);
        let mut dst = vec![0u8; 1000];
        write(me, dst.as_mut_ptr() as u64, &src[..1000]).unwrap();
        assert_eq!(dst, src[..1000]);
    }

    #[test]
    fn a_bad_address_is_an_error_not_a_crash() {
        let me = std::process::id() as i32;
        let mut got = [0u8; 64];
        let e = read(me, 8, &mut got).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "{e}");
    }

    #[test]
    fn the_probe_is_read_back() {
        let p = Probe::new();
        let mut got = [0u8; 16];
        read(std::process::id() as i32, p.addr(), &mut got).unwrap();
        assert!(p.matches(&got));
        assert!(!p.matches(&[0u8; 16]));
    }
}
