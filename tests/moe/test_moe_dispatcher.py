"""Sort/count MoE dispatcher: equivalence with a plain per-expert reference (outputs and
gradients), zero host syncs, E-independent op counts, and clear errors on bad input."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_fastpath.moe.config import MoEDispatchConfig
from megatron_fastpath.moe.dispatch import (
    build_dispatch_plan,
    combine_tokens,
    permute_tokens,
    routing_map_to_topk,
    validate_routing_inputs,
)
from megatron_fastpath.sync import SyncSentinel

from tests.moe.moe_dispatch_reference import (
    aux_loss_reference,
    dense_router_reference,
    moe_reference,
    moe_reference_dense,
)

H, FF = 16, 32  # hidden, expert ffn (multiples of 8: 16-byte rows for torch._grouped_mm in bf16)


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
def _tc(E=8, k=2, dtype=torch.float32, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    if k == 1:
        kw.setdefault("moe_router_pre_softmax", True)  # Megatron requires it for top-1 softmax
    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FF,
        moe_ffn_hidden_size=FF, num_moe_experts=E, moe_router_topk=k, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, **kw,
    )


def _experts(E, dtype=torch.float32):
    from megatron_fastpath.moe.experts import GroupedSwiGLUExperts

    ex = GroupedSwiGLUExperts(E, _tc(E=E, k=1, dtype=dtype))
    with torch.no_grad():
        ex.weight1.copy_(torch.randn(E, H, 2 * FF) / H**0.5)
        ex.weight2.copy_(torch.randn(E, FF, H) / FF**0.5)
    return ex


def _ours(x, ids, probs, experts, cfg):
    plan = build_dispatch_plan(ids, cfg, probs)
    y, _ = experts(permute_tokens(x, plan), plan.group_sizes_E)
    return combine_tokens(y, plan, probs, out_dtype=x.dtype), plan


def _grads(out, leaves, g):
    return torch.autograd.grad((out.float() * g).sum(), leaves)


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


def _random_ids(T, E, k):
    return torch.stack([torch.randperm(E)[:k] for _ in range(T)])


# Edge cases of the routing itself: (name, T, E, k, ids builder)
ROUTINGS = {
    "random": (24, 8, 2, lambda T, E, k: _random_ids(T, E, k)),
    "expert_without_tokens": (24, 8, 2, lambda T, E, k: 1 + _random_ids(T, E - 1, k)),
    "all_to_one_expert": (24, 8, 1, lambda T, E, k: torch.full((T, k), 5)),
    "all_to_one_plus_one": (24, 8, 2, lambda T, E, k: torch.stack(
        [torch.full((T,), 3), torch.full((T,), 6)], 1)),
    "single_token": (1, 8, 2, lambda T, E, k: _random_ids(T, E, k)),
    "k_equals_E": (12, 4, 4, lambda T, E, k: _random_ids(T, E, k)),
}


# ------------------------------------------------------------------------------------------
# pure dispatch vs per-expert loop: outputs and grads (tokens, probs, expert weights)
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pad_multiple", [1, 16])
@pytest.mark.parametrize("case", list(ROUTINGS))
def test_dispatch_matches_per_expert_reference(case, pad_multiple, dtype):
    T, E, k, make_ids = ROUTINGS[case]
    ids = make_ids(T, E, k)
    x = torch.randn(T, H).to(dtype).requires_grad_()
    probs = torch.rand(T, k).requires_grad_()
    ex = _experts(E, dtype)
    cfg = MoEDispatchConfig(num_experts=E, topk=k, pad_multiple=pad_multiple)

    out, plan = _ours(x, ids, probs, ex, cfg)
    x_r = x.detach().clone().requires_grad_()
    p_r = probs.detach().clone().requires_grad_()
    w1_r = ex.weight1.detach().clone().requires_grad_()
    w2_r = ex.weight2.detach().clone().requires_grad_()
    ref = moe_reference(x_r, ids, p_r, w1_r, w2_r)

    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **_tol(dtype))
    g = torch.randn(T, H)
    got = _grads(out, [x, probs, ex.weight1, ex.weight2], g)
    exp = _grads(ref, [x_r, p_r, w1_r, w2_r], g)
    for a, b, name in zip(got, exp, ["tokens", "probs", "weight1", "weight2"]):
        torch.testing.assert_close(a, b, **_tol(dtype), msg=lambda m: f"grad {name}: {m}")
    # counts are exact, group sizes aligned, offsets end at the static buffer size
    counts = torch.zeros(E, dtype=torch.long).index_add_(0, ids.flatten(), torch.ones(T * k, dtype=torch.long))
    assert torch.equal(plan.tokens_per_expert_E, counts)
    assert int(plan.group_sizes_E.sum()) == plan.num_rows == cfg.num_rows(T)
    if pad_multiple > 1:
        assert bool((plan.group_sizes_E % pad_multiple == 0).all())
        assert bool((plan.group_sizes_E >= counts).all())


def test_ties_in_scores_route_like_megatron():
    """All-equal router logits: our compact top-k picks the same experts as Megatron's."""
    from megatron_fastpath.moe.router import topk_routing

    T, E, k = 10, 8, 3
    logits = torch.zeros(T, E)
    logits[:, 2:5] = 1.0  # a 3-way tie at the top, 5-way tie below
    probs, ids = topk_routing(logits, MoEDispatchConfig(num_experts=E, topk=k))
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    probs_TE, map_TE = topk_routing_with_score_function(logits, k)
    dense_p = torch.zeros(T, E).scatter(1, ids, probs)
    dense_m = torch.zeros(T, E, dtype=torch.bool).scatter(1, ids, True)
    assert torch.equal(dense_m, map_TE)
    torch.testing.assert_close(dense_p, probs_TE)
    # and a fully tied row (zero logits) still gives k distinct experts, each prob 1/k
    probs0, ids0 = topk_routing(torch.zeros(T, E), MoEDispatchConfig(num_experts=E, topk=k))
    assert all(len(set(r)) == k for r in ids0.tolist())
    torch.testing.assert_close(probs0, torch.full((T, k), 1 / k))


