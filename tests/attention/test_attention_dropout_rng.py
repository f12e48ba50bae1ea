"""Attention dropout draws from Megatron's model-parallel RNG stream, as Megatron's
DotProductAttention does outside sequence parallelism (transformer/dot_product_attention.py:
``with tensor_parallel.get_cuda_rng_tracker().fork(): attention_probs =
self.attention_dropout(...)``): each TP rank (a different set of heads) gets its own mask, and
the default (data-parallel) stream, seeded alike on every TP rank, is not consumed. Run under the test-only CUDA-as-CPU mode with Megatron's real tracker."""

import torch
from tests.support.megatron_rng import run_as_rank

from megatron_fastpath.attention.core_attention import PackedCoreAttention
from megatron_fastpath.model import build_transformer_config, rope_config_for
from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
from tests.support.packed_reference import TINY

T = 32


def _attention_output(tp_rank):
    cfg = build_transformer_config(TINY, attention_dropout=0.5)
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=4, rope=rope_config_for(TINY)))
    attn = PackedCoreAttention(cfg, layer_number=1, cache=cache, backend="sdpa")
    attn.train()
    heads, d = cfg.num_attention_heads, cfg.kv_channels
    torch.manual_seed(3)
    q, k, v = (torch.randn(T, heads, d) for _ in range(3))

    def attend():
        with cache.batch([10, 22]) as pb:
            return attn(q, k, v, None, packed_seq_params=pb.packed_seq_params)

    return run_as_rank(attend, tp_rank=tp_rank)


def test_attention_dropout_masks_differ_per_tp_rank_and_spare_the_default_stream(mcore_parallel):
    out0, untouched0 = _attention_output(0)
    out1, untouched1 = _attention_output(1)
    again, _ = _attention_output(0)
    assert untouched0 and untouched1
    assert not torch.equal(out0, out1) and torch.equal(out0, again)
