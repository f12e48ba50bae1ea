"""benchmarks/sync_check.py --quick: one JSON row with the counts beside the times (aten ops
the modes intercept per step, host syncs of a counted step: 0), both sides measured in one
process. No time is asserted (the machine may be busy); the counts are."""

import json
import subprocess
import sys
from pathlib import Path

from tests.support.subproc import child_env

import pytest

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_writes_counts_and_both_times(tmp_path):
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sync_check.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=600,
                          env=child_env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert row["host_syncs_per_step"] == 0 and row["aten_ops_per_step"] > 100
    assert row["with_sentinel_ms"] > 0 and row["without_ms"] > 0
    assert row["with_over_without"] == round(row["with_sentinel_ms"] / row["without_ms"], 3) or \
        abs(row["with_over_without"] - row["with_sentinel_ms"] / row["without_ms"]) < 0.01
    assert "external_cores_busy" in report["environment"]
    assert "with_over_without = step time with the sentinel / without it" in out.with_suffix(".txt").read_text()
