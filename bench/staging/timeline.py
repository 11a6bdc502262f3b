#!/usr/bin/env python3
"""Where does a --leave-running checkpoint's downtime go? Runs the GPU suite's counter as a
hiber job, checkpoints it with --leave-running and hiber's debug log on, and prints on one
clock (ms from the checkpoint's start): every line hiber logged, and every gap in the job's
own progress longer than --gap-ms. Then the image's agent section. Runs on the GPU machine.

    python3 bench/staging/timeline.py --mib 48128 [--reserve-mib N] [--set K=V ...]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from benchlib import parse_progress  # noqa: E402

CARRY = REPO / ".carry"
HIBER = str(CARRY / "bin" / "hiber")
WORK = Path("/var/tmp/hiber-timeline")
ENV = dict(os.environ, HIBER_STATE=str(WORK / "state"), HIBER_CRIU=str(CARRY / "bin" / "criu"))


def now_ms():
    return time.time() * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, required=True)
    ap.add_argument("--reserve-mib", type=int, default=0)
    ap.add_argument("--gap-ms", type=int, default=100)
    ap.add_argument("--set", action="append", default=[], help="K=V for hiber's environment")
    a = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    counter = WORK / "counter"
    if not counter.exists():
        subprocess.run(["nvcc", "-O2", "-o", counter, REPO / "gpu/programs/counter.cu"], check=True)
    env = dict(ENV, **dict(kv.split("=", 1) for kv in a.set))
    argv = [counter, "--mib", a.mib, "--steps", "1000000000", "--interval-ms", "10"] + (["--reserve-mib", a.reserve_mib] if a.reserve_mib else [])
    subprocess.run([HIBER, "run", "--name", "tl", "--"] + [str(x) for x in argv], check=True, env=env)
    log = WORK / "state/jobs/tl/stdout.log"
    img = WORK / "img"
    shutil.rmtree(img, ignore_errors=True)
    try:
        start = time.time()
        while not parse_progress(log.read_text() if log.exists() else "") or parse_progress(log.read_text())[-1].step < 20:
            if time.time() - start > 300:
                sys.exit("the job made no progress")
            time.sleep(0.05)
        lines = []
        t0 = now_ms()
        p = subprocess.Popen([HIBER, "checkpoint", "tl", "--leave-running", "--out", str(img)], env=dict(env, HIBER_LOG="hiber_core=debug"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def read():
            for line in p.stderr:
                lines.append((now_ms() - t0, line.rstrip()))

        reader = threading.Thread(target=read)
        reader.start()
        p.wait()
        reader.join()
        t1 = now_ms()
        time.sleep(0.5)
        prog = parse_progress(log.read_text())
        gaps = [(a_.t_ms - t0, b.t_ms - a_.t_ms, a_.step) for a_, b in zip(prog, prog[1:]) if b.t_ms - a_.t_ms > a.gap_ms and b.t_ms >= t0 and a_.t_ms <= t1]
        events = [(t, f"hiber: {l}") for t, l in lines] + [(t, f"JOB STOPPED {g:.0f} ms after step {s}") for t, g, s in gaps]
        print(f"checkpoint of {a.mib} MiB (+{a.reserve_mib} MiB reserved), exit {p.returncode}, {(t1 - t0) / 1000:.2f} s until it returned")
        for t, e in sorted(events):
            print(f"{t:9.0f} ms  {e}")
        if img.exists():
            m = json.loads((img / "manifest.json").read_text())
            for d in m["devices"]:
                if d["engine"] == "agent":
                    s = d["state"]
                    print(json.dumps({k: s.get(k) for k in ("mode", "placed", "staging_seconds", "quiesce_seconds", "copy_seconds")}))
    finally:
        subprocess.run([HIBER, "rm", "-f", "tl"], env=env)
        shutil.rmtree(img, ignore_errors=True)


if __name__ == "__main__":
    main()
