"""CPU-safe, sync-free top-k router with Megatron's options, returning compact [T, k] routing.

Megatron-Core 0.16.1's ``Router.gating`` moves the gate weight to ``torch.cuda.current_device()``
on every call and ``TopKRouter.__init__`` allocates its expert-bias buffers on CUDA, so neither
runs on a CPU. :class:`FastpathRouter` subclasses ``TopKRouter`` (so Megatron's z-loss, input
jitter, aux-loss logging/``MoEAuxLossAutoScaler``, expert-bias state-dict handling and
``finalize_model_grads``' expert-bias update all keep working) but:

* initialises through ``compat.init_topk_router_state`` (``Router.__init__`` plus TopKRouter's
  attributes, buffers on the gate weight's device);
* ``gating`` is a plain ``router_gating_linear`` on whatever device the weight lives on;
* ``routing`` returns ``(probs_TK, topk_ids_TK)`` instead of dense ``[T, E]`` maps, counts tokens
  per expert with ``scatter_add_``, and never reads a tensor value on the host.

Supported: softmax / sigmoid scores, pre-softmax, top-k scaling factor, group-limited top-k
(``moe_router_num_groups`` / ``moe_router_group_topk``), sigmoid expert bias, the "aux_loss"
load-balancing loss (Megatron's ``switch_load_balancing_loss_func``, same value), z-loss.
Not supported (clear error at construction): sinkhorn (its loop syncs), seq/global aux loss,
router replay, fused router kernels.

Shape letters: S sequence, B batch, T = S*B tokens, E experts, k (K) experts per token.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.transformer.moe.moe_utils import (
    group_limited_topk,
    switch_load_balancing_loss_func,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

from megatron_fastpath.compat.graphs import in_capture_warmup
from megatron_fastpath.compat.moe import init_topk_router_state
from megatron_fastpath.moe.config import MoEDispatchConfig

__all__ = ["FastpathRouter", "topk_routing", "aux_loss_scores", "tokens_per_expert"]


def topk_routing(
    logits_TE: torch.Tensor,
    cfg: MoEDispatchConfig,
    expert_bias_E: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``topk_routing_with_score_function`` in compact form.

    Args:
        logits_TE: router logits [T, E].
        cfg: ``score_function``, ``pre_softmax``, ``topk``, ``num_groups``/``group_topk``,
            ``topk_scaling_factor``.
        expert_bias_E: sigmoid-only selection bias [E] (DeepSeek-V3 aux-free balancing).

    Returns:
        probs_TK (logits' dtype), topk_ids_TK (int64), the same values Megatron puts in its
        dense ``routing_probs`` / ``routing_map``.
    """
    T, E = logits_TE.shape
    k = cfg.topk

    def _topk(scores):
        if cfg.group_topk:
            return group_limited_topk(scores, k, T, E, cfg.num_groups, cfg.group_topk)
        return torch.topk(scores, k=k, dim=1)

    if cfg.score_function == "softmax":
        if cfg.pre_softmax:
            scores = torch.softmax(logits_TE, dim=-1, dtype=torch.float32).type_as(logits_TE)
            probs_TK, ids_TK = _topk(scores)
        else:
            top_logits, ids_TK = _topk(logits_TE)
            probs_TK = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits_TE)
    elif cfg.score_function == "sigmoid":
        scores = torch.sigmoid(logits_TE.float()).type_as(logits_TE)
        if expert_bias_E is not None:
            _, ids_TK = _topk(scores + expert_bias_E)
            probs_TK = torch.gather(scores, 1, ids_TK).type_as(logits_TE)
        else:
            probs_TK, ids_TK = _topk(scores)
        if k > 1:
            probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
    else:  # pragma: no cover - rejected by MoEDispatchConfig
        raise ValueError(f"invalid score_function {cfg.score_function!r}")
    if cfg.topk_scaling_factor:
        probs_TK = probs_TK * cfg.topk_scaling_factor
    return probs_TK, ids_TK


