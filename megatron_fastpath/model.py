"""Llama-style Megatron ``GPTModel`` construction on our layer spec (CPU or GPU)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_fastpath.settings import FINITE_POSITIVE, POSITIVE, setting

__all__ = ["ModelConfig", "build_transformer_config", "build_gpt_model", "build_fastpath_gpt",
           "rope_config_for", "rope_config_of"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (the ``model`` config group): MoE layers when
    ``num_experts`` is set."""

    num_layers: int = setting(4, "transformer layers", POSITIVE)
    hidden_size: int = setting(128, "hidden size", POSITIVE)
    num_attention_heads: int = setting(4, "attention (query) heads", POSITIVE)
    num_query_groups: int = setting(2, "key/value head groups of GQA (== num_attention_heads for MHA)", POSITIVE)
    ffn_hidden_size: int = setting(352, "SwiGLU MLP hidden size", POSITIVE)
    vocab_size: int = setting(256, "vocabulary size", POSITIVE)
    rotary_base: float = setting(10000.0, "RoPE base (theta)", FINITE_POSITIVE)
    rotary_percent: float = setting(1.0, "share of each head's dimensions RoPE rotates", FINITE_POSITIVE)
    rope_scaling_factor: Optional[float] = setting(
        None, "Llama 3.1 RoPE frequency scaling factor (8.0); null: off", FINITE_POSITIVE)
    normalization: str = setting("RMSNorm", "normalization layer: RMSNorm | LayerNorm")
    kv_channels: Optional[int] = setting(
        None, "head dimension; null: hidden_size // num_attention_heads", POSITIVE)
    qk_layernorm: bool = setting(False, "normalize queries and keys per head (Qwen3's QK-norm)")
    seq_length: int = setting(4096, "the model's context length (documentation / real-shape configs)", POSITIVE)
    num_experts: Optional[int] = setting(None, "MoE experts per layer; null: a dense MLP", POSITIVE)
    moe_router_topk: int = setting(2, "experts each token is routed to (MoE)", POSITIVE)
    moe_ffn_hidden_size: Optional[int] = setting(
        None, "each expert's MLP hidden size; null: ffn_hidden_size", POSITIVE)
    init_method_std: float = setting(0.02, "standard deviation of the weights' random initialisation", FINITE_POSITIVE)


def build_transformer_config(model: ModelConfig, params_dtype=torch.float32, **overrides):
    """Megatron TransformerConfig of a Llama-style model (RMSNorm, SwiGLU, no biases, RoPE via
    the packed cache), CPU-initialised so it builds without CUDA."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size,
        kv_channels=model.kv_channels,
        qk_layernorm=model.qk_layernorm,
        normalization=model.normalization,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # Megatron requires it for PP > 1 (the p2p buffers' dtype); harmless at PP = 1.
        pipeline_dtype=params_dtype,
        init_method_std=model.init_method_std,
        cuda_graph_scope=[],  # whole layer (the 0.16.1 default "full" is deprecated)
    )
    if model.num_experts is not None:
        kwargs.update(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
        )
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    # GPTModel's rotary arguments, carried on the config as NeMo's GPTConfig and Bridge's
    # GPTModelProvider carry them (read by rope_config_of).
    config.rotary_base = model.rotary_base
    config.rotary_percent = model.rotary_percent
    config.rope_scaling = model.rope_scaling_factor is not None
    config.rope_scaling_factor = model.rope_scaling_factor or 8.0
    return config


def rope_config_for(model: ModelConfig):
    """The cache's RoPE settings of a ``model`` group: :func:`rope_config_of` its config."""
    return rope_config_of(build_transformer_config(model))


