#!/usr/bin/env python3
"""How fast CRIU writes a frozen process's memory, by where its images go.

Inside a `--leave-running` pause of the 30 GiB DDP benchmark, CRIU's memory write
(pipes of the processes' pages into the image's files) took 1.01-1.14 s of the pause for
3.39 GiB (bench/results/2026-11-25-h200x2-ddp30.json: criu_memwrite_seconds). This
probe dumps a plain process holding that much non-zero anonymous memory with
`criu dump --leave-running` into directories on different filesystems, interleaved, and
prints CRIU's own figures (--display-stats): frozen, memory dump and memory write time.

Targets: a directory on the filesystem given (the image's), /dev/shm, and tmpfs mounted
by this probe with huge=always and huge=within_size (large folios for the page cache of
CRIU's pages files).

Runs as root on the GPU machine, without hiber or a GPU:
    python3 bench/probes/criu_write.py --dir /var/tmp/criu-write [--gib 3.4] [--reps 3]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CRIU = os.environ.get("HIBER_CRIU", str(REPO / ".carry/bin/criu"))
HOLDER = "import os, sys, time\nb = bytearray(os.urandom(1 << 20)) * int(sys.argv[1])\nprint('ready', flush=True)\ntime.sleep(3600)\n"


def holder(mib):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(mib)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def dump(pid, d):
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    t = time.time()
    r = subprocess.run([CRIU, "dump", "-t", str(pid), "-D", str(d), "--leave-running", "--display-stats", "-v1", "-o", "dump.log"], capture_output=True, text=True)
    took = time.time() - t
    if r.returncode != 0:
        return {"error": (d / "dump.log").read_text()[-800:] if (d / "dump.log").exists() else r.stderr[-800:]}
    stats = {}
    for key, name in (("Frozen time", "frozen_s"), ("Memory dump time", "memdump_s"), ("Memory write time", "memwrite_s")):
        m = re.search(rf"{key}:\s+(\d+) us", r.stdout + r.stderr)
        if m:
            stats[name] = int(m.group(1)) / 1e6
    m = re.search(r"Memory pages written:\s+(\d+)", r.stdout + r.stderr)
    if m:
        stats["gib"] = round(int(m.group(1)) * 4096 / 2**30, 3)
    stats["command_s"] = round(took, 3)
    return stats


def mount(where, huge):
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["umount", str(where)], capture_output=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=16g,mode=0700,huge={huge}", "tmpfs", str(where)], capture_output=True, text=True)
    return r.returncode == 0, r.stderr.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a directory on the image's filesystem")
    ap.add_argument("--gib", type=float, default=3.4)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    targets = {"image filesystem": Path(a.dir), "/dev/shm": Path("/dev/shm/criu-write")}
    for huge in ("always", "within_size"):
        where = Path(f"/tmp/criu-write-{huge}")
        ok, why = mount(where, huge)
        if ok:
            targets[f"tmpfs huge={huge}"] = where
        else:
            print(json.dumps({"target": f"tmpfs huge={huge}", "error": why}), flush=True)
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    fs = subprocess.run(["findmnt", "-no", "FSTYPE,OPTIONS", "-T", a.dir], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"image filesystem": fs}), flush=True)
    p = holder(int(a.gib * 1024))
    rows = {t: [] for t in targets}
    try:
        for rep in range(a.reps):
            for name, d in targets.items():
                s = dump(p.pid, d / "img")
                s.update(target=name, rep=rep)
                print(json.dumps(s), flush=True)
                rows[name].append(s)
                shutil.rmtree(d / "img", ignore_errors=True)
                subprocess.run(["sync"])
    finally:
        p.kill()
        for huge in ("always", "within_size"):
            subprocess.run(["umount", f"/tmp/criu-write-{huge}"], capture_output=True)
    for name, rs in rows.items():
        w = [r["memwrite_s"] for r in rs if "memwrite_s" in r]
        f = [r["frozen_s"] for r in rs if "frozen_s" in r]
        g = next((r["gib"] for r in rs if "gib" in r), None)
        if w:
            print(json.dumps({"target": name, "median_memwrite_s": statistics.median(w), "median_frozen_s": statistics.median(f), "gib": g,
                              "write_gb_s": round(g * 2**30 / 1e9 / statistics.median(w), 2) if g else None}), flush=True)


if __name__ == "__main__":
    main()
