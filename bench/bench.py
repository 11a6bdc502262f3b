#!/usr/bin/env python3
"""How long is the application stopped: hiber against the stock path, side by side.

Runs on the GPU machine. For each workload (the GPU suite's CUDA C++ counter holding 1, 4,
16 or 32 GiB, and a PyTorch model whose weights and AdamW state fill >= 8 GiB) and each
repetition, the contenders (--contenders, default hiber,stock) are alternated:

- hiber: `hiber run`, `hiber checkpoint --leave-running`, `hiber restore` (defaults: the
  agent is preloaded into the job);
- hiber-no-agent: the same with `hiber run --no-agent` (the driver engine alone);
- stock: the path NVIDIA documents for CRIU, with no hiber code: the workload started
  detached, driver lock + checkpoint (bench/stock/cuda_ckpt.c), `criu dump
  --leave-running`, driver restore + unlock, fsync of the image; then `criu restore -d`
  and driver restore + unlock.

Per sample: downtime (the longest gap in the workload's own progress timestamps around the
checkpoint), time until the image is durable, restore time until the workload prints
progress again (page cache, then cold cache), image size on disk, and the peak RSS of the
checkpointing processes. The ceilings (pinned host<->device copy, disk write and read) are
measured in the same run.

With --overhead-reps N, the agent's cost while nothing is checkpointed: a CUDA
microbenchmark (bench/programs/microbench.cu: many small and large allocations, tiny
launches, small copies) and PyTorch training steps (train_big.py), each run to its end as
a job N times with the agent and N times with `--no-agent`, interleaved. What is compared
is each program's own timing (the median block or step time of a run, after warm-up).

With --full DATA:RESERVE, counters that fill the GPU (DATA GiB changing, RESERVE GiB of
zeroed pool); with --incremental STATIC:DATA[:RESERVE], two --leave-running checkpoints of
a job whose STATIC GiB never change (RESERVE GiB more fill the GPU), the second incremental
(bytes written and time until durable against the first's), with the unchanged chunks found
by their fingerprints on the GPU and, with --incremental-modes gpu,copy, side by side with
every chunk copied to the host and hashed as before (HIBER_GPU_FINGERPRINT=0); with --periodic GIB:BATCH:EVERY:STEPS, PyTorch training's throughput
with a --leave-running checkpoint every EVERY steps against none.

With --ddp GIB (two GPUs), a two-rank DDP job launched by torchrun, each rank holding GIB
GiB of ballast besides its model: hiber's figures include its own view of the pause and
CRIU's (frozen, memory drained and written); the stock path locks and checkpoints every
CUDA process of the tree, then dumps it. `--overhead-benchmarks ddp` times that job's
steps with the agent (every NCCL call passing through it) against `--no-agent`.

    python3 bench/bench.py [--sizes 1,4,16,32] [--pytorch-gib 8] [--reps 3] [--tag NAME]
                           [--contenders hiber,stock] [--overhead-reps 0] [--overhead-pytorch-gib 8]
    python3 bench/bench.py --sizes '' --pytorch-gib 0 --overhead-reps 5 --tag overhead
    python3 bench/bench.py --report bench/results/*.json     # merge runs into one report
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    DDP_MLP_STEP,
    DDP_SMALL_STEP,
    MICRO,
    carried_commit,
    ddp_targets,
    downtime_ms,
    durable_rates,
    evaluate_targets,
    first_progress_after,
    fmt,
    full_gpu_targets,
    incremental_targets,
    merge_overhead,
    merge_rows,
    overhead_table,
    parse_progress,
    parse_timings,
    ratios,
    run_median,
    summary,
    table,
    periodic_targets,
    targets_table,
    throughput,
    typical_gap_ms,
    windowed_ms_per_step,
)

REPO = Path(__file__).resolve().parent.parent
CARRY = REPO / ".carry"


HIBER = str(CARRY / "bin" / "hiber")
CRIU = str(CARRY / "bin" / "criu")
WORK = Path("/var/tmp/hiber-bench")
BUILD = WORK / "build"
STATE = WORK / "state"
ENV = dict(os.environ, HIBER_STATE=str(STATE), HIBER_CRIU=CRIU, PYTHONUNBUFFERED="1")


def now_ms():
    return int(time.time() * 1000)


def run(args):
    """Runs a command to completion and returns its stdout; raises with its stderr."""
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=ENV)
    if p.returncode != 0:
        raise RuntimeError(f"{args[0]} {' '.join(map(str, args[1:3]))} failed ({p.returncode}): {p.stderr.strip()[-600:]}")
    return p.stdout


def run_rss(args, timeout=None, env=None):
    """Runs a command; returns (stdout, peak RSS in bytes of it and the children it reaped).
    Past `timeout` seconds it is killed and counts as failed."""
    import threading
    p = subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env or ENV)
    # Both pipes are read while it runs: a chatty command must not block on a full pipe.
    got = {}
    readers = [threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f.read().decode(errors="replace"))) for k, f in (("out", p.stdout), ("err", p.stderr))]
    for t in readers:
        t.start()
    timer = None
    if timeout:
        def hung():
            # os.kill, not Popen.kill: Popen's poll() could reap the child before wait4.
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        timer = threading.Timer(timeout, hung)
        timer.start()
    _, status, ru = os.wait4(p.pid, 0)
    if timer:
        timer.cancel()
    for t in readers:
        t.join()
    out, err = got.get("out", ""), got.get("err", "")
    if timeout and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        err = f"killed after {timeout}s (hung) " + err
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{args[0]} {' '.join(map(str, args[1:3]))} failed ({p.returncode}): {err.strip()[-600:]}")
    return out, ru.ru_maxrss * 1024


def drop_caches():
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def fsync_tree(root):
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(d, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def du(root):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def wait_for(what, limit, cond):
    start = time.time()
    while True:
        v = cond()
        if v:
            return v
        if time.time() - start > limit:
            raise RuntimeError(f"timed out after {limit}s waiting for {what}")
        time.sleep(0.02)


class Workload:
    def __init__(self, name, argv, ready_step):
        self.name, self.argv, self.ready_step = name, argv, ready_step


def counter(gib, reserve_gib=0):
    """The suite's counter holding `gib` GiB of data that changes every step; with
    `reserve_gib`, also that much more device memory kept zeroed and never touched (an
    allocator's pool, JAX's preallocation), so that the GPU can be filled without the image
    outgrowing the machine's disk."""
    argv = [BUILD / "counter", "--mib", str(gib * 1024), "--steps", "1000000000", "--interval-ms", "10"]
    if not reserve_gib:
        return Workload(f"{gib} GiB", argv, 20)
    return Workload(f"{gib + reserve_gib} GiB held, {gib} GiB data", argv + ["--reserve-mib", str(reserve_gib * 1024)], 20)


