"""Two microbatches in flight (1F1B order) with activation-offload recompute.

The layer a recompute re-runs in backward must read the batch of ITS forward. The core
attention reads everything per batch from the ``packed_seq_params`` it is given (the recompute
gets the same object back), never from a "current" batch; without params it refuses.
Order: set A, forward A, set B, forward B, backward A, release A, backward B (release B);
gradients equal running A then B one after the other. Dense and MoE.
"""

import dataclasses

import pytest
import torch

from megatron_fastpath.layer_spec import get_fastpath_layer_spec
from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
from megatron_fastpath.offload import OffloadConfig, RecordingDevice, with_activation_offload
from megatron_fastpath.offload.spec import get_offload_manager
from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
from tests.support.packed_reference import TINY
from tests.support.packed_reference import packed_inputs

T = 32
BATCHES = {"A": [5, 11, 16], "B": [30, 1]}  # different packings


def build(moe: bool):
    model_cfg = dataclasses.replace(TINY, num_experts=4, moe_router_topk=2) if moe else TINY
    cfg = build_transformer_config(model_cfg)
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=4, num_slots=2,
                                           rope=rope_config_for(model_cfg)))
    spec = get_fastpath_layer_spec(cache, backend="sdpa", num_experts=model_cfg.num_experts)
    spec = with_activation_offload(spec, OffloadConfig(recompute=True, min_offload_bytes=0,
                                                       headroom_margin_bytes=0),
                                   device=RecordingDevice())
    torch.manual_seed(0)
    model = build_gpt_model(cfg, spec, model_cfg.vocab_size, T)
    return model, cache, get_offload_manager(model)


def inputs(name):
    return packed_inputs(BATCHES[name], T, TINY.vocab_size,
                         torch.Generator().manual_seed(ord(name)))


def forward(model, pb, name):
    tokens, labels, mask = inputs(name)
    out = model(tokens, pb.position_ids_1T, None, labels=labels,
                packed_seq_params=pb.packed_seq_params)
    return (out * mask).sum()


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_1f1b_order_with_recompute_equals_one_after_the_other(mcore_parallel, moe):
    model, cache, manager = build(moe)

    manager.begin_step()
    for name in "AB":  # one after the other
        with cache.batch(BATCHES[name]) as pb:
            forward(model, pb, name).backward()
    manager.end_step()
    expected = grads(model)
    model.zero_grad(set_to_none=True)

    manager.begin_step()
    pa = cache.set_batch(BATCHES["A"])
    loss_a = forward(model, pa, "A")
    pb = cache.set_batch(BATCHES["B"])  # B is loaded into the other slot while A is in flight
    loss_b = forward(model, pb, "B")
    loss_a.backward()  # recompute of A's layers runs now, with B loaded last
    cache.release(pa)
    loss_b.backward()
    cache.release(pb)
    manager.end_step()
    got = grads(model)

    assert got.keys() == expected.keys() and len(got) > 0
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)


def test_recompute_without_params_is_refused(mcore_parallel):
    """An implicit fallback (None -> the batch current when the layer runs) would give wrong
    gradients: a recompute of A's layers in backward runs while B is current."""
    model, cache, manager = build(moe=False)
    tokens, labels, _ = inputs("A")
    manager.begin_step()
    with cache.batch(BATCHES["A"]) as pa:
        with pytest.raises(ValueError, match="never falls back to a 'current' batch"):
            model(tokens, pa.position_ids_1T, None, labels=labels)
