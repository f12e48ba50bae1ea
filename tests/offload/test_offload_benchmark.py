"""benchmarks/offload.py in its quick configuration: the JSON a reader checks."""

import json
import os
import subprocess
import sys

from tests.support.subproc import child_env

import pytest

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def test_offload_benchmark_quick_json(tmp_path):
    out = tmp_path / "offload.json"
    proc = subprocess.run(
        [sys.executable, f"{REPO}/benchmarks/offload.py", "--quick", "--no-gpu", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env=child_env(PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "baseline / ours: > 1 means ours is faster" in proc.stdout
    report = json.loads(out.read_text())
    assert out.with_suffix(".txt").exists()
    env = report["environment"]
    assert env["noisy"] == (env["load_average_1min_at_start"] / env["cores"] > 0.5
            or env["external_cores_busy"] / env["cores"] > 0.5)
    rows = report["results"]
    double = [r for r in rows if "double" in r["variant"]]
    assert double and all(r["hidden_fraction"] is not None and "c_over_g" in r for r in double)
    planned = {r["c_over_g"]: r for r in double if r["variant"] == "double_buffer"}
    assert {0.5, 1.0, 2.0} <= planned.keys()
    # the orders compare on the host-ahead replay: the same per-layer times and c on both
    # sides, no host issue jitter (the host-timed figures of two recorded steps can differ by
    # a few 1e-4 from run to run either way)
    for r in double:  # the planned order: never worse than forward order, no less freed
        # rounding to 6 places is monotone: no slack needed
        assert (r["forward_order_host_ahead_hidden_fraction"]
                <= r["host_ahead_hidden_fraction"]), r
        assert (r["host_ahead_pending_at_fwd_end"]
                <= r["forward_order_host_ahead_pending_at_fwd_end"]), r
        assert 0 <= r["eager_offloads"] <= r["offloaded_layers"], r
        # the recorded schedule, host ahead, is the planner's model of it (4 vs 6 places)
        assert abs(r["host_ahead_hidden_fraction"] - r["modelled_hidden_fraction"]) <= 6e-5, r
    # at c/g = 1 every layer cannot hide in forward order; the planned order hides it
    every = next(r for r in double if r["variant"] == "double_buffer_all_layers"
                 and r["c_over_g"] == 1.0)
    assert every["forward_order_host_ahead_hidden_fraction"] < 0.9 and every[
        "eager_offloads"] < (every["offloaded_layers"] - 1)
    for r in planned.values():  # the row runs the window the manager's "auto" planner picks
        assert r["offload_window"] == "auto" and r["planned_window"] == r["offloaded_layers"]
        # the target is met, or the window is the one below which the planner never goes
        assert r["modelled_hidden_fraction"] >= 0.9 or r["planned_window"] == r["peak_window"], r
        if r["c_over_g"] == 1.0:  # at c/g = 1 the planned window meets the target
            assert r["host_ahead_hidden_fraction"] >= 0.9, r
    for r in rows:  # the whole-step figure, from the step's own numbers
        if r["hidden_fraction"] is not None and r["copy_ms"] > 1:  # ms rounded to 4 places
            exposed = r["step_ms"] - r["free_copy_step_ms"]
            assert abs(r["hidden_fraction"] - (1 - exposed / r["copy_ms"])) < 1e-3
    by = {(r["variant"], r["c_over_g"]): r for r in rows}
    # single buffering serialises: it never hides more than double buffering of the same layers
    for ratio in (0.5, 1.0, 2.0):
        assert (by[("single_buffer", ratio)]["hidden_fraction"]
                <= by[("double_buffer_all_layers", ratio)]["hidden_fraction"])
