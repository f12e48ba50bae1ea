"""benchmarks/attention_layout.py --quick: a row per pack with both layouts' times, the scores
each computes and their outputs' agreement; no time is asserted (the machine may be busy)."""

import pytest

from tests.support.benchmark_run import run_benchmark

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration


def test_quick_run_writes_both_layouts_with_counts(tmp_path):
    out = tmp_path / "a.json"
    rows = run_benchmark("attention_layout", out, "--quick", "--reps", "1", timeout=600)["results"]
    assert [(r["tokens"], r["sequences"]) for r in rows] == [(512, 6), (4096, 48)]
    for r in rows:
        assert r["scores_mask"] == r["tokens"] ** 2 * 8
        assert r["scores_padded"] == r["max_seqs"] * r["seqlen_bound"] ** 2 * 8
        assert r["longest"] <= r["seqlen_bound"] and r["max_abs_diff"] < 1e-5
        assert r["mask_ms"] > 0 and r["padded_ms"] > 0
    assert "mask_over_padded = fwd+bwd time" in out.with_suffix(".txt").read_text()
