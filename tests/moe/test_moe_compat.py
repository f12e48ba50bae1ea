"""The MoE compat shims (``compat.init_topk_router_state`` / ``compat.init_moe_layer_state``):
they set exactly the state megatron-core's own constructors set (compared against the real
``TopKRouter`` / ``MoELayer`` built in the CUDA-as-CPU test mode), and refuse loudly on a
megatron-core version they were not checked against."""

import pytest
import torch.nn.functional as F
from packaging.version import Version

from tests.support.cuda_as_cpu import cuda_as_cpu


def _tc(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
        moe_ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True, **kw,
    )


def _state(module):
    return dict(
        attributes=set(vars(module)) - {"cfg", "dispatch_config"},  # ours: the frozen config
        buffers={n: (b.shape, b.dtype) for n, b in module._buffers.items() if b is not None},
        persistent=set(module.state_dict(keep_vars=True)) if hasattr(module, "weight") else None,
    )


@pytest.mark.parametrize("expert_bias", [False, True])
def test_router_state_equals_megatron_topk_router(mcore_parallel, expert_bias):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_fastpath.moe.router import FastpathRouter

    kw = dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid") if expert_bias else {}
    tc = _tc(moe_aux_loss_coeff=1e-2, **kw)
    pg = get_default_pg_collection()
    with cuda_as_cpu():
        real = TopKRouter(tc, pg)
    ours = FastpathRouter(tc, pg)
    assert _state(ours) == _state(real)
    if expert_bias:
        assert ours.expert_bias.device == ours.weight.device


def test_layer_state_equals_megatron_moe_layer(mcore_parallel):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_fastpath.moe.layer import FastpathMoELayer

    tc = _tc(moe_token_dispatcher_type="alltoall")
    pg = get_default_pg_collection()
    experts = ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    with cuda_as_cpu():
        real = MoELayer(tc, MoESubmodules(experts=experts, router=TopKRouter), 1, pg)
    ours = FastpathMoELayer(tc, layer_number=1, pg_collection=pg)
    assert set(vars(real)) - {"cfg"} == set(vars(ours)) - {"dispatch_config"}
    for name in ("moe_layer_recompute", "shared_experts_recompute", "fwd_execution_map",
                 "num_local_experts", "local_expert_indices", "layer_number", "use_shared_expert"):
        assert getattr(ours, name) == getattr(real, name), name
    assert type(ours.cudagraph_tensor_store) is type(real.cudagraph_tensor_store)


@pytest.mark.parametrize("shim", ["init_topk_router_state", "init_moe_layer_state"])
def test_shims_refuse_an_unchecked_megatron_core(mcore_parallel, monkeypatch, shim):
    import megatron_fastpath.compat as compat
    from megatron_fastpath.moe.layer import FastpathMoELayer
    from megatron_fastpath.moe.router import FastpathRouter

    build = FastpathRouter if shim == "init_topk_router_state" else FastpathMoELayer
    monkeypatch.setattr(compat, "MCORE_VERSION", Version("0.17.0"))
    expected = rf"compat\.{shim} was checked against megatron-core 0\.16\.x, 0\.19\.x only and megatron-core 0\.17\.0 is installed"  # noqa: E501
    with pytest.raises(ImportError, match=expected):
        build(_tc())
    monkeypatch.setattr(compat, "MCORE_VERSION", Version("0.16.3"))
    build(_tc())  # any 0.16.x release is the checked line


