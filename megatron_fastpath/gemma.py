"""Gemma 2 / 3's architecture pieces on the Megatron layer spec (``model_type: gemma2``,
``gemma3_text``).

Gemma 2 differs from Llama by (transformers 4.57 ``models/gemma2/modeling_gemma2.py``):

* RMSNorm with ``(1 + weight)``, computed in float32 and cast back (``Gemma2RMSNorm``):
  :class:`GemmaRMSNorm`, on every norm slot (input, pre-MLP, final, and the two below).
  Megatron 0.16.1's ``layernorm_zero_centered_gamma`` is refused by its torch norm
  (``WrappedTorchNorm``), and Megatron's layer has no post-attention / post-MLP norm slot, so:
* the attention and MLP outputs are normed before the residual add
  (``post_attention_layernorm`` / ``post_feedforward_layernorm``): :class:`PostNormSelfAttention`
  and :class:`PostNormMLP` (Megatron's modules, whose output goes through their
  ``post_layernorm``; their submodules -- and so LoRA on their linears -- are untouched);
* GeGLU with the tanh GELU (``hidden_activation: gelu_pytorch_tanh``): :func:`gelu_tanh` as
  the TransformerConfig ``activation_func`` with ``gated_linear_unit``;
* softmax scale ``query_pre_attn_scalar ** -0.5`` (TransformerConfig ``softmax_scale``);
* attention logit soft-capping ``cap * tanh(scores / cap)`` before the mask and softmax
  (``PackedCoreAttention(softcap=...)``: every backend but te);
* embeddings times ``sqrt(hidden_size)`` rounded to the model's dtype (transformers'
  ``normalizer``) and the LM head's logits soft-capped (``final_logit_softcapping``): forward
  hooks on the model's ``embedding`` / ``output_layer`` (:func:`apply_gemma_model_hooks`).

Gemma 3 adds per-head q / k norms of the same ``(1 + weight)`` form (``q_norm`` / ``k_norm``,
on Megatron's ``q_layernorm`` / ``k_layernorm`` slots) and rotates its sliding-window layers
with a second RoPE base (``rope_local_base_freq``, the packed cache's ``rope_local`` table),
its global ones with ``rope_theta`` (and ``rope_scaling``); no soft-capping by default.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_fastpath.attention.self_attention import CachedRopeSelfAttention

__all__ = ["GemmaOptions", "GemmaRMSNorm", "PostNormSelfAttention", "PostNormMLP", "gelu_tanh",
           "apply_gemma_model_hooks", "softcap"]


@dataclasses.dataclass(frozen=True)
class GemmaOptions:
    """The Gemma 2 / 3 settings (None: that cap is off). local_rope_layers: the 0-based layers
    rotating with the cache's second RoPE (Gemma 3's sliding layers, ``rope_local_base_freq``;
    ``PackedSeqConfig.rope_local``)."""

    attention_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    local_rope_layers: tuple = ()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh`` (``PytorchGELUTanh``)."""
    return F.gelu(x, approximate="tanh")


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` in transformers' order of operations."""
    return torch.tanh(x / cap) * cap


class GemmaRMSNorm(torch.nn.Module):
    """``Gemma2RMSNorm``: x / rms(x) * (1 + weight), in float32, cast to x's dtype. Megatron
    builds norms as ``build_module(spec, config=..., hidden_size=..., eps=...)``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # Megatron all-reduces the grads of parameters marked sequence_parallel over TP
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class _PostNormed:
    """Mixin: the module's output normed (a :class:`GemmaRMSNorm` at ``post_layernorm``)
    before the layer's residual add; ``_norm_name`` says which of Gemma's norms it is."""

    _norm_name = "post norm"

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = GemmaRMSNorm(config, config.hidden_size, config.layernorm_epsilon)

    def forward(self, *args, **kwargs):
        out, bias = super().forward(*args, **kwargs)
        if bias is not None:
            raise ValueError(f"a {self._norm_name} needs add_bias_linear=False (no output bias)")
        return self.post_layernorm(out), None


class PostNormSelfAttention(_PostNormed, CachedRopeSelfAttention):
    """Self-attention whose output is normed (Gemma's ``post_attention_layernorm``) before the
    layer's residual add; weight at ``self_attention.post_layernorm.weight``."""

    _norm_name = "post-attention norm"


def _mlp_cls():
    from megatron.core.transformer.mlp import MLP

    return MLP


class PostNormMLP(_PostNormed, _mlp_cls()):
    """Megatron's MLP whose output is normed (Gemma's ``post_feedforward_layernorm``) before
    the layer's residual add; weight at ``mlp.post_layernorm.weight``."""

    _norm_name = "post-MLP norm"


def apply_gemma_model_hooks(model, options: GemmaOptions, hidden_size: int) -> None:
    """Gemma's model-level pieces on a built ``GPTModel``: the final norm a
    :class:`GemmaRMSNorm`, the embedding output times ``sqrt(hidden_size)`` (rounded to the
    model's dtype, as transformers' ``normalizer`` tensor), the logits soft-capped."""
    config = model.config
    decoder = getattr(model, "decoder", None)
    if decoder is not None and getattr(decoder, "final_layernorm", None) is not None:
        decoder.final_layernorm = GemmaRMSNorm(config, hidden_size, config.layernorm_epsilon)
    if getattr(model, "pre_process", False):
        # x * normalizer with normalizer a 0-dim tensor of x's dtype == x * (that value)
        scale = float(torch.tensor(hidden_size ** 0.5, dtype=config.params_dtype))

        def scale_embedding(_module, _inputs, output):
            return output * scale

        model.embedding.register_forward_hook(scale_embedding)
    cap = options.final_logit_softcap
    if cap is not None and getattr(model, "post_process", False):
        def cap_logits(_module, _inputs, output):
            logits, bias = output
            return softcap(logits, cap), bias

        model.output_layer.register_forward_hook(cap_logits)
