"""Fake ``transformer_engine.common.recipe`` (TE v2.10 ``transformer_engine/common/recipe/__init__.py``).

The recipes are pydantic dataclasses as in TE (``recipe/__init__.py:11`` imports
``pydantic.dataclasses.dataclass``): field types are validated and an unknown keyword is
*ignored* (pydantic's default), which Megatron-Core 0.16.1 relies on -- its ``TEDelayedScaling``
passes ``override_linear_precision``, ``params_dtype`` and ``device``, fields TE 2.x no longer
has. Fields and defaults are TE 2.10's; each ``__post_init__`` asserts what TE's does.
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Callable, NamedTuple, Optional, Union

from pydantic.dataclasses import dataclass


class _FormatMax(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(Enum):
    """FP8 / FP4 formats and their largest finite values (TE recipe/__init__.py:23-45)."""

    E2M1 = _FormatMax(max_fwd=6, max_bwd=6)
    E4M3 = _FormatMax(max_fwd=448, max_bwd=448)
    E5M2 = _FormatMax(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatMax(max_fwd=448, max_bwd=57344)  # e4m3 forward, e5m2 backward


@dataclass(frozen=True)
class MMParams:
    use_split_accumulator: bool = True


@dataclass(frozen=True)
class QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


class Recipe:
    """Base class: the kind predicates TE's modules branch on (recipe/__init__.py:86-118)."""

    def nvfp4(self):
        return isinstance(self, NVFP4BlockScaling)

    def mxfp8(self):
        return isinstance(self, MXFP8BlockScaling)

    def delayed(self):
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self):
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self):
        return isinstance(self, (DelayedScaling, Float8CurrentScaling))

    def float8_block_scaling(self):
        return isinstance(self, Float8BlockScaling)

    def custom(self):
        return isinstance(self, CustomRecipe)


def _no_pure_e5m2(fmt) -> None:
    # every FP8 recipe's __post_init__, e.g. recipe/__init__.py:209 (DelayedScaling)
    assert fmt != Format.E5M2, "Pure E5M2 training is not supported."


@dataclass()
class DelayedScaling(Recipe):
    """recipe/__init__.py:121-221."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _no_pure_e5m2(self.fp8_format)


@dataclass()
class Float8CurrentScaling(Recipe):
    """recipe/__init__.py:224-262 (per-tensor current amax)."""

    use_power_2_scales: bool = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _no_pure_e5m2(self.fp8_format)


@dataclass()
class MXFP8BlockScaling(Recipe):
    """recipe/__init__.py:265-303: 32 consecutive values share an E8M0 (power-of-2) scale."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _no_pure_e5m2(self.fp8_format)


@dataclass()
class Float8BlockScaling(Recipe):
    """recipe/__init__.py:306-384: 1x128 (1D) or 128x128 (2D) blocks, float32 power-of-2
    scales by default."""

    use_f32_scales: bool = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        # recipe/__init__.py:348-366
        assert self.x_block_scaling_dim in [1, 2], "Only 1D or 2D blocks supported for x"
        assert self.w_block_scaling_dim in [1, 2], "Only 1D or 2D blocks supported for w"
        assert self.grad_block_scaling_dim in [1, 2], "Only 1D or 2D blocks supported for grad"
        dims = (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)
        assert sorted(dims)[1] != 2, "2D by 2D block gemm not supported."
        for p, what in ((self.fp8_gemm_fprop, "fprop"), (self.fp8_gemm_dgrad, "dgrad"),
                        (self.fp8_gemm_wgrad, "wgrad")):
            assert p.use_split_accumulator, f"Split accumulator required for {what}."
        assert not self.fp8_dpa and not self.fp8_mha, \
            "FP8 attention is not supported for Float8BlockScaling."
        _no_pure_e5m2(self.fp8_format)


@dataclass()
class NVFP4BlockScaling(Recipe):
    """recipe/__init__.py:387+ (FP4): present for Megatron's imports; the fake's linears refuse
    to execute it."""

    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3

    def __post_init__(self) -> None:
        # recipe/__init__.py:448-449
        assert self.fp4_format == Format.E2M1, "Only E2M1 is supported for NVFP4 scaling"
        assert self.fp8_format == Format.E4M3, "Only E4M3 is supported for NVFP4 scaling"


@dataclass()
class CustomRecipe(Recipe):
    qfactory: Optional[Callable] = None
    fp8_dpa: bool = False
    fp8_mha: bool = False
