#!/usr/bin/env python3
"""Runs the workspace's test binaries one at a time in cargo test's order, as `cargo test`
does, each binary's output as it comes, and one line summing every binary's counts.

With HIBER_TEST_LANES=2, Slurm's binary (which mostly waits for its daemons) runs beside the
others instead: about 2.5 minutes less on CI's 2-core machine. It is not the default: the
two-host MPI test failed once beside it (a restore found its address still taken, under
load), and running other binaries at once found more that they share of the host (see
APART). Each binary still runs all its tests, with cargo's own harness and threads.
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

# The binaries that run beside the others with HIBER_TEST_LANES=2, in a second lane. With
# any two binaries at once, a job of one kept another's CRIU staging area in its mount
# namespace (fixed in hiber), an MPI restore found its pseudo-terminal number, or its
# address, still taken, and a test counting its leftover processes host-wide counted
# another's (fixed in the test).
APART = ["slurm"]
# With HIBER_TEST_LANES=2, the binaries that run alone first: mounts.rs mounts things on the host that
# every job started meanwhile would keep in its mount namespace (and need at its restore).
ALONE = ["mounts"]
LANES = int(os.environ.get("HIBER_TEST_LANES", "1"))


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
    apart = [b for b in every if b[0] in APART] if LANES > 1 else []
    queues = [[b for b in every if b not in apart and b not in alone], apart]
    lock = threading.Lock()
    totals = {"passed": 0, "failed": 0, "bad": []}
    # Each binary's output is printed whole once it ends where two run at once, so that
    # theirs never interleave; as it comes where one runs at a time.
    live = not apart

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
    threads = [threading.Thread(target=lane, args=(q,)) for q in queues]
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
