"""Hugging Face ``config.json`` -> the fastpath model description (no transformers import).

:func:`read_hf_config` parses and validates a checkpoint's ``config.json`` into a frozen
:class:`HFModelSpec`; unsupported architectures and rope types are refused here, before any
tensor is read, with the list of what is supported. A sliding window is kept on the spec
(:attr:`HFModelSpec.sliding_window`, on the layers :attr:`HFModelSpec.window_layers`) and served
by the packed attention of those layers (``PackedCoreAttention(sliding_window=...)``); LongRoPE's
pre-training context is checked against the data's longest sequence by
:meth:`HFModelSpec.check_sequence_bound` (the job's data, or a cache's ``max_seqlen``). The spec
derives

* the :class:`~megatron_fastpath.model.ModelConfig` (shape) and the extra Megatron
  ``TransformerConfig`` fields (``layernorm_epsilon``, ``add_qkv_bias``, router options), and
* the packed cache's :class:`~megatron_fastpath.packed_seq.RopeConfig` (Llama 3.1, YaRN or
  Phi-3's LongRoPE scaling; a partial rotary dim for Phi-3).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:
    from megatron_fastpath.packed_seq.rope import (
        Llama3RopeScaling, LongRopeScaling, RopeConfig, YarnRopeScaling)

__all__ = ["HFModelSpec", "SUPPORTED", "UnsupportedCheckpointError", "HFConfigError", "read_hf_config"]

# model_type -> (family, is_moe). Each family's weight names live in hf/convert.py.
SUPPORTED = {
    "llama": ("llama", False),
    "mistral": ("llama", False),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "mixtral": ("mixtral", True),
    "qwen3_moe": ("qwen3_moe", True),
    "phi3": ("phi3", False),
    "gemma2": ("gemma2", False),
    "gemma3_text": ("gemma3", False),
}
GEMMA = ("gemma2", "gemma3")  # the families built with megatron_fastpath.gemma
SUPPORTED_TEXT = (
    "Llama 2/3/3.1/3.2 (model_type llama), Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE (every "
    "layer MoE), Phi-3 / Phi-3.5 (model_type phi3); rope_scaling none, default, llama3 or yarn "
    "(Phi-3: none or longrope, longrope only where no sequence of the data is longer than "
    "original_max_position_embeddings); sliding windows (Mistral, Qwen2/3 use_sliding_window on "
    "the layers max_window_layers / layer_types mark, Phi-3), served by every attention backend "
    "(with context parallelism: the sdpa backend only); Gemma 2 (model_type gemma2: attention "
    "logit soft-capping on the sdpa, flex and flash backends, not te); Gemma 3 text "
    "(model_type gemma3_text: rope_scaling none or linear; sdpa, flex and flash backends)"
)
# Gemma 3's multimodal config (model_type gemma3) is refused with this reason
GEMMA3_REASON = (
    "the multimodal Gemma3ForConditionalGeneration config (vision tower, text_config nested); "
    "load a text-only checkpoint (model_type gemma3_text, Gemma3ForCausalLM)")
# transformers' mask of sliding-window layers keeps key kv of query q iff
# ``kv_idx > q_idx - sliding_window`` (masking_utils.sliding_window_overlay, 4.57) on top of the
# causal ``kv_idx <= q_idx`` (positions inside the sequence): the packed attention of a
# windowed layer keeps exactly those keys (PackedCoreAttention's ``sliding_window``).


class UnsupportedCheckpointError(ValueError):
    """The checkpoint's config.json describes something this package cannot load."""


class HFConfigError(ValueError):
    """A field of the checkpoint's config.json has a value no model can have."""


