#!/usr/bin/env python3
"""Runs the workspace's test binaries two at a time, the slowest first.

`cargo test` runs its test binaries one after another. On CI's 2-core machine a few of
them spend most of their time waiting on something other than the CPU (Slurm's daemons
holding a requeued job, network namespaces, timers), and ran end to end took about nine
minutes (#41 asks for under eight, build included). Here each binary still runs all its
tests, with cargo's own harness and threads; only the binaries overlap.

Reads `cargo test --no-run --message-format=json` on stdin. Arguments after the first are
passed to every binary (a test name filter, say). Each binary's output is printed whole once
it ends, so two never interleave. Ends with one line summing every binary's counts, and
fails if any binary failed.
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

# The binaries that took longest in a full run here (seconds, a3f2a9d): started first, so
# that the two lanes end close together. Others follow in cargo's order.
SLOWEST = ["slurm", "opencl", "checkpoint_restore", "interrupted", "mpi", "migrate", "phases"]
LANES = int(os.environ.get("HIBER_TEST_LANES", "2"))


def binaries(stream):
    """(name, executable, package directory) of each test binary cargo built."""
    out = []
    for line in stream:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if msg.get("reason") != "compiler-artifact" or not msg.get("profile", {}).get("test"):
            continue
        exe = msg.get("executable")
        if not exe:
            continue
        target = msg["target"]
        name = target["name"] if "test" in target["kind"] else f"{target['name']} (unit tests)"
        out.append((name, exe, os.path.dirname(msg["manifest_path"])))
    rank = {n: i for i, n in enumerate(SLOWEST)}
    return sorted(out, key=lambda b: rank.get(b[0], len(SLOWEST)))


def counts(text):
    """(passed, failed) summed over the `test result:` lines of a binary's output."""
    passed = failed = 0
    for line in text.splitlines():
        if line.startswith("test result:"):
            words = line.replace(";", "").split()
            for i in range(1, len(words)):
                if words[i] == "passed":
                    passed += int(words[i - 1])
                elif words[i] == "failed":
                    failed += int(words[i - 1])
    return passed, failed


def main():
    args = sys.argv[1:]
    queue = binaries(sys.stdin)
    if not queue:
        print("run_tests: cargo listed no test binaries", file=sys.stderr)
        return 1
    lock = threading.Lock()
    totals = {"passed": 0, "failed": 0, "bad": []}

    def lane():
        while True:
            with lock:
                if not queue:
                    return
                name, exe, cwd = queue.pop(0)
            t0 = time.monotonic()
            with tempfile.TemporaryFile(mode="w+") as log:
                env = dict(os.environ, CARGO_MANIFEST_DIR=cwd)
                rc = subprocess.call([exe, *args], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                log.seek(0)
                text = log.read()
            passed, failed = counts(text)
            with lock:
                print(f"     Running {name} ({exe}): {time.monotonic() - t0:.1f} s", flush=True)
                sys.stdout.write(text)
                sys.stdout.flush()
                totals["passed"] += passed
                totals["failed"] += failed
                if rc != 0:
                    totals["bad"].append(f"{name} (exit status {rc})")

    threads = [threading.Thread(target=lane) for _ in range(max(1, LANES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"tests: {totals['passed']} passed, {totals['failed']} failed")
    if totals["bad"]:
        print("failed binaries: " + ", ".join(totals["bad"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
