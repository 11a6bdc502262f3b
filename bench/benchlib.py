"""The benchmark's logic that needs no GPU: reading a workload's progress, measuring gaps
in it, statistics, the agent's overhead, the issue's targets, and the report. Unit-tested
in CI (test_benchlib.py)."""
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import NamedTuple


class Progress(NamedTuple):
    """A progress line of any workload; the fields of hiber's `workload::progress::Progress`."""

    step: int
    checksum: int
    t_ms: int


_DEC = re.compile(r"[0-9]+")
_HEX = re.compile(r"[0-9a-fA-F]+")


def parse_progress(text, prefix=""):
    """Every `PREFIX step N checksum X t MS ...` line, in order, as Progress (X in hex, MS the
    workload's wall clock in milliseconds, anything after MS ignored); other lines are skipped.

    The one parser of the line in Python (the GPU suite uses it too; in Rust it is
    crates/hiber/src/workload/progress.rs, which reads it the same way). Every workload
    prints it: hiber's built-in ones, gpu/programs/ and bench/programs/. The one variation
    is PREFIX: counter.cu --fork prints its child's lines as `child step ...`, which only
    a call with prefix="child " returns; with the default they are foreign lines.

    A line cut short (the process was frozen mid-write, or the log was read while being
    written) is skipped rather than misread."""
    out = []
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        f = line[len(prefix):].split()
        if len(f) < 6 or f[0] != "step" or f[2] != "checksum" or f[4] != "t":
            continue
        if not (_DEC.fullmatch(f[1]) and _HEX.fullmatch(f[3]) and _DEC.fullmatch(f[5])):
            continue
        out.append(Progress(int(f[1]), int(f[3], 16), int(f[5])))
    return out


def job_log(state, name):
    """A hiber job's stdout log in state directory `state` ("" until there is one)."""
    try:
        with open(os.path.join(state, "jobs", name, "stdout.log")) as f:
            return f.read()
    except OSError:
        return ""


def wait_steps(state, name, at_least, limit_s=120):
    """Waits until job `name` printed `at_least` progress lines; returns them."""
    start = time.monotonic()
    while True:
        prog = parse_progress(job_log(state, name))
        if len(prog) >= at_least:
            return prog
        if time.monotonic() - start > limit_s:
            raise RuntimeError(f"job {name} made {len(prog)} steps, not {at_least}, in {limit_s} s")
        time.sleep(0.02)


def downtime_ms(progress, start_ms, end_ms):
    """The longest gap between consecutive progress lines that overlaps [start, end]: how
    long the application made no progress around a checkpoint, by its own clock."""
    worst = None
    for a, b in zip(progress, progress[1:]):
        if b.t_ms >= start_ms and a.t_ms <= end_ms:
            gap = b.t_ms - a.t_ms
            worst = gap if worst is None else max(worst, gap)
    return worst


def typical_gap_ms(progress, before_ms):
    """Median gap between progress lines before `before_ms`: the workload's own step time,
    against which a downtime is read."""
    gaps = [b.t_ms - a.t_ms for a, b in zip(progress, progress[1:]) if b.t_ms < before_ms]
    return statistics.median(gaps) if gaps else None


def first_progress_after(progress, after_ms, min_step=None):
    """Timestamp of the first progress line after `after_ms` (and at or past `min_step`)."""
    for p in progress:
        if p.t_ms > after_ms and (min_step is None or p.step >= min_step):
            return p.t_ms
    return None


def summary(samples):
    """{median, min, max, n} of the non-missing samples, or None when there are none."""
    xs = sorted(x for x in samples if x is not None)
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def fmt(s, unit="s", scale=1.0, digits=2):
    if not s:
        return "n/a"
    med, lo, hi = s["median"] * scale, s["min"] * scale, s["max"] * scale
    return f"{med:.{digits}f}{unit} ({lo:.{digits}f}–{hi:.{digits}f})"


METRICS = [
    ("downtime_s", "downtime", "s"),
    ("durable_s", "image durable", "s"),
    ("restore_warm_s", "restore (page cache)", "s"),
    ("restore_cold_s", "restore (cold cache)", "s"),
    ("image_gib", "image size", " GiB"),
    ("ckpt_maxrss_gib", "checkpointer peak RSS", " GiB"),
]