@dataclasses.dataclass(frozen=True)
class HFModelSpec:
    """What the fastpath needs from a Hugging Face decoder config (all host values).

    family: llama | qwen2 | qwen3 | mixtral | qwen3_moe | phi3 | gemma2 | gemma3 (Mistral loads
        as llama; phi3: fused ``qkv_proj`` / ``gate_up_proj`` tensors; gemma2 / gemma3
        (``gemma3_text``): :mod:`megatron_fastpath.gemma`'s layer).
    head_dim: per-head channels (config ``head_dim`` or hidden / heads).
    qkv_bias: q/k/v projections carry biases (Qwen2). qk_norm: per-head RMSNorm of q and k
    (Qwen3). tie_embeddings: the LM head is the embedding matrix.
    rope_scaling: Llama 3.1 (``rope_type: llama3``), YaRN (``yarn``) or Phi-3's LongRoPE
        (``longrope``, short factors: only where no sequence is longer than its
        ``original_max_position``, :meth:`check_sequence_bound`) RoPE scaling, None: none.
    rotary_percent: share of each head's channels that are rotated (Phi-3's
        ``partial_rotary_factor``), 1: all.
    sliding_window: the attention window of the checkpoint's sliding-window layers (Mistral's
        ``sliding_window``; Qwen's with ``use_sliding_window``), None: none; config.json is
        exported unchanged (``raw``).
    window_layers: the 0-based indices of the layers attending through ``sliding_window``
        (transformers' ``sliding_attention`` layers; every layer but for Qwen2 / Qwen3's
        ``layer_types`` / ``max_window_layers``), () without a window.
    softmax_scale: the attention's softmax scale when not head_dim ** -0.5 (Gemma 2's
        ``query_pre_attn_scalar ** -0.5``), None: the default.
    attn_softcap / final_softcap: Gemma 2's ``attn_logit_softcapping`` (attention scores) and
        ``final_logit_softcapping`` (LM head logits), None: off.
    rope_local_theta / local_rope_layers: Gemma 3's ``rope_local_base_freq`` and the 0-based
        layers rotating with it (its sliding layers; the cache's ``rope_local``,
        :meth:`rope_config_local`), None / (): one RoPE.
    linear_rope_factor: Gemma 3's ``rope_scaling`` ``linear`` factor of the global RoPE
        (transformers divides the inverse frequencies by it; served as positions / factor,
        ``RopeConfig.seq_len_interpolation_factor``), None: none.
    num_experts / topk / moe_ffn_hidden_size / norm_topk_prob / aux_loss_coeff: MoE only.
    """

    path: str
    model_type: str
    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: Optional[Union[Llama3RopeScaling, YarnRopeScaling, LongRopeScaling]] = None
    rotary_percent: float = 1.0
    sliding_window: Optional[int] = None
    window_layers: tuple = ()
    softmax_scale: Optional[float] = None
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    rope_local_theta: Optional[float] = None
    local_rope_layers: tuple = ()
    linear_rope_factor: Optional[float] = None
    num_experts: Optional[int] = None
    topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    norm_topk_prob: bool = True
    aux_loss_coeff: float = 0.0
    raw: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def model_config(self):
        """The ``model`` group dataclass of the main job for this checkpoint."""
        from megatron_fastpath.model import ModelConfig

        return ModelConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size, vocab_size=self.vocab_size,
            rotary_base=self.rope_theta, rotary_percent=self.rotary_percent,
            # Megatron's rope_scaling is Llama 3.1's; the cache's RopeConfig carries YaRN
            rope_scaling_factor=self.rope_scaling.factor if self._llama3 else None,
            kv_channels=self.head_dim, qk_layernorm=self.qk_norm,
            seq_length=self.max_position_embeddings, num_experts=self.num_experts,
            moe_router_topk=self.topk, moe_ffn_hidden_size=self.moe_ffn_hidden_size,
        )

    def transformer_overrides(self) -> dict:
        """TransformerConfig fields beyond ``build_transformer_config``'s Llama defaults."""
        out = dict(layernorm_epsilon=self.rms_norm_eps, add_qkv_bias=self.qkv_bias,
                   perform_initialization=False)  # every weight is overwritten by the loader
        if self.family in GEMMA:
            from megatron_fastpath.gemma import gelu_tanh

            out.update(activation_func=gelu_tanh, softmax_scale=self.softmax_scale)
        if self.is_moe:
            # HF: softmax over all experts, top-k, renormalise iff norm_topk_prob. Megatron:
            # pre_softmax=False takes top-k logits then softmax (== renormalised), True keeps
            # the full-softmax probabilities (== not renormalised).
            out.update(moe_router_pre_softmax=not self.norm_topk_prob,
                       moe_aux_loss_coeff=self.aux_loss_coeff,
                       moe_router_load_balancing_type="aux_loss" if self.aux_loss_coeff else "none")
        return out

    def gemma_options(self):
        """The builder's :class:`~megatron_fastpath.gemma.GemmaOptions` (Gemma 2), else None."""
        if self.family not in GEMMA:
            return None
        from megatron_fastpath.gemma import GemmaOptions

        return GemmaOptions(attention_softcap=self.attn_softcap,
                            final_logit_softcap=self.final_softcap,
                            local_rope_layers=tuple(self.local_rope_layers))

    def rope_config_local(self):
        """The cache's second RoPE (``PackedSeqConfig.rope_local``): Gemma 3's sliding layers'
        ``rope_local_base_freq`` with transformers' default rope type; None without one."""
        if self.rope_local_theta is None:
            return None
        from megatron_fastpath.packed_seq.rope import RopeConfig

        return RopeConfig(dim=int(self.head_dim * self.rotary_percent), base=self.rope_local_theta)

    @property
    def _llama3(self) -> bool:
        from megatron_fastpath.packed_seq.rope import Llama3RopeScaling

        return isinstance(self.rope_scaling, Llama3RopeScaling)

    @property
    def _longrope(self) -> Optional[LongRopeScaling]:
        from megatron_fastpath.packed_seq.rope import LongRopeScaling

        return self.rope_scaling if isinstance(self.rope_scaling, LongRopeScaling) else None

    @property
    def max_sequence(self) -> Optional[int]:
        """The longest sequence this checkpoint is served exactly for (LongRoPE's short-factor
        context), None: no limit. A sliding window sets none: the windowed layers attend
        through it (:attr:`window_layers`)."""
        return self._longrope.original_max_position if self._longrope else None

    def window_of_layer(self, layer_number: int) -> Optional[int]:
        """The window of Megatron's (1-based, global) ``layer_number``, None: full attention."""
        return self.sliding_window if layer_number - 1 in self.window_layers else None

    def rope_config(self) -> RopeConfig:
        from megatron_fastpath.packed_seq.rope import RopeConfig, YarnRopeScaling

        scaling = self.rope_scaling
        return RopeConfig(dim=int(self.head_dim * self.rotary_percent), base=self.rope_theta,
                          seq_len_interpolation_factor=self.linear_rope_factor,
                          llama3=scaling if self._llama3 else None,
                          yarn=scaling if isinstance(scaling, YarnRopeScaling) else None,
                          longrope=self._longrope)

    def check_sequence_bound(self, longest: int, what: str, fix: str) -> None:
        """Refuse a LongRoPE pre-training context shorter than the longest sequence the run can
        see (a sliding window has no bound: the windowed layers attend through it).

        longest: the bound on every sequence's tokens; what: where that bound comes from
        (``"data.max_tokens=8192"``); fix: how to lower it (to :attr:`max_sequence`). LongRoPE
        is served with its short factors, which are transformers' exactly when every sequence
        has at most ``original_max_position`` tokens."""
        where = os.path.join(self.path, "config.json")
        lr = self._longrope
        if lr is not None and longest > lr.original_max_position:
            orig = lr.original_max_position
            raise UnsupportedCheckpointError(
                f"{where}: rope_scaling longrope with original_max_position_embeddings={orig} "
                f"({self.model_type}) but a sequence can have {longest} tokens ({what}): "
                f"transformers rotates a forward whose sequence is longer than {orig} tokens with "
                f"the long factors and a shorter one with the short factors, and a packed batch "
                f"mixes lengths, so only the short factors are served, exact on sequences of at "
                f"most {orig} tokens; {fix}")
    def check_parallel(self, tp: int, ep: int = 1) -> None:
        """Refuse TP / EP sizes that do not divide the heads, groups, FFN, vocab or experts."""
        where = os.path.join(self.path, "config.json")
        need = {"num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_query_groups, "vocab_size": self.vocab_size}
        if not self.is_moe:  # experts are not TP-sharded (expert_tensor_parallel_size 1)
            need["intermediate_size"] = self.ffn_hidden_size
        for key, value in need.items():
            if value % tp:
                raise ValueError(
                    f"{where}: {key}={value} is not divisible by tensor_model_parallel_size={tp}; "
                    f"choose a TP size dividing it")
        if ep > 1 and (not self.is_moe or self.num_experts % ep):
            raise ValueError(
                f"{where}: {self.num_experts or 0} experts cannot be split over "
                f"expert_model_parallel_size={ep}")


def _get(cfg: dict, key: str, where: str, default=...):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise UnsupportedCheckpointError(f"{where}: required key '{key}' is missing")
    return default


def _int(cfg: dict, key: str, where: str, default=..., minimum: int = 1) -> int:
    """A whole-number field >= ``minimum`` (a float, bool or string is refused, not truncated)."""
    value = _get(cfg, key, where, default)
    if type(value) is not int or value < minimum:
        raise HFConfigError(f"{where}: field '{key}' is {value!r}: must be a whole number >= {minimum}")
    return value


def _float(cfg: dict, key: str, where: str, default=..., positive: bool = True) -> float:
    """A finite number field (> 0 when ``positive``, else >= 0)."""
    import math

    value = _get(cfg, key, where, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (value <= 0 if positive else value < 0)):
        raise HFConfigError(f"{where}: field '{key}' is {value!r}: must be a finite number "
                            f"{'> 0' if positive else '>= 0'}")
    return float(value)


def _refuse(where: str, what: str) -> None:
    raise UnsupportedCheckpointError(f"{where}: {what} is not supported. Supported: {SUPPORTED_TEXT}")


def _rotary_percent(cfg: dict, mt: str, head_dim: int, where: str) -> float:
    """Phi-3's ``partial_rotary_factor`` (transformers rotates the first
    ``int(head_dim * factor)`` channels of each head); refused on the other families."""
    if "partial_rotary_factor" not in cfg or cfg["partial_rotary_factor"] is None:
        return 1.0
    factor = _float(cfg, "partial_rotary_factor", where)
    if factor == 1.0:
        return 1.0
    if mt != "phi3":
        _refuse(where, f"partial_rotary_factor={cfg['partial_rotary_factor']} on model_type {mt!r}")
    dim = int(head_dim * factor)
    if factor > 1.0 or dim <= 0 or dim % 2:
        raise HFConfigError(f"{where}: field 'partial_rotary_factor' is {factor}: the rotary dim "
                            f"int(head_dim={head_dim} * {factor}) = {dim} must be even, > 0 and "
                            f"<= head_dim")
    return factor


def _longrope(cfg: dict, rs: dict, head_dim: int, rotary_percent: float, where: str):
    """Phi-3's LongRoPE as transformers 4.57 reads it (``_compute_longrope_parameters``): the
    pre-training context is the top-level ``original_max_position_embeddings`` (Phi3Config
    default 4096) and then factor = max_position_embeddings / original; without it, original =
    max_position_embeddings and factor = rope_scaling ``factor``. attention_factor (if not
    given): sqrt(1 + ln(factor) / ln(original)) for factor > 1, else 1."""
    import math

    from megatron_fastpath.packed_seq.rope import LongRopeScaling

    at = f"{where} (rope_scaling)"
    dim = int(head_dim * rotary_percent)
    for key in ("short_factor", "long_factor"):
        value = rs.get(key)
        if (not isinstance(value, list) or len(value) != dim // 2
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in value)):
            raise HFConfigError(f"{at}: field '{key}' is {value!r:.80}: must be a list of "
                                f"{dim // 2} numbers (one per rotary frequency)")
    max_pos = _int(cfg, "max_position_embeddings", where, 4096)
    original = cfg.get("original_max_position_embeddings", 4096)
    if original:
        original = _int(cfg, "original_max_position_embeddings", where)
        factor = max_pos / original
    else:
        original, factor = max_pos, _float(rs, "factor", at)
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    else:
        attention_factor = _float(rs, "attention_factor", at)
    if attention_factor != 1.0 and rotary_percent != 1.0:
        _refuse(where, f"longrope's attention factor ({attention_factor:.6g}) with "
                f"partial_rotary_factor={rotary_percent} (transformers scales only the rotated "
                "channels' cos / sin, which is not a softmax scale)")
    try:
        return LongRopeScaling(short_factor=tuple(rs["short_factor"]), original_max_position=original,
                               attention_factor=attention_factor)
    except ValueError as exc:
        raise HFConfigError(f"{at}: {exc}") from None


