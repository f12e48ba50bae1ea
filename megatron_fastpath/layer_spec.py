"""Megatron ``TransformerLayer`` specs whose attention reads the packed-sequence cache.

Drop-in for ``GPTModel(transformer_layer_spec=...)``: the spec is Megatron's own local (or
Transformer Engine) GPT layer spec with two entries swapped, as data:

* ``self_attention.module`` -> :class:`CachedRopeSelfAttention` (RoPE from the cache), and
* ``self_attention.submodules.core_attention`` -> :class:`PackedCoreAttention` bound to the cache.

Build the model with ``position_embedding_type="none"`` (RoPE is applied from the cache; on CPU
Megatron 0.16.1's ``RotaryEmbedding`` would move itself to CUDA) or ``"rope"`` on GPU (its
per-model embedding is then computed but not used), and call it with
``attention_mask=None, packed_seq_params=batch.packed_seq_params`` (required: the batch's masks
and RoPE ride in it).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_fastpath import compat  # noqa: F401  (refuses megatron-core < 0.16.1 at import)
from megatron_fastpath.attention.backend import backend_of
from megatron_fastpath.attention.core_attention import PackedCoreAttention

__all__ = ["get_fastpath_layer_spec", "megatron_base_spec"]


def get_fastpath_layer_spec(
    cache,
    backend: str = "auto",
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
    num_experts: Optional[int] = None,
    linear_impl: Optional[str] = None,
    moe_spec_kwargs: Optional[dict] = None,
    params_dtype=None,
    sliding_window: Optional[int] = None,
    window_layers: Optional[tuple] = None,
    gemma=None,
):
    """Return a ``ModuleSpec`` for a Megatron ``TransformerLayer`` reading ``cache``.

    Args:
        cache: the :class:`PackedSeqCache` shared by all layers (one per device).
        backend: core attention backend: "sdpa" (CPU default), "flex", "flash", "te", "auto".
            A backend whose package is missing is refused here, before any model is built; one
            :func:`~megatron_fastpath.attention.backend.resolve_backend` returned (a
            ``ResolvedBackend``, e.g. the main job's ``JobConfig.attention_backend``) is taken
            as it is.
        normalization: "RMSNorm" (Llama) or "LayerNorm".
        qk_layernorm: normalise q and k per head.
        num_experts: None for a dense SwiGLU/GELU MLP (per TransformerConfig); an int selects the
            sort/count MoE layer (:mod:`megatron_fastpath.moe`).
        linear_impl: "local" (Megatron's own linears, CPU-capable) or "te" (Transformer Engine
            linears, needed for FP8); default "te" when backend resolves to "te", else "local".
        moe_spec_kwargs: extra keyword arguments for :func:`megatron_fastpath.moe.get_moe_mlp_spec`.
        params_dtype: the model's dtype, when known: te / flash on CUDA in float32 are refused
            here, before any model is built (the attention checks it again when built).
        sliding_window / window_layers: the attention window (tokens) of the layers
            ``window_layers`` lists (0-based global indices; None: every layer), None: none
            (:class:`PackedCoreAttention`'s, e.g. a Hugging Face checkpoint's).
        gemma: a :class:`~megatron_fastpath.gemma.GemmaOptions` (Gemma 2 / 3's layer): every norm a
            ``(1 + weight)`` float32 :class:`~megatron_fastpath.gemma.GemmaRMSNorm`, the
            attention and MLP outputs normed before the residual add, the attention scores
            soft-capped (``gemma.attention_softcap``; refused with the te backend, here). Local
            linears only (TE's linear_qkv / linear_fc1 fuse a norm without the (1 + weight)
            float32 form and there is no post-norm slot).
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_fastpath.attention.self_attention import CachedRopeSelfAttention

    if normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"normalization must be 'RMSNorm' or 'LayerNorm'; got {normalization!r}")
    resolved = backend_of(  # resolved once: the layers take it as it is (a ResolvedBackend)
        backend, cache.device, cache.config.max_tokens, cache.config.sdpa_max_tokens,
        dtype=params_dtype, context_parallel_size=cache.config.context_parallel_size,
    )
    linear_impl = linear_impl or ("te" if resolved == "te" else "local")
    if linear_impl not in ("local", "te"):
        raise ValueError(f"linear_impl must be 'local' or 'te'; got {linear_impl!r}")
    if gemma is not None:
        _check_gemma(gemma, resolved, linear_impl, num_experts)

    base = megatron_base_spec(linear_impl, num_experts=num_experts, qk_layernorm=qk_layernorm,
                              normalization=normalization)

    attn = base.submodules.self_attention
    core_params = {"cache": cache, "backend": resolved}
    if sliding_window is not None:
        core_params.update(sliding_window=sliding_window, window_layers=window_layers)
    attention_cls = CachedRopeSelfAttention
    if gemma is not None:
        from megatron_fastpath.gemma import PostNormSelfAttention

        attention_cls = PostNormSelfAttention
        if gemma.attention_softcap is not None:
            core_params["softcap"] = gemma.attention_softcap
        if gemma.local_rope_layers:
            core_params["local_rope_layers"] = tuple(gemma.local_rope_layers)
    core = ModuleSpec(module=PackedCoreAttention, params=core_params)
    attn_subs = dataclasses.replace(attn.submodules, core_attention=core)
    if gemma is not None and qk_layernorm:  # Gemma 3's q_norm / k_norm: (1 + weight) norms
        from megatron_fastpath.gemma import GemmaRMSNorm

        attn_subs = dataclasses.replace(attn_subs, q_layernorm=GemmaRMSNorm, k_layernorm=GemmaRMSNorm)
    self_attention = ModuleSpec(
        module=attention_cls,
        params=dict(attn.params),
        submodules=attn_subs,
    )
    mlp = base.submodules.mlp
    if num_experts is not None:
        from megatron_fastpath.moe.spec import get_moe_mlp_spec

        mlp = get_moe_mlp_spec(num_experts=num_experts, **(moe_spec_kwargs or {}))
    norms = {}
    if gemma is not None:
        from megatron_fastpath.compat.spec import replace_dense_mlp
        from megatron_fastpath.gemma import GemmaRMSNorm, PostNormMLP

        mlp = replace_dense_mlp(mlp, module=PostNormMLP)
        norms = dict(input_layernorm=GemmaRMSNorm, pre_mlp_layernorm=GemmaRMSNorm)
    submodules = dataclasses.replace(base.submodules, self_attention=self_attention, mlp=mlp,
                                     **norms)
    return ModuleSpec(module=base.module, params=dict(base.params), submodules=submodules)


def _check_gemma(gemma, backend: str, linear_impl: str, num_experts) -> None:
    """Refuse what Gemma 2's layer cannot be built on, before any model exists (the soft-cap
    with its backend: the attention's own check, run here before any layer is built)."""
    PackedCoreAttention._checked_softcap(gemma.attention_softcap, backend)
    if linear_impl != "local":
        raise ValueError(
            "Gemma's layer with linear_impl='te': Transformer Engine's linear_qkv / linear_fc1 "
            "fuse the input / pre-MLP norm (not Gemma's (1 + weight) norm in float32) and the "
            "layer has no post-attention / post-MLP norm slot; use linear_impl='local'")
    if num_experts is not None:
        raise ValueError("Gemma's layer is dense: num_experts must be None")


def megatron_base_spec(
    linear_impl: str,
    num_experts: Optional[int] = None,
    qk_layernorm: bool = False,
    normalization: str = "RMSNorm",
):
    """Megatron's own GPT layer spec that the fastpath specs edit: Transformer Engine's
    (``linear_impl="te"``; refused here, naming the fix, when TE is missing) or the local one.

    With ``num_experts`` the spec is Megatron's MoE variant, whose pre-MLP norm is a real norm
    (the TE dense MLP fuses it into linear_fc1); the caller replaces the MLP slot itself."""
    from megatron.core.models.gpt import gpt_layer_specs

    if linear_impl == "te":
        from megatron_fastpath._optional import require

        require("transformer_engine.pytorch", "linear_impl='te'", "linear_impl='local'")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None,
            qk_layernorm=qk_layernorm,
        )
    if linear_impl != "local":
        raise ValueError(f"linear_impl must be 'local' or 'te'; got {linear_impl!r}")
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, qk_layernorm=qk_layernorm, normalization=normalization
    )
