"""The benchmark's logic that needs no GPU: reading a workload's progress, measuring gaps
in it, statistics, and the report. Unit-tested in CI (test_benchlib.py)."""
import statistics


def parse_progress(text):
    """(step, t_ms) of every `step N checksum X t MS ...` line; other lines are skipped.

    A line cut short (the process was frozen mid-write, or the log was read while being
    written) is skipped rather than misread."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) < 6 or f[0] != "step" or f[2] != "checksum" or f[4] != "t":
            continue
        try:
            out.append((int(f[1]), int(f[5])))
        except ValueError:
            continue
    return out


def downtime_ms(progress, start_ms, end_ms):
    """The longest gap between consecutive progress lines that overlaps [start, end]: how
    long the application made no progress around a checkpoint, by its own clock."""
    worst = None
    for (_, a), (_, b) in zip(progress, progress[1:]):
        if b >= start_ms and a <= end_ms:
            gap = b - a
            worst = gap if worst is None else max(worst, gap)
    return worst


def typical_gap_ms(progress, before_ms):
    """Median gap between progress lines before `before_ms`: the workload's own step time,
    against which a downtime is read."""
    gaps = [b - a for (_, a), (_, b) in zip(progress, progress[1:]) if b < before_ms]
    return statistics.median(gaps) if gaps else None


def first_progress_after(progress, after_ms, min_step=None):
    """Timestamp of the first progress line after `after_ms` (and at or past `min_step`)."""
    for step, t in progress:
        if t > after_ms and (min_step is None or step >= min_step):
            return t
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
    order = sorted({w for w, _ in merged}, key=lambda w: (w.startswith("PyTorch"), float(w.split()[-2])))
    return [merged[(w, c)] for w in order for c in ("hiber", "stock") if (w, c) in merged]