ONLY_0_19 = {"router": {"frozen_expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count"},
             "layer": {"_delayed_wgrad_event", "_delayed_wgrad_stream"}}


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_shims_set_the_lines_attributes(mcore_parallel, monkeypatch, version):
    """Each line's branch sets what that line's constructors set (the installed line's set is
    compared with Megatron's own above): 0.19 adds frozen_expert_bias, the quantile-balancing
    buffers (router.py:175, :250-253) and the delayed-wgrad event / stream (moe_layer.py:431)."""
    import megatron_fastpath.compat as compat
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_fastpath.moe.layer import FastpathMoELayer
    from megatron_fastpath.moe.router import FastpathRouter

    monkeypatch.setattr(compat, "MCORE_VERSION", Version(version))
    on_0_19 = version.startswith("0.19")
    router = FastpathRouter(_tc(), get_default_pg_collection())
    layer = FastpathMoELayer(_tc(), layer_number=1, pg_collection=get_default_pg_collection())
    for module, names in ((router, ONLY_0_19["router"]), (layer, ONLY_0_19["layer"])):
        present = names & set(vars(module))
        assert present == (names if on_0_19 else set())
    if on_0_19:
        assert router.frozen_expert_bias is False and router.qb_beta is None
        assert layer._delayed_wgrad_event is None and layer._delayed_wgrad_stream is None


def test_0_19_branch_refuses_what_it_does_not_copy(mcore_parallel, monkeypatch):
    import megatron_fastpath.compat as compat
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_fastpath.moe.layer import FastpathMoELayer
    from megatron_fastpath.moe.router import FastpathRouter

    monkeypatch.setattr(compat, "MCORE_VERSION", Version("0.19.2"))
    tc = _tc(moe_aux_loss_coeff=0.0)
    tc.moe_router_load_balancing_type = "quantile_balancing"
    with pytest.raises(ValueError, match="does not support moe_router_load_balancing_type="
                                         "'quantile_balancing'; use 'aux_loss' or 'none'"):
        FastpathRouter(tc, get_default_pg_collection())
    tc = _tc()
    tc.overlap_dispatch_backward_with_experts_wgrad = True
    with pytest.raises(ValueError, match="overlap_dispatch_backward_with_experts_wgrad"):
        FastpathMoELayer(tc, layer_number=1, pg_collection=get_default_pg_collection())


def test_expert_bias_counts_skip_cudagraph_warmup(mcore_parallel, monkeypatch):
    """CudaGraphManager runs warm-up passes (zero inputs, grad enabled) before capturing a
    layer (megatron/core/transformer/cuda_graphs.py create_fwd_graph, between
    _set_warmup_start and _set_warmup_end). Their tokens must not enter the router's
    expert-bias counts; the capture's own pass must (its update is what replays run). Driven
    through Megatron's own flag functions, whose 0.16.1 _set_warmup_end leaves the flag set."""
    import torch
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_fastpath.moe.router import FastpathRouter

    monkeypatch.setattr(cuda_graphs, "_IS_GRAPH_WARMUP", False)  # restored: 0.16.1 never resets it
    monkeypatch.setattr(cuda_graphs, "_IS_GRAPH_CAPTURING", False)
    tc = _tc(moe_aux_loss_coeff=0.0, moe_router_enable_expert_bias=True,
             moe_router_score_function="sigmoid")
    router = FastpathRouter(tc, get_default_pg_collection())
    router.train()
    x = torch.randn(6, 1, 16)
    router(x)  # step 1, eager
    assert router.local_tokens_per_expert.sum() == 6 * 2  # tokens x top-k
    cuda_graphs._set_warmup_start()
    router(torch.zeros_like(x))  # the warm-up pass
    cuda_graphs._set_warmup_end()
    assert router.local_tokens_per_expert.sum() == 6 * 2
    cuda_graphs._set_capture_start()
    router(x)  # the capture pass: its update is recorded (here: runs) once
    cuda_graphs._set_capture_end()
    assert router.local_tokens_per_expert.sum() == 2 * 6 * 2


def test_megatron_warmup_flag_site_is_still_there():
    import os

    import megatron.core

    from megatron_fastpath.compat.graphs import WARMUP_FLAG_SITE

    rel, text = WARMUP_FLAG_SITE
    with open(os.path.join(os.path.dirname(megatron.core.__file__), rel)) as f:
        assert text in f.read()
