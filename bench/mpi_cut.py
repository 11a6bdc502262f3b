#!/usr/bin/env python3
"""An MPI job over several hosts (#38's benchmark row): how long a `--leave-running`
checkpoint stops it when every host's hiber cuts it as one through `hiber coordinate`,
against the same hosts checkpointed one after another without a coordinator (not one cut:
the baseline a script around single-host checkpoints would be). The two alternate in one
run, on one job.

The hosts are network namespaces on a bridge (in a namespace of their own), each with its
own hiber (state directory) and an sshd stand-in outside any job
(crates/hiber/tests/fixtures/sshd_standin.py). mpirun runs as a job on the first host and
starts Open MPI's daemon on the others as jobs of their hibers (`orte_launch_agent`). The
program is crates/hiber/tests/fixtures/mpi_ring.c, each rank holding --mib MiB.

How long the job stopped is read from rank 0's progress lines (one per step, PAUSE ms
apart when nothing stops it): the longest gap between two steps, and the stall (the sum of
every gap's excess over twice the median gap) from the first hiber's start to a second
after the last one's end. A pause on any host stops the whole ring.

Usage: bench/mpi_cut.py --hiber target/release/hiber [--hosts 4] [--ranks-per-host 2]
       [--mib 1024] [--reps 3] [--json OUT]
Needs root, Open MPI (scripts/setup.sh) and `ip`.
"""
import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "crates/hiber/tests/fixtures")
NET = "10.78.0"
PORT = 2222


def sh(*args, check=True, **kw):
    p = subprocess.run(list(args), capture_output=True, text=True, **kw)
    if check and p.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: {p.stderr.strip() or p.stdout.strip()}")
    return p


