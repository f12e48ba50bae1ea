"""benchmarks/kernel_grids.py: the flash-attn varlen grid the cache's bounds imply (FA2's
``ceil(max_seqlen / 128) x (cu_seqlens.numel() - 1) x heads``) and the bytes a graph replay
copies per layer, recomputed here from the cache's own params."""

import pytest

from tests.support.benchmark_run import run_benchmark

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration


def test_grid_counts_follow_the_cache_bounds(tmp_path):
    out = tmp_path / "k.json"
    (r,) = run_benchmark("kernel_grids", out, "--tokens", "8192", timeout=300, one_thread=False)["results"]
    # defaults: max_seqlen 8192 (64 blocks), cu_seqlens of max_seqs 8192 + 1 + 1 tail entries
    assert r["flash_blocks_hook_defaults"] == 64 * (8192 + 1) * 32 == 16_779_264
    # bounds: max_seqs 85 + 1, max_seqlen 128 (one block), tail closed every 128 tokens
    assert r["flash_blocks_data_bounds"] == 1 * (86 + 8192 // 128) * 32
    assert r["replay_bytes_per_layer_mask"] > 8192 * 8192 * 2 > r["replay_bytes_per_layer_padded"]
