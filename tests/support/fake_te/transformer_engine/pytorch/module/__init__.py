from transformer_engine.pytorch.module.base import TransformerEngineBaseModule  # noqa: F401
from transformer_engine.pytorch.module.grouped_linear import GroupedLinear  # noqa: F401
from transformer_engine.pytorch.module.layernorm import LayerNorm, RMSNorm  # noqa: F401
from transformer_engine.pytorch.module.layernorm_linear import LayerNormLinear  # noqa: F401
from transformer_engine.pytorch.module.linear import Linear  # noqa: F401
