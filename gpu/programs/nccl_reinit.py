"""NCCL communicators ended and made again by the program itself, with no hiber: the
control for hiber's NCCL rebuild.

Two ranks (RANK 0 and 1, started apart) meet through files in --dir: rank 0 draws each
generation's unique id and writes it there. Each step all-reduces --mib of int32 through
NCCL's own API (ctypes on the libnccl.so.2 PyTorch loaded), on PyTorch's current stream, and
checks every element of the sum. Every --every steps both ranks end the communicator
(`ncclCommAbort`, or `ncclCommDestroy` with --how destroy) and make a new one from a fresh
id, on the main thread or, with --thread, on a thread that exits afterwards (as hiber's
agent does). Prints `step N ok` per step, and `done` at the end; a wrong sum ends the run
with `step N WRONG`.
"""
import argparse
import ctypes
import glob
import os
import threading
import time

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--steps", type=int, default=200)
p.add_argument("--every", type=int, default=20)
p.add_argument("--mib", type=int, default=64)
p.add_argument("--how", choices=("abort", "destroy"), default="abort")
p.add_argument("--thread", action="store_true")
args = p.parse_args()

import torch  # noqa: E402

rank = int(os.environ["RANK"])
torch.cuda.set_device(0)
torch.zeros(1, device="cuda")


def libnccl():
    with open("/proc/self/maps") as f:
        for line in f:
            if "libnccl.so" in line:
                return line.split()[-1]
    import site

    for d in site.getsitepackages():
        for path in glob.glob(os.path.join(d, "nvidia", "nccl*", "lib", "libnccl.so.2")):
            return path
    return "libnccl.so.2"


nccl = ctypes.CDLL(libnccl())


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def check(r, what):
    if r != 0:
        raise SystemExit(f"{what}: NCCL error {r}")


def unique_id(gen):
    path = os.path.join(args.dir, f"id{gen}")
    if rank == 0:
        uid = UniqueId()
        check(nccl.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        with open(path + ".tmp", "wb") as f:
            # (Not bytes(uid.internal): a c_char array field reads as a string, cut at its
            # first NUL.)
            f.write(ctypes.string_at(ctypes.addressof(uid), 128))
        os.rename(path + ".tmp", path)
        return uid
    while not os.path.exists(path):
        time.sleep(0.01)
    uid = UniqueId()
    raw = open(path, "rb").read()
    ctypes.memmove(ctypes.addressof(uid), raw, len(raw))
    return uid


def make(gen):
    comm = ctypes.c_void_p()
    uid = unique_id(gen)

    def init():
        torch.cuda.set_device(0)
        check(nccl.ncclCommInitRank(ctypes.byref(comm), 2, uid, rank), "ncclCommInitRank")

    if args.thread:
        t = threading.Thread(target=init)
        t.start()
        t.join()
    else:
        init()
    return comm


n = args.mib << 18
idx = torch.arange(n, device="cuda", dtype=torch.int32) % 7
gen = 0
comm = make(gen)
for step in range(args.steps):
    if step and step % args.every == 0:
        check((nccl.ncclCommAbort if args.how == "abort" else nccl.ncclCommDestroy)(comm), args.how)
        gen += 1
        comm = make(gen)
    x = (rank + 1) * (step + 1) + idx
    stream = torch.cuda.current_stream().cuda_stream
    check(nccl.ncclAllReduce(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(x.data_ptr()), ctypes.c_size_t(n), 2, 0, comm, ctypes.c_void_p(stream)), "ncclAllReduce")
    want = 3 * (step + 1) + 2 * idx
    if not torch.equal(x, want):
        print(f"step {step} WRONG", flush=True)
        raise SystemExit(1)
    print(f"step {step} ok", flush=True)
check(nccl.ncclCommDestroy(comm), "ncclCommDestroy")
print("done", flush=True)
