#!/usr/bin/env python3
"""The OpenCL layer's cost while nothing is checkpointed, side by side in one run: a program
with no layer, with the inline layer (libhiber_opencl.so preloaded, calling the platform
itself), and, with --hiber, through the proxy (the layer sending every call to a proxy
process, as `hiber run --opencl=proxy` does). Runs alternate between the modes, the same
number of times each. Prints a markdown row per program and device: the medians of the
per-call times and their ratios to no layer.

Programs (built from this directory): launch.c (many tiny kernels, small transfers: the
pattern where a layer costs the most), roundtrip.c (a call whose answer the
application waits for, over and over) and bandwidth.c (blocking writes and reads of
--mib MiB from pageable memory; its "per call" is one transfer).

Usage: overhead.py LAUNCH_BINARY LAYER_LIB [--roundtrip BINARY] [--hiber HIBER]
       [--bandwidth BINARY [--mib N]]
       [--pairs N] [--rounds N] [--device D ...]
(D as the programs take it: an index, gpu or cpu.) The environment (OCL_ICD_VENDORS,
POCL_DEVICES, and HIBER_OPENCL_PINNED for the proxy) passes through. --only PROGRAM,...
runs only those rows.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time


def run(binary, count, device, env_extra):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.pop("HIBER_OPENCL_PROXY", None)
    env.update(env_extra)
    out = subprocess.run([binary, "3", str(count), device], env=env, check=True, capture_output=True, text=True).stdout
    # The first repetition warms caches and compilers up; the rest count.
    times = [float(l.split()[3]) for l in out.splitlines() if l.startswith("rep ")]
    # bandwidth.c's `gbs R write W read R`: each direction's GB/s.
    gbs = [(float(l.split()[3]), float(l.split()[5])) for l in out.splitlines() if l.startswith("gbs ")][1:]
    return statistics.median(times[1:]), gbs


class Proxy:
    """A job's OpenCL proxy listener (`hiber __opencl-proxy`), for the benchmark's runs."""

    def __init__(self, hiber):
        self.dir = tempfile.mkdtemp(prefix="hiber-bench-proxy-")
        self.sock = os.path.join(self.dir, "opencl-proxy.sock")
        # A job in proxy mode that is "starting" (no record yet) keeps the listener up.
        jobs = os.path.join(self.dir, "jobs")
        os.makedirs(os.path.join(jobs, "bench"))
        open(os.path.join(jobs, "bench", "opencl-proxy"), "w").close()
        self.p = subprocess.Popen([hiber, "__opencl-proxy", "--listen", self.sock, "--jobs", jobs], stderr=subprocess.DEVNULL)
        for _ in range(500):
            if os.path.exists(self.sock):
                return
            time.sleep(0.01)
        raise SystemExit("the OpenCL proxy did not start")

    def close(self):
        self.p.kill()
        self.p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("layer")
    ap.add_argument("--roundtrip", help="roundtrip.c's binary: a row for calls that wait for their answer")
    ap.add_argument("--bandwidth", help="bandwidth.c's binary: a row for 1 GiB writes and reads (--mib)")
    ap.add_argument("--mib", type=int, default=1024, help="the bandwidth row's transfer size")
    ap.add_argument("--hiber", help="hiber's binary: a column for the proxy")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--device", action="append", default=None)
    ap.add_argument("--only", help="run only these programs (comma-separated: launch, roundtrip, bandwidth)")
    a = ap.parse_args()
    proxy = Proxy(a.hiber) if a.hiber else None
    modes = [("no layer", {}), ("inline layer", {"LD_PRELOAD": a.layer})]
    if proxy:
        modes.append(("proxy", {"LD_PRELOAD": a.layer, "HIBER_OPENCL_PROXY": proxy.sock}))
    programs = [("launch", a.binary, a.rounds)]
    if a.roundtrip:
        programs.append(("roundtrip", a.roundtrip, a.rounds * 5))
    if a.bandwidth:
        # µs per transfer of MIB MiB: the ratio to no layer is the inverse of the share of
        # its bandwidth.
        programs.append((f"bandwidth {a.mib} MiB", a.bandwidth, a.mib))
    if a.only:
        programs = [p for p in programs if p[0].split()[0] in a.only.split(",")]
    head = " | ".join(f"{m} (µs/call, median)" for m, _ in modes)
    ratios = " | ".join(f"{m} / no layer" for m, _ in modes[1:])
    print(f"| program | device | runs per mode | {head} | {ratios} |")
    print("|---" * (3 + 2 * len(modes) - 1) + "|")
    notes = []
    try:
        for name, binary, count in programs:
            for dev in a.device or ["0"]:
                got = {m: [] for m, _ in modes}
                gbs = {m: [] for m, _ in modes}
                for i in range(a.pairs):
                    # Rotate which goes first, so drift does not favour one mode.
                    for m, extra in modes[i % len(modes):] + modes[: i % len(modes)]:
                        t, g = run(binary, count, dev, extra)
                        got[m].append(t)
                        gbs[m] += g
                med = [statistics.median(got[m]) for m, _ in modes]
                cells = " | ".join(f"{x:.4f}" for x in med)
                rs = " | ".join(f"{x / med[0]:.3f}" for x in med[1:])
                print(f"| {name} | {dev} | {a.pairs} | {cells} | {rs} |", flush=True)
                if all(gbs[m] for m, _ in modes):
                    each = ", ".join(
                        f"{m} write {statistics.median(w for w, _ in gbs[m]):.2f} read {statistics.median(r for _, r in gbs[m]):.2f}" for m, _ in modes
                    )
                    notes.append(f"{name} on {dev}, GB/s (medians): {each}")
    finally:
        if proxy:
            proxy.close()
    for n in notes:
        print(f"\n- {n}")


if __name__ == "__main__":
    main()
