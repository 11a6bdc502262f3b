"""A GPU monitor in a process of its own, as training dashboards' system monitors run one.

It opens NVML through ctypes (as pynvml does: `dlopen` and `dlsym`), takes a handle to
every GPU once, and then every --interval-ms reads each GPU's memory, utilization and
temperature through those handles, printing `sample N gpus K used_mib U ok` (or `sample
N FAILED ...` when a call fails). It never initializes CUDA: it holds NVIDIA's device files
(nvidiactl, nvidia-uvm, one per GPU) without a CUDA context. A restored monitor must go on
reading its GPUs through the handles it had, with its sample count going on.

Each line goes out in one write(2): the monitor shares its log with the training process
beside it, and print() writes a line and its newline apart, so the other process's line
could land between them and leave a sample line that does not end in `ok` (shown on this
repository's CPU machine: two processes printing 20,000 lines each to one file tore most
of them; one write each tore none).
"""
import argparse
import ctypes
import os
import time


def say(line):
    os.write(1, (line + "\n").encode())


p = argparse.ArgumentParser()
p.add_argument("--interval-ms", type=int, default=100)
p.add_argument("--samples", type=int, default=1 << 30)
args = p.parse_args()


class Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0, "nvmlInit"
count = ctypes.c_uint()
assert nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
handles = []
for i in range(count.value):
    h = ctypes.c_void_p()
    assert nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) == 0
    handles.append(h)
say(f"monitor start gpus {len(handles)}")
for n in range(args.samples):
    used, bad = 0, []
    for h in handles:
        mem, util, temp = Memory(), Utilization(), ctypes.c_uint()
        for what, rc in (
            ("memory", nvml.nvmlDeviceGetMemoryInfo(h, ctypes.byref(mem))),
            ("utilization", nvml.nvmlDeviceGetUtilizationRates(h, ctypes.byref(util))),
            ("temperature", nvml.nvmlDeviceGetTemperature(h, 0, ctypes.byref(temp))),
        ):
            if rc != 0:
                bad.append(f"{what} rc {rc}")
        used += mem.used >> 20
    if bad or not 0 < temp.value < 120:
        say(f"sample {n} FAILED {' '.join(bad)} temperature {temp.value}")
    else:
        say(f"sample {n} gpus {len(handles)} used_mib {used} ok")
    time.sleep(args.interval_ms / 1000)
