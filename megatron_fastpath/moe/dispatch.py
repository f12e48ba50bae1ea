"""Sort/count token dispatch as pure functions on tensors (no Megatron, CPU-testable).

Shape letters: T tokens, k (K) experts per token, N = T*k (token, expert) pairs, E experts (of
this dispatch), R rows of the static expert buffer, D (H) hidden size, C per-expert capacity.

The algorithm::

    ids_N        = topk_ids_TK.flatten()                       # expert of each pair
    order_N      = stable argsort(ids_N)                       # pairs grouped by expert
    counts_E     = zeros(E+1).scatter_add_(0, ids_N, 1)[:E]    # never bincount, never .tolist()
    x_RD         = x_TD.index_select(0, row_token_R)           # permute into a static buffer
    out_TD       = zeros.index_add_(0, row_combine_R, y_RD * w_R)[:T] # weighted combine

Every shape is a function of (T, k, E, config) only, so the op sequence is the same for every
batch (no host sync, CUDA-graph capturable) and its length does not depend on E.

NOT_ROUTED: an expert id equal to E marks a pair that goes to no expert (the router gives it to
every pair of a padding token). It sorts after all experts, is not counted, takes no capacity,
and its buffer row (if any) combines into the trash row: its token's output is exactly zero and
no expert weight sees a gradient from it.

Buffer layouts (rows R = ``MoEDispatchConfig.num_rows(T)``):

* dropless, ``pad_multiple == 1``: R = N, expert groups back to back, NOT_ROUTED pairs last
  (the slack of the last group);
* dropless with padding (FP8): group e gets ``round_up(count_e, m)`` rows; R is the static bound
  ``floor((N + E*(m-1)) / m) * m`` and the slack is appended to the last group, so the offsets
  always end at R (``torch._grouped_mm`` leaves rows past the last offset uninitialised);
* capacity, ``pad_to_capacity``: group e occupies rows ``[e*C, (e+1)*C)``; R = E*C;
* capacity, packed: kept counts ``min(count_e, C)`` packed like the dropless case.

Padding and slack rows hold a copy of some token: the combine sends them to a trash row (index
T) that is sliced away, so they never reach the output and receive exactly zero gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_fastpath.moe.config import MoEDispatchConfig

__all__ = [
    "DispatchPlan",
    "validate_routing_inputs",
    "check_routing_values",
    "build_dispatch_plan",
    "permute_tokens",
    "permute_probs",
    "combine_tokens",
    "routing_map_to_topk",
]


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """What combine needs from dispatch (and the EP phases in between). Tensors live on the
    token device. Built by :func:`build_dispatch_plan` only (keywords).

    Static ints: ``num_tokens`` T, ``num_rows`` R, ``capacity`` C (None when dropless).

    Tensors:
        tokens_per_expert_E: int64 [E], routed pairs of each expert before any drop (NOT_ROUTED
            pairs excluded); the EP dropless split exchange sends these rows.
        group_sizes_E: int64 [E], buffer rows of each expert (kept + alignment padding; the last
            expert also absorbs the slack up to R). Sums to R: Megatron's ``tokens_per_expert``.
        row_token_ids_R: int64 [R], source token of each buffer row (gather index of permute).
        row_slot_ids_R: int64 [R], flat (token*k + j) pair index of each buffer row (gathers
            the routing probabilities).
        row_combine_ids_R: int64 [R], destination of each row in the combine: its token, or the
            trash row T for slack / dropped / NOT_ROUTED rows.
    """

    num_tokens: int
    num_rows: int
    capacity: Optional[int]
    tokens_per_expert_E: torch.Tensor
    group_sizes_E: torch.Tensor
    row_token_ids_R: torch.Tensor
    row_slot_ids_R: torch.Tensor
    row_combine_ids_R: torch.Tensor


# -- validation (static: shapes, dtypes, sizes; never reads tensor values) ------------------
def validate_routing_inputs(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    probs_TK: Optional[torch.Tensor],
    cfg: MoEDispatchConfig,
    num_experts: Optional[int] = None,
) -> None:
    """Raise TypeError/ValueError for malformed routing inputs. Metadata only: no device work."""
    E = cfg.num_experts if num_experts is None else num_experts
    if not torch.is_tensor(x_TD) or x_TD.dim() != 2:
        raise ValueError(f"tokens must be a 2-D [T, D] tensor, got shape {tuple(x_TD.shape)}")
    if not x_TD.is_floating_point():
        raise TypeError(f"tokens must be floating point, got {x_TD.dtype}")
    if topk_ids_TK.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"topk_ids must be int64 or int32 expert indices, got {topk_ids_TK.dtype} "
            "(a bool [T, E] routing map must go through routing_map_to_topk first)"
        )
    T, k = topk_ids_TK.shape
    if T != x_TD.shape[0]:
        raise ValueError(f"topk_ids has {T} rows but tokens have {x_TD.shape[0]}")
    if k != cfg.topk:
        raise ValueError(f"topk_ids has k={k} columns but the config says topk={cfg.topk}")
    if k > E:
        raise ValueError(f"top-k={k} > num_experts={E}: lower moe_router_topk or add experts")
    if topk_ids_TK.device != x_TD.device:
        raise ValueError(f"topk_ids on {topk_ids_TK.device} but tokens on {x_TD.device}")
    if probs_TK is not None:
        if probs_TK.shape != topk_ids_TK.shape:
            raise ValueError(
                f"probs shape {tuple(probs_TK.shape)} != topk_ids shape {tuple(topk_ids_TK.shape)}"
            )
        if not probs_TK.is_floating_point():
            raise TypeError(f"probs must be floating point, got {probs_TK.dtype}")
        if probs_TK.device != x_TD.device:
            raise ValueError(f"probs on {probs_TK.device} but tokens on {x_TD.device}")
    if T == 0:
        raise ValueError("empty batch (T=0): nothing to route")


def check_routing_values(
    topk_ids_TK: torch.Tensor, cfg: MoEDispatchConfig, num_experts: Optional[int] = None
) -> None:
    """Data checks (``cfg.check_expert_ids`` / ``cfg.strict_capacity``): ids in [0, E] (E =
    NOT_ROUTED) and, in
    strict capacity mode, no expert over capacity. Exactly ONE host read (counted by
    SyncSentinel), done before any token is moved. Clamped ids are used for the count so an
    out-of-range id cannot trigger a device-side assert first."""
    E = cfg.num_experts if num_experts is None else num_experts
    ids_N = topk_ids_TK.reshape(-1).long()
    lo_hi = torch.aminmax(ids_N)
    stats = [lo_hi.min, lo_hi.max]
    if cfg.strict_capacity:
        counts_E = torch.zeros(E + 1, dtype=torch.long, device=ids_N.device)  # bin E: NOT_ROUTED
        counts_E.scatter_add_(0, ids_N.clamp(0, E), torch.ones_like(ids_N))
        stats.append(counts_E[:E].max())
        stats.append(counts_E[:E].argmax())
    lo, hi, *cap = torch.stack(stats).tolist()  # the single host read
    if lo < 0 or hi > E:
        raise ValueError(
            f"expert ids out of range: min={lo}, max={hi}, but num_experts={E} "
            f"(ids must be in [0, E), or E={E} for a NOT_ROUTED padding pair; check the "
            "router's expert count)"
        )
    if cfg.strict_capacity:
        C = cfg.capacity(topk_ids_TK.shape[0])
        if cap[0] > C:
            raise ValueError(
                f"capacity overflow (strict_capacity=True): expert {cap[1]} got {cap[0]} tokens "
                f"> capacity {C} (T={topk_ids_TK.shape[0]}, k={cfg.topk}, E={E}, "
                f"capacity_factor={cfg.capacity_factor}); raise moe_expert_capacity_factor or "
                "set strict_capacity=False to drop"
            )


def routing_map_to_topk(
    probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's dense (probs [T, E], bool routing_map [T, E]) -> compact (probs [T, k],
    ids [T, k]) with a static-shape ``topk`` (no sync). Rows with fewer than k selected experts
    (a router that dropped tokens) get extra ids whose probability is 0."""
    if routing_map_TE.shape != probs_TE.shape or routing_map_TE.dim() != 2:
        raise ValueError(
            f"dense routing needs probs and routing_map of equal [T, E] shape, got "
            f"{tuple(probs_TE.shape)} and {tuple(routing_map_TE.shape)}"
        )
    if topk > routing_map_TE.shape[1]:
        raise ValueError(f"top-k={topk} > num_experts={routing_map_TE.shape[1]}")
    _, ids_TK = torch.topk(routing_map_TE.to(torch.int8), topk, dim=1, sorted=False)
    probs_TK = probs_TE.gather(1, ids_TK) * routing_map_TE.gather(1, ids_TK)
    return probs_TK, ids_TK


