//! "Hosts" for the end-to-end tests: network namespaces joined by a veth pair, each with a
//! hiber of its own (its own state directory), as two machines of a cluster would be.

use std::process::{Child, Command};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::{wait, Hiber, HIBER};

/// Two network namespaces joined by a veth pair: `a` at 10.77.N.1, `b` at 10.77.N.2. Each
/// is held by a process (`unshare --net sleep`), not mounted under /run/netns as `ip netns
/// add` would: such a mount is in the mount namespace of every job started while it exists,
/// and once deleted, a restore of such a job cannot bind it again (see docs/user/jobs.md).
pub struct Hosts {
    holders: Vec<Child>,
    /// `/proc/PID/ns/net` of each host.
    pub a: String,
    pub b: String,
    pub a_addr: String,
    pub b_addr: String,
    /// The hosts' network, as `10.77.N.0/24`.
    pub net: String,
}

static N: AtomicU32 = AtomicU32::new(0);

impl Hosts {
    pub fn new() -> Hosts {
        let n = N.fetch_add(1, Ordering::Relaxed);
        Hosts::on(&format!("10.77.{}", n + 10))
    }

    /// Two new hosts that take the addresses of `old`'s (which must be gone): the machines
    /// a job moves to when its addresses move with it (a floating IP).
    pub fn taking_over(old: Hosts) -> Hosts {
        let net = old.net.trim_end_matches(".0/24").to_string();
        drop(old);
        Hosts::on(&net)
    }

    /// Two hosts at `NET.1` and `NET.2`.
    fn on(net: &str) -> Hosts {
        let n = N.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}{n}", std::process::id() % 100000);
        let (va, vb) = (format!("vA{tag}"), format!("vB{tag}"));
        let net = net.to_string();
        let mine = net_of(std::process::id() as i32);
        let mut holders = Vec::new();
        for _ in 0..2 {
            let child = Command::new("unshare").args(["--net", "--", "sleep", "infinity"]).spawn().unwrap();
            let pid = child.id() as i32;
            holders.push(child);
            wait("a network namespace", Duration::from_secs(10), || std::fs::metadata(format!("/proc/{pid}/ns/net")).is_ok() && net_of(pid) != mine);
        }
        let (pa, pb) = (holders[0].id().to_string(), holders[1].id().to_string());
        let hosts = Hosts {
            a: format!("/proc/{pa}/ns/net"),
            b: format!("/proc/{pb}/ns/net"),
            a_addr: format!("{net}.1"),
            b_addr: format!("{net}.2"),
            net: format!("{net}.0/24"),
            holders,
        };
        let run = |ns: Option<&str>, args: &[&str]| {
            let mut c = match ns {
                Some(ns) => {
                    let mut c = Command::new("nsenter");
                    c.arg(format!("--net={ns}")).arg("ip");
                    c
                }
                None => Command::new("ip"),
            };
            let out = c.args(args).output().expect("run ip");
            assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        run(None, &["link", "add", &va, "type", "veth", "peer", "name", &vb]);
        run(None, &["link", "set", &va, "netns", &pa]);
        run(None, &["link", "set", &vb, "netns", &pb]);
        for (ns, dev, addr) in [(&hosts.a, &va, format!("{net}.1/24")), (&hosts.b, &vb, format!("{net}.2/24"))] {
            run(Some(ns), &["addr", "add", &addr, "dev", dev]);
            run(Some(ns), &["link", "set", dev, "up"]);
            run(Some(ns), &["link", "set", "lo", "up"]);
        }
        hosts
    }

    pub fn net_inode(ns: &str) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(ns).unwrap().ino()
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for c in &mut self.holders {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// hiber in network namespace `ns`, with `h`'s state directory. Only the network namespace
/// changes (`nsenter`): `ip netns exec` would also give hiber a mount namespace of its own,
/// with its namespace's /sys, which two real hosts' jobs do not differ by.
pub fn hiber_in(ns: &str, h: &Hiber, args: &[&str]) -> Command {
    let mut c = Command::new("nsenter");
    // `-F`: nsenter execs hiber in its own process rather than forking, so that killing the
    // child kills hiber.
    c.arg("-F").arg(format!("--net={ns}")).arg(HIBER).args(args).env("HIBER_STATE", &h.state).env_remove("HIBER_LOG");
    c
}

/// The network namespace (its inode) of process `pid`.
pub fn net_of(pid: i32) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/net")).unwrap().ino()
}

/// `hiber coordinate` in host A's namespace on `port` of A's address, for `participants`
/// with `timeout_s` a phase, listening once this returns; its stdout's first line said so.
pub struct Coordinator {
    pub child: Child,
    pub addr: String,
    /// The session token, for every participant's `HIBER_SESSION`.
    pub session: String,
}

impl Coordinator {
    pub fn start(hosts: &Hosts, h: &Hiber, participants: usize, port: u16, timeout_s: u64) -> Coordinator {
        let addr = format!("{}:{port}", hosts.a_addr);
        // Long enough for a session token (hiber refuses short ones).
        let session = format!("test-session-{:016}-{port:08}-{:016}", std::process::id(), std::process::id());
        let mut child =
            hiber_in(&hosts.a, h, &["coordinate", "--participants", &participants.to_string(), "--listen", &addr, "--timeout", &timeout_s.to_string()])
                .env("HIBER_SESSION", &session)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert!(line.starts_with("coordinating"), "the coordinator did not start: {line}");
        // The rest of its stdout goes on into the pipe, read by nobody: it writes a line
        // a phase, far less than a pipe holds.
        child.stdout = Some(out.into_inner());
        Coordinator { child, addr, session }
    }

    /// hiber in namespace `ns` with `args` and `--coordinator` this one, in the session,
    /// its output piped.
    pub fn participant(&self, ns: &str, h: &Hiber, args: &[&str]) -> Command {
        let mut a = args.to_vec();
        a.extend(["--coordinator", &self.addr]);
        let mut c = hiber_in(ns, h, &a);
        c.env("HIBER_SESSION", &self.session).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        c
    }
}
