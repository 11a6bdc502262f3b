#!/usr/bin/env python3
"""Runs the workspace's test binaries, each binary's output whole once it ends, and one line
summing every binary's counts.

Three binaries run at once (HIBER_TEST_LANES, 3 unless set), the slowest first: Slurm's
mostly waits for its daemons, and takes one lane for almost all the run; the others share
the machine's two cores. One after another they made a fresh clone's run 11 to 14 minutes
on CI's 2-core machine, against #41's 8; two at a time, 8 m 01 s. Each binary still runs
all its tests, with cargo's own harness and threads.
HIBER_TEST_LANES=1 runs them one at a time in cargo test's order, each binary's output as it
comes, as `cargo test` does.

Running binaries at once found what they share of the host, each fixed where it was:
- a job kept another checkpoint's staging area in its mount namespace (fixed in hiber:
  a job's mount namespace drops them);
- a test counted leftover workloads host-wide (fixed in the test);
- an MPI job restored in place found its terminal numbers taken by another binary's jobs
  (fixed in hiber: each job has its own /dev/pts);
- and its address held by a connection it had closed itself (fixed in hiber: a restore
  ends such connections). That one failed one run in five alone too.
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

# The binaries that run alone, first: mounts.rs mounts things on the host that every job
# started meanwhile would keep in its mount namespace (and need at its restore).
ALONE = ["mounts"]
# The slowest binaries, slowest first (as timed one at a time on CI's machine), started
# first so that the lanes end close together; the others follow in cargo's order.
SLOWEST = ["slurm", "opencl", "interrupted", "checkpoint_restore", "dead_host", "migrate", "mpi", "phases"]
LANES = int(os.environ.get("HIBER_TEST_LANES", "3"))


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
        unit = "test" not in target["kind"]
        name = f"{target['name']} (unit tests)" if unit else target["name"]
        out.append(((msg["manifest_path"], not unit, target["name"]), name, exe, os.path.dirname(msg["manifest_path"])))
    # cargo test's own order (package by package, unit tests first, then the test files by
    # name), not the order the builds finished in: the runs that passed in CI before ran so.
    return [b[1:] for b in sorted(out)]


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
    every = binaries(sys.stdin)
    if not every:
        print("run_tests: cargo listed no test binaries", file=sys.stderr)
        return 1
    alone = [b for b in every if b[0] in ALONE] if LANES > 1 else []
    rest = [b for b in every if b not in alone]
    if LANES > 1:
        rest.sort(key=lambda b: SLOWEST.index(b[0]) if b[0] in SLOWEST else len(SLOWEST))
    lock = threading.Lock()
    totals = {"passed": 0, "failed": 0, "bad": []}
    # Each binary's output is printed whole once it ends where several run at once, so that
    # theirs never interleave; as it comes where one runs at a time.
    live = LANES <= 1

    def lane(queue):
        while True:
            with lock:
                if not queue:
                    return
                name, exe, cwd = queue.pop(0)
            t0 = time.monotonic()
            env = dict(os.environ, CARGO_MANIFEST_DIR=cwd)
            if live:
                # One lane: the output as it comes, as cargo shows it (a test that hangs says
                # so while it runs).
                print(f"     Running {name} ({exe})", flush=True)
                p = subprocess.Popen([exe, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace")
                lines = []
                for line in p.stdout:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                    lines.append(line)
                rc, text = p.wait(), "".join(lines)
            else:
                with tempfile.TemporaryFile(mode="w+") as log:
                    rc = subprocess.call([exe, *args], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                    log.seek(0)
                    text = log.read()
            passed, failed = counts(text)
            with lock:
                if live:
                    print(f"     ({name}: {time.monotonic() - t0:.1f} s)", flush=True)
                else:
                    print(f"     Running {name} ({exe}): {time.monotonic() - t0:.1f} s", flush=True)
                    sys.stdout.write(text)
                    sys.stdout.flush()
                totals["passed"] += passed
                totals["failed"] += failed
                if rc != 0:
                    totals["bad"].append(f"{name} (exit status {rc})")

    lane(alone)
    # Every lane takes the next binary from the one queue.
    threads = [threading.Thread(target=lane, args=(rest,)) for _ in range(max(LANES, 1))]
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
