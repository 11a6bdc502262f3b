"""Unit tests of the benchmark's parsing and statistics (run in CI by scripts/test.sh)."""
import unittest

from benchlib import downtime_ms, first_progress_after, merge_rows, parse_progress, ratios, summary, table, typical_gap_ms

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


class Progress(unittest.TestCase):
    def test_parse_skips_noise_and_torn_lines(self):
        p = parse_progress(LOG)
        self.assertEqual([s for s, _ in p], [0, 1, 2, 3, 4, 6])
        self.assertEqual(p[3], (3, 4040))

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


if __name__ == "__main__":
    unittest.main()
