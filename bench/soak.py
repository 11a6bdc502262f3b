#!/usr/bin/env python3
"""Soak: one job checkpointed and restored again and again; does anything grow?

A job is started with `hiber run`, then for each cycle, once it has made a few steps:
checkpoint it, stopping (even cycles) or with --leave-running (odd cycles, the original
then removed with `hiber rm -f`), and restore the image as the next job of the chain. Each
image is removed once the next one exists. At the end the last copy runs to its end.

Every progress line (`step N checksum X t MS`, benchlib.parse_progress) of every copy is
checked against an uninterrupted run of the same command: each copy goes on from the step
after its image's last one (at or before the last step its original printed), with the same checksum at every step (the CPU workload's checksum
folds in every word a step touches).

Per cycle it records the wall time of the checkpoint and of the restore (each a `hiber`
process; its peak RSS from wait4), the image's size, the job's RSS after the restore, and
the size of hiber's state directory (jobs, journals, CRIU's logs). The summary compares
the first and the last tenth of the cycles: a ratio far above 1 is growth.

    bench/soak.py --cycles 1000                     # the CPU workload (64 MiB)
    bench/soak.py --cycles 20 --gpu                 # PyTorch training on the GPU
    bench/soak.py --cycles 20 --cmd 'python3 x.py'  # any program printing progress lines

The result goes to --out as JSON (bench/results/), with the machine and the commit.
"""
import argparse
import datetime
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hiber_bin():
    for p in (os.environ.get("HIBER"), os.path.join(REPO, "target/release/hiber"), os.path.join(REPO, "target/debug/hiber")):
        if p and os.access(p, os.X_OK):
            return p
    sys.exit("soak: no hiber binary (build it: cargo build --release -p hiber)")


