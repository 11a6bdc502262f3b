"""JAX data-parallel training over every GPU in one process, for hiber's GPU suite.

One process drives all the GPUs JAX sees: the batch is sharded over a mesh of them and the
parameters are replicated, so XLA sums the gradients across the GPUs with NCCL, which it
loads itself (`dlopen("libnccl.so.2")` and `dlsym` of each entry point, XLA's NCCL stub),
one communicator rank per GPU in this one process. Memory settings are JAX's defaults
(75% of each GPU preallocated).

Prints `step N checksum X t MS loss L` per step (X: the loss's float32 bits in hex): a
restored run must reproduce an uninterrupted one bit for bit. It also holds --extra-gib of
device memory per GPU with known content and checks it word by word at the end.
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
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

devs = jax.devices()
mesh = Mesh(np.array(devs), ("data",))
replicated = NamedSharding(mesh, P())
sharded = NamedSharding(mesh, P("data"))

key = jax.random.PRNGKey(1234)
sizes = [512, 2048, 2048, 10]
keys = jax.random.split(key, len(sizes))
params = [
    (jax.random.normal(k, (a, b), jnp.float32) / jnp.sqrt(a), jnp.zeros((b,), jnp.float32)) for k, a, b in zip(keys, sizes[:-1], sizes[1:])
]
params = jax.device_put(params, replicated)
batch = 256 * len(devs)


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
    x = jax.lax.with_sharding_constraint(jax.random.normal(kx, (batch, 512), jnp.float32), sharded)
    y = jax.lax.with_sharding_constraint(jax.random.randint(ky, (batch,), 0, 10), sharded)
    # The gradients of replicated parameters over a sharded batch: an all-reduce (NCCL).
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params, grads)
    return jax.lax.with_sharding_constraint(params, replicated), loss


n = int(args.extra_gib * (1 << 30) // 4) * len(devs)
extra = jax.device_put(jnp.arange(n, dtype=jnp.uint32), sharded)
print(f"start jax-sharded steps {args.steps} pid {os.getpid()} jax {jax.__version__} devices {len(devs)}", flush=True)
for step in range(args.steps):
    params, loss = train_step(params, step)
    val = float(loss)
    bits = struct.unpack("<I", struct.pack("<f", val))[0]
    print(f"step {step} checksum {bits:08x} t {int(time.time() * 1000)} loss {val:.9g}", flush=True)
    time.sleep(args.interval_ms / 1000)
ok = bool(jnp.array_equal(extra, jnp.arange(n, dtype=jnp.uint32)))
print("verify ok extra memory intact" if ok else "verify FAILED extra memory", flush=True)
raise SystemExit(0 if ok else 1)
