#!/usr/bin/env python3
"""How much of a PyTorch process's device memory is not its allocator's, and how much of
that is the per-thread stack's local memory: the memory the agent leaves to the driver,
which a `--leave-running` checkpoint copies into host memory, CRIU dumps, and the driver
copies back, all inside the pause (gpu/RESULTS.md, "Where a DDP job's `--leave-running`
pause goes": 1-1.5 GiB per DDP rank on H100).

Runs on the GPU machine, without hiber: one process, one GPU, a one-rank NCCL process
group and the suite's DDP model. It prints NVML's count of the process's device memory
(what a driver checkpoint would copy, were the allocator's pools gone) and PyTorch's
reserved memory after each stage: CUDA initialised; some DDP steps; the process group
destroyed; the allocator's cache emptied; the stack limit (`cuCtxSetLimit`,
CU_LIMIT_STACK_SIZE, which the driver raises for each kernel that needs more and never
lowers by itself) set back to 1 KiB, and to the smallest the driver takes; a matmul after.

    python3 bench/probes/context_memory.py
"""
import ctypes
import os
import subprocess
import time

import torch
import torch.distributed as dist

STACK = 0  # CU_LIMIT_STACK_SIZE
cu = ctypes.CDLL("libcuda.so.1")


def nvml_mib():
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    return sum(int(line.split(",")[1]) for line in out.splitlines() if line.split(",")[0].strip() == str(os.getpid()))


def stack():
    v = ctypes.c_size_t()
    r = cu.cuCtxGetLimit(ctypes.byref(v), STACK)
    return v.value if r == 0 else f"error {r}"


def report(stage):
    torch.cuda.synchronize()
    time.sleep(0.3)
    print(f"{stage}: NVML {nvml_mib()} MiB, allocator reserved {torch.cuda.memory_reserved() >> 20} MiB, stack {stack()} B per thread", flush=True)


torch.cuda.set_device(0)
torch.zeros(1, device="cuda")
report("CUDA initialised")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29555"), RANK="0", WORLD_SIZE="1")
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)).cuda()
net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for _ in range(50):
    x = torch.randn(128, 512, device="cuda")
    y = torch.randint(0, 10, (128,), device="cuda")
    loss = torch.nn.functional.cross_entropy(net(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    v = loss.detach().clone()
    dist.all_reduce(v)
    v.item()
report("50 DDP steps")
dist.destroy_process_group()
report("process group destroyed")
del net, model, opt
torch.cuda.empty_cache()
report("allocator cache emptied")
for value in (1024, 0):
    r = cu.cuCtxSetLimit(STACK, ctypes.c_size_t(value))
    report(f"stack limit set to {value} (result {r})")
a = torch.randn(4096, 4096, device="cuda")
(a @ a).sum().item()
report("a matmul after")
