"""The sdpa backend's two layouts on one packed batch: the [T, T] mask vs the packed-to-padded
view. One ``PackedCoreAttention`` layer (GQA 8 heads / 2 groups, head dim 64, fp32),
forward + backward, min over repeats, both layouts in one process on the same q / k / v. Counts
beside the times: attention scores computed (T^2 vs S * M^2) and the mask's bytes.

Packs as the issue measured them: T = 512 with 6 sequences and T = 16384 with 188 (synthetic
SFT lengths of 8..96 tokens), and T = 4096 with 48 between.

    python benchmarks/attention_layout.py --json benchmarks/results/attention_layout.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_meter import LoadMeter, describe, publish  # noqa: E402

HEADS, GROUPS, D = 8, 2, 64
PACKS = ((512, 6), (4096, 48), (16384, 188))


def _lengths(t: int, n: int, seed: int = 0) -> list:
    """``n`` lengths of 8..96 tokens, at most ``t`` in total."""
    rng = np.random.default_rng(seed)
    out = rng.integers(8, 97, size=n)
    while out.sum() > t:
        out = np.maximum(out - 1, 1)
    return out.tolist()


def _layer(t: int, max_seqs: int, max_seqlen: int, layout: str):
    from megatron_fastpath.attention.core_attention import PackedCoreAttention
    from megatron_fastpath.model import ModelConfig, build_transformer_config
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    cfg = build_transformer_config(ModelConfig(num_layers=1, hidden_size=HEADS * D,
                                               num_attention_heads=HEADS, num_query_groups=GROUPS))
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=t, max_seqs=max_seqs, max_seqlen=max_seqlen,
                                           sdpa_layout=layout, sdpa_mask_max_tokens=t))
    return PackedCoreAttention(cfg, layer_number=1, cache=cache, backend="sdpa", apply_rope=False), cache


def measure(t: int, n: int, reps: int) -> dict:
    from megatron_fastpath.packed_seq.config import seqlen_bound

    lengths = _lengths(t, n)
    m = seqlen_bound(max(lengths), t)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (HEADS, GROUPS, GROUPS))
    row = dict(tokens=t, sequences=len(lengths), longest=max(lengths), max_seqs=n, seqlen_bound=m)
    outs = {}
    for layout in ("padded", "mask"):
        attn, cache = _layer(t, n, m, layout)
        best = float("inf")
        for _ in range(reps):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            t0 = time.perf_counter()
            with cache.batch(lengths) as pb:
                out = attn(qq, kk, vv, None, packed_seq_params=pb.packed_seq_params)
                out.sum().backward()
            best = min(best, time.perf_counter() - t0)
        outs[layout] = out.detach()[: sum(lengths)]
        row[f"{layout}_ms"] = round(best * 1e3, 2)
    row["scores_mask"] = t * t * HEADS
    row["scores_padded"] = n * m * m * HEADS
    row["mask_bytes"] = t * t * 4
    row["mask_over_padded"] = round(row["mask_ms"] / row["padded_ms"], 2)
    row["max_abs_diff"] = float((outs["mask"] - outs["padded"]).abs().max())
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3, help="repeats per layout (minimum taken)")
    p.add_argument("--quick", action="store_true", help="T = 512 and 4096 only")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    packs = PACKS[:2] if args.quick else PACKS
    with LoadMeter() as meter:
        rows = [measure(t, n, args.reps) for t, n in packs]
    env = dict(torch=torch.__version__, threads=torch.get_num_threads(), **meter.report())
    keys = list(rows[0])
    text = "\n".join(["  ".join(keys)] + ["  ".join(str(r[k]) for k in keys) for r in rows] + [
        "", "ratio: mask_over_padded = fwd+bwd time of one layer with the [T, T] mask / with the "
        "padded view (> 1: the padded view is faster); scores = attention scores computed",
        describe(env)])
    return publish(args, env, rows, text)


if __name__ == "__main__":
    main()
