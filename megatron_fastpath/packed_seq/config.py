"""The cache's static capacities (:class:`PackedSeqConfig`) and the rules sized from them: how
many tokens the ``sdpa`` backend's mask serves (:func:`sdpa_max_tokens`) and the static
``max_seqlen`` of a dataset (:func:`seqlen_bound`).

Shape letters: T = ``max_tokens``, S = ``max_seqs``, M = ``max_seqlen`` (the bound).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_fastpath.packed_seq.rope import RopeConfig

__all__ = [
    "DEFAULT_SDPA_MASK_MAX_TOKENS",
    "PADDED_VIEW_MIN_SAVING",
    "PackedSeqConfig",
    "SDPA_LAYOUTS",
    "SEQLEN_BUCKET",
    "sdpa_max_tokens",
    "seqlen_bound",
]

# The SDPA mask costs T^2 x (2 or 4) bytes per slot; above this many tokens it is refused (the
# sdpa backend then attends through the padded view, which has no mask: sdpa_max_tokens).
DEFAULT_SDPA_MASK_MAX_TOKENS = 16384
SDPA_LAYOUTS = ("auto", "mask", "padded")
# sdpa_layout=auto takes the padded view when it computes this many times fewer scores than the
# [T, T] mask: its gathers and scatter cost more than the saved scores below that. Measured on
# CPU: one layer fwd+bwd (benchmarks/results/attention_layout.json) 2.7x fewer scores (T 512,
# 6 sequences) -> the mask 1.9x faster, 21x fewer (T 4096, 48) -> the padded view 7.9x faster;
# a whole training step (benchmarks/results/end_to_end*.json, long-tail lengths): 1.0x and 1.14x
# fewer (T 512 / 2048) -> the mask faster (48.5 vs 60.8 ms, 256 vs 343 ms); 3.5x and 3.8x fewer
# (T 8192 / 16384) -> the padded view, ahead of every peer by 1.6x / 2.2x. 3 separates them.
PADDED_VIEW_MIN_SAVING = 3
SEQLEN_BUCKET = 64  # a data-derived max_seqlen is the longest sequence rounded up to this


def sdpa_max_tokens(sdpa_layout: str = "auto", mask_max_tokens: int = DEFAULT_SDPA_MASK_MAX_TOKENS,
                    context_parallel_size: int = 1) -> Optional[int]:
    """The most packed tokens the ``sdpa`` backend serves in ``sdpa_layout``; None = no limit.

    The one home of the rule (``resolve_backend``'s ``auto`` reads it through the parse, the
    layer spec and the attention): only the [T, T] mask has a size limit. It binds when the
    backend must attend through the mask -- ``sdpa_layout="mask"``, or any layout with context
    parallelism (the padded view is not built for CP). ``"padded"`` has no mask, and ``"auto"``
    takes the padded view whenever the mask would be over its limit
    (:attr:`PackedSeqConfig.sdpa_padded`), so neither has a limit."""
    if sdpa_layout == "mask" or context_parallel_size > 1:
        return mask_max_tokens
    return None


def seqlen_bound(longest: int, max_tokens: int) -> int:
    """The static ``max_seqlen`` for data whose longest sequence is ``longest`` tokens: rounded
    up to a multiple of :data:`SEQLEN_BUCKET`, at most ``max_tokens``. It sizes the sdpa
    backend's padded view (rows of this many tokens) and is the ``max_seqlen`` flash / TE get
    (their grids scale with it) instead of T."""
    if longest < 1:
        raise ValueError(f"the longest sequence must be >= 1 token; got {longest}")
    return min(max_tokens, -(-longest // SEQLEN_BUCKET) * SEQLEN_BUCKET)


@dataclasses.dataclass(frozen=True)
class PackedSeqConfig:
    """Static capacities of the cache.

    max_tokens: T, tokens per packed microbatch (the token dimension the model sees).
    max_seqs: S, sequences per packed microbatch.
    max_seqlen: constant bound reported as ``max_seqlen_q/kv`` (default T) -- constant so
        CUDA-graph argument matching holds across batches.
    num_slots: microbatches that may be in flight at once (>= pipeline stages for 1F1B). A slot
        only keeps an in-flight batch from being overwritten; which slot a microbatch gets does
        not matter to attention (it reads the params it is given; a CUDA-graph replay copies
        them into the graph's inputs).
    rope: rotary settings; None disables the RoPE structures.
    rope_local: a second RoPE of the layers that rotate with another base (Gemma 3's sliding
        layers: ``rope_local_base_freq``), the ``rope_cos_sin_local`` kind; None: none.
    sdpa_mask_max_tokens: refuse to build a T x T SDPA mask above this T.
    sdpa_layout: how the ``sdpa`` backend attends: "mask" (the packed [T] tokens against each
        other under one [T, T] additive mask: T^2 scores), "padded" (the packed-to-padded view,
        ``max_seqs`` rows of ``max_seqlen`` tokens, plain causal attention per row: S x M^2
        scores, no mask) or "auto" (:attr:`sdpa_padded`: the padded view when it computes at
        least :data:`PADDED_VIEW_MIN_SAVING` times fewer scores, 3 S M^2 < T^2 -- many short
        sequences -- or when T is above ``sdpa_mask_max_tokens``, where no mask is built; the
        mask when a few long ones fill T).
    context_parallel_size / context_parallel_rank: CP and this rank's place in its group; with
        CP > 1 every token field of a slot holds this rank's T / CP tokens
        (:mod:`megatron_fastpath.packed_seq.context_parallel`).
    num_adapters: K, the LoRA adapters a batch's sequences train (each batch then gives each
        sequence's adapter: ``set_batch(lengths, adapters=[...])``; the per-token adapter and its
        sort ride in the record: :mod:`megatron_fastpath.packed_seq.adapters`); None: none.
    """

    max_tokens: int
    max_seqs: int
    max_seqlen: Optional[int] = None
    num_slots: int = 1
    rope: Optional[RopeConfig] = None
    rope_local: Optional[RopeConfig] = None
    sdpa_mask_max_tokens: int = DEFAULT_SDPA_MASK_MAX_TOKENS
    sdpa_layout: str = "auto"
    context_parallel_size: int = 1
    context_parallel_rank: int = 0
    num_adapters: Optional[int] = None

    def __post_init__(self):
        from megatron_fastpath.settings import check_positive_ints

        check_positive_ints("PackedSeqConfig", self, ("max_tokens", "max_seqs", "num_slots"))
        if self.max_seqs > self.max_tokens:
            raise ValueError(
                f"max_seqs={self.max_seqs} > max_tokens={self.max_tokens}: every sequence has "
                "at least one token"
            )
        if self.max_seqlen is not None and not (0 < self.max_seqlen <= self.max_tokens):
            raise ValueError(
                f"max_seqlen must be in [1, max_tokens={self.max_tokens}]; got {self.max_seqlen}"
            )
        k = self.num_adapters
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"num_adapters must be an int >= 1 (or None: no adapters); got {k!r}")
        if k is not None and self.context_parallel_size > 1:
            raise ValueError(
                f"num_adapters={k} with context_parallel_size={self.context_parallel_size}: the "
                "adapter indices are built for the packed layout, not the CP one; use CP 1")
        if self.sdpa_layout not in SDPA_LAYOUTS:
            raise ValueError(f"sdpa_layout must be one of {SDPA_LAYOUTS}; got {self.sdpa_layout!r}")
        cp = self.context_parallel_size
        if not isinstance(cp, int) or cp < 1 or not 0 <= self.context_parallel_rank < cp:
            raise ValueError(
                f"context_parallel_size={cp!r} / context_parallel_rank={self.context_parallel_rank!r}:"
                " the size must be an int >= 1 and the rank in [0, size)")
        if cp > 1:
            q = 2 * cp
            if self.max_tokens % q or self.max_seqlen_bound % q:
                raise ValueError(
                    f"context parallelism {cp} splits every packed piece into 2 x CP = {q} chunks:"
                    f" max_tokens={self.max_tokens} and max_seqlen={self.max_seqlen_bound} must be"
                    f" multiples of {q}; round them up to a multiple of {q}")
            if self.sdpa_layout == "padded":
                raise ValueError(
                    "sdpa_layout='padded' with context_parallel_size > 1: the padded view is not "
                    "built for the CP layout (its queries attend all-gathered keys through the "
                    "mask); use sdpa_layout='mask' or 'auto'")

    @property
    def max_seqlen_bound(self) -> int:
        return self.max_seqlen if self.max_seqlen is not None else self.max_tokens

    @property
    def local_tokens(self) -> int:
        """T_l: tokens of a packed microbatch on this CP rank (T without CP)."""
        return self.max_tokens // self.context_parallel_size

    @property
    def sdpa_padded(self) -> bool:
        """The ``sdpa`` backend uses the packed-to-padded view (see ``sdpa_layout``; never with
        context parallelism, whose queries attend the all-gathered keys through the mask)."""
        if self.context_parallel_size > 1:
            return False
        if self.sdpa_layout != "auto":
            return self.sdpa_layout == "padded"
        if self.max_tokens > self.sdpa_mask_max_tokens:  # the mask would be refused: sdpa_max_tokens
            return True
        return PADDED_VIEW_MIN_SAVING * self.max_seqs * self.max_seqlen_bound ** 2 < self.max_tokens ** 2

    @property
    def sdpa_max_tokens(self) -> Optional[int]:
        """:func:`sdpa_max_tokens` of this config (None: the sdpa backend has no token limit)."""
        return sdpa_max_tokens(self.sdpa_layout, self.sdpa_mask_max_tokens, self.context_parallel_size)
