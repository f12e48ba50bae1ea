"""ModuleSpec for the MLP slot of a Megatron ``TransformerLayer``: the fastpath MoE layer."""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_fastpath.moe.config import ExpertBackend

__all__ = ["get_moe_mlp_spec"]


def get_moe_mlp_spec(
    num_experts: Optional[int] = None,
    expert_backend: ExpertBackend = "grouped_mm",
    shared_experts: Optional[ModuleSpec] = None,
) -> ModuleSpec:
    """Spec for ``TransformerLayerSubmodules.mlp``: :class:`FastpathMoELayer` with the
    CPU-safe :class:`FastpathRouter`, :class:`SortCountTokenDispatcher` and grouped experts.

    Args:
        num_experts: only checked (>= 1) for symmetry with Megatron's
            ``get_moe_module_spec(num_experts=...)``; the layer reads
            ``TransformerConfig.num_moe_experts``, which must be set.
        expert_backend: "grouped_mm" (torch._grouped_mm, 0 syncs; CPU and Hopper) or
            "te_grouped_linear" (Transformer Engine GroupedLinear, FP8; 1 counted sync/layer).
            Overrides ``MoEDispatchConfig.expert_backend`` through the experts spec.
        shared_experts: optional spec for Megatron's ``SharedExpertMLP`` (used when
            ``moe_shared_expert_intermediate_size`` is set; overlap is not supported).

    Every other option (top-k, capacity, FP8 padding, router score function, aux loss) comes
    from the ``TransformerConfig`` via ``MoEDispatchConfig.from_transformer_config``.
    """
    from megatron_fastpath.moe.experts import expert_class
    from megatron_fastpath.moe.layer import FastpathMoELayer, FastpathMoESubmodules
    from megatron_fastpath.moe.router import FastpathRouter

    if num_experts is not None and num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    experts = expert_class(expert_backend)  # raises ValueError naming the backends
    return ModuleSpec(
        module=FastpathMoELayer,
        submodules=FastpathMoESubmodules(
            experts=ModuleSpec(module=experts),
            shared_experts=shared_experts,
            router=FastpathRouter,
        ),
        metainfo={"fuse_pre_mlp_layernorm": False},
    )