def test_dense_routing_map_conversion_is_exact():
    T, E, k = 16, 8, 2
    logits = torch.randn(T, E)
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    probs_TE, map_TE = topk_routing_with_score_function(logits, k)
    probs_TK, ids_TK = routing_map_to_topk(probs_TE, map_TE, k)
    assert torch.equal(torch.zeros(T, E, dtype=torch.bool).scatter(1, ids_TK, True), map_TE)
    torch.testing.assert_close(torch.zeros(T, E).scatter(1, ids_TK, probs_TK), probs_TE)


# ------------------------------------------------------------------------------------------
# capacity mode: drop-and-pad against an independent per-expert selection
# ------------------------------------------------------------------------------------------
def _kept_reference(ids, probs, E, C, policy):
    """Per expert, the pairs Megatron keeps: top-C by prob ('probs') or first C ('position')."""
    T, k = ids.shape
    keep = torch.zeros(T, k, dtype=torch.bool)
    for e in range(E):
        pairs = [(t, j) for t in range(T) for j in range(k) if int(ids[t, j]) == e]
        if policy == "probs":
            pairs = sorted(pairs, key=lambda p: -float(probs[p]))  # stable: earlier wins ties
        for t, j in pairs[:C]:
            keep[t, j] = True
    return keep


@pytest.mark.parametrize("pad_to_capacity", [True, False])
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 3.0])
def test_capacity_drop_and_pad_matches_reference(factor, policy, pad_to_capacity):
    T, E, k = 20, 4, 2
    ids = torch.cat([torch.zeros(T, 1, dtype=torch.long), 1 + _random_ids(T, E - 1, 1)], 1)
    probs = torch.rand(T, k).requires_grad_()
    x = torch.randn(T, H, requires_grad=True)
    ex = _experts(E)
    cfg = MoEDispatchConfig(num_experts=E, topk=k, capacity_factor=factor, drop_policy=policy,
                            pad_to_capacity=pad_to_capacity)
    with SyncSentinel() as s:
        out, plan = _ours(x, ids, probs, ex, cfg)
        gx, = torch.autograd.grad(out.sum(), [x])
    assert s.num_syncs == 0, s.summary()
    C = cfg.capacity(T)
    assert plan.num_rows == (E * C if pad_to_capacity else min(T * k, E * C))
    keep = _kept_reference(ids, probs.detach(), E, C, policy)
    x_r = x.detach().clone().requires_grad_()
    ref = moe_reference(x_r, ids, probs.detach() * keep, ex.weight1.detach(), ex.weight2.detach())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    gx_r, = torch.autograd.grad(ref.sum(), [x_r])
    torch.testing.assert_close(gx, gx_r, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# the Megatron layer: router + dispatcher + experts vs Megatron routing + per-expert loop
# ------------------------------------------------------------------------------------------
def _layer(tc, **dispatch_overrides):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_fastpath.moe.config import MoEDispatchConfig
    from megatron_fastpath.moe.layer import FastpathMoELayer
    from megatron_fastpath.moe.spec import get_moe_mlp_spec

    spec = get_moe_mlp_spec(num_experts=tc.num_moe_experts)
    if dispatch_overrides:
        spec.params = {"dispatch_config": MoEDispatchConfig.from_transformer_config(
            tc, **dispatch_overrides)}
    layer = build_module(spec, config=tc, layer_number=1)
    assert isinstance(layer, FastpathMoELayer)
    return layer


def _layer_vs_reference(layer, x_SBH, aux_coeff=0.0, score_function="softmax"):
    tc = layer.config
    k = tc.moe_router_topk
    g = torch.randn(x_SBH.shape)
    out, bias = layer(x_SBH)
    assert bias is None and out.shape == x_SBH.shape and out.dtype == x_SBH.dtype
    got = _grads(out, [x_SBH, layer.router.weight, layer.experts.weight1, layer.experts.weight2], g)

    x_r = x_SBH.detach().reshape(-1, H).clone().requires_grad_()
    rw = layer.router.weight.detach().clone().requires_grad_()
    w1 = layer.experts.weight1.detach().clone().requires_grad_()
    w2 = layer.experts.weight2.detach().clone().requires_grad_()
    logits, probs_TE, map_TE = dense_router_reference(x_r, rw, k, score_function=score_function)
    ref = moe_reference_dense(x_r, probs_TE, map_TE, w1, w2)
    loss = (ref.float() * g.reshape(-1, H)).sum()
    if aux_coeff:
        loss = loss + aux_loss_reference(logits, k, aux_coeff, score_function)
    exp = torch.autograd.grad(loss, [x_r, rw, w1, w2])
    tol = _tol(x_SBH.dtype)
    torch.testing.assert_close(out.reshape(-1, H), ref, **tol)
    for a, b, name in zip(got, exp, ["tokens", "router", "weight1", "weight2"]):
        torch.testing.assert_close(a.reshape(b.shape).float(), b.float(), **tol,
                                   msg=lambda m: f"grad {name}: {m}")
    return map_TE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_layer_matches_reference_with_aux_loss(mcore_parallel, dtype, score_function):
    tc = _tc(E=8, k=2, dtype=dtype, moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32",
             moe_router_score_function=score_function)
    layer = _layer(tc)
    x = torch.randn(6, 2, H).to(dtype).requires_grad_()
    _layer_vs_reference(layer, x, aux_coeff=1e-2, score_function=score_function)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["expert_without_tokens", "all_to_one_expert", "single_token",
                                  "k_equals_E", "tied_scores"])