# -- plan --------------------------------------------------------------------------------
def build_dispatch_plan(
    topk_ids_TK: torch.Tensor,
    cfg: MoEDispatchConfig,
    probs_TK: Optional[torch.Tensor] = None,
) -> DispatchPlan:
    """Sort the T*k (token, expert) pairs by expert and lay them out in a static buffer.

    Args:
        topk_ids_TK: int [T, k] expert ids in [0, E]; id E (``cfg.num_experts``) marks a pair
            that is NOT_ROUTED (a padding token): it takes no capacity, no group row of any
            expert, and its rows (slack at the end of the buffer) combine into the trash row.
        cfg: dispatch config (layout, capacity, padding).
        probs_TK: routing probabilities, only read for ``drop_policy == "probs"`` in capacity
            mode (highest-probability pairs are kept). Not differentiated through.

    Returns:
        A :class:`DispatchPlan`. No host sync; the op count depends only on the layout mode.
    """
    E = cfg.num_experts
    T, k = topk_ids_TK.shape
    N = T * k
    dev = topk_ids_TK.device
    C = cfg.capacity(T)
    R = cfg.num_rows(T)

    ids_N = topk_ids_TK.reshape(-1).long()
    if C is not None and cfg.drop_policy == "probs" and probs_TK is not None:
        # Keep the highest-probability pairs of each expert: sort by -prob, then stably by id.
        by_prob_N = torch.sort(probs_TK.detach().reshape(-1), descending=True, stable=True)[1]
        sorted_ids_N, by_expert_N = torch.sort(ids_N.index_select(0, by_prob_N), stable=True)
        slot_N = by_prob_N.index_select(0, by_expert_N)
    else:
        sorted_ids_N, slot_N = torch.sort(ids_N, stable=True)
    token_N = torch.div(slot_N, k, rounding_mode="floor")

    # One extra bin counts the NOT_ROUTED pairs (id E), which sort after every expert.
    counts_E = torch.zeros(E + 1, dtype=torch.long, device=dev)
    counts_E = counts_E.scatter_add_(0, ids_N, torch.ones_like(ids_N))[:E]

    if C is None and cfg.pad_multiple == 1:
        # Dropless, unpadded: the sorted order *is* the buffer; NOT_ROUTED pairs form the
        # slack of the last group and go to the trash row.
        group_sizes_E = counts_E.clone()
        group_sizes_E[-1:] += N - counts_E.sum()
        return DispatchPlan(
            num_tokens=T, num_rows=R, capacity=None, tokens_per_expert_E=counts_E,
            group_sizes_E=group_sizes_E, row_token_ids_R=token_N, row_slot_ids_R=slot_N,
            row_combine_ids_R=torch.where(sorted_ids_N < E, token_N, T),
        )
    return _padded_plan(slot_N, token_N, counts_E, cfg, T, N, C, R)