def run_hiber(hiber, args, env):
    """Runs hiber; returns (wall seconds, its peak RSS in KiB, stdout). Fails loudly."""
    start = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as err:
        p = subprocess.Popen([hiber] + args, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        out = p.stdout.read()
        # wait4, not wait: the process's own rusage, peak RSS included.
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
        if p.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"hiber {' '.join(args)} failed ({p.returncode}): {err.read().strip()}")
    return wall, usage.ru_maxrss, out


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def rss_kib(pid):
    """Resident memory of a job's whole tree (its root and descendants), KiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(l.split()[1]) for l in f if l.startswith("VmRSS:")), 0)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return total


def job_pid(state, name):
    with open(os.path.join(state, "jobs", name, "job.json")) as f:
        return json.load(f)["pid"]


def tenth_ratio(rows, key):
    n = max(1, len(rows) // 10)
    first = statistics.median(r[key] for r in rows[:n])
    last = statistics.median(r[key] for r in rows[-n:])
    return {"first_tenth_median": first, "last_tenth_median": last, "ratio": (last / first) if first else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--steps-per-cycle", type=int, default=3, help="steps each copy makes before its checkpoint")
    ap.add_argument("--gpu", action="store_true", help="PyTorch training (gpu/programs/train.py) instead of the CPU workload")
    ap.add_argument("--cmd", help="the job's command (prints progress lines; takes --steps N and --interval-ms MS)")
    ap.add_argument("--interval-ms", type=int, default=10)
    ap.add_argument("--out", help="JSON result (default: print only)")
    a = ap.parse_args()

    hiber = hiber_bin()
    # Enough that no copy runs out while the cycles go on (they run freely meanwhile).
    steps = 1_000_000
    if a.cmd:
        base = a.cmd.split()
    elif a.gpu:
        base = ["python3", os.path.join(REPO, "gpu/programs/train.py"), "--extra-gib", "1"]
    else:
        base = [hiber, "workload", "cpu", "--mem-mib", "64"]
    cmd = base + ["--steps", str(steps), "--interval-ms", str(a.interval_ms)]

    # The commit of the code that runs, taken now (HEAD may move during a long run).
    # Binaries carried to the GPU machine say which commit they were built from.
    carried = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(hiber))), "COMMIT")
    if os.path.isfile(carried):
        commit = open(carried).read().strip()
    else:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    work = tempfile.mkdtemp(prefix="hiber-soak-")
    state = os.path.join(work, "state")
    images = os.path.join(work, "images")
    os.makedirs(images)
    env = dict(os.environ, HIBER_STATE=state)
    print(f"soak: {a.cycles} cycles of {' '.join(cmd)}; state in {state}", flush=True)

    # Each copy's log, kept as its job is removed.
    rows, name, prev_image, chain, logs = [], "soak-0", None, ["soak-0"], {}
    run_hiber(hiber, ["run", "--name", name, "--"] + cmd, env)
    try:
        for i in range(a.cycles):
            have = len(benchlib.parse_progress(benchlib.job_log(state, name)))
            benchlib.wait_steps(state, name, have + a.steps_per_cycle)
            leave = i % 2 == 1
            image = os.path.join(images, f"c{i}")
            ck_args = ["checkpoint", name, "--out", image] + (["--leave-running"] if leave else [])
            ck_wall, ck_rss, _ = run_hiber(hiber, ck_args, env)
            if leave:
                logs[name] = benchlib.job_log(state, name)
                run_hiber(hiber, ["rm", "-f", name], env)
            nxt = f"soak-{i + 1}"
            rs_wall, rs_rss, _ = run_hiber(hiber, ["restore", image, "--name", nxt], env)
            if not leave:
                # The stopped original's record, as a user would drop it (`hiber ls` would
                # list every one): what is left in the state directory is hiber's own.
                logs[name] = benchlib.job_log(state, name)
                run_hiber(hiber, ["rm", name], env)
            if prev_image:
                shutil.rmtree(prev_image)
            prev_image, name = image, nxt
            chain.append(name)
            rows.append({
                "cycle": i,
                "mode": "leave-running" if leave else "stop",
                "checkpoint_s": ck_wall,
                "restore_s": rs_wall,
                "image_bytes": dir_bytes(image),
                "job_rss_kib": rss_kib(job_pid(state, name)),
                "state_bytes": dir_bytes(state),
                "hiber_children_maxrss_kib": max(ck_rss, rs_rss),
            })
            if i % 50 == 0 or i == a.cycles - 1:
                r = rows[-1]
                print(f"cycle {i}: checkpoint {r['checkpoint_s']:.2f}s restore {r['restore_s']:.2f}s image {r['image_bytes'] >> 20} MiB "
                      f"job rss {r['job_rss_kib'] >> 10} MiB state {r['state_bytes'] >> 20} MiB", flush=True)
    finally:
        logs[name] = benchlib.job_log(state, name)
        subprocess.run([hiber, "rm", "-f", name], env=env, capture_output=True)

    # Every copy's trajectory against an uninterrupted run of as many steps.
    last_step = max((p.step for job in chain for p in benchlib.parse_progress(logs.get(job, ""))), default=0)
    ref_cmd = base + ["--steps", str(last_step + 1), "--interval-ms", "0"]
    ref = subprocess.run(ref_cmd, capture_output=True, text=True, check=True).stdout
    reference = {p.step: p.checksum for p in benchlib.parse_progress(ref)}
    problems = []
    checked = 0
    for job in chain:
        prog = benchlib.parse_progress(logs.get(job, ""))
        for prev, p in zip(prog, prog[1:]):
            if p.step != prev.step + 1:
                problems.append(f"{job}: step {p.step} after {prev.step}")
        for p in prog:
            checked += 1
            if reference.get(p.step) != p.checksum:
                problems.append(f"{job}: step {p.step} checksum {p.checksum:016x}, uninterrupted {reference.get(p.step, 0):016x}")
    for prev_job, job in zip(chain, chain[1:]):
        before, after = benchlib.parse_progress(logs.get(prev_job, "")), benchlib.parse_progress(logs.get(job, ""))
        if before and after and after[0].step > before[-1].step + 1:
            problems.append(f"{job} starts at step {after[0].step}, {prev_job} ended at {before[-1].step}")
    summary = {k: tenth_ratio(rows, k) for k in ("checkpoint_s", "restore_s", "image_bytes", "job_rss_kib", "state_bytes", "hiber_children_maxrss_kib")}
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "host": os.uname().nodename,
        "cpus": os.cpu_count(),
        "command": cmd,
        "cycles": a.cycles,
        "progress_lines_checked": checked,
        "problems": problems,
        "summary": summary,
        "cycles_detail": rows,
    }
    for k, s in summary.items():
        print(f"{k}: first tenth {s['first_tenth_median']:.3f}, last tenth {s['last_tenth_median']:.3f}, ratio {s['ratio'] or 0:.2f}")
    print(f"{checked} progress lines checked against the uninterrupted run; {len(problems)} problem(s)")
    for p in problems[:20]:
        print("  " + p)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
