"""A PyTorch model whose weights, gradients and AdamW state fill --gib GiB of device memory,
training on synthetic data and printing `step N checksum X t MS loss L step_ms D` per step,
where D is the step's own wall time (forward, backward, optimizer, and the loss read back,
without the sleep between steps). With --steps S it prints `done` after S steps and exits;
by default it runs until killed."""
import argparse
import os
import struct
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--gib", type=float, default=8.0)
p.add_argument("--interval-ms", type=int, default=10)
p.add_argument("--steps", type=int, default=0, help="0: run until killed")
p.add_argument("--batch", type=int, default=64, help="rows per step: sets the step's compute")
args = p.parse_args()
torch.manual_seed(0)
width = 8192
# fp32 weights + grads + two AdamW moments: 16 bytes per parameter.
layers = max(1, round(args.gib * (1 << 30) / 16 / (width * width)))
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
x = torch.randn(args.batch, width, device="cuda")
print(f"start train_big layers {layers} params {sum(p.numel() for p in model.parameters())} pid {os.getpid()}", flush=True)
step = 0
while not args.steps or step < args.steps:
    t0 = time.perf_counter()
    loss = model(x).square().mean()
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
    v = loss.item()
    step_ms = (time.perf_counter() - t0) * 1000
    print(f"step {step} checksum {struct.unpack('<I', struct.pack('<f', v))[0]:08x} t {int(time.time() * 1000)} loss {v:.6g} step_ms {step_ms:.3f}", flush=True)
    step += 1
    time.sleep(args.interval_ms / 1000)
print("done", flush=True)
