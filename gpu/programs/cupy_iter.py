"""CuPy: power iteration with a raw kernel, for hiber's GPU suite.

A 4096x4096 matrix from a fixed seed, a vector multiplied by it and normalized each step,
then passed through a custom ElementwiseKernel; prints `step N checksum X t MS` with X a
hash of the vector's bits. At the end it checks --extra-gib of device memory word by word.
"""
import argparse
import os
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--interval-ms", type=int, default=20)
p.add_argument("--extra-gib", type=float, default=1.0)
args = p.parse_args()

import cupy as cp  # noqa: E402

rs = cp.random.RandomState(1234)
a = rs.standard_normal((4096, 4096), dtype=cp.float32)
v = rs.standard_normal(4096, dtype=cp.float32)
squash = cp.ElementwiseKernel("float32 x", "float32 y", "y = x / (1.0f + fabsf(x))", "squash")
extra = cp.arange(int(args.extra_gib * (1 << 30) // 8), dtype=cp.int64)
print(f"start cupy steps {args.steps} pid {os.getpid()} cupy {cp.__version__}", flush=True)
for step in range(args.steps):
    v = a @ v
    v = squash(v / cp.linalg.norm(v))
    bits = v.view(cp.uint32).astype(cp.uint64)
    x = int((bits * cp.arange(1, bits.size + 1, dtype=cp.uint64)).sum() % (1 << 32))
    print(f"step {step} checksum {x:08x} t {int(time.time() * 1000)}", flush=True)
    time.sleep(args.interval_ms / 1000)
ok = bool(cp.array_equal(extra, cp.arange(extra.size, dtype=cp.int64)))
print("verify ok extra memory intact" if ok else "verify FAILED extra memory", flush=True)
raise SystemExit(0 if ok else 1)
