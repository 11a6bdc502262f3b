"""PyTorch training with a fixed seed, for hiber's GPU suite.

Prints `step N checksum X t MS loss L` per step, where X is the loss's float32 bits in hex:
a restored run must reproduce an uninterrupted run's trajectory bit for bit.

--expandable has PyTorch's caching allocator map its memory with CUDA VMM (cuMemCreate /
cuMemMap) instead of cudaMalloc. --compile runs the model through torch.compile, whose
kernels differ from eager ones: compare its trajectory only with another --compile run.
--loader-workers N feeds the batches from a DataLoader with N persistent worker processes,
forked (Linux's default start method) after CUDA is initialized, as nearly every training
script does; pinned batches, a shuffled sampler with its own seed. Its trajectory differs
from the default one: compare it only with another run with the same N.
Without these flags the program and its output are what they always were.
"""
import argparse
import os
import struct
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--interval-ms", type=int, default=20)
p.add_argument("--extra-gib", type=float, default=2.0, help="extra device memory held, with known content")
p.add_argument("--expandable", action="store_true", help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
p.add_argument("--compile", action="store_true", help="wrap the model in torch.compile (default mode)")
p.add_argument("--loader-workers", type=int, default=0, help="batches from a DataLoader with this many persistent workers")
args = p.parse_args()

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
if args.expandable:
    # The allocator reads its configuration once, so it is set before torch is loaded.
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
import torch  # noqa: E402

torch.manual_seed(1234)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
model = torch.nn.Sequential(
    torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 10)
).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
# The compiled module shares the model's parameters; deterministic algorithms (above) also
# keep inductor from choosing kernels by timing them.
net = torch.compile(model) if args.compile else model
g = torch.Generator(device=dev)
g.manual_seed(99)
extra = torch.arange(int(args.extra_gib * (1 << 30) // 8), device=dev, dtype=torch.int64)


class Synthetic(torch.utils.data.Dataset):
    """Sample i is a function of i alone, whichever worker makes it."""

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        gi = torch.Generator().manual_seed(i)
        return torch.randn(512, generator=gi), torch.randint(0, 10, (), generator=gi)


def loader_batches():
    loader = torch.utils.data.DataLoader(
        Synthetic(),
        batch_size=256,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
        num_workers=args.loader_workers,
        persistent_workers=True,
        pin_memory=True,
    )
    while True:
        for x, y in loader:
            yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)


batches = loader_batches() if args.loader_workers else None
print(f"start train steps {args.steps} pid {os.getpid()} torch {torch.__version__}", flush=True)
for step in range(args.steps):
    if batches:
        x, y = next(batches)
    else:
        x = torch.randn(256, 512, device=dev, generator=g)
        y = torch.randint(0, 10, (256,), device=dev, generator=g)
    loss = torch.nn.functional.cross_entropy(net(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    val = loss.item()
    bits = struct.unpack("<I", struct.pack("<f", val))[0]
    print(f"step {step} checksum {bits:08x} t {int(time.time() * 1000)} loss {val:.9g}", flush=True)
    time.sleep(args.interval_ms / 1000)
# The extra memory must have survived intact.
ok = bool(torch.equal(extra, torch.arange(extra.numel(), device=dev, dtype=torch.int64)))
print("verify ok extra memory intact" if ok else "verify FAILED extra memory", flush=True)
raise SystemExit(0 if ok else 1)
