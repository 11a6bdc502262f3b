#!/usr/bin/env python3
"""Where the rest of a DDP job's `--leave-running` pause goes, finer than the benchmark's
`pause_steps` (#11: 2.65 s on free GPUs, against a 2 s target).

Runs on the two-GPU machine as root, from the repository root with `.carry/` in place:
    python3 bench/probes/pause_parts.py [--mib 30720]

1. The machine: kernel, whether it tracks dirty memory for CRIU's pre-dump (soft-dirty,
   CONFIG_MEM_SOFT_DIRTY), transparent huge pages.
2. The benchmark's job (bench.py --ddp 30: torchrun, two DDP ranks, each holding --mib of
   ballast) under `hiber run`. Before the checkpoint: each process's memory as the kernel
   counts it (smaps: anonymous, huge pages, VMAs; the largest anonymous mappings).
3. One `hiber checkpoint --leave-running` with `HIBER_LOG=hiber_core=debug` and CRIU's log
   kept (`HIBER_KEEP_CRIU_LOG=1`): hiber's own lines on the NCCL cut, the agent's take
   (quiesce, fingerprints, arenas, copy, release), the driver and CRIU; CRIU's log reduced
   to when it started on each process and on its memory; each process's share of CRIU's
   pages (pages-*.img).
4. A plain PyTorch process on one GPU (no hiber): its anonymous memory before and after
   glibc's malloc_trim(0), which returns freed heap pages to the kernel.
5. The same kind of process taken through the driver's checkpoint and restore from here
   (`cuCheckpointProcess*`, as hiber's driver engine calls them): how long each took, and
   the anonymous mappings the checkpoint added (where the driver keeps device state in
   host memory, which CRIU then dumps), with their huge pages.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CARRY = REPO / ".carry"
HIBER = str(CARRY / "bin/hiber")
STATE = Path("/var/tmp/pause-parts-state")
IMG = Path("/var/tmp/pause-parts-img")
ENV = dict(os.environ, HIBER_STATE=str(STATE), NCCL_NVLS_ENABLE="0", PATH=f"{CARRY / 'bin'}:{os.environ['PATH']}")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def sh(cmd):
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return (r.stdout + r.stderr).strip()


def machine():
    print("== machine", flush=True)
    print("kernel", os.uname().release)
    cfg = sh("zcat /proc/config.gz 2>/dev/null || cat /boot/config-$(uname -r) 2>/dev/null")
    print("config:", " ".join(l for l in cfg.splitlines() if "SOFT_DIRTY" in l or "USERFAULTFD" in l) or "(no kernel config readable)")
    print("criu mem_dirty_track:", sh(f"{CARRY / 'bin/criu'} check --feature mem_dirty_track"))
    for f in ("enabled", "defrag", "shmem_enabled"):
        print(f"thp {f}:", sh(f"cat /sys/kernel/mm/transparent_hugepage/{f}"))
    print(sh("nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader"), flush=True)


def children(root):
    kids = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                kids.setdefault(int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    tree, todo = [], [root]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += kids.get(p, [])
    return sorted(tree)


def memory(pid):
    """smaps of one process: totals and its largest anonymous mappings."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except OSError as e:
        return {"pid": pid, "error": str(e)}
    vmas, cur = [], None
    for line in text.splitlines():
        f = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            cur = {"range": f[0], "perms": f[1], "path": f[5] if len(f) > 5 else "", "anon": 0, "thp": 0, "size": 0}
            vmas.append(cur)
        elif cur is not None and f[0] in ("Anonymous:", "AnonHugePages:", "Size:"):
            cur[{"Anonymous:": "anon", "AnonHugePages:": "thp", "Size:": "size"}[f[0]]] = int(f[1])
    top = sorted(vmas, key=lambda v: -v["anon"])[:12]
    return {
        "pid": pid,
        "comm": comm,
        "threads": threads,
        "vmas": len(vmas),
        "anon_mib": sum(v["anon"] for v in vmas) >> 10,
        "thp_mib": sum(v["thp"] for v in vmas) >> 10,
        "device_vmas": sum(1 for v in vmas if v["path"].startswith("/dev/nvidia")),
        "top_anon": [f"{v['anon'] >> 10} MiB of {v['size'] >> 10} ({v['perms']} {v['path'] or '[anon]'})" for v in top if v["anon"] >= 8 << 10],
    }


