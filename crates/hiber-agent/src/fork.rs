//! Children of a CUDA process, detached from the driver.
//!
//! A process that forks after it initialized CUDA (PyTorch's DataLoader workers,
//! `multiprocessing` with the fork start method, a shell-out that forks before it execs)
//! gives the child a copy of its mappings and descriptors, the driver's among them: ranges
//! of /dev/nvidia-uvm, /dev/nvidiactl and /dev/nvidiaN, and descriptors of those files. The
//! child cannot use them (CUDA answers CUDA_ERROR_NOT_INITIALIZED in a forked child, and UVM
//! lets no child touch its parent's ranges), but CRIU cannot dump a process that holds them
//! ("Can't handle non-regular mapping"), so no job with such a child could be checkpointed.
//!
//! So the agent detaches the child right after fork, in a `pthread_atfork` child handler
//! that a process registers when it initializes CUDA:
//! - each driver mapping becomes an inaccessible anonymous reservation of the same range:
//!   an access faults, as it would have before, and nothing else is placed there;
//! - each driver descriptor is pointed at /dev/null, so its number stays taken and libcuda's
//!   copy of it in the child never names some other file;
//! - the agent's control socket, which belongs to the parent, is closed.
//!
//! A program exec'd from such a child (or after a vfork, where no handler runs) inherits
//! the descriptors but not the mappings: the agent, preloaded into it as well, points them
//! at /dev/null when it is loaded, before the program runs (only those without
//! close-on-exec, which is what a descriptor that survived exec looks like).
//!
//! The handler runs in the child of a possibly multithreaded process, before the child
//! returns from fork: it takes no lock but the C library's allocator (which glibc makes
//! usable there), reads no environment and writes no log.

use std::ffi::c_int;
use std::os::unix::ffi::OsStrExt;
use std::sync::Once;

/// Every device file of NVIDIA's driver: nvidiactl, nvidia-uvm, nvidia0, nvidia-caps/...
const DRIVER_FILES: &[u8] = b"/dev/nvidia";

/// Registers the child handler, once per process image (a child inherits the
/// registration with the rest of its parent's memory).
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a function that takes no arguments and never unwinds.
        let r = unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
        if r != 0 {
            crate::log(&format!("cannot register the fork handler (error {r}); children forked from now on keep the driver's mappings"));
        }
    });
}

/// Runs when the agent is loaded into a program: descriptors of the driver that it holds
/// now came from a parent (no code of this program has run yet).
extern "C" fn at_load() {
    let _ = std::panic::catch_unwind(|| {
        // A library loaded before the agent may have initialized CUDA in its own
        // constructor: its descriptors are live, and close-on-exec (as libcuda opens
        // them), which no descriptor carried across exec can be.
        if crate::control::started() {
            return;
        }
        let inherited: Vec<c_int> = driver_descriptors().into_iter().filter(|&fd| !close_on_exec(fd)).collect();
        detach_descriptors(&inherited);
    });
}

fn close_on_exec(fd: c_int) -> bool {
    // SAFETY: F_GETFD on a descriptor number has no memory effects.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    flags >= 0 && flags & libc::FD_CLOEXEC != 0
}

#[used]
#[link_section = ".init_array"]
static DETACH_AT_LOAD: extern "C" fn() = at_load;

extern "C" fn after_fork_in_child() {
    let _ = std::panic::catch_unwind(|| {
        for (start, end) in driver_mappings() {
            // SAFETY: replaces the range [start, end) of this process, which /proc/self/maps
            // lists as a mapping of a driver file that nothing in the child may use, with an
            // inaccessible anonymous mapping of the same range; no Rust reference points into
            // it.
            unsafe {
                libc::mmap(
                    start as *mut libc::c_void,
                    end - start,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    -1,
                    0,
                );
            }
        }
        detach_descriptors(&driver_descriptors());
        crate::control::forget_listener();
        crate::ipc::forget_in_child();
    });
}

