"""Fake ``transformer_engine.pytorch.fp8`` (TE v2.10: a deprecated re-export of
``quantization``)."""

from ..common.recipe import (  # noqa: F401
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling,
    NVFP4BlockScaling, Recipe,
)
from .quantization import (  # noqa: F401
    FP8GlobalStateManager, autocast, fp8_autocast, fp8_model_init, get_fp8_max,
    get_fp8_torch_dtype, quantized_model_init,
)
