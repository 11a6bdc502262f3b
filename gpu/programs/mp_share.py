"""CUDA tensors shared between processes by torch.multiprocessing, for hiber's GPU suite.

The parent (the producer) holds `shared` (--mib MiB of int64 on the GPU) and `results` (one
int64 per step) and hands both to a spawned consumer through a Queue: torch sends legacy
CUDA IPC handles (`cudaIpcGetMemHandle`, and an interprocess event to wait on). Every step
the producer adds the step to `shared` in place and sends the step; the consumer sums
`shared` through its own mapping of the producer's memory, writes the sum into
`results[step]` (the producer's memory again) and answers with it. Every --every steps the
producer shares a fresh tensor too, which the consumer sums into its answer and drops
(opening and closing a handle while the job runs, also after a restore). The producer
checks each answer against its own sum and against `results`, and folds it into a checksum:
`step N checksum X t MS` per step. A consumer that lost its mapping, or read stale memory,
changes the trajectory from that step on.

A second spawned process, the reader, allocates no device memory of its own: it reads
`shared[step]` and writes it into `results2[step]` (both the producer's memory) through
views, which the caching allocator serves without allocating.

At the end the producer checks `results` and `results2` whole and prints `verify ok`.
"""
import argparse
import sys
import time

import torch
import torch.multiprocessing as mp


def consumer(requests, answers):
    shared, results = requests.get()
    while (msg := requests.get()) is not None:
        step, extra = msg
        s = int(shared.sum().item())
        if extra is not None:
            s += int(extra.sum().item())
            del extra
        results[step] = s
        torch.cuda.synchronize()
        answers.put(s)


def reader(requests, answers):
    shared, results2 = requests.get()
    while (step := requests.get()) is not None:
        v = int(shared[step].item())
        results2[step] = v
        torch.cuda.synchronize()
        answers.put(v)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--interval-ms", type=int, default=20)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--every", type=int, default=25)
    args = p.parse_args()

    dev = torch.device("cuda")
    n = args.mib * (1 << 20) // 8
    shared = torch.arange(n, device=dev, dtype=torch.int64)
    results = torch.zeros(args.steps, device=dev, dtype=torch.int64)
    results2 = torch.zeros(args.steps, device=dev, dtype=torch.int64)
    torch.cuda.synchronize()

    ctx = mp.get_context("spawn")
    requests, answers = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(requests, answers), daemon=True)
    proc.start()
    requests.put((shared, results))
    r_requests, r_answers = ctx.Queue(), ctx.Queue()
    rproc = ctx.Process(target=reader, args=(r_requests, r_answers), daemon=True)
    rproc.start()
    r_requests.put((shared, results2))

    base = n * (n - 1) // 2
    added = 0
    acc = 0
    ok = True
    print(f"start mp_share steps {args.steps} pids {proc.pid} {rproc.pid} mib {args.mib}", flush=True)
    for step in range(args.steps):
        shared.add_(step)
        added += step
        extra = None
        want = base + added * n
        if step % args.every == 0:
            extra = torch.full((1 << 18,), step + 1, device=dev, dtype=torch.int64)
            want += (step + 1) << 18
        torch.cuda.synchronize()
        requests.put((step, extra))
        r_requests.put(step)
        got, read = answers.get(), r_answers.get()
        del extra
        if got != want or int(results[step].item()) != want or read != step + added or int(results2[step].item()) != read:
            ok = False
            print(f"step {step} WRONG got {got} results {int(results[step].item())} want {want} read {read}", flush=True)
        acc = (acc * 1000003 + got) % (1 << 61)
        acc = (acc * 1000003 + read) % (1 << 61)
        print(f"step {step} checksum {acc:016x} t {int(time.time() * 1000)}", flush=True)
        time.sleep(args.interval_ms / 1000)

    requests.put(None)
    r_requests.put(None)
    proc.join(60)
    rproc.join(60)
    expect = torch.tensor([base + (s * (s + 1) // 2) * n + (((s + 1) << 18) if s % args.every == 0 else 0) for s in range(args.steps)], dtype=torch.int64)
    expect2 = torch.tensor([s + s * (s + 1) // 2 for s in range(args.steps)], dtype=torch.int64)
    ok = ok and proc.exitcode == 0 and rproc.exitcode == 0 and torch.equal(results.cpu(), expect) and torch.equal(results2.cpu(), expect2)
    if ok:
        print("verify ok every sum the consumer made on the producer's memory was right", flush=True)
        sys.exit(0)
    print(f"verify FAILED consumer exit {proc.exitcode} reader exit {rproc.exitcode}", flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
