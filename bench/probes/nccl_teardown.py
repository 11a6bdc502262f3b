"""Where a two-rank DDP job's NCCL teardown spends its time in a `--leave-running` checkpoint.

A DDP job (gpu/programs/ddp.py under torchrun, with the agent) is checkpointed a few
times. For each checkpoint it prints hiber's own figures (the NCCL cut's hold, drain and
teardown, from its log) and the job's longest step gap; NCCL's timestamped log
(NCCL_DEBUG=INFO, INIT and PROXY) shows each communicator's abort and each proxy thread's
exit. The job must still end with `verify ok`.

Its run of 2026-11-25 (results/2026-11-25-h200x2-nccl-teardown.txt) compared the agent
waking NCCL's UDS proxy threads with a datagram (since removed) against not waking them.
Since then the agent wakes every NCCL proxy thread's poll through its own `poll`
(crates/hiber-agent/src/poll.rs); `--wake both` runs one job with it and one with
`HIBER_NCCL_WAKE=0`, which turns it off.

Usage on a two-GPU machine, from the repository root with .carry/ (scripts/gpu-carry.sh):
    python3 bench/probes/nccl_teardown.py [--checkpoints 3] [--wake on|off|both] [--out DIR]
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
sys.path.insert(0, str(REPO / "bench"))
from benchlib import parse_progress  # noqa: E402

HIBER = str(REPO / ".carry/bin/hiber")
STATE = Path("/tmp/hiber-probe-teardown")
ENV = dict(os.environ, HIBER_STATE=str(STATE), HIBER_CRIU=str(REPO / ".carry/bin/criu"), NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")


def hiber(*args, env=None):
    return subprocess.run([HIBER, *args], env=env or ENV, capture_output=True, text=True, timeout=300)


def steps(job):
    log = STATE / "jobs" / job / "stdout.log"
    return parse_progress(log.read_text()) if log.exists() else []


def wait(what, secs, cond):
    end = time.time() + secs
    while time.time() < end:
        if cond():
            return
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


def one_job(checkpoints, out, wake):
    job = f"td-{wake}"
    nccl_log = out / f"nccl-{wake}"
    nccl_log.mkdir(parents=True, exist_ok=True)
    job_env = [f"HIBER_NCCL_WAKE={1 if wake == 'on' else 0}", "NCCL_DEBUG=INFO", "NCCL_DEBUG_SUBSYS=INIT,PROXY", "NCCL_DEBUG_TIMESTAMP_LEVELS=INFO",
               "NCCL_DEBUG_TIMESTAMP_FORMAT=[%T.%6f] ", f"NCCL_DEBUG_FILE={nccl_log}/%p.log", f"HIBER_AGENT_LOG={out}/agent-{wake}.log"]
    argv = ["env", *job_env, "python3", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "gpu/programs/ddp.py"),
            "--mode", "ddp", "--steps", "3000", "--interval-ms", "10"]
    p = hiber("run", "--name", job, "--", *argv)
    assert p.returncode == 0, p.stderr
    wait("step 100", 180, lambda: len(steps(job)) > 100)
    rows = []
    for i in range(checkpoints):
        before = len(steps(job))
        img = Path(f"/tmp/hiber-probe-img-{i}")
        shutil.rmtree(img, ignore_errors=True)
        t0 = time.time()
        p = hiber("checkpoint", job, "--leave-running", "--out", str(img), "--json", env=dict(ENV, HIBER_LOG="hiber_core=info"))
        took = time.time() - t0
        # hiber's log may be coloured: the escapes go before the fields are read.
        text = re.sub(r"\x1b\[[0-9;]*m", "", p.stderr)
        cut = next((l for l in text.splitlines() if "NCCL work cut and torn down" in l), "")
        figures = {k: float(v) for k, v in re.findall(r"(hold_s|drain_s|down_s)=([0-9.e-]+)", cut)}
        wait("steps after the checkpoint", 60, lambda: len(steps(job)) > before + 40)
        prog = steps(job)
        gap = max((b.t_ms - a.t_ms for a, b in zip(prog[before - 5:], prog[before - 4:])), default=None)
        rows.append({"wake": wake, "checkpoint": i, "rc": p.returncode, "seconds": round(took, 2), **figures, "longest_step_gap_ms": gap})
        if p.returncode != 0:
            rows[-1]["error"] = p.stderr.strip()[-600:]
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(img, ignore_errors=True)
        time.sleep(2)
    wait(f"{job} to end", 240, lambda: (STATE / "jobs" / job / "exit.json").exists())
    log = (STATE / "jobs" / job / "stdout.log").read_text()
    verified = "verify ok ranks agree" in log.splitlines()
    print(json.dumps({"wake": wake, "job_verified": verified, "exit": (STATE / "jobs" / job / "exit.json").read_text().strip()}), flush=True)
    hiber("rm", "-f", job)
    # NCCL's account of each teardown: the aborts, and the proxy threads' exits.
    keep = re.compile(r"Abort|Destroy|exit|Service thread|UDS|commReclaim|Proxy Progress")
    with open(out / f"nccl-teardown-{wake}.txt", "w") as f:
        for path in sorted(nccl_log.glob("*.log")):
            for line in path.read_text(errors="replace").splitlines():
                if keep.search(line):
                    f.write(f"{path.stem}: {line}\n")
    shutil.rmtree(nccl_log, ignore_errors=True)
    return rows, verified


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--wake", choices=["on", "off", "both"], default="both")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/hiber-probe-out"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ok = True
    for wake in (["off", "on"] if a.wake == "both" else [a.wake]):
        shutil.rmtree(STATE, ignore_errors=True)
        _, verified = one_job(a.checkpoints, out, wake)
        ok = ok and verified
    shutil.rmtree(STATE, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
