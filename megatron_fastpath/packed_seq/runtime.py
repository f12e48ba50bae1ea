"""One packed microbatch through a model: the forward every entry point uses (the main job's
CPU and GPU steps, the held-out evaluator, the NeMo and Megatron-Bridge forward steps).

What the model reads comes from the cache slot's :class:`~megatron_fastpath.packed_seq.params.PackedBatch`:
the static ``PackedSeqParams``, the position ids and Megatron's MoE ``padding_mask`` (True on
the padding tail, so padding tokens take no expert capacity and stay out of the aux loss).
Only the token ids and labels come from the caller, already on the device (None on the
pipeline stages that do not read them).

With ``linear_cross_entropy`` the last stage's loss is the chunked, vocab-parallel linear
cross-entropy (:func:`megatron_fastpath.loss.linear_cross_entropy`) on the decoder's hidden
states and the output weight, run in place of Megatron's output layer and
``compute_language_model_loss`` through ``GPTModel.forward``'s output processor
(:mod:`megatron_fastpath.compat.gpt_output`): no [T, V / TP] logits are formed. The held-out
evaluation's :func:`forward_eval` goes through the same processor slot, chunked the same way.

Shape key: T = tokens of a packed microbatch (its batch dimension is 1), V = vocabulary (V / TP
per tensor-parallel rank), H = hidden size.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["cp_local", "forward", "forward_eval", "masked_loss_sum", "vocab_parallel_argmax"]


def cp_local(pb, x_1T: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This context-parallel rank's tokens of a packed [1, T] tensor (token ids, labels, loss
    mask): [1, T / CP] gathered through the cache's ``cp_token_index_T`` on the device (no host
    read), with 0 for a sequence's 2 x CP padding and the tail (no label, no loss). ``x_1T``
    itself without CP (and None stays None: the pipeline stages that do not read it)."""
    index_T = pb.packed_seq_params.cp_token_index_T
    if index_T is None or x_1T is None:
        return x_1T
    x_ext = torch.cat([x_1T, x_1T.new_zeros((1, 1))], dim=1)  # the pad row at index T
    return x_ext.index_select(1, index_T)


def forward(model, pb, tokens_1T: Optional[torch.Tensor], labels_1T: Optional[torch.Tensor] = None,
            *, linear_cross_entropy: Optional[bool] = False):
    """``model`` (Megatron's ``GPTModel``, or a wrapper passing keyword arguments through to
    it: DDP, ``Float16Module``) on packed batch ``pb``: per-token losses [1, T] on the last
    pipeline stage when ``labels_1T`` is given (the logits [1, T, V / TP] when it is None),
    hidden states on the other stages. ``linear_cross_entropy``: the losses from the chunked
    linear cross-entropy, never forming the logits (False: Megatron's output layer and loss;
    None: chosen by ``rules.default_linear_cross_entropy`` on this rank's logits size)."""
    if labels_1T is not None and _chunked(model, labels_1T, linear_cross_entropy):
        from megatron_fastpath.compat.gpt_output import forward_with_output_processor

        return forward_with_output_processor(
            model, _linear_cross_entropy_output, tokens_1T, pb.position_ids_1T, None,
            labels=labels_1T, packed_seq_params=pb.packed_seq_params, padding_mask=pb.padding_mask_1T)
    return model(
        tokens_1T,
        pb.position_ids_1T,
        None,  # attention mask: the packed params carry the boundaries
        labels=labels_1T,
        packed_seq_params=pb.packed_seq_params,
        padding_mask=pb.padding_mask_1T,  # MoE routing skips padding (Megatron: True = padding)
    )


def _chunked(model, labels_1T: torch.Tensor, choice: Optional[bool]) -> bool:
    if choice is not None:
        return bool(choice)
    from megatron_fastpath.compat.gpt_output import unwrap_gpt_model
    from megatron_fastpath.rules import default_linear_cross_entropy

    gpt = unwrap_gpt_model(model)
    if not gpt.post_process:  # a pipeline stage before the last: no output layer, no loss here
        return False
    weight = (gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
              else gpt.output_layer.weight)
    return default_linear_cross_entropy(labels_1T.numel(), weight.shape[0]) == "chunked"


def _checked_output(output_layer, config) -> None:
    # What runs between 0.19.x's output layer and its loss besides the GEMM: MuP's logit scaling
    # (_scale_logits, language_module.py:320-337); the rules refuse it before any device work.
    if getattr(config, "use_mup", False):
        raise ValueError("fastpath.linear_cross_entropy=chunked with MuP (use_mup): the logits are "
                         "scaled before the loss; use linear_cross_entropy=off")