def _rope_scaling(cfg: dict, where: str, mt: str = "", head_dim: int = 0,
                  rotary_percent: float = 1.0
                  ) -> Optional[Union[Llama3RopeScaling, YarnRopeScaling, LongRopeScaling]]:
    from megatron_fastpath.packed_seq.rope import Llama3RopeScaling, YarnRopeScaling

    rs = cfg.get("rope_scaling")
    if not rs:
        return None
    if not isinstance(rs, dict):
        raise HFConfigError(f"{where}: field 'rope_scaling' is {rs!r:.80}: must be an object or null")
    kind = rs.get("rope_type", rs.get("type"))
    if mt == "phi3":  # Phi3Config renames type su / yarn to longrope and accepts nothing else
        if rs.get("type", kind) in ("su", "yarn", "longrope"):
            return _longrope(cfg, rs, head_dim, rotary_percent, where)
        _refuse(where, f"rope_scaling type {kind!r} on Phi-3 (supported: none, longrope)")
    if kind == "default":
        return None
    if kind not in ("llama3", "yarn"):
        _refuse(where, f"rope_scaling type {kind!r} (supported rope types: none, default, llama3, yarn)")
    at = f"{where} (rope_scaling)"
    try:
        if kind == "llama3":
            return Llama3RopeScaling(
                factor=_float(rs, "factor", at), low_freq_factor=_float(rs, "low_freq_factor", at, 1.0),
                high_freq_factor=_float(rs, "high_freq_factor", at, 4.0),
                original_max_position=_int(rs, "original_max_position_embeddings", at, 8192))
        # transformers' _compute_yarn_parameters (modeling_rope_utils.py, 4.57): the original
        # context falls back to max_position_embeddings; beta_fast / beta_slow `or` 32 / 1;
        # mscale / mscale_all_dim count only when both are truthy; truncate defaults to true.
        original = rs.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")
        if original is None:
            raise UnsupportedCheckpointError(
                f"{at}: yarn needs 'original_max_position_embeddings' (the pre-training context) "
                "or, as transformers falls back to, the config's 'max_position_embeddings'")
        truncate = rs.get("truncate", True)
        if not isinstance(truncate, bool):
            raise HFConfigError(f"{at}: field 'truncate' is {truncate!r}: must be true or false")
        return YarnRopeScaling(
            factor=_float(rs, "factor", at), original_max_position=original,
            beta_fast=rs.get("beta_fast") or 32.0, beta_slow=rs.get("beta_slow") or 1.0,
            attention_factor=rs.get("attention_factor"), mscale=rs.get("mscale") or None,
            mscale_all_dim=rs.get("mscale_all_dim") or None, truncate=truncate)
    except (HFConfigError, UnsupportedCheckpointError):
        raise
    except ValueError as exc:  # values each fine, together not (low_freq_factor >= high)
        raise HFConfigError(f"{at}: {exc}") from None


