"""Core attention over a packed batch whose derived tensors ride in its ``packed_seq_params``.

``PackedCoreAttention`` is a Megatron ``core_attention`` submodule (same constructor and call
signature as ``DotProductAttention`` / ``TEDotProductAttention``). It takes q/k/v of a packed
microbatch and the batch's :class:`CachedPackedSeqParams`, applies RoPE from the params'
per-token cos/sin (built once per batch by the cache, shared by all layers) and runs one of the
backends over the params' static boundary metadata and masks. The backend is chosen by name
(``attention/backend.py``) and its kernel resolved once, at construction, from the table
``attention/kernels.py`` ``ATTENTION_KERNELS``:

=========  ==============================================================  =============
backend    kernel                                                          device
=========  ==============================================================  =============
``sdpa``   ``F.scaled_dot_product_attention``: one additive mask, or the   CPU default
           packed-to-padded view, no mask (``sdpa_layout``)
``flex``   ``flex_attention`` + cached ``BlockMask``                       CPU / CUDA
``flash``  ``flash_attn_varlen_func`` over the static ``cu_seqlens``       CUDA
``te``     Megatron ``TEDotProductAttention`` (THD) + TE fused RoPE        CUDA
=========  ==============================================================  =============

None of them reads a tensor value on the host, and none reads the cache: everything per batch
comes from the params (a CUDA-graph replay copies them in; a recompute in backward gets the same
object its forward got). ``packed_seq_params=None`` is refused.

Sliding windows (``sliding_window=W`` on the layers ``window_layers`` lists): key j of query i is
kept iff it is in i's sequence, j <= i and pos(i) - pos(j) < W -- transformers' mask
(``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - W`` on top of causal). sdpa reads
the cache's windowed [T, T] mask (``sdpa_mask_window``, built once per batch) or, in the padded
view, a constant banded causal [M, M] mask; flex the windowed BlockMask
(``flex_block_mask_window``); flash passes ``window_size=(W - 1, 0)`` and te hands TE
``window_size=(W - 1, 0)`` through Megatron's ``config.window_size`` (both keep the keys in
[i - window_size[0], i + window_size[1]]). TE with context parallelism refuses a window (TE's CP
ring takes none for THD). A window no sequence can exceed (W >= the cache's ``max_seqlen``)
masks nothing: such a layer runs plain causal attention.

Attention logit soft-capping (``softcap=c``, Gemma 2's ``attn_logit_softcapping``): scores =
c * tanh(q.k * scale / c) before the mask and softmax (transformers' ``eager_attention_forward``).
Torch SDPA takes no score function, so sdpa computes such a layer explicitly over the same mask
(additive [T, T], or the padded view's causal / banded [M, M]): scores, cap, mask, softmax in
float32 cast back, @ v; flex passes a ``score_mod``; flash flash-attn's ``softcap`` (>= 2.6);
te refuses it at construction (Transformer Engine 2.9-2.11's attention has no soft-capping).

A second RoPE (``local_rope_layers``: Gemma 3's sliding layers, ``rope_local_base_freq``): those
layers read the params' ``rope_local_cos_T1D`` / ``rope_local_sin_T1D`` (the cache's
``PackedSeqConfig.rope_local``, built once per batch); te refuses it (one table per batch).

Shape letters: T packed tokens, H heads (np query heads, ng key/value groups), d head dim,
D rotary dim.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule

from megatron_fastpath.attention.backend import (
    BACKENDS,
    ResolvedBackend,
    backend_of,
    check_backend,
    check_backend_dtype,
    choose_backend,
    resolve_backend,
)
from megatron_fastpath.attention.context_parallel import all_gather_cp, context_parallel_group
from megatron_fastpath.attention.kernels import attention_kernel
from megatron_fastpath.attention.rope import apply_rope_cached
from megatron_fastpath.packed_seq.params import CachedPackedSeqParams

__all__ = [
    "BACKENDS",
    "PackedCoreAttention",
    "ResolvedBackend",
    "backend_of",
    "check_backend",
    "check_backend_dtype",
    "choose_backend",
    "resolve_backend",
]

# cp_comm_type values TE 2.9-2.11 runs THD with (None: Megatron's TEDotProductAttention passes
# "p2p"): context_parallel.py refuses THD under "all_gather" (AttnFuncWithCPAndKVAllGather:
# "thd format is not supported!") and "a2a+p2p" ("... not supported with hierarchical CP
# implementation yet!"), and under "a2a" before 2.10.
_TE_THD_CP_COMM_TYPES = (None, "p2p")


def _flex_attention_fn(device: torch.device):
    """``flex_attention`` as the flex backend calls it on ``device`` (the cache's): compiled on
    CUDA (flex_attention generates a fused kernel only under torch.compile), eager elsewhere.
    The one place the backend gets it (the tests' GPU stand-ins replace this function)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention


def _te_dot_product_attention_cls():
    """Megatron's ``TEDotProductAttention`` (a seam: CPU tests put a stand-in with its exact
    signature here)."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return TEDotProductAttention


class PackedCoreAttention(MegatronModule):
    """Megatron core attention over a :class:`PackedSeqCache`.

    Built from a ModuleSpec: ``ModuleSpec(PackedCoreAttention, params={"cache": cache,
    "backend": "sdpa"})``; Megatron's ``SelfAttention`` passes the rest (config, layer_number,
    attn_mask_type, attention_type, cp_comm_type, softmax_scale, pg_collection).

    forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
            packed_seq_params=batch.packed_seq_params)
        query: [T, np, hn] (THD) or [T, 1, np, hn];
        key/value: [T, ng, hn] or [T, 1, ng, hn] (GQA: ng divides np).
        returns [T, np*hn] (THD) or [T, 1, np*hn].

    T must equal the cache's ``max_tokens`` (pad the packed batch to it: static shapes; with
    context parallelism this rank's ``local_tokens``).
    ``attention_mask`` must be None: the mask rides in ``packed_seq_params``, which is required.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        *,
        cache,
        backend: str = "sdpa",
        apply_rope: bool = True,
        sliding_window: Optional[int] = None,
        window_layers: Optional[tuple] = None,
        softcap: Optional[float] = None,
        local_rope_layers: Optional[tuple] = None,
    ):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError("PackedCoreAttention supports self-attention only")
        from megatron_fastpath import rules

        refused = rules.refusals(rules.RunFacts(
            names=rules.NAMES["megatron"], context_parallel_size=config.context_parallel_size))
        if refused:
            raise ValueError(refused[0])
        self.cache = cache
        self.backend = backend_of(  # the mask's size limit binds the mask layout only
            backend, cache.device, cache.config.max_tokens, cache.config.sdpa_max_tokens,
            dtype=config.params_dtype, context_parallel_size=cache.config.context_parallel_size,
        )
        self.sdpa_padded = self.backend == "sdpa" and cache.config.sdpa_padded
        self.cp_group = None  # sdpa's all-gather group; te hands CP to TE (below)
        if cache.config.context_parallel_size > 1:
            if self.backend not in rules.CP_ATTENTION_BACKENDS:
                raise ValueError(rules.refusals(rules.RunFacts(
                    names=rules.NAMES["main"], context_parallel_size=cache.config.context_parallel_size,
                    attention_backend=self.backend))[0])
            if self.backend == "sdpa":
                self.cp_group = context_parallel_group(pg_collection)
            elif cp_comm_type not in _TE_THD_CP_COMM_TYPES:
                raise ValueError(
                    f"cp_comm_type={cp_comm_type!r} with the 'te' backend: Transformer Engine "
                    "2.9-2.11 runs packed (THD) sequences with context parallelism over 'p2p' "
                    "only ('all_gather' and 'a2a+p2p' refuse THD; 'a2a' does from 2.10 on); "
                    "leave cp_comm_type unset (Megatron's default 'p2p')")
        self.layer_number = layer_number
        self.softcap = self._checked_softcap(softcap, self.backend)
        self.window = self._layer_window(cache, layer_number, sliding_window, window_layers)
        self.apply_rope = apply_rope and cache.config.rope is not None
        # Gemma 3: the layers local_rope_layers lists (0-based) rotate with the cache's second
        # RoPE (PackedSeqConfig.rope_local, rope_local_base_freq), the others with its rope
        self.rope_local = self.apply_rope and layer_number - 1 in (local_rope_layers or ())
        if self.rope_local and self.backend == "te":
            raise ValueError(
                f"layer {layer_number} rotates with a second RoPE base (Gemma 3's "
                "rope_local_base_freq) and the 'te' backend takes one RoPE table per batch "
                "(rope_freqs); use attention_backend=flash, sdpa or flex")
        rope_cfg = cache.config.rope_local if self.rope_local else cache.config.rope
        if self.rope_local and rope_cfg is None:
            raise ValueError(f"layer {layer_number} rotates with a second RoPE base but the cache "
                             "has none: build it with PackedSeqConfig(rope_local=...)")
        self.rope_interleaved = rope_cfg.interleaved if self.apply_rope else False
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.hidden_per_head = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.hidden_per_head)
        )
        # YaRN's attention factor m: transformers multiplies cos and sin by it, so the rotated q
        # and k each carry m (the rotation is linear) and every score q.k carries m^2; folded
        # into the softmax scale here, for every backend (TE's fused RoPE takes angles only).
        rope_scale = rope_cfg.cos_sin_scale if self.apply_rope else 1.0
        if rope_scale != 1.0:
            if rope_cfg.dim != self.hidden_per_head:
                raise ValueError(
                    f"YaRN's attention factor with partial rotary embedding (rotary dim "
                    f"{rope_cfg.dim} of {self.hidden_per_head} channels per head) is not "
                    "supported: transformers scales only the rotated channels; use rotary_percent=1")
            self.softmax_scale = self.softmax_scale * rope_scale * rope_scale
            softmax_scale = self.softmax_scale
        # What this layer reads from the params; the cache builds it into every slot's params.
        needs = {"sdpa": ["sdpa_padded" if self.sdpa_padded else "sdpa_mask"],
                 "flex": ["flex_block_mask"], "flash": [], "te": []}[self.backend]
        if self.apply_rope:
            needs.append("rope_freqs" if self.backend == "te" else
                         "rope_cos_sin_local" if self.rope_local else "rope_cos_sin")
        for kind in needs:
            cache.register(kind, dtype=config.params_dtype)
        self.band_MM = None  # the padded view's banded causal mask of a windowed layer
        if self.window is not None:
            kind = {"sdpa": None if self.sdpa_padded else "sdpa_mask_window",
                    "flex": "flex_block_mask_window"}.get(self.backend)
            if kind is not None:
                cache.register(kind, dtype=config.params_dtype, window=self.window)
            if self.sdpa_padded:  # row position i keeps keys i - W < j <= i: a constant
                m_1M = torch.arange(cache.config.max_seqlen_bound, device=cache.device).unsqueeze(0)
                back_MM = m_1M.t() - m_1M
                self.band_MM = (back_MM >= 0) & (back_MM < self.window)
        self.te_attention = None
        if self.backend == "te":
            from megatron.core.transformer.enums import AttnMaskType

            # TE reads cu_seqlens / max_seqlen from the params (cu_seqlens_*_padded are None).
            # With CP (config.context_parallel_size > 1) Megatron's TEDotProductAttention hands
            # TE the CP group of pg_collection, its global ranks, a shared CUDA stream and
            # cp_comm_type (None -> "p2p") at construction; the params then carry TE's THD + CP
            # inputs as they are: the GLOBAL cu_seqlens of the sequences padded to 2 x CP (TE
            # divides them by CP itself), the global max_seqlen bound, and this rank's tokens in
            # TE's load-balanced order (packed_seq/context_parallel.py). cu_seqlens_*_padded
            # stay None: TE takes cu_seqlens for them (FusedAttention and FlashAttention alike),
            # while given ones make DotProductAttention compare both with torch.equal, a host
            # sync whenever they are not the same tensor (a per-layer graph copies each field
            # into its own buffer). docs/configuration.md "Context parallelism".
            self.te_attention = _te_dot_product_attention_cls()(
                config=self._te_config(config),
                layer_number=layer_number,
                attn_mask_type=AttnMaskType.padding_causal,
                attention_type=attention_type,
                attention_dropout=attention_dropout,
                softmax_scale=softmax_scale,
                cp_comm_type=cp_comm_type,
                pg_collection=pg_collection,
            )
            cp = cache.config.context_parallel_size
            if cp > 1 and config.context_parallel_size != cp:
                # Megatron's constructor hands TE the CP arguments only when the
                # TransformerConfig says CP (mcore 0.16.1 extensions/transformer_engine.py
                # L1228-1252); the main job keeps CP in parallel_state and the cache, so the same
                # arguments go through TE's set_context_parallel_group, as Megatron's forward
                # sets a dynamic CP group (L1347-1353): group, global ranks, the stream shared
                # by every layer (class attribute, L1149 / L1232-1233), comm type (None -> p2p)
                te_cls = type(self.te_attention)
                if getattr(te_cls, "cp_stream", None) is None:
                    te_cls.cp_stream = torch.cuda.Stream()
                group = context_parallel_group(pg_collection)
                self.te_attention.set_context_parallel_group(
                    group, torch.distributed.get_process_group_ranks(group), te_cls.cp_stream,
                    "p2p" if cp_comm_type is None else cp_comm_type)
        self.flex_fn = _flex_attention_fn(cache.device) if self.backend == "flex" else None
        # the job's device (the cache's) decides the flex kernel's CPU refusal
        self.flex_on_cpu = cache.device.type == "cpu"
        # the backend's kernel, resolved once (kernels.ATTENTION_KERNELS)
        self._attend = attention_kernel(self.backend, self.sdpa_padded)

    @staticmethod
    def _checked_softcap(cap: Optional[float], backend: str) -> Optional[float]:
        """Attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``): scores =
        cap * tanh(scores / cap) after the softmax scale, before the mask and softmax."""
        if cap is None:
            return None
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) \
                or cap <= 0:
            raise ValueError(f"softcap must be a finite number > 0 or None; got {cap!r}")
        if backend == "te":
            raise ValueError(
                f"attention logit soft-capping (softcap={cap}) with the 'te' attention backend: "
                "Transformer Engine 2.9-2.11's DotProductAttention has no logit soft-capping; "
                "use attention_backend=flash (flash-attn's softcap), sdpa or flex")
        return float(cap)

    @staticmethod
    def _layer_window(cache, layer_number: int, window: Optional[int],
                      window_layers: Optional[tuple]) -> Optional[int]:
        """This layer's sliding window: ``window`` when ``window_layers`` (0-based global layer
        indices; None: every layer) holds it, None otherwise or when no sequence can exceed it
        (the cache's ``max_seqlen`` <= W: plain causal attention is exactly the window's)."""
        if window is None or (window_layers is not None and layer_number - 1 not in window_layers):
            return None
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"sliding_window must be an int >= 1; got {window!r}")
        return None if window >= cache.config.max_seqlen_bound else window

    def _te_config(self, config):
        """The config Megatron's ``TEDotProductAttention`` gets: with a window, a copy whose
        ``window_size`` = (W - 1, 0) (mcore 0.16.1 hands it to TE on the layers
        ``is_layer_window_attention`` marks: every one with ``window_attn_skip_freq`` None).
        TE's DotProductAttention keeps, for query i, the keys in [i + s_k - s_q -
        window_size[0], i + s_k - s_q + window_size[1]] (s_k = s_q per packed sequence), and
        (W - 1, 0) is a valid window for its causal masks (``check_set_window_size``)."""
        if self.window is None:
            return config
        if self.cache.config.context_parallel_size > 1:
            raise ValueError(
                f"sliding_window={self.window} (layer {self.layer_number}) with the 'te' backend "
                "and context parallelism: Transformer Engine 2.9-2.11 takes a sliding window under "
                "CP only with cp_comm_type 'all_gather' / 'a2a' (attn_forward_func_with_cp), "
                "which do not run packed (THD) sequences here ('p2p' only); use "
                "attention_backend=sdpa (its CP mask applies the window), or keep every sequence "
                f"within the window (max_seqlen <= {self.window})")
        te_config = copy.copy(config)
        te_config.window_size, te_config.window_attn_skip_freq = (self.window - 1, 0), None
        return te_config

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        attn_mask_type=None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError(
                "PackedCoreAttention takes its mask from the PackedSeqCache; pass "
                "attention_mask=None to the model"
            )
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by PackedCoreAttention")
        sbhd = query.dim() == 4
        if sbhd:
            if query.shape[1] != 1:
                raise ValueError(
                    f"a packed microbatch has batch size 1 (all sequences in one row); got "
                    f"query of shape {tuple(query.shape)}"
                )
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        t = query.shape[0]
        if t != self.cache.config.local_tokens:
            raise ValueError(
                f"packed input has {t} tokens but the cache's static capacity is "
                f"{self.cache.config.local_tokens} (max_tokens={self.cache.config.max_tokens} / "
                f"context_parallel_size={self.cache.config.context_parallel_size}): pad the packed "
                "batch to max_tokens (and take this CP rank's tokens, runtime.cp_local)"
            )
        params = self._checked_params(packed_seq_params)
        if self.apply_rope and self.backend != "te":
            cos_T1D, sin_T1D = ((params.rope_local_cos_T1D, params.rope_local_sin_T1D)
                                if self.rope_local else (params.rope_cos_T1D, params.rope_sin_T1D))
            if cos_T1D.dtype != query.dtype:
                raise ValueError(
                    f"the packed cache built RoPE in {cos_T1D.dtype} (TransformerConfig.params_dtype)"
                    f" but attention runs in {query.dtype}; set params_dtype to the compute dtype"
                )
            query = apply_rope_cached(query, cos_T1D, sin_T1D, self.rope_interleaved)
            key = apply_rope_cached(key, cos_T1D, sin_T1D, self.rope_interleaved)
        if self.cp_group is not None:  # sdpa (te: TE's own CP exchange, inside its call)
            # Megatron's cp_comm_type="all_gather": every rank's keys / values (RoPE applied at
            # their global positions), in rank order -- the order of the params' cp_kv_* fields.
            key, value = all_gather_cp(key, self.cp_group), all_gather_cp(value, self.cp_group)

        out_THd = self._attend(self, query, key, value, params)
        out = out_THd.reshape(t, -1)
        return out.unsqueeze(1) if sbhd else out

    def _checked_params(self, params) -> CachedPackedSeqParams:
        """The batch's params, refusing None and foreign params (host-side checks only)."""
        if params is None:
            raise ValueError(
                "PackedCoreAttention needs the batch's packed_seq_params (batch.packed_seq_params "
                "from cache.set_batch); it never falls back to a 'current' batch, which a "
                "recompute in backward or a CUDA-graph replay would read wrongly"
            )
        if not isinstance(params, CachedPackedSeqParams):
            raise ValueError(
                "packed_seq_params were not produced by a PackedSeqCache (got "
                f"{type(params).__name__}); load the batch with cache.set_batch(lengths or "
                "cu_seqlens) and pass batch.packed_seq_params"
            )
        windowed = self.window is not None
        field = {"sdpa": "pad_gather_SM" if self.sdpa_padded
                 else "sdpa_mask_window_TT" if windowed else "sdpa_mask_TT",
                 "flex": "flex_window_kv_indices" if windowed else "flex_kv_indices"}.get(self.backend)
        if field is not None and getattr(params, field) is None:
            raise ValueError(
                f"packed_seq_params carry no {field}: they come from a PackedSeqCache this "
                "model's attention did not register with; pass the params of the model's cache"
            )
        return params

    def dropout_prob(self) -> float:
        """The attention dropout probability of this call (0 outside training)."""
        return self.dropout_p if self.training else 0.0

    def dropout_rng(self):
        """Where attention dropout draws: Megatron's model-parallel RNG stream (a different mask
        per TP rank, whose heads differ), as its DotProductAttention does outside sequence
        parallelism (transformer/dot_product_attention.py) and TE's attention through its
        tracker; the default generator otherwise (and on CPU, which has no CUDA tracker)."""
        if self.dropout_prob() == 0 or self.config.sequence_parallel or not torch.cuda.is_available():
            return contextlib.nullcontext()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return get_cuda_rng_tracker().fork()
