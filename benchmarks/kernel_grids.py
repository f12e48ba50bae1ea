"""What the packed cache's static bounds cost the GPU kernels, counted on the host.

Varlen attention kernels size their grid from the static bounds the cache hands them, not from
the batch: flash-attn 2's varlen forward launches ``ceil(max_seqlen / 128) x batch x heads``
blocks (``flash_api.cpp`` ``mha_varlen_fwd``: ``num_m_block`` over ``max_seqlen_q``, ``batch =
cu_seqlens_q.numel() - 1``), most of them exiting at once when ``max_seqlen`` = T and ``batch``
= the ``max_seqs`` capacity. And a per-layer CUDA-graph replay copies every tensor field of the
params into the graph's input buffers (Megatron's ``CudaGraphManager``), once per layer per
microbatch.

Rows, per pack size T: the NeMo hook's defaults (``max_seqs = max_seqlen = packed_sequence_size``)
and the bounds from the data (``max_seqs`` from NeMo's ``max_samples_per_bin`` + 1,
``max_seqlen`` from ``dataset_max_seqlen``, here the synthetic SFT lengths of up to 96 tokens);
for the sdpa backend the bytes a graph replay copies per layer, [T, T] mask vs padded view.
Counts only: nothing is timed (a GPU would run these kernels; ``benchmarks/gpu_check.py``).

    python benchmarks/kernel_grids.py --json benchmarks/results/kernel_grids.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_meter import LoadMeter, describe, publish  # noqa: E402

HEADS, FLASH_BLOCK_M = 32, 128  # Llama 3 8B's query heads; FA2's kBlockM for head dim 128
LONGEST = 96  # the synthetic SFT distribution's longest sequence


def _params(t: int, max_seqs: int, max_seqlen, layout: str = "mask"):
    import torch

    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    cache = PackedSeqCache(PackedSeqConfig(max_tokens=t, max_seqs=max_seqs, max_seqlen=max_seqlen,
                                           sdpa_layout=layout, sdpa_mask_max_tokens=t))
    cache.register("sdpa_padded" if cache.config.sdpa_padded else "sdpa_mask", torch.bfloat16)
    return cache, cache.set_batch([LONGEST] * (t // LONGEST)).packed_seq_params


def _flash_blocks(params) -> int:
    batch = params.cu_seqlens_q.numel() - 1
    return -(-params.max_seqlen_q // FLASH_BLOCK_M) * batch * HEADS


def _replay_bytes(params) -> int:
    return sum(v.numel() * v.element_size() for v in params.tensors().values())


def row(t: int) -> dict:
    from megatron_fastpath.packed_seq.config import seqlen_bound

    seqs = t // LONGEST  # the most sequences of the data a pack holds
    _, hook = _params(t, t, None)
    _, data = _params(t, seqs + 1, seqlen_bound(LONGEST, t))
    _, mask = _params(t, seqs + 1, seqlen_bound(LONGEST, t), layout="mask")
    _, padded = _params(t, seqs + 1, seqlen_bound(LONGEST, t), layout="padded")
    return dict(tokens=t, sequences=seqs, heads=HEADS,
                flash_blocks_hook_defaults=_flash_blocks(hook),
                flash_blocks_data_bounds=_flash_blocks(data),
                defaults_over_bounds=round(_flash_blocks(hook) / _flash_blocks(data), 1),
                replay_bytes_per_layer_mask=_replay_bytes(mask),
                replay_bytes_per_layer_padded=_replay_bytes(padded))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    with LoadMeter() as meter:
        rows = [row(t) for t in args.tokens]
    env = dict(**meter.report())
    keys = list(rows[0])
    text = "\n".join(["  ".join(keys)] + ["  ".join(str(r[k]) for k in keys) for r in rows] + [
        "", "ratio: defaults_over_bounds = flash-attn varlen blocks launched with the hook's default "
        "bounds (max_seqs = max_seqlen = T) / with the data's (> 1: the defaults launch more); "
        "replay bytes: the params tensors a per-layer graph replay copies (bf16)", describe(env)])
    return publish(args, env, rows, text)


if __name__ == "__main__":
    main()