def table(rows):
    """Markdown table: one row per (workload, contender), medians and min–max."""
    head = "| workload | contender | " + " | ".join(m[1] for m in METRICS) + " |"
    sep = "|" + "---|" * (2 + len(METRICS))
    lines = [head, sep]
    for r in rows:
        cells = [fmt(summary(r["samples"].get(key, [])), unit) for key, _, unit in METRICS]
        lines.append(f"| {r['workload']} | {r['contender']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(rows, metric="downtime_s", base="stock", other="hiber"):
    """workload -> median(base) / median(other) for `metric`."""
    out = {}
    by = {(r["workload"], r["contender"]): summary(r["samples"].get(metric, [])) for r in rows}
    for (w, c), s in by.items():
        if c == other and s and by.get((w, base)):
            out[w] = by[(w, base)]["median"] / s["median"] if s["median"] else None
    return out


# hiber with its agent (the default), hiber without it (`hiber run --no-agent`: the driver
# engine alone), and the stock path; a row of another contender goes last.
CONTENDER_ORDER = ("hiber", "hiber-no-agent", "stock")


def _gib_held(workload):
    """The GiB a workload's name gives first: "32 GiB", "PyTorch 8 GiB", "68 GiB held, 47 GiB data"."""
    m = re.search(r"(\d+(?:\.\d+)?) GiB", workload)
    return float(m.group(1)) if m else 0.0


def merge_rows(runs):
    """Rows of several runs, one per (workload, contender), their samples concatenated:
    repetitions of one workload may come from several calls (each call is limited to 10
    minutes on the GPU machine; a 32 GiB pair of samples takes about 5)."""
    merged = {}
    for run_ in runs:
        for r in run_["rows"]:
            m = merged.setdefault((r["workload"], r["contender"]), {"workload": r["workload"], "contender": r["contender"], "samples": {}})
            for k, v in r["samples"].items():
                m["samples"].setdefault(k, []).extend(v)
    order = sorted({w for w, _ in merged}, key=lambda w: (w.startswith("PyTorch"), _gib_held(w), w))
    contenders = sorted({c for _, c in merged}, key=lambda c: (CONTENDER_ORDER.index(c) if c in CONTENDER_ORDER else len(CONTENDER_ORDER), c))
    return [merged[(w, c)] for w in order for c in contenders if (w, c) in merged]


def parse_timings(text, lead, key):
    """The number after `key` on every line `LEAD N ...` (N an integer): `block 3 ms 41.2`
    (the microbenchmark) or `step 7 ... step_ms 12.5` (train_big.py). A line cut short or
    with something else there is skipped."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) < 2 or f[0] != lead:
            continue
        try:
            int(f[1])
            out.append(float(f[f.index(key, 2) + 1]))
        except (ValueError, IndexError):
            continue
    return out


def run_median(values, warmup):
    """Median of `values` after the first `warmup` (lazy module loading, allocator and
    cache warm-up): one program run's figure. None when nothing is left."""
    rest = values[warmup:]
    return statistics.median(rest) if rest else None


def overhead_pct(with_agent, without):
    """(with - without) / without, in percent; None when either is missing."""
    if with_agent is None or not without:
        return None
    return (with_agent - without) / without * 100


def merge_overhead(runs):
    """The agent-overhead entries of several runs, one per benchmark, their per-run medians
    concatenated by side ("hiber": with the agent, "hiber-no-agent": without). A run from
    before the overhead benchmark has none."""
    merged = {}
    for run_ in runs:
        for e in run_.get("overhead", []):
            m = merged.setdefault(e["benchmark"], {"benchmark": e["benchmark"], "unit": e.get("unit", ""), "samples": {}, "pairs": []})
            for side, v in e["samples"].items():
                m["samples"].setdefault(side, []).extend(v)
            m["pairs"].extend(e.get("pairs", []))
    return list(merged.values())


def overhead_of(entry):
    """{with, without (summaries of the per-run medians), pct (overhead of the medians)}."""
    w = summary(entry["samples"].get("hiber", []))
    wo = summary(entry["samples"].get("hiber-no-agent", []))
    return {"with": w, "without": wo, "pct": overhead_pct(w["median"] if w else None, wo["median"] if wo else None)}


def paired_overhead(pairs, confidence=0.9):
    """The overhead of runs paired back to back ([with, without] each): per pair
    with/without - 1 in percent, their median, and a distribution-free interval for that
    median (the sign test's: order statistics X(j)..X(n+1-j), the narrowest whose coverage
    is at least `confidence`; None when too few pairs have one). None without pairs."""
    r = sorted((w / wo - 1) * 100 for w, wo in pairs if w and wo)
    n = len(r)
    if not n:
        return None
    out = {"median": statistics.median(r), "n": n, "low": None, "high": None, "coverage": None}
    for j in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, k) for k in range(j)) / 2**n
        if coverage < confidence:
            break
        out.update(low=r[j - 1], high=r[n - j], coverage=coverage)
    return out


