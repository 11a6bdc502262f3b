"""A CUDA process with children forked after CUDA is initialized, for hiber's GPU suite.

After torch has initialized CUDA and filled device memory with known content, the process
starts four children, each the way programs do it:
- `mp`:    a multiprocessing.Process with the fork start method, fed through Queues;
- `fork`:  a bare os.fork child, fed through pipes;
- `popen`: a subprocess.Popen of a Python interpreter (fork + exec), fed through its stdin;
- `shell`: a shell started by os.system, whose `cat` copies lines from a FIFO to a file.
Each child keeps a counter of its own. At every step the parent asks each for a word that
depends on the step and on that counter, and folds the answers into a checksum on the GPU:
`step N checksum X t MS` per step. A child that was restarted, or whose state was lost,
changes the trajectory from that step on.

At the end the parent checks the device memory word by word, that the shell's copy holds
every line it sent, and prints `verify ok`.
"""
import argparse
import hashlib
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--interval-ms", type=int, default=20)
p.add_argument("--mib", type=int, default=1024, help="device memory held, with known content")
args = p.parse_args()

import torch  # noqa: E402

dev = torch.device("cuda")
held = torch.arange(args.mib * (1 << 20) // 8, device=dev, dtype=torch.int64)
torch.cuda.synchronize()


def word(name, counter, step):
    return int.from_bytes(hashlib.blake2b(f"{name}:{counter}:{step}".encode(), digest_size=4).digest(), "little")


def mp_child(requests, answers):
    counter = 0
    while (step := requests.get()) is not None:
        counter += 1
        answers.put(word("mp", counter, step))


ctx = mp.get_context("fork")
mp_req, mp_ans = ctx.Queue(), ctx.Queue()
mp_proc = ctx.Process(target=mp_child, args=(mp_req, mp_ans), daemon=True)
mp_proc.start()

down_r, down_w = os.pipe()  # parent -> child
up_r, up_w = os.pipe()  # child -> parent
fork_pid = os.fork()
if fork_pid == 0:
    os.close(down_w)
    os.close(up_r)
    counter = 0
    with os.fdopen(down_r, "r") as inp, os.fdopen(up_w, "w") as out:
        for line in inp:
            counter += 1
            out.write(f"{word('fork', counter, int(line))}\n")
            out.flush()
    os._exit(0)
os.close(down_r)
os.close(up_w)
fork_in, fork_out = os.fdopen(down_w, "w"), os.fdopen(up_r, "r")

POPEN_CHILD = """
import hashlib, sys
counter = 0
for line in sys.stdin:
    counter += 1
    d = hashlib.blake2b(f"popen:{counter}:{int(line)}".encode(), digest_size=4).digest()
    print(int.from_bytes(d, "little"), flush=True)
"""
popen = subprocess.Popen([sys.executable, "-c", POPEN_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, close_fds=False)

work = tempfile.mkdtemp(prefix="forks-")
fifo, copy = os.path.join(work, "fifo"), os.path.join(work, "copy")
os.mkfifo(fifo)
# os.system blocks until the shell ends: it runs on a thread of its own, as it would in a
# program that shells out from a worker thread.
shell = threading.Thread(target=os.system, args=(f"cat {fifo} > {copy}",), daemon=True)
shell.start()
fifo_w = open(fifo, "w")

acc = torch.zeros((), dtype=torch.int64, device=dev)
print(f"start forks steps {args.steps} pid {os.getpid()} children mp {mp_proc.pid} fork {fork_pid} popen {popen.pid}", flush=True)
for step in range(args.steps):
    mp_req.put(step)
    fork_in.write(f"{step}\n")
    fork_in.flush()
    popen.stdin.write(f"{step}\n")
    popen.stdin.flush()
    fifo_w.write(f"line {step}\n")
    fifo_w.flush()
    words = [mp_ans.get(), int(fork_out.readline()), int(popen.stdout.readline())]
    for w in words:
        acc = (acc * 1000003 + w) % (1 << 31)
    x = int(acc.item())
    print(f"step {step} checksum {x:08x} t {int(time.time() * 1000)}", flush=True)
    time.sleep(args.interval_ms / 1000)

mp_req.put(None)
fork_in.close()
popen.stdin.close()
fifo_w.close()
mp_proc.join(30)
os.waitpid(fork_pid, 0)
popen.wait(30)
shell.join(30)
lines = open(copy).read().splitlines()
ok_mem = bool(torch.equal(held, torch.arange(held.numel(), device=dev, dtype=torch.int64)))
ok_children = mp_proc.exitcode == 0 and popen.returncode == 0
ok_shell = lines == [f"line {s}" for s in range(args.steps)]
if ok_mem and ok_children and ok_shell:
    print("verify ok device memory intact, every child answered and ended cleanly", flush=True)
    sys.exit(0)
print(f"verify FAILED memory {ok_mem} children {ok_children} shell {ok_shell} ({len(lines)} lines)", flush=True)
sys.exit(1)
