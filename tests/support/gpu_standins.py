"""CPU stand-ins for the GPU-only attention libraries, honouring their contracts.

* :func:`flash_attn_varlen_func`: flash-attn 2.8's varlen signature. Like FA2, its output and
  its dq / dk / dv are allocated uninitialised (here: NaN) and only rows inside a sequence
  ``[cu_seqlens[i], cu_seqlens[i+1])`` are written (flash-attention PR #2324); a sequence longer
  than ``max_seqlen`` is an error.
* :class:`TEDotProductAttentionStandIn`: Megatron 0.16.1's ``TEDotProductAttention``
  constructor and ``forward`` signature (checked against the installed source by the tests);
  it forwards the base ``PackedSeqParams`` fields as TE's ``DotProductAttention`` receives them
  and decides ``pad_between_seqs`` with TE 2.10's own expression (``torch.equal`` on the
  device tensors: a host sync when ``cu_seqlens_*_padded`` are given).
* :func:`te_apply_rotary_pos_emb`: TE's ``apply_rotary_pos_emb`` keywords, computed with
  Megatron's ``_apply_rotary_pos_emb_bshd`` (the unfused reference).

Host reads of ``cu_seqlens`` happen inside the stand-ins only (a real kernel reads them on the
device); tests that count syncs exclude them by design.
"""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn.functional as F


def _varlen_reference(q, k, v, cu, max_seqlen, scale):
    """Causal attention per sequence; NaN on rows outside every sequence."""
    out = torch.full_like(q, float("nan"))
    bounds = cu.tolist()
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            continue
        if b - a > max_seqlen:
            raise RuntimeError(f"sequence of {b - a} tokens > max_seqlen={max_seqlen}")
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out


class _FlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, max_seqlen, scale):
        ctx.save_for_backward(q, k, v, cu_q)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return _varlen_reference(q, k, v, cu_q, max_seqlen, scale)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, cu = ctx.saved_tensors
        dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))  # empty_like in FA2
        bounds = cu.tolist()
        for a, b in zip(bounds, bounds[1:]):
            if b <= a:
                continue
            with torch.enable_grad():
                xs = [x[a:b].detach().requires_grad_(True) for x in (q, k, v)]
                o = _varlen_reference(*xs, torch.tensor([0, b - a]), ctx.max_seqlen, ctx.scale)
                g = torch.autograd.grad(o, xs, dout[a:b])
            dq[a:b], dk[a:b], dv[a:b] = g
        return dq, dk, dv, None, None, None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    assert causal and dropout_p == 0.0
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _FlashVarlen.apply(q, k, v, cu_seqlens_q, max_seqlen_q, scale)


def fake_flash_attn_module() -> types.ModuleType:
    mod = types.ModuleType("flash_attn")
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    mod.__version__ = "2.8.3"
    return mod


class TEDotProductAttentionStandIn(torch.nn.Module):
    """Megatron 0.16.1 ``TEDotProductAttention`` signature over the varlen reference."""

    calls: list = []

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 num_splits=None, cp_comm_type="p2p", pg_collection=None):
        super().__init__()
        from megatron.core.packed_seq_params import PackedSeqParams

        self.config, self.softmax_scale = config, softmax_scale
        self.kept = [f.name for f in dataclasses.fields(PackedSeqParams)
                     if f.name not in ("cp_group", "local_cp_size")]

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None, num_splits=None):
        kw = {k: getattr(packed_seq_params, k) for k in self.kept}
        assert kw["qkv_format"] == "thd" and attention_mask is None
        # TE 2.10 DotProductAttention.forward, verbatim logic:
        pad_between_seqs = (
            kw["cu_seqlens_q_padded"] is not None
            and not torch.equal(kw["cu_seqlens_q_padded"][:-1], kw["cu_seqlens_q"][:-1])
        ) or (
            kw["cu_seqlens_kv_padded"] is not None
            and not torch.equal(kw["cu_seqlens_kv_padded"][:-1], kw["cu_seqlens_kv"][:-1])
        )
        type(self).calls.append((attn_mask_type.name, pad_between_seqs))
        scale = self.softmax_scale or query.shape[-1] ** -0.5
        out = _FlashVarlen.apply(query, key, value, kw["cu_seqlens_q"], kw["max_seqlen_q"], scale)
        return out.reshape(out.shape[0], -1)


def te_apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None,
                            interleaved=False, fused=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    assert tensor_format == "sbhd" and freqs.dtype == torch.float32 and freqs.dim() == 4
    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