def paired_text(p):
    """`+0.35% (6 pairs; 97% interval -0.40% to +1.10%)`."""
    if p["low"] is None:
        return f"{p['median']:+.2f}% ({p['n']} pairs, too few for an interval)"
    return f"{p['median']:+.2f}% ({p['n']} pairs; {p['coverage'] * 100:.0f}% interval {p['low']:+.2f}% to {p['high']:+.2f}%)"


def overhead_table(entries):
    """Markdown table of the overhead entries: medians with min–max, and the overhead (of
    the back-to-back pairs where the runs kept them, else of the medians)."""
    lines = ["| benchmark | with the agent | without (`--no-agent`) | overhead |", "|---|---|---|---|"]
    for e in entries:
        o = overhead_of(e)
        unit = f" {e['unit']}" if e["unit"] else ""
        paired = paired_overhead(e.get("pairs", []))
        if paired:
            pct = paired_text(paired)
        else:
            n = min(o["with"]["n"] if o["with"] else 0, o["without"]["n"] if o["without"] else 0)
            pct = ("n/a" if o["pct"] is None else f"{o['pct']:+.2f}%") + f" ({n} runs each)"
        lines.append(f"| {e['benchmark']} | {fmt(o['with'], unit, digits=3)} | {fmt(o['without'], unit, digits=3)} | {pct} |")
    return "\n".join(lines)


def durable_rates(runs):
    """(workload, contender) -> {"GBps": [...], "fraction": [...]}: per sample, the image's
    bytes over the seconds until it was durable, and that over the disk write bandwidth
    its own run measured (the ceiling). Samples of a row are aligned: each sample records
    every metric or none."""
    out = {}
    for run_ in runs:
        ceiling = run_.get("ceilings", {}).get("disk_write_GBps")
        for r in run_["rows"]:
            s = r["samples"]
            d = out.setdefault((r["workload"], r["contender"]), {"GBps": [], "fraction": []})
            for gib, secs in zip(s.get("image_gib", []), s.get("durable_s", [])):
                if gib is None or not secs:
                    continue
                gbps = gib * (1 << 30) / secs / 1e9
                d["GBps"].append(gbps)
                if ceiling:
                    d["fraction"].append(gbps / ceiling)
    return out


# The targets are set on the 32 GiB counter, the PyTorch workload and the two
# overhead benchmarks; these are the names the benchmark gives them.
BIG = "32 GiB"
MICRO = "CUDA microbenchmark"


def _median(rows, workload, contender, metric):
    for r in rows:
        if r["workload"] == workload and r["contender"] == contender:
            s = summary(r["samples"].get(metric, []))
            return s["median"] if s else None
    return None


def _verdict(target, value, ok, measured):
    """(target, measured, verdict); `measured` is called only when there is a value."""
    if value is None:
        return (target, "not measured", "not measured")
    return (target, measured(), "met" if ok(value) else "NOT met")


def _downtime_ratio(rows, workload, at_least):
    hiber, stock = _median(rows, workload, "hiber", "downtime_s"), _median(rows, workload, "stock", "downtime_s")
    x = stock / hiber if stock is not None and hiber else None
    return _verdict(f"{workload}: stock downtime / hiber downtime ≥ {at_least}x", x, lambda v: v >= at_least,
                    lambda: f"{x:.1f}x (stock {stock:.2f} s, hiber {hiber:.2f} s)")


