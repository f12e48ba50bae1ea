"""benchmarks/kernel_grids.py: the flash-attn varlen grid the cache's bounds imply (FA2's
``ceil(max_seqlen / 128) x (cu_seqlens.numel() - 1) x heads``) and the bytes a graph replay
copies per layer, recomputed here from the cache's own params."""

import json
import subprocess
import sys
from pathlib import Path

from tests.support.subproc import child_env

import pytest

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_grid_counts_follow_the_cache_bounds(tmp_path):
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernel_grids.py"), "--tokens", "8192",
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env=child_env(PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    # defaults: max_seqlen 8192 (64 blocks), cu_seqlens of max_seqs 8192 + 1 + 1 tail entries
    assert r["flash_blocks_hook_defaults"] == 64 * (8192 + 1) * 32 == 16_779_264
    # bounds: max_seqs 85 + 1, max_seqlen 128 (one block), tail closed every 128 tokens
    assert r["flash_blocks_data_bounds"] == 1 * (86 + 8192 // 128) * 32
    assert r["replay_bytes_per_layer_mask"] > 8192 * 8192 * 2 > r["replay_bytes_per_layer_padded"]