def _linear_cross_entropy_output(*, hidden_states, output_layer, output_weight, labels, config, **_):
    """The output processor of :func:`forward`: per-token losses [1, T] (float32)."""
    from megatron_fastpath.compat.gpt_output import output_weight_for_call
    from megatron_fastpath.loss.linear_cross_entropy import linear_cross_entropy

    _checked_output(output_layer, config)
    weight_VH = output_weight_for_call(output_layer, output_weight, hidden_states)
    return linear_cross_entropy(hidden_states, weight_VH, labels, tp_group=output_layer.tp_group,
                                sequence_parallel=output_layer.sequence_parallel)


def _eval_output(*, hidden_states, output_layer, output_weight, labels, config,
                 compute_language_model_loss, **_):
    """The output processor of :func:`forward_eval`: per chunk of tokens its logits, Megatron's
    loss of them and their vocab-parallel argmax; the chunks' size is the linear
    cross-entropy's (``chunk_rows``), so one chunk's logits are held at a time."""
    from megatron_fastpath.compat.gpt_output import output_weight_for_call
    from megatron_fastpath.loss.linear_cross_entropy import chunk_rows

    _checked_output(output_layer, config)
    h_TBH = hidden_states
    if output_layer.sequence_parallel:  # the whole sequence, as the output layer gathers it
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        h_TBH = gather_from_sequence_parallel_region(h_TBH, group=output_layer.tp_group)
    weight_VH = output_weight_for_call(output_layer, output_weight, hidden_states)
    T = h_TBH.shape[0]
    rows = chunk_rows(T, weight_VH.shape[0])
    losses, preds = [], []
    for start in range(0, T, rows):
        logits_CBV = torch.nn.functional.linear(h_TBH[start:start + rows], weight_VH)
        losses.append(compute_language_model_loss(labels[:, start:start + rows], logits_CBV))
        preds.append(vocab_parallel_argmax(logits_CBV.transpose(0, 1), output_layer.tp_group))
    return torch.cat(losses, dim=1), torch.cat(preds, dim=1)


@torch.no_grad()
def forward_eval(model, pb, tokens_1T: torch.Tensor, labels_1T: torch.Tensor) -> tuple:
    """(per-token losses [1, T], greedy predictions [1, T]) of ``model`` on ``pb`` without
    gradients and without the [T, V / TP] logits: the output layer, Megatron's loss and the
    vocab-parallel argmax chunk by chunk (one pipeline stage holds the whole model)."""
    from megatron_fastpath.compat.gpt_output import forward_with_output_processor

    return forward_with_output_processor(
        model, _eval_output, tokens_1T, pb.position_ids_1T, None,
        labels=labels_1T, packed_seq_params=pb.packed_seq_params, padding_mask=pb.padding_mask_1T)


def vocab_parallel_argmax(logits_1TV: torch.Tensor, group=None) -> torch.Tensor:
    """Global argmax over a vocabulary split across the tensor-parallel group (``group``, else
    Megatron's; each rank holds V / TP consecutive ids); ties go to the lowest id, as
    ``torch.argmax``."""
    from megatron.core import parallel_state as ps

    best_1T, idx_1T = logits_1TV.float().max(-1)
    if group is None:
        if not ps.model_parallel_is_initialized():
            return idx_1T
        group = ps.get_tensor_model_parallel_group()
    tp = torch.distributed.get_world_size(group)
    if tp == 1:
        return idx_1T
    idx_1T = idx_1T + torch.distributed.get_rank(group) * logits_1TV.shape[-1]
    bests, idxs = [torch.empty_like(best_1T) for _ in range(tp)], [torch.empty_like(idx_1T) for _ in range(tp)]
    torch.distributed.all_gather(bests, best_1T, group=group)
    torch.distributed.all_gather(idxs, idx_1T, group=group)
    winner_1T = torch.stack(bests).argmax(0, keepdim=True)  # first rank holding the max
    return torch.stack(idxs).gather(0, winner_1T)[0]


def masked_loss_sum(per_token_1T: torch.Tensor, loss_mask_1T: torch.Tensor) -> torch.Tensor:
    """Sum of per-token losses over a loss mask on the same device (response tokens)."""
    return (per_token_1T.float() * loss_mask_1T).sum()
