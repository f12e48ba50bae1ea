"""MoE padding tokens: a packed batch is padded to max_tokens, and the
padding must not influence anything real. Changing ONLY the padding content leaves real tokens'
outputs, the aux / z losses and every gradient bit-identical; padding tokens get a zero MoE
output. Dropless and capacity mode here (EP=1); EP=2 in ``test_moe_ep_gloo.py``.

The mask is Megatron's own ``padding_mask`` ([B, S], True = padding), which megatron-core 0.16.1
passes GPTModel -> TransformerBlock -> TransformerLayer -> MoELayer -> router; the last test
checks that Megatron's TransformerLayer delivers it to our router."""

import pytest
import torch
import torch.nn.functional as F

from tests.moe.padding_support import (
    B, S, compare_runs, padding_mask_BS, run_layer, two_paddings)

H, FF, E, K = 16, 32, 8, 2

MODES = {
    "dropless": dict(),
    "dropless_pad16": dict(pad_multiple=16),
    # capacity 6 per expert for 24 tokens: padding routed like today would fill expert 0
    "capacity_pad": dict(capacity_factor=1.0, pad_to_capacity=True),
    "capacity_packed": dict(capacity_factor=1.0, pad_to_capacity=False),
}


def _tc(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FF,
        moe_ffn_hidden_size=FF, num_moe_experts=E, moe_router_topk=K, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
        moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_router_dtype="fp32", **kw,
    )


def _layer(tc, overrides):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_fastpath.moe.config import MoEDispatchConfig
    from megatron_fastpath.moe.spec import get_moe_mlp_spec

    spec = get_moe_mlp_spec(num_experts=E)
    spec.params = {"dispatch_config": MoEDispatchConfig.from_transformer_config(tc, **overrides)}
    layer = build_module(spec, config=tc, layer_number=1)
    layer.set_layer_number(1)  # as TransformerLayer does: the router logs its losses under it
    with torch.no_grad():  # unit-scale weights, so outputs and gradients are far from zero
        layer.router.weight.copy_(torch.randn(E, H) / H**0.5)
        layer.experts.weight1.copy_(torch.randn(E, H, 2 * FF) / H**0.5)
        layer.experts.weight2.copy_(torch.randn(E, FF, H) / FF**0.5)
    return layer


@pytest.mark.parametrize("mode", list(MODES))
def test_padding_content_changes_nothing_real(mcore_parallel, mode):
    layer = _layer(_tc(), MODES[mode])
    pad = padding_mask_BS()
    x = torch.randn(S, B, H)
    g = torch.randn(S, B, H)
    xa, xb = two_paddings(x, pad, layer.router.weight.detach())
    ra, rb = run_layer(layer, xa, pad, g), run_layer(layer, xb, pad, g)
    compare_runs(ra, rb, pad, where=mode)
    # the comparison is not between zeros: real outputs and expert grads are non-trivial
    assert float(ra["out"].abs().max()) > 1e-2
    assert float(ra["grads"]["experts.weight1"].abs().max()) > 1e-3


def test_without_mask_every_token_is_real(mcore_parallel):
    """No padding_mask: the old behaviour (all tokens routed) -- the hot padding content then
    changes real outputs in capacity mode, which is what the mask prevents."""
    layer = _layer(_tc(), MODES["capacity_pad"])
    pad = padding_mask_BS()
    x = torch.randn(S, B, H)
    xa, xb = two_paddings(x, pad, layer.router.weight.detach())
    with torch.no_grad():
        oa, _ = layer(xa)
        ob, _ = layer(xb)
    real = ~pad.t()
    assert not torch.equal(oa[real], ob[real])


def test_padding_mask_shape_checked_before_device_work(mcore_parallel):
    from megatron_fastpath.sync import SyncSentinel

    layer = _layer(_tc(), {})
    x, wrong = torch.randn(S, B, H), padding_mask_BS().t()
    with SyncSentinel() as s, pytest.raises(ValueError, match=r"padding_mask \[B, S\]"):
        layer(x, padding_mask=wrong)
    assert s.aten_ops == 0


