"""Core attention that reads the packed-sequence cache.

``PackedCoreAttention`` is a Megatron ``core_attention`` submodule (same constructor and call
signature as ``DotProductAttention`` / ``TEDotProductAttention``). It takes q/k/v of a packed
microbatch, applies RoPE from the cache's per-token cos/sin (built once per batch, shared by all
layers) and runs one of the backends over the cache's static boundary metadata:

=========  ==============================================================  =============
backend    kernel                                                          device
=========  ==============================================================  =============
``sdpa``   ``F.scaled_dot_product_attention`` + cached block-causal mask   CPU default
``flex``   ``flex_attention`` + cached ``BlockMask``                       CPU / CUDA
``flash``  ``flash_attn_varlen_func`` over the static ``cu_seqlens``       CUDA
``te``     Megatron ``TEDotProductAttention`` (THD) + TE fused RoPE        CUDA
=========  ==============================================================  =============

None of them reads a tensor value on the host.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_fastpath._optional import require
from megatron_fastpath.attention.rope import apply_rope_cached
from megatron_fastpath.packed_seq.cache import _dtype_name

__all__ = ["BACKENDS", "PackedCoreAttention", "resolve_backend"]

BACKENDS = ("sdpa", "flex", "flash", "te")

_ALTERNATIVES = {
    "flash": "backend='sdpa' (CPU and GPU) or backend='flex'",
    "te": "backend='flash', 'sdpa' or 'flex'",
}


def resolve_backend(backend: str, device: torch.device, max_tokens: int, sdpa_limit: int) -> str:
    """Validate ``backend`` (raising before any device work when its package is missing) and
    resolve ``"auto"``: te > flash on CUDA when installed, else sdpa (flex above the SDPA mask
    limit)."""
    if backend == "auto":
        from megatron_fastpath._optional import have

        if device.type == "cuda" and have("transformer_engine.pytorch"):
            return "te"
        if device.type == "cuda" and have("flash_attn"):
            return "flash"
        if device.type == "cuda" and max_tokens > sdpa_limit:
            return "flex"
        return "sdpa"  # on CPU above the mask limit this raises with the alternatives
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS} or 'auto'")
    if backend == "flash":
        require("flash_attn", "the 'flash' attention backend", _ALTERNATIVES["flash"])
    if backend == "te":
        require("transformer_engine.pytorch", "the 'te' attention backend", _ALTERNATIVES["te"])
    return backend


def _megatron_module_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class PackedCoreAttention(_megatron_module_base()):
    """Megatron core attention over a :class:`PackedSeqCache`.

    Built from a ModuleSpec: ``ModuleSpec(PackedCoreAttention, params={"cache": cache,
    "backend": "sdpa"})``; Megatron's ``SelfAttention`` passes the rest (config, layer_number,
    attn_mask_type, attention_type, cp_comm_type, softmax_scale, pg_collection).

    forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
            packed_seq_params=None)
        query: [T, np, hn] (THD, when packed_seq_params are given) or [T, 1, np, hn];
        key/value: [T, ng, hn] or [T, 1, ng, hn] (GQA: ng divides np).
        returns [T, np*hn] (THD) or [T, 1, np*hn].

    T must equal the cache's ``max_tokens`` (pad the packed batch to it: static shapes).
    ``attention_mask`` must be None: the mask comes from the cache.
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
    ):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError("PackedCoreAttention supports self-attention only")
        if config.context_parallel_size > 1:
            raise ValueError(
                "PackedCoreAttention does not support context parallelism (context_parallel_size"
                f"={config.context_parallel_size}); use Megatron's TE spec for CP"
            )
        self.cache = cache
        self.backend = resolve_backend(
            backend, cache.device, cache.config.max_tokens, cache.config.sdpa_mask_max_tokens
        )
        self.layer_number = layer_number
        self.apply_rope = apply_rope and cache.config.rope is not None
        self.rope_interleaved = cache.config.rope.interleaved if self.apply_rope else False
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.hidden_per_head = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.hidden_per_head)
        )
        needs = {"sdpa": ["sdpa_mask"], "flex": ["flex_block_mask"], "flash": ["real_mask"], "te": ["real_mask"]}[
            self.backend
        ]
        if self.apply_rope:
            needs.append("rope_freqs" if self.backend == "te" else f"rope_cos_sin:{_dtype_name(config.params_dtype)}")
        for kind in needs:
            cache.register(kind)
        self._te_attention = None
        if self.backend == "te":
            from megatron.core.extensions.transformer_engine import TEDotProductAttention
            from megatron.core.transformer.enums import AttnMaskType

            # TE reads cu_seqlens / cu_seqlens_padded / max_seqlen from the cache's params.
            self._te_attention = TEDotProductAttention(
                config=config,
                layer_number=layer_number,
                attn_mask_type=AttnMaskType.padding_causal,
                attention_type=attention_type,
                attention_dropout=attention_dropout,
                softmax_scale=softmax_scale,
                cp_comm_type=cp_comm_type,
                pg_collection=pg_collection,
            )
        if self.backend == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            # flex_attention only generates a fused kernel under torch.compile.
            self._flex = torch.compile(flex_attention, dynamic=False) if cache.device.type == "cuda" else flex_attention

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
        if t != self.cache.config.max_tokens:
            raise ValueError(
                f"packed input has {t} tokens but the cache's static capacity is max_tokens="
                f"{self.cache.config.max_tokens}: pad the packed batch to max_tokens"
            )
        params = packed_seq_params
        if params is None:
            params = self.cache.slot_for(None).params
        if self.apply_rope and self.backend != "te":
            cos_T1D, sin_T1D = self.cache.rope_cos_sin(params, dtype=query.dtype)
            query = apply_rope_cached(query, cos_T1D, sin_T1D, self.rope_interleaved)
            key = apply_rope_cached(key, cos_T1D, sin_T1D, self.rope_interleaved)

        out_THd = getattr(self, f"_forward_{self.backend}")(query, key, value, params)
        out = out_THd.reshape(t, -1)
        return out.unsqueeze(1) if sbhd else out

    # Each backend: q [T, np, hn], k/v [T, ng, hn] -> [T, np, hn].
    @staticmethod
    def _as_1HTd(*xs_THd):
        """[T, heads, d] -> [1, heads, T, d] (SDPA / flex layout)."""
        return tuple(x.transpose(0, 1).unsqueeze(0) for x in xs_THd)

    def _dropout(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _forward_sdpa(self, q, k, v, params):
        mask_TT = self.cache.sdpa_mask(params)
        out_1HTd = F.scaled_dot_product_attention(
            *self._as_1HTd(q, k, v),
            attn_mask=mask_TT,
            dropout_p=self._dropout(),
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out_1HTd.squeeze(0).transpose(0, 1)

    def _forward_flex(self, q, k, v, params):
        if self._dropout() > 0:
            raise ValueError("the 'flex' backend does not support attention dropout; use 'sdpa'")
        if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
            raise ValueError(
                "the 'flex' backend has no backward on CPU (torch FlexAttention limitation); "
                "train with backend='sdpa' on CPU, use 'flex' there for forward-only evaluation"
            )
        block_mask = self.cache.flex_block_mask(params)
        out_1HTd = self._flex(
            *self._as_1HTd(q, k, v),
            block_mask=block_mask,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out_1HTd.squeeze(0).transpose(0, 1)

    def _forward_flash(self, q, k, v, params):  # pragma: no cover - CUDA only
        flash_attn = require("flash_attn", "the 'flash' attention backend", _ALTERNATIVES["flash"])
        out = flash_attn.flash_attn_varlen_func(
            q, k, v,
            cu_seqlens_q=params.cu_seqlens_q,
            cu_seqlens_k=params.cu_seqlens_kv,
            max_seqlen_q=params.max_seqlen_q,
            max_seqlen_k=params.max_seqlen_kv,
            dropout_p=self._dropout(),
            softmax_scale=self.softmax_scale,
            causal=True,
        )
        # Tokens past cu_seqlens[-1] (static padding) are not written by the kernel.
        real_T11 = self.cache.real_token_mask(params).view(-1, 1, 1)
        return torch.where(real_T11, out, torch.zeros((), dtype=out.dtype, device=out.device))

    def _forward_te(self, q, k, v, params):  # pragma: no cover - CUDA only
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb as te_rope

        if self.apply_rope:
            freqs_T11D = self.cache.get("rope_freqs", params)
            # sbhd with s = packed token, b = 1: per-token angles, fused kernel, no cu_seqlens.
            q = te_rope(q.unsqueeze(1), freqs_T11D, tensor_format="sbhd", fused=True,
                        interleaved=self.rope_interleaved).squeeze(1)
            k = te_rope(k.unsqueeze(1), freqs_T11D, tensor_format="sbhd", fused=True,
                        interleaved=self.rope_interleaved).squeeze(1)
        out = self._te_attention(q, k, v, None, packed_seq_params=params)
        out = out.view(q.shape[0], q.shape[1], -1)
        real_T11 = self.cache.real_token_mask(params).view(-1, 1, 1)
        return torch.where(real_T11, out, torch.zeros((), dtype=out.dtype, device=out.device))
