"""JAX training with its default settings, for hiber's GPU suite.

Nothing is configured: XLA's client preallocates 75% of the GPU's memory at start, as it
does for every user who sets nothing. An MLP trained with SGD on data drawn from a fixed
key prints `step N checksum X t MS loss L` per step (X: the loss's float32 bits in hex);
a restored run must reproduce an uninterrupted one bit for bit. It also holds --extra-gib
of device memory with known content and checks it word by word at the end.
"""
import argparse
import os
import struct
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--interval-ms", type=int, default=20)
p.add_argument("--extra-gib", type=float, default=1.0)
args = p.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

key = jax.random.PRNGKey(1234)
sizes = [512, 2048, 2048, 10]
keys = jax.random.split(key, len(sizes))
params = [
    (jax.random.normal(k, (a, b), jnp.float32) / jnp.sqrt(a), jnp.zeros((b,), jnp.float32)) for k, a, b in zip(keys, sizes[:-1], sizes[1:])
]


def loss_fn(params, x, y):
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = jax.nn.gelu(h)
    logp = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


@jax.jit
def train_step(params, step):
    k = jax.random.fold_in(keys[-1], step)
    kx, ky = jax.random.split(k)
    x = jax.random.normal(kx, (256, 512), jnp.float32)
    y = jax.random.randint(ky, (256,), 0, 10)
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params, grads)
    return params, loss


n = int(args.extra_gib * (1 << 30) // 4)
extra = jnp.arange(n, dtype=jnp.uint32)
dev = jax.devices()[0]
stats = dev.memory_stats() or {}
limit = stats.get("bytes_limit", 0)
print(f"start jax steps {args.steps} pid {os.getpid()} jax {jax.__version__} device {dev} pool {limit >> 20} MiB", flush=True)
for step in range(args.steps):
    params, loss = train_step(params, step)
    val = float(loss)
    bits = struct.unpack("<I", struct.pack("<f", val))[0]
    print(f"step {step} checksum {bits:08x} t {int(time.time() * 1000)} loss {val:.9g}", flush=True)
    time.sleep(args.interval_ms / 1000)
ok = bool(jnp.array_equal(extra, jnp.arange(n, dtype=jnp.uint32)))
print("verify ok extra memory intact" if ok else "verify FAILED extra memory", flush=True)
raise SystemExit(0 if ok else 1)
