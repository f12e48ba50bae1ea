"""Held-out evaluation of the main job (any data provider with held-out bins).

Shape key: T = tokens of a packed microbatch, V = vocabulary (V / TP per tensor-parallel rank).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from megatron_fastpath.packed_seq.runtime import vocab_parallel_argmax

__all__ = ["Evaluator", "EvalResult", "EvalSample", "perplexity", "greedy_complete"]


def perplexity(loss: float) -> float:
    """exp(loss), capped below a double's overflow (exp overflows above ~709)."""
    return math.exp(min(loss, 700.0))


@dataclasses.dataclass(frozen=True)
class EvalSample:
    """One held-out prompt and the model's greedy completion (``data.eval_samples``).

    index: the sample's number (the order of the held-out records). prompt / completion /
    reference: decoded text (the prompt with its special tokens, the completion and the
    record's own reply without). stop: why the completion ended -- eos (a stop token, kept in
    ``completion_ids``), max_new_tokens, or max_tokens (the packed cache holds no longer
    sequence)."""

    index: int
    prompt: str
    completion: str
    reference: str
    prompt_ids: tuple
    completion_ids: tuple
    stop: str


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Token-weighted held-out loss, its perplexity, and the share of loss tokens whose
    greedy (argmax) prediction is the label (None when the model gives no logits); ``samples``:
    the greedy completions of held-out prompts (on data-parallel rank 0; empty elsewhere)."""

    loss: float
    token_accuracy: Optional[float] = None
    samples: tuple = ()

    @property
    def perplexity(self) -> float:
        return perplexity(self.loss)


def _context_parallel_gather(pred_1T: torch.Tensor, pb, max_tokens: int) -> torch.Tensor:
    """[T] predictions of the whole packed batch from each context-parallel rank's [1, T / CP]
    share (its tokens' places in the batch: ``cp_token_index_T``; T for padding); the local
    predictions without CP."""
    from megatron.core import parallel_state as ps

    index_T = pb.packed_seq_params.cp_token_index_T
    if index_T is None:
        return pred_1T[0]
    full = torch.zeros(max_tokens + 1, dtype=pred_1T.dtype, device=pred_1T.device)
    full.index_copy_(0, index_T, pred_1T[0])  # distinct places; the padding rows land at T
    full[max_tokens] = 0
    torch.distributed.all_reduce(full, group=ps.get_context_parallel_group())
    return full[:max_tokens]


@torch.no_grad()
def greedy_complete(model, cache, prompt_ids, stop_ids, max_new_tokens: int, device) -> tuple:
    """(completion ids, why it stopped) of greedy decoding from ``prompt_ids``: one full forward
    of the packed runtime per new token (one sequence in the packed batch, no KV cache), the
    next token the argmax of the last position's logits (over the whole vocabulary under TP);
    it stops after a token of ``stop_ids`` ("eos"), after ``max_new_tokens`` tokens, or when
    the sequence fills the cache's longest sequence ("max_tokens"). Every rank of the tensor-
    and context-parallel group runs it with the same prompt (their forwards communicate)."""
    from megatron_fastpath.data import PackedMicrobatch
    from megatron_fastpath.packed_seq.runtime import cp_local, forward

    import numpy as np

    T = cache.config.max_tokens
    limit = min(T, cache.config.max_seqlen_bound)
    seq, out = list(prompt_ids), []
    while True:
        if len(out) >= max_new_tokens:
            return tuple(out), "max_new_tokens"
        if len(seq) >= limit:
            return tuple(out), "max_tokens"
        n = len(seq)
        tokens = torch.zeros(1, T, dtype=torch.long)
        tokens[0, :n] = torch.tensor(seq, dtype=torch.long)
        mb = PackedMicrobatch(tokens, torch.zeros_like(tokens), torch.zeros(1, T),
                              np.asarray([n], dtype=np.int64), 0)
        with cache.batch(mb.lengths) as pb:
            tokens_1T = cp_local(pb, tokens.to(device))
            logits_1TV = forward(model, pb, tokens_1T)
            pred_T = _context_parallel_gather(vocab_parallel_argmax(logits_1TV), pb, T)
            nxt = int(pred_T[n - 1])  # the host read of one id per token (between steps)
        seq.append(nxt)
        out.append(nxt)
        if nxt in stop_ids:
            return tuple(out), "eos"


class Evaluator:
    """Held-out loss, perplexity and token accuracy: sums over all ranks' bins of masked
    per-token losses and of correct greedy predictions, over the loss tokens (token-weighted,
    the same packing and cache as training; no gradients). The loss is Megatron's own
    ``compute_language_model_loss`` of the logits, as in training; with
    ``linear_cross_entropy`` (``fastpath.linear_cross_entropy=chunked``) the packed runtime's
    :func:`~megatron_fastpath.packed_seq.runtime.forward_eval` forms the logits a chunk of
    tokens at a time for the same loss and predictions. Reads the result to the host: run
    between steps, never inside one."""

    def __init__(self, model, cache, bins: tuple, device, prompts=None, linear_cross_entropy: bool = False):
        from megatron_fastpath.packed_seq.staging import PinnedStaging

        self.model, self.cache, self.bins, self.device = model, cache, bins, device
        self.linear_cross_entropy = linear_cross_entropy
        self.prompts = prompts  # providers.EvalPrompts (data.eval_samples); None: no samples
        self.staging = PinnedStaging(cache.config.max_tokens, device)

    @torch.no_grad()
    def __call__(self) -> EvalResult:
        from megatron.core import parallel_state as ps

        from megatron_fastpath.packed_seq.runtime import cp_local, forward, forward_eval, masked_loss_sum

        was_training = self.model.training
        self.model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss, correct, tokens
        logits = hasattr(self.model, "compute_language_model_loss")
        try:
            for mb in self.bins:
                with self.cache.batch(mb.lengths) as pb:
                    tokens_1T, labels_1T, mask_1T = (
                        cp_local(pb, x) for x in self.staging.to_device(mb))
                    if logits and self.linear_cross_entropy:  # no [T, V / TP] logits
                        per_tok_1T, pred_1T = forward_eval(self.model, pb, tokens_1T, labels_1T)
                        sums[1] += ((pred_1T == labels_1T) * mask_1T.bool()).sum().double()
                    elif logits:
                        logits_1TV = forward(self.model, pb, tokens_1T)
                        per_tok_1T = self.model.compute_language_model_loss(
                            labels_1T, logits_1TV.transpose(0, 1).contiguous())
                        hit_1T = vocab_parallel_argmax(logits_1TV) == labels_1T
                        sums[1] += (hit_1T * mask_1T.bool()).sum().double()
                    else:
                        per_tok_1T = forward(self.model, pb, tokens_1T, labels_1T)
                    sums[0] += masked_loss_sum(per_tok_1T, mask_1T).double()
                # each CP rank holds part of the microbatch; the sum over DP x CP counts it once
                sums[2] += mb.num_loss_tokens / self.cache.config.context_parallel_size
        finally:
            self.model.train(was_training)
        if (ps.model_parallel_is_initialized()
                and ps.get_data_parallel_world_size(with_context_parallel=True) > 1):
            torch.distributed.all_reduce(
                sums, group=ps.get_data_parallel_group(with_context_parallel=True))
        total, correct, tokens = sums.tolist()
        tokens = max(tokens, 1.0)
        return EvalResult(total / tokens, correct / tokens if logits else None, self.samples())

    @torch.no_grad()
    def samples(self) -> tuple:
        """:class:`EvalSample` s of the held-out prompts, completed greedily on data-parallel
        rank 0 (with its tensor- and context-parallel peers, whose forwards it needs); the other
        data-parallel ranks return () and go on to the next step. Model in eval mode, restored."""
        from megatron.core import parallel_state as ps

        if self.prompts is None or not self.prompts.prompts:
            return ()
        if ps.model_parallel_is_initialized() and ps.get_data_parallel_rank() != 0:
            return ()
        p = self.prompts
        was_training = self.model.training
        self.model.eval()
        out = []
        try:
            for i, (prompt, reference) in enumerate(p.prompts):
                ids, stop = greedy_complete(self.model, self.cache, prompt, p.stop_ids,
                                            p.max_new_tokens, self.device)
                reply = ids[:-1] if stop == "eos" else ids
                out.append(EvalSample(i, p.decode(list(prompt)), p.decode_reply(list(reply)),
                                      p.decode_reply(list(reference)), tuple(prompt), ids, stop))
        finally:
            self.model.train(was_training)
        return tuple(out)
