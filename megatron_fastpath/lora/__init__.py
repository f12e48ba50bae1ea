"""LoRA adapters for Megatron TransformerLayers (graph-capturable, FP8-compatible)."""

from megatron_fastpath.lora.adapter import AdaptersLockedError, LoRALinear
from megatron_fastpath.lora.config import LORA_TARGETS, LoRAConfig
from megatron_fastpath.lora.multi import MultiLoRALinear, adapter_routed_layer, adapter_routing
from megatron_fastpath.lora.spec import (
    freeze_base_parameters,
    lock_lora,
    lora_modules,
    lora_parameter_count,
    merge_lora,
    set_lora_enabled,
    with_lora,
)

__all__ = [
    "AdaptersLockedError",
    "LORA_TARGETS",
    "LoRAConfig",
    "LoRALinear",
    "MultiLoRALinear",
    "adapter_routed_layer",
    "adapter_routing",
    "freeze_base_parameters",
    "lock_lora",
    "lora_modules",
    "lora_parameter_count",
    "merge_lora",
    "set_lora_enabled",
    "with_lora",
]
