"""One process using two GPUs, for hiber's GPU suite.

Holds --mib of device memory with known content on each of cuda:0 and cuda:1, and at every
step runs a matrix product on each GPU, copies the result across (cuda:0 -> cuda:1, through
the host or peer access, as torch chooses), and prints `step N checksum X t MS` with X the
bits of a sum over both. At the end it checks both GPUs' memory word by word. Prints which
physical GPU (UUID) each device is now, once at start and once at the end.
"""
import argparse
import os
import struct
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--interval-ms", type=int, default=20)
p.add_argument("--mib", type=int, default=1024)
p.add_argument("--via-host", action="store_true", help="copy between the GPUs through host memory, never enabling peer access")
args = p.parse_args()

import torch  # noqa: E402

torch.manual_seed(5)
devs = [torch.device("cuda:0"), torch.device("cuda:1")]
held = [torch.arange(args.mib * (1 << 20) // 8, device=d, dtype=torch.int64) for d in devs]
a = [torch.randn(1024, 1024, device=d) / 32 for d in devs]
v = [torch.randn(1024, device=d) for d in devs]
uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(2)]
peer = torch.cuda.can_device_access_peer(0, 1) and not args.via_host
print(f"start two_gpus steps {args.steps} pid {os.getpid()} uuids {' '.join(uuids)} peer {int(peer)}", flush=True)
for step in range(args.steps):
    v = [torch.tanh(a[i] @ v[i]) for i in range(2)]
    v[1] = (v[1] + (v[0].cpu().to(devs[1]) if args.via_host else v[0].to(devs[1]))) / 2
    s = float(v[1].sum().item())
    bits = struct.unpack("<I", struct.pack("<f", s))[0]
    print(f"step {step} checksum {bits:08x} t {int(time.time() * 1000)}", flush=True)
    time.sleep(args.interval_ms / 1000)
ok = all(bool(torch.equal(h, torch.arange(h.numel(), device=h.device, dtype=torch.int64))) for h in held)
print("verify ok both GPUs intact" if ok else "verify FAILED", flush=True)
raise SystemExit(0 if ok else 1)