def evaluate_targets(runs):
    """The issue's targets, each as (target, measured, verdict), the verdict "met", "NOT met"
    or "not measured" (a run from before a metric existed, or a workload not run)."""
    rows = merge_rows(runs)
    out = []
    down = _median(rows, BIG, "hiber", "downtime_s")
    out.append(_verdict(f"{BIG}: hiber downtime ≤ 2 s", down, lambda v: v <= 2.0, lambda: f"{down:.2f} s"))
    out.append(_downtime_ratio(rows, BIG, 10))
    torch_workloads = [w for w in dict.fromkeys(r["workload"] for r in rows) if w.startswith("PyTorch")]
    for w in torch_workloads or ["PyTorch"]:
        out.append(_downtime_ratio(rows, w, 5))
    warm = _median(rows, BIG, "hiber", "restore_warm_s")
    out.append(_verdict(f"{BIG}: hiber restore from page cache until progress ≤ 5 s", warm, lambda v: v <= 5.0, lambda: f"{warm:.2f} s"))
    rates = durable_rates(runs).get((BIG, "hiber"), {"GBps": [], "fraction": []})
    frac, gbps = summary(rates["fraction"]), summary(rates["GBps"])
    disk = summary([r.get("ceilings", {}).get("disk_write_GBps") for r in runs if any(x["workload"] == BIG and x["contender"] == "hiber" for x in r["rows"])])
    out.append(_verdict(f"{BIG}: hiber image durable at ≥ 90% of the disk's write bandwidth", frac["median"] if frac else None, lambda v: v >= 0.9,
                        lambda: f"{frac['median'] * 100:.0f}% ({gbps['median']:.2f} GB/s; disk {disk['median']:.2f} GB/s)"))
    entries = merge_overhead(runs)
    micro = [e for e in entries if e["benchmark"] == MICRO] or [{"benchmark": MICRO, "unit": "", "samples": {}}]
    torch_steps = [e for e in entries if e["benchmark"].startswith("PyTorch")] or [{"benchmark": "PyTorch step", "unit": "", "samples": {}}]
    for e in micro + torch_steps:
        o = overhead_of(e)
        out.append(_verdict(f"agent overhead, {e['benchmark']} ≤ 1%", o["pct"], lambda v: v <= 1.0,
                            lambda: f"{o['pct']:+.2f}% ({o['with']['median']:.3f} vs {o['without']['median']:.3f} {e['unit']})"))
    return out


FULL = "47 GiB"


def full_gpu_targets(runs):
    """The targets of the issue on a full GPU (H100), as evaluate_targets gives its own: the
    47 GiB job checkpointed with --leave-running when the GPU has no room for a whole copy,
    and its restore from page cache. Empty when no run has the workload."""
    rows = merge_rows(runs)
    if not any(r["workload"] == FULL for r in rows):
        return []
    down = _median(rows, FULL, "hiber", "downtime_s")
    warm = _median(rows, FULL, "hiber", "restore_warm_s")
    return [
        _verdict(f"{FULL} (GPU without room for a whole copy): hiber downtime ≤ 1.5 s", down, lambda v: v <= 1.5, lambda: f"{down:.2f} s"),
        _verdict(f"{FULL}: hiber restore from page cache until progress ≤ 3 s", warm, lambda v: v <= 3.0, lambda: f"{warm:.2f} s"),
        _downtime_ratio(rows, FULL, 10),
    ]


DDP_SMALL_STEP = "DDP 2 ranks step, small model (torchrun, pinned)"
DDP_MLP_STEP = "DDP 2 ranks step, 120M-parameter MLP (torchrun, pinned)"


def ddp_targets(runs):
    """#11's targets for a two-rank DDP job (bench.py --ddp GIB, --overhead-benchmarks ddp):
    the --leave-running downtime and the restore of hiber, what the stock path did with the
    same job (where it never checkpointed it, the report says so and the targets are
    absolute), and the agent's cost on each DDP step benchmark ([`_ddp_overhead`]). Empty
    when no run has a DDP row or benchmark."""
    rows = merge_rows(runs)
    out = []
    for w in dict.fromkeys(r["workload"] for r in rows if r["workload"].startswith("DDP ")):
        down = _median(rows, w, "hiber", "downtime_s")
        warm = _median(rows, w, "hiber", "restore_warm_s")
        out.append(_verdict(f"{w}: hiber downtime (--leave-running) ≤ 2 s", down, lambda v: v <= 2.0, lambda: f"{down:.2f} s"))
        out.append(_verdict(f"{w}: hiber restore from page cache until progress ≤ 5 s", warm, lambda v: v <= 5.0, lambda: f"{warm:.2f} s"))
        stock = _median(rows, w, "stock", "downtime_s")
        errors = [e["error"] for r in runs for e in r.get("errors", []) if e.get("workload") == w and e.get("contender") == "stock"]
        if stock is not None:
            out.append(_downtime_ratio(rows, w, 1))
        elif errors:
            first = " ".join(errors[0].split())[:160]
            out.append((f"{w}: the stock path", f"could not checkpoint the job ({len(errors)} of {len(errors)} tries; first: {first})", "targets absolute"))
        else:
            out.append((f"{w}: the stock path", "not measured", "not measured"))
    for e in [e for e in merge_overhead(runs) if e["benchmark"].startswith("DDP 2 ranks step")]:
        out.append(_ddp_overhead(e))
    return out