def test_layer_edge_cases(mcore_parallel, case, dtype):
    E, k, S, B = 8, 2, 6, 2
    if case == "all_to_one_expert":
        k = 1
    if case == "k_equals_E":
        E, k = 4, 4
    if case == "single_token":
        S, B = 1, 1
    tc = _tc(E=E, k=k, dtype=dtype, moe_router_dtype="fp32")
    layer = _layer(tc)
    x = torch.randn(S, B, H)
    with torch.no_grad():
        w = layer.router.weight
        if case == "expert_without_tokens":
            x[..., 0] = 3.0
            w[0, 0] = -20.0  # expert 0 loses every token
        elif case == "all_to_one_expert":
            x[..., 0] = 3.0
            w[5, 0] = 20.0  # expert 5 wins every token
        elif case == "tied_scores":
            w.zero_()  # every logit equal
    x = x.to(dtype).requires_grad_()
    map_TE = _layer_vs_reference(layer, x)
    if case == "expert_without_tokens":
        assert not bool(map_TE[:, 0].any())
    if case == "all_to_one_expert":
        assert bool(map_TE[:, 5].all())


@pytest.mark.parametrize("mode", ["capacity_no_drop", "fp8_padding", "probs_in_experts"])
def test_layer_modes_match_reference(mcore_parallel, mode):
    overrides = {
        "capacity_no_drop": dict(capacity_factor=8.0, pad_to_capacity=True),
        "fp8_padding": dict(pad_multiple=16),
        "probs_in_experts": dict(probs_in_combine=False),
    }[mode]
    layer = _layer(_tc(E=4, k=2), **overrides)
    x = torch.randn(5, 2, H, requires_grad=True)
    _layer_vs_reference(layer, x)


