"""Unit tests of the benchmark's parsing and statistics (run in CI by scripts/test.sh)."""
import json
import unittest
from pathlib import Path

import bench
from benchlib import (
    carried_commit,
    DDP_MLP_STEP,
    DDP_SMALL_STEP,
    ddp_targets,
    durable_rates,
    downtime_ms,
    evaluate_targets,
    full_gpu_targets,
    incremental_targets,
    periodic_targets,
    throughput,
    windowed_ms_per_step,
    first_progress_after,
    merge_overhead,
    merge_rows,
    overhead_of,
    overhead_pct,
    overhead_table,
    paired_overhead,
    Progress,
    parse_progress,
    parse_timings,
    ratios,
    run_median,
    summary,
    table,
    targets_table,
    typical_gap_ms,
)

RESULTS = Path(__file__).resolve().parent / "results"

LOG = """start counter mib 1024 steps 100 pid 7
step 0 checksum 00ff t 1000
step 1 checksum 00fe t 1020
step 2 checksum 00fd t 1040
cuda error something
step 3 checksum 00fc t 4040 loss 2.3
step 4 checksum 00fb t 4060
step 5 checksum 00fa t
step x checksum 1 t 9
child step 6 checksum 1 t 5000
step 6 checksum 00f9 t 4080
"""


class ProgressLines(unittest.TestCase):
    def test_parse_skips_noise_and_torn_lines(self):
        p = parse_progress(LOG)
        self.assertEqual([x.step for x in p], [0, 1, 2, 3, 4, 6])
        self.assertEqual(p[3], Progress(step=3, checksum=0xFC, t_ms=4040))

    def test_parse_reads_the_line_as_the_rust_parser_does(self):
        # The cases of crates/hiber/src/workload/progress.rs.
        log = "start cpu\nstep 0 checksum 00000000000000ff t 1000\nstep 1 checksum 0a t 1020 counts [1, 2]\nstep x checksum 1 t 2\ngarbage\nstep 2 checksum 0b t\nverify ok steps 2\n"
        self.assertEqual(parse_progress(log), [Progress(0, 255, 1000), Progress(1, 10, 1020)])
        for line in ["step 3", "step 3 checksum 0f", "step 3 checksum 0f t", "step 3 checksum zz t 5", "step 3 checksum 0x0f t 5", "step 3 checksum 0f t 5.5", "step 3 sum 0f t 5"]:
            self.assertEqual(parse_progress(line), [], line)
        self.assertEqual(parse_progress("step 3 checksum 0f t 5 loss 2.5"), [Progress(3, 15, 5)])

    def test_prefixed_lines_are_read_only_with_their_prefix(self):
        log = "step 0 checksum 01 t 10\nchild step 0 checksum 02 t 11\nchild step 1 checksum 03 t\nchild step 1 checksum 04 t 31\n"
        self.assertEqual(parse_progress(log), [Progress(0, 1, 10)])
        self.assertEqual(parse_progress(log, "child "), [Progress(0, 2, 11), Progress(1, 4, 31)])

    def test_downtime_is_the_gap_overlapping_the_window(self):
        p = parse_progress(LOG)
        self.assertEqual(downtime_ms(p, 1050, 3000), 3000)
        self.assertEqual(downtime_ms(p, 4041, 4070), 20)
        self.assertIsNone(downtime_ms(p, 9000, 9100))
        self.assertEqual(typical_gap_ms(p, 1100), 20)

    def test_first_progress_after(self):
        p = parse_progress(LOG)
        self.assertEqual(first_progress_after(p, 1030), 1040)
        self.assertEqual(first_progress_after(p, 1030, min_step=4), 4060)
        self.assertIsNone(first_progress_after(p, 5000))