def tokens_per_expert(
    ids_TK: torch.Tensor, num_experts: int, valid_T: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Counts of (token, expert) pairs per expert, [E] float32, by ``scatter_add_`` (no sync)."""
    ones_TK = (
        torch.ones(ids_TK.shape, dtype=torch.float32, device=ids_TK.device)
        if valid_T is None
        else valid_T.to(torch.float32).unsqueeze(1).expand(ids_TK.shape)
    )
    counts = torch.zeros(num_experts, dtype=torch.float32, device=ids_TK.device)
    return counts.scatter_add_(0, ids_TK.reshape(-1), ones_TK.reshape(-1))


def aux_loss_scores(logits_TE: torch.Tensor, cfg: MoEDispatchConfig) -> torch.Tensor:
    """Scores used by the load-balancing loss (Megatron's ``compute_routing_scores_for_aux_loss``):
    full softmax, or sigmoid normalised over experts. [T, E] float32."""
    if cfg.score_function == "softmax":
        return torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    scores = torch.sigmoid(logits_TE.float())
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


class FastpathRouter(TopKRouter):
    """Top-k router: ``forward(hidden [S, B, H] or [T, H], padding_mask=None)`` ->
    ``(probs_TK, topk_ids_TK)``.

    The compact pair is accepted by :class:`~megatron_fastpath.moe.token_dispatcher.
    SortCountTokenDispatcher` in place of Megatron's dense ``(probs, routing_map)``.
    ``padding_mask`` ([S, B], True = padding, Megatron's convention, passed down by Megatron's
    ``GPTModel`` -> ``TransformerBlock`` -> ``TransformerLayer`` -> ``MoELayer``) removes padded
    tokens from the load-balancing statistics and routes them nowhere (id E = NOT_ROUTED).

    Args:
        config: Megatron ``TransformerConfig`` (MoE fields).
        pg_collection: Megatron ``ProcessGroupCollection`` (``tp``, ``cp``, ``tp_cp``,
            ``tp_dp_cp``); the aux-loss token counts are all-reduced over ``tp_cp`` like Megatron.
        dispatch_config: overrides ``MoEDispatchConfig.from_transformer_config(config)``.
    """

    def __init__(self, config, pg_collection=None, dispatch_config: Optional[MoEDispatchConfig] = None):
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        if config.moe_router_load_balancing_type == "sinkhorn":
            raise ValueError("FastpathRouter: sinkhorn routing syncs every step; use aux_loss")
        if getattr(config, "moe_enable_routing_replay", False):
            raise ValueError("FastpathRouter: moe_enable_routing_replay is not supported")
        if getattr(config, "moe_router_fusion", False):
            raise ValueError("FastpathRouter: moe_router_fusion (TE kernels) is not supported")
        self.cfg = dispatch_config or MoEDispatchConfig.from_transformer_config(config)
        init_topk_router_state(self, config, pg_collection, self.cfg.topk, self.cfg.score_function)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Router logits [..., E] on the weight's device (no CUDA move), in ``moe_router_dtype``."""
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            self.config.moe_router_dtype, input.dtype
        )
        # Megatron's router_gating_linear references te_general_gemm, which is undefined when
        # Transformer Engine is absent (NameError in 0.16.1): a plain linear in router dtype.
        bias = None if self.bias is None else self.bias.to(router_dtype)
        return torch.nn.functional.linear(
            input.to(router_dtype), self.weight.to(router_dtype), bias
        )

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """logits [S, B, E] or [T, E] -> (probs_TK, topk_ids_TK); attaches aux/z losses.

        ``padding_mask`` ([S, B] or [T], True = padding): padding tokens add nothing to the
        aux / z losses or the expert-bias counts, and are NOT_ROUTED: their ids are E and their
        probabilities 0, so the dispatcher gives them no capacity and no output."""
        E = self.num_experts
        logits_TE = logits.reshape(-1, E)
        pad_T = padding_mask.reshape(-1) if padding_mask is not None else None
        logits_TE = self.apply_z_loss(logits_TE, padding_mask=pad_T)

        probs_TK, ids_TK = topk_routing(logits_TE, self.cfg, self.expert_bias)

        if self.training and torch.is_grad_enabled() and self.cfg.aux_loss_coeff > 0:
            probs_TK = self._apply_compact_aux_loss(probs_TK, ids_TK, logits_TE, pad_T)
        if self.enable_expert_bias and torch.is_grad_enabled() and not in_capture_warmup():
            # not in CudaGraphManager's warm-up passes before capture (zero inputs, run with
            # grad): their tokens would enter the expert-bias update. The captured graph
            # itself holds the update, so every replay counts its real tokens.
            with torch.no_grad():
                valid_T = None if pad_T is None else ~pad_T
                self.local_tokens_per_expert += tokens_per_expert(ids_TK, E, valid_T)
        if pad_T is not None:
            pad_T1 = pad_T.unsqueeze(1)
            probs_TK = probs_TK.masked_fill(pad_T1, 0.0)
            ids_TK = ids_TK.masked_fill(pad_T1, E)  # NOT_ROUTED
        return probs_TK, ids_TK

    def _apply_compact_aux_loss(self, probs_TK, ids_TK, logits_TE, pad_T):
        """Megatron's "aux_loss" (switch load balancing), same value, from compact ids."""
        cfg = self.cfg
        scores_TE = aux_loss_scores(logits_TE, cfg)
        if cfg.group_topk or self.expert_bias is not None:
            # Megatron counts the plain (ungrouped, unbiased) top-k of the aux scores.
            aux_ids_TK = torch.topk(scores_TE, k=cfg.topk, dim=1)[1]
        else:
            aux_ids_TK = ids_TK  # same selection: softmax / normalised sigmoid are monotonic
        valid_T = None if pad_T is None else ~pad_T
        if valid_T is not None:
            scores_TE = scores_TE * valid_T.unsqueeze(-1)
        local_counts_E = tokens_per_expert(aux_ids_TK, self.num_experts, valid_T)
        global_counts_E = reduce_from_tensor_model_parallel_region(local_counts_E, self.tp_cp_group)
        if valid_T is None:
            local_num_tokens = logits_TE.shape[0]
            total_num_tokens = local_num_tokens * self.tp_cp_group.size()
        else:
            local_num_tokens = local_counts_E.sum() / cfg.topk
            total_num_tokens = global_counts_E.sum() / cfg.topk
        aux_loss = switch_load_balancing_loss_func(
            probs=scores_TE,
            tokens_per_expert=global_counts_E,
            total_num_tokens=total_num_tokens,
            topk=cfg.topk,
            num_experts=self.num_experts,
            moe_aux_loss_coeff=cfg.aux_loss_coeff,
        )
        return self.attach_and_log_load_balancing_loss(
            probs_TK,
            cfg.aux_loss_coeff,
            aux_loss,
            "load_balancing_loss",
            self.tp_cp_group,
            valid_token_count=local_num_tokens,
        )

    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """hidden [S, B, H] (or [T, H]) -> (probs_TK, topk_ids_TK). No host sync."""
        self._maintain_float32_expert_bias()
        input = self.apply_input_jitter(input)
        logits = self.gating(input)
        return self.routing(logits, padding_mask=padding_mask)
