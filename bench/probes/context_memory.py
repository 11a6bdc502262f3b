#!/usr/bin/env python3
"""What the driver moves inside a `--leave-running` pause, and what lowering the per-thread
stack limit saves (gpu/RESULTS.md, "Where a DDP job's `--leave-running` pause goes": the
driver copied 1-1.5 GiB per DDP rank on H100, which CRIU then dumped and the driver copied
back, about 2.7 s of a 4.6 s pause).

Runs on the GPU machine, without hiber. Starts `--ranks` ranks of the suite's DDP job
(the same order of calls as gpu/programs/ddp.py: the process group first, then the
device), each stopping at stages. At each stage every rank prints NVML's count of its
device memory per GPU, its allocator's reserved memory and its stack limit
(CU_LIMIT_STACK_SIZE, which the driver raises for each kernel that needs more and never
lowers by itself). Where no NCCL communicator is alive, this script then takes each rank
through the driver's checkpoint and restore (`cuCheckpointProcess*`, as hiber's driver
engine does) and prints how long each took and how much the rank's anonymous memory grew.

Stages: CUDA and NCCL up, after DDP steps (no checkpoint: NCCL is alive); the process
group destroyed; the allocator's cache emptied (about what the agent leaves to the
driver); the stack limit set to 1 KiB, then to 0 (each timed); a matmul after; the old
limit set back (timed).

    python3 bench/probes/context_memory.py --ranks 2
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

STACK = 0  # CU_LIMIT_STACK_SIZE


def nvml_by_gpu(pid):
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    got = {}
    for line in out.splitlines():
        f = [x.strip() for x in line.split(",")]
        if f[0] == str(pid):
            got[f[1][-8:]] = got.get(f[1][-8:], 0) + int(f[2])
    return got


def rank_main():
    import torch
    import torch.distributed as dist

    cu = ctypes.CDLL("libcuda.so.1")
    rank = int(os.environ["RANK"])

    def stack():
        v = ctypes.c_size_t()
        r = cu.cuCtxGetLimit(ctypes.byref(v), STACK)
        return v.value if r == 0 else f"error {r}"

    def stage(name, checkpointable, **extra):
        torch.cuda.synchronize()
        time.sleep(0.5)
        rec = dict(rank=rank, stage=name, checkpointable=checkpointable, nvml_mib=nvml_by_gpu(os.getpid()), reserved_mib=torch.cuda.memory_reserved() >> 20, stack=stack(), **extra)
        print("STAGE " + json.dumps(rec), flush=True)
        if sys.stdin.readline().strip() != "go":
            sys.exit(1)

    def set_stack(v):
        t = time.perf_counter()
        r = cu.cuCtxSetLimit(STACK, ctypes.c_size_t(v))
        torch.cuda.synchronize()
        return r, round(time.perf_counter() - t, 4)

    dist.init_process_group("nccl")
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    torch.manual_seed(1234)
    g = torch.Generator(device=dev)
    g.manual_seed(100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)).to(dev)
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(100):
        x = torch.randn(128, 512, device=dev, generator=g)
        y = torch.randint(0, 10, (128,), device=dev, generator=g)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        v = loss.detach().clone()
        dist.all_reduce(v)
        v.item()
    stage("after 100 DDP steps", False)
    dist.destroy_process_group()
    stage("process group destroyed", True)
    del net, opt
    torch.cuda.empty_cache()
    stage("allocator cache emptied", True)
    old = stack()
    r, s = set_stack(1024)
    stage("stack limit set to 1024", True, result=r, set_s=s)
    r, s = set_stack(0)
    stage("stack limit set to 0", True, result=r, set_s=s)
    a = torch.randn(4096, 4096, device=dev)
    (a @ a).sum().item()
    out = model(torch.randn(128, 512, device=dev)).sum().item()
    stage("a matmul and a forward after", True, forward=out)
    r, s = set_stack(old)
    stage(f"stack limit set back to {old}", True, result=r, set_s=s)


class Driver:
    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        assert self.cu.cuInit(0) == 0

    def call(self, name, pid, args=None):
        t = time.perf_counter()
        r = getattr(self.cu, name)(ctypes.c_int(pid), args)
        return r, round(time.perf_counter() - t, 4)

    def lock(self, pid):
        args = (ctypes.c_uint * 16)()
        args[0] = 10000
        return self.call("cuCheckpointProcessLock", pid, ctypes.byref(args))


def rss_anon_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) >> 10
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29555"), WORLD_SIZE=str(args.ranks), NCCL_NVLS_ENABLE="0")
    ranks = [subprocess.Popen([sys.executable, __file__, "--rank-main"], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(args.ranks)]
    drv = Driver()
    while True:
        recs = []
        for proc in ranks:
            line = proc.stdout.readline()
            while line and not line.startswith("STAGE "):
                line = proc.stdout.readline()
            if not line:
                recs = None
                break
            recs.append(json.loads(line[6:]))
        if recs is None:
            break
        for proc, rec in zip(ranks, recs):
            if rec.pop("checkpointable"):
                pid = proc.pid
                before = rss_anon_mib(pid)
                rec["lock"] = drv.lock(pid)
                rec["checkpoint"] = drv.call("cuCheckpointProcessCheckpoint", pid)
                rec["anon_growth_mib"] = rss_anon_mib(pid) - before
                rec["restore"] = drv.call("cuCheckpointProcessRestore", pid)
                rec["unlock"] = drv.call("cuCheckpointProcessUnlock", pid)
            print(json.dumps(rec), flush=True)
        for proc in ranks:
            proc.stdin.write("go\n")
            proc.stdin.flush()
    for proc in ranks:
        proc.wait()
        print(f"rank pid {proc.pid} exited {proc.returncode}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--rank-main"]:
        rank_main()
    else:
        main()
