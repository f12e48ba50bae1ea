"""``FastpathMoELayer``: Megatron's ``MoELayer`` with the sort/count dispatcher, the CPU-safe
router and grouped experts on device offsets.

Only construction differs from ``MoELayer``; ``forward`` (route -> preprocess -> dispatch ->
experts -> combine -> postprocess), shared experts, recompute and ``isinstance(mlp, MoELayer)``
checks in ``TransformerLayer`` are Megatron's own.

Padding tokens: Megatron 0.16.1 threads ``padding_mask`` ([B, S] bool, True = padding) from
``GPTModel.forward`` through ``TransformerBlock`` and ``TransformerLayer._forward_mlp`` into
``MoELayer.forward`` (which transposes it to [S, B]) and the router. It is a tensor argument of
the layer call, so a CUDA-graph runner copies it into its static inputs at every replay. Given
it, :class:`~megatron_fastpath.moe.router.FastpathRouter` routes padding tokens nowhere: they
take no expert capacity, add nothing to the aux loss and get a zero MoE output (shared experts,
if any, are dense and still see them). The packed batch's mask is ``~real_token_mask`` [1, T];
without it every token counts as real.

Shape letters: S sequence, B batch, H hidden size.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.spec_utils import build_module

from megatron_fastpath.compat.moe import init_moe_layer_state
from megatron_fastpath.moe.config import MoEDispatchConfig
from megatron_fastpath.moe.experts import expert_class
from megatron_fastpath.moe.router import FastpathRouter
from megatron_fastpath.moe.token_dispatcher import SortCountTokenDispatcher

__all__ = ["FastpathMoELayer", "FastpathMoESubmodules"]


@dataclasses.dataclass
class FastpathMoESubmodules(MoESubmodules):
    """``MoESubmodules`` whose defaults are the fastpath router and grouped experts
    (``experts=None`` picks the backend named by ``MoEDispatchConfig.expert_backend``)."""

    experts: object = None
    shared_experts: object = None
    router: object = FastpathRouter


class FastpathMoELayer(MoELayer):
    """Mixture-of-experts layer: sort/count dispatch, 0 host syncs per layer at EP=1.

    Args:
        config: Megatron ``TransformerConfig`` with ``num_moe_experts`` etc.
        submodules: :class:`FastpathMoESubmodules` (router / experts / shared experts specs).
        layer_number: set by ``TransformerLayer``.
        pg_collection: process groups; default: Megatron's global parallel state.
        dispatch_config: overrides ``MoEDispatchConfig.from_transformer_config(config)``.
    """

    def __init__(
        self,
        config,
        submodules: Optional[MoESubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection=None,
        dispatch_config: Optional[MoEDispatchConfig] = None,
        is_mtp_layer: bool = False,
        name: Optional[str] = None,
    ):
        # megatron-core 0.19's TransformerLayer builds its MLP with ``is_mtp_layer`` and
        # ``name`` (transformer/transformer_layer.py:433-438); ``name`` only labels TE modules
        if is_mtp_layer:
            raise ValueError("FastpathMoELayer: multi-token-prediction layers are not supported; "
                             "use Megatron's MoELayer for the MTP block")
        submodules = submodules if submodules is not None else FastpathMoESubmodules()
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        if config.moe_latent_size:
            raise ValueError("FastpathMoELayer: moe_latent_size (TE latent projections) unsupported")
        if config.moe_shared_expert_intermediate_size is not None and config.moe_shared_expert_overlap:
            raise ValueError(
                "FastpathMoELayer: moe_shared_expert_overlap is tied to Megatron's alltoall "
                "dispatcher; set moe_shared_expert_overlap=False"
            )
        cfg = dispatch_config or MoEDispatchConfig.from_transformer_config(config)
        # MoELayer.__init__ always builds one of Megatron's dispatchers (the "alltoall" one
        # needs CUDA): set its other state through the compat shim, then build ours.
        init_moe_layer_state(self, config, submodules, layer_number, pg_collection)
        self.dispatch_config = cfg

        router = submodules.router or FastpathRouter
        if isinstance(router, type) and issubclass(router, FastpathRouter):
            self.router = router(config=config, pg_collection=pg_collection, dispatch_config=cfg)
        else:
            self.router = router(config=config, pg_collection=pg_collection)

        self.token_dispatcher = SortCountTokenDispatcher(
            self.num_local_experts,
            self.local_expert_indices,
            config=config,
            pg_collection=pg_collection,
            dispatch_config=cfg,
        )

        experts = submodules.experts or expert_class(cfg.expert_backend)
        self.experts = build_module(
            experts, self.num_local_experts, config, pg_collection=pg_collection
        )

        if self.use_shared_expert:
            if submodules.shared_experts is None:
                raise ValueError(
                    "moe_shared_expert_intermediate_size is set but no shared_experts spec given"
                )
            self.shared_experts = build_module(
                submodules.shared_experts,
                config=config,
                pg_collection=pg_collection,
                gate=config.moe_shared_expert_gate,
            )

    @property
    def expected_host_syncs_per_layer(self) -> int:
        """Host syncs per forward+backward of this layer (dispatcher + expert backend)."""
        n = self.token_dispatcher.expected_host_syncs_per_layer
        return n + getattr(self.experts, "HOST_SYNCS_PER_FORWARD", 0)

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        """Megatron's MoELayer.forward after static input checks (no device work on error).

        hidden_states [S, B, H]; padding_mask [B, S] bool (True = padding) or None."""
        if hidden_states is None:  # Megatron's partial-CUDA-graph resume path
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        if hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"hidden_states last dim {hidden_states.shape[-1]} != hidden_size "
                f"{self.config.hidden_size}"
            )
        if padding_mask is not None and (
            hidden_states.dim() != 3
            or tuple(padding_mask.shape) != (hidden_states.shape[1], hidden_states.shape[0])
        ):
            raise ValueError(
                f"padding_mask shape {tuple(padding_mask.shape)} does not match hidden_states "
                f"{tuple(hidden_states.shape)}: Megatron's convention is padding_mask [B, S] "
                "(True = padding) for hidden_states [S, B, H]"
            )
        expert_dtype = next(self.experts.parameters()).dtype
        if hidden_states.dtype != expert_dtype:
            raise TypeError(
                f"hidden_states dtype {hidden_states.dtype} != expert weight dtype {expert_dtype}: "
                "cast the input (or wrap the model in Megatron's Float16Module for bf16/fp16)"
            )
        return super().forward(hidden_states, intermediate_tensors, padding_mask)
