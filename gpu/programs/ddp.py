"""Two-rank DistributedDataParallel training over NCCL, started by torchrun, for hiber's GPU
suite (hiber refuses to checkpoint it for now; the job must train on undisturbed).

Rank 0 prints `step N checksum X t MS loss L` per step; at the end every rank checks that
the ranks' parameters agree bit for bit and rank 0 prints `verify ok`.
"""
import argparse
import os
import struct
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--interval-ms", type=int, default=20)
args = p.parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("nccl")
rank = dist.get_rank()
dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
torch.cuda.set_device(dev)
torch.manual_seed(1234)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)).to(dev)
ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
g = torch.Generator(device=dev)
g.manual_seed(100 + rank)
for step in range(args.steps):
    x = torch.randn(128, 512, device=dev, generator=g)
    y = torch.randint(0, 10, (128,), device=dev, generator=g)
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    val = loss.detach().clone()
    dist.all_reduce(val)
    if rank == 0:
        v = float(val.item()) / dist.get_world_size()
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        print(f"step {step} checksum {bits:08x} t {int(time.time() * 1000)} loss {v:.9g}", flush=True)
    time.sleep(args.interval_ms / 1000)
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
other = flat.clone()
dist.broadcast(other, 0)
same = torch.tensor([int(torch.equal(flat, other))], device=dev)
dist.all_reduce(same, op=dist.ReduceOp.MIN)
if rank == 0:
    print("verify ok ranks agree" if same.item() == 1 else "verify FAILED ranks differ", flush=True)
dist.destroy_process_group()
raise SystemExit(0 if same.item() == 1 else 1)
