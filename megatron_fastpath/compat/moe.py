"""MoE: MoELayer / TopKRouter state without their CUDA-only constructors (moe/layer.py, moe/router.py)."""

from __future__ import annotations


from megatron_fastpath.compat import MCORE_0_19, _require_checked_mcore


# ---------------------------------------------------------------------------------------------
# MoE: MoELayer / TopKRouter state without their CUDA-only constructors
#
# megatron-core 0.16.x's ``TopKRouter.__init__`` allocates its expert-bias / global-aux buffers
# on ``torch.cuda.current_device()`` (transformer/moe/router.py, TopKRouter.__init__), and
# ``MoELayer.__init__`` always builds one of Megatron's token dispatchers from
# ``moe_token_dispatcher_type``; the "alltoall" one makes a ``torch.cuda.Stream`` (and would be
# thrown away). Neither runs on a CPU. The fastpath router / layer therefore run the CUDA-free
# base constructors (``Router.__init__``, ``BaseMoELayer.__init__``) and set, by hand, the other
# attributes the 0.16.x constructors set, which Megatron's inherited methods read. The two
# functions below are that hand copy; ``tests/moe/test_moe_compat.py`` builds Megatron's real
# TopKRouter / MoELayer (CUDA-as-CPU test mode) and checks the attribute sets are equal, and
# each function refuses a megatron-core outside the checked lines (compat's one gate).
#
# 0.19.x moved both: ``TopKRouter.__init__`` (0.19.2 transformer/moe/router.py:157) also sets
# ``frozen_expert_bias = False`` (:175) and the quantile-balancing buffers ``qb_beta`` /
# ``qb_beta_accum`` / ``qb_beta_count`` (None unless ``moe_router_load_balancing_type ==
# "quantile_balancing"``, :223-253; refused here); ``MoELayer.__init__`` (moe_layer.py:221) ends
# with ``setup_delayed_wgrad_for_dispatch_backward_overlap()`` (:383, :427), which sets
# ``_delayed_wgrad_event`` / ``_delayed_wgrad_stream`` (None, or CUDA objects with
# ``overlap_dispatch_backward_with_experts_wgrad``; refused here).
# ---------------------------------------------------------------------------------------------

MOE_INIT_SITES = (
    "transformer/moe/router.py: TopKRouter.__init__",
    "transformer/moe/moe_layer.py: MoELayer.__init__",
)


def init_topk_router_state(router, config, pg_collection, topk: int, score_function: str) -> None:
    """``TopKRouter.__init__`` (0.16.x / 0.19.x) with its buffers on the gate weight's device.

    Runs ``Router.__init__`` (gate weight, Megatron's init, process groups) and sets the
    attributes ``TopKRouter.__init__`` sets. Refuses what it does not copy: the global aux loss
    (its step-count buffers) and router replay."""
    import torch

    from megatron.core.transformer.moe.router import Router

    line = _require_checked_mcore(
        "init_topk_router_state",
        f"it sets by hand the attributes of {MOE_INIT_SITES[0]}",
    )
    if line == MCORE_0_19 and config.moe_router_load_balancing_type == "quantile_balancing":
        raise ValueError("the fastpath router does not support moe_router_load_balancing_type="
                         "'quantile_balancing'; use 'aux_loss' or 'none'")
    Router.__init__(router, config=config, pg_collection=pg_collection)
    router.topk = topk
    router.routing_type = config.moe_router_load_balancing_type
    if router.get_aux_loss_coeff("global_aux_loss") > 0:
        raise ValueError("the fastpath router does not support 'global_aux_loss'; use 'aux_loss'")
    router.score_function = score_function
    router.input_jitter = None
    if line == MCORE_0_19:
        router.frozen_expert_bias = False
        router.qb_beta = router.qb_beta_accum = router.qb_beta_count = None
    router.router_replay = None
    router.global_tokens_per_expert = None
    router.ga_steps = None
    router.enable_expert_bias = config.moe_router_enable_expert_bias
    if router.enable_expert_bias:
        zeros = lambda: torch.zeros(  # noqa: E731
            router.num_experts, dtype=torch.float32, device=router.weight.device
        )
        router.register_buffer("local_tokens_per_expert", zeros(), persistent=False)
        router.register_buffer("expert_bias", zeros())
    else:
        router.local_tokens_per_expert = None
        router.expert_bias = None


def init_moe_layer_state(layer, config, submodules, layer_number, pg_collection) -> None:
    """``MoELayer.__init__`` (0.16.x / 0.19.x) up to, not including, router / dispatcher / experts /
    shared experts, which the caller builds; plus the CUDA-graph resume state it sets last."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer
    from megatron.core.transformer.moe.moe_utils import MoECudaGraphTensorStore

    line = _require_checked_mcore(
        "init_moe_layer_state",
        f"it sets by hand the attributes of {MOE_INIT_SITES[1]}",
    )
    if line == MCORE_0_19 and getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False):
        raise ValueError("the fastpath MoE layer does not support "
                         "overlap_dispatch_backward_with_experts_wgrad (CUDA events and streams "
                         "around Megatron's dispatcher); turn it off")
    BaseMoELayer.__init__(
        layer, config=config, layer_number=layer_number, pg_collection=pg_collection
    )
    layer.submodules = submodules
    layer.moe_layer_recompute = (
        config.recompute_granularity == "selective"
        and "moe" in config.recompute_modules
        and config.cuda_graph_impl != "local"
    )
    layer.shared_experts_recompute = (
        config.recompute_granularity == "selective"
        and "shared_experts" in config.recompute_modules
    )
    layer.tp_group = pg_collection.tp
    layer.cudagraph_tensor_store = MoECudaGraphTensorStore()
    layer.fwd_execution_map = ["route", "expert_compute", "postprocess"]
    if line == MCORE_0_19:
        layer._delayed_wgrad_event = None
        layer._delayed_wgrad_stream = None
