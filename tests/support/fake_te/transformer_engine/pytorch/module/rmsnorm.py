from transformer_engine.pytorch.module.layernorm import RMSNorm  # noqa: F401