def test_zero_host_syncs_with_mask(mcore_parallel):
    from megatron_fastpath.sync import SyncSentinel

    for mode in ("dropless", "capacity_pad"):
        layer = _layer(_tc(), MODES[mode])
        x = torch.randn(S, B, H, requires_grad=True)
        pad = padding_mask_BS()
        out, _ = layer(x, padding_mask=pad)
        out.sum().backward()  # warm-up (aux-loss tracker allocation)
        with SyncSentinel(strict=True, name=f"moe {mode} with padding mask") as s:
            out, _ = layer(x, padding_mask=pad)
            out.sum().backward()
        assert s.num_syncs == 0


def test_megatron_transformer_layer_passes_the_mask(mcore_parallel):
    """megatron-core 0.16.1's TransformerLayer forwards ``padding_mask`` to ``self.mlp``: the
    padding rows of a whole layer's MoE output are zero and the real rows ignore padding."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from megatron_fastpath.moe.spec import get_moe_mlp_spec

    tc = _tc(hidden_dropout=0.0)
    layer = TransformerLayer(
        tc, TransformerLayerSubmodules(mlp=get_moe_mlp_spec(), mlp_bda=get_bias_dropout_add),
        layer_number=1,
    )
    pad = padding_mask_BS()
    x = torch.randn(S, B, H)
    xa, xb = two_paddings(x, pad, layer.mlp.router.weight.detach())
    with torch.no_grad():
        oa, _ = layer(xa, attention_mask=None, padding_mask=pad)
        ob, _ = layer(xb, attention_mask=None, padding_mask=pad)
    real = ~pad.t()
    assert torch.equal(oa[real], ob[real])
    # no attention, residual only: padding rows come out as their input (MoE output zero)
    assert torch.equal(oa[~real], xa[~real]) and torch.equal(ob[~real], xb[~real])


def test_mask_convention_is_megatrons_router(mcore_parallel):
    """True = padding, as Megatron's own TopKRouter.routing reads it: with the same logits and
    mask, our router logs the same load-balancing and z losses as Megatron's (whose aux loss
    drops padding tokens from the routing map and the token count)."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_default_pg_collection,
        get_moe_layer_wise_logging_tracker,
    )
    from megatron.core.transformer.moe.router import TopKRouter

    from tests.support.cuda_as_cpu import cuda_as_cpu
    from megatron_fastpath.moe.router import FastpathRouter

    tc = _tc()
    pg = get_default_pg_collection()
    logits_SBE = torch.randn(S, B, E)
    pad = padding_mask_BS().t()  # [S, B] as MoELayer hands it to the router

    def losses(router):
        clear_aux_losses_tracker()
        router.set_layer_number(1)
        router.routing(logits_SBE.clone().requires_grad_(), padding_mask=pad)
        return {k: v["values"].clone() for k, v in get_moe_layer_wise_logging_tracker().items()}

    with cuda_as_cpu():
        megatron_router = TopKRouter(tc, pg)
    # its expert-bias update (off here) is a torch.compile'd no-op that cannot trace on a CPU
    megatron_router._apply_expert_bias = lambda *args, **kwargs: None
    theirs = losses(megatron_router)
    ours = losses(FastpathRouter(tc, pg))
    assert set(ours) == set(theirs) == {"load_balancing_loss", "z_loss"}
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], msg=name)


def test_cache_padding_mask_routes_real_tokens(mcore_parallel):
    """End to end with the packed cache: the mask a PackedBatch offers for Megatron's
    ``GPTModel(padding_mask=...)`` leaves real tokens routed and padding tokens unrouted."""
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    layer = _layer(_tc(), MODES["dropless"])
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=S * B, max_seqs=4))
    with cache.batch([9, 7]) as pb:  # 16 real tokens, 8 padding
        real_T = pb.packed_seq_params.real_token_mask_T.clone()
        with torch.no_grad():
            out, _ = layer(torch.randn(S * B, 1, H), padding_mask=pb.padding_mask_1T)
    out_TH = out.reshape(-1, H)
    assert bool((out_TH[real_T].abs().sum(-1) > 0).all()), "a real token got no MoE output"
    assert torch.count_nonzero(out_TH[~real_T]) == 0
