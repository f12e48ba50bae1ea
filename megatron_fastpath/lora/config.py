"""LoRA configuration."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_fastpath.settings import setting

__all__ = ["LoRAConfig", "LORA_TARGETS", "HF_FUSED_TARGETS", "HF_TARGETS", "normalize_targets"]

# Megatron linear names inside a TransformerLayer and how their weights are sharded.
LORA_TARGETS = {
    "linear_qkv": ("self_attention", "column"),
    "linear_proj": ("self_attention", "row"),
    "linear_fc1": ("mlp", "column"),
    "linear_fc2": ("mlp", "row"),
}


# Hugging Face / PEFT module names -> the Megatron linear holding them. Megatron fuses q, k, v
# into linear_qkv and gate, up into linear_fc1: such a linear is adapted as a whole, so its HF
# names are accepted together only (an adapter on q_proj alone would be a different model).
HF_TARGETS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
# Families that fuse them in the checkpoint too (Phi-3: qkv_proj, gate_up_proj): one name each.
HF_FUSED_TARGETS = {"qkv_proj": "linear_qkv", "gate_up_proj": "linear_fc1"}
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear of the layers (not the output head)


def normalize_targets(targets) -> tuple:
    """``lora.targets`` as Megatron linear names (in the order given, once each). Accepts a list or a
    comma-separated string of Megatron names and HF names, or ``all-linear``."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    names = [str(t) for t in targets]
    if ALL_LINEAR in names:
        if len(names) > 1:
            raise ValueError(f"lora.targets: {ALL_LINEAR!r} already names every linear; got {names}")
        return tuple(LORA_TARGETS)
    hf_of = {hf: megatron for megatron, hfs in HF_TARGETS.items() for hf in hfs}
    hf_of.update(HF_FUSED_TARGETS)
    unknown = sorted(set(names) - set(LORA_TARGETS) - set(hf_of))
    if unknown or not names:
        raise ValueError(
            f"unknown LoRA target(s) {unknown or names}; choose from {sorted(LORA_TARGETS)}, "
            f"the Hugging Face names {sorted(hf_of)} or {ALL_LINEAR!r}")
    for megatron, hfs in HF_TARGETS.items():
        given = [h for h in hfs if h in names]
        if given and len(given) < len(hfs):
            raise ValueError(
                f"lora.targets {given}: Megatron holds {', '.join(hfs)} in one linear "
                f"({megatron}) and adapts it as a whole; target all of {list(hfs)} (or "
                f"{megatron}), or none of them")
    return tuple(dict.fromkeys(hf_of.get(n, n) for n in names))  # given order, once each


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (MLPerf Llama-2-70B: r=16, alpha=32, dropout=0.1 on linear_qkv and
    linear_proj). What the main job writes at the end (PEFT adapter, merged weights) is the
    ``export`` group's.
    """

    rank: int = setting(16, "adapter rank r")
    alpha: float = setting(32.0, "scale numerator: the adapter's output is scaled by alpha / rank")
    dropout: float = setting(0.1, "dropout on the adapter input, in [0, 1)")
    targets: tuple = setting(
        ("linear_qkv", "linear_proj"), f"linears to adapt: Megatron names ({', '.join(LORA_TARGETS)}), "
        f"their Hugging Face names or {ALL_LINEAR!r}")
    dtype: Optional[str] = setting(
        None, "adapter dtype: float32 | bfloat16 | float16; null: the base weight's (bf16 in a "
        "bf16 / FP8 run)")

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRA rank must be a positive int; got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1); got {self.dropout}")
        object.__setattr__(self, "targets", normalize_targets(self.targets))
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"LoRA dtype must be float32, bfloat16 or float16; got {self.dtype!r}")

    def dtype_or(self, default: torch.dtype) -> torch.dtype:
        return getattr(torch, self.dtype) if self.dtype else default