def rope_config_of(config):
    """The one place a ``RopeConfig`` is built from a Megatron ``TransformerConfig``.

    Reads what Megatron's ``RotaryEmbedding`` is given: ``kv_channels`` (default hidden /
    heads), ``rotary_interleaved`` (a TransformerConfig field) and the ``GPTModel`` rotary
    arguments, which NeMo's ``GPTConfig``, Bridge's ``GPTModelProvider`` and
    :func:`build_transformer_config` carry on the config: ``rotary_percent``, ``rotary_base``,
    ``seq_len_interpolation_factor``, ``rope_scaling`` / ``rope_scaling_factor`` (Llama 3.1).
    dim = kv_channels * rotary_percent, as RotaryEmbedding computes it."""
    from megatron_fastpath.packed_seq.rope import Llama3RopeScaling, RopeConfig

    kv_channels = config.kv_channels or config.hidden_size // config.num_attention_heads
    return RopeConfig(
        dim=int(kv_channels * getattr(config, "rotary_percent", 1.0)),
        base=float(getattr(config, "rotary_base", 10000)),
        interleaved=bool(getattr(config, "rotary_interleaved", False)),
        seq_len_interpolation_factor=getattr(config, "seq_len_interpolation_factor", None),
        # Megatron's rope_scaling takes only the factor; the other three are _apply_scaling's
        # defaults, which are Llama3RopeScaling's.
        llama3=(Llama3RopeScaling(getattr(config, "rope_scaling_factor", 8.0))
                if getattr(config, "rope_scaling", False) else None),
    )


def build_fastpath_gpt(tcfg, cache, arch: ModelConfig, *, backend: str, linear_impl: Optional[str] = None,
                       lora=None, offload=None, tie_embeddings: bool = False,
                       sliding_window: Optional[int] = None, window_layers: Optional[tuple] = None,
                       gemma=None, lora_adapters=None):
    """The one model builder of the package (main job, Hugging Face loading): ``GPTModel`` of
    architecture ``arch`` on the fastpath layer spec over ``cache``, with the switched-on
    features as spec transforms (``lora``: a ``LoRAConfig``, ``offload``: an
    ``OffloadConfig``), this pipeline stage's part, on the cache's device. Weights are
    Megatron's initialisation; when ``tcfg.perform_initialization`` is False (a loader will
    overwrite every weight) the tensor-parallel marks Megatron's init would set are set here.
    ``sliding_window`` / ``window_layers``: the attention window of the layers it applies to
    (:func:`~megatron_fastpath.layer_spec.get_fastpath_layer_spec`). ``gemma``: a
    :class:`~megatron_fastpath.gemma.GemmaOptions` (Gemma 2's layer, scaled embeddings, final
    norm and soft-capped logits). ``lora_adapters``: K adapters of ``lora`` trained at once
    (a count or K names: :func:`~megatron_fastpath.lora.with_lora`'s ``adapters``)."""
    from megatron.core import parallel_state as ps

    from megatron_fastpath.layer_spec import get_fastpath_layer_spec

    spec = get_fastpath_layer_spec(
        cache, backend=backend, num_experts=arch.num_experts, qk_layernorm=arch.qk_layernorm,
        normalization=arch.normalization, linear_impl=linear_impl, params_dtype=tcfg.params_dtype,
        sliding_window=sliding_window, window_layers=window_layers, gemma=gemma)
    if lora is not None:
        from megatron_fastpath.lora import with_lora

        spec = with_lora(spec, lora, adapters=lora_adapters)
    elif lora_adapters is not None:
        raise ValueError("lora_adapters given without a LoRAConfig (lora=...)")
    if offload is not None:
        from megatron_fastpath.offload import with_activation_offload

        spec = with_activation_offload(spec, offload)
    first = last = True  # one process without Megatron's parallel state (library use)
    if ps.model_parallel_is_initialized():
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    model = build_gpt_model(
        tcfg, spec, arch.vocab_size, cache.config.max_tokens,
        share_embeddings_and_output_weights=tie_embeddings, pre_process=first, post_process=last)
    if gemma is not None:
        from megatron_fastpath.gemma import apply_gemma_model_hooks

        apply_gemma_model_hooks(model, gemma, arch.hidden_size)
    if not tcfg.perform_initialization:
        from megatron_fastpath.compat.tensor_parallel import mark_tensor_parallel_weights

        mark_tensor_parallel_weights(model)
    return model.to(cache.device)


def build_gpt_model(config, layer_spec, vocab_size: int, max_sequence_length: int, **kwargs):
    """``GPTModel`` with ``position_embedding_type="none"``: RoPE comes from the packed cache."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    kwargs.setdefault("share_embeddings_and_output_weights", False)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="none",
        **kwargs,
    )
