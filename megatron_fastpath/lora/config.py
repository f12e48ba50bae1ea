"""LoRA configuration."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["LoRAConfig", "LORA_TARGETS"]

# Megatron linear names inside a TransformerLayer and how their weights are sharded.
LORA_TARGETS = {
    "linear_qkv": ("self_attention", "column"),
    "linear_proj": ("self_attention", "row"),
    "linear_fc1": ("mlp", "column"),
    "linear_fc2": ("mlp", "row"),
}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """rank r, alpha (scale = alpha / r), dropout on the adapter input, target linears
    (MLPerf Llama-2-70B: r=16, alpha=32, dropout=0.1 on linear_qkv and linear_proj), and the
    adapter dtype (None: the base weight's dtype, i.e. bf16 in a bf16/FP8 run). What the main
    job writes at the end (PEFT adapter, merged weights) is the ``export`` group's.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.1
    targets: tuple = ("linear_qkv", "linear_proj")
    dtype: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRA rank must be a positive int; got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1); got {self.dropout}")
        targets = tuple(self.targets)
        unknown = sorted(set(targets) - set(LORA_TARGETS))
        if unknown or not targets:
            raise ValueError(
                f"unknown LoRA target(s) {unknown or targets}; choose from {sorted(LORA_TARGETS)}"
            )
        object.__setattr__(self, "targets", targets)
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"LoRA dtype must be float32, bfloat16 or float16; got {self.dtype!r}")

    def dtype_or(self, default: torch.dtype) -> torch.dtype:
        return getattr(torch, self.dtype) if self.dtype else default