class Stats(unittest.TestCase):
    def test_summary(self):
        self.assertEqual(summary([3.0, None, 1.0, 2.0]), {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3})
        self.assertEqual(summary([4.0, 1.0])["median"], 2.5)
        self.assertIsNone(summary([None]))

    def test_table_and_ratios(self):
        rows = [
            {"workload": "32 GiB", "contender": "stock", "samples": {"downtime_s": [40.0, 42.0, 41.0]}},
            {"workload": "32 GiB", "contender": "hiber", "samples": {"downtime_s": [2.0, 4.0, 2.05]}},
        ]
        t = table(rows)
        self.assertIn("| 32 GiB | stock | 41.00s (40.00–42.00) |", t)
        self.assertIn("n/a", t)
        self.assertAlmostEqual(ratios(rows)["32 GiB"], 41.0 / 2.05)

    def test_workloads_sort_by_the_gib_they_hold(self):
        runs = [{"rows": [row("68 GiB held, 47 GiB data", "hiber", downtime_s=[2.0]), row("PyTorch 8 GiB", "hiber"), row("47 GiB", "stock"), row("4 GiB", "hiber")]}]
        self.assertEqual([r["workload"] for r in merge_rows(runs)], ["4 GiB", "47 GiB", "68 GiB held, 47 GiB data", "PyTorch 8 GiB"])

    def test_runs_merge_by_workload_and_contender(self):
        a = {"rows": [{"workload": "32 GiB", "contender": "hiber", "samples": {"downtime_s": [1.0]}},
                      {"workload": "32 GiB", "contender": "stock", "samples": {"downtime_s": [9.0]}}]}
        b = {"rows": [{"workload": "32 GiB", "contender": "hiber", "samples": {"downtime_s": [2.0], "image_gib": [32.5]}},
                      {"workload": "PyTorch 8 GiB", "contender": "hiber", "samples": {"downtime_s": [5.0]}},
                      {"workload": "4 GiB", "contender": "stock", "samples": {"downtime_s": [3.0]}}]}
        rows = merge_rows([a, b])
        self.assertEqual([(r["workload"], r["contender"]) for r in rows],
                         [("4 GiB", "stock"), ("32 GiB", "hiber"), ("32 GiB", "stock"), ("PyTorch 8 GiB", "hiber")])
        self.assertEqual(rows[1]["samples"], {"downtime_s": [1.0, 2.0], "image_gib": [32.5]})


    def test_merge_orders_contenders_hiber_no_agent_stock(self):
        a = {"rows": [{"workload": "4 GiB", "contender": c, "samples": {"downtime_s": [1.0]}} for c in ("stock", "other", "hiber-no-agent", "hiber")]}
        self.assertEqual([r["contender"] for r in merge_rows([a])], ["hiber", "hiber-no-agent", "stock", "other"])


MICRO_LOG = """start microbench blocks 4 pid 9
block 0 ms 80.5
block 1 ms 41.0
cuda error nothing
block 2 ms
block x ms 1
block 3 ms 43.0
blocks 4 ms 999
verify ok
done
"""

TORCH_LOG = """start train_big layers 8 params 1 pid 3
step 0 checksum 3f80 t 1000 loss 1 step_ms 250.0
step 1 checksum 3f80 t 1020 loss 1 step_ms 12.5
step 2 checksum 3f80 t 1040 loss 1
step 3 checksum 3f80 t 1060 loss 1 step_ms 12.0
done
"""


def run_with(rows=(), overhead=None, disk=1.0):
    r = {"machine": {}, "ceilings": {"disk_write_GBps": disk}, "rows": list(rows)}
    if overhead is not None:
        r["overhead"] = overhead
    return r


def row(workload, contender, **samples):
    return {"workload": workload, "contender": contender, "samples": samples}


def micro(with_, without):
    return {"benchmark": "CUDA microbenchmark", "unit": "ms per block", "samples": {"hiber": with_, "hiber-no-agent": without}}


