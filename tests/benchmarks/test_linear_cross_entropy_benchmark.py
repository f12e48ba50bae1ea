"""benchmarks/linear_cross_entropy.py's quick grid (T 96 and 200, V 512 and 1024, H 16; TP 1 in
one process, TP 2 in two gloo processes): a row per side and shape with its peak and allocated
bytes from the profiler's allocator events, ours' loss equal to Megatron's, Megatron's peak at
least the float32 logits [T, V/TP] and transformers' more; a side over ``--max-gib`` is not run
and its row holds the estimate instead. No time is asserted (the machine may be busy)."""

import pytest

from tests.support.benchmark_run import run_benchmark

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration


def test_quick_grid_rows(tmp_path):
    out = tmp_path / "lce.json"
    rows = run_benchmark("linear_cross_entropy", out, "--quick", "--repeats", "1", timeout=600)["results"]
    keys = [(r["tp"], r["tokens"], r["vocab"], r["side"]) for r in rows]
    assert keys == [(tp, T, V, s) for tp in (1, 2) for V in (512, 1024) for T in (96, 200)
                    for s in (("ours", "megatron", "transformers") if tp == 1 else ("ours", "megatron"))]
    by = {k: r for k, r in zip(keys, rows)}
    for (tp, T, V, side), r in by.items():
        assert r["measured"] and r["vocab_per_rank"] == V // tp and r["hidden"] == 16
        assert r["logits_bytes"] == T * (V // tp) * 4
        assert r["allocated_bytes"] >= r["peak_bytes"] > 0 and r["ms"] > 0
        if side == "megatron":
            assert r["peak_bytes"] >= r["logits_bytes"]  # the softmax it saves
        if side == "transformers":
            assert r["peak_bytes"] >= 2 * r["logits_bytes"]  # logits + log-softmax at least
        if side == "ours":
            assert r["chunks"] == 1 and r["chunk_rows"] == T  # a tiny T fits one chunk
            assert r["loss_max_abs_diff_vs_megatron"] < 1e-5
    assert "copies of [T, V/TP] f32" in out.with_suffix(".txt").read_text()


def test_a_side_over_the_memory_limit_is_estimated_not_run(tmp_path):
    out = tmp_path / "lce.json"
    rows = run_benchmark("linear_cross_entropy", out, "--tokens", "64", "--vocabs", "4096", "--hidden", "8",
                         "--tp", "1", "--repeats", "1", "--max-gib", "0.001", timeout=300)["results"]
    by = {r["side"]: r for r in rows}
    assert by["ours"]["measured"] and by["ours"]["chunks"] == 1
    for side, copies in (("megatron", 1.5), ("transformers", 3.5)):
        assert not by[side]["measured"] and "peak_bytes" not in by[side]
        assert by[side]["estimated_peak_bytes"] == int(copies * 64 * 4096 * 4 + 4 * 64 * 8 * 4)
