#!/usr/bin/env python3
"""The OpenCL layer's cost while nothing is checkpointed: bench/opencl/launch.c (many tiny
kernels, small transfers) with and without libhiber_opencl.so preloaded, alternated, the
same number of times each. Prints a markdown row per device: medians of the per-call
times and their ratio.

Usage: overhead.py LAUNCH_BINARY LAYER_LIB [--pairs N] [--rounds N] [--device D ...]
(D as launch.c takes it: an index, gpu or cpu.) The environment (OCL_ICD_VENDORS,
POCL_DEVICES) passes through.
"""
import argparse
import os
import statistics
import subprocess


def run(binary, rounds, device, layer):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if layer:
        env["LD_PRELOAD"] = layer
    out = subprocess.run([binary, "3", str(rounds), device], env=env, check=True, capture_output=True, text=True).stdout
    # The first repetition warms caches and compilers up; the rest count.
    times = [float(l.split()[3]) for l in out.splitlines() if l.startswith("rep ")]
    return statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("layer")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--device", action="append", default=None)
    a = ap.parse_args()
    print("| device | calls per run | pairs | without the layer (µs/call, median) | with it | ratio |")
    print("|---|---|---|---|---|---|")
    for dev in a.device or ["0"]:
        without, with_ = [], []
        for i in range(a.pairs):
            # Alternate which goes first, so drift does not favour one side.
            order = [(False, without), (True, with_)] if i % 2 == 0 else [(True, with_), (False, without)]
            for layer, out in order:
                out.append(run(a.binary, a.rounds, dev, a.layer if layer else None))
        m0, m1 = statistics.median(without), statistics.median(with_)
        calls = a.rounds * 2 + a.rounds // 100 * 2
        print(f"| {dev} | {calls} | {a.pairs} | {m0:.4f} | {m1:.4f} | {m1 / m0:.4f} |")


if __name__ == "__main__":
    main()
