"""Sort/count MoE token dispatch: static shapes, device group sizes, zero host syncs.

Pure tensor functions (no Megatron import): :mod:`megatron_fastpath.moe.config`,
:mod:`megatron_fastpath.moe.dispatch`. Megatron adapters (imported lazily):
``FastpathRouter``, ``SortCountTokenDispatcher``, ``GroupedSwiGLUExperts``,
``TEGroupedSwiGLUExperts``, ``FastpathMoELayer``, ``get_moe_mlp_spec``.
"""

from megatron_fastpath.moe.config import FP8_ALIGN, MoEDispatchConfig
from megatron_fastpath.moe.dispatch import (
    DispatchPlan,
    build_dispatch_plan,
    check_routing_values,
    combine_tokens,
    permute_probs,
    permute_tokens,
    routing_map_to_topk,
    validate_routing_inputs,
)

from megatron_fastpath._lazy import lazy_getattr

_LAZY = {
    "FastpathRouter": "megatron_fastpath.moe.router",
    "topk_routing": "megatron_fastpath.moe.router",
    "SortCountTokenDispatcher": "megatron_fastpath.moe.token_dispatcher",
    "GroupedSwiGLUExperts": "megatron_fastpath.moe.experts",
    "TEGroupedSwiGLUExperts": "megatron_fastpath.moe.experts",
    "FastpathMoELayer": "megatron_fastpath.moe.layer",
    "FastpathMoESubmodules": "megatron_fastpath.moe.layer",
    "get_moe_mlp_spec": "megatron_fastpath.moe.spec",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "FP8_ALIGN",
    "MoEDispatchConfig",
    "DispatchPlan",
    "build_dispatch_plan",
    "check_routing_values",
    "combine_tokens",
    "permute_probs",
    "permute_tokens",
    "routing_map_to_topk",
    "validate_routing_inputs",
    *_LAZY,
]