def _ddp_overhead(e):
    """The ≤ 1% verdict on one DDP step benchmark. With back-to-back pairs: met when the
    interval of their median overhead lies at or below 1%, NOT met when above, else not
    resolved. Runs from before the pairs: "not resolved" where the runs without the agent
    alone spread wider than the target (such a difference is not a measurement of the
    agent)."""
    target = f"agent overhead, {e['benchmark']} ≤ 1%"
    o = overhead_of(e)
    wo = o["without"]
    if o["pct"] is None:
        return (target, "not measured", "not measured")
    paired = paired_overhead(e.get("pairs", []))
    if paired:
        measured = f"{paired_text(paired)}; {o['with']['median']:.3f} vs {wo['median']:.3f} {e['unit']}"
        if paired["low"] is None or paired["low"] <= 1.0 < paired["high"]:
            return (target, measured, "not resolved")
        return (target, measured, "met" if paired["high"] <= 1.0 else "NOT met")
    spread = (wo["max"] - wo["min"]) / wo["median"] * 100 if wo["median"] else None
    measured = f"{o['pct']:+.2f}% ({o['with']['median']:.3f} vs {wo['median']:.3f} {e['unit']}; runs without the agent spread {spread:.1f}%)"
    if spread is not None and spread > 1.0:
        return (target, measured, "not resolved")
    return _verdict(target, o["pct"], lambda v: v <= 1.0, lambda: measured)


def targets_table(targets):
    """Markdown table of evaluate_targets' answer."""
    lines = ["| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {v} |" for t, m, v in targets]
    return "\n".join(lines)


def windowed_ms_per_step(progress, warmup, window):
    """Milliseconds per step from step `warmup` on, by the workload's own clock: the median
    over consecutive windows of `window` steps. None when no whole window is left."""
    after = [p for p in progress if p.step >= warmup]
    rates = [(b.t_ms - a.t_ms) / (b.step - a.step) for a, b in zip(after[::window], after[window::window]) if b.step > a.step]
    return statistics.median(rates) if rates else None


def throughput(progress, warmup):
    """Steps per second from step `warmup` to the last step, by the workload's own clock."""
    after = [p for p in progress if p.step >= warmup]
    if len(after) < 2 or after[-1].t_ms == after[0].t_ms:
        return None
    return (after[-1].step - after[0].step) / ((after[-1].t_ms - after[0].t_ms) / 1000)


def incremental_targets(entries):
    """The issue's targets for a second checkpoint of a job whose weights did not change:
    bytes written ≤ 5% of the first checkpoint's, time until durable ≤ 30% of the first's
    (medians over the samples of each entry)."""
    out = []
    for e in entries:
        s = e["samples"]
        written = summary([w / f if f else None for w, f in zip(s.get("second_written_gib", []), s.get("first_gib", []))])
        durable = summary([b / a if a else None for b, a in zip(s.get("second_durable_s", []), s.get("first_durable_s", []))])
        out.append(_verdict(f"{e['workload']}: second checkpoint writes ≤ 5% of the first's bytes", written and written["median"], lambda v: v <= 0.05,
                            lambda: f"{written['median'] * 100:.1f}%"))
        out.append(_verdict(f"{e['workload']}: second checkpoint durable in ≤ 30% of the first's time", durable and durable["median"], lambda v: v <= 0.30,
                            lambda: f"{durable['median'] * 100:.1f}%"))
    return out


def periodic_targets(entries):
    """The issue's target for training checkpointed every N steps: throughput falls ≤ 2%."""
    out = []
    for e in entries:
        base, ck = summary(e["samples"].get("without", [])), summary(e["samples"].get("with", []))
        fall = 1 - ck["median"] / base["median"] if base and ck else None
        out.append(_verdict(f"{e['workload']}: throughput falls ≤ 2% with a checkpoint every {e['every']} steps", fall, lambda v: v <= 0.02,
                            lambda: f"{fall * 100:+.2f}% ({ck['median']:.3f} against {base['median']:.3f} steps/s)"))
    return out


def carried_commit(carry):
    """The commit the hiber carried in `carry` was built from (scripts/gpu-carry.sh records
    it in COMMIT; $HIBER_COMMIT overrides)."""
    if os.environ.get("HIBER_COMMIT"):
        return os.environ["HIBER_COMMIT"]
    try:
        return (Path(carry) / "COMMIT").read_text().strip() or "unknown"
    except OSError:
        return "unknown"
