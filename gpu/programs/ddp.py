"""Two-rank training over NCCL, started by torchrun, for hiber's GPU suite.

Ranks started apart (`--init-file`, with RANK and WORLD_SIZE set) meet through a file
rather than torchrun's store, as ranks on two hosts with a shared filesystem would; each
then prints its steps (the checksums are the same on every rank).

Modes: `ddp` (DistributedDataParallel), `fsdp` (FSDP2's fully_shard: all-gathers and
reduce-scatters), `allreduce` (a plain torch.distributed all-reduce loop). Each rank also
holds `--mib` of ballast filled from its own seed. The model is an MLP, one hidden layer of
1024 by default (the suite's); `--hidden`, `--layers` and `--batch` make the benchmark's
larger one, and `--pin-cpus` pins each rank to CPUs of its own.

Rank 0 prints `step N checksum X t MS loss L` per step (X: the bits of the loss, or of the
all-reduced sum, identical run to run). At the end every rank checks that the ranks'
parameters agree bit for bit, that its ballast is what it filled in and (with
`--stack-limit`) that its stack limit is what it set, and rank 0 prints `verify ok`.
"""
import argparse
import os
import struct
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--interval-ms", type=int, default=20)
p.add_argument("--mode", choices=("ddp", "fsdp", "allreduce"), default="ddp")
p.add_argument("--mib", type=int, default=0)
p.add_argument("--stack-limit", type=int, default=0, help="set the kernels' per-thread stack limit (cuCtxSetLimit) to this many bytes at the start, and check at the end that it still is at least that: hiber lowers it for its checkpoints and must set it back")
p.add_argument("--init-file", help="rendezvous through this file (torch's FileStore) rather than torchrun's TCP store: ranks started apart, as on two hosts")
p.add_argument("--hidden", type=int, default=1024, help="width of the model's hidden layers")
p.add_argument("--layers", type=int, default=1, help="number of hidden layers (each --hidden wide)")
p.add_argument("--batch", type=int, default=128)
p.add_argument("--pin-cpus", type=int, default=0, help="pin each rank to this many CPUs of its own (LOCAL_RANK's block), for steadier step times in benchmarks")
args = p.parse_args()
if args.pin_cpus:
    first = int(os.environ.get("LOCAL_RANK", "0")) * args.pin_cpus
    os.sched_setaffinity(0, range(first, first + args.pin_cpus))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if args.init_file:
    dist.init_process_group("nccl", init_method="file://" + args.init_file, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
else:
    dist.init_process_group("nccl")
rank = dist.get_rank()
dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
torch.cuda.set_device(dev)
torch.manual_seed(1234)


def stack_limit(set_to=None):
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")
    if set_to is not None:
        assert cu.cuCtxSetLimit(0, ctypes.c_size_t(set_to)) == 0, "cuCtxSetLimit(CU_LIMIT_STACK_SIZE)"
    v = ctypes.c_size_t()
    assert cu.cuCtxGetLimit(ctypes.byref(v), 0) == 0, "cuCtxGetLimit(CU_LIMIT_STACK_SIZE)"
    return v.value


if args.stack_limit:
    torch.zeros(1, device=dev)
    stack_limit(args.stack_limit)
g = torch.Generator(device=dev)
g.manual_seed(100 + rank)

ballast = ballast_sum = None
if args.mib:
    ballast = torch.randint(-(2**31), 2**31 - 1, (args.mib << 18,), dtype=torch.int32, device=dev, generator=g)


def ballast_total():
    # In slices: widened whole, a ballast of half the GPU would not fit beside itself.
    return sum(int(c.to(torch.int64).sum().item()) for c in ballast.split(1 << 26))


if ballast is not None:
    ballast_sum = ballast_total()


def bits(v):
    return struct.unpack("<I", struct.pack("<f", v))[0]


# The defaults (one hidden layer of 1024) are the suite's model, whose trajectories its
# scenarios compare against.
layers = [torch.nn.Linear(512, args.hidden), torch.nn.GELU()]
for _ in range(args.layers - 1):
    layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 10)).to(dev)
if args.mode == "ddp":
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
elif args.mode == "fsdp":
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    net = fully_shard(model)
else:
    net = None
    state = torch.randn(1 << 20, device=dev, generator=g)
opt = torch.optim.SGD(model.parameters(), lr=0.05) if net is not None else None

for step in range(args.steps):
    if net is not None:
        x = torch.randn(args.batch, 512, device=dev, generator=g)
        y = torch.randint(0, 10, (args.batch,), device=dev, generator=g)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        val = loss.detach().clone()
        dist.all_reduce(val)
        v = float(val.item()) / dist.get_world_size()
    else:
        state.mul_(0.5).add_(torch.randn(state.shape, device=dev, generator=g))
        dist.all_reduce(state)
        state.div_(dist.get_world_size())
        v = float(state.sum().item())
    if rank == 0 or args.init_file:
        print(f"step {step} checksum {bits(v):08x} t {int(time.time() * 1000)} loss {v:.9g}", flush=True)
    time.sleep(args.interval_ms / 1000)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


if net is not None:
    flat = torch.cat([full(p.detach()).flatten() for p in model.parameters()])
else:
    flat = state
other = flat.clone()
dist.broadcast(other, 0)
ok = torch.equal(flat, other) and (ballast is None or ballast_total() == ballast_sum)
if args.stack_limit and stack_limit() < args.stack_limit:
    print(f"rank {rank}: stack limit {stack_limit()} B, set to {args.stack_limit} B at the start", flush=True)
    ok = False
same = torch.tensor([int(ok)], device=dev)
dist.all_reduce(same, op=dist.ReduceOp.MIN)
if rank == 0 or args.init_file:
    print("verify ok ranks agree" if same.item() == 1 else "verify FAILED ranks differ or ballast changed", flush=True)
dist.destroy_process_group()
raise SystemExit(0 if same.item() == 1 else 1)
