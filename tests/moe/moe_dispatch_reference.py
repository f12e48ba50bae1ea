"""Plain per-expert references for the MoE tests (boolean masks, host loops: obviously right,
deliberately slow). Not a test module."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_expert(x_nH: torch.Tensor, w1_HF2: torch.Tensor, w2_FH: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(x_nH @ w1_HF2, 2, dim=-1)
    return (F.silu(gate) * up) @ w2_FH


def moe_reference(x_TH, ids_TK, probs_TK, w1_EHF2, w2_EFH):
    """out[t] = sum_j probs[t, j] * expert_{ids[t, j]}(x[t]), one expert at a time."""
    out = torch.zeros(x_TH.shape, dtype=torch.float32)
    for e in range(w1_EHF2.shape[0]):
        hit_TK = ids_TK == e
        tok = hit_TK.any(dim=1)
        if not bool(tok.any()):
            continue
        w_t = (probs_TK * hit_TK).sum(dim=1)[tok]
        y = swiglu_expert(x_TH[tok], w1_EHF2[e], w2_EFH[e])
        out[tok] += (w_t.unsqueeze(-1) * y).float()
    return out.to(x_TH.dtype)


def dense_router_reference(x_TH, router_w_EH, topk, score_function="softmax", pre_softmax=False,
                           num_groups=None, group_topk=None):
    """Megatron's own topk_routing_with_score_function -> compact (probs, ids) with the ids in
    Megatron's top-k order."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = x_TH.float() @ router_w_EH.float().t()
    probs_TE, map_TE = topk_routing_with_score_function(
        logits, topk, use_pre_softmax=pre_softmax, num_groups=num_groups, group_topk=group_topk,
        score_function=score_function,
    )
    return logits, probs_TE, map_TE


def moe_reference_dense(x_TH, probs_TE, map_TE, w1_EHF2, w2_EFH):
    """Per-expert loop over Megatron's dense routing map."""
    out = torch.zeros(x_TH.shape, dtype=torch.float32)
    for e in range(w1_EHF2.shape[0]):
        tok = map_TE[:, e]
        if not bool(tok.any()):
            continue
        y = swiglu_expert(x_TH[tok], w1_EHF2[e], w2_EFH[e])
        out[tok] += (probs_TE[tok, e].unsqueeze(-1) * y).float()
    return out.to(x_TH.dtype)


def aux_loss_reference(logits_TE, topk, coeff, score_function="softmax"):
    """Megatron's switch load-balancing loss from the dense routing map of the aux scores."""
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
    )

    map_TE, scores_TE = compute_routing_scores_for_aux_loss(logits_TE, topk, score_function)
    T, E = logits_TE.shape
    return switch_load_balancing_loss_func(
        scores_TE, map_TE.sum(0), T, topk, E, coeff
    )