def _sliding_window(cfg: dict, mt: str, where: str) -> tuple:
    """(window, 0-based windowed layers) of the checkpoint as transformers 4.57 reads the
    config, (None, ()) when no layer has one: MistralConfig ``sliding_window`` (default 4096, null:
    none) on every layer, MixtralConfig's (default none); Qwen2 / Qwen3 / Qwen3-MoE
    ``sliding_window`` (default 4096) only with ``use_sliding_window``, on the layers
    ``layer_types`` marks ``sliding_attention`` (default: index >= ``max_window_layers``,
    default 28; Qwen3-MoE: every layer)."""
    if mt == "mistral":
        window = cfg.get("sliding_window", 4096)
    elif mt in ("mixtral", "phi3"):  # Phi3Config: default none, every layer
        window = cfg.get("sliding_window")
    elif mt in ("qwen2", "qwen3", "qwen3_moe"):
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
    elif mt in ("gemma2", "gemma3_text"):  # default 4096 on the layers layer_types marks
        window = cfg.get("sliding_window", 4096)
    else:  # Llama: transformers reads no window (a stray use_sliding_window is refused, as before)
        if cfg.get("use_sliding_window"):
            _refuse(where, f"use_sliding_window=true on model_type {mt!r}")
        return None, ()
    if window is None:
        return None, ()
    window = _int({"sliding_window": window}, "sliding_window", where)
    layers = _int(cfg, "num_hidden_layers", where)
    if mt in ("qwen2", "qwen3", "gemma2", "gemma3_text"):  # where layer_types says sliding
        types = cfg.get("layer_types")
        if types is None and mt in ("gemma2", "gemma3_text"):
            types = _gemma_layer_types(cfg, mt, layers, where)
        elif types is None:
            first = _int(cfg, "max_window_layers", where, 28, minimum=0)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers:
            raise HFConfigError(f"{where}: field 'layer_types' must list one type per layer "
                                f"({layers}); got {types!r}")
        windowed = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        return (window, windowed) if windowed else (None, ())
    return window, tuple(range(layers))