def pytorch(gib):
    return Workload(f"PyTorch {gib} GiB", ["python3", REPO / "bench/programs/train_big.py", "--gib", str(gib)], 5)


def torchrun(script_args, nproc=2):
    """A job of `nproc` ranks launched by torchrun as a user starts one (its launcher, its
    TCPStore, one process per GPU)."""
    return ["python3", "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", REPO / "gpu/programs/ddp.py"] + script_args


def ddp(gib):
    """Two-rank DDP training (gpu/programs/ddp.py) over NCCL, each rank also holding `gib`
    GiB of ballast on its GPU: rank 0 prints the progress lines."""
    return Workload(f"DDP 2 ranks, {gib} GiB per GPU", torchrun(["--mode", "ddp", "--mib", str(gib * 1024), "--steps", "1000000000"]), 20)


def hiber_run(agent, job, argv):
    """`hiber run`, with the agent preloaded (hiber's default) or with `--no-agent`."""
    run([HIBER, "run"] + ([] if agent else ["--no-agent"]) + ["--name", job, "--"] + argv)


class Hiber:
    def __init__(self, agent=True, stopping=False, compress=False):
        self.agent = agent
        self.stopping = stopping
        self.compress = compress
        self.name = ("hiber" if agent else "hiber-no-agent") + ("-stop" if stopping else "") + ("-zstd" if compress else "")

    def start(self, w):
        hiber_run(self.agent, "bw", w.argv)
        return json.loads((STATE / "jobs/bw/job.json").read_text())["pid"]

    def log(self, job="bw"):
        try:
            return (STATE / "jobs" / job / "stdout.log").read_text()
        except FileNotFoundError:
            return ""

    def checkpoint(self, pid, img):
        out, rss = run_rss([HIBER, "checkpoint", "bw", "--json"] + ([] if self.stopping else ["--leave-running"]) + (["--compress"] if self.compress else []) + ["--out", img])
        # hiber's own view of the pause, and CRIU's figures of its part of it.
        r = json.loads(out)
        self.figures = {k: r[k] for k in ("paused_seconds", "devices_seconds", "criu_frozen_seconds", "criu_memdump_seconds", "criu_memwrite_seconds") if r.get(k) is not None}
        # Where the pause went, step by step (each engine's quiesce, capture and resume,
        # CRIU's dump).
        for st in r.get("pause_steps") or []:
            self.figures["step_" + st["step"].replace(" ", "_") + "_s"] = st["seconds"]
        if r.get("criu_memory_bytes") is not None:
            self.figures["criu_memory_gib"] = r["criu_memory_bytes"] / (1 << 30)
        # 1 where CRIU wrote into hiber's staging area in memory (--leave-running).
        self.figures["criu_staged"] = 1.0 if r.get("criu_staged") else 0.0
        return rss  # hiber returns once the image is fsync'd and renamed into place

    def kill(self, job="bw"):
        run([HIBER, "rm", "-f", job])

    def restore(self, img, job):
        run([HIBER, "restore", img, "--name", job])
        return job


def cuda_processes(root):
    """`root` and its descendants with a CUDA context: those that map an NVIDIA device
    (`/dev/nvidia0`, `/dev/nvidia-uvm`, ...). Holding only `/dev/nvidiactl` (NVML, as a
    launcher that imports torch does) is no context for the driver to checkpoint."""
    kids = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    tree, todo = [], [root]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += kids.get(p, [])
    def gpu(p):
        try:
            maps = Path(f"/proc/{p}/maps").read_text()
        except OSError:
            return False
        return any(l.split()[-1].startswith("/dev/nvidia") and not l.split()[-1].startswith("/dev/nvidiactl") for l in maps.splitlines() if len(l.split()) >= 6)
    return sorted(p for p in tree if gpu(p))