class Overhead(unittest.TestCase):
    def test_parse_timings(self):
        self.assertEqual(parse_timings(MICRO_LOG, "block", "ms"), [80.5, 41.0, 43.0])
        # A step line without the field (an older train_big.py) is skipped.
        self.assertEqual(parse_timings(TORCH_LOG, "step", "step_ms"), [250.0, 12.5, 12.0])
        self.assertEqual(parse_timings("", "step", "step_ms"), [])

    def test_run_median_leaves_out_warm_up(self):
        self.assertEqual(run_median([80.5, 41.0, 43.0], 1), 42.0)
        self.assertIsNone(run_median([80.5], 1))

    def test_overhead_pct(self):
        self.assertAlmostEqual(overhead_pct(101.0, 100.0), 1.0)
        self.assertAlmostEqual(overhead_pct(99.0, 100.0), -1.0)
        self.assertIsNone(overhead_pct(None, 100.0))
        self.assertIsNone(overhead_pct(1.0, None))

    def test_merge_across_runs_and_old_runs(self):
        a = run_with(overhead=[micro([10.0], [10.0])])
        b = run_with(overhead=[micro([10.2, 10.4], [10.0, 9.9]),
                               {"benchmark": "PyTorch 8 GiB step", "unit": "ms per step", "samples": {"hiber": [12.0]}}])
        old = {"machine": {}, "ceilings": {}, "rows": []}  # from before the overhead benchmark
        entries = merge_overhead([a, old, b])
        self.assertEqual([e["benchmark"] for e in entries], ["CUDA microbenchmark", "PyTorch 8 GiB step"])
        self.assertEqual(entries[0]["samples"], {"hiber": [10.0, 10.2, 10.4], "hiber-no-agent": [10.0, 10.0, 9.9]})
        o = overhead_of(entries[0])
        self.assertAlmostEqual(o["pct"], 2.0)
        self.assertIsNone(overhead_of(entries[1])["pct"])
        t = overhead_table(entries)
        self.assertIn("| CUDA microbenchmark | 10.200 ms per block (10.000–10.400) | 10.000 ms per block (9.900–10.000) | +2.00% (3 runs each) |", t)
        self.assertIn("| n/a | n/a (0 runs each) |", t)