# ------------------------------------------------------------------------------------------
# host syncs and op counts
# ------------------------------------------------------------------------------------------
def _fwd_bwd_counts(layer, x):
    out, _ = layer(x)
    (out * 1.0).sum().backward()  # warm-up: first-call allocations (aux-loss tracker)
    with SyncSentinel(strict=True, name="moe layer fwd+bwd") as s:
        out, _ = layer(x)
        (out * torch.ones_like(out)).sum().backward()
    return s


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(capacity_factor=1.0), dict(capacity_factor=1.0, pad_to_capacity=False),
     dict(pad_multiple=16)],
    ids=["dropless", "capacity_pad", "capacity_packed", "fp8_pad16"],
)
def test_zero_host_syncs_and_op_count_independent_of_E(mcore_parallel, overrides):
    counts = {}
    for E in (8, 64):
        tc = _tc(E=E, k=2, moe_aux_loss_coeff=1e-2)
        layer = _layer(tc, **overrides)
        assert layer.expected_host_syncs_per_layer == 0
        x = torch.randn(16, 2, H, requires_grad=True)
        s = _fwd_bwd_counts(layer, x)  # strict: raises at the first host sync
        assert s.num_syncs == 0
        counts[E] = (s.aten_ops, dict(s.op_counts))
    assert counts[8][0] == counts[64][0], (counts[8], counts[64])
    assert counts[8][1] == counts[64][1]


def test_per_expert_loop_does_grow_with_E():
    """Sanity check of the measurement: a torch.where loop costs E data-dependent syncs."""
    for E in (8, 64):
        ids = _random_ids(32, E, 2)
        with SyncSentinel() as s:
            for e in range(E):
                torch.where(ids == e)
        assert s.num_syncs == E


# ------------------------------------------------------------------------------------------
# bad input: clear errors, raised before any token is moved
# ------------------------------------------------------------------------------------------
def test_topk_greater_than_num_experts():
    with pytest.raises(ValueError, match="topk=5 > num_experts=4"):
        MoEDispatchConfig(num_experts=4, topk=5)
    cfg = MoEDispatchConfig(num_experts=4, topk=2)
    with pytest.raises(ValueError, match="k=5 columns"):
        validate_routing_inputs(torch.randn(3, H), torch.zeros(3, 5, dtype=torch.long), None, cfg)


def _dispatcher(tc, **overrides):
    from megatron_fastpath.moe.token_dispatcher import SortCountTokenDispatcher

    cfg = MoEDispatchConfig.from_transformer_config(tc, **overrides)
    E = tc.num_moe_experts
    return SortCountTokenDispatcher(E, list(range(E)), tc, dispatch_config=cfg)


def test_expert_ids_out_of_range_raise_before_device_work(mcore_parallel):
    d = _dispatcher(_tc(E=4, k=2), check_expert_ids=True)
    x = torch.randn(6, 1, H)
    ids = torch.tensor([[0, 1]] * 5 + [[2, 5]])  # 4 = E would be NOT_ROUTED
    with SyncSentinel() as s, pytest.raises(ValueError, match=r"expert ids out of range: min=0, max=5"):
        d.dispatch_preprocess(x, ids, torch.rand(6, 2))
    assert s.num_syncs == 1  # the one documented validation read
    assert not {"index_select", "index_add", "_grouped_mm", "sort"} & set(s.op_counts)
    with pytest.raises(ValueError, match="out of range: min=-1"):
        d.dispatch_preprocess(x, torch.tensor([[0, -1]] * 6), torch.rand(6, 2))


def test_strict_capacity_overflow_raises_before_device_work(mcore_parallel):
    d = _dispatcher(_tc(E=4, k=1), capacity_factor=1.0, strict_capacity=True)
    x = torch.randn(8, 1, H)
    ids = torch.tensor([[2]] * 5 + [[0], [1], [3]])  # capacity = ceil(8/4) = 2, expert 2 gets 5
    with SyncSentinel() as s, pytest.raises(ValueError, match="expert 2 got 5 tokens > capacity 2"):
        d.dispatch_preprocess(x, ids, torch.rand(8, 1))
    assert not {"index_select", "index_add", "sort"} & set(s.op_counts)
    # within capacity: dispatches fine, with exactly the one counted read
    ok = torch.tensor([[0], [0], [1], [1], [2], [2], [3], [3]])
    d.dispatch_preprocess(x, ok, torch.rand(8, 1))
    assert d.host_syncs == 2 and d.expected_host_syncs_per_layer == 1


