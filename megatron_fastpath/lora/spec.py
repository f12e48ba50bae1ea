"""Put LoRA into a TransformerLayer ModuleSpec (wiring as data) and manage a LoRA model."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import torch

from megatron_fastpath.compat.spec import dense_mlp_module, dense_mlp_submodules, replace_dense_mlp
from megatron_fastpath.lora.adapter import LoRALinear
from megatron_fastpath.lora.config import LORA_TARGETS, LoRAConfig
from megatron_fastpath.lora.multi import MultiLoRALinear, adapter_names, adapter_routed_layer

__all__ = [
    "with_lora",
    "freeze_base_parameters",
    "lora_modules",
    "set_lora_enabled",
    "lock_lora",
    "merge_lora",
    "lora_parameter_count",
]


def _wrap(linear_spec, cfg: LoRAConfig, parallel: str, adapters: Optional[tuple], target: str):
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(linear_spec, ModuleSpec):
        if isinstance(linear_spec.module, type) and issubclass(linear_spec.module, LoRALinear):
            raise ValueError("this linear already has a LoRA adapter")
        base, params = linear_spec.module, dict(linear_spec.params)
    else:
        base, params = linear_spec, {}
    params = {**params, "base": base, "lora": cfg, "parallel": parallel}
    if adapters is None:
        return ModuleSpec(module=LoRALinear, params=params)
    return ModuleSpec(module=MultiLoRALinear,
                      params={**params, "adapters": adapters, "target": target})


def with_lora(layer_spec, cfg: LoRAConfig, adapters=None):
    """A copy of a TransformerLayer ``ModuleSpec`` whose target linears carry LoRA adapters.

    ``adapters``: None for one adapter (:class:`LoRALinear`); a count K >= 1 or a list of K
    distinct names for K adapters of ``cfg``'s rank, alpha, dropout and dtype on every target,
    trained at once, each token by the adapter its batch gives it
    (:class:`~megatron_fastpath.lora.multi.MultiLoRALinear`; the cache needs
    ``PackedSeqConfig(num_adapters=K)`` and each batch ``set_batch(lengths, adapters=[...])``).
    The layer itself then becomes :func:`~megatron_fastpath.lora.multi.adapter_routed_layer`
    of its class, which hands the batch's params to its linears. The adapters are an argument
    here, not a :class:`LoRAConfig` field: the config holds what every adapter shares (the main
    job's ``lora`` group), the names are which models are trained.

    MoE layers (mlp is not an ``MLP``) accept only attention targets here."""
    if adapters is not None:
        adapters = adapter_names(adapters)
    subs = layer_spec.submodules
    attn = subs.self_attention
    attn_subs, mlp = attn.submodules, subs.mlp
    attn_changes, mlp_changes = {}, {}
    for name in cfg.targets:
        owner, parallel = LORA_TARGETS[name]
        if owner == "self_attention":
            attn_changes[name] = _wrap(getattr(attn_subs, name), cfg, parallel, adapters, name)
        else:
            mlp_subs = dense_mlp_submodules(mlp)
            if mlp_subs is None:
                raise ValueError(
                    f"LoRA target {name} needs a dense MLP; this layer's mlp is "
                    f"{dense_mlp_module(mlp)} (MoE experts: target attention linears)"
                )
            mlp_changes[name] = _wrap(getattr(mlp_subs, name), cfg, parallel, adapters, name)
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn_subs, **attn_changes))
    if mlp_changes:
        mlp = replace_dense_mlp(
            mlp, submodules=dataclasses.replace(dense_mlp_submodules(mlp), **mlp_changes))
    module = layer_spec.module if adapters is None else adapter_routed_layer(layer_spec.module)
    return dataclasses.replace(
        layer_spec, module=module,
        submodules=dataclasses.replace(subs, self_attention=attn, mlp=mlp))


def lora_modules(model: torch.nn.Module) -> Iterator[LoRALinear]:
    return (m for m in model.modules() if isinstance(m, LoRALinear))


def freeze_base_parameters(model: torch.nn.Module) -> int:
    """requires_grad=False on everything but LoRA A/B; returns the trainable count."""
    trainable = 0
    for name, p in model.named_parameters():
        is_adapter = name.endswith("lora_A") or name.endswith("lora_B")
        p.requires_grad_(is_adapter)
        trainable += p.numel() if is_adapter else 0
    if trainable == 0:
        raise ValueError("no LoRA parameters found: build the model from with_lora(spec, cfg)")
    return trainable


def set_lora_enabled(model: torch.nn.Module, enabled: bool) -> None:
    for m in lora_modules(model):
        m.set_enabled(enabled)


def lock_lora(model: torch.nn.Module) -> None:
    for m in lora_modules(model):
        m.lock()


def merge_lora(model: torch.nn.Module) -> None:
    for m in lora_modules(model):
        m.merge()


def lora_parameter_count(
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    rank: int,
    targets=("linear_qkv", "linear_proj"),
    ffn_hidden_size: int = 0,
    gated_linear_unit: bool = True,
    kv_channels: int = 0,
) -> int:
    """r * (in + out) per adapted linear, summed over layers (Megatron's fused QKV)."""
    head = kv_channels or hidden_size // num_attention_heads
    shapes = {
        "linear_qkv": (hidden_size, head * (num_attention_heads + 2 * num_query_groups)),
        "linear_proj": (head * num_attention_heads, hidden_size),
        "linear_fc1": (hidden_size, ffn_hidden_size * (2 if gated_linear_unit else 1)),
        "linear_fc2": (ffn_hidden_size, hidden_size),
    }
    return num_layers * sum(rank * sum(shapes[t]) for t in targets)
