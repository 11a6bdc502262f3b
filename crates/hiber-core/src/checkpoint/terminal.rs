//! Which controlling terminals a checkpoint can take along.
//!
//! A pseudo-terminal whose both ends the tree holds (a program that runs another under a
//! pty of its own, as `script`, `expect` or a terminal multiplexer do) is the tree's own
//! state: CRIU dumps the pair, opens a new one with the same index on restore, and makes
//! the slave the controlling terminal of its session again. A controlling terminal from
//! outside the tree is not: the shell's terminal the program was started from, or a
//! virtual console. CRIU could restore such a tree only onto the terminal CRIU itself runs
//! on (`--shell-job`), and a restored job has none, so it is refused before anything is
//! stopped.

use crate::proctree::ProcessInfo;

/// Majors of the Unix98 pty slaves (`/dev/pts/N`): 136 to 143, of which the kernel now
/// uses 136 alone, with minors up to 2^20.
const PTY_SLAVE_MAJORS: std::ops::RangeInclusive<u32> = 136..=143;

/// A controlling terminal that does not belong to the tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutsideTerminal {
    pub pid: i32,
    pub comm: String,
    /// `/dev/pts/N`, or `major:minor` for another kind of terminal.
    pub tty: String,
}

/// (major, minor) of a `tty_nr` from /proc/PID/stat (the kernel's `new_encode_dev`).
fn decode_tty_nr(tty_nr: i32) -> (u32, u32) {
    let dev = tty_nr as u32;
    ((dev >> 8) & 0xfff, (dev & 0xff) | ((dev >> 12) & 0xfff00))
}

/// The index of the pty whose slave is device (`major`, `minor`), if it is a pty slave.
fn pty_index(major: u32, minor: u32) -> Option<u32> {
    PTY_SLAVE_MAJORS.contains(&major).then(|| ((major - PTY_SLAVE_MAJORS.start()) << 8) + minor)
}

/// The `tty-index` of an fdinfo text: a pty master's (`/dev/ptmx`) shows the index of
/// its pair.
fn master_index(fdinfo: &str) -> Option<u32> {
    fdinfo.lines().find_map(|l| l.strip_prefix("tty-index:")).and_then(|v| v.trim().parse().ok())
}

/// The pty indices whose master some process of the tree holds.
fn held_masters(tree: &[ProcessInfo]) -> Vec<u32> {
    tree.iter()
        .flat_map(|p| p.fds.iter().filter(|f| f.target.ends_with("/ptmx")).map(move |f| (p.pid, f.fd)))
        .filter_map(|(pid, fd)| std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).ok().as_deref().and_then(master_index))
        .collect()
}

/// The first process of `tree` whose controlling terminal is not a pty the tree holds the
/// master of, given the indices of the masters it holds.
fn outside(tree: &[ProcessInfo], masters: &[u32]) -> Option<OutsideTerminal> {
    tree.iter().filter(|p| p.tty_nr != 0).find_map(|p| {
        let (major, minor) = decode_tty_nr(p.tty_nr);
        let index = pty_index(major, minor);
        if index.is_some_and(|i| masters.contains(&i)) {
            return None;
        }
        let tty = index.map_or_else(|| format!("{major}:{minor}"), |i| format!("/dev/pts/{i}"));
        Some(OutsideTerminal { pid: p.pid, comm: p.comm.clone(), tty })
    })
}

/// The first process of `tree` whose controlling terminal comes from outside it: anything
/// but a pty whose master a process of the tree holds.
pub fn outside_terminal(tree: &[ProcessInfo]) -> Option<OutsideTerminal> {
    if tree.iter().all(|p| p.tty_nr == 0) {
        return None;
    }
    outside(tree, &held_masters(tree))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(pid: i32, tty_nr: i32) -> ProcessInfo {
        ProcessInfo {
            pid,
            ppid: 1,
            ns_pid: pid,
            comm: format!("p{pid}"),
            cmdline: Vec::new(),
            threads: 1,
            tty_nr,
            start_time: 0,
            uid: 0,
            rss_bytes: 0,
            anon_bytes: 0,
            kernel_thread: false,
            fds: Vec::new(),
            device_files: Vec::new(),
        }
    }

    #[test]
    fn tty_nr_decodes_as_the_kernel_encodes_it() {
        // /dev/pts/0 and /dev/pts/300 (minor above 255: its high bits go above the major).
        assert_eq!(decode_tty_nr(34816), (136, 0));
        assert_eq!(decode_tty_nr((300 & 0xff) | (136 << 8) | ((300 & !0xff) << 12)), (136, 300));
        // /dev/tty1, a virtual console.
        assert_eq!(decode_tty_nr(1025), (4, 1));
        assert_eq!(pty_index(136, 300), Some(300));
        assert_eq!(pty_index(137, 4), Some(260));
        assert_eq!(pty_index(4, 1), None);
    }

    #[test]
    fn master_index_is_read_from_fdinfo() {
        assert_eq!(master_index("pos:\t0\nflags:\t0100002\nmnt_id:\t24\nino:\t91\ntty-index:\t7\n"), Some(7));
        assert_eq!(master_index("pos:\t0\nflags:\t0100002\nmnt_id:\t24\n"), None);
    }

    #[test]
    fn only_a_pty_whose_master_the_tree_holds_is_its_own() {
        let tree = [process(10, 0), process(11, 34816 + 3)];
        assert_eq!(outside(&tree, &[3]), None);
        let refused = outside(&tree, &[2]).expect("pts 3 without its master");
        assert_eq!((refused.pid, refused.tty.as_str()), (11, "/dev/pts/3"));
        let console = [process(12, 1025)];
        assert_eq!(outside(&console, &[1]).map(|t| t.tty), Some("4:1".to_string()));
        assert_eq!(outside(&[process(13, 0)], &[]), None);
    }
}
