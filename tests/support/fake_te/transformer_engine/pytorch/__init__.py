"""Fake ``transformer_engine.pytorch`` (TE v2.10): the modules Megatron's TE spec builds, the
FP8 autocast and state, the RNG tracker. See ``transformer_engine/__init__.py``."""

from . import distributed, quantization, tensor  # noqa: F401
from . import fp8, graph, ops, router, utils  # noqa: F401
from .attention import DotProductAttention  # noqa: F401
from .module import (  # noqa: F401
    GroupedLinear, LayerNorm, LayerNormLinear, Linear, RMSNorm,
)
from .quantization import (  # noqa: F401
    autocast, fp8_autocast, fp8_model_init, quantized_model_init,
)
