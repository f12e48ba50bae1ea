"""The output layer and the vocab-parallel cross-entropy fused, chunked over tokens.

``linear_cross_entropy(hidden_SBH, weight_VH, labels_BS)`` returns what GPTModel returns from
``output_layer(hidden)`` followed by ``compute_language_model_loss(labels, logits)`` (megatron/core
models/common/language_module/language_module.py: 0.16.1 line 128, 0.19.2 line 155): the float32
per-token loss ``[B, S]`` of ``tensor_parallel.vocab_parallel_cross_entropy`` on the logits
``hidden @ weight.T``, without ever holding the ``[T, V/TP]`` logits (T = S * B tokens): the tokens
go through in chunks of ``chunk_tokens`` rows, and only one chunk's logits ``[C, V/TP]`` exist at
a time.

Per chunk the forward computes the logits in the hidden's dtype (what the output layer's GEMM
writes), upcasts them to float32 and reduces max, sum-exp and the target logit over the TP group
the way ``megatron/core/tensor_parallel/cross_entropy.py`` does (``calculate_logits_max``,
``calculate_predicted_logits``, ``calculate_cross_entropy_loss``; its label smoothing with the
rank's partition size as ``K``, as Megatron writes it). It keeps for backward the hidden
states, the labels and the per-token log-sum-exp: O(T) + O(T * H), nothing of size T * V.

The backward recomputes each chunk's logits and forms Megatron's gradient (softmax minus the
smoothed one-hot, times the per-token ``grad_output``: any tensor, a loss mask times a scale in
the train step), then the chunk's hidden gradient ``grad_logits @ W`` and weight gradient
``grad_logits.T @ h``. When the weight takes no gradient (LoRA freezes the output layer) the
forward forms each chunk's ``(softmax - one_hot) @ W`` instead and keeps that ``[T, H]`` float32
tensor: the backward is then one multiply by ``grad_output`` and no GEMM at all.

Static shapes only: the chunk count and sizes come from the tensors' shapes, no tensor value is
read on the host, so the function is CUDA-graph capturable and sync-free. Tensor parallelism
as the output layer's ``ColumnParallelLinear``: the hidden's gradient all-reduced over the TP
group (Megatron's ``copy_to_tensor_model_parallel_region``), or with ``sequence_parallel`` the
rank's ``[S/TP, B, H]`` shard all-gathered in forward and its gradient reduce-scattered
(``gather_from_sequence_parallel_region``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_CHUNK_BYTES", "chunk_rows", "linear_cross_entropy"]

# one chunk's float32 logits [C, V/TP] take at most this many bytes (the chunk size rule)
DEFAULT_CHUNK_BYTES = 256 * 2**20


def chunk_rows(num_tokens: int, vocab_per_rank: int, chunk_tokens: Optional[int] = None) -> int:
    """Rows per chunk: ``chunk_tokens`` if given, else the most whose float32 logits fit
    ``DEFAULT_CHUNK_BYTES`` (at least 1); never more than ``num_tokens``. From shapes only."""
    if chunk_tokens is None:
        chunk_tokens = max(1, DEFAULT_CHUNK_BYTES // (4 * max(1, vocab_per_rank)))
    if chunk_tokens < 1:
        raise ValueError(f"error: chunk_tokens={chunk_tokens} must be >= 1 (the rows of one chunk)")
    return max(1, min(int(chunk_tokens), num_tokens))


def _tp_group(tp_group):
    """The group the vocabulary is split over: ``tp_group``, else Megatron's tensor-parallel group
    when its parallel state is initialised (as ``vocab_parallel_cross_entropy`` defaults), else
    None (one rank holds the whole vocabulary)."""
    if tp_group is not None or not (dist.is_available() and dist.is_initialized()):
        return tp_group
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None


def _chunk_stats(h_c, weight, target_c, vocab_start, group, smoothing_sum: bool):
    """One chunk's forward: float32 logits, their TP-global max, the target logit and the
    sum-exp (Megatron's order: max reduced first, the shifted exp summed, target and sum-exp
    reduced); returns (shifted logits exp'ed in place, max, sum_exp, predicted, sum of shifted
    logits or None, target_local, valid)."""
    logits = torch.nn.functional.linear(h_c, weight).float()
    logits_max = logits.max(dim=-1)[0]
    if group is not None:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    logits.sub_(logits_max.unsqueeze(-1))
    vocab = logits.size(-1)
    valid = (target_c >= vocab_start) & (target_c < vocab_start + vocab)
    target_local = torch.where(valid, target_c - vocab_start, torch.zeros_like(target_c))
    predicted = logits.gather(1, target_local.unsqueeze(-1)).squeeze(-1) * valid
    shifted_sum = logits.sum(dim=-1) if smoothing_sum else None
    torch.exp(logits, out=logits)
    sum_exp = logits.sum(dim=-1)
    if group is not None:
        both = torch.stack([predicted, sum_exp])
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        predicted, sum_exp = both[0], both[1]
    return logits, logits_max, sum_exp, predicted, shifted_sum, target_local, valid


def _grad_logits_(probs, target_local, valid, smoothing: float, vocab: int):
    """Megatron's backward on one chunk's softmax, in place: minus ``(1 - smoothing)`` at the
    target (where this rank holds it), minus ``smoothing / K`` everywhere."""
    probs.scatter_add_(1, target_local.unsqueeze(-1), (-(1.0 - smoothing) * valid.float()).unsqueeze(-1))
    if smoothing > 0:
        probs.sub_(smoothing / vocab)
    return probs


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TH, weight, target_T, label_smoothing, chunk, group, need_grad):
        T = hidden_TH.size(0)
        vocab = weight.size(0)
        rank = dist.get_rank(group) if group is not None else 0
        vocab_start = rank * vocab
        smoothing = label_smoothing * vocab / (vocab - 1) if label_smoothing > 0 else 0.0
        need_h, need_w = need_grad
        grad_h_in_forward = need_h and not need_w
        loss = torch.empty(T, dtype=torch.float32, device=hidden_TH.device)
        lse = torch.empty(T, dtype=torch.float32, device=hidden_TH.device) if need_w else None
        d_TH = torch.empty(T, hidden_TH.size(1), dtype=torch.float32, device=hidden_TH.device) \
            if grad_h_in_forward else None
        for start in range(0, T, chunk):
            end = min(start + chunk, T)
            probs, lmax, sum_exp, predicted, shifted_sum, target_local, valid = _chunk_stats(
                hidden_TH[start:end], weight, target_T[start:end], vocab_start, group, smoothing > 0)
            log_sum = torch.log(sum_exp)
            loss_c = log_sum - predicted
            if smoothing > 0:  # mean of log(softmax) over this rank's partition, as Megatron's
                mean_log_probs = shifted_sum / vocab - log_sum
                loss_c = (1.0 - smoothing) * loss_c - smoothing * mean_log_probs
            loss[start:end] = loss_c
            if lse is not None:
                lse[start:end] = lmax + log_sum
            if d_TH is not None:
                probs.div_(sum_exp.unsqueeze(-1))
                _grad_logits_(probs, target_local, valid, smoothing, vocab)
                d_TH[start:end] = torch.mm(probs.to(weight.dtype), weight)
            del probs
        ctx.chunk, ctx.group, ctx.smoothing, ctx.vocab_start = chunk, group, smoothing, vocab_start
        ctx.need = (need_h, need_w)
        if need_w:
            ctx.save_for_backward(hidden_TH, weight, target_T, lse)
        elif d_TH is not None:
            ctx.save_for_backward(d_TH)
        ctx.hidden_dtype = hidden_TH.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_T):
        need_h, need_w = ctx.need
        if not (need_h or need_w):
            return None, None, None, None, None, None, None
        grad_T = grad_T.float()
        if not need_w:
            (d_TH,) = ctx.saved_tensors
            grad_h = (d_TH * grad_T.unsqueeze(-1)).to(ctx.hidden_dtype)
            return grad_h, None, None, None, None, None, None
        hidden_TH, weight, target_T, lse = ctx.saved_tensors
        T, chunk, vocab = hidden_TH.size(0), ctx.chunk, weight.size(0)
        grad_h = torch.empty_like(hidden_TH) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, T, chunk):
            end = min(start + chunk, T)
            h_c, target_c = hidden_TH[start:end], target_T[start:end]
            probs = torch.nn.functional.linear(h_c, weight).float()
            probs.sub_(lse[start:end].unsqueeze(-1)).exp_()
            valid = (target_c >= ctx.vocab_start) & (target_c < ctx.vocab_start + vocab)
            target_local = torch.where(valid, target_c - ctx.vocab_start, torch.zeros_like(target_c))
            _grad_logits_(probs, target_local, valid, ctx.smoothing, vocab)
            probs.mul_(grad_T[start:end].unsqueeze(-1))
            g = probs.to(weight.dtype)
            del probs
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[start:end])
            if g.dtype == torch.float32:
                grad_w.addmm_(g.t(), h_c)
            else:
                grad_w.add_(torch.mm(g.t(), h_c))
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def linear_cross_entropy(hidden_SBH: torch.Tensor, weight_VH: torch.Tensor, labels_BS: torch.Tensor, *,
                         tp_group=None, sequence_parallel: bool = False, label_smoothing: float = 0.0,
                         chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """Float32 per-token loss ``[B, S]``: GPTModel's ``compute_language_model_loss(labels,
    output_layer(hidden))`` without the ``[T, V/TP]`` logits.

    ``hidden_SBH``: the decoder's output ``[S, B, H]`` (with ``sequence_parallel`` this rank's
    ``[S/TP, B, H]`` shard); ``weight_VH``: this rank's vocabulary shard ``[V/TP, H]`` of
    ``output_layer.weight`` (the embedding's weight when tied); ``labels_BS``: ``[B, S]`` token ids
    (an id outside ``[0, V)`` scores 0 as its target logit, as in Megatron). ``tp_group``: the
    group the vocabulary is split over (default: Megatron's tensor-parallel group when
    initialised); ``label_smoothing`` in ``[0, 1)`` as ``vocab_parallel_cross_entropy`` takes it;
    ``chunk_tokens``: rows per chunk (default: the most whose float32 logits fit
    ``DEFAULT_CHUNK_BYTES``)."""
    if hidden_SBH.dim() != 3 or weight_VH.dim() != 2 or labels_BS.dim() != 2:
        raise ValueError(f"error: linear_cross_entropy takes hidden [S, B, H], weight [V/TP, H] and labels "
                         f"[B, S]; got {tuple(hidden_SBH.shape)}, {tuple(weight_VH.shape)}, "
                         f"{tuple(labels_BS.shape)}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"error: label_smoothing={label_smoothing} must be in [0, 1), as Megatron's "
                         "vocab_parallel_cross_entropy takes it")
    group = _tp_group(tp_group)
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    if sequence_parallel and group is None:
        raise ValueError("error: sequence_parallel=True needs a tensor-parallel group of 2 or more ranks "
                         "(the hidden is this rank's sequence shard); pass tp_group or drop sequence_parallel")
    if group is not None:
        from megatron.core import tensor_parallel

        if sequence_parallel:
            hidden_SBH = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_SBH, tensor_parallel_output_grad=True, group=group)
        else:
            hidden_SBH = tensor_parallel.copy_to_tensor_model_parallel_region(hidden_SBH, group=group)
    S, B, H = hidden_SBH.shape
    if labels_BS.shape != (B, S) or weight_VH.size(1) != H:
        raise ValueError(f"error: linear_cross_entropy: labels {tuple(labels_BS.shape)} must be [B, S] = "
                         f"{(B, S)} and weight {tuple(weight_VH.shape)} [V/TP, {H}] for hidden "
                         f"{tuple(hidden_SBH.shape)} (gathered over TP with sequence_parallel)")
    grad_on = torch.is_grad_enabled()
    need = (grad_on and hidden_SBH.requires_grad, grad_on and weight_VH.requires_grad)
    chunk = chunk_rows(S * B, weight_VH.size(0), chunk_tokens)
    target_T = labels_BS.transpose(0, 1).reshape(S * B)  # [b s] => [s b], Megatron's token order
    loss_T = _LinearCrossEntropy.apply(hidden_SBH.reshape(S * B, H), weight_VH, target_T,
                                       float(label_smoothing), chunk, group, need)
    return loss_T.view(S, B).transpose(0, 1).contiguous()  # [s b] => [b s]