def wait_steps(n, timeout=300):
    log = STATE / "jobs/pp/stdout.log"
    end = time.time() + timeout
    while time.time() < end:
        text = log.read_text() if log.exists() else ""
        if len(re.findall(r"^step \d+", text, re.M)) >= n:
            return
        time.sleep(1)
    raise SystemExit(f"the job made no {n} steps in {timeout} s:\n{text[-2000:]}")


def criu_log_summary(text):
    """CRIU's log reduced to where its time went: each process it starts on, and every line
    that came 5 ms or more after the one before (with that gap)."""
    out, prev = [], None
    for line in text.splitlines():
        m = re.match(r"^\((\d+\.\d+)\)", line)
        if not m:
            continue
        t = float(m.group(1))
        gap = t - prev if prev is not None else 0.0
        prev = t
        if gap >= 0.005 or any(k in line for k in ("Dumping task (pid", "Dumping pages", "page writer")):
            out.append(f"+{gap * 1000:7.1f} ms {line[:150]}")
    return out[:300]


def ddp(mib, variants):
    print("== DDP job, hiber", flush=True)
    shutil.rmtree(STATE, ignore_errors=True)
    shutil.rmtree(IMG, ignore_errors=True)
    argv = ["python3", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "gpu/programs/ddp.py"), "--mode", "ddp", "--mib", str(mib), "--steps", "1000000000"]
    subprocess.run([HIBER, "run", "--name", "pp", "--"] + argv, env=ENV, check=True)
    try:
        wait_steps(30)
        root = json.loads((STATE / "jobs/pp/job.json").read_text())["pid"]
        for p in children(root):
            print(json.dumps(memory(p)), flush=True)
        print(sh("nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader"))
        for variant in variants:
            checkpoint(variant)
        for name in ("stdout.log", "stderr.log"):
            text = (STATE / "jobs/pp" / name).read_text(errors="replace") if (STATE / "jobs/pp" / name).exists() else ""
            print(f"job {name}, the agent's lines:", *[l[:200] for l in text.splitlines() if "hiber" in l.lower() or "stack" in l.lower()][:30], sep="\n  ")
    finally:
        subprocess.run([HIBER, "rm", "-f", "pp"], env=ENV)
        shutil.rmtree(IMG, ignore_errors=True)


def checkpoint(variant):
    """One `--leave-running` checkpoint of the job with `variant`'s variables set."""
    print(f"-- checkpoint with {variant or 'defaults'}", flush=True)
    env = dict(ENV, HIBER_LOG="hiber_core=debug", HIBER_KEEP_CRIU_LOG="1", **dict(v.split("=", 1) for v in variant.split(",") if v))
    shutil.rmtree(IMG, ignore_errors=True)
    for d in (STATE / "logs").glob("dump-*"):
        shutil.rmtree(d, ignore_errors=True)
    t = time.time()
    r = subprocess.run([HIBER, "checkpoint", "pp", "--leave-running", "--json", "--out", str(IMG)], env=env, capture_output=True, text=True)
    print(f"checkpoint rc {r.returncode} in {time.time() - t:.2f} s", flush=True)
    try:
        rep = json.loads(r.stdout)
        print("pause_steps", json.dumps(rep.get("pause_steps")))
        print({k: rep.get(k) for k in ("paused_seconds", "criu_frozen_seconds", "criu_memdump_seconds", "criu_memwrite_seconds", "criu_memory_bytes", "criu_staged")})
    except json.JSONDecodeError:
        print(r.stdout[-2000:])
    for line in ANSI.sub("", r.stderr).splitlines():
        if any(k in line for k in ("NCCL", "device memory taken", "arenas", "quiesce", "staging", "CRIU dump", "phase", "pause", "keeper", "resum", "checkpoint")):
            print("  ", line[:400])
    pages = sorted(IMG.rglob("pages-*.img"))
    print("CRIU pages files (MiB):", [(p.name, p.stat().st_size >> 20) for p in pages])
    print("CRIU pagemaps:", sorted(p.name for p in IMG.rglob("pagemap-*.img")))
    logs = sorted((STATE / "logs").glob("dump-*"))
    if logs:
        text = (logs[-1] / "dump.log").read_text(errors="replace")
        print(f"CRIU dump.log: {len(text.splitlines())} lines")
        for l in criu_log_summary(text):
            print("   ", l)
    # Which GPUs each rank holds a context on after the cut (the agent's teardown once gave
    # rank 1 one on GPU 0 as well).
    print(sh("nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader"))
    print("job still stepping after:", (STATE / "jobs/pp/stdout.log").read_text().strip().splitlines()[-1][:120], flush=True)


