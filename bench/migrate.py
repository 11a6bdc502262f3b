#!/usr/bin/env python3
"""`hiber migrate` against its baseline, side by side in one run, between two "hosts" on this
machine (network namespaces joined by a veth pair, each with a hiber and state directory of
its own; the target runs `hiber serve`).

- migrate: `hiber migrate JOB --to B` (the image over TLS, restored at B).
- baseline: `hiber checkpoint JOB` (stopping) at A, the image copied to B's disk (`cp -a`,
  unencrypted: what `scp` of the image would do at disk speed), `hiber restore` at B.

The job is hiber's `cpu` workload (one thread stepping every 20 ms over a buffer of MEM MiB,
each step rewriting a part of it and printing its wall clock). Downtime is the job's own:
the longest gap between two of its progress lines around the move, the line before at A and
the line after at B. Runs alternate between the two ways, the same number of times each;
the report gives medians and the ratio migrate / baseline.

Usage (root): bench/migrate.py HIBER [--sizes MIB ...] [--runs N] [--json OUT]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402


class Hosts:
    """Two network namespaces held by processes, joined by a veth pair."""

    def __init__(self, tag):
        self.holders = [subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"]) for _ in range(2)]
        time.sleep(0.3)
        self.ns = [f"/proc/{p.pid}/ns/net" for p in self.holders]
        va, vb = f"vmA{tag}", f"vmB{tag}"
        subprocess.run(["ip", "link", "add", va, "type", "veth", "peer", "name", vb], check=True)
        for dev, p in ((va, self.holders[0]), (vb, self.holders[1])):
            subprocess.run(["ip", "link", "set", dev, "netns", str(p.pid)], check=True)
        for ns, dev, addr in ((self.ns[0], va, "10.78.0.1/24"), (self.ns[1], vb, "10.78.0.2/24")):
            for args in (["addr", "add", addr, "dev", dev], ["link", "set", dev, "up"], ["link", "set", "lo", "up"]):
                subprocess.run(["nsenter", f"--net={ns}", "ip", *args], check=True)
        self.b_addr = "10.78.0.2"

    def close(self):
        for p in self.holders:
            p.kill()
            p.wait()


def hiber(hiber_bin, ns, state, *args, check=True):
    env = dict(os.environ, HIBER_STATE=state)
    env.pop("HIBER_LOG", None)
    return subprocess.run(["nsenter", "-F", f"--net={ns}", hiber_bin, *args], env=env, check=check, capture_output=True, text=True)


def one_run(args, hosts, way, mib, n, root):
    state_a, state_b = os.path.join(root, f"a{n}"), os.path.join(root, f"b{n}")
    job = f"m{n}"
    hiber(args.hiber, hosts.ns[0], state_a, "run", "--name", job, "--", args.hiber, "workload", "cpu", "--steps", "100000", "--mem-mib", str(mib))
    before = benchlib.wait_steps(state_a, job, 30)
    t0 = time.time()
    if way == "migrate":
        out = hiber(args.hiber, hosts.ns[0], state_a, "migrate", job, "--to", f"{hosts.b_addr}:7400", "--token-file", args.token, "--json")
        report = json.loads(out.stdout)
        sent = report["sent_bytes"]
    else:
        image = os.path.join(state_a, "img")
        hiber(args.hiber, hosts.ns[0], state_a, "checkpoint", job, "--out", image)
        copy = os.path.join(root, f"copy{n}")
        subprocess.run(["cp", "-a", image, copy], check=True)
        hiber(args.hiber, hosts.ns[1], state_b, "restore", copy, "--name", job)
        sent = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(copy) for f in fs)
    wall = time.time() - t0
    # The target's log: with migrate it holds the lines from before the move too.
    after_start = len(benchlib.parse_progress(benchlib.job_log(state_b, job)))
    benchlib.wait_steps(state_b, job, after_start + 10)
    pa = benchlib.parse_progress(benchlib.job_log(state_a, job)) if way == "baseline" else []
    pb = benchlib.parse_progress(benchlib.job_log(state_b, job))
    progress = sorted({(p.step, p.t_ms): p for p in pa + pb}.values(), key=lambda p: p.step)
    steps = [p.step for p in progress]
    assert steps == list(range(steps[0], steps[0] + len(steps))), f"{way}: steps missing or repeated"
    down = benchlib.downtime_ms(progress, int(t0 * 1000), int((t0 + wall) * 1000))
    typical = benchlib.typical_gap_ms(before, int(t0 * 1000))
    hiber(args.hiber, hosts.ns[1], state_b, "rm", "-f", job, check=False)
    hiber(args.hiber, hosts.ns[0], state_a, "rm", "-f", job, check=False)
    shutil.rmtree(state_a, ignore_errors=True)
    shutil.rmtree(state_b, ignore_errors=True)
    shutil.rmtree(os.path.join(root, f"copy{n}"), ignore_errors=True)
    return {"way": way, "mem_mib": mib, "downtime_ms": down, "step_ms": typical, "command_s": wall, "bytes": sent}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hiber")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="hiber-bench-migrate-")
    os.chmod(root, 0o700)
    args.token = os.path.join(root, "token")
    with open(os.open(args.token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(os.urandom(24).hex() + "\n")
    hosts = Hosts(os.getpid() % 10000)
    env = dict(os.environ, HIBER_STATE=os.path.join(root, "serve"))
    env.pop("HIBER_LOG", None)
    serve = None
    rows = []
    try:
        n = 0
        for mib in args.sizes:
            for r in range(args.runs):
                for way in (("migrate", "baseline") if r % 2 == 0 else ("baseline", "migrate")):
                    n += 1
                    if way == "migrate":
                        # The target's hiber receives into the run's state B.
                        env["HIBER_STATE"] = os.path.join(root, f"b{n}")
                        serve = subprocess.Popen(
                            ["nsenter", "-F", f"--net={hosts.ns[1]}", args.hiber, "serve", "--listen", f"{hosts.b_addr}:7400", "--token-file", args.token],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                        serve.stdout.readline()
                    try:
                        row = one_run(args, hosts, way, mib, n, root)
                    finally:
                        if serve:
                            serve.kill()
                            serve.wait()
                            serve = None
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        hosts.close()
        shutil.rmtree(root, ignore_errors=True)
    print()
    print("| job memory | way | runs | downtime (median, min–max) | command | bytes moved |")
    print("|---|---|---|---|---|---|")
    for mib in args.sizes:
        med = {}
        for way in ("migrate", "baseline"):
            rs = [r for r in rows if r["mem_mib"] == mib and r["way"] == way]
            d = [r["downtime_ms"] for r in rs]
            med[way] = statistics.median(d)
            print(f"| {mib} MiB | {way} | {len(rs)} | {med[way]:.0f} ms ({min(d):.0f}–{max(d):.0f}) | "
                  f"{statistics.median(r['command_s'] for r in rs):.2f} s | {statistics.median(r['bytes'] for r in rs) / 2**20:.0f} MiB |")
        print(f"| {mib} MiB | ratio migrate / baseline | | {med['migrate'] / med['baseline']:.2f} | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "migrate", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
