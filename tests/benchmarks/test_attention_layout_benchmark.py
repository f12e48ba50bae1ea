"""benchmarks/attention_layout.py --quick: a row per pack with both layouts' times, the scores
each computes and their outputs' agreement; no time is asserted (the machine may be busy)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.support.subproc import child_env

import pytest

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_writes_both_layouts_with_counts(tmp_path):
    out = tmp_path / "a.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "attention_layout.py"), "--quick",
                           "--reps", "1", "--json", str(out)], capture_output=True, text=True,
                          timeout=600, env=child_env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["tokens"], r["sequences"]) for r in rows] == [(512, 6), (4096, 48)]
    for r in rows:
        assert r["scores_mask"] == r["tokens"] ** 2 * 8
        assert r["scores_padded"] == r["max_seqs"] * r["seqlen_bound"] ** 2 * 8
        assert r["longest"] <= r["seqlen_bound"] and r["max_abs_diff"] < 1e-5
        assert r["mask_ms"] > 0 and r["padded_ms"] > 0
    assert "mask_over_padded = fwd+bwd time" in out.with_suffix(".txt").read_text()