def _gemma_layer_types(cfg: dict, mt: str, layers: int, where: str) -> list:
    """Gemma2Config: sliding on every other layer from the first; Gemma3TextConfig: on all but
    every ``sliding_window_pattern``-th (default 6) -- ``(i + 1) % pattern`` in both."""
    pattern = 2 if mt == "gemma2" else _int(cfg, "sliding_window_pattern", where, 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _check_attention(cfg: dict, mt: str, where: str) -> None:
    if mt in ("gemma2", "gemma3_text"):  # Gemma configs read hidden_activation, not hidden_act
        name = "Gemma 2" if mt == "gemma2" else "Gemma 3"
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            _refuse(where, f"hidden_activation {cfg.get('hidden_activation')!r} on {name} "
                    "(GeGLU with gelu_pytorch_tanh only)")
        if cfg.get("attention_bias"):
            _refuse(where, f"attention_bias on {name}")
        if cfg.get("use_bidirectional_attention"):
            _refuse(where, "use_bidirectional_attention=true on Gemma 3 (causal attention only)")
        return
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse(where, f"hidden_act {cfg.get('hidden_act')!r} (SwiGLU with silu only)")
    if mt in ("llama", "mistral") and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        _refuse(where, "attention_bias / mlp_bias on a Llama-family model")
    if mt == "qwen3" and cfg.get("attention_bias"):
        _refuse(where, "attention_bias on Qwen3")
    if mt == "phi3" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        _refuse(where, "attention_bias / mlp_bias on Phi-3")


def _without_linear(cfg: dict, mt: str) -> dict:
    """Gemma 3's ``linear`` rope_scaling is read by :func:`_gemma_fields`, not as a scaling."""
    rs = cfg.get("rope_scaling")
    if mt == "gemma3_text" and isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "linear":
        return {k: v for k, v in cfg.items() if k != "rope_scaling"}
    return cfg


def _gemma_fields(cfg: dict, mt: str, layers: int, where: str) -> dict:
    """Gemma2Config / Gemma3TextConfig (transformers 4.57): query_pre_attn_scalar (default 256;
    softmax scale its ** -0.5), attn_logit_softcapping and final_logit_softcapping (Gemma 2
    default 50.0 / 30.0, Gemma 3 none; null: off); Gemma 3: rope_local_base_freq (default
    10000) on its sliding layers (layer_types), a ``linear`` rope_scaling factor on the others."""
    gemma2 = mt == "gemma2"

    def cap(key, default):
        value = cfg.get(key, default)
        return None if value is None else _float({key: value}, key, where)

    scalar = _float(cfg, "query_pre_attn_scalar", where, 256)
    out = dict(softmax_scale=scalar ** -0.5,
               attn_softcap=cap("attn_logit_softcapping", 50.0 if gemma2 else None),
               final_softcap=cap("final_logit_softcapping", 30.0 if gemma2 else None))
    if not gemma2:
        types = cfg.get("layer_types") or _gemma_layer_types(cfg, mt, layers, where)
        if not isinstance(types, list) or len(types) != layers:
            raise HFConfigError(f"{where}: field 'layer_types' must list one type per layer "
                                f"({layers}); got {types!r}")
        out.update(rope_local_theta=_float(cfg, "rope_local_base_freq", where, 10000.0),
                   local_rope_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"))
        rs = cfg.get("rope_scaling")
        if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "linear":
            out["linear_rope_factor"] = _float(rs, "factor", f"{where} (rope_scaling)")
    return out


def _moe_fields(cfg: dict, mt: str, where: str) -> dict:
    norm = True if mt == "mixtral" else bool(cfg.get("norm_topk_prob", False))
    if mt != "mixtral":
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            _refuse(where, "Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step)")
    aux = float(cfg.get("router_aux_loss_coef", 0.0)) if cfg.get("output_router_logits") else 0.0
    experts = _int(cfg, "num_local_experts" if mt == "mixtral" else "num_experts", where)
    ffn = _int(cfg, "intermediate_size" if mt == "mixtral" else "moe_intermediate_size", where)
    topk = _int(cfg, "num_experts_per_tok", where)
    if topk > experts:
        raise HFConfigError(f"{where}: field 'num_experts_per_tok' is {topk}: must be <= the "
                            f"{experts} experts")
    return dict(num_experts=experts, topk=topk, moe_ffn_hidden_size=ffn, norm_topk_prob=norm,
                aux_loss_coeff=aux)


def read_hf_config(path: str) -> HFModelSpec:
    """Parse ``<path>/config.json``; raise before any weight is touched if unsupported."""
    where = os.path.join(path, "config.json")
    if os.path.exists(where) and not os.path.isfile(where):  # a FIFO would block the open for ever
        raise HFConfigError(f"{where} is not a regular file (a directory, FIFO or device): "
                            "model.path must be a Hugging Face checkpoint directory")
    if not os.path.isfile(where):
        raise FileNotFoundError(f"{where} not found: model.path must be a Hugging Face checkpoint "
                                "directory (config.json + *.safetensors)")
    try:
        with open(where, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{where} holds a JSON {type(cfg).__name__}, not an object: not a "
                            "Hugging Face config.json")
    mt = cfg.get("model_type")
    if mt == "gemma3":
        _refuse(where, f"model_type {mt!r} ({GEMMA3_REASON})")
    if mt not in SUPPORTED:
        _refuse(where, f"model_type {mt!r} (architectures {cfg.get('architectures')})")
    family, is_moe = SUPPORTED[mt]
    _check_attention(cfg, mt, where)
    heads = _int(cfg, "num_attention_heads", where)
    hidden = _int(cfg, "hidden_size", where)
    head_dim = _int(cfg, "head_dim", where, hidden // heads)
    rotary_percent = _rotary_percent(cfg, mt, head_dim, where)
    kw = dict(
        path=path, model_type=mt, family=family,
        num_layers=_int(cfg, "num_hidden_layers", where), hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=_int(cfg, "num_key_value_heads", where, heads),
        head_dim=head_dim, ffn_hidden_size=_int(cfg, "intermediate_size", where),
        vocab_size=_int(cfg, "vocab_size", where),
        rms_norm_eps=_float(cfg, "rms_norm_eps", where),
        rope_theta=_float(cfg, "rope_theta", where, 1e6 if family == "gemma3" else 10000.0),
        max_position_embeddings=_int(cfg, "max_position_embeddings", where, 4096),
        # Gemma2Config's default is true (save_pretrained leaves it out of config.json then)
        tie_embeddings=bool(cfg.get("tie_word_embeddings", family in GEMMA)),
        qkv_bias=family == "qwen2", qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        rope_scaling=_rope_scaling(_without_linear(cfg, mt), where, mt, head_dim, rotary_percent),
        rotary_percent=rotary_percent, raw=cfg,
    )
    kw["sliding_window"], kw["window_layers"] = _sliding_window(cfg, mt, where)
    if family in GEMMA:
        kw.update(_gemma_fields(cfg, mt, kw["num_layers"], where))
    if heads % kw["num_query_groups"]:
        raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kw['num_query_groups']}")
    if is_moe:
        kw.update(_moe_fields(cfg, mt, where))
    return HFModelSpec(**kw)
