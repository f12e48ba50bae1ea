"""Rotary position embedding: the settings (:class:`RopeConfig`, with Llama 3.1's frequency
scaling as one :class:`Llama3RopeScaling` value and YaRN's as one :class:`YarnRopeScaling`) and
the math the packed cache builds its RoPE tensors with, exactly as Megatron's
``RotaryEmbedding`` (Llama 3.1) and transformers' ``_compute_yarn_parameters`` (YaRN) compute
them.

Shape letters: T = tokens, D = rotary dim, F = D / 2 rotary frequencies.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

import torch

__all__ = ["Llama3RopeScaling", "LongRopeScaling", "RopeConfig", "YarnRopeScaling"]


def _set_positive_real(obj, name: str, why: str) -> None:
    """``obj.name`` as a float, refusing anything but a finite number > 0 (``why``: the rest of
    the message, after "<Class>.<name> is <value>: ")."""
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{type(obj).__name__}.{name} is {v!r}: {why}")
    object.__setattr__(obj, name, float(v))


def _set_positive_whole(obj, name: str, why: str) -> None:
    """``obj.name`` as an int, refusing anything but a whole number >= 1."""
    n = getattr(obj, name)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0:
        raise ValueError(f"{type(obj).__name__}.{name} is {n!r}: {why}")
    object.__setattr__(obj, name, int(n))


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency scaling of RoPE (Megatron's ``rope_scaling=True`` with
    ``rope_scaling_factor``; Hugging Face ``rope_scaling`` of ``rope_type: llama3``; NeMo
    ``Llama31Config`` / Bridge ``Llama31ModelProvider``).

    factor: long wavelengths are divided by it (8 for Llama 3.1 / 3.3, 32 for Llama 3.2).
    low_freq_factor / high_freq_factor: wavelengths above ``original_max_position /
        low_freq_factor`` are scaled, those below ``original_max_position / high_freq_factor``
        kept, and the band between interpolated smoothly.
    original_max_position: the context the model was pre-trained on (HF
        ``original_max_position_embeddings``, NeMo ``old_context_len``).

    The defaults (1, 4, 8192) are Llama 3.1's and those of Megatron's ``_apply_scaling``.
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _set_positive_real(self, name, "the scaled wavelengths are divided by it, so it must be "
                               "a finite number > 0; Llama 3.1 uses factor=8.0, low_freq_factor=1.0, "
                               "high_freq_factor=4.0")
        if not self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"Llama3RopeScaling.low_freq_factor={self.low_freq_factor} is not below "
                f"high_freq_factor={self.high_freq_factor}: the band between them is interpolated "
                "(a division by their difference), so it must be non-empty; use low < high "
                "(Llama 3.1: 1.0 and 4.0)")
        _set_positive_whole(self, "original_max_position", "it is the pre-training context in "
                            "tokens, so it must be a whole number >= 1; Llama 3.1 uses 8192")

    def apply(self, inv_freq_F: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (Megatron's ``RotaryEmbedding._apply_scaling``, op for
        op, so the result is bitwise the same)."""
        factor, low, high = self.factor, self.low_freq_factor, self.high_freq_factor
        old_len = self.original_max_position
        wavelen_F = 2 * math.pi / inv_freq_F
        # long wavelengths (> old_len / low) are divided by factor, short ones (< old_len / high)
        # kept, and the band between interpolated smoothly.
        scaled_F = torch.where(wavelen_F > old_len / low, inv_freq_F / factor, inv_freq_F)
        smooth_F = (old_len / wavelen_F - low) / (high - low)
        smoothed_F = (1 - smooth_F) * scaled_F / factor + smooth_F * scaled_F
        medium_F = ~(wavelen_F < old_len / high) * ~(wavelen_F > old_len / low)
        return torch.where(medium_F, smoothed_F, scaled_F)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' ``get_mscale`` (inside ``_compute_yarn_parameters``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN scaling of RoPE (Hugging Face ``rope_scaling`` of ``rope_type: yarn``: Qwen2 /
    Qwen2.5 long context, Llama / Mistral / Qwen3 fine-tunes), computed exactly as transformers'
    ``modeling_rope_utils._compute_yarn_parameters`` (4.57).

    factor: context extension ratio; the interpolated frequencies are divided by it.
    original_max_position: the pre-training context (HF ``original_max_position_embeddings``,
        falling back to ``max_position_embeddings`` as transformers does).
    beta_fast / beta_slow: rotation counts bounding the ramp between extrapolated (kept) and
        interpolated (divided) frequencies (HF defaults 32 and 1).
    attention_factor: cos and sin are multiplied by it; None: derived as transformers does,
        ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`` when both are set
        (and non-zero), else ``get_mscale(factor) = 0.1 ln(factor) + 1``.
    truncate: floor / ceil the correction range (HF default True).
    """

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: bool = True

    def __post_init__(self):
        optional = ("attention_factor", "mscale", "mscale_all_dim")  # None: derived / unused
        for name in ("factor", "beta_fast", "beta_slow") + optional:
            if getattr(self, name) is None and name in optional:
                continue
            _set_positive_real(self, name, "it must be a finite number > 0 (Qwen2.5 uses factor=4.0, "
                               "original_max_position=32768; beta_fast=32, beta_slow=1)")
        _set_positive_whole(self, "original_max_position", "it is the pre-training context in "
                            "tokens, so it must be a whole number >= 1 (Qwen2.5: 32768)")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"YarnRopeScaling.truncate is {self.truncate!r}: it must be true or false")

    @property
    def cos_sin_scale(self) -> float:
        """The factor cos and sin are multiplied by (transformers' ``attention_scaling``)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return float(_yarn_mscale(self.factor, self.mscale)
                         / _yarn_mscale(self.factor, self.mscale_all_dim))
        return _yarn_mscale(self.factor)

    def inv_freq(self, dim: int, base: float, device=None) -> torch.Tensor:
        """[F] float32 inverse frequencies, op for op as ``_compute_yarn_parameters``."""
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (
                2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        pos_freqs_F = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
        inv_freq_extrapolation_F = 1.0 / pos_freqs_F
        inv_freq_interpolation_F = 1.0 / (self.factor * pos_freqs_F)
        ramp_F = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_F = 1 - ramp_F.to(device=device, dtype=torch.float)
        return (inv_freq_interpolation_F * (1 - extrapolation_F)
                + inv_freq_extrapolation_F * extrapolation_F)


@dataclasses.dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE scaling with its short factors (Hugging Face ``rope_scaling`` of ``type:
    longrope``: Phi-3 / Phi-3.5 128k), computed exactly as transformers'
    ``modeling_rope_utils._compute_longrope_parameters`` (4.57) for a sequence of at most
    ``original_max_position`` tokens. transformers switches to the long factors when a forward's
    longest position reaches past ``original_max_position``; a packed batch mixes lengths, so
    only the short-factor regime is served (the loader refuses a longer sequence bound).

    short_factor: per-frequency divisors of the inverse frequencies (D / 2 of them).
    original_max_position: the pre-training context (Phi-3's top-level
        ``original_max_position_embeddings``).
    attention_factor: cos and sin are multiplied by it (derived by the config reader as
        transformers does: ``sqrt(1 + ln(factor) / ln(original))`` for factor > 1, else 1).
    """

    short_factor: tuple
    original_max_position: int
    attention_factor: float = 1.0

    def __post_init__(self):
        factors = tuple(self.short_factor)
        if not factors or any(isinstance(f, bool) or not isinstance(f, numbers.Real)
                              or not math.isfinite(f) or f <= 0 for f in factors):
            raise ValueError(f"LongRopeScaling.short_factor is {self.short_factor!r:.80}: it must be "
                             "a non-empty list of finite numbers > 0 (one per rotary frequency)")
        object.__setattr__(self, "short_factor", tuple(float(f) for f in factors))
        _set_positive_real(self, "attention_factor", "it must be a finite number > 0")
        _set_positive_whole(self, "original_max_position", "it is the pre-training context in "
                            "tokens, so it must be a whole number >= 1 (Phi-3: 4096)")

    @property
    def cos_sin_scale(self) -> float:
        return self.attention_factor

    def inv_freq(self, dim: int, base: float, device=None) -> torch.Tensor:
        """[F] float32 inverse frequencies, op for op as ``_compute_longrope_parameters``."""
        if len(self.short_factor) != dim // 2:
            raise ValueError(f"LongRopeScaling.short_factor has {len(self.short_factor)} entries but "
                             f"the rotary dim {dim} has {dim // 2} frequencies")
        ext_factors_F = torch.tensor(self.short_factor, dtype=torch.float32, device=device)
        shape_F = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        return 1.0 / (ext_factors_F * base**shape_F)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings (Llama-style, as Megatron's ``RotaryEmbedding``).

    dim: number of rotated channels per head (``kv_channels * rotary_percent``), even.
    base: rotary base (theta).
    interleaved: rotate (even, odd) pairs instead of the two halves.
    seq_len_interpolation_factor: positions are divided by this (linear scaling), if set.
    llama3: Llama 3.1 frequency scaling, None for none.
    yarn: YaRN scaling (frequencies and the cos / sin factor), None for none.
    longrope: LongRoPE scaling in its short-factor regime (Phi-3), None for none; at most one
        of ``llama3``, ``yarn`` and ``longrope``.
    """

    dim: int
    base: float = 10000.0
    interleaved: bool = False
    seq_len_interpolation_factor: Optional[float] = None
    llama3: Optional[Llama3RopeScaling] = None
    yarn: Optional[YarnRopeScaling] = None
    longrope: Optional[LongRopeScaling] = None

    def __post_init__(self):
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"RopeConfig.dim must be a positive even number; got {self.dim}")
        if self.llama3 is not None and not isinstance(self.llama3, Llama3RopeScaling):
            raise TypeError(
                f"RopeConfig.llama3 is {self.llama3!r}: it must be a Llama3RopeScaling or None "
                "(e.g. llama3=Llama3RopeScaling(factor=8.0))")
        if self.yarn is not None and not isinstance(self.yarn, YarnRopeScaling):
            raise TypeError(
                f"RopeConfig.yarn is {self.yarn!r}: it must be a YarnRopeScaling or None "
                "(e.g. yarn=YarnRopeScaling(factor=4.0, original_max_position=32768))")
        if self.longrope is not None and not isinstance(self.longrope, LongRopeScaling):
            raise TypeError(f"RopeConfig.longrope is {self.longrope!r:.80}: it must be a "
                            "LongRopeScaling or None")
        if sum(x is not None for x in (self.llama3, self.yarn, self.longrope)) > 1:
            raise ValueError("RopeConfig: llama3, yarn and longrope scaling are distinct rope "
                             "types; set one")

    @property
    def cos_sin_scale(self) -> float:
        """The factor transformers multiplies cos and sin by (YaRN's attention factor; 1
        otherwise). The cache's cos / sin do not carry it: attention folds its square into the
        softmax scale (``PackedCoreAttention``), the same scores on every backend."""
        scaling = self.yarn if self.yarn is not None else self.longrope
        return 1.0 if scaling is None else scaling.cos_sin_scale

    def inv_freq(self, device=None) -> torch.Tensor:
        """[F] float32, exactly as Megatron's RotaryEmbedding computes it (including its
        Llama 3.1 ``_apply_scaling`` when ``llama3`` is set); with ``yarn``, as transformers'
        ``_compute_yarn_parameters`` (``longrope``: ``_compute_longrope_parameters``)."""
        if self.yarn is not None:
            return self.yarn.inv_freq(self.dim, self.base, device)
        if self.longrope is not None:
            return self.longrope.inv_freq(self.dim, self.base, device)
        inv_F = 1.0 / (
            self.base
            ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim)
        )
        return inv_F if self.llama3 is None else self.llama3.apply(inv_F)

    def angles_TD(self, position_ids_T: torch.Tensor, inv_freq_F: torch.Tensor) -> torch.Tensor:
        """[T, D] float32 rotation angles of tokens at ``position_ids_T`` (position within their
        sequence), given this config's ``inv_freq_F`` (computed once by the caller)."""
        pos_T = position_ids_T.to(torch.float32)
        if self.seq_len_interpolation_factor is not None:
            pos_T = pos_T / self.seq_len_interpolation_factor
        freqs_TF = torch.outer(pos_T, inv_freq_F)
        if self.interleaved:
            return torch.stack((freqs_TF, freqs_TF), dim=-1).flatten(-2)
        return torch.cat((freqs_TF, freqs_TF), dim=-1)
