"""Core attention over a packed batch whose derived tensors ride in its ``packed_seq_params``.

``PackedCoreAttention`` is a Megatron ``core_attention`` submodule (same constructor and call
signature as ``DotProductAttention`` / ``TEDotProductAttention``). It takes q/k/v of a packed
microbatch and the batch's :class:`CachedPackedSeqParams`, applies RoPE from the params'
per-token cos/sin (built once per batch by the cache, shared by all layers) and runs one of the
backends over the params' static boundary metadata and masks:

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

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from megatron_fastpath._optional import require
from megatron_fastpath.attention.context_parallel import all_gather_cp, context_parallel_group
from megatron_fastpath.attention.rope import apply_rope_cached
from megatron_fastpath.packed_seq.params import CachedPackedSeqParams, block_mask_from

__all__ = ["BACKENDS", "PackedCoreAttention", "ResolvedBackend", "resolve_backend"]

BACKENDS = ("sdpa", "flex", "flash", "te")

# cp_comm_type values TE 2.9-2.11 runs THD with (None: Megatron's TEDotProductAttention passes
# "p2p"): context_parallel.py refuses THD under "all_gather" (AttnFuncWithCPAndKVAllGather:
# "thd format is not supported!") and "a2a+p2p" ("... not supported with hierarchical CP
# implementation yet!"), and under "a2a" before 2.10.
_TE_THD_CP_COMM_TYPES = (None, "p2p")

_ALTERNATIVES = {
    "flash": "backend='sdpa' (CPU and GPU) or backend='flex'",
    "te": "backend='flash', 'sdpa' or 'flex'",
}


def _flex_attention_fn(device: torch.device):
    """``flex_attention`` as the flex backend calls it on ``device`` (the cache's): compiled on
    CUDA (flex_attention generates a fused kernel only under torch.compile), eager elsewhere.
    The one place the backend gets it (the tests' GPU stand-ins replace this function)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention


class ResolvedBackend(str):
    """An attention backend name as :func:`resolve_backend` returns it: checked (its package,
    the dtype) and ``auto`` resolved for the device, dtype and context-parallel size it was
    given. The layer spec and :class:`PackedCoreAttention` take one as it is -- the main job
    resolves its backend once, at parse, and carries it in ``JobConfig.attention_backend`` --
    and resolve a plain name themselves (the spec once, for all its layers)."""

    __slots__ = ()


def backend_of(backend: str, device: torch.device, max_tokens: int, sdpa_limit: Optional[int],
               dtype: Optional[torch.dtype] = None, context_parallel_size: int = 1) -> str:
    """``backend`` when it is a :class:`ResolvedBackend`, else :func:`resolve_backend` of it."""
    if isinstance(backend, ResolvedBackend):
        return backend
    return resolve_backend(backend, device, max_tokens, sdpa_limit, dtype=dtype,
                           context_parallel_size=context_parallel_size)


def resolve_backend(backend: str, device: torch.device, max_tokens: int, sdpa_limit: Optional[int],
                    dtype: Optional[torch.dtype] = None, context_parallel_size: int = 1) -> str:
    """Validate ``backend`` (raising before any device work when its package is missing, or
    when ``dtype`` is one its kernels lack) and resolve ``"auto"``: te > flash on CUDA when
    installed and the dtype is one their kernels take (bf16 / fp16), else sdpa -- flex only on
    CUDA when ``max_tokens`` is above ``sdpa_limit``: ``auto`` picks something that runs (the
    fp32 default on a GPU machine with TE installed used to stop at parse).

    ``sdpa_limit``: the most tokens the sdpa backend serves in its layout,
    :func:`megatron_fastpath.packed_seq.config.sdpa_max_tokens` (the one home of that rule):
    the [T, T] mask's limit when sdpa attends through the mask, None when its layout is or can
    be the padded view, which has no mask (then the mask's limit never pushes auto off sdpa).

    With ``context_parallel_size > 1`` ``auto`` picks only among the backends that run context
    parallelism (:data:`megatron_fastpath.rules.CP_ATTENTION_BACKENDS`): te, else sdpa -- never
    flash or flex, which the rules would refuse at CP > 1."""
    resolved = choose_backend(backend, device, max_tokens, sdpa_limit, dtype=dtype,
                              context_parallel_size=context_parallel_size)
    return check_backend(resolved, device, dtype, chosen_by_auto=backend == "auto")


def choose_backend(backend: str, device: torch.device, max_tokens: int, sdpa_limit: Optional[int],
                   dtype: Optional[torch.dtype] = None, context_parallel_size: int = 1) -> str:
    """:func:`resolve_backend`'s choice alone (``backend`` itself unless ``auto``), unchecked:
    raises only for an unknown name (the main job hands it to the rules before
    :func:`check_backend` asks for its package)."""
    if backend == "auto":
        from megatron_fastpath._optional import have
        from megatron_fastpath.rules import CP_ATTENTION_BACKENDS

        half = dtype is None or dtype in (torch.bfloat16, torch.float16)
        usable = BACKENDS if context_parallel_size <= 1 else CP_ATTENTION_BACKENDS
        if device.type == "cuda" and half and "te" in usable and have("transformer_engine.pytorch"):
            resolved = "te"
        elif device.type == "cuda" and half and "flash" in usable and have("flash_attn"):
            resolved = "flash"
        elif (device.type == "cuda" and "flex" in usable and sdpa_limit is not None
              and max_tokens > sdpa_limit):
            resolved = "flex"  # sdpa's layout is the [T, T] mask, refused above its limit
        else:
            # on CPU above the mask limit (sdpa_layout=mask) the cache refuses the mask, naming
            # the alternatives (the padded view, flex / flash / te, a higher limit)
            resolved = "sdpa"
    elif backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS} or 'auto'")
    else:
        resolved = backend
    return resolved


def check_backend(backend: str, device: torch.device, dtype: Optional[torch.dtype],
                  chosen_by_auto: bool = False) -> ResolvedBackend:
    """``backend`` (a :func:`choose_backend` choice) checked -- its package installed (an
    explicit flash / te), the dtype one its kernels take -- as a :class:`ResolvedBackend`."""
    if not chosen_by_auto and backend == "flash":
        require("flash_attn", "the 'flash' attention backend", _ALTERNATIVES["flash"])
    if not chosen_by_auto and backend == "te":
        require("transformer_engine.pytorch", "the 'te' attention backend", _ALTERNATIVES["te"])
    check_backend_dtype(backend, device, dtype, chosen_by_auto=chosen_by_auto)
    return ResolvedBackend(backend)


def check_backend_dtype(backend: str, device: torch.device, dtype: Optional[torch.dtype],
                        chosen_by_auto: bool = False) -> None:
    """te / flash on CUDA need fp16 or bf16: TE has no fp32 THD backend and flash-attn takes
    half precision only ("No dot product attention backend" at the first forward)."""
    if dtype is None or device.type != "cuda" or backend not in ("te", "flash"):
        return
    if dtype not in (torch.bfloat16, torch.float16):
        how = " (chosen by attention_backend=auto on CUDA)" if chosen_by_auto else ""
        raise ValueError(
            f"the '{backend}' attention backend{how} runs in bf16 / fp16 only, but the model "
            f"dtype is {dtype}: set the model dtype to bfloat16 (dtype: bfloat16, i.e. "
            "TransformerConfig params_dtype=torch.bfloat16 with bf16=True), or keep float32 "
            "with attention_backend=sdpa"
        )


def _te_dot_product_attention_cls():
    """Megatron's ``TEDotProductAttention`` (a seam: CPU tests put a stand-in with its exact
    signature here)."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return TEDotProductAttention


def _te_apply_rotary_pos_emb():
    """Transformer Engine's fused RoPE (>= 2.3; a seam for CPU stand-ins)."""
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    return apply_rotary_pos_emb


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

    T must equal the cache's ``max_tokens`` (pad the packed batch to it: static shapes).
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
        self._band_MM = None  # the padded view's banded causal mask of a windowed layer
        if self.window is not None:
            kind = {"sdpa": None if self.sdpa_padded else "sdpa_mask_window",
                    "flex": "flex_block_mask_window"}.get(self.backend)
            if kind is not None:
                cache.register(kind, dtype=config.params_dtype, window=self.window)
            if self.sdpa_padded:  # row position i keeps keys i - W < j <= i: a constant
                m_1M = torch.arange(cache.config.max_seqlen_bound, device=cache.device).unsqueeze(0)
                back_MM = m_1M.t() - m_1M
                self._band_MM = (back_MM >= 0) & (back_MM < self.window)
        self._te_attention = None
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
            self._te_attention = _te_dot_product_attention_cls()(
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
                te_cls = type(self._te_attention)
                if getattr(te_cls, "cp_stream", None) is None:
                    te_cls.cp_stream = torch.cuda.Stream()
                group = context_parallel_group(pg_collection)
                self._te_attention.set_context_parallel_group(
                    group, torch.distributed.get_process_group_ranks(group), te_cls.cp_stream,
                    "p2p" if cp_comm_type is None else cp_comm_type)
        if self.backend == "flex":
            self._flex = _flex_attention_fn(cache.device)
            # the job's device (the cache's) decides the CPU refusal in _forward_flex
            self._flex_on_cpu = cache.device.type == "cpu"

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
        import copy

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

        out_THd = getattr(self, f"_forward_{self.backend}")(query, key, value, params)
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

    # Each backend: q [T, np, hn], k/v [T, ng, hn] -> [T, np, hn].
    @staticmethod
    def _as_1HTd(*xs_THd):
        """[T, heads, d] -> [1, heads, T, d] (SDPA / flex layout)."""
        return tuple(x.transpose(0, 1).unsqueeze(0) for x in xs_THd)

    def _dropout(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _dropout_rng(self):
        """Where attention dropout draws: Megatron's model-parallel RNG stream (a different mask
        per TP rank, whose heads differ), as its DotProductAttention does outside sequence
        parallelism (transformer/dot_product_attention.py) and TE's attention through its
        tracker; the default generator otherwise (and on CPU, which has no CUDA tracker)."""
        import contextlib

        if self._dropout() == 0 or self.config.sequence_parallel or not torch.cuda.is_available():
            return contextlib.nullcontext()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return get_cuda_rng_tracker().fork()

    def _forward_sdpa(self, q, k, v, params):
        if self.sdpa_padded:
            return self._forward_sdpa_padded(q, k, v, params)
        # additive, q's dtype: used as is, saved once per step (windowed layers: their own one)
        mask_TT = params.sdpa_mask_TT if self.window is None else params.sdpa_mask_window_TT
        if mask_TT.dtype != q.dtype:
            raise ValueError(
                f"the packed cache built the SDPA mask in {mask_TT.dtype} (TransformerConfig."
                f"params_dtype) but attention runs in {q.dtype}; set params_dtype to the compute dtype"
            )
        if self.softcap is not None:
            out_1HTd = self._softcapped_attention(*self._as_1HTd(q, k, v), mask_TT)
            return out_1HTd.squeeze(0).transpose(0, 1)
        with self._dropout_rng():
            out_1HTd = F.scaled_dot_product_attention(
                *self._as_1HTd(q, k, v),
                attn_mask=mask_TT,
                dropout_p=self._dropout(),
                scale=self.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        return out_1HTd.squeeze(0).transpose(0, 1)

    def _softcapped_attention(self, q_BHQd, k_BGKd, v_BGKd, mask_QK):
        """Explicit attention with logit soft-capping (torch SDPA takes no score function), as
        transformers' ``eager_attention_forward`` of Gemma 2: scores = q k^T * scale, cap *
        tanh(scores / cap), + the mask (additive, or a bool keep-mask), softmax in float32 cast
        to q's dtype, dropout, @ v. GQA: query head h reads key / value group h // (H / G)."""
        rep = q_BHQd.shape[1] // k_BGKd.shape[1]
        if rep > 1:
            k_BGKd, v_BGKd = (x.repeat_interleave(rep, 1) for x in (k_BGKd, v_BGKd))
        scores = torch.matmul(q_BHQd, k_BGKd.transpose(-2, -1)) * self.softmax_scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask_QK.dtype == torch.bool:
            scores = scores.masked_fill(mask_QK.logical_not(), float("-inf"))
        else:
            scores = scores + mask_QK
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_BHQd.dtype)
        if self._dropout() > 0:
            with self._dropout_rng():
                probs = F.dropout(probs, p=self._dropout())
        return torch.matmul(probs, v_BGKd)

    def _forward_sdpa_padded(self, q, k, v, params):
        """Causal SDPA on the packed-to-padded view: S rows of M tokens, one sequence per row,
        left-aligned (q, k, v gathered through ``pad_gather_SM``, whose indices all lie in
        [0, T): no zero row is appended, i.e. no [T + 1, h, d] copy per tensor and layer).
        Right padding needs no mask under causality: a real query at position i sees keys
        0..i of its own row, all real, so what an empty cell holds (token 0) reaches no real
        output, and its gradient is exactly zero. Outputs of empty cells are dropped by the
        scatter back (``pad_scatter_T``); padding tokens get zeros (one in-place fill)."""
        gather_SM = params.pad_gather_SM
        s_rows, m = gather_SM.shape

        def padded(x_THd):  # [T, h, d] -> [S, h, M, d]
            return x_THd[gather_SM].transpose(1, 2)

        if self.softcap is not None:
            m_M = torch.arange(m, device=q.device)
            keep_MM = self._band_MM if self._band_MM is not None else m_M[:, None] >= m_M[None, :]
            out_ShMd = self._softcapped_attention(padded(q), padded(k), padded(v), keep_MM)
        else:
            with self._dropout_rng():
                out_ShMd = F.scaled_dot_product_attention(
                    padded(q), padded(k), padded(v), attn_mask=self._band_MM,
                    is_causal=self._band_MM is None, dropout_p=self._dropout(),
                    scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        out_flat = out_ShMd.transpose(1, 2).reshape(s_rows * m, q.shape[1], -1)
        out_THd = out_flat[params.pad_scatter_T]  # a fresh tensor: filled in place
        return out_THd.masked_fill_(params.real_token_mask_T.logical_not().view(-1, 1, 1), 0)

    def _forward_flex(self, q, k, v, params):
        if self._dropout() > 0:
            raise ValueError("the 'flex' backend does not support attention dropout; use 'sdpa'")
        if self._flex_on_cpu and torch.is_grad_enabled() and q.requires_grad:
            raise ValueError(
                "the 'flex' backend has no backward on CPU (torch FlexAttention limitation); "
                "train with backend='sdpa' on CPU, use 'flex' there for forward-only evaluation"
            )
        block_mask = block_mask_from(params, self.window)
        extra = {}
        if self.softcap is not None:  # flex scales q.k first, then applies score_mod
            cap = self.softcap

            def softcap_score(score, b, h, q_idx, kv_idx):
                return torch.tanh(score / cap) * cap

            extra["score_mod"] = softcap_score
        out_1HTd = self._flex(
            *self._as_1HTd(q, k, v),
            block_mask=block_mask,
            **extra,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out_1HTd.squeeze(0).transpose(0, 1)

    def _forward_flash(self, q, k, v, params):
        flash_attn = require("flash_attn", "the 'flash' attention backend", _ALTERNATIVES["flash"])
        with self._dropout_rng():
            out = flash_attn.flash_attn_varlen_func(
                q, k, v,
                cu_seqlens_q=params.cu_seqlens_q,
                cu_seqlens_k=params.cu_seqlens_kv,
                max_seqlen_q=params.max_seqlen_q,
                max_seqlen_k=params.max_seqlen_kv,
                dropout_p=self._dropout(),
                softmax_scale=self.softmax_scale,
                causal=True,
                # flash-attn 2.8 keeps the keys in [i - window_size[0], i + window_size[1]]
                # (equal q / k lengths; -1: unbounded): (W - 1, 0) is transformers' window
                window_size=(-1, -1) if self.window is None else (self.window - 1, 0),
                # flash-attn >= 2.6: softcap > 0 caps the scaled scores, cap * tanh(s / cap)
                **({} if self.softcap is None else {"softcap": self.softcap}),
            )
        # cu_seqlens close the padding tail at T: the kernel writes every row of out and, in
        # backward, of dq / dk / dv (FA2 leaves rows after the last boundary uninitialised).
        return out

    def _forward_te(self, q, k, v, params):
        from megatron.core.transformer.enums import AttnMaskType

        if self.apply_rope:
            te_rope = _te_apply_rotary_pos_emb()
            freqs_T11D = params.rope_freqs_T11D
            # sbhd with s = packed token, b = 1: per-token angles, fused kernel, no cu_seqlens.
            q = te_rope(q.unsqueeze(1), freqs_T11D, tensor_format="sbhd", fused=True,
                        interleaved=self.rope_interleaved).squeeze(1)
            k = te_rope(k.unsqueeze(1), freqs_T11D, tensor_format="sbhd", fused=True,
                        interleaved=self.rope_interleaved).squeeze(1)
        # Megatron's TEDotProductAttention.forward takes attn_mask_type positionally required.
        out = self._te_attention(q, k, v, None, attn_mask_type=AttnMaskType.padding_causal,
                                 packed_seq_params=params)
        return out.view(q.shape[0], q.shape[1], -1)