class Targets(unittest.TestCase):
    def test_durable_rates_use_each_runs_own_ceiling(self):
        gib = 1e9 / (1 << 30)  # image_gib of exactly 1 GB
        a = run_with([row("32 GiB", "hiber", image_gib=[2 * gib, 2 * gib], durable_s=[1.0, 2.0])], disk=2.0)
        b = run_with([row("32 GiB", "hiber", image_gib=[3 * gib], durable_s=[1.0])], disk=4.0)
        d = durable_rates([a, b])[("32 GiB", "hiber")]
        self.assertEqual([round(x, 6) for x in d["GBps"]], [2.0, 1.0, 3.0])
        self.assertEqual([round(x, 6) for x in d["fraction"]], [1.0, 0.5, 0.75])

    def test_all_met(self):
        gib = 1e9 / (1 << 30)
        rows = [
            row("32 GiB", "hiber", downtime_s=[1.5, 1.9, 2.5], restore_warm_s=[4.0], image_gib=[19 * gib], durable_s=[10.0]),
            row("32 GiB", "stock", downtime_s=[36.0]),
            row("PyTorch 8 GiB", "hiber", downtime_s=[2.0]),
            row("PyTorch 8 GiB", "stock", downtime_s=[12.0]),
        ]
        torch_steps = {"benchmark": "PyTorch 8 GiB step", "unit": "ms per step", "samples": {"hiber": [10.05], "hiber-no-agent": [10.0]}}
        got = evaluate_targets([run_with(rows, [micro([10.1], [10.0]), torch_steps], disk=2.0)])
        self.assertEqual([v for _, _, v in got], ["met"] * 7, got)
        self.assertEqual(got[0], ("32 GiB: hiber downtime ≤ 2 s", "1.90 s", "met"))
        self.assertEqual(got[1][1], "18.9x (stock 36.00 s, hiber 1.90 s)")
        self.assertEqual(got[2][0], "PyTorch 8 GiB: stock downtime / hiber downtime ≥ 5x")
        self.assertEqual(got[4][1], "95% (1.90 GB/s; disk 2.00 GB/s)")
        self.assertEqual(got[6], ("agent overhead, PyTorch 8 GiB step ≤ 1%", "+0.50% (10.050 vs 10.000 ms per step)", "met"))

    def test_not_met(self):
        rows = [row("32 GiB", "hiber", downtime_s=[4.0], restore_warm_s=[6.0], image_gib=[1.0], durable_s=[10.0]),
                row("32 GiB", "stock", downtime_s=[36.0]),
                row("PyTorch 8 GiB", "hiber", downtime_s=[3.0]), row("PyTorch 8 GiB", "stock", downtime_s=[12.0])]
        got = evaluate_targets([run_with(rows, [micro([10.2], [10.0])])])
        self.assertEqual([v for _, _, v in got], ["NOT met"] * 6 + ["not measured"])
        self.assertIn("| agent overhead, CUDA microbenchmark ≤ 1% | +2.00% (10.200 vs 10.000 ms per block) | NOT met |", targets_table(got))

    def test_full_gpu_targets(self):
        self.assertEqual(full_gpu_targets([run_with([row("32 GiB", "hiber", downtime_s=[1.0])])]), [])
        rows = [row("47 GiB", "hiber", downtime_s=[1.2, 1.4, 1.6], restore_warm_s=[3.5]), row("47 GiB", "stock", downtime_s=[70.0])]
        got = full_gpu_targets([run_with(rows)])
        self.assertEqual(got[0], ("47 GiB (GPU without room for a whole copy): hiber downtime ≤ 1.5 s", "1.40 s", "met"))
        self.assertEqual(got[1], ("47 GiB: hiber restore from page cache until progress ≤ 3 s", "3.50 s", "NOT met"))
        self.assertEqual(got[2][2], "met")
        self.assertIn("50.0x", got[2][1])

    def test_ddp_targets(self):
        self.assertEqual(ddp_targets([run_with([row("32 GiB", "hiber", downtime_s=[1.0])])]), [])
        w = "DDP 2 ranks, 30 GiB per GPU"
        run_ = run_with([row(w, "hiber", downtime_s=[3.5, 4.6, 5.2], restore_warm_s=[3.8, 4.2, 4.6]), row(w, "stock")],
                        [{"benchmark": "DDP 2 ranks step (torchrun)", "unit": "ms per step", "samples": {"hiber": [1.96, 1.41], "hiber-no-agent": [1.82, 1.37]}}])
        run_["errors"] = [{"workload": w, "contender": "stock", "rep": 0, "error": "cuda_ckpt 1377 lock failed (1):\n lock of 1377 failed: 600"}]
        got = ddp_targets([run_])
        self.assertEqual(got[0], (f"{w}: hiber downtime (--leave-running) ≤ 2 s", "4.60 s", "NOT met"))
        self.assertEqual(got[1], (f"{w}: hiber restore from page cache until progress ≤ 5 s", "4.20 s", "met"))
        self.assertEqual(got[2][2], "targets absolute")
        self.assertIn("could not checkpoint the job (1 of 1 tries; first: cuda_ckpt 1377 lock failed (1): lock of 1377 failed: 600)", got[2][1])
        # Runs without the agent 28% apart cannot show a 1% overhead either way.
        self.assertEqual(got[3][2], "not resolved")
        self.assertIn("spread 28.2%", got[3][1])
        tight = run_with([], [{"benchmark": "DDP 2 ranks step (torchrun)", "unit": "ms per step", "samples": {"hiber": [1.62, 1.63], "hiber-no-agent": [1.600, 1.604]}}])
        self.assertEqual(ddp_targets([tight])[0][2], "NOT met")

    def test_paired_overhead_and_its_interval(self):
        # Six pairs: the sign test's interval is the whole range (97% coverage).
        pairs = [[20.1, 20.0], [20.0, 20.0], [19.9, 20.0], [20.2, 20.0], [20.05, 20.0], [20.0, 20.1]]
        p = paired_overhead(pairs)
        self.assertEqual(p["n"], 6)
        self.assertAlmostEqual(p["median"], 0.125)
        self.assertAlmostEqual(p["low"], -0.5)
        self.assertAlmostEqual(p["high"], 1.0)
        self.assertAlmostEqual(p["coverage"], 1 - 2 / 64)
        # Eight pairs: one from each end is left out (93%).
        p8 = paired_overhead([[100 + k, 100] for k in range(8)])
        self.assertAlmostEqual(p8["low"], 1.0)
        self.assertAlmostEqual(p8["high"], 6.0)
        self.assertAlmostEqual(p8["coverage"], 1 - 2 * 9 / 256)
        self.assertIsNone(paired_overhead([[1.0, 1.0]] * 4)["low"], "four pairs cover less than 90%")
        self.assertIsNone(paired_overhead([]))

    def test_ddp_overhead_verdicts_of_pairs(self):
        def entry(name, pairs):
            return {"benchmark": name, "unit": "ms per step", "pairs": pairs,
                    "samples": {"hiber": [w for w, _ in pairs], "hiber-no-agent": [wo for _, wo in pairs]}}
        within = entry(DDP_MLP_STEP, [[20.1, 20.0], [20.0, 20.0], [19.9, 20.0], [20.15, 20.0], [20.05, 20.0], [20.0, 20.1]])
        above = entry(DDP_SMALL_STEP, [[1.53, 1.5], [1.54, 1.5], [1.55, 1.5], [1.56, 1.5], [1.57, 1.5], [1.58, 1.5]])
        wide = entry(DDP_SMALL_STEP, [[1.5, 1.5], [1.6, 1.5], [1.4, 1.5], [1.5, 1.5], [1.5, 1.5], [1.5, 1.5]])
        few = entry(DDP_MLP_STEP, [[20.0, 20.0]] * 3)
        got = ddp_targets([run_with([], [within, above])])
        self.assertEqual(got[0][0], f"agent overhead, {DDP_MLP_STEP} ≤ 1%")
        self.assertEqual(got[0][2], "met")
        self.assertIn("+0.12% (6 pairs; 97% interval -0.50% to +0.75%)", got[0][1])
        self.assertEqual(got[1][2], "NOT met")
        self.assertEqual(ddp_targets([run_with([], [wide])])[0][2], "not resolved")
        self.assertEqual(ddp_targets([run_with([], [few])])[0][2], "not resolved")
        self.assertIn("+0.12% (6 pairs", overhead_table([within]))

    def test_windowed_ms_per_step(self):
        # 10 ms a step, with one 500 ms hiccup: one window of five moves, not the median.
        p, t = [], 1000
        for i in range(60):
            p.append(Progress(i, 0, t))
            t += 500 if i == 33 else 10
        self.assertAlmostEqual(windowed_ms_per_step(p, 10, 10), 10.0)
        self.assertIsNone(windowed_ms_per_step(p, 55, 10))

    def test_throughput_is_steps_per_second_after_warmup(self):
        p = [Progress(i, 0, 1000 + 100 * i) for i in range(11)]
        self.assertAlmostEqual(throughput(p, 5), 10.0)
        self.assertIsNone(throughput(p, 10))
        self.assertIsNone(throughput([], 0))

    def test_incremental_and_periodic_targets(self):
        inc = [{"workload": "40 GiB static, 1 GiB changing", "samples": {"first_gib": [42.0, 42.0], "second_written_gib": [1.5, 1.7],
                                                                         "first_durable_s": [30.0, 32.0], "second_durable_s": [4.0, 12.0]}}]
        got = incremental_targets(inc)
        self.assertEqual(got[0], ("40 GiB static, 1 GiB changing: second checkpoint writes ≤ 5% of the first's bytes", "3.8%", "met"))
        self.assertEqual(got[1][2], "met")
        self.assertEqual(got[1][1], "25.4%")
        self.assertEqual(incremental_targets([{"workload": "w", "samples": {}}])[0][2], "not measured")
        per = [{"workload": "PyTorch 8 GiB", "every": 100, "samples": {"without": [5.0, 5.1], "with": [4.8, 4.9]}}]
        got = periodic_targets(per)
        self.assertEqual(got[0][2], "NOT met")
        self.assertIn("+3.96%", got[0][1])

    def test_nothing_measured(self):
        got = evaluate_targets([run_with()])
        self.assertEqual(len(got), 7)
        self.assertEqual({v for _, m, v in got}, {"not measured"})
        self.assertEqual({m for _, m, v in got}, {"not measured"})

    def test_the_recorded_runs_still_read(self):
        # The driver engine's runs (2026-11-22, before the agent) and the agent's runs of
        # that day, as recorded.
        paths = sorted(RESULTS.glob("2026-11-22-*.json"))
        before = [p for p in paths if "agent" not in p.name]
        after = [p for p in paths if "agent" in p.name]
        self.assertTrue(before and after)
        got = dict((t, v) for t, _, v in evaluate_targets([json.loads(p.read_text()) for p in before]))
        self.assertEqual(got["32 GiB: hiber downtime ≤ 2 s"], "NOT met")
        self.assertEqual(got["agent overhead, CUDA microbenchmark ≤ 1%"], "not measured")
        text = bench.report([str(p) for p in before])
        self.assertIn("| 32 GiB | hiber |", text)
        self.assertIn("| agent overhead, PyTorch step ≤ 1% | not measured | not measured |", text)
        got = dict((t, v) for t, _, v in evaluate_targets([json.loads(p.read_text()) for p in after]))
        self.assertEqual(got["32 GiB: hiber downtime ≤ 2 s"], "met")
        self.assertEqual(got["32 GiB: stock downtime / hiber downtime ≥ 10x"], "met")
        self.assertIn("| PyTorch 4 GiB step |", bench.report([str(p) for p in after]))
        # The same targets measured again on 2026-11-25.
        final = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("2026-11-25-h100-*-final.json"))]
        got = dict((t, v) for t, _, v in evaluate_targets(final))
        self.assertEqual(got["32 GiB: stock downtime / hiber downtime ≥ 10x"], "met")
        self.assertEqual(got["agent overhead, PyTorch 8 GiB step ≤ 1%"], "met")

    def test_the_recorded_ddp_runs_still_read(self):
        # #11's runs on 2xH200 (2026-11-25): the DDP job with 30 GiB per GPU and the pinned pairs.
        runs = [json.loads((RESULTS / f"2026-11-25-h200x2-{n}.json").read_text()) for n in ("ddp30", "ddp-overhead-pinned")]
        got = {t: v for t, _, v in ddp_targets(runs)}
        self.assertEqual(got["DDP 2 ranks, 30 GiB per GPU: hiber downtime (--leave-running) ≤ 2 s"], "NOT met")
        self.assertEqual(got["DDP 2 ranks, 30 GiB per GPU: hiber restore from page cache until progress ≤ 5 s"], "met")
        self.assertEqual(got["DDP 2 ranks, 30 GiB per GPU: the stock path"], "targets absolute")
        self.assertEqual(got[f"agent overhead, {DDP_MLP_STEP} ≤ 1%"], "met")
        self.assertEqual(got[f"agent overhead, {DDP_SMALL_STEP} ≤ 1%"], "not resolved")
        # 2026-11-26: the NCCL wake and CRIU's staging area (3 samples, CRIU staged in each).
        runs[0] = json.loads((RESULTS / "2026-11-26-h200x2-ddp30-wake-stage.json").read_text())
        rows = {t: (m, v) for t, m, v in ddp_targets(runs)}
        self.assertEqual(rows["DDP 2 ranks, 30 GiB per GPU: hiber downtime (--leave-running) ≤ 2 s"], ("3.03 s", "NOT met"))
        self.assertEqual(rows["DDP 2 ranks, 30 GiB per GPU: hiber restore from page cache until progress ≤ 5 s"][1], "met")
        hiber = next(r for r in runs[0]["rows"] if r["contender"] == "hiber")
        self.assertEqual(hiber["samples"]["criu_staged"], [1.0, 1.0, 1.0])


class CarriedCommit(unittest.TestCase):
    def test_the_carry_names_its_build_and_the_environment_overrides(self):
        import os
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            saved = os.environ.pop("HIBER_COMMIT", None)
            try:
                self.assertEqual(carried_commit(d), "unknown", "no COMMIT file")
                (Path(d) / "COMMIT").write_text("abc1234\n")
                self.assertEqual(carried_commit(d), "abc1234")
                os.environ["HIBER_COMMIT"] = "feed000"
                self.assertEqual(carried_commit(d), "feed000")
            finally:
                os.environ.pop("HIBER_COMMIT", None)
                if saved is not None:
                    os.environ["HIBER_COMMIT"] = saved


if __name__ == "__main__":
    unittest.main()
