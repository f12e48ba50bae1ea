"""benchmarks/sync_check.py --quick: one JSON row with the counts beside the times (aten ops
the modes intercept per step, host syncs of a counted step: 0), both sides measured in one
process. No time is asserted (the machine may be busy); the counts are."""

import pytest

from tests.support.benchmark_run import run_benchmark

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration


def test_quick_run_writes_counts_and_both_times(tmp_path):
    out = tmp_path / "s.json"
    report = run_benchmark("sync_check", out, "--quick", timeout=600)
    (row,) = report["results"]
    assert row["host_syncs_per_step"] == 0 and row["aten_ops_per_step"] > 100
    assert row["with_sentinel_ms"] > 0 and row["without_ms"] > 0
    assert row["with_over_without"] == round(row["with_sentinel_ms"] / row["without_ms"], 3) or \
        abs(row["with_over_without"] - row["with_sentinel_ms"] / row["without_ms"]) < 0.01
    assert "external_cores_busy" in report["environment"]
    assert "with_over_without = step time with the sentinel / without it" in out.with_suffix(".txt").read_text()
