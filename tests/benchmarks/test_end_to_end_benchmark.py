"""benchmarks/end_to_end.py at T = 512: a row per length mix with the four sides' step times,
the attention scores each computes, and the loss of ours equal to stock Megatron's (its local
spec, packed with a block-causal mask and padded, same weights) -- a reference nobody here
wrote. No time is asserted (the machine may be busy)."""

import pytest

from tests.support.benchmark_run import run_benchmark

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration


def test_lengths_fill_the_pack_exactly():
    from end_to_end import lengths_for

    for mix in ("sft", "long_tail"):
        for t in (512, 2048):
            lengths = lengths_for(mix, t)
            assert sum(lengths) == t and min(lengths) >= 1 and max(lengths) <= 1024


def test_t512_rows_agree_with_stock_megatron(tmp_path):
    out = tmp_path / "e.json"
    rows = run_benchmark("end_to_end", out, "--tokens", "512", "--reps", "1", timeout=900)["results"]
    assert [(r["tokens"], r["mix"]) for r in rows] == [(512, "sft"), (512, "long_tail")]
    for r in rows:
        assert r["scores_packed_mask"] == 512 * 512
        assert r["scores_padded"] == r["sequences"] * r["longest"] ** 2
        assert r["tokens_padded"] == r["sequences"] * r["longest"]
        assert r["loss_rel_diff_megatron"] < 1e-5  # ours == Megatron's local attention
        assert all(r[f"{n}_ms"] > 0 for n in ("ours", "megatron_packed", "megatron_padded", "hf_padded"))
        assert r["fastest_peer_over_ours"] == round(r[f"{r['fastest_peer']}_ms"] / r["ours_ms"], 2)
        assert r["ours_ms"] == min(r["times_ms"]["ours"]) and len(r["times_ms"]["ours"]) == 1
        # one repeat: no spread, so the verdict follows the minimums
        gap = min(r["times_ms"][r["fastest_peer"]]) - min(r["times_ms"]["ours"])
        assert r["verdict"] == ("ours faster" if gap > 0 else "peer faster" if gap < 0 else "tie within noise")
    assert "fastest_peer_over_ours = the fastest peer's time / ours" in out.with_suffix(".txt").read_text()


def test_a_gap_inside_either_sides_spread_is_a_tie():
    from end_to_end import verdict

    assert verdict([10.0, 12.0, 14.0], [11.0, 11.2, 11.4]) == "tie within noise"  # ours' spread 2
    assert verdict([10.0, 10.1, 10.2], [13.0, 13.1, 13.2]) == "ours faster"
    assert verdict([13.0, 13.1, 13.2], [10.0, 10.1, 10.2]) == "peer faster"
