"""benchmarks/h2d_staging.py on this CPU machine: a JSON row per pack size with the bytes per
step and the staging memcpy the GPU path adds; the CUDA-only counts are null, not guessed."""

import pytest

from tests.support.benchmark_run import run_benchmark

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration


def test_cpu_run_writes_rows_without_guessed_gpu_counts(tmp_path):
    out = tmp_path / "h.json"
    rows = run_benchmark("h2d_staging", out, "--reps", "3", timeout=300)["results"]
    assert [r["tokens"] for r in rows] == [4096, 16384]
    for r in rows:
        assert r["bytes_per_step"] == 4 * (2 * r["tokens"] * 8 + r["tokens"] * 4)
        assert r["pageable_copies_per_step"] is None and r["staging_memcpy_ms_per_step"] > 0
    assert "need a GPU to time" in out.with_suffix(".txt").read_text()
