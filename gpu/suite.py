#!/usr/bin/env python3
"""hiber's GPU suite: every GPU scenario in one call on the GPU machine.

Uses hiber and CRIU built on the build machine and carried in .carry/ (scripts/gpu-carry.sh),
builds its test programs here with nvcc, runs each scenario, prints a table of passed /
failed / skipped-with-reason, and writes the run (date, GPU, driver, commit, per-scenario
results, timings, image sizes) to $OUT/results.md and $OUT/results.json.

Each scenario asserts the restored program's own state: it resumes at the next step with
the original's checksum trajectory, and its final word-by-word check passes.

`hiber run` preloads the agent (libhiber_agent.so) into every job unless told --no-agent, so
every scenario runs with it; the agent_* scenarios also check, from the image's agent
section and `hiber inspect`, what the agent moved itself and what it left to the driver.
"""
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from benchlib import carried_commit, parse_progress  # noqa: E402 - shared with the bench

if not __debug__:
    # Every check below is an assert; under -O they would all be gone and every scenario pass.
    sys.exit("gpu/suite.py checks with assert: run it without -O or PYTHONOPTIMIZE")

CARRY = REPO / ".carry"


HIBER = str(CARRY / "bin" / "hiber")
OUT = Path(os.environ.get("OUT") or "/tmp/hiber-gpu-out")
# A worker of a parallel run (SUITE_JOBS) gets a state directory of its own.
STATE = Path(os.environ.get("SUITE_STATE") or "/tmp/hiber-gpu-state")
# Two suites at once on one machine (SUITE_ONLY groups) each need a build directory of their own.
BUILD = Path(os.environ.get("SUITE_BUILD") or "/tmp/hiber-gpu-build")
ENV = dict(os.environ, HIBER_STATE=str(STATE), HIBER_CRIU=str(CARRY / "bin" / "criu"), PYTHONUNBUFFERED="1")
ONLY = set(filter(None, os.environ.get("SUITE_ONLY", "").split(",")))
TRAIN = REPO / "gpu/programs/train.py"
FORKS = REPO / "gpu/programs/forks.py"
MP_SHARE = REPO / "gpu/programs/mp_share.py"
JAX = REPO / "gpu/programs/jax_train.py"
JAX_SHARDED = REPO / "gpu/programs/jax_sharded.py"
NVML_MONITOR = REPO / "gpu/programs/nvml_monitor.py"
GENERATE = REPO / "gpu/programs/generate.py"
TWO_GPUS = REPO / "gpu/programs/two_gpus.py"
DDP = REPO / "gpu/programs/ddp.py"
TORCHRUN = ("python3", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1")
CUPY = REPO / "gpu/programs/cupy_iter.py"
# The CUDA programs of gpu/programs/ that main() builds with nvcc, and how each build went.
PROGRAMS = ("counter", "mallocasync", "graphs", "pinned")
BUILT = {}

results = []


class Skip(Exception):
    pass


# SUITE_TRACE=1: each command and how it ended, on stderr as it happens, so a run cut by a
# timeout still shows where it was.
TRACE = os.environ.get("SUITE_TRACE") == "1"


def sh(*args, check=True, env=None, timeout=600):
    t0 = time.time()
    if TRACE:
        print(f"[trace] {time.strftime('%H:%M:%S')} {' '.join(map(str, args))[-200:]}", file=sys.stderr, flush=True)
    p = subprocess.run(list(map(str, args)), capture_output=True, text=True, env=env or ENV, timeout=timeout)
    if TRACE:
        print(f"[trace] rc={p.returncode} after {time.time() - t0:.1f}s {p.stderr.strip()[-300:]}", file=sys.stderr, flush=True)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p


def hiber(*args, check=True, env=None):
    if args and args[0] == "rm" and os.environ.get("SUITE_KEEP_AGENT_LOGS") == "1":
        # The agent's log of each job, kept before the job and its directory go.
        for name in (a for a in args[1:] if not a.startswith("-")):
            f = STATE / "jobs" / name / "agent.log"
            if f.exists():
                (OUT / "agent").mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, OUT / "agent" / f"{name}.log")
    return sh(HIBER, *args, check=check, env=env)


def hiber_json(*args, env=None):
    return json.loads(hiber(*args, "--json", env=env).stdout)


def log(job):
    try:
        return (STATE / "jobs" / job / "stdout.log").read_text()
    except FileNotFoundError:
        return ""


def progress(job, prefix=""):
    """(step, checksum) of every progress line of the job's log (lines `PREFIX step ...`)."""
    return [(p.step, p.checksum) for p in parse_progress(log(job), prefix)]


def wait(what, limit, cond):
    start = time.time()
    while not cond():
        if time.time() - start > limit:
            raise AssertionError(f"timed out after {limit}s waiting for {what}")
        time.sleep(0.05)
    if TRACE:
        print(f"[trace] {time.strftime('%H:%M:%S')} {what}: {time.time() - start:.1f}s", file=sys.stderr, flush=True)


def wait_step(job, step, limit=60):
    wait(f"{job} to reach step {step}", limit, lambda: progress(job) and progress(job)[-1][0] >= step)


def state_of(job):
    for j in hiber_json("ls")["jobs"]:
        if j["name"] == job:
            return j["state"]
    return None


def assert_verified(job, limit=300):
    wait(f"{job} to finish", limit, lambda: state_of(job) != "running")
    st, text = state_of(job), log(job)
    tail = "\n".join(text.splitlines()[-6:])
    if st != "exited(0)":
        # What the job said on its way out (NCCL's warnings, PyTorch's error) goes with it.
        err = STATE / "jobs" / job / "stderr.log"
        said = [l[-300:] for l in (err.read_text(errors="replace") if err.exists() else "").splitlines() if "WARN" in l or "rror" in l]
        tail += "\nits stderr said:\n" + "\n".join(said[-12:])
    assert st == "exited(0)", f"{job} ended as {st}:\n{tail}"
    assert any(l.startswith("verify ok") for l in text.splitlines()), f"{job} did not verify:\n{tail}"


def assert_continues(original, copy, start):
    assert copy and copy[0][0] == start, f"copy resumes at {copy[0][0] if copy else None}, expected {start}"
    orig = dict(original)
    for step, s in copy:
        if step in orig:
            assert orig[step] == s, f"checksum differs at step {step}: {orig[step]:x} vs {s:x}"
    for a, b in zip(copy, copy[1:]):
        assert b[0] == a[0] + 1, f"steps not consecutive: {a[0]} then {b[0]}"


def job_log_tails():
    """The last lines of every job's logs and of CRIU's kept logs, for a failure report, with
    the host's free memory and disk."""
    out = {"free": sh("free", "-m", check=False).stdout.splitlines()[1:2], "df": sh("df", "-m", "/tmp", check=False).stdout.splitlines()[1:]}
    for f in sorted(STATE.glob("jobs/*/std*.log")) + sorted(STATE.glob("jobs/*/agent.log")) + sorted(STATE.glob("logs/*/*.log"))[-4:]:
        lines = f.read_text(errors="replace").splitlines()
        if lines:
            out[str(f.relative_to(STATE))] = lines[-4:]
    return out


def cleanup():
    if TRACE and (STATE / "jobs").exists():
        # Every job's logs (hiber's, the agent's, the program's), kept under OUT/jobs.
        for f in (STATE / "jobs").glob("*/*.log"):
            if f.stat().st_size <= 4 << 20:
                dest = OUT / "jobs" / f.relative_to(STATE / "jobs")
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, dest)
    if (STATE / "jobs").exists():
        for j in (STATE / "jobs").iterdir():
            hiber("rm", "-f", j.name, check=False)
    shutil.rmtree(STATE / "images", ignore_errors=True)


def image_of(name):
    return str(STATE / "images" / name)


def program(name):
    """A CUDA test program built by main(); the scenario is skipped if nvcc could not build it.
    Every scenario that runs one asks for it here, so that none is skipped that does not need it."""
    b = BUILT.get(name)
    if b is None or b.returncode != 0:
        raise Skip(f"nvcc could not build {name}.cu: " + (b.stderr[-300:] if b else "not built"))
    return BUILD / name


def job_pid(job):
    return json.loads((STATE / "jobs" / job / "job.json").read_text())["pid"]


def run_job(job, *cmd, agent=None, limit=60, env=None):
    """Start CMD as the hiber job JOB (with --no-agent when agent is False; the job gets ENV,
    hiber's environment, or the suite's). With agent True or False, wait for its first step
    and check that the agent is mapped into it, or is not."""
    hiber("run", "--name", job, *(["--no-agent"] if agent is False else []), "--", *cmd, env=env)
    if agent is not None:
        wait_step(job, 0, limit)
        mapped = "libhiber_agent" in Path(f"/proc/{job_pid(job)}/maps").read_text()
        assert mapped == agent, f"the agent is {'not ' if agent else ''}mapped into {job}"


def device_section(image, engine):
    m = json.loads((Path(image) / "manifest.json").read_text())
    for d in m["devices"]:
        if d["engine"] == engine:
            return d["state"]
    return None


def cuda_section(image):
    return device_section(image, "cuda")


def agent_section(image):
    return device_section(image, "agent")


def agent_bytes(sec):
    """Device bytes the agent moved itself, all processes of an agent section together."""
    return sum(p["bytes"] for p in sec["processes"]) if sec else 0


def inspect_agent(image, metrics):
    """`hiber inspect IMAGE`'s text; its agent lines are kept in the metrics."""
    out = hiber("inspect", image).stdout
    metrics["inspect_agent"] = [l.strip() for l in out.splitlines() if l.strip().startswith("agent:")]
    return out


def agent_moved(image, metrics, at_least=1):
    """Check that the agent itself moved at least AT_LEAST bytes of one process of the image,
    and record what it did and what it left to the driver."""
    sec = agent_section(image)
    assert sec and sec["processes"], "the image has an agent section with the processes"
    most = max(p["bytes"] for p in sec["processes"])
    assert most >= at_least, f"the agent moved {most >> 20} MiB of a process, expected at least {at_least >> 20} MiB"
    metrics.update(agent_mode=sec["mode"], agent_passthrough=[p["passthrough"] for p in sec["processes"]])
    inspect_agent(image, metrics)
    return sec


def stop_and_restore(job, at, metrics, restore_args=(), wait_limit=60):
    """Checkpoint (stopping the job), restore, and check the copy continues intact.

    The device memory is in the cuda section (the driver's), the agent section, or both."""
    wait_step(job, at, wait_limit)
    img = image_of(job)
    ck = hiber_json("checkpoint", job, "--out", img)
    sec, agent = cuda_section(img), agent_section(img)
    assert (sec and sec["processes"]) or (agent and agent["processes"]), "the image records the CUDA processes"
    before = progress(job)
    rs = hiber_json("restore", img, "--name", job + "-r", *restore_args)
    assert_verified(job + "-r")
    assert_continues(before, progress(job + "-r"), before[-1][0] + 1)
    metrics["checkpoint_s"] = round(ck["total_seconds"], 2)
    # Each figure from the section that records it (engine/cuda Section, engine/agent Section);
    # a field missing from a section that is there fails the scenario.
    if sec:
        metrics["driver_checkpoint_s"] = round(sec["checkpoint_seconds"], 2)
    if agent:
        metrics["agent_quiesce_s"] = round(agent["quiesce_seconds"], 2)
        metrics["agent_copy_s"] = round(agent["copy_seconds"], 2)
    metrics.update(
        dump_s=round(ck["dump_seconds"], 2),
        restore_s=round(rs["total_seconds"], 2),
        restore_devices_s=round(rs["devices_seconds"], 2),
        image_mib=ck["image_bytes"] >> 20,
    )
    if sec:
        metrics["gpu_mib"] = sum(p["memory_bytes"] for p in sec["processes"]) >> 20
    if agent:
        metrics["agent_mib"] = agent_bytes(agent) >> 20
    return img


def identical_run(m, job, script, args=(), agent=None, at=50, steps="160", limit=60, ref_timeout=300, ref_may_skip=False, restore_args=(), launcher=("python3",), env=None):
    """SCRIPT with ARGS, uninterrupted outside hiber, then as the hiber job JOB checkpointed at
    step AT and restored: the two trajectories (loss bits, tokens, checksums) must be
    identical, and the restored run's own final check must pass."""
    ref = sh(*launcher, script, "--steps", steps, *args, check=not ref_may_skip, timeout=ref_timeout, env=env)
    if ref.returncode != 0:
        raise Skip(f"{Path(script).name} {' '.join(args)} does not run here outside hiber: {ref.stderr.strip()[-300:]}")
    ref_traj = [(p.step, p.checksum) for p in parse_progress(ref.stdout)]
    assert len(ref_traj) == int(steps), "reference run completed"
    run_job(job, *launcher, script, "--steps", steps, *args, agent=agent, limit=limit, env=env)
    img = stop_and_restore(job, at, m, restore_args=restore_args, wait_limit=limit)
    combined = progress(job) + progress(job + "-r")
    assert combined == ref_traj, "trajectory differs from the uninterrupted run"
    m["steps_compared"] = len(combined)
    return img


def training_identical(m, job, flags=(), agent=None, at=50, steps="160", limit=60, ref_timeout=300, ref_may_skip=False):
    """train.py with FLAGS: the loss trajectory of a checkpointed and restored run is
    bit-identical to an uninterrupted one."""
    img = identical_run(m, job, TRAIN, flags, agent, at, steps, limit, ref_timeout, ref_may_skip)
    m["final_loss"] = log(job + "-r").splitlines()[-2].split()[-1]
    return img


def image_processes(image):
    return json.loads((Path(image) / "manifest.json").read_text())["processes"]


