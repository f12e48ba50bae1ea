from .layernorm import RMSNorm  # noqa: F401