/// The ranges of /proc/self/maps that map a driver file.
fn driver_mappings() -> Vec<(usize, usize)> {
    let Ok(maps) = std::fs::read("/proc/self/maps") else { return Vec::new() };
    maps.split(|&b| b == b'\n').filter_map(driver_range).collect()
}

/// `start-end perms offset dev inode path`: the range, when the path is a driver file.
fn driver_range(line: &[u8]) -> Option<(usize, usize)> {
    let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty());
    let range = fields.next()?;
    let path = fields.nth(4)?;
    if !path.starts_with(DRIVER_FILES) {
        return None;
    }
    let range = std::str::from_utf8(range).ok()?;
    let (start, end) = range.split_once('-')?;
    let (start, end) = (usize::from_str_radix(start, 16).ok()?, usize::from_str_radix(end, 16).ok()?);
    (start < end).then_some((start, end))
}

fn driver_descriptors() -> Vec<c_int> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return Vec::new() };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let fd: c_int = e.file_name().to_str()?.parse().ok()?;
        let target = std::fs::read_link(e.path()).ok()?;
        target.as_os_str().as_bytes().starts_with(DRIVER_FILES).then_some(fd)
    })
    .collect()
}

/// Points each descriptor at /dev/null, keeping its close-on-exec flag.
fn detach_descriptors(fds: &[c_int]) {
    if fds.is_empty() {
        return;
    }
    // SAFETY: plain open of a NUL-terminated path; the descriptor is closed below.
    let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if null < 0 {
        return;
    }
    for &fd in fds {
        let cloexec = if close_on_exec(fd) { libc::O_CLOEXEC } else { 0 };
        // SAFETY: dup3 on descriptor numbers; `fd` is one of the driver's, which nothing in
        // this process may use, and replacing it closes the driver file.
        unsafe { libc::dup3(null, fd, cloexec) };
    }
    // SAFETY: `null` was opened above and is not used after this.
    unsafe { libc::close(null) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_of_driver_files_are_found() {
        let uvm = b"200000000-200200000 rw-s 00000000 00:05 1041 /dev/nvidia-uvm";
        assert_eq!(driver_range(uvm), Some((0x2_0000_0000, 0x2_0020_0000)));
        let ctl = b"7f0000000000-7f0000001000 rw-s 00abc000 00:05 1035                       /dev/nvidiactl";
        assert_eq!(driver_range(ctl), Some((0x7f00_0000_0000, 0x7f00_0000_1000)));
        for other in [
            &b"7f0000000000-7f0000001000 r-xp 00000000 08:01 42 /usr/lib/libcuda.so.1"[..],
            b"7ffd0000000-7ffd0021000 rw-p 00000000 00:00 0 [stack]",
            b"7f0000000000-7f0000001000 rw-p 00000000 00:00 0",
            b"",
        ] {
            assert_eq!(driver_range(other), None, "{}", String::from_utf8_lossy(other));
        }
    }

    #[test]
    fn descriptors_are_pointed_at_dev_null_keeping_cloexec() {
        use std::os::fd::AsRawFd;
        // Files of this test stand in for the driver's: what is checked is the replacement.
        let a = std::fs::File::open("/proc/self/stat").unwrap();
        let b = std::fs::File::open("/proc/self/status").unwrap();
        // SAFETY: clears FD_CLOEXEC on a descriptor this test owns.
        unsafe { libc::fcntl(b.as_raw_fd(), libc::F_SETFD, 0) };
        detach_descriptors(&[a.as_raw_fd(), b.as_raw_fd()]);
        for (f, cloexec) in [(&a, true), (&b, false)] {
            let target = std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd())).unwrap();
            assert_eq!(target, std::path::Path::new("/dev/null"));
            // SAFETY: F_GETFD on a descriptor this test owns.
            let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFD) };
            assert_eq!(flags & libc::FD_CLOEXEC != 0, cloexec);
        }
    }
}