@pytest.mark.parametrize("bad", ["float_ids", "int_probs", "probs_shape", "x_rows", "dense_shape"])
def test_mismatched_inputs_raise_without_device_work(mcore_parallel, bad):
    d = _dispatcher(_tc(E=4, k=2))
    x, ids, probs = torch.randn(6, 1, H), torch.randint(0, 4, (6, 2)), torch.rand(6, 2)
    err, args = {
        "float_ids": (TypeError, (x, ids.float(), probs)),
        "int_probs": (TypeError, (x, ids, (probs * 10).long())),
        "probs_shape": (ValueError, (x, ids, probs[:, :1])),
        "x_rows": (ValueError, (torch.randn(5, 1, H), ids, probs)),
        "dense_shape": (ValueError, (x, torch.zeros(6, 4, dtype=torch.bool), torch.rand(6, 3))),
    }[bad]
    with SyncSentinel() as s, pytest.raises(err):
        d.dispatch_preprocess(*args)
    assert s.num_syncs == 0
    assert not {"index_select", "sort", "scatter_add"} & set(s.op_counts)


def test_layer_rejects_dtype_mismatch_before_device_work(mcore_parallel):
    layer = _layer(_tc(E=4, k=2))
    x = torch.randn(4, 2, H, dtype=torch.bfloat16)
    with SyncSentinel() as s, pytest.raises(TypeError, match="expert weight dtype torch.float32"):
        layer(x)
    assert s.aten_ops == 0


def test_grouped_experts_reject_unaligned_sizes():
    from megatron_fastpath.moe.experts import GroupedSwiGLUExperts

    tc = _tc(E=4, k=1, dtype=torch.bfloat16)
    tc = dataclasses.replace(tc, moe_ffn_hidden_size=12)
    with pytest.raises(ValueError, match="moe_ffn_hidden_size=12 must be a multiple of 8"):
        GroupedSwiGLUExperts(4, tc)


def test_from_transformer_config_reads_megatron_fields():
    tc = _tc(E=16, k=4, moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=True,
             moe_router_score_function="sigmoid", moe_aux_loss_coeff=0.01,
             moe_router_num_groups=4, moe_router_group_topk=2, moe_router_pre_softmax=True)
    cfg = MoEDispatchConfig.from_transformer_config(tc)
    assert (cfg.num_experts, cfg.topk, cfg.capacity_factor, cfg.pad_to_capacity) == (16, 4, 1.25, True)
    assert (cfg.score_function, cfg.aux_loss_coeff, cfg.num_groups, cfg.group_topk) == (
        "sigmoid", 0.01, 4, 2)
    assert cfg.pre_softmax and cfg.pad_multiple == 1
    assert cfg.capacity(10) == 4  # ceil(10*4/16*1.25)
    assert MoEDispatchConfig.from_transformer_config(tc, pad_multiple=16).capacity(10) == 16


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "mxfp8", "blockwise"])
def test_fp8_expert_groups_padded_to_megatrons_alignment(recipe):
    """Expert groups are padded to the recipe's alignment, not 16 rows for every recipe:
    MXFP8 scales blocks of 32 and needs 32. The padding is Megatron's own
    get_fp8_align_size of the recipe."""
    import types

    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size

    tc = _tc(E=4, k=2)
    fp8 = types.SimpleNamespace(**{**vars(tc), "fp8": "hybrid", "fp8_recipe": recipe})
    cfg = MoEDispatchConfig.from_transformer_config(fp8)
    assert cfg.pad_multiple == get_fp8_align_size(Fp8Recipe(recipe)) == (32 if recipe == "mxfp8" else 16)


@pytest.mark.gpu
def test_te_grouped_linear_backend_costs_one_counted_sync(mcore_parallel):
    from megatron_fastpath.moe.experts import TEGroupedSwiGLUExperts

    tc = _tc(E=4, k=2, dtype=torch.bfloat16)
    ex = TEGroupedSwiGLUExperts(4, tc)
    x = torch.randn(32, H, device="cuda", dtype=torch.bfloat16)
    sizes = torch.tensor([16, 0, 16, 0], device="cuda")
    with SyncSentinel() as s:
        y, _ = ex(x, sizes)
    assert y.shape == x.shape
    assert ex.host_syncs == 1 == ex.HOST_SYNCS_PER_FORWARD
    assert s.num_syncs >= 1 and any(e.op == "tolist" for e in s.events)