TRIM = r"""
import ctypes, os, torch
def anon():
    return sum(int(l.split()[1]) for l in open(f"/proc/{os.getpid()}/smaps") if l.startswith("Anonymous:")) >> 10
a0 = anon()
m = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096)).cuda()
opt = torch.optim.AdamW(m.parameters())
for _ in range(50):
    loss = m(torch.randn(256, 4096, device="cuda")).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
torch.cuda.synchronize()
a1 = anon()
import time; t = time.time()
ctypes.CDLL("libc.so.6").malloc_trim(0)
took = time.time() - t
print(f"anon MiB: torch imported {a0}, after CUDA and 50 steps {a1}, after malloc_trim {anon()} ({took * 1000:.1f} ms)")
"""


def trim():
    print("== malloc_trim, one PyTorch process", flush=True)
    r = subprocess.run([sys.executable, "-c", TRIM], env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"), capture_output=True, text=True)
    print((r.stdout + r.stderr)[-800:], flush=True)


HOLD = r"""
import torch
m = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096)).cuda()
for _ in range(20):
    m(torch.randn(256, 4096, device="cuda")).sum().backward()
torch.cuda.synchronize()
torch.cuda.empty_cache()
print("ready", flush=True)
import time
time.sleep(3600)
"""


def vmas(pid):
    out = {}
    cur = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        f = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            cur = f[0]
            out[cur] = {"path": f[5] if len(f) > 5 else "", "perms": f[1]}
        elif cur and f[0] in ("Anonymous:", "AnonHugePages:", "Size:"):
            out[cur][f[0][:-1]] = int(f[1]) >> 10
    return out


def driver():
    print("== the driver's checkpoint of one PyTorch process", flush=True)
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    p = subprocess.Popen([sys.executable, "-c", HOLD], env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"), stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        before = vmas(p.pid)
        print(sh(f"nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | grep {p.pid}"))
        args = (ctypes.c_uint64 * 8)()
        args[0] = 10000  # timeoutMs in the low half
        for name, call in (("lock", cu.cuCheckpointProcessLock), ("checkpoint", cu.cuCheckpointProcessCheckpoint)):
            t = time.time()
            r = call(p.pid, ctypes.byref(args if name == "lock" else (ctypes.c_uint64 * 8)()))
            print(f"{name}: {r} in {time.time() - t:.3f} s", flush=True)
        after = vmas(p.pid)
        new = {k: v for k, v in after.items() if k not in before or before[k].get("Anonymous", 0) != v.get("Anonymous", 0)}
        gone = [k for k in before if k not in after]
        print(f"mappings: {len(before)} before, {len(after)} after; {len(gone)} gone ({sum(before[k].get('Size', 0) for k in gone)} MiB); new or grown:")
        for k, v in sorted(new.items(), key=lambda kv: -kv[1].get("Anonymous", 0))[:15]:
            print(f"   {k} {v}")
        print("   anonymous added:", sum(v.get("Anonymous", 0) for v in after.values()) - sum(v.get("Anonymous", 0) for v in before.values()), "MiB; huge pages:", sum(v.get("AnonHugePages", 0) for v in after.values()), "MiB")
        for name, call in (("restore", cu.cuCheckpointProcessRestore), ("unlock", cu.cuCheckpointProcessUnlock)):
            t = time.time()
            r = call(p.pid, ctypes.byref((ctypes.c_uint64 * 8)()))
            print(f"{name}: {r} in {time.time() - t:.3f} s", flush=True)
    finally:
        p.kill()
        p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=30720)
    ap.add_argument("--variants", default="", help="checkpoints to take, separated by ';', each with its own variables (A=1,B=2; empty: hiber's defaults)")
    ap.add_argument("--no-trim", action="store_true")
    ap.add_argument("--ddp-only", action="store_true", help="only the DDP job's checkpoints (no malloc_trim, no driver probe)")
    a = ap.parse_args()
    machine()
    ddp(a.mib, a.variants.split(";"))
    if a.ddp_only:
        return
    if not a.no_trim:
        trim()
    driver()


if __name__ == "__main__":
    main()