def abstract_sockets(pid):
    """Names of the abstract unix sockets a process holds, as /proc/PID/net/unix lists them."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            t = os.readlink(fd)
        except OSError:
            continue
        if t.startswith("socket:["):
            inodes.add(t[8:-1])
    names = []
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[6] in inodes:
            names.append(f[7])
    return names


SCENARIOS = []
# Scenarios that need the machine to themselves: they fill the GPU or host memory, size what
# they do by what is free, or time something. A parallel run (SUITE_JOBS) runs them one at a
# time after the others.
EXCLUSIVE = set()


def scenario(fn):
    SCENARIOS.append(fn)
    return fn


def exclusive(fn):
    EXCLUSIVE.add(fn.__name__)
    return fn


def abi_layout(text):
    """{name: value} of the `NAME VALUE` lines abi.c and `hiber workload cuda-abi` print
    (NAME may hold spaces: `CUmemAccessDesc size 12`), and what could not be read."""
    layout, problems = {}, []
    for line in text.splitlines():
        f = line.rsplit(None, 1)
        if len(f) != 2 or not f[1].lstrip("-").isdigit():
            problems.append(f"unreadable line {line!r}")
        elif f[0] in layout:
            problems.append(f"{f[0]} printed twice")
        else:
            layout[f[0]] = int(f[1])
    return layout, problems


def abi_differences(from_cuda_h, from_hiber):
    """Every way the two printouts disagree, line by line and both ways: a name that only one
    side prints, a value that differs, a line that is not `NAME VALUE`, an empty printout."""
    c, c_problems = abi_layout(from_cuda_h)
    r, r_problems = abi_layout(from_hiber)
    out = [f"cuda.h side: {p}" for p in c_problems] + [f"hiber side: {p}" for p in r_problems]
    if not c:
        out.append("abi.c printed nothing")
    if not r:
        out.append("hiber workload cuda-abi printed nothing")
    out += [f"{k}: only abi.c (cuda.h) prints it ({c[k]})" for k in c if k not in r]
    out += [f"{k}: only hiber prints it ({r[k]})" for k in r if k not in c]
    out += [f"{k}: cuda.h {c[k]}, hiber {r[k]}" for k in c if k in r and c[k] != r[k]]
    return out


def find_cuda_h():
    """cuda.h of the toolkit here: beside nvcc, then the usual places."""
    nvcc = shutil.which("nvcc")
    candidates = ([Path(nvcc).resolve().parent.parent / "include/cuda.h"] if nvcc else []) + [Path("/usr/local/cuda/include/cuda.h")]
    candidates += sorted(Path("/usr/local").glob("cuda*/include/cuda.h")) + [Path("/usr/include/cuda.h")]
    return next((p for p in candidates if p.is_file()), None), candidates


@scenario
def abi_matches_cuda_h(m):
    """hiber's CUDA struct layouts (hiber workload cuda-abi) against this machine's cuda.h
    (abi.c). Passes only when the comparison ran and found every line equal: no cuda.h is a
    skip with the reason, abi.c not building or either side printing nothing is a failure."""
    cuda_h, looked = find_cuda_h()
    if cuda_h is None:
        raise Skip("no cuda.h to compare hiber's struct layouts with (looked at " + ", ".join(map(str, looked)) + ")")
    m["cuda_h"] = str(cuda_h)
    gcc = sh("gcc", "-I", cuda_h.parent, REPO / "gpu/programs/abi.c", "-o", BUILD / "abi", check=False)
    assert gcc.returncode == 0, f"abi.c does not build against {cuda_h}, so the layouts were not compared:\n{gcc.stderr[-1500:]}"
    c = sh(BUILD / "abi").stdout
    r = hiber("workload", "cuda-abi").stdout
    diffs = abi_differences(c, r)
    assert not diffs, "layouts differ:\n" + "\n".join(diffs)
    m["abi_lines_compared"] = len(abi_layout(c)[0])


@scenario
def doctor_sees_the_driver(m):
    out = hiber("doctor").stdout
    assert "checkpoint API present" in out, out
    m["doctor"] = [l for l in out.splitlines() if "nvidia" in l][0].strip()


@scenario
def cuda_cpp_static_cudart_1gib(m):
    ldd = sh("ldd", program("counter")).stdout
    assert "libcudart" not in ldd, "built with static cudart"
    hiber("run", "--name", "counter", "--", program("counter"), "--mib", "1024", "--steps", "300")
    stop_and_restore("counter", 40, m)


@scenario
def pytorch_training_identical_loss(m):
    training_identical(m, "train")


@scenario
def two_gpu_processes_in_one_job(m):
    hiber("run", "--name", "pair", "--", program("counter"), "--fork", "--mib", "2048", "--steps", "300")
    wait("the child's progress", 120, lambda: len(progress("pair", "child ")) > 40)
    img = stop_and_restore("pair", 40, m)
    assert len(cuda_section(img)["processes"]) == 2, "both processes were checkpointed by the driver"
    assert "verify ok both processes" in log("pair-r")
    # The child resumes where it was checkpointed too, not from the start (its own final
    # check would pass either way).
    child_before = progress("pair", "child ")
    child = progress("pair-r", "child ")
    assert_continues(child_before, child, child_before[-1][0] + 1)
    assert child[-1][0] == 299, "the child ran to the end too"


@scenario
def leave_running_gpu_job(m):
    # Long enough (600 steps of 20 ms) that the original still runs when its copy is
    # restored, on a machine busy with other scenarios (300 steps once ended first).
    hiber("run", "--name", "live", "--", program("counter"), "--mib", "1024", "--steps", "600")
    wait_step("live", 40)
    img = image_of("live")
    before = progress("live")[-1][0]
    ck = hiber_json("checkpoint", "live", "--leave-running", "--out", img)
    at = progress("live")[-1][0]
    wait_step("live", at + 10)
    # The CUDA process holds an abstract unix socket; a copy beside the running original
    # needs its own network namespace for it (without, CRIU reports the address in use).
    m["sockets"] = abstract_sockets(json.loads((STATE / "jobs/live/job.json").read_text())["pid"])
    p = hiber("restore", img, "--name", "clash", check=False)
    m["without_isolate_net"] = p.stderr.strip()[:400]
    assert p.returncode == 1 and "--isolate-net" in p.stderr and state_of("clash") is None, p.stderr
    rs = hiber_json("restore", img, "--name", "live-copy", "--isolate-net")
    assert state_of("live") == "running", "original and copy run side by side"
    assert_verified("live")
    assert_verified("live-copy")
    copy = progress("live-copy")
    # The image holds a step between the last one logged before the checkpoint began and
    # the last one logged after it returned: the copy resumes just after it (not from scratch).
    assert copy and before + 1 <= copy[0][0] <= at + 1, f"copy resumes at {copy[0][0] if copy else None}, expected {before + 1}..{at + 1}"
    assert_continues(progress("live"), copy, copy[0][0])
    m.update(checkpoint_s=round(ck["total_seconds"], 2), restore_s=round(rs["total_seconds"], 2), image_mib=ck["image_bytes"] >> 20)


@scenario
def gpu_map_by_uuid_same_gpu(m):
    uuid = sh("nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader").stdout.split()[0]
    hiber("run", "--name", "mapped", "--", program("counter"), "--mib", "1024", "--steps", "300")
    stop_and_restore("mapped", 40, m, restore_args=("--gpu-map", f"{uuid}={uuid}"))
    m["map"] = f"{uuid}={uuid}"


@scenario
@exclusive
def lock_timeout_keeps_the_process_running(m):
    hiber("run", "--name", "busy", "--", program("counter"), "--mib", "256", "--steps", "120", "--spin-at", "20", "--spin-ms", "10000")
    wait("the long kernel", 120, lambda: "spin" in log("busy"))
    time.sleep(0.5)
    env = dict(ENV, HIBER_CUDA_LOCK_TIMEOUT_MS="1500")
    p = hiber("checkpoint", "busy", "--out", image_of("busy"), check=False, env=env)
    assert p.returncode == 1, f"checkpoint should fail: {p.returncode}\n{p.stderr}"
    # The agent's quiesce (or, without an agent, the driver's lock) times out.
    assert ("lock" in p.stderr or "quiesce" in p.stderr) and "keeps running" in p.stderr, p.stderr
    assert not Path(image_of("busy")).exists(), "no image left"
    m["error"] = p.stderr.strip().splitlines()[0][:160]
    assert_verified("busy")


@scenario
@exclusive
def restore_refused_without_enough_gpu_memory(m):
    hiber("run", "--name", "big", "--", program("counter"), "--mib", "4096", "--steps", "300")
    wait_step("big", 20)
    img = image_of("big")
    hiber("checkpoint", "big", "--out", img)
    hog = subprocess.Popen([str(program("counter")), "--hog-free-mib", "1024"], stdout=subprocess.PIPE, text=True)
    try:
        assert "hogging" in hog.stdout.readline()
        p = hiber("restore", img, "--name", "big-r", check=False)
        assert p.returncode == 1 and "MiB free" in p.stderr, p.stderr
        assert state_of("big-r") is None, "no job left behind"
        m["error"] = p.stderr.strip().splitlines()[0][:160]
    finally:
        hog.kill()
        hog.wait()
    time.sleep(1)
    hiber("restore", img, "--name", "big-r")
    assert_verified("big-r")


@scenario
def agent_static_cudart_counter(m):
    run_job("acount", program("counter"), "--mib", "1024", "--steps", "300", agent=True)
    img = stop_and_restore("acount", 40, m)
    agent_moved(img, m, at_least=1 << 30)
    sec = cuda_section(img)
    assert sec and sec["processes"], "the driver took the remainder: the image has a cuda section"


@scenario
def agent_pytorch_default(m):
    img = training_identical(m, "atrain", agent=True)
    agent_moved(img, m)


@scenario
def agent_pytorch_expandable(m):
    # PyTorch's allocator maps its memory with cuMemCreate/cuMemMap, which the agent tracks;
    # the reference run is --expandable too.
    img = training_identical(m, "aexp", ("--expandable",), agent=True)
    agent_moved(img, m)


@scenario
def agent_mallocasync_falls_back(m):
    run_job("async", program("mallocasync"), "--mib", "1024", "--steps", "300", agent=True)
    img = stop_and_restore("async", 40, m)
    out = inspect_agent(img, m)
    assert "left to the driver path" in out, "inspect says what the agent left to the driver:\n" + out[-1500:]
    sec = agent_section(img)
    assert sec and sec["processes"], "the image has an agent section with the process"
    m["agent_passthrough"] = [p["passthrough"] for p in sec["processes"]]
    # kinds lists only the kinds with a count: an absent "async" is a count of 0.
    stream_ordered = sum(p["passthrough"]["kinds"].get("async", 0) for p in sec["processes"])
    assert stream_ordered > 0, f"the agent counted no stream-ordered allocation: {m['agent_passthrough']}"
    drv = cuda_section(img)
    assert drv and drv["processes"], "the driver took the stream-ordered memory: the image has a cuda section"


@scenario
def agent_cuda_graphs(m):
    # Two cudaMalloc'd buffers of 256 MiB, which the agent serves, that the graph's kernel nodes
    # name by address.
    run_job("graphs", program("graphs"), "--mib", "512", "--steps", "300", agent=True)
    img = stop_and_restore("graphs", 40, m)
    agent_moved(img, m, at_least=512 << 20)


@scenario
def agent_torch_compile(m):
    # The first step compiles (the reference run leaves inductor's caches warm for the job).
    img = training_identical(m, "acomp", ("--compile",), agent=True, limit=300, ref_timeout=600, ref_may_skip=True)
    agent_moved(img, m)


@scenario
def agent_leave_running(m):
    # Long enough (about 30 s) that the original still runs when the copy starts, even on a
    # loaded machine (on 2×H200, beside three other scenarios, 300 steps had ended by then).
    run_job("alive", program("counter"), "--mib", "1024", "--steps", "1500", agent=True)
    wait_step("alive", 40)
    img = image_of("alive")
    before = progress("alive")[-1][0]
    ck = hiber_json("checkpoint", "alive", "--leave-running", "--out", img)
    at = progress("alive")[-1][0]
    wait_step("alive", at + 10)
    rs = hiber_json("restore", img, "--name", "alive-copy", "--isolate-net")
    assert state_of("alive") == "running", "original and copy run side by side"
    assert_verified("alive")
    assert_verified("alive-copy")
    copy = progress("alive-copy")
    # The image holds a step between the last one logged before the checkpoint began and
    # the last one logged after it returned: the copy resumes just after it (not from scratch).
    assert copy and before + 1 <= copy[0][0] <= at + 1, f"copy resumes at {copy[0][0] if copy else None}, expected {before + 1}..{at + 1}"
    assert_continues(progress("alive"), copy, copy[0][0])
    sec = agent_moved(img, m, at_least=1 << 30)
    m.update(checkpoint_s=round(ck["total_seconds"], 2), restore_s=round(rs["total_seconds"], 2), image_mib=ck["image_bytes"] >> 20, agent_mib=agent_bytes(sec) >> 20)


def pinned_round_trip(m, agent):
    """pinned.cu (mapped page-locked host memory that its kernels poll and write, allocated
    afresh each step, as NCCL's network transport uses it): a --leave-running checkpoint,
    then a restore of the image beside it; both go on to the end, every word checked."""
    job = "pinned" if agent else "pinned-na"
    run_job(job, program("pinned"), "--steps", "600", agent=agent)
    wait_step(job, 40)
    img = image_of(job)
    before = progress(job)[-1][0]
    ck = hiber_json("checkpoint", job, "--leave-running", "--out", img)
    m["paused_s"] = round(ck["paused_seconds"] or 0, 2)
    rs = hiber_json("restore", img, "--name", job + "-copy", "--isolate-net")
    m["restore_s"] = round(rs["total_seconds"], 2)
    assert_verified(job)
    assert_verified(job + "-copy")
    copy = progress(job + "-copy")
    assert copy and copy[0][0] > before, f"copy resumes at {copy[0][0] if copy else None}"
    assert_continues(progress(job), copy, copy[0][0])


@scenario
def agent_pinned_host_memory(m):
    pinned_round_trip(m, True)


@scenario
def no_agent_pinned_host_memory(m):
    pinned_round_trip(m, False)


def xid_lines():
    """The driver's Xid reports in the kernel log (empty where dmesg cannot be read)."""
    p = subprocess.run(["dmesg"], capture_output=True, text=True)
    return [l for l in p.stdout.splitlines() if "Xid" in l]


@scenario
@exclusive
def driver_restore_keeps_time_slicing(m):
    """Two processes share the GPU by time-slicing: B steps all along while A runs a kernel
    of 3 s, so the GPU must switch away from A's context in the middle of it. First with no
    checkpoint; then after a --leave-running checkpoint of A, with the agent and without.
    The two ranks of nccl_socket_ranks_failed_cut_trains_on share the GPU the same way
    (their kernels spin until the other's run), and after the driver's checkpoint and restore
    both faulted with Xid 109 (CTX SWITCH TIMEOUT), H100, driver 580.159.04: this asks
    whether any restored context can still be switched away from."""
    xids = len(xid_lines())
    run_job("slice-b", program("counter"), "--mib", "256", "--steps", "20000", "--interval-ms", "2", agent=True)
    try:
        for case, agent, ckpt in (("control", True, False), ("agent", True, True), ("no_agent", False, True)):
            job = "slice-" + case
            run_job(job, program("counter"), "--mib", "256", "--steps", "300", "--spin-at", "150", "--spin-ms", "3000", agent=agent)
            wait_step(job, 40)
            if ckpt:
                ck = hiber_json("checkpoint", job, "--leave-running", "--out", image_of(job))
                m[f"{case}_paused_s"] = round(ck["paused_seconds"] or 0, 2)
            b_at = progress("slice-b")[-1][0]
            wait(f"{job} to finish", 120, lambda: state_of(job) != "running")
            new = xid_lines()[xids:]
            m[f"{case}_xid"] = [l[-160:] for l in new]
            m[f"{case}_b_steps_meanwhile"] = progress("slice-b")[-1][0] - b_at
            assert state_of("slice-b") == "running", f"B ended as {state_of('slice-b')}: {log('slice-b')[-300:]}"
            assert_verified(job)
            assert not new, f"{case}: {new}"
    finally:
        hiber("rm", "-f", "slice-b", check=False)
    # Both processes restored: a job of two (counter --fork), checkpointed --leave-running;
    # the parent's 3 s kernel must give the GPU to the child, both contexts restored ones.
    job = "slice-fork"
    hiber("run", "--name", job, "--", program("counter"), "--fork", "--mib", "512", "--steps", "400", "--interval-ms", "5", "--spin-at", "250", "--spin-ms", "3000")
    wait_step(job, 40)
    ck = hiber_json("checkpoint", job, "--leave-running", "--out", image_of(job))
    m["fork_paused_s"] = round(ck["paused_seconds"] or 0, 2)
    wait(f"{job} to finish", 120, lambda: state_of(job) != "running")
    new = xid_lines()[xids:]
    m["fork_xid"] = [l[-160:] for l in new]
    assert_verified(job)
    assert not new, f"fork: {new}"


def free_mib():
    out = sh("nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits").stdout
    return int(out.strip().splitlines()[0])


@scenario
@exclusive
def agent_full_gpu_staged_leave_running(m):
    """A job filling the GPU, checkpointed with --leave-running: the GPU has room for only a
    few GiB of hiber's copies, the staging area in host memory (capped here by
    HIBER_HOST_STAGING_MIB) takes the next 2 GiB, and the rest is written before the job
    resumes. The job's 8 GiB of data span all three places, and its pool, never written, is
    found to be zeros and copied nowhere; the original and then the restored copy both go on
    with the same checksums and verify every word at their end."""
    data = 8192
    # Leave about 4 GiB free once the job runs: room for about 2 GiB of copies on the GPU.
    reserve = free_mib() - data - 4 * 1024
    assert reserve > 1024, f"the GPU has only {free_mib()} MiB free"
    run_job("full", program("counter"), "--mib", str(data), "--reserve-mib", str(reserve), "--steps", "200", "--interval-ms", "20", agent=True, limit=120)
    wait_step("full", 30)
    img = image_of("full")
    before = progress("full")[-1][0]
    env = dict(ENV, HIBER_HOST_STAGING_MIB="2048")
    ck = hiber_json("checkpoint", "full", "--leave-running", "--out", img, env=env)
    at = progress("full")[-1][0]
    sec = agent_section(img)
    placed = sec["placed"]
    m.update(agent_mode=sec["mode"], placed_mib={k: v >> 20 for k, v in placed.items()}, staging_s=round(sec["staging_seconds"], 2), copy_s=round(sec["copy_seconds"], 2))
    assert sec["mode"] == "staged", f"mode {sec['mode']}"
    assert placed["device"] >= 1 << 30, f"only {placed['device'] >> 20} MiB copied on the GPU"
    assert placed["host"] == 2 << 30, f"{placed['host'] >> 20} MiB staged in host memory, expected the cap of 2048"
    assert placed["direct"] > 0, "something was written before the release"
    # The pool, never written, is found to be zeros on the GPU: not copied anywhere.
    assert placed["zeros"] >= (reserve - 64) << 20, f"the pool ({reserve} MiB) found to be zeros: {placed}"
    moved = placed["device"] + placed["host"] + placed["direct"]
    assert data << 20 <= moved <= (data + 64) << 20, f"the data (and at most a chunk of the pool) copied or written: {placed}"
    inspect_agent(img, m)
    assert any("to host memory" in l for l in m["inspect_agent"]), m["inspect_agent"]
    # The original first: the GPU has no room for both.
    assert_verified("full")
    rs = hiber_json("restore", img, "--name", "full-copy")
    assert_verified("full-copy")
    copy = progress("full-copy")
    assert copy and before + 1 <= copy[0][0] <= at + 1, f"copy resumes at {copy[0][0] if copy else None}, expected {before + 1}..{at + 1}"
    assert_continues(progress("full"), copy, copy[0][0])
    m.update(checkpoint_s=round(ck["total_seconds"], 2), restore_s=round(rs["total_seconds"], 2), image_mib=ck["image_bytes"] >> 20, agent_mib=agent_bytes(sec) >> 20)


def image_fingerprints(image):
    """The GPU fingerprints an image's manifest keeps, by chunk file."""
    files = json.loads((Path(image) / "manifest.json").read_text())["files"]
    return {f["path"]: f["fingerprint"] for f in files if f.get("fingerprint")}


@scenario
def agent_incremental_image_outlives_its_parent(m):
    """Two --leave-running checkpoints of a job whose 2 GiB of weights never change (counter
    --static-mib) and whose 1 GiB of data does: the second image finds the weights unchanged
    by their fingerprints on the GPU and shares their chunks with the first (hard links)
    instead of copying and writing them; the first is removed, the second restores, and the
    copy goes on with the original's checksums. Then the preemption loop: the copy is
    checkpointed and stopped (its restored weights found unchanged against the second
    image), restored again, and verifies every word at its end, as the original does."""
    run_job("inc", program("counter"), "--mib", "1024", "--static-mib", "2048", "--steps", "400", agent=True)
    wait_step("inc", 30)
    first, second, third = image_of("inc1"), image_of("inc2"), image_of("inc3")
    r1 = hiber_json("checkpoint", "inc", "--leave-running", "--out", first)
    at1 = progress("inc")[-1][0]
    wait_step("inc", at1 + 20)
    before = progress("inc")[-1][0]
    r2 = hiber_json("checkpoint", "inc", "--leave-running", "--out", second)
    at = progress("inc")[-1][0]
    p1, p2 = agent_section(first)["placed"], agent_section(second)["placed"]
    fp1, fp2 = image_fingerprints(first), image_fingerprints(second)
    m.update(first_mib=r1["image_bytes"] >> 20, second_mib=r2["image_bytes"] >> 20, shared_mib=r2["shared_bytes"] >> 20,
             unchanged_mib=p2.get("unchanged", 0) >> 20, fingerprinted_chunks=len(fp2),
             first_s=round(r1["total_seconds"], 2), second_s=round(r2["total_seconds"], 2))
    assert r1["shared_bytes"] == 0 and p1.get("unchanged", 0) == 0, (r1, p1)
    assert len(fp1) == 48 and len(fp2) == 48, f"every chunk (3 GiB: 48) fingerprinted: {len(fp1)}, {len(fp2)}"
    assert r2["shared_bytes"] >= 2 << 30, f"the weights are shared: {r2}"
    assert p2["unchanged"] == 2 << 30, f"the weights, and only they, found unchanged on the GPU: {p2}"
    assert sum(fp1[k] == fp2.get(k) for k in fp1) == 32, "the 32 chunks of weights keep their fingerprints; the data's change"
    assert r2["parent"] == first, r2
    assert_verified("inc")
    hiber("rm", first)
    rs = hiber_json("restore", second, "--name", "inc-copy")
    wait_step("inc-copy", at + 10)
    copy = progress("inc-copy")
    assert copy and before + 1 <= copy[0][0] <= at + 1, f"copy resumes at {copy[0][0] if copy else None}, expected {before + 1}..{at + 1}"
    assert_continues(progress("inc"), copy, copy[0][0])
    r3 = hiber_json("checkpoint", "inc-copy", "--out", third)
    p3 = agent_section(third)["placed"]
    m.update(third_unchanged_mib=p3.get("unchanged", 0) >> 20, third_shared_mib=r3["shared_bytes"] >> 20, third_s=round(r3["total_seconds"], 2))
    assert r3["parent"] == second, f"a restored job's next checkpoint takes its image as parent: {r3}"
    assert p3["unchanged"] == 2 << 30 and r3["shared_bytes"] >= 2 << 30, (p3, r3)
    hiber("rm", second)
    rs3 = hiber_json("restore", third, "--name", "inc-copy2")
    assert_verified("inc-copy2")
    assert_continues(progress("inc"), progress("inc-copy2"), progress("inc-copy2")[0][0])
    m.update(restore_s=round(rs["total_seconds"], 2), restore3_s=round(rs3["total_seconds"], 2))


@scenario
def agent_hiber_killed_after_handover_recovers(m):
    """SIGKILL hiber once the agent has released the job's device memory (hiber held the
    only reference): `hiber recover` loads it back from the chunks hiber wrote first, and
    the job runs on intact."""
    hiber("run", "--name", "victim", "--", program("counter"), "--mib", "2048", "--steps", "400")
    wait_step("victim", 30)
    img = image_of("victim")
    p = subprocess.Popen([HIBER, "checkpoint", "victim", "--out", img], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    start, killed_at = time.time(), None
    while time.time() - start < 60 and p.poll() is None:
        if any('"devices_quiesced"' in f.read_text(errors="replace") for f in (STATE / "journal").glob("*.json")):
            p.kill()
            killed_at = time.time() - start
            break
        time.sleep(0.002)
    p.wait()
    assert killed_at is not None, f"hiber was not caught after the handover: {p.returncode} {p.stderr.read().decode()[-400:]}"
    before = progress("victim")[-1][0]
    r = hiber("recover")
    m.update(killed_after_s=round(killed_at, 2), recover=r.stdout.strip()[-300:])
    assert not Path(img).exists(), "no image from the interrupted checkpoint"
    assert_verified("victim")
    assert progress("victim")[-1][0] == 399 and progress("victim")[-1][0] > before


def keepers_of(job):
    """PIDs of `hiber __keep` processes that keep memory for a process of JOB."""
    mine = {f"{pid}:".encode() for pid in tree_of(job_pid(job))}
    out = []
    for d in Path("/proc").iterdir():
        try:
            args = (d / "cmdline").read_bytes().split(b"\0") if d.name.isdigit() else []
        except OSError:
            continue
        if b"__keep" in args and any(a.startswith(t) for a in args for t in mine):
            out.append(int(d.name))
    return out


@scenario
def agent_hiber_killed_before_the_hand_back_recovers(m):
    """SIGKILL hiber during a --leave-running checkpoint, held after the driver's checkpoint
    (HIBER_PAUSE_AT=captured): the agent has released the job's memory and nothing of it is
    on disk; the keeper hiber started holds a reference to each allocation, and `hiber
    recover` hands them back as they are. The job runs on intact and verifies every word,
    and the keeper is gone."""
    hiber("run", "--name", "kept", "--", program("counter"), "--mib", "2048", "--steps", "400", "--interval-ms", "10")
    wait_step("kept", 30)
    img = image_of("kept")
    p = subprocess.Popen([HIBER, "checkpoint", "kept", "--leave-running", "--out", img], env=dict(ENV, HIBER_PAUSE_AT="captured"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait("hiber to hold after the driver's checkpoint", 60,
             lambda: any('"captured"' in f.read_text(errors="replace") for f in (STATE / "journal").glob("*.json")))
        m["keepers"] = len(keepers_of("kept"))
    finally:
        p.kill()
        p.wait()
    before = progress("kept")[-1][0]
    time.sleep(1)
    assert progress("kept")[-1][0] == before, "the job waits at the agent's gate"
    r = hiber("recover", check=False)
    m["recover"] = (r.stdout + r.stderr).strip()[-400:]
    assert r.returncode == 0 and "lost" not in m["recover"], m["recover"]
    assert not Path(img).exists(), "no image from the interrupted checkpoint"
    assert_verified("kept")
    assert progress("kept")[-1][0] == 399
    time.sleep(3)
    left = keepers_of("kept")
    assert m["keepers"] == 1 and not left, f"one keeper during the checkpoint ({m['keepers']}), none after ({left})"


@scenario
def agent_checkpoint_restore_chain(m):
    """The preemption loop on the GPU, with the agent: the job, then each restored copy,
    checkpointed again, five cycles, stopping and --leave-running alternating (a
    leave-running copy runs beside its original, in a network namespace of its own, before
    the original gives way). After each cycle the copy goes on from where the checkpoint
    caught the job with the original's trajectory; the last one verifies every word."""
    run_job("chain0", program("counter"), "--mib", "1024", "--steps", "3000", "--interval-ms", "10", agent=True)
    wait_step("chain0", 20)
    prev, cycles = "chain0", []
    for i in range(1, 6):
        leave = i % 2 == 0
        img, copy = image_of(f"chain{i}"), f"chain{i}"
        frm = progress(prev)[-1][0]
        ck = hiber_json("checkpoint", prev, *(["--leave-running"] if leave else []), "--out", img)
        until = progress(prev)[-1][0]
        assert state_of(prev) == ("running" if leave else "checkpointed"), f"cycle {i}: {prev} is {state_of(prev)}"
        rs = hiber_json("restore", img, "--name", copy, *(["--isolate-net"] if leave else []))
        wait_step(copy, until + 3)
        ours = progress(copy)
        assert frm < ours[0][0] <= until + 1, f"cycle {i}: copy resumes at {ours[0][0]}, expected {frm + 1}..{until + 1}"
        assert_continues(progress(prev), ours, ours[0][0])
        agent_moved(img, m, at_least=1 << 30)
        if leave:
            hiber("rm", "-f", prev)
        cycles.append({"leave_running": leave, "checkpoint_s": round(ck["total_seconds"], 2), "restore_s": round(rs["total_seconds"], 2)})
        prev = copy
    assert_verified(prev)
    m["cycles"] = cycles
    m.update(checkpoint_s=cycles[-1]["checkpoint_s"], restore_s=cycles[-1]["restore_s"])


@scenario
def agent_failure_at_each_phase_keeps_the_job(m):
    """A checkpoint made to fail at each phase barrier (HIBER_FAIL_AT), once the agent and the
    driver hold the job's GPU state: the job keeps running and computing correctly (its final
    check of every word passes after a later restore), and the next checkpoint works."""
    run_job("phased", program("counter"), "--mib", "1024", "--steps", "2000", "--interval-ms", "10", agent=True)
    wait_step("phased", 20)
    failures = {}
    for phase, extra in (("quiesced", ()), ("captured", ()), ("dumped", ()), ("dumped", ("--leave-running",)), ("committed", ("--leave-running",))):
        img = image_of(f"phased-{phase}")
        p = hiber("checkpoint", "phased", *extra, "--out", img, check=False, env=dict(ENV, HIBER_FAIL_AT=phase))
        assert p.returncode == 1 and "injected failure" in p.stderr and "keeps running" in p.stderr, f"{phase}: {p.returncode} {p.stderr}"
        assert not Path(img).exists(), f"{phase}: no image is left"
        assert state_of("phased") == "running", f"{phase}: the job runs on"
        at = progress("phased")[-1][0]
        wait_step("phased", at + 5)
        failures[phase + "".join(extra)] = p.stderr.strip().splitlines()[0][:160]
    m["failures"] = failures
    img = stop_and_restore("phased", progress("phased")[-1][0] + 2, m)
    agent_moved(img, m, at_least=1 << 30)


@scenario
def no_agent_opt_out(m):
    run_job("plain", program("counter"), "--mib", "1024", "--steps", "300", agent=False)
    img = stop_and_restore("plain", 40, m)
    agent = agent_section(img)
    assert agent_bytes(agent) == 0, f"the agent moved {agent_bytes(agent)} bytes of a --no-agent job"
    sec = cuda_section(img)
    assert sec and sum(p["memory_bytes"] for p in sec["processes"]) >= 1 << 30, "the driver took all the device memory"
    m["agent_section"] = agent is not None


@scenario
def agent_dataloader_workers(m):
    """PyTorch fed by DataLoader(num_workers=2, persistent_workers=True, pin_memory=True): the
    workers are forked after CUDA is initialized. The agent detaches them from the driver's
    mappings, the tree is checkpointed whole, and the restored workers go on delivering the
    same batches (the loss trajectory is bit-identical)."""
    img = training_identical(m, "loader", ("--loader-workers", "2"), agent=True, limit=120)
    procs = image_processes(img)
    assert len(procs) >= 3, f"the image holds the trainer and its two workers: {len(procs)} processes"
    m["processes"] = len(procs)


@scenario
def agent_children_forked_after_cuda(m):
    """A CUDA process's children started after CUDA init: multiprocessing (fork), os.fork,
    subprocess.Popen and os.system; each keeps a counter and answers every step, and the
    restored children continue from their own state."""
    img = identical_run(m, "forks", FORKS, ("--mib", "1024"), agent=True, limit=120)
    m["processes"] = len(image_processes(img))
    assert m["processes"] >= 5, f"the parent, its four children and the shell's cat: {m['processes']} processes"
    assert "verify ok" in log("forks-r")


@scenario
def agent_torch_multiprocessing_cuda_ipc(m):
    """torch.multiprocessing shares CUDA tensors with a spawned consumer (legacy CUDA IPC),
    with the agent on: a --leave-running checkpoint, then a stopping one and a restore; the
    consumer's sums of the producer's memory, and its writes into it, stay on the
    uninterrupted run's trajectory, and fresh tensors are shared and dropped after the
    restore too."""
    steps = "160"
    ref = sh("python3", MP_SHARE, "--steps", steps, timeout=300)
    ref_traj = [(p.step, p.checksum) for p in parse_progress(ref.stdout)]
    assert len(ref_traj) == int(steps) and "verify ok" in ref.stdout, "reference run completed"
    run_job("ipc", "python3", MP_SHARE, "--steps", steps, agent=True, limit=120)
    wait_step("ipc", 30, 120)
    live = image_of("ipc-live")
    ck = hiber_json("checkpoint", "ipc", "--leave-running", "--out", live)
    m["leave_running_s"] = round(ck["total_seconds"], 2)
    wait_step("ipc", 60, 120)
    img = stop_and_restore("ipc", 90, m, wait_limit=120)
    combined = progress("ipc") + progress("ipc-r")
    assert combined == ref_traj, "trajectory differs from the uninterrupted run"
    assert "verify ok" in log("ipc-r"), log("ipc-r")[-500:]
    m["steps_compared"] = len(combined)
    # The producer's memory is in the image once: the consumer holds little of its own,
    # and the reader none, yet it was quiesced (and resumed after the restore) for the
    # producer's memory it had open.
    sec = agent_section(img)
    m["agent_processes"] = [(p["ns_pid"], p["bytes"] >> 20, p.get("ipc_imports", 0)) for p in sec["processes"]]
    assert any(p["bytes"] == 0 and p.get("ipc_imports", 0) > 0 for p in sec["processes"]), m["agent_processes"]
    hiber("rm", live)


@scenario
def no_agent_dataloader_refused_cleanly(m):
    """Without the agent nothing detaches forked workers from the driver's mappings: the
    checkpoint is refused before anything is touched, naming the process, and the job
    trains on undisturbed."""
    run_job("bare", "python3", TRAIN, "--steps", "200", "--loader-workers", "2", agent=False, limit=120)
    wait_step("bare", 20, 120)
    p = hiber("checkpoint", "bare", "--out", image_of("bare"), check=False)
    assert p.returncode == 1 and "keeps running" in p.stderr and "/dev/nvidia" in p.stderr and "agent" in p.stderr, p.stderr
    assert not Path(image_of("bare")).exists(), "no image is left"
    m["error"] = p.stderr.strip()[:300]
    assert_verified("bare")


# JAX's memory settings are its defaults (75% of the GPU preallocated). XLA picks its GPU
# algorithms by timing them, and some reduce with atomics, so two runs of one program differ
# in the last bits (seen: step 50's loss bits differed in each of four runs): these flags
# make runs comparable bit for bit, and change nothing about memory.
JAX_ENV = dict(ENV, XLA_FLAGS="--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0")


@scenario
@exclusive
def agent_jax_defaults(m):
    """JAX with its default memory settings: 75% of the GPU preallocated."""
    img = identical_run(m, "jax", JAX, agent=True, limit=180, ref_timeout=300, env=JAX_ENV)
    m["pool"] = [l for l in log("jax").splitlines() if l.startswith("start")][0].split("pool ")[-1]
    # Most of the pool was never written: found to be zeros on the GPU, and not copied.
    placed = agent_section(img)["placed"]
    m.update(zeros_mib=placed["zeros"] >> 20, direct_mib=placed["direct"] >> 20)
    assert placed["zeros"] >= 32 << 30, f"the untouched pool is found to be zeros: {placed}"


def jax_sharded_checkpointed(m, job):
    """JAX_SHARDED run as JOB with the agent, checkpointed with --leave-running mid-run:
    it trains on to the end on the uninterrupted trajectory. Returns the image and the
    reference trajectory."""
    need_two_gpus()
    steps, args = "300", ("--interval-ms", "10")
    ref = sh("python3", JAX_SHARDED, "--steps", steps, *args, timeout=300, env=JAX_ENV)
    ref_traj = [(p.step, p.checksum) for p in parse_progress(ref.stdout)]
    assert len(ref_traj) == int(steps) and "verify ok" in ref.stdout, f"reference run: {ref.stdout[-400:]} {ref.stderr[-1200:]}"
    # Defaults only: the agent answers XLA's lookups of NCCL, and hiber checkpoints the
    # process inside CRIU's freeze.
    run_job(job, "python3", JAX_SHARDED, "--steps", steps, *args, agent=True, limit=240, env=JAX_ENV)
    wait_step(job, 40, 240)
    m["gpus_per_process"] = gpus_per_process(job)
    assert any(n > 1 for n in m["gpus_per_process"].values()), f"one process on both GPUs: {m['gpus_per_process']}"
    img = image_of(job)
    ck = hiber_logged(m, "checkpoint_log", "checkpoint", job, "--leave-running", "--out", img, env=JAX_ENV)
    m["checkpoint_s"] = round(ck["total_seconds"], 2)
    assert_verified(job, 300)
    assert_on_reference(job, ref_traj)
    m["step_gap_ms"] = step_gap_ms(job, 2, int(steps))
    return img, ref_traj


@scenario
@exclusive
def agent_jax_sharded_two_gpus(m):
    """JAX data-parallel over both GPUs in one process (#41, item 8): XLA loads NCCL itself
    (dlopen, then dlsym of each entry point), one rank per GPU in this one process, and
    the agent's dlsym hands it the agent's entry points. Checkpointed with --leave-running
    mid-run, it trains on, on the uninterrupted trajectory; the image restores in place and
    the copy goes on from the cut; checkpointed again (stopping) and restored, it goes on
    from that cut to the end on the same trajectory (the preemption loop)."""
    img, ref_traj = jax_sharded_checkpointed(m, "jaxs")
    t0 = time.time()
    hiber_logged(m, "restore_log", "restore", img, "--name", "jaxs-r", env=JAX_ENV)
    wait_step("jaxs-r", 0, 180)
    m["restore_until_step_s"] = round(time.time() - t0, 2)
    at = progress("jaxs-r")[-1][0] + 20
    wait_step("jaxs-r", at, 180)
    assert_on_reference("jaxs-r", ref_traj)
    img2 = image_of("jaxs-again")
    hiber_logged(m, "checkpoint_again_log", "checkpoint", "jaxs-r", "--out", img2, env=JAX_ENV)
    before = progress("jaxs-r")
    hiber_logged(m, "restore_again_log", "restore", img2, "--name", "jaxs-r2", env=JAX_ENV)
    assert_verified("jaxs-r2", 300)
    again = assert_on_reference("jaxs-r2", ref_traj)
    assert again[0][0] == before[-1][0] + 1, f"jaxs-r2 resumes at {again[0][0]}, after {before[-1][0]}"
    assert again[-1][0] == 299, "jaxs-r2 ran to the end"


@scenario
@exclusive
def agent_jax_sharded_swapped_gpus(m):
    """The same JAX job's image restored with its two GPUs swapped (--gpu-map 0=1,1=0): the
    copy goes on from the cut to the end on the same trajectory. Known to fail on
    bd7331e (2xH200): the restore completes, then XLA's first step fails with "Failed to set
    memcpy D2D node params: CUDA_ERROR_INVALID_VALUE" (docs/user/gpu-status.md)."""
    img, ref_traj = jax_sharded_checkpointed(m, "jaxw")
    hiber_logged(m, "restore_log", "restore", img, "--name", "jaxw-r", "--gpu-map", "0=1,1=0", env=JAX_ENV)
    assert_verified("jaxw-r", 300)
    got = assert_on_reference("jaxw-r", ref_traj)
    assert got[-1][0] == 299, "jaxw-r ran to the end"


def monitor_samples(job):
    """The NVML monitor's sample lines of JOB's log: (number, ok)."""
    out = []
    for line in log(job).splitlines():
        f = line.split()
        if len(f) >= 3 and f[0] == "sample" and f[1].isdigit():
            out.append((int(f[1]), f[-1] == "ok"))
    return out


@scenario
def agent_nvml_monitor_beside_training(m):
    """A monitor process that reads the GPUs through NVML alone (no CUDA context), beside a
    PyTorch training process in one job (#41, item 9): checkpointed with --leave-running,
    both go on; the image restores, the training on its uninterrupted trajectory and the
    monitor still reading its GPUs through the handles it had, its sample count going on."""
    ref = sh("python3", TRAIN, "--steps", "200", timeout=300)
    ref_traj = [(p.step, p.checksum) for p in parse_progress(ref.stdout)]
    script = f"python3 {NVML_MONITOR} & exec python3 {TRAIN} --steps 200"
    run_job("mon", "sh", "-c", script, agent=True, limit=120)
    wait_step("mon", 50, 120)
    wait("monitor samples", 30, lambda: len(monitor_samples("mon")) >= 5)
    img = image_of("mon")
    ck = hiber_logged(m, "checkpoint_log", "checkpoint", "mon", "--leave-running", "--out", img)
    m["checkpoint_s"] = round(ck["total_seconds"], 2)
    m["image_processes"] = [(p["comm"], p.get("device_files", [])[:3]) for p in image_processes(img)]
    at = len(monitor_samples("mon"))
    wait("the original's monitor after the checkpoint", 30, lambda: len(monitor_samples("mon")) >= at + 5)
    failed = [l for l in log("mon").splitlines() if "sample " in l and not l.endswith(" ok")]
    assert not failed, f"the original monitor's reads failed after the checkpoint: {failed[:5]}"
    hiber("rm", "-f", "mon")
    hiber_logged(m, "restore_log", "restore", img, "--name", "mon-r")
    assert_verified("mon-r")
    got = assert_on_reference("mon-r", ref_traj)
    m["resumed_at"] = got[0][0]
    samples = monitor_samples("mon-r")
    # The failed lines themselves (7dd8144 failed here once, and its report showed only the
    # log's tail, all ok).
    failed = [l for l in log("mon-r").splitlines() if l.startswith("sample ") and not l.endswith(" ok")]
    m["restored_monitor_failed"] = failed[:10]
    assert len(samples) >= 5 and not failed, f"the restored monitor reads its GPUs: {len(samples)} samples, failed: {failed[:10]}"
    assert samples[0][0] > 3, f"the monitor goes on from its checkpoint, not from the start: {samples[:3]}"
    m["monitor_samples_after_restore"] = len(samples)


@scenario
@exclusive
def no_agent_jax_defaults(m):
    """The same JAX job with the driver's checkpoint alone. JAX's default client takes every
    GPU it sees: where that makes it a process on several GPUs (a two-GPU machine), its
    stopping checkpoint is refused (the driver would not restore it), and the job runs on."""
    if len(gpus_here()) < 2:
        identical_run(m, "jaxd", JAX, agent=False, limit=180, ref_timeout=300, env=JAX_ENV)
        return
    run_job("jaxd", "python3", JAX, "--steps", "400", agent=False, limit=180, env=JAX_ENV)
    wait_step("jaxd", 30, 180)
    several = {p: n for p, n in gpus_per_process("jaxd").items() if n > 1}
    m["gpus_per_process"] = gpus_per_process("jaxd")
    if several:
        refused_on_several_gpus(m, "jaxd")
    else:
        # On one GPU after all: the round trip of a one-GPU machine.
        hiber("rm", "-f", "jaxd")
        identical_run(m, "jaxd1", JAX, agent=False, limit=180, ref_timeout=300, env=JAX_ENV)


@scenario
def agent_transformers_generate(m):
    """Hugging Face transformers: greedy decoding with a KV cache, random GPT-2 weights."""
    identical_run(m, "gen", GENERATE, agent=True, limit=180, ref_timeout=300)


@scenario
def agent_cupy(m):
    """CuPy: matrix products and a custom elementwise kernel."""
    identical_run(m, "cupy", CUPY, agent=True, limit=180, ref_timeout=300)


@scenario
def agent_torchrun_one_rank(m):
    """A training script launched by torchrun (its launcher runs a libuv TCPStore, which
    opens an io_uring unless hiber keeps the job off it): the whole tree round-trips."""
    identical_run(m, "trun", TRAIN, agent=True, limit=180, launcher=TORCHRUN)
    m["processes"] = len(image_processes(image_of("trun")))


# ---- two GPUs (nvidia-h200-x2); skipped on a machine with one ----------------------------


def tree_of(root):
    """ROOT and its descendants."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parents.items() if pp in frontier]
        out += frontier
    return out


def gpus_here():
    out = sh("nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits").stdout
    return [(int(i), u.strip(), int(mem)) for i, u, mem in (l.split(",") for l in out.strip().splitlines())]


def need_two_gpus():
    if len(gpus_here()) < 2:
        raise Skip("needs two GPUs (nvidia-h200-x2)")


def used_mib():
    """Device memory used on each GPU, by index."""
    return {i: mem for i, _, mem in gpus_here()}


def two_gpu(base):
    """Registers BASE's scenario twice: with the agent and with --no-agent."""

    def register(fn):
        for on in (True, False):
            def run(m, fn=fn, on=on):
                need_two_gpus()
                fn(m, on)

            run.__name__ = f"{base}_{'agent' if on else 'no_agent'}"
            run.__doc__ = fn.__doc__
            # They compare the GPUs' memory use before and after.
            scenario(exclusive(run))
        return fn

    return register


def restore_moves(m, job, at, gpu_map, expect_on):
    """Stop JOB at step AT, restore it with --gpu-map GPU_MAP, and check that it goes on
    from where it was, verifies, and that its memory now sits where EXPECT_ON says
    ({GPU index: at least MiB})."""
    wait_step(job, at)
    img = image_of(job)
    hiber_json("checkpoint", job, "--out", img)
    before = progress(job)
    p = hiber("restore", img, "--name", job + "-r", "--gpu-map", gpu_map, "--json")
    rs = json.loads(p.stdout)
    # What hiber said on the way (the driver's pairs it fell back to, say).
    notes = [l.strip()[-300:] for l in p.stderr.splitlines() if "WARN" in l or "warn" in l]
    if notes:
        m.setdefault("restore_notes", {})[job] = notes
    wait_step(job + "-r", before[-1][0] + 5)
    used = used_mib()
    m.setdefault("used_mib_after", {})[job] = used
    for gpu, mib in expect_on.items():
        assert used[gpu] >= mib, f"{job} restored with --gpu-map {gpu_map}: GPU {gpu} uses {used[gpu]} MiB, expected at least {mib}"
    m.setdefault("restore_s", round(rs["total_seconds"], 2))
    return before


@two_gpu("gpu_map_onto_the_other_gpu")
def _onto_other(m, agent):
    """A job on GPU 0 restored onto GPU 1 with --gpu-map 0=1 (the driver needs the full
    permutation; hiber completes it): it resumes where it was, on GPU 1, intact."""
    run_job("mv", program("counter"), "--mib", "3072", "--steps", "400", agent=agent)
    before = restore_moves(m, "mv", 40, "0=1", {1: 3072})
    assert used_mib()[0] < 1024, f"GPU 0 is left with {used_mib()[0]} MiB"
    assert_verified("mv-r")
    assert_continues(before, progress("mv-r"), before[-1][0] + 1)


@two_gpu("gpu_swap_two_jobs")
def _swap(m, agent):
    """Two jobs, on GPU 0 and GPU 1, swap GPUs (0=1,1=0)."""
    run_job("sa", program("counter"), "--mib", "2048", "--steps", "400", agent=agent)
    run_job("sb", program("counter"), "--mib", "5120", "--steps", "400", "--device", "1", agent=agent)
    wait_step("sa", 40)
    wait_step("sb", 40)
    for j in ("sa", "sb"):
        hiber_json("checkpoint", j, "--out", image_of(j))
    base = used_mib()
    for j in ("sa", "sb"):
        before = progress(j)
        hiber_json("restore", image_of(j), "--name", j + "-r", "--gpu-map", "0=1,1=0")
        wait_step(j + "-r", before[-1][0] + 3)
    used = used_mib()
    m["used_mib"] = {"before": base, "after": used}
    assert used[0] >= 5120 and 2048 <= used[1] < 5120, f"sb's 5 GiB now on GPU 0, sa's 2 GiB on GPU 1: {used}"
    for j in ("sa", "sb"):
        assert_verified(j + "-r")


def gpu_indices(job):
    """The GPUs (nvidia-smi's indices) on which processes of JOB's tree have contexts."""
    index = {}
    for line in sh("nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader").stdout.splitlines():
        i, u = [x.strip() for x in line.split(",")]
        index[u] = int(i)
    tree = set(tree_of(job_pid(job)))
    used = set()
    for line in sh("nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader").stdout.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) == 2 and f[0].isdigit() and int(f[0]) in tree:
            used.add(index.get(f[1], -1))
    return sorted(used)


def gpus_per_process(job):
    """For each process of JOB's tree with CUDA contexts, on how many GPUs (nvidia-smi)."""
    tree = set(tree_of(job_pid(job)))
    out = sh("nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader").stdout
    n = {}
    for line in out.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) == 2 and f[0].isdigit() and int(f[0]) in tree:
            n[int(f[0])] = n.get(int(f[0]), 0) + 1
    return n


def refused_on_several_gpus(m, job, limit=300):
    """Checkpoints of JOB, run without the agent with a process on several GPUs, stopping
    and --leave-running, are refused before anything is touched (the driver would restore
    it neither into a new process nor into itself if it enabled peer access), and no image
    is left; the job runs on to its own final check."""
    m["gpus_per_process"] = gpus_per_process(job)
    assert any(n > 1 for n in m["gpus_per_process"].values()), f"a process of {job} is on several GPUs: {m['gpus_per_process']}"
    for extra in ((), ("--leave-running",)):
        p = hiber("checkpoint", job, *extra, "--out", image_of(job), check=False)
        m.setdefault("errors", []).append(p.stderr.strip()[:300])
        assert p.returncode == 1 and "GPUs without the agent" in p.stderr and "keeps running" in p.stderr, f"{extra}: rc {p.returncode}: {p.stdout[-300:]} {p.stderr[-600:]}"
        assert not Path(image_of(job)).exists(), "no image is left"
    wait_step(job, progress(job)[-1][0] + 5, limit)
    assert_verified(job, limit)


@two_gpu("gpu_one_process_on_both_gpus")
def _both(m, agent):
    """One process holding memory and computing on both GPUs (peer access), restored with
    the GPUs swapped: the trajectory is the uninterrupted one and both GPUs' memory is
    intact. Without the agent the driver would not restore it (2xH200, driver 580): its
    checkpoint is refused before anything is touched, and the job runs on."""
    if agent:
        identical_run(m, "botha", TWO_GPUS, ("--mib", "2048"), agent=True, limit=120, restore_args=("--gpu-map", "0=1,1=0"))
        return
    run_job("bothd", "python3", TWO_GPUS, "--steps", "300", "--mib", "2048", agent=False, limit=120)
    wait_step("bothd", 30, 120)
    refused_on_several_gpus(m, "bothd")


@two_gpu("gpu_one_process_on_both_gpus_in_place")
def _both_in_place(m, agent):
    """One process on both GPUs, restored onto the same GPUs: the trajectory is the
    uninterrupted one (the swap above differs from this only in the map). Without the agent
    the driver refused even this restore (18cb543): refused before anything is touched."""
    if agent:
        identical_run(m, "bothia", TWO_GPUS, ("--mib", "2048"), agent=True, limit=120)
        return
    run_job("bothid", "python3", TWO_GPUS, "--steps", "300", "--mib", "2048", agent=False, limit=120)
    wait_step("bothid", 30, 120)
    refused_on_several_gpus(m, "bothid")


@scenario
@exclusive
def gpu_two_gpus_without_peer_access_in_place_no_agent(m):
    """One process on both GPUs that never enables peer access (it copies through the
    host), without the agent: refused as one with peer access (from outside the process
    the two cannot be told apart; the driver restored such a process in place, ee189ad)."""
    need_two_gpus()
    run_job("nopeer", "python3", TWO_GPUS, "--steps", "300", "--mib", "1024", "--via-host", agent=False, limit=120)
    wait_step("nopeer", 30, 120)
    refused_on_several_gpus(m, "nopeer")


@two_gpu("gpu_cuda_visible_devices_1")
def _cvd(m, agent):
    """A job started with CUDA_VISIBLE_DEVICES=1, restored onto GPU 0 with --gpu-map 1=0."""
    env = dict(ENV, CUDA_VISIBLE_DEVICES="1")
    hiber("run", "--name", "cvd", *([] if agent else ["--no-agent"]), "--", program("counter"), "--mib", "3072", "--steps", "400", env=env)
    wait_step("cvd", 30)
    assert used_mib()[1] >= 3072, f"the job runs on GPU 1: {used_mib()}"
    before = restore_moves(m, "cvd", 40, "1=0", {0: 3072})
    assert_verified("cvd-r")
    assert_continues(before, progress("cvd-r"), before[-1][0] + 1)


TORCHRUN2 = ("python3", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")


def rings_in(tree):
    """(pid, comm) of every process of TREE holding an io_uring."""
    rings = []
    for pid in tree:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                if "io_uring" in os.readlink(fd):
                    rings.append((pid, Path(f"/proc/{pid}/comm").read_text().strip()))
        except OSError:
            pass
    return rings


@scenario
@exclusive
def nccl_ddp_refused_cleanly_no_agent(m):
    """A two-rank DDP job over NCCL without the agent, launched by torchrun: no process of
    it holds an io_uring (hiber keeps the launcher's store off it), and its checkpoint is
    refused before anything is touched, naming NCCL; the job trains on to its own check."""
    need_two_gpus()
    job = "ddpd"
    run_job(job, *TORCHRUN2, DDP, "--steps", "300", agent=False, limit=180)
    wait_step(job, 30, 180)
    tree = tree_of(job_pid(job))
    rings = rings_in(tree)
    m["processes"] = len(tree)
    assert len(tree) >= 3 and not rings, f"the launcher and two ranks, none with an io_uring: {len(tree)} processes, rings {rings}"
    p = hiber("checkpoint", job, "--out", image_of(job), check=False)
    m["error"] = p.stderr.strip()[:400]
    assert p.returncode == 1 and "NCCL communicator" in p.stderr and "keeps running" in p.stderr, f"rc {p.returncode}: {p.stdout[-300:]} {p.stderr[-600:]}"
    assert not Path(image_of(job)).exists(), "no image is left"
    at = progress(job)[-1][0]
    wait_step(job, at + 10)
    assert_verified(job, 300)


def nccl_reference(mode, steps, args):
    """The uninterrupted trajectory of ddp.py in MODE, outside hiber."""
    ref = sh(*TORCHRUN2, DDP, "--mode", mode, "--steps", steps, *args, timeout=300)
    traj = [(p.step, p.checksum) for p in parse_progress(ref.stdout)]
    assert len(traj) == int(steps) and "verify ok" in ref.stdout, f"reference run: {ref.stdout[-500:]} {ref.stderr[-1500:]}"
    return traj


def step_gap_ms(job, lo, hi):
    """The longest pause between two consecutive steps of JOB logged between steps LO and HI
    (the job's own clock): what a checkpoint in between cost it."""
    ps = [p for p in parse_progress(log(job)) if lo <= p.step <= hi]
    return max((b.t_ms - a.t_ms for a, b in zip(ps, ps[1:])), default=0)


def assert_on_reference(job, ref):
    got = progress(job)
    want = dict(ref)
    assert got, f"{job} logged no step"
    bad = [(s, c, want.get(s)) for s, c in got if want.get(s) != c]
    assert not bad, f"{job} left the uninterrupted trajectory at {bad[:3]} (step, got, want)"
    return got


def hiber_logged(m, key, *args, env=None):
    """hiber ARGS --json with HIBER_LOG=info: the JSON, and hiber's own account of where the
    time went in M[KEY]. On failure, the error lines of the CRIU log it names go with the
    error."""
    p = hiber(*args, "--json", env=dict(env or ENV, HIBER_LOG="hiber_core=info"), check=False)
    m[key] = [l.strip()[-260:] for l in p.stderr.splitlines() if "INFO" in l][-14:]
    if p.returncode != 0:
        criu = [l.split("CRIU's log: ", 1)[1].strip() for l in p.stderr.splitlines() if "CRIU's log: " in l]
        if criu and Path(criu[0]).exists():
            lines = Path(criu[0]).read_text(errors="replace").splitlines()
            m[key + "_criu_errors"] = [l[-300:] for i, l in enumerate(lines) if "Error" in l or "rror" in lines[min(i + 1, len(lines) - 1)]][:24]
        raise AssertionError(f"hiber {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()[-700:]}")
    return json.loads(p.stdout)


TCP_STATES = {"01": "ESTAB", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "0A": "LISTEN"}


def job_sockets(job):
    """The TCP sockets of JOB's processes, `PID STATE LOCAL REMOTE` (IPv4, from
    /proc/PID/net/tcp and the sockets each holds): NCCL's, the store's."""
    out = []
    for pid in tree_of(job_pid(job)):
        inodes = set()
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                t = os.readlink(fd)
                if t.startswith("socket:["):
                    inodes.add(t[8:-1])
            lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
        except OSError:
            continue

        def addr(h):
            ip, port = h.split(":")
            return ".".join(str(int(ip[i:i + 2], 16)) for i in (6, 4, 2, 0)) + f":{int(port, 16)}"

        for l in lines:
            f = l.split()
            if len(f) > 9 and f[9] in inodes:
                out.append(f"{pid} {TCP_STATES.get(f[3], f[3])} {addr(f[1])} {addr(f[2])}")
    return out[:40]


def nccl_round_trip(m, mode, steps="600", mib="2048", interval="10"):
    """A two-rank job over NCCL (MODE of ddp.py) checkpointed with --leave-running at step
    40: it trains on, on the uninterrupted run's trajectory, paused for no longer than the
    checkpoint's downtime. The image is then restored twice, once with the GPUs swapped
    (0=1,1=0) and once in place: each copy goes on from the cut on the same trajectory, and
    its ranks agree at the end, their stack limit as they set it."""
    need_two_gpus()
    # A stack limit of 4 KiB (1 GiB of local memory per rank on an H100) that no kernel
    # reaches: the agent lowers it for the driver's checkpoint, and must set it back.
    args = ("--mib", mib, "--interval-ms", interval, "--stack-limit", "4096")
    ref = nccl_reference(mode, steps, args)
    job = "nc" + mode[:4]
    # SUITE_NCCL_ENV=K=V,... adds to the jobs' environment (to try NCCL's settings).
    extra_env = dict(kv.split("=", 1) for kv in filter(None, os.environ.get("SUITE_NCCL_ENV", "").split(",")))
    run_job(job, *TORCHRUN2, DDP, "--mode", mode, "--steps", steps, *args, agent=True, limit=180, env=dict(ENV, **extra_env))
    wait_step(job, 40, 180)
    m["sockets"] = job_sockets(job)
    img = image_of(job)
    ck = hiber_logged(m, "checkpoint_log", "checkpoint", job, "--leave-running", "--out", img)
    m["checkpoint_s"] = round(ck["total_seconds"], 2)
    m["devices_s"] = round(ck["devices_seconds"], 3)
    m["pause_steps"] = ck.get("pause_steps")
    assert_verified(job)
    assert_on_reference(job, ref)
    assert len(progress(job)) == int(steps), "the original ran every step"
    # The job's own clock: its longest pause between two steps (the checkpoint's downtime,
    # or a step's own time where the checkpoint cost less).
    m["step_gap_ms"] = step_gap_ms(job, 2, int(steps))
    agent = agent_section(img)
    m["agent_mib"] = sum(p["bytes"] for p in agent["processes"]) >> 20
    failures = []
    for name, extra in ((job + "-r", ("--gpu-map", "0=1,1=0")), (job + "-r2", ())):
        try:
            t0 = time.time()
            hiber_logged(m, "restore_log_" + name, "restore", img, "--name", name, *extra)
            wait_step(name, 0, 120)
            m.setdefault("restore_until_step_s", []).append(round(time.time() - t0, 2))
            assert_verified(name)
            got = assert_on_reference(name, ref)
            assert got[-1][0] == int(steps) - 1, f"{name} ran to the end"
            m.setdefault("resumed_at", []).append(got[0][0])
        except AssertionError as e:
            failures.append(f"{name} {' '.join(extra)}: {e}")
    assert not failures, " | ".join(failures)


@scenario
@exclusive
def nccl_ddp_leave_running_and_restored_twice(m):
    nccl_round_trip(m, "ddp")


@scenario
@exclusive
def nccl_fsdp_leave_running_and_restored_twice(m):
    nccl_round_trip(m, "fsdp")


@scenario
@exclusive
def nccl_allreduce_leave_running_and_restored_twice(m):
    nccl_round_trip(m, "allreduce")


@scenario
@exclusive
def nccl_ddp_stop_and_restore(m):
    """A DDP job stopped by its checkpoint and restored: it goes on from the cut on the
    uninterrupted trajectory; no process of the launcher's tree holds an io_uring."""
    need_two_gpus()
    ref = nccl_reference("ddp", "200", ())
    run_job("ncstop", *TORCHRUN2, DDP, "--steps", "200", agent=True, limit=180)
    wait_step("ncstop", 40, 180)
    tree = tree_of(job_pid("ncstop"))
    assert not rings_in(tree), "no io_uring"
    m["processes"] = len(tree)
    img = image_of("ncstop")
    ck = hiber_logged(m, "checkpoint_log", "checkpoint", "ncstop", "--out", img)
    m["checkpoint_s"] = round(ck["total_seconds"], 2)
    before = progress("ncstop")
    t0 = time.time()
    hiber_logged(m, "restore_log", "restore", img, "--name", "ncstop-r")
    wait_step("ncstop-r", before[-1][0] + 1, 120)
    m["restore_until_step_s"] = round(time.time() - t0, 2)
    assert_verified("ncstop-r")
    assert_on_reference("ncstop", ref)
    got = assert_on_reference("ncstop-r", ref)
    assert got[0][0] == before[-1][0] + 1, f"resumes at {got[0][0]}, after {before[-1][0]}"


def rank_killed(m, job, hiber_dies):
    """Rank 1 of a two-rank DDP job is killed while hiber holds the job after the NCCL cut
    (HIBER_PAUSE_AT=quiesced). The surviving rank gets its memory back, and since its
    communicators cannot be built again without its peer, its NCCL calls fail as after a
    peer's death in NCCL instead of waiting for ever: PyTorch raises, the rank ends, and so
    does the job. The ranks are started by a plain shell loop that waits for both (torchrun
    would stop the survivor itself as soon as a worker dies, which hides what hiber does).
    HIBER_DIES: hiber is killed too, and `hiber recover` undoes the checkpoint."""
    need_two_gpus()
    port = 29533 if hiber_dies else 29534
    loop = ("for r in 0 1; do RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=%d "
            f"python3 {DDP} --steps 100000 --interval-ms 10 & done; wait") % port
    run_job(job, "sh", "-c", loop, agent=None)
    wait_step(job, 30, 180)
    ranks = {}
    for pid in tree_of(job_pid(job)):
        try:
            for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if kv.startswith(b"LOCAL_RANK="):
                    ranks[int(kv[len(b"LOCAL_RANK="):])] = pid
        except OSError:
            pass
    assert set(ranks) == {0, 1}, f"two ranks: {ranks}"
    # With HIBER_DIES, a stopping checkpoint: it writes the memory before the agents release
    # it, and `hiber recover` loads that back (a --leave-running one's memory comes back from
    # the keeper instead: agent_hiber_killed_before_the_hand_back_recovers).
    argv = [HIBER, "checkpoint", job, "--out", image_of(job)] + ([] if hiber_dies else ["--leave-running"])
    env = dict(ENV, HIBER_PAUSE_AT="quiesced", **({} if hiber_dies else {"HIBER_PAUSE_MS": "4000"}))
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def held():
            # This checkpoint's own journal entry (other scenarios run beside this one).
            for f in (STATE / "journal").glob("*.json"):
                try:
                    e = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                if e.get("hiber_pid") == p.pid and '"devices_quiesced"' in f.read_text(errors="replace"):
                    return True
            return False
        wait("hiber to hold the job after the cut", 120, held)
        os.kill(ranks[1], 9)
        if hiber_dies:
            p.kill()
        out, err = p.communicate(timeout=180)
    finally:
        p.kill()
    if hiber_dies:
        r = hiber("recover", check=False)
        m["recover"] = (r.stdout + r.stderr).strip()[-500:]
        said = r.stdout + r.stderr
        assert "are gone" in said and "problem:" not in said and "panicked" not in r.stderr, m["recover"]
    else:
        m["checkpoint"] = err.strip().splitlines()[-3:]
        assert p.returncode != 0 and "panicked" not in err, f"the checkpoint fails once a rank is gone: {p.returncode} {err[-800:]}"
        # Named as the rank's end, with nothing left for `hiber recover` to retry.
        assert "ended during the checkpoint" in err and "so did its undo" not in err, err[-800:]
        left = list((STATE / "journal").glob(f"checkpoint-*-{p.pid}.json"))
        assert not left, f"the journal keeps the checkpoint: {left}"
    t0 = time.time()
    wait(f"{job} to end", 180, lambda: state_of(job) != "running")
    m["ended_after_s"] = round(time.time() - t0, 1)
    m["ended_as"] = state_of(job)
    tail = (STATE / "jobs" / job / "stderr.log").read_text(errors="replace")[-2000:]
    m["rank0_error"] = [line for line in tail.splitlines() if "NCCL" in line or "Error" in line][-3:]
    assert not Path(image_of(job)).exists(), "no image of the interrupted checkpoint"


@scenario
@exclusive
def nccl_rank_killed_during_checkpoint_fails_the_other(m):
    """The fault case: rank 1 killed during a --leave-running checkpoint, which hiber then
    carries on with: the checkpoint fails, no image, and rank 0 ends as after a peer's death."""
    rank_killed(m, "ncdie", hiber_dies=False)


@scenario
@exclusive
def nccl_rank_and_hiber_killed_recover_fails_the_other(m):
    """The double fault: rank 1 killed during a stopping checkpoint, then hiber itself, then
    `hiber recover`: rank 0 gets its memory back from the partial image and ends as after a
    peer's death."""
    rank_killed(m, "ncdie2", hiber_dies=True)


def xhost_env(rank):
    """Rank RANK of a two-rank job whose ranks are started apart, as on two hosts. Each is a
    host of its own to NCCL (NCCL_HOSTID), which then connects them through its socket
    transport over loopback as it would two hosts, rather than through the GPU (two ranks of
    one host may not share a GPU, and one GPU is all this scenario needs). With
    SUITE_XHOST_SPREAD=1 rank r is on GPU r: two hosts of one GPU each."""
    gpu = str(rank) if os.environ.get("SUITE_XHOST_SPREAD") == "1" else "0"
    env = dict(ENV, NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1", WORLD_SIZE="2", LOCAL_RANK=gpu, RANK=str(rank),
               NCCL_HOSTID=f"hiber-suite-host{rank}", NCCL_DEBUG="WARN")
    # SUITE_XHOST_ENV (K=V,K=V) adds to these or replaces them; a piece without `=` belongs
    # to the value before it (NCCL_DEBUG_SUBSYS=INIT,NET).
    pairs = []
    for piece in filter(None, os.environ.get("SUITE_XHOST_ENV", "").split(",")):
        if "=" in piece or not pairs:
            pairs.append(piece.split("=", 1))
        else:
            pairs[-1][1] += "," + piece
    env.update(pairs)
    return env


def xhost_cmd(init, steps):
    return ("python3", str(DDP), "--mode", "ddp", "--init-file", init, "--steps", steps, "--mib", "1024", "--interval-ms", "10")


def coordinated(m, key, commands, extra_env=(), hosts=None, net_opt_in=True):
    """`hiber coordinate` and one hiber per command of COMMANDS (each with --coordinator and
    --json), all at once, each given the matching dict of EXTRA_ENV: the coordinator's exit
    and output, and each participant's (returncode, JSON or None, stderr). Kept in M[KEY].
    With HOSTS (a NetnsHosts), command i runs in host i's network namespace, and the
    coordinator in host 0's, on its address."""
    import secrets
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ip = hosts.addrs[0] if hosts else "127.0.0.1"
    addr = f"{ip}:{port}"
    # The ranks' communicators go over NCCL's network transport, which hiber refuses where
    # two ranks share a GPU unless told to try (HIBER_NCCL_NET=1): these scenarios show why.
    # NET_OPT_IN False: hiber's default, as a job across hosts with a GPU per rank gets it.
    env = dict(ENV, HIBER_SESSION=secrets.token_hex(16))
    if net_opt_in:
        env["HIBER_NCCL_NET"] = "1"
    inside = (lambda i: hosts.enter(i)) if hosts else (lambda i: [])
    coord = subprocess.Popen([*inside(0), HIBER, "coordinate", "--participants", str(len(commands)), "--listen", addr, "--timeout", "120"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def listening():
        if hosts:
            return "coordinating" in (coord.stdout.readline() if coord.poll() is None else "coordinating")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    wait("the coordinator to listen", 30, listening)
    extra = list(extra_env) + [{}] * (len(commands) - len(extra_env))
    procs = [subprocess.Popen([*inside(i), HIBER, *map(str, c), "--coordinator", addr, "--json"], env=dict(env, HIBER_LOG="hiber_core=info", **x),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i, (c, x) in enumerate(zip(commands, extra))]
    parts = []
    for p in procs:
        out, err = p.communicate(timeout=400)
        try:
            js = json.loads(out) if p.returncode == 0 else None
        except ValueError:
            js = None
        parts.append((p.returncode, js, err))
    cout, cerr = coord.communicate(timeout=60)
    m[key] = {"coordinator": (coord.returncode, (cout + cerr).strip()[-300:]),
              "participants": [(rc, [l.strip()[-220:] for l in err.splitlines() if "NCCL" in l or "rror" in l][-4:]) for rc, _, err in parts]}
    return coord.returncode, parts


@scenario
@exclusive
def nccl_two_jobs_one_cut_coordinated(m):
    """An NCCL job whose two ranks are two jobs, each checkpointed by a hiber of its own, as
    on two hosts, held together by `hiber coordinate`: the NCCL cut runs across the two
    hibers over the coordinator (counts gathered, every rank drained before any tears down,
    rank 0's hiber drawing the id the other builds with). First a failure on one side after
    both tore their communicators down (HIBER_FAIL_AT=captured): both abort, build the
    communicator again together in the coordinator's undo round, and train on. Then the
    `--leave-running` cut: both train on, on the uninterrupted trajectory. Then both
    originals go, and the two images are restored together: the copies go on from the cut
    to the end, on the same trajectory, and agree. Fails with the code of 3f3497a as the scenario
    above does: the cut, the undo round and the rebuild all pass, then a rank faults a few
    steps later (the network transport's fault, not the coordination's)."""
    steps = "700"
    ref = xhost_reference(steps, "two")
    init = f"/tmp/hiber-suite-xinit-{os.getpid()}"
    Path(init).unlink(missing_ok=True)
    jobs = ("nx0", "nx1")
    for r, job in enumerate(jobs):
        hiber("run", "--name", job, "--", *xhost_cmd(init, steps), env=xhost_env(r))
    for job in jobs:
        wait_step(job, 40, 180)
        assert "libhiber_agent" in Path(f"/proc/{job_pid(job)}/maps").read_text(), f"the agent is mapped into {job}"
    imgs = [image_of(j) for j in jobs]
    try:
        xhost_cut_and_restore(m, jobs, imgs, ref, steps)
    except AssertionError:
        keep_ranks_said(m, jobs + tuple(j + "-r" for j in jobs))
        raise
    finally:
        Path(init).unlink(missing_ok=True)


# iproute2's ip: this machine's, or the one scripts/gpu-carry.sh carries (with its libraries)
# where there is none (the GPU machine).
IP = ["ip"] if shutil.which("ip") else ["env", f"LD_LIBRARY_PATH={CARRY / 'lib'}", str(CARRY / "bin" / "ip")]


class NetnsHosts:
    """Two "hosts": network namespaces joined by a veth pair, at 10.88.N.1 and 10.88.N.2,
    each held by a process (`unshare --net sleep`), as the CI tests make them
    (crates/hiber/tests/common/hosts.rs). Raises Skip where namespaces or veth cannot be
    made (the reason goes into the report)."""

    def __init__(self, n=0):
        self.holders, self.addrs = [], [f"10.88.{n}.1", f"10.88.{n}.2"]
        tag = f"{os.getpid() % 10000}{n}"
        self.devs = [f"vhA{tag}", f"vhB{tag}"]
        try:
            for _ in range(2):
                self.holders.append(subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"]))
            for h in self.holders:
                wait("a network namespace", 10, lambda: os.readlink(f"/proc/{h.pid}/ns/net") != os.readlink("/proc/self/ns/net"))
            ip = IP
            sh(*ip, "link", "add", self.devs[0], "type", "veth", "peer", "name", self.devs[1])
            for i, h in enumerate(self.holders):
                sh(*ip, "link", "set", self.devs[i], "netns", str(h.pid))
                ns = self.enter(i)
                sh(*ns, *ip, "addr", "add", self.addrs[i] + "/24", "dev", self.devs[i])
                sh(*ns, *ip, "link", "set", self.devs[i], "up")
                sh(*ns, *ip, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, FileNotFoundError, AssertionError) as e:
            self.close()
            raise Skip(f"cannot make network namespace hosts here: {e}")

    def enter(self, i):
        """The command prefix that runs a program in host I's network namespace only."""
        return ["nsenter", "-F", f"--net=/proc/{self.holders[i].pid}/ns/net"]

    def close(self):
        for h in self.holders:
            h.kill()
            h.wait()


def netns_env(hosts, rank, gpu):
    """Rank RANK on host RANK of HOSTS (its GPU: GPU), NCCL over its socket transport on the
    host's veth. The hosts share this machine's name, so NCCL_HOSTID tells them apart."""
    return dict(ENV, NCCL_SOCKET_IFNAME=hosts.devs[rank], NCCL_IB_DISABLE="1", WORLD_SIZE="2", LOCAL_RANK=str(gpu), RANK=str(rank),
                NCCL_HOSTID=f"hiber-netns-host{rank}", NCCL_DEBUG="WARN")


@scenario
@exclusive
def nccl_netns_hosts_coordinated_cut_restored_swapped(m):
    """#38, NCCL across hosts: two ranks of one NCCL job, each on a host of its own (a
    network namespace with its own address and veth, one GPU each), talking over NCCL's socket
    transport, each a job of the hiber of its host, with hiber's defaults (no
    HIBER_NCCL_NET: a rank per GPU is cut). `hiber coordinate` on host A holds them
    as one cut (`--leave-running`: they train on, on the uninterrupted trajectory); then the
    originals go and both images are restored together with their GPUs swapped (host A's rank
    onto GPU 1, host B's onto GPU 0), the communicator rebuilt through the coordinator's
    exchange: they run to the end on the same trajectory and verify."""
    hosts = NetnsHosts()
    jobs = ("nn0", "nn1")
    init = f"/tmp/hiber-suite-netns-{os.getpid()}"
    try:
        steps = "500"
        env_of = lambda r: netns_env(hosts, r, r)  # noqa: E731 - rank r on host r and GPU r
        ref = xhost_reference(steps, "netns", env_of, hosts.enter)
        Path(init).unlink(missing_ok=True)
        for r, j in enumerate(jobs):
            sh(*hosts.enter(r), HIBER, "run", "--name", j, "--", *xhost_cmd(init, steps), env=env_of(r))
        for j in jobs:
            wait_step(j, 40, 180)
        imgs = [image_of(j) for j in jobs]
        xhost_cut(m, jobs, imgs, ref, hosts, net_opt_in=False)
        # SUITE_NETNS_GPUS=same restores each rank onto the GPU it had (to tell a fault of
        # the swap from one of the rebuild).
        swap = os.environ.get("SUITE_NETNS_GPUS", "swap") == "swap"
        xhost_restore_together(m, jobs, imgs, hosts, [("--gpu-map", "0=1"), ("--gpu-map", "1=0")] if swap else None, net_opt_in=False)
        for j in jobs:
            wait(f"{j}-r to compute", 120, lambda: len(progress(j + "-r")) >= 3)
        m["gpus_after"] = [gpu_indices(j + "-r") for j in jobs]
        want = [[1], [0]] if swap else [[0], [1]]
        assert m["gpus_after"] == want, f"the ranks' GPUs after the restore: {m['gpus_after']}, expected {want}"
        xhost_ran_to_the_end(m, jobs, ref, steps)
    except AssertionError:
        keep_ranks_said(m, jobs + tuple(j + "-r" for j in jobs))
        raise
    finally:
        for j in jobs + tuple(j + "-r" for j in jobs):
            hiber("rm", "-f", j, check=False)
        Path(init).unlink(missing_ok=True)
        hosts.close()


MPI_RSH_AGENT = REPO / "crates/hiber/tests/fixtures/mpi_rsh_agent.sh"
SSHD_STANDIN = REPO / "crates/hiber/tests/fixtures/sshd_standin.py"


def mpi_cuda_program():
    """gpu/programs/mpi_cuda_ring.cu built with nvcc and Open MPI's flags (mpicc's, or the
    usual places of Debian's and Ubuntu's openmpi). Skip where this machine has no Open MPI."""
    if not shutil.which("mpirun"):
        raise Skip("no mpirun here")
    flags = []
    if shutil.which("mpicc"):
        for what in ("compile", "link"):
            got = sh("mpicc", f"--showme:{what}", check=False)
            flags += got.stdout.split() if got.returncode == 0 else []
    if not any(f.startswith("-I") for f in flags):
        inc = [d for d in ("/usr/lib/x86_64-linux-gnu/openmpi/include", "/usr/include/openmpi", "/usr/include/x86_64-linux-gnu/openmpi") if Path(d, "mpi.h").exists()]
        if not inc:
            raise Skip("Open MPI's mpi.h is not here (no libopenmpi-dev)")
        flags = [f"-I{inc[0]}", "-L/usr/lib/x86_64-linux-gnu/openmpi/lib", "-lmpi"]
    # nvcc takes the host linker's flags through -Xlinker, and -pthread as a compiler flag.
    args = []
    for f in flags:
        if f.startswith("-Wl,"):
            args += ["-Xlinker", f[4:]]
        elif f == "-pthread":
            args += ["-Xcompiler", "-pthread"]
        else:
            args.append(f)
    out = BUILD / "mpi_cuda_ring"
    b = sh("nvcc", "-O2", "-o", out, REPO / "gpu/programs/mpi_cuda_ring.cu", *args, check=False, timeout=300)
    if b.returncode != 0:
        raise Skip(f"nvcc could not build mpi_cuda_ring.cu: {b.stderr[-400:]}")
    return out


@scenario
@exclusive
def mpi_cuda_ranks_on_two_netns_hosts_cut_and_restored(m):
    """#38, MPI with CUDA across hosts: an Open MPI job of two ranks, each on a host of its own
    (a network namespace with its own address, veth between them) and on a GPU of its own
    (rank 0 on GPU 0 on host A, rank 1 on GPU 1 on host B), each rank's memory on its GPU
    through the agent, the ranks talking over Open MPI's TCP transport between the hosts.
    mpirun is a job of host A's hiber; it starts its daemon on host B over the rsh agent as a
    job of B's hiber (`orte_launch_agent`), as users start multi-host jobs. `hiber coordinate`
    cuts both hosts as one: with --leave-running (the job runs on, on the uninterrupted
    trajectory), then stopping; the two images are restored in place together and the job
    ends on the uninterrupted trajectory, every rank's device memory intact."""
    need_two_gpus()
    prog = mpi_cuda_program()
    steps, pause, mib = "1000", "30", "512"
    # `--mca plm rsh` below: the GPU machine's environment sets OMPI_MCA_plm=isolated (every
    # rank on the local host), as containers made for one node often do; a cluster's has ssh.
    mpi = ["--allow-run-as-root", "--oversubscribe"]
    ref = sh("mpirun", *mpi, "-np", "2", prog, steps, "0", mib, timeout=300)
    ref_traj = [(p.step, p.checksum) for p in parse_progress(ref.stdout)]
    assert len(ref_traj) == int(steps) and "verify ok" in ref.stdout, f"reference run: {ref.stdout[-400:]} {ref.stderr[-800:]}"
    hosts = NetnsHosts(1)
    port = "2222"
    sshd = []
    jobs = ("mpig", "orted", "mpig-r", "orted-r")
    try:
        for i in range(2):
            p = subprocess.Popen([*hosts.enter(i), "python3", SSHD_STANDIN, hosts.addrs[i], port], env=ENV, stdout=subprocess.PIPE, text=True)
            sshd.append(p)
            assert p.stdout.readline().strip() == "listening", "the sshd stand-in listens"
        net = hosts.addrs[0].rsplit(".", 1)[0] + ".0/24"
        cmd = ["mpirun", *mpi, "--host", f"{hosts.addrs[0]}:1,{hosts.addrs[1]}:1", "-np", "2",
               "--mca", "plm", "rsh", "--mca", "plm_rsh_agent", MPI_RSH_AGENT, "--mca", "orte_launch_agent", f"{HIBER} run --name orted -- orted",
               "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", net, "--mca", "oob_tcp_if_include", net,
               prog, steps, pause, mib]
        sh(*hosts.enter(0), HIBER, "run", "--name", "mpig", "--", *cmd, env=dict(ENV, HIBER_MPI_SSHD_PORT=port))
        wait_step("mpig", 20, 120)
        said = log("mpig") + log("orted")
        m["ranks"] = [l for l in said.splitlines() if l.startswith("start rank")]
        assert state_of("orted") == "running", "the daemon on host B is a job of the hiber there"
        for j in ("mpig", "orted"):
            assert any("libhiber_agent" in Path(f"/proc/{p}/maps").read_text() for p in job_pids(j) if Path(f"/proc/{p}/maps").exists()), f"the agent is in {j}'s ranks"
        used = {j: gpus_per_process(j) for j in ("mpig", "orted")}
        m["gpus_per_process"] = used
        imgs = [image_of("mpig-1"), image_of("orted-1")]
        rc, parts = coordinated(m, "cut", [("checkpoint", "mpig", "--leave-running", "--out", imgs[0]), ("checkpoint", "orted", "--leave-running", "--out", imgs[1])], hosts=hosts)
        assert rc == 0 and all(p[0] == 0 for p in parts), f"coordinated --leave-running cut: {m['cut']}"
        m["paused_s"] = [round(p[1]["paused_seconds"] or 0, 2) for p in parts]
        at = progress("mpig")[-1][0]
        wait_step("mpig", at + 20, 120)
        assert_on_reference("mpig", ref_traj)
        stops = [image_of("mpig-2"), image_of("orted-2")]
        rc, parts = coordinated(m, "stop", [("checkpoint", "mpig", "--out", stops[0]), ("checkpoint", "orted", "--out", stops[1])], hosts=hosts)
        assert rc == 0 and all(p[0] == 0 for p in parts), f"coordinated stopping cut: {m['stop']}"
        m["checkpoint_s"] = [round(p[1]["total_seconds"], 2) for p in parts]
        cut_at = progress("mpig")[-1][0]
        rc, parts = coordinated(m, "restore", [("restore", stops[0], "--name", "mpig-r"), ("restore", stops[1], "--name", "orted-r")], hosts=hosts)
        assert rc == 0 and all(p[0] == 0 for p in parts), f"coordinated restore: {m['restore']}"
        m["restore_s"] = [round(p[1]["total_seconds"], 2) for p in parts if p[1]]
        assert_verified("mpig-r", 240)
        got = assert_on_reference("mpig-r", ref_traj)
        assert got[0][0] == cut_at + 1 and got[-1][0] == int(steps), f"mpig-r resumes after {cut_at} and runs to the end: {got[0]}..{got[-1]}"
        assert "device memory intact" in log("mpig-r"), log("mpig-r")[-300:]
        m["resumed_at"] = got[0][0]
    except AssertionError:
        keep_ranks_said(m, jobs)
        for j in jobs:
            f = STATE / "jobs" / j / "stdout.log"
            if f.exists():
                (OUT / f"{j}-stdout.log").write_text(f.read_text(errors="replace")[-100_000:])
        raise
    finally:
        for j in jobs:
            hiber("rm", "-f", j, check=False)
        for p in sshd:
            p.kill()
            p.wait()
        hosts.close()


def xhost_reference(steps, tag, env_of=xhost_env, enter=lambda r: []):
    """The uninterrupted trajectory of the two socket-transport ranks, outside hiber (rank r
    with ENV_OF(r), started by the command prefix ENTER(r))."""
    ref_init = f"/tmp/hiber-suite-xref-{tag}-{os.getpid()}"
    Path(ref_init).unlink(missing_ok=True)
    procs = [subprocess.Popen([*enter(r), *xhost_cmd(ref_init, steps)], env=env_of(r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    out = [p.communicate(timeout=300) for p in procs]
    ref = [(p.step, p.checksum) for p in parse_progress(out[0][0])]
    assert len(ref) == int(steps) and "verify ok" in out[0][0], f"reference run: {out[0][0][-300:]} {out[0][1][-1500:]}"
    return ref


def xhost_one_job(job, steps):
    """Both socket-transport ranks in one job, started by a shell loop (each rank's lines
    prefixed `r0 `/`r1 `), at step 40. Returns the rendezvous file."""
    init = f"/tmp/hiber-suite-xinit-{job}-{os.getpid()}"
    Path(init).unlink(missing_ok=True)
    cmd = " ".join(xhost_cmd(init, steps))
    # SUITE_XHOST_SPREAD=1 puts rank r on GPU r (two GPUs): the shape of two hosts, one GPU
    # each, rather than two ranks sharing one GPU.
    spread = os.environ.get("SUITE_XHOST_SPREAD") == "1"
    gpu = "LOCAL_RANK=$r " if spread else ""
    loop = f"for r in 0 1; do RANK=$r {gpu}NCCL_HOSTID=hiber-suite-host$r {cmd} 2>&1 | sed -u -n \"s/^/r$r /p\" & done; wait"
    env = {k: v for k, v in xhost_env(0).items() if k not in ("RANK", "NCCL_HOSTID") + (("LOCAL_RANK",) if spread else ())}
    hiber("run", "--name", job, "--", "sh", "-c", loop, env=env)
    wait(f"{job} to reach step 40", 180, lambda: len(progress(job, "r0 ")) > 40)
    return init


def xhost_trains_on(m, job, ref, n):
    at = progress(job, "r0 ")[-1][0]
    try:
        # (A rank that faults ends the job: no need to wait the whole limit.)
        wait(f"{job} to reach step {at + n}", 120, lambda: all(progress(job, r) and progress(job, r)[-1][0] >= at + n for r in ("r0 ", "r1 ")) or state_of(job) != "running")
        # A job that ran to its last step and verified on both ranks trained on too (on a
        # fast machine the image takes longer to write than the rest of the job runs).
        last = ref[-1][0]
        ended_well = all(progress(job, r) and progress(job, r)[-1][0] == last for r in ("r0 ", "r1 ")) and all(
            any(l.startswith(r + "verify ok") for l in log(job).splitlines()) for r in ("r0 ", "r1 ")
        )
        assert state_of(job) == "running" or ended_well, f"{job} ended as {state_of(job)} before step {at + n}"
        m["ran_to_its_end"] = state_of(job) != "running"
    finally:
        m["said"] = [l[-240:] for l in log(job).splitlines() if "NCCL WARN" in l or "rror" in l][-6:]
    want = dict(ref)
    for r in ("r0 ", "r1 "):
        bad = [(s, c) for s, c in progress(job, r) if want.get(s) != c]
        assert not bad, f"{r}left the trajectory at {bad[:3]}"


@scenario
@exclusive
def nccl_network_transport_refused_before_anything_stops(m):
    """Two ranks of one job over NCCL's socket transport (each a host of its own to NCCL),
    both on GPU 0: `hiber checkpoint` refuses them, naming the reason, the shared GPU and
    HIBER_NCCL_NET, before anything drains, and the job trains on, on the uninterrupted
    trajectory."""
    steps = "400"
    ref = xhost_reference(steps, "refused")
    job = "nxrefused"
    init = xhost_one_job(job, steps)
    try:
        p = hiber("checkpoint", job, "--leave-running", "--out", image_of(job), check=False)
        m["refusal"] = p.stderr.strip().splitlines()[:2]
        assert p.returncode != 0 and "network transport" in p.stderr and "two of its ranks on GPU-" in p.stderr and "HIBER_NCCL_NET" in p.stderr, f"{p.returncode}: {p.stderr[-600:]}"
        assert not Path(image_of(job)).exists()
        xhost_trains_on(m, job, ref, 40)
    finally:
        hiber("rm", "-f", job, check=False)
        Path(init).unlink(missing_ok=True)


@scenario
@exclusive
def nccl_socket_ranks_in_one_job_leave_running(m):
    """The same two ranks, each a host of its own to NCCL (its socket transport), started
    together in one job by a shell loop and checkpointed by one hiber with --leave-running
    (HIBER_NCCL_NET=1: hiber refuses such communicators by default): they train on, on the
    uninterrupted trajectory. Fails with the code of 3f3497a (H100, 2026-11-25): a rank
    faults ('unspecified launch failure') a few steps after the rebuild, which is why the
    default refuses."""
    # With a GPU per rank the job ran through 400 steps while hiber wrote the image (2×H100,
    # 227f4d6), and 1200 steps of the reference took longer than its 300 s beside the NCCL
    # scenarios (0118a44): a job that ends, verified, counts as training on.
    steps = "700"
    ref = xhost_reference(steps, "one")
    job = "nx1job"
    init = xhost_one_job(job, steps)
    try:
        ck = hiber_logged(m, "checkpoint_log", "checkpoint", job, "--leave-running", "--out", image_of(job), env=dict(ENV, HIBER_NCCL_NET="1"))
        m["paused_s"] = round(ck["paused_seconds"] or 0, 2)
        xhost_trains_on(m, job, ref, 40)
    finally:
        Path(init).unlink(missing_ok=True)


NCCL_REINIT = REPO / "gpu/programs/nccl_reinit.py"


def reinit_pair(m, key, flags, agent_job=None):
    """Both ranks of nccl_reinit.py over the socket transport, as plain processes or (with
    AGENT_JOB) as one `hiber run` job with the agent and no checkpoint: M[KEY] gets the last
    step each rank reached and what it said on failure. True if both ran to `done`."""
    d = f"/tmp/hiber-suite-reinit-{key}-{os.getpid()}"
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    cmd = ["python3", str(NCCL_REINIT), "--dir", d, "--steps", "120", "--every", "15", "--mib", "16", *flags]
    env = {k: v for k, v in xhost_env(0).items() if k not in ("RANK", "NCCL_HOSTID")}
    try:
        if agent_job is None:
            files = [open(f"{d}.r{r}.log", "w+") for r in (0, 1)]
            procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), NCCL_HOSTID=f"hiber-suite-host{r}"), stdout=f, stderr=subprocess.STDOUT, text=True) for r, f in zip((0, 1), files)]
            end = time.time() + 120
            for p in procs:
                try:
                    p.wait(timeout=max(1, end - time.time()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            outs = []
            for f in files:
                f.seek(0)
                outs.append(f.read())
                f.close()
                os.unlink(f.name)
        else:
            loop = f"for r in 0 1; do RANK=$r NCCL_HOSTID=hiber-suite-host$r {' '.join(cmd)} 2>&1 | sed -u -n \"s/^/r$r /p\" & done; wait"
            hiber("run", "--name", agent_job, "--", "sh", "-c", loop, env=env)
            try:
                wait(f"{agent_job} to end", 120, lambda: state_of(agent_job) != "running")
            except AssertionError:
                pass
            text = log(agent_job)
            hiber("rm", "-f", agent_job, check=False)
            outs = ["\n".join(l[3:] for l in text.splitlines() if l.startswith(f"r{r} ")) for r in (0, 1)]
    finally:
        shutil.rmtree(d, ignore_errors=True)
    m[key] = []
    for out in outs:
        steps = [l for l in out.splitlines() if l.startswith("step ")]
        m[key].append({"last": steps[-1] if steps else None, "done": "done" in out.splitlines(),
                       "said": [l[-200:] for l in out.splitlines() if "rror" in l or "WARN" in l or "WRONG" in l][-3:]})
    return all(r["done"] for r in m[key])


@scenario
@exclusive
def nccl_socket_reinit_without_hiber(m):
    """The control for the network-transport fault: two ranks over NCCL's socket transport
    on the one GPU end their communicator and make it again themselves every 20 steps,
    through NCCL's own API, with no hiber: on the main thread, on a thread that exits (as the
    agent does), with ncclCommDestroy, and then as a job under the agent (which then rebuilds
    nothing). Every all-reduce's sum is checked. Where these fault too, the fault is NCCL's
    or the driver's, not the cut's."""
    ok = {}
    ok["abort"] = reinit_pair(m, "abort", ["--how", "abort"])
    ok["abort_thread"] = reinit_pair(m, "abort_thread", ["--how", "abort", "--thread"])
    ok["destroy"] = reinit_pair(m, "destroy", ["--how", "destroy"])
    ok["agent_abort_thread"] = reinit_pair(m, "agent_abort_thread", ["--how", "abort", "--thread"], agent_job="reinit-agent")
    m["ok"] = ok
    assert all(ok.values()), f"ranks faulted: {[k for k, v in ok.items() if not v]}"


@scenario
@exclusive
def nccl_socket_ranks_failed_cut_trains_on(m):
    """The bisection of the network-transport fault: the two socket-transport ranks of one
    job, checkpointed by one hiber (HIBER_NCCL_NET=1) made to fail at each phase of
    SUITE_XHOST_FAIL_AT (default `quiesced`: the communicators torn down and the memory
    taken, then everything handed back and built again, with neither the driver's checkpoint
    nor CRIU in between; then `captured`: the driver's checkpoint too). After each the job
    trains 40 more steps on the uninterrupted trajectory."""
    steps = "600"
    ref = xhost_reference(steps, "failed")
    job = "nxfailed"
    init = xhost_one_job(job, steps)
    try:
        for phase in os.environ.get("SUITE_XHOST_FAIL_AT", "quiesced,captured").split(","):
            p = hiber("checkpoint", job, "--leave-running", "--out", image_of(job) + "-" + phase, check=False,
                      env=dict(ENV, HIBER_NCCL_NET="1", HIBER_FAIL_AT=phase, HIBER_LOG="hiber_core=info"))
            m[f"failed_at_{phase}"] = [l.strip()[-200:] for l in p.stderr.splitlines() if "nccl" in l.lower() or "rror" in l][-5:]
            assert p.returncode != 0, f"the checkpoint failed at {phase}"
            xhost_trains_on(m, job, ref, 40)
            m[f"passed_{phase}"] = True
    except AssertionError:
        (OUT / f"{job}-stdout.log").write_text(log(job)[-2_000_000:])
        raise
    finally:
        hiber("rm", "-f", job, check=False)
        Path(init).unlink(missing_ok=True)


def xhost_trained_on(jobs, ref, n):
    """Every job of JOBS goes N steps further, on the trajectory REF; the step they were at."""
    at = max(progress(j)[-1][0] for j in jobs)
    for j in jobs:
        wait_step(j, at + n, 120)
        assert_on_reference(j, ref)
    return at


def xhost_cut(m, jobs, imgs, ref, hosts=None, net_opt_in=True):
    """JOBS cut as one into IMGS with --leave-running (through `coordinated`, in HOSTS if
    given): they train on 30 steps on REF. Returns the step they were at."""
    rc, parts = coordinated(m, "cut", [("checkpoint", j, "--leave-running", "--out", i) for j, i in zip(jobs, imgs)], hosts=hosts, net_opt_in=net_opt_in)
    assert rc == 0 and all(p[0] == 0 for p in parts), f"coordinated checkpoint: {m['cut']}"
    m["checkpoint_s"] = [round(p[1]["total_seconds"], 2) for p in parts]
    m["paused_s"] = [round(p[1]["paused_seconds"] or 0, 2) for p in parts]
    return xhost_trained_on(jobs, ref, 30)


def xhost_restore_together(m, jobs, imgs, hosts=None, restore_args=None, net_opt_in=True):
    """The originals go; IMGS come back together as JOB-r (each with its RESTORE_ARGS).

    The originals are stopped together before they are removed. Removed one after the
    other, the rank left running saw its peer gone and wrote PyTorch's "dump" signal into
    the job's store, the rendezvous file that the copies share: the copies read it at once,
    and stalled (seventh session, 15:37:28)."""
    pids = [p for j in jobs for p in job_pids(j)]
    for p in pids:
        try:
            os.kill(p, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    for j in jobs:
        hiber("rm", "-f", j)
    extra = restore_args or [()] * len(jobs)
    rc, parts = coordinated(m, "restore", [("restore", i, "--name", j + "-r", *x) for j, i, x in zip(jobs, imgs, extra)], hosts=hosts, net_opt_in=net_opt_in)
    assert rc == 0 and all(p[0] == 0 for p in parts), f"coordinated restore: {m['restore']}"
    m["restore_s"] = [round(p[1]["total_seconds"], 2) for p in parts if p[1]]


def xhost_ran_to_the_end(m, jobs, ref, steps):
    """Each restored JOB-r verifies, on REF, to its last step; where each resumed goes in M."""
    m["resumed_at"] = []
    for j in jobs:
        assert_verified(j + "-r")
        got = assert_on_reference(j + "-r", ref)
        assert got[-1][0] == int(steps) - 1, f"{j}-r ran to the end"
        m["resumed_at"].append(got[0][0])


def keep_ranks_said(m, jobs):
    """What the ranks of JOBS said (NCCL's warnings, PyTorch's error), for the report: the
    tail of each one's stderr into OUT, its error lines into M."""
    for j in jobs:
        f = STATE / "jobs" / j / "stderr.log"
        if f.exists():
            text = f.read_text(errors="replace")
            (OUT / f"{j}-stderr.log").write_text(text[-200_000:])
            m[f"{j}_said"] = [l[-240:] for l in text.splitlines() if "NCCL WARN" in l or "rror" in l][-6:]


def xhost_cut_and_restore(m, jobs, imgs, ref, steps):
    # 1. The cut.
    at = xhost_cut(m, jobs, imgs, ref)
    m["step_gap_ms"] = [step_gap_ms(j, 2, at + 30) for j in jobs]
    m["agent_mib"] = [agent_bytes(agent_section(i)) >> 20 for i in imgs]
    # 2. One side fails after both tore their communicators down, before and after the
    # driver took the GPU state: both undo together, and train on.
    for phase in os.environ.get("SUITE_XHOST_FAIL_AT", "quiesced,captured").split(","):
        spare = [i + "-" + phase for i in imgs]
        rc, parts = coordinated(m, "failed_at_" + phase, [("checkpoint", j, "--leave-running", "--out", i) for j, i in zip(jobs, spare)], [{}, {"HIBER_FAIL_AT": phase}])
        assert rc != 0 and all(p[0] != 0 for p in parts), f"the failed cut fails everywhere: {m['failed_at_' + phase]}"
        assert not any(Path(i).exists() for i in spare), "no image of the failed cut"
        xhost_trained_on(jobs, ref, 20)
    # 3. Both originals go; the images of the cut come back together.
    xhost_restore_together(m, jobs, imgs)
    xhost_ran_to_the_end(m, jobs, ref, steps)


# ---------------------------------------------------------------------------------------
# OpenCL: the test programs of crates/hiber/tests/opencl/ (built on the build machine and
# carried in .carry/opencl/ by scripts/gpu-carry.sh). On PoCL (the machine's one registered
# vendor) they move between its two CPU drivers. With NVIDIA's OpenCL (a vendors directory
# the suite makes) a checkpoint is refused before anything stops: its driver state is out
# of reach of CRIU and of the driver's checkpoint API (see the scenarios' driver_says). The
# jobs run --no-agent: the agent is for CUDA programs.

OPENCL = CARRY / "opencl"
NVIDIA_OPENCL = ("/usr/local/nvidia/lib64/libnvidia-opencl.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-opencl.so.1")


def opencl_env():
    lib = next((p for p in NVIDIA_OPENCL if Path(p).exists()), None)
    if lib is None:
        raise Skip("no libnvidia-opencl.so.1 here")
    d = Path("/tmp/hiber-ocl-vendors")
    d.mkdir(exist_ok=True)
    for f in Path("/etc/OpenCL/vendors").glob("*.icd"):
        if "nvidia" not in f.name:
            shutil.copy(f, d / f.name)
    (d / "nvidia.icd").write_text(lib + "\n")
    return dict(ENV, OCL_ICD_VENDORS=str(d))


def ocl_program(name):
    p = OPENCL / name
    if not p.exists():
        raise Skip(f"{p} was not carried (scripts/gpu-carry.sh builds it)")
    return p


def ocl_devices(text):
    """The `dev NAME` of each progress line, in order of first appearance."""
    out = []
    for l in text.splitlines():
        if l.startswith("step ") and " dev " in l:
            d = l.split(" dev ", 1)[1]
            if d not in out:
                out.append(d)
    return out


def ocl_move(m, job, prog, args, start_dev, restore_args, at=30, sleep="20", limit=120, env=None, mode="auto"):
    """PROG ARGS on START_DEV uninterrupted outside hiber, then as job JOB (`--opencl=MODE`)
    checkpointed at step AT and restored with RESTORE_ARGS: identical trajectories, and the
    copy's own check of its device state against its host reference passes."""
    env = env or opencl_env()
    m["platforms"] = [l for l in sh("clinfo", "-l", env=env, check=False).stdout.splitlines() if l.strip()]
    binary = ocl_program(prog)
    ref = sh(binary, *args, start_dev, "0", env=env, timeout=300)
    ref_traj = [(p.step, p.checksum) for p in parse_progress(ref.stdout)]
    assert "verify ok" in ref.stdout, ref.stdout[-500:]
    hiber("run", "--name", job, "--no-agent", f"--opencl={mode}", "--", binary, *args, start_dev, sleep, env=env)
    wait_step(job, at, limit)
    m.setdefault("nvidia_in_job", []).append(any("libnvidia-opencl" in maps_text(p) for p in job_pids(job)))
    img = image_of(job)
    ck = hiber_json("checkpoint", job, "--out", img, env=env)
    sec = device_section(img, "opencl")
    assert sec and sec["processes"] and sec["processes"][0]["mems"], "the image records the OpenCL memory objects"
    m["engines"] = [d["engine"] for d in json.loads((Path(img) / "manifest.json").read_text())["devices"]]
    m["opencl_mib"] = sum(p["bytes"] for p in sec["processes"]) >> 20
    before = progress(job)
    rs = hiber_json("restore", img, "--name", job + "-r", *restore_args, env=env)
    assert_verified(job + "-r", limit=600)
    assert_continues(before, progress(job + "-r"), before[-1][0] + 1)
    combined = progress(job) + progress(job + "-r")
    assert combined == ref_traj, "trajectory differs from the uninterrupted run"
    m.update(
        devices=[ocl_devices(log(job)), ocl_devices(log(job + "-r"))],
        steps_compared=len(combined),
        checkpoint_s=round(ck["total_seconds"], 2),
        dump_s=round(ck["dump_seconds"], 2),
        restore_s=round(rs["total_seconds"], 2),
        restore_devices_s=round(rs["devices_seconds"], 2),
        image_mib=ck["image_bytes"] >> 20,
    )
    return m


def pocl_env():
    """PoCL alone, with its two CPU drivers as two devices. The machine's environment names
    NVIDIA's OpenCL too (OCL_ICD_FILENAMES=libpocl.so.2:libnvidia-opencl.so.1), and a
    process that loaded it cannot be checkpointed."""
    return dict(ENV, POCL_DEVICES="basic pthread", OCL_ICD_FILENAMES="libpocl.so.2")


@scenario
def opencl_pocl_moves_on_the_gpu_machine(m):
    ocl_move(m, "oclp", "stencil", ("300", "1048576"), "0", ("--opencl-device", "0:1"), env=pocl_env())
    assert m["devices"][0] != m["devices"][1], m["devices"]


@scenario
def opencl_pocl_two_queues(m):
    ocl_move(m, "oclq", "reduce", ("200", "1048576"), "1", (), env=pocl_env())


@scenario
def opencl_pocl_images_move(m):
    ocl_move(m, "ocli", "image", ("200", "256"), "1", ("--opencl-device", "0:0"), env=pocl_env())


def refused_on_nvidia(m, job, device):
    """A job with NVIDIA's OpenCL loaded (used or not) in its own process (inline mode) is
    refused before anything stops, and runs on; the driver's answer for it is kept."""
    env = opencl_env()
    hiber("run", "--name", job, "--no-agent", "--opencl=inline", "--", ocl_program("stencil"), "100000", "65536", device, "20", env=env)
    wait_step(job, 10)
    img = image_of(job)
    p = sh(HIBER, "checkpoint", job, "--out", img, check=False, env=dict(env, HIBER_LOG="hiber_core=debug"))
    assert p.returncode != 0, "refused"
    err = [l for l in p.stderr.splitlines() if l.startswith("hiber:") or l.startswith("hint:")]
    assert any("libnvidia-opencl" in l for l in err), p.stderr[-1500:]
    m["refusal"] = err
    m["driver_says"] = [l.strip()[-300:] for l in p.stderr.splitlines() if "not a CUDA process" in l][:2]
    assert not Path(img).exists(), "no image"
    at = progress(job)[-1][0]
    wait_step(job, at + 5)
    assert state_of(job) == "running"


def maps_text(pid):
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


def job_pids(job):
    """The host PIDs of JOB's tree."""
    out, i = [next(j["pid"] for j in hiber_json("ls")["jobs"] if j["name"] == job)], 0
    while i < len(out):
        try:
            out += [int(c) for c in Path(f"/proc/{out[i]}/task/{out[i]}/children").read_text().split()]
        except OSError:
            pass
        i += 1
    return out


@scenario
def opencl_nvidia_proxy_round_trip(m):
    """NVIDIA's OpenCL through the proxy (#36): a stencil on the GPU, no process of the job
    mapping NVIDIA's library, checkpointed and restored on the GPU, on its trajectory."""
    ocl_move(m, "oclnv", "stencil", ("300", "1048576"), "gpu", ("--opencl-device", "gpu"), mode="proxy")
    assert m["nvidia_in_job"] == [False], m["nvidia_in_job"]


@scenario
def opencl_nvidia_to_pocl_and_back(m):
    """CheCL's headline through the proxy (#36): checkpointed on NVIDIA's GPU, restored on
    PoCL's CPU device, and a run started on the CPU restored on the GPU; each goes on on
    the uninterrupted trajectory (the kernels are deterministic)."""
    ocl_move(m, "oclgc", "stencil", ("300", "1048576"), "gpu", ("--opencl-device", "cpu"), mode="proxy")
    back = {}
    ocl_move(back, "oclcg", "stencil", ("300", "1048576"), "cpu", ("--opencl-device", "gpu"), mode="proxy")
    m["back"] = back
    assert m["nvidia_in_job"] == [False] and back["nvidia_in_job"] == [False], (m["nvidia_in_job"], back["nvidia_in_job"])


@scenario
@exclusive
def opencl_nvidia_2gib_through_the_proxy(m):
    """#36's checkpoint row: a job holding two 1 GiB OpenCL buffers on NVIDIA's GPU, through
    the proxy, checkpointed (stopping) and restored on the GPU, on its trajectory."""
    env = opencl_env()
    ref = sh(ocl_program("stencil"), "6", str(256 << 20), "gpu", "0", env=env, timeout=300)
    ref_traj = [(p.step, p.checksum) for p in parse_progress(ref.stdout)]

    def running():
        m["nvidia_in_job"] = any("libnvidia-opencl" in maps_text(p) for p in job_pids("ocl2g"))
        assert not m["nvidia_in_job"], "no process of the job maps NVIDIA's OpenCL"

    ocl_2gib(m, "ocl2g", env, "6", "gpu", "1500", ("--no-agent", "--opencl=proxy"), running)
    assert progress("ocl2g") + progress("ocl2g-r") == ref_traj, "trajectory differs from the uninterrupted run"


@scenario
def opencl_nvidia_2gib_lean_through_the_proxy(m):
    """#36's stop target: the same 2 GiB job, but its memory is its OpenCL buffers (the
    stencil's `lean` mode keeps no host copy of them, as a real job's buffers are filled
    once and read in pieces), checkpointed (stopping) and restored on the GPU, on its
    trajectory. What CRIU dumps is then the program and the layer, not 3 GiB of references."""
    env = opencl_env()
    ref = sh(ocl_program("stencil"), "6", str(256 << 20), "gpu", "0", "lean", env=env, timeout=300)
    ref_traj = [(p.step, p.checksum) for p in parse_progress(ref.stdout)]
    ocl_2gib(m, "ocl2gl", env, "6", "gpu", "1500", ("--no-agent", "--opencl=proxy"), mode=("lean",))
    assert progress("ocl2gl") + progress("ocl2gl-r") == ref_traj, "trajectory differs from the uninterrupted run"


def ocl_2gib(m, job, env, steps, device, sleep, run_args=(), running=lambda: None, mode=()):
    """The stencil over two 1 GiB buffers on DEVICE, STEPS steps SLEEP ms apart (in MODE,
    the stencil's fifth argument), as job JOB (`hiber run RUN_ARGS`); RUNNING checks it once
    it runs. Checkpointed (stopping) at step 2: the image holds its 2048 MiB of OpenCL
    memory. Restored as JOB-r: it goes on from the cut and verifies. The times go into M."""
    hiber("run", "--name", job, *run_args, "--", ocl_program("stencil"), steps, str(256 << 20), device, sleep, *mode, env=env)
    wait_step(job, 2, 150)
    running()
    img = image_of(job)
    ck = hiber_logged(m, "checkpoint_log", "checkpoint", job, "--out", img, env=env)
    sec = device_section(img, "opencl")
    m["opencl_mib"] = sum(p["bytes"] for p in sec["processes"]) >> 20
    assert m["opencl_mib"] == 2048, m["opencl_mib"]
    before = progress(job)
    rs = hiber_json("restore", img, "--name", job + "-r", env=env)
    assert_verified(job + "-r", limit=600)
    assert_continues(before, progress(job + "-r"), before[-1][0] + 1)
    m.update(
        checkpoint_s=round(ck["total_seconds"], 2),
        quiesce_s=round(sec["quiesce_seconds"], 2),
        save_s=round(sec["save_seconds"], 2),
        dump_s=round(ck["dump_seconds"], 2),
        restore_s=round(rs["total_seconds"], 2),
        restore_devices_s=round(rs["devices_seconds"], 2),
        image_mib=ck["image_bytes"] >> 20,
    )


@scenario
def opencl_nvidia_discovery_child_beside_cuda_job(m):
    """#36, item 5: a child that lists NVIDIA's OpenCL platforms and devices and runs on (as
    hwloc's plugin does in launchers' daemons), beside a PyTorch training process, in one
    job run with --opencl=proxy. No process of the job maps NVIDIA's OpenCL; the job is
    checkpointed (stopping) and restored: the training on its uninterrupted trajectory, the
    child going on from where it stopped and listing the same platforms again."""
    env = opencl_env()
    disc = ocl_program("discover")
    ref = sh("python3", TRAIN, "--steps", "200", timeout=300, env=env)
    ref_traj = [(p.step, p.checksum) for p in parse_progress(ref.stdout)]
    script = f"{disc} 1200 50 & d=$!; python3 {TRAIN} --steps 200; s=$?; wait $d && exit $s"
    hiber("run", "--name", "odisc", "--opencl=proxy", "--", "sh", "-c", script, env=env)
    wait_step("odisc", 50, 120)
    wait("the discovery child to list", 30, lambda: "listed " in log("odisc"))
    m["listed"] = next(l for l in log("odisc").splitlines() if l.startswith("listed "))
    maps = {p: maps_text(p) for p in job_pids("odisc")}
    assert not any("libnvidia-opencl" in t for t in maps.values()), "no process of the job maps NVIDIA's OpenCL"
    assert any("libhiber_agent" in t for t in maps.values()), "the training process has the agent"
    img = image_of("odisc")
    ck = hiber_json("checkpoint", "odisc", "--out", img, env=env)
    m["engines"] = [d["engine"] for d in json.loads((Path(img) / "manifest.json").read_text())["devices"]]
    alive_at = max(int(l.split()[1]) for l in log("odisc").splitlines() if l.startswith("alive "))
    assert alive_at < 1199, "the child was still running at the checkpoint"
    rs = hiber_json("restore", img, "--name", "odisc-r", env=env)
    assert_verified("odisc-r", limit=300)
    text = log("odisc-r")
    got = assert_on_reference("odisc-r", ref_traj)
    resumed = min(int(l.split()[1]) for l in text.splitlines() if l.startswith("alive "))
    assert resumed == alive_at + 1, f"the child resumed at alive {resumed}, stopped at {alive_at}"
    again = [l for l in text.splitlines() if l.startswith("listed again ")]
    assert again == ["listed again " + m["listed"].split(" ", 1)[1]], (again, m["listed"])
    m.update(resumed_step=got[0][0], checkpoint_s=round(ck["total_seconds"], 2), restore_s=round(rs["total_seconds"], 2))


@scenario
def opencl_on_nvidia_refused_before_anything_stops(m):
    refused_on_nvidia(m, "ocln", "gpu")


@scenario
def opencl_pocl_beside_nvidia_refused(m):
    refused_on_nvidia(m, "oclb", "cpu")


@scenario
@exclusive
def opencl_2gib_on_pocl(m):
    """Two 1 GiB buffers on PoCL (its largest allocation here is under 2 GiB): checkpoint and
    restore times against the disk's rate. NVIDIA's row is opencl_nvidia_2gib_through_the_proxy."""
    env = pocl_env()
    dd = sh("dd", "if=/dev/zero", "of=/tmp/hiber-dd", "bs=64M", "count=32", "oflag=direct", check=False)
    m["disk_write"] = (dd.stderr.strip().splitlines() or ["?"])[-1]
    Path("/tmp/hiber-dd").unlink(missing_ok=True)
    ocl_2gib(m, "ocl4", env, "5", "1", "0")


@scenario
@exclusive
def opencl_layer_overhead(m):
    """bench/opencl/overhead.py: the launch-heavy microbenchmark and the waited-for call, with
    no layer, the inline layer and the proxy, side by side."""
    env = opencl_env()
    rows = sh(
        "python3", REPO / "bench/opencl/overhead.py", ocl_program("launch"), CARRY / "bin/libhiber_opencl.so",
        "--roundtrip", ocl_program("roundtrip"), "--bandwidth", ocl_program("bandwidth"), "--hiber", HIBER,
        "--pairs", "3", "--rounds", "20000", "--device", "gpu", "--device", "cpu", env=env, timeout=500,
    )
    m["table"] = rows.stdout.strip().splitlines()


@scenario
@exclusive
def opencl_launch_on_another_thread(m):
    """Why the proxy's launch loop is slower on NVIDIA: its post thread runs the posted calls
    on a thread other than the one that made the context, queue and kernel. The same loop
    with no layer at all, on the thread that made them and on another (launch.c's `thread`),
    alternating, medians of the per-call times."""
    env = opencl_env()
    runs = {"same thread": [], "another thread": []}
    for i in range(5):
        for name, extra in (("same thread", ()), ("another thread", ("thread",)))[:: 1 if i % 2 == 0 else -1]:
            out = sh(ocl_program("launch"), "3", "20000", "gpu", *extra, env=env, timeout=120).stdout
            runs[name] += [float(l.split()[3]) for l in out.splitlines() if l.startswith("rep ")]
    med = {k: statistics.median(v) for k, v in runs.items()}
    m["us_per_call_median"] = {k: round(v, 4) for k, v in med.items()}
    m["runs"] = {k: len(v) for k, v in runs.items()}
    m["ratio"] = round(med["another thread"] / med["same thread"], 3)


@scenario
@exclusive
def opencl_proxy_bandwidth_pageable_staging(m):
    """The bandwidth row again with the proxy staging through pageable memory
    (HIBER_OPENCL_PINNED=0), beside no layer in the same run: what the page-locked
    staging is worth on NVIDIA's platform."""
    env = dict(opencl_env(), HIBER_OPENCL_PINNED="0")
    rows = sh(
        "python3", REPO / "bench/opencl/overhead.py", ocl_program("launch"), CARRY / "bin/libhiber_opencl.so",
        "--bandwidth", ocl_program("bandwidth"), "--hiber", HIBER, "--only", "bandwidth",
        "--pairs", "3", "--device", "gpu", env=env, timeout=300,
    )
    m["table"] = rows.stdout.strip().splitlines()


@scenario
def hiber_demo_on_the_gpu(m):
    p = hiber("demo", "--mem-mib", "2048")
    assert "GPU workload" in p.stdout and "demo passed" in p.stdout, p.stdout
    m["report"] = [l.strip() for l in p.stdout.splitlines() if l.strip()]


def machine():
    q = sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total,uuid", "--format=csv,noheader", check=False).stdout.strip()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpus": q.splitlines(),
        "kernel": os.uname().release,
        "commit": carried_commit(CARRY),
        "criu": sh(CARRY / "bin/criu", "--version", check=False).stdout.split("\n")[0],
        "nvcc": (sh("nvcc", "--version", check=False).stdout.strip().splitlines() or ["?"])[-1],
    }


def run_one(fn):
    """Runs one scenario in this process and returns its row."""
    m = {}
    start = time.time()
    try:
        fn(m)
        status = "passed"
    except Skip as e:
        status, m["reason"] = "skipped", str(e)
    except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the suite
        status, m["reason"] = "failed", "".join(traceback.format_exception_only(type(e), e)).strip()[-1500:]
        m["logs"] = job_log_tails()
    finally:
        cleanup()
    secs = round(time.time() - start, 1)
    print(f"[{status}] {fn.__name__} ({secs}s) {json.dumps(m)[:4000]}", flush=True)
    return {"scenario": fn.__name__, "status": status, "seconds": secs, **m}


def run_parallel(fns, jobs):
    """Runs FNS on JOBS workers, each a `suite.py` of its own for one scenario at a time, with
    a state directory per worker slot; returns {name: row}."""
    queue, rows, lock = list(fns), {}, threading.Lock()

    def slot(k):
        while True:
            with lock:
                if not queue:
                    return
                fn = queue.pop(0)
            out = OUT / "workers" / fn.__name__
            # A result left by an earlier run with the same $OUT must not pass for this one.
            (out / "results.json").unlink(missing_ok=True)
            env = dict(os.environ, SUITE_WORKER="1", SUITE_ONLY=fn.__name__, SUITE_STATE=f"{STATE}-{k}", OUT=str(out))
            try:
                p = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=1200)
            except subprocess.TimeoutExpired as e:
                p = subprocess.CompletedProcess(e.cmd, -9, str(e.stdout or ""), f"the worker ran past {e.timeout}s")
            with lock:
                sys.stdout.write(p.stdout)
                sys.stdout.flush()
            try:
                row = json.loads((out / "results.json").read_text())["results"][0]
            except (OSError, ValueError, IndexError):
                row = {"scenario": fn.__name__, "status": "failed", "seconds": 0, "reason": f"its worker ended ({p.returncode}) without a result: {p.stderr[-800:]}"}
            with lock:
                rows[fn.__name__] = row

    threads = [threading.Thread(target=slot, args=(k,)) for k in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # A worker that died left its jobs: none may run beside the scenarios that follow.
    for k in range(jobs):
        jobs_dir = Path(f"{STATE}-{k}") / "jobs"
        for j in jobs_dir.iterdir() if jobs_dir.exists() else ():
            hiber("rm", "-f", j.name, check=False, env=dict(ENV, HIBER_STATE=f"{STATE}-{k}"))
    return rows


def main():
    unknown = ONLY - {fn.__name__ for fn in SCENARIOS}
    if unknown:
        # A misspelt name would otherwise run nothing and report 0 failed.
        sys.exit("SUITE_ONLY names no scenario: " + ", ".join(sorted(unknown)))
    OUT.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(STATE, ignore_errors=True)
    selected = [fn for fn in SCENARIOS if not ONLY or fn.__name__ in ONLY]
    worker = os.environ.get("SUITE_WORKER") == "1"
    if worker:
        # The programs were built by the run that started this worker.
        for prog, (rc, err) in json.loads((BUILD / "built.json").read_text()).items():
            BUILT[prog] = subprocess.CompletedProcess([], rc, "", err)
        rows = [run_one(fn) for fn in selected]
        (OUT / "results.json").write_text(json.dumps({"results": rows}))
        return 0
    BUILD.mkdir(parents=True, exist_ok=True)
    info = machine()
    jobs = max(1, int(os.environ.get("SUITE_JOBS", "1")))
    info["jobs"] = jobs
    print(json.dumps(info), flush=True)
    for prog in PROGRAMS:
        BUILT[prog] = sh("nvcc", "-O2", "-o", BUILD / prog, REPO / f"gpu/programs/{prog}.cu", check=False, timeout=300)
    (BUILD / "built.json").write_text(json.dumps({k: (b.returncode, b.stderr) for k, b in BUILT.items()}))
    rows = {}
    if jobs > 1:
        rows.update(run_parallel([fn for fn in selected if fn.__name__ not in EXCLUSIVE], jobs))
        selected = [fn for fn in selected if fn.__name__ in EXCLUSIVE]
    for fn in selected:
        rows[fn.__name__] = run_one(fn)
    results.extend(rows[fn.__name__] for fn in SCENARIOS if fn.__name__ in rows)
    table = ["| scenario | result | time | checkpoint | driver ckpt | restore | GPU mem | image |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        g = lambda k, u="": f"{r[k]}{u}" if k in r else ""  # noqa: E731
        table.append(f"| {r['scenario']} | {r['status']}{(': ' + ' '.join(r['reason'].split())[:160]) if r['status'] != 'passed' else ''} | {r['seconds']}s | {g('checkpoint_s', 's')} | {g('driver_checkpoint_s', 's')} | {g('restore_s', 's')} | {g('gpu_mib', ' MiB')} | {g('image_mib', ' MiB')} |")
    counts = {s: sum(r["status"] == s for r in results) for s in ("passed", "failed", "skipped")}
    together = f", {jobs} scenarios at a time (those that need the machine alone, one at a time after them)" if jobs > 1 else ""
    head = f"## GPU suite run {info['date']}\n\n- GPU: {'; '.join(info['gpus'])}\n- kernel {info['kernel']}, {info['criu']}, {info['nvcc']}\n- hiber commit {info['commit']}{together}\n\n"
    md = head + "\n".join(table) + f"\n\n{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped\n"
    (OUT / "results.md").write_text(md)
    (OUT / "results.json").write_text(json.dumps({"machine": info, "results": results}, indent=1))
    print("\n" + md, flush=True)
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped", flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