def _padded_plan(slot_N, token_N, counts_E, cfg, T, N, C, R) -> DispatchPlan:
    """Capacity and/or alignment-padded layout: row r of the buffer holds the ``rank``-th kept
    pair of its group, or is padding (a copy of some token, combined into the trash row)."""
    E, m, dev = cfg.num_experts, cfg.pad_multiple, counts_E.device
    sorted_starts_E = torch.cumsum(counts_E, 0) - counts_E  # start of expert e in slot_N
    kept_E = counts_E if C is None else torch.clamp(counts_E, max=C)
    row_R = torch.arange(R, device=dev)
    if C is not None and cfg.pad_to_capacity:
        group_sizes_E = torch.full((E,), C, dtype=torch.long, device=dev)
        group_R = torch.div(row_R, C, rounding_mode="floor")
        rank_R = row_R - group_R * C
    else:
        group_sizes_E = (kept_E + (m - 1)) // m * m if m > 1 else kept_E.clone()
        group_sizes_E[-1:] += R - group_sizes_E.sum()  # slack to the last expert: ends at R
        ends_E = torch.cumsum(group_sizes_E, 0)
        group_R = torch.searchsorted(ends_E, row_R, right=True).clamp_(max=E - 1)
        rank_R = row_R - (ends_E - group_sizes_E).index_select(0, group_R)
    valid_R = rank_R < kept_E.index_select(0, group_R)
    src_R = torch.clamp(sorted_starts_E.index_select(0, group_R) + rank_R, max=N - 1)
    src_R = torch.where(valid_R, src_R, torch.zeros_like(src_R))
    row_token_R = token_N.index_select(0, src_R)
    return DispatchPlan(
        num_tokens=T, num_rows=R, capacity=C, tokens_per_expert_E=counts_E,
        group_sizes_E=group_sizes_E, row_token_ids_R=row_token_R,
        row_slot_ids_R=slot_N.index_select(0, src_R),
        row_combine_ids_R=torch.where(valid_R, row_token_R, T),
    )


# -- permute / combine -------------------------------------------------------------------
def permute_tokens(x_TD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Gather tokens into the expert-grouped buffer: [T, D] -> [R, D] (one index_select)."""
    return x_TD.index_select(0, plan.row_token_ids_R)


def permute_probs(probs_TK: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Routing probability of each buffer row, [R] (0 on padding/dropped rows)."""
    probs_R = probs_TK.reshape(-1).index_select(0, plan.row_slot_ids_R)
    return probs_R * (plan.row_combine_ids_R < plan.num_tokens)


def combine_tokens(
    y_RD: torch.Tensor,
    plan: DispatchPlan,
    probs_TK: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Weighted sum of each token's k expert outputs: [R, D] -> [T, D].

    ``out[t] = sum_j probs[t, j] * y[row of (t, j)]`` via one ``index_add_`` (padding, dropped
    and NOT_ROUTED rows go to a trash row that is sliced away). ``probs_TK=None`` sums unweighted (probs were
    applied inside the experts). Accumulates in the promoted dtype of y and probs, returns
    ``out_dtype`` (default: y's dtype)."""
    T = plan.num_tokens
    out_dtype = y_RD.dtype if out_dtype is None else out_dtype
    if probs_TK is not None:
        w_R = probs_TK.reshape(-1).index_select(0, plan.row_slot_ids_R)
        src_RD = y_RD * w_R.unsqueeze(-1)
    else:
        src_RD = y_RD
    out = src_RD.new_zeros(T + 1, y_RD.shape[-1]).index_add_(0, plan.row_combine_ids_R, src_RD)
    return out[:T].to(out_dtype)