class Hosts:
    """N network namespaces on a bridge in a switch namespace, 10.78.0.1 upwards."""

    def __init__(self, n):
        tag = str(os.getpid())
        self.sw = f"hbsw{tag}"
        self.ns = [f"hb{i}x{tag}" for i in range(n)]
        self.addr = [f"{NET}.{i + 1}" for i in range(n)]
        sh("ip", "netns", "add", self.sw)
        sh("ip", "-n", self.sw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.ns):
            sh("ip", "netns", "add", ns)
            a, b = f"vh{i}x{tag}", f"vs{i}x{tag}"
            sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            sh("ip", "link", "set", a, "netns", ns)
            sh("ip", "link", "set", b, "netns", self.sw)
            sh("ip", "-n", self.sw, "link", "set", b, "master", "br0")
            sh("ip", "-n", self.sw, "link", "set", b, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", a)
            sh("ip", "-n", ns, "link", "set", a, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def close(self):
        for ns in self.ns + [self.sw]:
            sh("ip", "netns", "del", ns, check=False)


def in_ns(ns, *args):
    return ["ip", "netns", "exec", ns, *args]


def progress(log):
    """(step, t_ms) of every progress line."""
    out = []
    for line in log.splitlines():
        f = line.split()
        if len(f) >= 6 and f[0] == "step" and f[2] == "checksum" and f[4] == "t":
            try:
                out.append((int(f[1]), int(f[5])))
            except ValueError:
                pass
    return out


def stall(lines, start, end):
    """The longest gap between steps, and the stall, in [start - 1 s, end + 1 s] (s)."""
    t = [ms / 1000 for _, ms in lines if start - 1 <= ms / 1000 <= end + 1]
    gaps = [b - a for a, b in zip(t, t[1:])]
    if len(gaps) < 3:
        return None, None
    normal = statistics.median(gaps)
    return max(gaps), sum(max(0.0, g - 2 * normal) for g in gaps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hiber", required=True)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pause-ms", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    hiber = os.path.abspath(a.hiber)
    work = tempfile.mkdtemp(prefix="hiber-mpi-cut-")
    ring = os.path.join(work, "mpi_ring")
    sh("mpicc", "-O2", "-o", ring, os.path.join(FIXTURES, "mpi_ring.c"))
    hosts = Hosts(a.hosts)
    states = [os.path.join(work, f"state{i}") for i in range(a.hosts)]
    sshd = []
    env = dict(os.environ)
    env.pop("HIBER_LOG", None)
    try:
        for i, ns in enumerate(hosts.ns):
            p = subprocess.Popen(in_ns(ns, "python3", os.path.join(FIXTURES, "sshd_standin.py"), hosts.addr[i], str(PORT)),
                                 env=dict(env, HIBER_STATE=states[i]), stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "listening"
            sshd.append(p)
        host_list = ",".join(f"{ad}:{a.ranks_per_host}" for ad in hosts.addr)
        nranks = a.hosts * a.ranks_per_host
        job = ["run", "--name", "mpib", "--", "mpirun", "--allow-run-as-root", "--oversubscribe", "--host", host_list, "-np", str(nranks),
               "--mca", "plm_rsh_agent", os.path.join(FIXTURES, "mpi_rsh_agent.sh"),
               "--mca", "orte_launch_agent", f"{hiber} run --name orted -- orted",
               "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", f"{NET}.0/24", "--mca", "oob_tcp_if_include", f"{NET}.0/24",
               ring, "1000000", str(a.pause_ms), str(a.mib)]
        sh(*in_ns(hosts.ns[0], hiber, *job), env=dict(env, HIBER_STATE=states[0], HIBER_MPI_SSHD_PORT=str(PORT)))
        log = os.path.join(states[0], "jobs", "mpib", "stdout.log")

        def lines():
            try:
                return progress(open(log).read())
            except OSError:
                return []

        # Every rank has filled its memory once steps come.
        deadline = time.time() + 600
        while len(lines()) < 20:
            if time.time() > deadline:
                raise SystemExit("the job made no progress: " + open(os.path.join(states[0], "jobs", "mpib", "stderr.log")).read()[-2000:])
            time.sleep(0.5)
        jobs = ["mpib"] + ["orted"] * (a.hosts - 1)
        rows = {"coordinated": [], "one by one": []}

        def checkpoint(i, coordinator=None, session=None):
            img = os.path.join(work, f"img{i}")
            args = [hiber, "checkpoint", jobs[i], "--leave-running", "--json", "--out", img]
            if coordinator:
                args += ["--coordinator", coordinator]
            e = dict(env, HIBER_STATE=states[i])
            if session:
                e["HIBER_SESSION"] = session
            return subprocess.Popen(in_ns(hosts.ns[i], *args), env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def finish(p):
            out, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"checkpoint failed: {err.strip()[-1500:]}")
            return json.loads(out)

        for rep in range(a.reps):
            for mode in (("coordinated", "one by one") if rep % 2 == 0 else ("one by one", "coordinated")):
                start = time.time()
                if mode == "coordinated":
                    session = secrets.token_hex(24)
                    addr = f"{hosts.addr[0]}:{7500 + rep}"
                    coord = subprocess.Popen(in_ns(hosts.ns[0], hiber, "coordinate", "--participants", str(a.hosts), "--listen", addr, "--timeout", "300"),
                                             env=dict(env, HIBER_SESSION=session), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    assert coord.stdout.readline().startswith("coordinating"), coord.stderr.read()
                    reports = [finish(p) for p in [checkpoint(i, addr, session) for i in range(a.hosts)]]
                    coord.communicate(timeout=60)
                else:
                    reports = [finish(checkpoint(i)) for i in range(a.hosts)]
                end = time.time()
                time.sleep(1.5)
                gap, stalled = stall(lines(), start, end)
                paused = [round(r.get("paused_seconds") or 0, 3) for r in reports]
                rows[mode].append({"wall_s": round(end - start, 3), "max_gap_s": gap and round(gap, 3), "stall_s": stalled and round(stalled, 3), "paused_s": paused})
                print(f"{mode}: wall {end - start:.2f} s, longest gap {gap:.2f} s, stall {stalled:.2f} s, each host's pause {paused}", file=sys.stderr, flush=True)
                for i in range(a.hosts):
                    shutil.rmtree(os.path.join(work, f"img{i}"), ignore_errors=True)
        med = {m: statistics.median(r["stall_s"] for r in rs) for m, rs in rows.items()}
        gap = {m: statistics.median(r["max_gap_s"] for r in rs) for m, rs in rows.items()}
        print(f"| hosts | ranks | MiB a rank | reps | stall, coordinated (s, median) | stall, one by one (s, median) | ratio | longest gap, coordinated | longest gap, one by one |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| {a.hosts} | {nranks} | {a.mib} | {a.reps} | {med['coordinated']:.2f} | {med['one by one']:.2f} | {med['coordinated'] / med['one by one']:.2f} | {gap['coordinated']:.2f} | {gap['one by one']:.2f} |")
        if a.json:
            commit = sh("git", "-C", REPO, "rev-parse", "--short", "HEAD").stdout.strip()
            with open(a.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": commit, "hosts": a.hosts, "ranks": nranks,
                           "mib_per_rank": a.mib, "pause_ms": a.pause_ms,
                           "mpi_cut": [{"mode": m, "samples": rs} for m, rs in rows.items()]}, f, indent=1)
    finally:
        for i in range(a.hosts):
            for j in ("mpib", "orted"):
                subprocess.run([hiber, "rm", "-f", j], env=dict(env, HIBER_STATE=states[i]), capture_output=True)
        for p in sshd:
            p.kill()
        hosts.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
