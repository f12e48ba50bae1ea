"""The attention backends' kernels over a packed batch, and :data:`ATTENTION_KERNELS`, the
table from a backend name to its kernel that :class:`~megatron_fastpath.attention.core_attention.
PackedCoreAttention` resolves once, at construction.

Each kernel takes the layer (:class:`AttentionLayer`: its settings), q [T, np, d] and k / v
[T, ng, d] with RoPE applied (te: not yet; it applies TE's fused RoPE itself) and the batch's
:class:`~megatron_fastpath.packed_seq.params.CachedPackedSeqParams`, and returns [T, np, d].
None reads a tensor value on the host or the cache: everything per batch comes from the params.

=========================  =======================================================================
kernel                     what it runs
=========================  =======================================================================
``attend_sdpa``            ``F.scaled_dot_product_attention`` under the params' one additive
                           [T, T] mask (``sdpa_mask_TT``, or ``sdpa_mask_window_TT`` of a
                           windowed layer); with soft-capping :func:`softcapped_attention`
``attend_sdpa_padded``     the same backend in its packed-to-padded layout: S rows of M tokens,
                           plain causal (or banded, windowed) SDPA per row, no [T, T] mask
``attend_flex``            ``flex_attention`` over the params' BlockMask (``block_mask_from``)
``attend_flash``           ``flash_attn_varlen_func`` over the static ``cu_seqlens``
``attend_te``              Megatron's ``TEDotProductAttention`` (THD) after TE's fused RoPE
=========================  =======================================================================

Shape letters: T packed tokens, H / np query heads, G / ng key/value groups, d head dim,
S = ``max_seqs`` rows and M = ``max_seqlen`` tokens per row of the padded view, B = 1 batch,
Q / K query / key positions.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F

from megatron_fastpath._optional import require
from megatron_fastpath.attention.backend import ALTERNATIVES
from megatron_fastpath.packed_seq.params import CachedPackedSeqParams, block_mask_from

__all__ = ["ATTENTION_KERNELS", "AttentionKernel", "AttentionLayer", "attention_kernel",
           "softcapped_attention"]


class AttentionLayer(Protocol):
    """What a kernel reads of its layer (a ``PackedCoreAttention``)."""

    softmax_scale: float
    softcap: Optional[float]  # logit soft-capping (None: none)
    window: Optional[int]  # sliding window W (None: causal over the whole sequence)
    apply_rope: bool
    rope_interleaved: bool
    band_MM: Optional[torch.Tensor]  # the padded view's banded causal [M, M] keep-mask (window)
    flex_fn: Callable  # flex_attention as the flex backend calls it (compiled on CUDA)
    flex_on_cpu: bool
    te_attention: Optional[torch.nn.Module]  # Megatron's TEDotProductAttention of the layer

    def dropout_prob(self) -> float:
        """The attention dropout probability of this call (0 outside training)."""

    def dropout_rng(self) -> contextlib.AbstractContextManager:
        """Where attention dropout draws its mask."""


# (layer, q [T, np, d], k [T, ng, d], v [T, ng, d], params) -> [T, np, d]
AttentionKernel = Callable[[AttentionLayer, torch.Tensor, torch.Tensor, torch.Tensor,
                            CachedPackedSeqParams], torch.Tensor]


def _te_apply_rotary_pos_emb():
    """Transformer Engine's fused RoPE (>= 2.3; a seam for CPU stand-ins)."""
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    return apply_rotary_pos_emb


def as_1HTd(*xs_THd):
    """[T, heads, d] -> [1, heads, T, d] (SDPA / flex layout)."""
    return tuple(x.transpose(0, 1).unsqueeze(0) for x in xs_THd)


def attend_sdpa(layer: AttentionLayer, q, k, v, params):
    """SDPA of the packed [T] tokens against each other under the params' [T, T] mask."""
    # additive, q's dtype: used as is, saved once per step (windowed layers: their own one)
    mask_TT = params.sdpa_mask_TT if layer.window is None else params.sdpa_mask_window_TT
    if mask_TT.dtype != q.dtype:
        raise ValueError(
            f"the packed cache built the SDPA mask in {mask_TT.dtype} (TransformerConfig."
            f"params_dtype) but attention runs in {q.dtype}; set params_dtype to the compute dtype"
        )
    if layer.softcap is not None:
        out_1HTd = softcapped_attention(layer, *as_1HTd(q, k, v), mask_TT)
        return out_1HTd.squeeze(0).transpose(0, 1)
    with layer.dropout_rng():
        out_1HTd = F.scaled_dot_product_attention(
            *as_1HTd(q, k, v),
            attn_mask=mask_TT,
            dropout_p=layer.dropout_prob(),
            scale=layer.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    return out_1HTd.squeeze(0).transpose(0, 1)


def softcapped_attention(layer: AttentionLayer, q_BHQd, k_BGKd, v_BGKd, mask_QK):
    """Explicit attention with logit soft-capping (torch SDPA takes no score function), as
    transformers' ``eager_attention_forward`` of Gemma 2: scores = q k^T * scale, cap *
    tanh(scores / cap), + the mask (additive, or a bool keep-mask), softmax in float32 cast
    to q's dtype, dropout, @ v. GQA: query head h reads key / value group h // (H / G)."""
    rep = q_BHQd.shape[1] // k_BGKd.shape[1]
    if rep > 1:
        k_BGKd, v_BGKd = (x.repeat_interleave(rep, 1) for x in (k_BGKd, v_BGKd))
    scores = torch.matmul(q_BHQd, k_BGKd.transpose(-2, -1)) * layer.softmax_scale
    scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if mask_QK.dtype == torch.bool:
        scores = scores.masked_fill(mask_QK.logical_not(), float("-inf"))
    else:
        scores = scores + mask_QK
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_BHQd.dtype)
    if layer.dropout_prob() > 0:
        with layer.dropout_rng():
            probs = F.dropout(probs, p=layer.dropout_prob())
    return torch.matmul(probs, v_BGKd)


