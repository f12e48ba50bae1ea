"""``SortCountTokenDispatcher``: Megatron-Core's ``MoETokenDispatcher`` on the sort/count plan.

Phases (Megatron-Core 0.16.1 interface, called by ``MoELayer``):

==================== ==========================================================================
dispatch_preprocess  routing -> :class:`~megatron_fastpath.moe.dispatch.DispatchPlan` (stable
                     sort, ``scatter_add_`` counts, device offsets) and the permuted buffer.
token_dispatch       EP > 1 only: all-to-all of the buffer.
dispatch_postprocess EP > 1 only: regroup received rows by local expert. Returns
                     ``(tokens [R, H], tokens_per_expert [E_l] on device, probs or None)``.
combine_preprocess   inverse of dispatch_postprocess.
token_combine        EP > 1 only: all-to-all back.
combine_postprocess  weighted ``index_add_`` of each token's k rows; restore [S, B, H].
==================== ==========================================================================

Host syncs per layer (forward + backward), reported by ``expected_host_syncs_per_layer``:

* EP = 1, dropless or capacity: **0**.
* EP > 1, capacity mode: **0** -- every (rank, expert) chunk has ``capacity`` rows, so the
  all-to-all has equal static splits.
* EP > 1, dropless: **1** -- the per-expert counts are exchanged with an all-to-all (device) and
  the split sizes read to the host once (``all_to_all_single`` needs host splits); the
  backward reuses them.
* +1 when ``check_expert_ids`` or ``strict_capacity`` is on (one combined host read).

The routing may be given compactly (``probs [T, k]``, int ``topk_ids [T, k]``, from
:class:`~megatron_fastpath.moe.router.FastpathRouter`) or densely like Megatron's routers
(``probs [T, E]``, bool ``routing_map [T, E]``), which is converted with a static-shape top-k.
Compact ids equal to E are NOT_ROUTED (padding tokens, see :mod:`megatron_fastpath.moe.dispatch`):
they take no capacity, are not sent at EP > 1, and get a zero output.

Shape letters: S sequence, B batch, T = S*B tokens, H hidden, k experts per token, E experts
(E_l local to this EP rank), R rows of the expert buffer, C capacity per expert.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from megatron_fastpath.moe.config import MoEDispatchConfig
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

__all__ = ["SortCountTokenDispatcher", "all_to_all"]


class _AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` on any device (Megatron's ``_AllToAll`` allocates
    uneven outputs on ``torch.cuda.current_device()``). ``None`` splits = equal splits."""

    @staticmethod
    def forward(ctx, x, group, out_splits: Optional[List[int]], in_splits: Optional[List[int]]):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        x = x.contiguous()
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows,) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad.contiguous(), ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def all_to_all(x, group, out_splits=None, in_splits=None) -> torch.Tensor:
    """Autograd-aware ``all_to_all_single`` along dim 0 (identity for a 1-rank group)."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, out_splits, in_splits)


@dataclasses.dataclass(frozen=True)
class _EPState:
    """Per-layer-call EP metadata (dropless variant: host splits and the receive-side plan)."""

    in_splits: Optional[List[int]]
    out_splits: Optional[List[int]]
    recv_plan: Optional[DispatchPlan]


class SortCountTokenDispatcher(MoETokenDispatcher):
    """Sort/count token dispatcher: static shapes, device group sizes, no host sync at EP=1.

    Args:
        num_local_experts: experts on this EP rank (E / EP).
        local_expert_indices: their global ids (contiguous).
        config: Megatron ``TransformerConfig``.
        pg_collection: Megatron ``ProcessGroupCollection`` (``ep``, ``expt_tp``, ``tp_ep``).
        dispatch_config: overrides ``MoEDispatchConfig.from_transformer_config(config)``.

    Attributes:
        host_syncs: running count of the host reads this dispatcher made (for reporting).
        plan: the :class:`DispatchPlan` of the current micro-batch (between dispatch and combine).
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: List[int],
        config,
        pg_collection=None,
        dispatch_config: Optional[MoEDispatchConfig] = None,
    ) -> None:
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        cfg = dispatch_config or MoEDispatchConfig.from_transformer_config(config)
        if self.tp_size > 1:
            raise NotImplementedError(
                "SortCountTokenDispatcher: expert tensor parallelism (expert_tensor_parallel_size"
                " > 1) is not supported; use EP for experts"
            )
        if cfg.num_experts != num_local_experts * self.ep_size:
            raise ValueError(
                f"num_experts={cfg.num_experts} != num_local_experts={num_local_experts} x "
                f"EP={self.ep_size}"
            )
        if list(local_expert_indices) != list(
            range(local_expert_indices[0], local_expert_indices[0] + num_local_experts)
        ):
            raise ValueError(f"local_expert_indices must be contiguous, got {local_expert_indices}")
        if self.ep_size > 1 and not cfg.dropless and not cfg.pad_to_capacity:
            # The static all-to-all needs equal (rank, expert) chunks: pad to capacity.
            cfg = dataclasses.replace(cfg, pad_to_capacity=True)
        self.cfg = cfg
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        if self.ep_size > 1 and cfg.dropless:
            # Sender side is unpadded; alignment padding is applied after regrouping by local
            # expert on the receiving rank.
            self._send_cfg = dataclasses.replace(cfg, pad_multiple=1)
            self._recv_cfg = MoEDispatchConfig(
                num_experts=num_local_experts, topk=1, pad_multiple=cfg.pad_multiple
            )
        else:
            self._send_cfg = cfg
            self._recv_cfg = None
        self.host_syncs = 0
        self.plan: Optional[DispatchPlan] = None
        self._probs_TK: Optional[torch.Tensor] = None
        self._ep: Optional[_EPState] = None
        self.hidden_shape = None

    # -- reporting -----------------------------------------------------------------------
    @property
    def expected_host_syncs_per_layer(self) -> int:
        """Host syncs one MoE layer forward+backward costs with this configuration."""
        n = 1 if (self.ep_size > 1 and self.cfg.dropless) else 0
        return n + (1 if (self.cfg.check_expert_ids or self.cfg.strict_capacity) else 0)

    # -- dispatch --------------------------------------------------------------------------
    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """hidden [S, B, H] (or [T, H]); routing (probs, ids) [T, k] or dense [T, E] ->
        (permuted tokens [R, H], permuted probs [R] or None)."""
        self.hidden_shape = hidden_states.shape
        x_TD = hidden_states.reshape(-1, self.hidden_shape[-1])
        if routing_map.dtype == torch.bool:
            if probs is None or routing_map.shape != probs.shape:
                raise ValueError(
                    "dense routing: probs and routing_map must both be [T, E], got "
                    f"{None if probs is None else tuple(probs.shape)} and {tuple(routing_map.shape)}"
                )
            if routing_map.shape[1] != self.cfg.num_experts:
                raise ValueError(
                    f"routing_map has {routing_map.shape[1]} experts, config has "
                    f"{self.cfg.num_experts}"
                )
            probs_TK, ids_TK = routing_map_to_topk(probs, routing_map, self.cfg.topk)
        else:
            ids_TK, probs_TK = routing_map, probs
        validate_routing_inputs(x_TD, ids_TK, probs_TK, self.cfg)
        if probs_TK is None:
            raise ValueError("probs must be given (routing weights of the top-k experts)")
        if self.cfg.check_expert_ids or self.cfg.strict_capacity:
            self.host_syncs += 1  # counted even when the check raises
            check_routing_values(ids_TK, self.cfg)
        self.plan = build_dispatch_plan(ids_TK, self._send_cfg, probs_TK)
        self._probs_TK = probs_TK
        x_RD = permute_tokens(x_TD, self.plan)
        probs_R = None if self.cfg.probs_in_combine else permute_probs(probs_TK, self.plan)
        return x_RD, probs_R

    def token_dispatch(self, hidden_states, probs):
        """EP all-to-all: static equal splits (capacity) or count-exchanged splits (dropless)."""
        if self.ep_size == 1:
            return hidden_states, probs
        group = self.ep_group
        if not self.cfg.dropless:
            self._ep = _EPState(None, None, None)
            out = all_to_all(hidden_states, group)
            return out, (None if probs is None else all_to_all(probs, group))
        # Dropless: exchange counts on device, then ONE host read of the split sizes.
        E_l, ep = self.num_local_experts, self.ep_size
        counts_E = self.plan.tokens_per_expert_E
        recv_counts = all_to_all(counts_E, group)  # [ep * E_l]: from each source, my experts
        splits = torch.cat([counts_E.view(ep, E_l).sum(1), recv_counts.view(ep, E_l).sum(1)])
        splits = splits.tolist()  # the one counted host sync of dropless EP
        self.host_syncs += 1
        in_splits, out_splits = splits[:ep], splits[ep:]
        # NOT_ROUTED (padding) pairs are the tail of the buffer: they are not sent.
        sent = sum(in_splits)
        out = all_to_all(hidden_states[:sent], group, out_splits, in_splits)
        probs = None if probs is None else all_to_all(probs[:sent], group, out_splits, in_splits)
        # Local expert of each received row, then a k=1 plan that groups (and pads) by expert.
        R_recv = sum(out_splits)
        chunk_expert = torch.arange(ep * E_l, device=counts_E.device) % E_l
        recv_ids = torch.repeat_interleave(chunk_expert, recv_counts, output_size=R_recv)
        recv_plan = build_dispatch_plan(recv_ids.unsqueeze(1), self._recv_cfg)
        self._ep = _EPState(in_splits, out_splits, recv_plan)
        return out, probs

    def dispatch_postprocess(self, hidden_states, probs):
        """-> (tokens grouped by local expert [R', H], tokens_per_expert [E_l] device, probs)."""
        if self.ep_size == 1:
            return hidden_states, self.plan.group_sizes_E, probs
        E_l, ep = self.num_local_experts, self.ep_size
        if not self.cfg.dropless:
            C = self.plan.capacity
            x = _src_major_to_expert_major(hidden_states, ep, E_l, C)
            p = None if probs is None else _src_major_to_expert_major(probs, ep, E_l, C)
            sizes = torch.full((E_l,), ep * C, dtype=torch.long, device=x.device)
            return x, sizes, p
        rp = self._ep.recv_plan
        x = permute_tokens(hidden_states, rp)
        p = None
        if probs is not None:
            p = probs.index_select(0, rp.row_token_ids_R)
            if rp.row_combine_ids_R is not None:
                p = p * (rp.row_combine_ids_R < rp.num_tokens)
        return x, rp.group_sizes_E, p

    # -- combine ---------------------------------------------------------------------------
    def combine_preprocess(self, hidden_states):
        """Undo dispatch_postprocess (EP > 1)."""
        if self.ep_size == 1:
            return hidden_states
        if not self.cfg.dropless:
            return _expert_major_to_src_major(
                hidden_states, self.ep_size, self.num_local_experts, self.plan.capacity
            )
        return combine_tokens(hidden_states, self._ep.recv_plan, None)

    def token_combine(self, hidden_states):
        """EP all-to-all back to the source ranks (splits swapped); dropless: zero rows appended
        for the NOT_ROUTED tail that was not sent (combined into the trash row)."""
        if self.ep_size == 1:
            return hidden_states
        st = self._ep
        out = all_to_all(hidden_states, self.ep_group, st.in_splits, st.out_splits)
        unsent = self.plan.num_rows - out.shape[0]
        return torch.nn.functional.pad(out, (0, 0, 0, unsent)) if unsent else out

    def combine_postprocess(self, hidden_states):
        """Weighted sum of each token's expert outputs -> original [S, B, H] shape."""
        plan, probs_TK = self.plan, self._probs_TK
        w = probs_TK if self.cfg.probs_in_combine else None
        out_TD = combine_tokens(hidden_states, plan, w, out_dtype=hidden_states.dtype)
        self.plan, self._probs_TK, self._ep = None, None, None
        return out_TD.view(self.hidden_shape)


def _src_major_to_expert_major(t: torch.Tensor, ep: int, E_l: int, C: int) -> torch.Tensor:
    """[ep * E_l * C, ...] (by source rank) -> [E_l * ep * C, ...] (by local expert)."""
    tail = tuple(t.shape[1:])
    return t.view((ep, E_l, C) + tail).transpose(0, 1).reshape((E_l * ep * C,) + tail)


def _expert_major_to_src_major(t: torch.Tensor, ep: int, E_l: int, C: int) -> torch.Tensor:
    tail = tuple(t.shape[1:])
    return t.view((E_l, ep, C) + tail).transpose(0, 1).reshape((ep * E_l * C,) + tail)