def gone(pid):
    """Whether `pid` has exited. The ranks of a killed launcher become the bench's orphans
    (it is their subreaper): they are reaped here, else they would stay as zombies."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class Stock:
    name = "stock"
    # How long one step of the stock path may take before it counts as hung (a driver lock
    # waiting on a collective whose peer is already locked, say).
    STEP_LIMIT_S = 120

    def start(self, w):
        self.logf = WORK / "stock.log"
        self.logf.unlink(missing_ok=True)
        # ">>": O_WRONLY|O_APPEND, which CRIU does not size-check on restore.
        with open(self.logf, "ab") as out:
            self.proc = subprocess.Popen([str(a) for a in w.argv], stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, env=ENV)
        self.pid = self.proc.pid
        return self.pid

    def log(self, job=None):
        return self.logf.read_text() if self.logf.exists() else ""

    def checkpoint(self, pid, img):
        """Every CUDA process of the tree locked and checkpointed by the driver, the tree
        dumped, then every one restored and unlocked (also when a step failed, so that the
        job is left as it was where the driver allows)."""
        img.mkdir(parents=True)
        self.cuda_pids = cuda_processes(pid) or [pid]
        rss, done = 0, []
        try:
            for p in self.cuda_pids:
                _, r = run_rss([BUILD / "cuda_ckpt", p, "lock", "checkpoint"], timeout=self.STEP_LIMIT_S)
                done.append(p)
                rss = max(rss, r)
            try:
                _, r = run_rss([CRIU, "dump", "-t", pid, "-D", img, "--leave-running", "--tcp-established", "-o", "dump.log"], timeout=self.STEP_LIMIT_S)
            except RuntimeError as e:
                errors = [l for l in (img / "dump.log").read_text(errors="replace").splitlines() if "Error" in l] if (img / "dump.log").exists() else []
                raise RuntimeError(f"{e}; {' | '.join(errors[-3:])}") from None
            rss = max(rss, r)
        finally:
            for p in done:
                try:
                    _, r = run_rss([BUILD / "cuda_ckpt", p, "restore", "unlock"], timeout=self.STEP_LIMIT_S)
                    rss = max(rss, r)
                except RuntimeError as e:
                    print(f"[stock] process {p} not resumed: {e}", flush=True)
        fsync_tree(img)
        return rss

    def kill(self, job=None):
        # The whole session: a launcher's ranks go with it (a restored tree keeps its
        # session and group).
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGKILL)
        # And each CUDA process by name: on 2xH200 (2026-11-26) a rank the driver could not
        # restore (801) outlived its group's kill and held 32 GiB of GPU 0 through the later
        # samples and the suite after them.
        for p in getattr(self, "cuda_pids", []):
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc is not None:
            self.proc.wait()
            self.proc = None
        else:
            # A tree restored by `criu restore -d` is orphaned when CRIU exits; the bench
            # is a child subreaper, so it is ours to reap, and its PID is free again for
            # the next restore.
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
        wait_for("the process to go", 60, lambda: all(gone(p) for p in [self.pid] + getattr(self, "cuda_pids", [])))

    def restore(self, img, job):
        try:
            run([CRIU, "restore", "-D", img, "-d", "-o", f"restore-{job}.log"])
        except RuntimeError as e:
            errors = [l for l in (img / f"restore-{job}.log").read_text().splitlines() if "Error" in l]
            raise RuntimeError(f"{e}; {' | '.join(errors[-3:])}") from None
        for p in getattr(self, "cuda_pids", [self.pid]):
            run([BUILD / "cuda_ckpt", p, "restore", "unlock"])
        return None


CONTENDERS = {"hiber": lambda: Hiber(agent=True), "hiber-no-agent": lambda: Hiber(agent=False), "hiber-stop": lambda: Hiber(stopping=True), "hiber-zstd": lambda: Hiber(compress=True), "stock": Stock}


def agent_figures(img):
    """From a hiber image's device sections: where the agent's device memory was while the
    job was stopped (GiB copied on the GPU, to host memory, written before the release), the
    time the host staging area took to make ready beforehand, the quiesce-to-release time,
    and the device memory left to the driver's checkpoint (what NVML still counted for the
    processes then: the CUDA contexts' own, and what the agent passed through, also given
    apart), which goes through host memory and CRIU's dump inside the pause."""
    try:
        m = json.loads((img / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    out = {}
    for d in m.get("devices", []):
        s = d["state"]
        if d["engine"] == "agent":
            p = s.get("placed", {})
            out.update({"agent_device_gib": p.get("device", 0) / (1 << 30), "agent_host_gib": p.get("host", 0) / (1 << 30), "agent_direct_gib": p.get("direct", 0) / (1 << 30),
                        "agent_unchanged_gib": p.get("unchanged", 0) / (1 << 30), "agent_zeros_gib": p.get("zeros", 0) / (1 << 30), "agent_staging_s": s.get("staging_seconds", 0.0),
                        "agent_quiesce_s": s["quiesce_seconds"],
                        "agent_passthrough_gib": sum(q.get("passthrough", {}).get("bytes", 0) for q in s.get("processes", [])) / (1 << 30)})
            kinds = [f"{q.get('comm')}: " + ", ".join(f"{n} {k}" for k, n in q.get("passthrough", {}).get("kinds", {}).items()) for q in s.get("processes", []) if q.get("passthrough", {}).get("calls")]
            if kinds:
                print(f"[figures] passed through by the agent: {'; '.join(kinds)}", flush=True)
        elif d["engine"] == "cuda":
            out["driver_gib"] = sum(q.get("memory_bytes", 0) for q in s.get("processes", [])) / (1 << 30)
            out["driver_checkpoint_s"] = s.get("checkpoint_seconds", 0.0)
    return out


def gpu_used_mib():
    """Device memory in use on each GPU (NVML), or [] where nvidia-smi does not answer."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
        return [int(v) for v in q.split()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return []


# A GPU holding more than this before a sample still holds an earlier sample's job (a killed
# process's memory is freed after it is gone, and a job the stock path left broken may hold
# it longer): such a sample would measure hiber on a GPU without room for a copy.
IDLE_GPU_MIB = 2048


def one_sample(contender, w, rep, cold=True):
    img = WORK / "img"
    shutil.rmtree(img, ignore_errors=True)
    try:
        wait_for("the GPUs to be free of earlier samples' jobs", 60, lambda: max(gpu_used_mib(), default=0) <= IDLE_GPU_MIB)
    except RuntimeError:
        print(f"[warn] {w.name} {contender.name} rep {rep}: GPUs still hold {gpu_used_mib()} MiB; measured so (recorded as gpu_used_before_mib)", flush=True)
    used_before = max(gpu_used_mib(), default=0)
    pid = contender.start(w)
    try:
        def started():
            # A job that died on its way up (out of device memory, say) fails the sample now,
            # with its last words, rather than after the whole wait.
            if not Path(f"/proc/{pid}").exists():
                raise RuntimeError(f"{w.name} ended before it made progress: " + " | ".join(contender.log().strip().splitlines()[-3:]))
            return (parse_progress(contender.log()) or [(-1, 0)])[-1][0] >= w.ready_step

        wait_for(f"{w.name} to make progress", 300, started)
        t0 = now_ms()
        rss = contender.checkpoint(pid, img)
        t1 = now_ms()
        stopping = getattr(contender, "stopping", False)
        if not stopping:
            wait_for("progress after the checkpoint", 120, lambda: first_progress_after(parse_progress(contender.log()), t1))
        prog = parse_progress(contender.log())
        # The step the checkpoint caught: the last one logged before it began. A restored
        # copy resumes just after it (not where the original is now, which with a long
        # image write after --leave-running can be hundreds of steps later).
        at_step = max((p.step for p in prog if p.t_ms <= t0), default=prog[-1].step)
        sample = {
            # A stopping checkpoint's job is stopped until a restore makes progress: its
            # downtime is completed below.
            "downtime_s": (t1 - prog[-1].t_ms) / 1000 if stopping else downtime_ms(prog, t0, t1) / 1000,
            "typical_step_s": typical_gap_ms(prog, t0) / 1000,
            "durable_s": (t1 - t0) / 1000,
            "image_gib": du(img) / (1 << 30),
            "ckpt_maxrss_gib": rss / (1 << 30),
            "gpu_used_before_mib": used_before,
        }
        sample.update(agent_figures(img))
        sample.update(getattr(contender, "figures", {}))
        if not stopping:
            contender.kill()
        for kind in ("warm", "cold") if cold else ("warm",):
            job = f"bw-{kind}"
            if kind == "cold":
                drop_caches()
            t2 = now_ms()
            restored = contender.restore(img, job)
            t3 = wait_for("progress after the restore", 300, lambda: first_progress_after(parse_progress(contender.log(restored)), t2, min_step=at_step - 50))
            sample[f"restore_{kind}_s"] = (t3 - t2) / 1000
            if stopping and kind == "warm":
                sample["downtime_s"] += (t3 - t2) / 1000
            contender.kill(restored)
        return sample
    finally:
        try:
            contender.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
        shutil.rmtree(img, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)


def incremental_sample(static_gib, data_gib, reserve_gib=0, fingerprints=True):
    """Two --leave-running checkpoints of one job whose STATIC GiB never change (a model's
    weights) while its DATA GiB change every step; the second image takes the first as its
    parent (hiber's default for a job's next checkpoint). Then the second image restores
    from page cache, with the first removed, until the job makes progress. RESERVE GiB more
    of zeroed device memory fill the GPU, so that hiber's copies go to host memory. Without
    `fingerprints` (HIBER_GPU_FINGERPRINT=0, hiber before them) unchanged chunks are found
    by copying every chunk to the host and hashing it."""
    argv = [BUILD / "counter", "--mib", str(data_gib * 1024), "--static-mib", str(static_gib * 1024), "--steps", "1000000000", "--interval-ms", "10"]
    if reserve_gib:
        argv += ["--reserve-mib", str(reserve_gib * 1024)]
    env = ENV if fingerprints else dict(ENV, HIBER_GPU_FINGERPRINT="0")
    h = Hiber()
    imgs = [WORK / "inc1", WORK / "inc2"]
    for i in imgs:
        shutil.rmtree(i, ignore_errors=True)
    h.start(Workload("inc", argv, 20))
    try:
        wait_for("the job to make progress", 300, lambda: (parse_progress(h.log()) or [(-1, 0)])[-1][0] >= 20)
        out, times = [], []
        for img in imgs:
            t0 = now_ms()
            r, rss = run_rss([HIBER, "checkpoint", "bw", "--leave-running", "--out", img, "--json"], env=env)
            t1 = now_ms()
            out.append((json.loads(r), rss))
            times.append((t0, t1))
            wait_for("progress after the checkpoint", 120, lambda: first_progress_after(parse_progress(h.log()), t1))
            at = parse_progress(h.log())[-1].step
            wait_for("20 more steps", 120, lambda: parse_progress(h.log())[-1].step >= at + 20)
        prog = parse_progress(h.log())
        (r1, rss1), (r2, rss2) = out
        sample = {
            "first_gib": r1["image_bytes"] / (1 << 30),
            "first_durable_s": (times[0][1] - times[0][0]) / 1000,
            "first_downtime_s": downtime_ms(prog, *times[0]) / 1000,
            "second_written_gib": (r2["image_bytes"] - r2["shared_bytes"]) / (1 << 30),
            "second_shared_gib": r2["shared_bytes"] / (1 << 30),
            "second_durable_s": (times[1][1] - times[1][0]) / 1000,
            "second_downtime_s": downtime_ms(prog, *times[1]) / 1000,
            "ckpt_maxrss_gib": max(rss1, rss2) / (1 << 30),
        }
        # Where the second checkpoint's device memory was while the job was stopped, and
        # how much of it was found unchanged on the GPU.
        sample.update({f"second_{k}": v for k, v in agent_figures(imgs[1]).items()})
        h.kill()
        shutil.rmtree(imgs[0])
        t2 = now_ms()
        h.restore(imgs[1], "inc-copy")
        wait_for("progress after the restore", 300, lambda: first_progress_after(parse_progress(h.log("inc-copy")), t2))
        sample["second_restore_warm_s"] = (first_progress_after(parse_progress(h.log("inc-copy")), t2) - t2) / 1000
        h.kill("inc-copy")
        return sample
    finally:
        for job in ("bw", "inc-copy"):
            try:
                h.kill(job)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for i in imgs:
            shutil.rmtree(i, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)


def periodic_sample(gib, batch, every, steps, with_checkpoints):
    """PyTorch training (train_big.py, GIB GiB of weights and optimizer state, BATCH rows per
    step) run for STEPS steps as a job, with `hiber checkpoint --leave-running` every EVERY
    steps or without; returns its throughput (steps per second after 20 steps of warm-up,
    by its own clock), the median step time without the sleep, the checkpoints' count and
    median time. Each checkpoint's image replaces the one before (a job's next checkpoint
    takes its latest image as parent, then that one is removed)."""
    argv = ["python3", REPO / "bench/programs/train_big.py", "--gib", str(gib), "--batch", str(batch), "--steps", str(steps), "--interval-ms", "0"]
    hiber_run(True, "pd", argv)
    d = STATE / "jobs" / "pd"
    log = lambda: (d / "stdout.log").read_text() if (d / "stdout.log").exists() else ""  # noqa: E731
    took, kept, n = [], None, 0
    try:
        next_at = every
        while not (d / "exit.json").exists():
            prog = parse_progress(log())
            if with_checkpoints and prog and prog[-1].step >= next_at and prog[-1].step < steps - 1:
                img = WORK / f"per{n}"
                t = time.time()
                run([HIBER, "checkpoint", "pd", "--leave-running", "--out", img])
                took.append(time.time() - t)
                n += 1
                if kept is not None:
                    shutil.rmtree(kept, ignore_errors=True)
                kept = img
                # The next one is due EVERY steps after this one was taken.
                next_at = parse_progress(log())[-1].step + every
            time.sleep(0.05)
        text = log()
        if "done" not in text.splitlines():
            raise RuntimeError(f"train_big ended without `done`: {(d / 'exit.json').read_text().strip()} {text[-300:]}")
        prog = parse_progress(text)
        return {"steps_per_s": throughput(prog, 20), "step_ms": run_median(parse_timings(text, "step", "step_ms"), 20), "checkpoints": n,
                "checkpoint_s": statistics.median(took) if took else None}
    finally:
        try:
            run([HIBER, "rm", "-f", "pd"])
        except RuntimeError:
            pass
        if kept is not None:
            shutil.rmtree(kept, ignore_errors=True)


class OverheadBenchmark:
    """A program run to its end as a hiber job; `figure` turns its log into one number."""

    def __init__(self, name, unit, argv, done, figure):
        self.name, self.unit, self.argv, self.done, self.figure = name, unit, argv, done, figure

    def measure(self, agent):
        job = "ov"
        hiber_run(agent, job, self.argv)
        d = STATE / "jobs" / job
        try:
            # The shim writes exit.json once the job's root has exited: its log is complete.
            wait_for(f"{self.name} to finish", 300, lambda: (d / "exit.json").exists())
            log = (d / "stdout.log").read_text()
            if self.done not in log.splitlines():
                tail = (log + (d / "stderr.log").read_text()).strip()[-600:]
                raise RuntimeError(f"{self.name} ended ({(d / 'exit.json').read_text().strip()}) without `{self.done}`: {tail}")
            v = self.figure(log)
            if v is None:
                raise RuntimeError(f"{self.name} printed no timing after warm-up")
            return v
        finally:
            try:
                run([HIBER, "rm", "-f", job])
            except RuntimeError:
                pass


# Runs of the overhead benchmarks, and how much of each is warm-up (lazy module loading,
# the allocators' first growth) left out of its median.
MICRO_BLOCKS, MICRO_WARMUP = 40, 5
TORCH_STEPS, TORCH_WARMUP = 200, 20
# The two DDP steps: the suite's small model (a launch-bound step of about 1.5 ms, where the
# agent's cost per NCCL call shows the most) and a 120M-parameter MLP (a compute-bound step
# of about 20 ms, as in training). Each rank is pinned to CPUs of its own: unpinned, runs
# without the agent alone were 29% apart. Steps, warm-up, steps per window.
DDP_SMALL = (3000, 200, 200)
DDP_MLP = (400, 50, 25)
DDP_PIN_CPUS = 4


def ddp_ms_per_step(steps_warmup_window):
    """Rank 0's ms per step after warm-up: the median over windows of steps, by its own
    clock (a hiccup moves one window, not the figure; whole-millisecond stamps are too
    coarse for one small step)."""
    _, warmup, window = steps_warmup_window
    return lambda log: windowed_ms_per_step(parse_progress(log), warmup, window)


def overhead_benchmarks(pytorch_gib, which):
    out = []
    if "micro" in which:
        out.append(OverheadBenchmark(MICRO, "ms per block", [BUILD / "microbench", "--blocks", str(MICRO_BLOCKS)], "verify ok",
                                     lambda log: run_median(parse_timings(log, "block", "ms"), MICRO_WARMUP)))
    if "pytorch" in which and pytorch_gib:
        out.append(OverheadBenchmark(f"PyTorch {pytorch_gib} GiB step", "ms per step",
                                     ["python3", REPO / "bench/programs/train_big.py", "--gib", str(pytorch_gib), "--steps", str(TORCH_STEPS), "--interval-ms", "0"], "done",
                                     lambda log: run_median(parse_timings(log, "step", "step_ms"), TORCH_WARMUP)))
    if "ddp" in which:
        # Every NCCL call of the job passes through the agent.
        pin = ["--interval-ms", "0", "--pin-cpus", str(DDP_PIN_CPUS)]
        out.append(OverheadBenchmark(DDP_SMALL_STEP, "ms per step", torchrun(["--mode", "ddp", "--steps", str(DDP_SMALL[0])] + pin),
                                     "verify ok ranks agree", ddp_ms_per_step(DDP_SMALL)))
        mlp = ["--hidden", "4096", "--layers", "8", "--batch", "1024"]
        out.append(OverheadBenchmark(DDP_MLP_STEP, "ms per step", torchrun(["--mode", "ddp", "--steps", str(DDP_MLP[0])] + mlp + pin),
                                     "verify ok ranks agree", ddp_ms_per_step(DDP_MLP)))
    return out


def measure_overhead(reps, pytorch_gib, result, save, which=("micro", "pytorch")):
    """Each benchmark `reps` times with the agent and `reps` times without, interleaved
    (which side goes first alternates), into result["overhead"]; each rep's two runs, back
    to back, are also kept as a pair ([with, without])."""
    for b in overhead_benchmarks(pytorch_gib, which):
        entry = {"benchmark": b.name, "unit": b.unit, "samples": {"hiber": [], "hiber-no-agent": []}, "pairs": []}
        result["overhead"].append(entry)
        for rep in range(reps):
            pair = {}
            for agent in ((True, False) if rep % 2 == 0 else (False, True)):
                side = "hiber" if agent else "hiber-no-agent"
                try:
                    v = b.measure(agent)
                except Exception as e:  # noqa: BLE001 - a failed run is recorded, not fatal
                    result["errors"].append({"workload": b.name, "contender": side, "rep": rep, "error": str(e)[-800:]})
                    print(f"[error] {b.name} {side} rep {rep}: {e}", flush=True)
                    save()
                    continue
                entry["samples"][side].append(round(v, 4))
                pair[side] = round(v, 4)
                print(f"{b.name:>24} {side:>14} rep {rep}: {v:.3f} {b.unit}", flush=True)
            if len(pair) == 2:
                entry["pairs"].append([pair["hiber"], pair["hiber-no-agent"]])
            save()
        shutil.rmtree(STATE, ignore_errors=True)


def ceilings():
    """Pinned host<->device copy bandwidth, and the image disk's write and read bandwidth."""
    code = r"""
import torch, json
n = 4 << 30
h = torch.empty(n, dtype=torch.uint8, pin_memory=True); d = torch.empty(n, dtype=torch.uint8, device="cuda")
h.fill_(7); d.copy_(h); torch.cuda.synchronize()
def bw(dst, src):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        s.record(); dst.copy_(src, non_blocking=True); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) / 1000)
    return n / sorted(ts)[2] / 1e9
print(json.dumps({"pinned_h2d_GBps": bw(d, h), "pinned_d2h_GBps": bw(h, d)}))
"""
    out = json.loads(run(["python3", "-c", code]).strip().splitlines()[-1])
    f = WORK / "ddtest"
    size = 8 << 30
    t = time.time()
    run(["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={size >> 24}", "conv=fdatasync"])
    out["disk_write_GBps"] = size / (time.time() - t) / 1e9
    drop_caches()
    t = time.time()
    run(["dd", f"if={f}", "of=/dev/null", "bs=16M"])
    out["disk_read_GBps"] = size / (time.time() - t) / 1e9
    f.unlink()
    return {k: round(v, 2) for k, v in out.items()}


def machine():
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    df = subprocess.run(["df", "-h", str(WORK)], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpu": q, "kernel": os.uname().release, "commit": carried_commit(CARRY), "disk": df, "cpus": os.cpu_count()}


def merge_entries(runs, key):
    """Entries of `key` ("incremental", "periodic") of several runs, merged by workload."""
    out = {}
    for r in runs:
        for e in r.get(key, []):
            m = out.setdefault(e["workload"], {k: v for k, v in e.items() if k not in ("samples", "details")} | {"samples": {}})
            for k, v in e["samples"].items():
                m["samples"].setdefault(k, []).extend(v)
    return list(out.values())


def report(paths):
    runs = [json.loads(Path(p).read_text()) for p in paths]
    rows = merge_rows(runs)
    counts = sorted({len(r["samples"].get("downtime_s", [])) for r in rows})
    lines = [
        f"Medians with min–max over the repetitions ({'/'.join(map(str, counts)) or 'none'} per row). Downtime: the longest gap in the workload's own progress",
        "timestamps around a `--leave-running` checkpoint (its normal step takes 0.01–0.04 s). Image durable: until",
        "the image is fsync'd (hiber: its command returns; stock: driver + `criu dump` + fsync). Restore: until the",
        "workload prints progress again. Checkpointer peak RSS: of hiber and CRIU (stock: of CRIU and the driver client).",
        "",
        table(rows),
        "",
    ]
    for c in [c for c in dict.fromkeys(r["contender"] for r in rows) if c != "stock"]:
        for w, x in ratios(rows, other=c).items():
            lines.append(f"- {w}: stock downtime / {c} downtime = {x:.2f}")
    lines.append("")
    lines.append("Image durable bandwidth: image bytes / seconds until durable, and that against the disk write ceiling of")
    lines.append("the sample's own run (medians):")
    lines.append("")
    rates = durable_rates(runs)
    for r in rows:
        d = rates.get((r["workload"], r["contender"]), {"GBps": [], "fraction": []})
        g, f = summary(d["GBps"]), summary(d["fraction"])
        if g:
            lines.append(f"- {r['workload']}, {r['contender']}: {g['median']:.2f} GB/s" + (f", {f['median'] * 100:.0f}% of the disk's write bandwidth" if f else ""))
    lines.append("")
    entries = merge_overhead(runs)
    lines.append("Agent overhead while not checkpointing: each program run to its end under `hiber run` (with the agent) and")
    lines.append("`hiber run --no-agent`, interleaved; per run, the median of the program's own block times (microbenchmark,")
    lines.append(f"after {MICRO_WARMUP} of {MICRO_BLOCKS} blocks) or step times (PyTorch, after {TORCH_WARMUP} of {TORCH_STEPS} steps); medians with min–max over the runs.")
    if any(e["benchmark"].startswith("DDP 2 ranks step,") for e in entries):
        lines.append(f"DDP steps: each rank pinned to {DDP_PIN_CPUS} CPUs of its own; per run, rank 0's median over windows of steps after warm-up")
        lines.append(f"(small model: {DDP_SMALL[0]} steps, windows of {DDP_SMALL[2]} after {DDP_SMALL[1]}; MLP: {DDP_MLP[0]}, windows of {DDP_MLP[2]} after {DDP_MLP[1]}).")
        lines.append("Where runs were paired back to back, the overhead is the median over the pairs of with/without - 1, with the")
        lines.append("sign test's interval for that median (distribution-free; its coverage is given).")
    lines.append("")
    lines.append(overhead_table(entries) if entries else "Not measured in these runs.")
    lines.append("")
    lines.append("Targets:")
    lines.append("")
    lines.append(targets_table(evaluate_targets(runs)))
    lines.append("")
    inc = merge_entries(runs, "incremental")
    if inc:
        lines.append("Incremental images: two `--leave-running` checkpoints of one job, the second with the first as parent")
        lines.append("(medians, min–max):")
        lines.append("")
        keys = ["first_gib", "first_durable_s", "first_downtime_s", "second_written_gib", "second_shared_gib", "second_durable_s", "second_downtime_s",
                "second_restore_warm_s", "ckpt_maxrss_gib"]
        lines.append("| workload | " + " | ".join(keys) + " |")
        lines.append("|---|" + "---|" * len(keys))
        for e in inc:
            lines.append(f"| {e['workload']} | " + " | ".join(fmt(summary(e["samples"].get(k, [])), "") for k in keys) + " |")
        lines.append("")
        lines.append(targets_table(incremental_targets(inc)))
        lines.append("")
    per = merge_entries(runs, "periodic")
    if per:
        lines.append("Training with a `--leave-running` checkpoint every N steps, against none (steps per second after warm-up):")
        lines.append("")
        lines.append("| workload | every | without | with |")
        lines.append("|---|---|---|---|")
        for e in per:
            lines.append(f"| {e['workload']} | {e['every']} | {fmt(summary(e['samples']['without']), '')} | {fmt(summary(e['samples']['with']), '')} |")
        lines.append("")
        lines.append(targets_table(periodic_targets(per)))
        lines.append("")
    for title, targets in (("Targets for a two-rank DDP job (#11):", ddp_targets(runs)), ("Targets on a full GPU:", full_gpu_targets(runs))):
        if targets:
            lines += [title, "", targets_table(targets), ""]
    lines.append("Runs (each measured its own ceilings):")
    lines.append("")
    for p, run_ in zip(paths, runs):
        m, c = run_["machine"], run_["ceilings"]
        lines.append(
            f"- `{Path(p).name}`, {m['date']}: {m['gpu']}, hiber {m['commit']}, {m['cpus']} CPUs; "
            f"pinned H2D {c['pinned_h2d_GBps']} GB/s, D2H {c['pinned_d2h_GBps']} GB/s, disk write {c['disk_write_GBps']} GB/s, read {c['disk_read_GBps']} GB/s"
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,4,16,32")
    ap.add_argument("--full", default="", help="DATA:RESERVE GiB pairs, comma-separated: counters that fill the GPU (e.g. 47:21 on an H100)")
    ap.add_argument("--no-cold", action="store_true", help="restore from page cache only (saves a disk-bound restore per sample)")
    ap.add_argument("--incremental", default="", help="STATIC:DATA[:RESERVE] GiB, comma-separated: two checkpoints of a job whose STATIC GiB never change, "
                    "RESERVE GiB more filling the GPU (reps samples per mode)")
    ap.add_argument("--incremental-modes", default="gpu", help="comma-separated, of: gpu (fingerprints on the GPU), copy (every chunk copied and hashed, "
                    "HIBER_GPU_FINGERPRINT=0), alternated within each repetition")
    ap.add_argument("--periodic", default="", help="GIB:BATCH:EVERY:STEPS: PyTorch throughput with a checkpoint every EVERY steps, against none (reps pairs)")
    ap.add_argument("--pytorch-gib", type=int, default=8, help="0 to skip")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--contenders", default="hiber,stock", help=f"comma-separated, of: {', '.join(CONTENDERS)}")
    ap.add_argument("--overhead-reps", type=int, default=0, help="agent-overhead runs per side and benchmark; 0 to skip")
    ap.add_argument("--overhead-pytorch-gib", type=int, default=8, help="the PyTorch overhead benchmark's size; 0 to skip it")
    ap.add_argument("--overhead-benchmarks", default="micro,pytorch", help="comma-separated, of: micro, pytorch, ddp (two GPUs)")
    ap.add_argument("--ddp", type=int, default=0, help="GiB of ballast per GPU of a two-rank DDP job launched by torchrun (two GPUs); 0 to skip")
    ap.add_argument("--report", nargs="*")
    a = ap.parse_args()
    if a.report is not None:
        print(report(a.report))
        return 0
    names = [c for c in a.contenders.split(",") if c]
    unknown = [c for c in names if c not in CONTENDERS]
    if unknown or not names:
        ap.error(f"--contenders: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(CONTENDERS)}")
    # PR_SET_CHILD_SUBREAPER: orphans of the stock path's `criu restore -d` come to us.
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    out = Path(os.environ.get("OUT") or "/tmp/hiber-bench-out")
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(WORK, ignore_errors=True)
    BUILD.mkdir(parents=True)
    cuda_inc = "/usr/local/cuda/include"
    run(["nvcc", "-O2", "-o", BUILD / "counter", REPO / "gpu/programs/counter.cu"])
    run(["gcc", "-O2", "-I", cuda_inc, REPO / "bench/stock/cuda_ckpt.c", "-o", BUILD / "cuda_ckpt", "-ldl"])
    if a.overhead_reps:
        run(["nvcc", "-O2", "-o", BUILD / "microbench", REPO / "bench/programs/microbench.cu"])
    result = {"machine": machine(), "ceilings": ceilings(), "rows": [], "overhead": [], "incremental": [], "periodic": [], "errors": []}
    print(json.dumps(result["machine"]), json.dumps(result["ceilings"]), flush=True)

    def save():
        (out / f"bench-{a.tag}.json").write_text(json.dumps(result, indent=1))

    if a.overhead_reps:
        measure_overhead(a.overhead_reps, a.overhead_pytorch_gib, result, save, a.overhead_benchmarks.split(","))
    modes = [m for m in a.incremental_modes.split(",") if m]
    if any(m not in ("gpu", "copy") for m in modes) or not modes:
        ap.error(f"--incremental-modes: {a.incremental_modes}; choose from gpu, copy")
    for spec in [x for x in a.incremental.split(",") if x]:
        static, data, reserve = (list(map(int, spec.split(":"))) + [0])[:3]
        name = f"{static} GiB unchanged, {data} GiB changing" + (f", {reserve} GiB reserved" if reserve else "")
        entries = {m: {"workload": name + ("" if m == "gpu" else " (copy and hash)"), "samples": {}} for m in modes}
        result["incremental"] += entries.values()
        for rep in range(a.reps):
            for m in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                entry = entries[m]
                try:
                    s = incremental_sample(static, data, reserve, fingerprints=m == "gpu")
                except Exception as e:  # noqa: BLE001 - a failed sample is recorded, not fatal
                    result["errors"].append({"workload": entry["workload"], "contender": "hiber", "rep": rep, "error": str(e)[-800:]})
                    print(f"[error] {entry['workload']} rep {rep}: {e}", flush=True)
                    save()
                    continue
                for k, v in s.items():
                    entry["samples"].setdefault(k, []).append(round(v, 3))
                print(f"{entry['workload']} rep {rep}: " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()), flush=True)
                save()
    if a.periodic:
        gib, batch, every, steps = map(int, a.periodic.split(":"))
        entry = {"workload": f"PyTorch {gib} GiB, batch {batch}", "every": every, "steps": steps, "samples": {"with": [], "without": []}, "details": []}
        result["periodic"].append(entry)
        for rep in range(a.reps):
            for with_ in ((False, True) if rep % 2 == 0 else (True, False)):
                side = "with" if with_ else "without"
                try:
                    s = periodic_sample(gib, batch, every, steps, with_)
                except Exception as e:  # noqa: BLE001 - a failed sample is recorded, not fatal
                    result["errors"].append({"workload": entry["workload"], "contender": side, "rep": rep, "error": str(e)[-800:]})
                    print(f"[error] {entry['workload']} {side} rep {rep}: {e}", flush=True)
                    save()
                    continue
                entry["samples"][side].append(round(s["steps_per_s"], 4))
                entry["details"].append(dict(s, side=side, rep=rep))
                print(f"{entry['workload']} {side} checkpoints rep {rep}: {s}", flush=True)
                save()
    full = [tuple(map(int, f.split(":"))) for f in a.full.split(",") if f]
    workloads = [counter(int(s)) for s in a.sizes.split(",") if s] + [counter(d, r) for d, r in full] + ([pytorch(a.pytorch_gib)] if a.pytorch_gib else [])
    workloads += [ddp(a.ddp)] if a.ddp else []
    for w in workloads:
        rows = {n: {"workload": w.name, "contender": n, "samples": {}} for n in names}
        # In the result from the start and saved after every sample, so that a call cut off by
        # the GPU machine's time limit still brings back the samples it took.
        result["rows"] += [rows[n] for n in names]
        failed = set()
        for rep in range(a.reps):
            # Which contender goes first rotates with the repetition.
            first = rep % len(names)
            for c in [CONTENDERS[n]() for n in names[first:] + names[:first]]:
                if c.name in failed:
                    # It could not do this workload once: its error is recorded, and the
                    # repetitions would only spend GPU time failing again.
                    continue
                try:
                    s = one_sample(c, w, rep, cold=not a.no_cold)
                except Exception as e:  # noqa: BLE001 - a failed sample is recorded, not fatal
                    result["errors"].append({"workload": w.name, "contender": c.name, "rep": rep, "error": str(e)[-800:]})
                    print(f"[error] {w.name} {c.name} rep {rep}: {e}", flush=True)
                    failed.add(c.name)
                    save()
                    continue
                for k, v in s.items():
                    rows[c.name]["samples"].setdefault(k, []).append(round(v, 3))
                print(f"{w.name:>16} {c.name:>14} rep {rep}: " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()), flush=True)
                save()
    save()
    print()
    print(table(result["rows"]))
    if result["overhead"]:
        print()
        print(overhead_table(result["overhead"]))
    print(json.dumps(result["ceilings"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
