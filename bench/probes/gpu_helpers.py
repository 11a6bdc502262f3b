#!/usr/bin/env python3
"""Facts for two shapes of GPU job hiber refuses today (#41, items 8 and 9), on the GPU machine.

1. A process that holds NVIDIA's device files through NVML alone (a training dashboard's
   system monitor): which files and mappings it holds, whether nvmlShutdown lets go of
   them, whether a device handle taken before a shutdown and init is the same afterwards
   (and still answers), and what the driver's checkpoint API says of such a process.
2. JAX sharded over two GPUs in one process: how XLA reaches NCCL (which library, loaded
   how: a DT_NEEDED of the plugin, or dlopen), and which NCCL entry points it resolves.

    python3 bench/probes/gpu_helpers.py [--jax]
"""
import ctypes
import glob
import json
import os
import subprocess
import sys
import time


def nvidia_files(pid="self"):
    fds = []
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            t = os.readlink(fd)
        except OSError:
            continue
        if t.startswith("/dev/nvidia"):
            fds.append(t)
    maps = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/dev/nvidia"):
                maps.add(parts[5])
    return sorted(fds), sorted(maps)


def nvml_child():
    """Runs in a child: NVML alone, then waits for the parent's questions on stdin."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    out = {}
    out["init"] = nvml.nvmlInit_v2()
    h = ctypes.c_void_p()
    out["handle_rc"] = nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))
    out["handle"] = h.value
    out["files_after_init"] = nvidia_files()

    class Util(ctypes.Structure):
        _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]

    u = Util()
    out["util_rc"] = nvml.nvmlDeviceGetUtilizationRates(h, ctypes.byref(u))
    print(json.dumps({"stage": "initialized", **out}), flush=True)
    sys.stdin.readline()  # the parent asked the driver's checkpoint API meanwhile
    out2 = {}
    out2["shutdown"] = nvml.nvmlShutdown()
    out2["files_after_shutdown"] = nvidia_files()
    out2["init_again"] = nvml.nvmlInit_v2()
    h2 = ctypes.c_void_p()
    out2["handle_again_rc"] = nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h2))
    out2["handle_again"] = h2.value
    out2["same_handle"] = h2.value == h.value
    out2["old_handle_util_rc"] = nvml.nvmlDeviceGetUtilizationRates(h, ctypes.byref(u))
    out2["files_after_reinit"] = nvidia_files()
    # Twice initialized (refcounted): one shutdown keeps it, the second lets go.
    nvml.nvmlInit_v2()
    nvml.nvmlShutdown()
    out2["files_after_init_shutdown_pair"] = nvidia_files()
    nvml.nvmlShutdown()
    out2["files_after_last_shutdown"] = nvidia_files()
    print(json.dumps({"stage": "reinit", **out2}), flush=True)


def checkpoint_api_on(pid):
    cuda = ctypes.CDLL("libcuda.so.1")
    r = {"cuInit": cuda.cuInit(0)}
    st = ctypes.c_int(-1)
    r["getState"] = cuda.cuCheckpointProcessGetState(ctypes.c_int(pid), ctypes.byref(st))
    r["state"] = st.value
    args = (ctypes.c_uint64 * 8)()
    args[0] = 2000  # timeoutMs in the low 32 bits
    r["lock"] = cuda.cuCheckpointProcessLock(ctypes.c_int(pid), args)
    if r["lock"] == 0:
        r["checkpoint"] = cuda.cuCheckpointProcessCheckpoint(ctypes.c_int(pid), (ctypes.c_uint64 * 8)())
        r["files_after_checkpoint"] = nvidia_files(pid)
        r["restore"] = cuda.cuCheckpointProcessRestore(ctypes.c_int(pid), (ctypes.c_uint64 * 8)())
        r["unlock"] = cuda.cuCheckpointProcessUnlock(ctypes.c_int(pid), (ctypes.c_uint64 * 8)())
    return r


def nvml_probe():
    child = subprocess.Popen([sys.executable, __file__, "--nvml-child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    first = json.loads(child.stdout.readline())
    print("nvml child:", json.dumps(first, indent=1))
    print("driver checkpoint API on it:", json.dumps(checkpoint_api_on(child.pid), indent=1))
    child.stdin.write("go\n")
    child.stdin.flush()
    print("nvml child after:", json.dumps(json.loads(child.stdout.readline()), indent=1))
    child.wait()


JAX_PROGRAM = r"""
import os, json, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devs = jax.devices()
mesh = Mesh(devs, ("d",))
x = jax.device_put(jnp.arange(8.0 * len(devs)).reshape(len(devs), 8), NamedSharding(mesh, P("d")))
@jax.jit
def f(x):
    return jnp.sum(x, axis=0)  # a reduction across the sharded axis: an all-reduce
y = f(x).block_until_ready()
libs = sorted({l.split()[5] for l in open("/proc/self/maps") if len(l.split()) >= 6 and ("nccl" in l or "xla" in l or "cuda_plugin" in l or "pjrt" in l)})
fds = sorted({os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{f}")})
print(json.dumps({"devices": [str(d) for d in devs], "sum": [float(v) for v in y], "libs": libs, "nccl_fds": [f for f in fds if "nccl" in f or "nvidia" in f]}))
"""


def jax_probe():
    env = dict(os.environ, NCCL_DEBUG="INFO", NCCL_NVLS_ENABLE="0", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    r = subprocess.run([sys.executable, "-c", JAX_PROGRAM], capture_output=True, text=True, env=env, timeout=300)
    print("jax rc", r.returncode)
    print("jax stdout:", r.stdout[-4000:])
    print("jax stderr (NCCL lines):", "\n".join(l for l in r.stderr.splitlines() if "NCCL" in l)[:3000])
    if r.returncode != 0:
        print("jax stderr tail:", r.stderr[-2000:])
    # NCCL_DEBUG writes to stdout too: the program's own line is the one JSON object.
    found = [l for l in r.stdout.splitlines() if l.startswith("{")]
    libs = json.loads(found[-1])["libs"] if found else []
    for lib in libs:
        if "nccl" in lib or "xla" in lib or "pjrt" in lib or "plugin" in lib:
            d = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True).stdout
            needed = [l.split("[")[1].rstrip("]") for l in d.splitlines() if "(NEEDED)" in l]
            print(f"{lib}: NEEDED {needed}")
            s = subprocess.run(["sh", "-c", f"strings -n 8 '{lib}' | grep -E '^libnccl|ncclCommInitRank|dlopen' | sort -u | head -20"], capture_output=True, text=True).stdout
            print(f"{lib}: strings {s.split()}")


if __name__ == "__main__":
    if "--nvml-child" in sys.argv:
        nvml_child()
        sys.exit(0)
    print(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout)
    nvml_probe()
    if "--jax" in sys.argv:
        jax_probe()