def attend_sdpa_padded(layer: AttentionLayer, q, k, v, params):
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

    if layer.softcap is not None:
        m_M = torch.arange(m, device=q.device)
        keep_MM = layer.band_MM if layer.band_MM is not None else m_M[:, None] >= m_M[None, :]
        out_ShMd = softcapped_attention(layer, padded(q), padded(k), padded(v), keep_MM)
    else:
        with layer.dropout_rng():
            out_ShMd = F.scaled_dot_product_attention(
                padded(q), padded(k), padded(v), attn_mask=layer.band_MM,
                is_causal=layer.band_MM is None, dropout_p=layer.dropout_prob(),
                scale=layer.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
    out_flat = out_ShMd.transpose(1, 2).reshape(s_rows * m, q.shape[1], -1)
    out_THd = out_flat[params.pad_scatter_T]  # a fresh tensor: filled in place
    return out_THd.masked_fill_(params.real_token_mask_T.logical_not().view(-1, 1, 1), 0)


def attend_flex(layer: AttentionLayer, q, k, v, params):
    """``flex_attention`` over the params' BlockMask (the windowed one of a windowed layer);
    soft-capping as a ``score_mod``. No dropout; no backward on CPU."""
    if layer.dropout_prob() > 0:
        raise ValueError("the 'flex' backend does not support attention dropout; use 'sdpa'")
    if layer.flex_on_cpu and torch.is_grad_enabled() and q.requires_grad:
        raise ValueError(
            "the 'flex' backend has no backward on CPU (torch FlexAttention limitation); "
            "train with backend='sdpa' on CPU, use 'flex' there for forward-only evaluation"
        )
    block_mask = block_mask_from(params, layer.window)
    extra = {}
    if layer.softcap is not None:  # flex scales q.k first, then applies score_mod
        cap = layer.softcap

        def softcap_score(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / cap) * cap

        extra["score_mod"] = softcap_score
    out_1HTd = layer.flex_fn(
        *as_1HTd(q, k, v),
        block_mask=block_mask,
        **extra,
        scale=layer.softmax_scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out_1HTd.squeeze(0).transpose(0, 1)


def attend_flash(layer: AttentionLayer, q, k, v, params):
    """flash-attn's varlen kernel over the params' static ``cu_seqlens`` / ``max_seqlen``."""
    flash_attn = require("flash_attn", "the 'flash' attention backend", ALTERNATIVES["flash"])
    with layer.dropout_rng():
        out = flash_attn.flash_attn_varlen_func(
            q, k, v,
            cu_seqlens_q=params.cu_seqlens_q,
            cu_seqlens_k=params.cu_seqlens_kv,
            max_seqlen_q=params.max_seqlen_q,
            max_seqlen_k=params.max_seqlen_kv,
            dropout_p=layer.dropout_prob(),
            softmax_scale=layer.softmax_scale,
            causal=True,
            # flash-attn 2.8 keeps the keys in [i - window_size[0], i + window_size[1]]
            # (equal q / k lengths; -1: unbounded): (W - 1, 0) is transformers' window
            window_size=(-1, -1) if layer.window is None else (layer.window - 1, 0),
            # flash-attn >= 2.6: softcap > 0 caps the scaled scores, cap * tanh(s / cap)
            **({} if layer.softcap is None else {"softcap": layer.softcap}),
        )
    # cu_seqlens close the padding tail at T: the kernel writes every row of out and, in
    # backward, of dq / dk / dv (FA2 leaves rows after the last boundary uninitialised).
    return out


def attend_te(layer: AttentionLayer, q, k, v, params):
    """TE's fused RoPE from the params' ``rope_freqs_T11D``, then the layer's Megatron
    ``TEDotProductAttention`` (THD, padding-causal) over the params as they are."""
    from megatron.core.transformer.enums import AttnMaskType

    if layer.apply_rope:
        te_rope = _te_apply_rotary_pos_emb()
        freqs_T11D = params.rope_freqs_T11D
        # sbhd with s = packed token, b = 1: per-token angles, fused kernel, no cu_seqlens.
        q = te_rope(q.unsqueeze(1), freqs_T11D, tensor_format="sbhd", fused=True,
                    interleaved=layer.rope_interleaved).squeeze(1)
        k = te_rope(k.unsqueeze(1), freqs_T11D, tensor_format="sbhd", fused=True,
                    interleaved=layer.rope_interleaved).squeeze(1)
    # Megatron's TEDotProductAttention.forward takes attn_mask_type positionally required.
    out = layer.te_attention(q, k, v, None, attn_mask_type=AttnMaskType.padding_causal,
                             packed_seq_params=params)
    return out.view(q.shape[0], q.shape[1], -1)


# Backend name -> its kernel: the one table PackedCoreAttention resolves its backend through.
ATTENTION_KERNELS: dict[str, AttentionKernel] = {
    "sdpa": attend_sdpa,
    "flex": attend_flex,
    "flash": attend_flash,
    "te": attend_te,
}


def attention_kernel(backend: str, sdpa_padded: bool = False) -> AttentionKernel:
    """The kernel of a resolved ``backend``; the sdpa backend's packed-to-padded layout
    (``sdpa_padded``) has its own."""
    if backend == "sdpa" and sdpa_padded:
        return attend_sdpa_padded
    return ATTENTION_KERNELS[backend]
