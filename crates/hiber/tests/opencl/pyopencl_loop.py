"""A PyOpenCL program (Debian's python3-pyopencl): a kernel of its own and pyopencl.array's
generated ones, each step checked against NumPy. Prints `step N checksum X t MS dev NAME`,
then `verify ok`. Usage: pyopencl_loop.py STEPS DEVICE SLEEP_S (DEVICE: an index over all
platforms' devices)."""
import sys, time, hashlib
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
steps = int(sys.argv[1]); dev = int(sys.argv[2]); sleep = float(sys.argv[3])
devs = [d for p in cl.get_platforms() for d in p.get_devices()]
ctx = cl.Context([devs[dev]])
q = cl.CommandQueue(ctx)
prg = cl.Program(ctx, """
__kernel void advance(__global uint *a, uint it) { uint i = get_global_id(0); a[i] = a[i] * 1103515245u + 12345u + (it ^ i); }
""").build()
a = cla.to_device(q, np.arange(1 << 16, dtype=np.uint32))
ref = np.arange(1 << 16, dtype=np.uint32)
k = prg.advance


def device_name():
    # PyOpenCL asks a string's size, then the string: a checkpoint that falls between the
    # two and moves the job to a device with a longer name answers INVALID_VALUE to the
    # second (docs/user/opencl.md, "Moving to another device"). Asked again, both come from the new
    # device.
    try:
        return q.device.name
    except cl.LogicError:
        return q.device.name


for s in range(1, steps + 1):
    k(q, a.shape, None, a.data, np.uint32(s))
    b = (a * 3 + 1).get()          # pyopencl.array's own generated kernels
    ref = (ref * np.uint32(1103515245) + np.uint32(12345) + (np.uint32(s) ^ np.arange(1 << 16, dtype=np.uint32))).astype(np.uint32)
    want = (ref * 3 + 1).astype(np.uint32)
    h = int(hashlib.blake2b(b.tobytes(), digest_size=8).hexdigest(), 16)
    print(f"step {s} checksum {h:016x} t {int(time.time()*1000)} dev {device_name().replace(' ', '_')}", flush=True)
    if not np.array_equal(b, want):
        print(f"verify failed at step {s}", flush=True); sys.exit(1)
    time.sleep(sleep)
print("verify ok", flush=True)
