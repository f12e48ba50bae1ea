"""benchmarks/h2d_staging.py on this CPU machine: a JSON row per pack size with the bytes per
step and the staging memcpy the GPU path adds; the CUDA-only counts are null, not guessed."""

import json
import subprocess
import sys
from pathlib import Path

from tests.support.subproc import child_env

import pytest

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_cpu_run_writes_rows_without_guessed_gpu_counts(tmp_path):
    out = tmp_path / "h.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "h2d_staging.py"), "--reps", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env=child_env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["tokens"] for r in rows] == [4096, 16384]
    for r in rows:
        assert r["bytes_per_step"] == 4 * (2 * r["tokens"] * 8 + r["tokens"] * 4)
        assert r["pageable_copies_per_step"] is None and r["staging_memcpy_ms_per_step"] > 0
    assert "need a GPU to time" in out.with_suffix(".txt").read_text()
