"""ModuleSpec plug-in point: turn a TransformerLayer spec into an offloading one."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_fastpath.offload.config import OffloadConfig
from megatron_fastpath.offload.device import OffloadDevice
from megatron_fastpath.offload.layer import offloaded_layer_class
from megatron_fastpath.offload.manager import ActivationOffloadManager

__all__ = ["with_activation_offload", "get_offload_manager"]

SpecLike = Union[ModuleSpec, TransformerBlockSubmodules]


def _as_manager(manager_or_config, device: Optional[OffloadDevice]) -> ActivationOffloadManager:
    if isinstance(manager_or_config, ActivationOffloadManager):
        if device is not None and manager_or_config._device is not device:
            raise ValueError("pass `device` only with an OffloadConfig; the manager has its own")
        return manager_or_config
    if isinstance(manager_or_config, OffloadConfig):
        return ActivationOffloadManager(manager_or_config, device=device)
    raise TypeError(
        "with_activation_offload needs an ActivationOffloadManager or an OffloadConfig, got "
        f"{type(manager_or_config).__name__}"
    )


def _layer_spec(spec: ModuleSpec, manager: ActivationOffloadManager) -> ModuleSpec:
    if not isinstance(spec.module, type):
        raise TypeError(
            f"with_activation_offload needs a ModuleSpec whose module is a TransformerLayer "
            f"class, got module={spec.module!r}"
        )
    params = dict(spec.params)
    params["offload_manager"] = manager
    return dataclasses.replace(spec, module=offloaded_layer_class(spec.module), params=params)


def with_activation_offload(
    layer_spec: SpecLike,
    manager_or_config: Union[ActivationOffloadManager, OffloadConfig],
    device: Optional[OffloadDevice] = None,
) -> SpecLike:
    """Return a copy of ``layer_spec`` whose TransformerLayers offload their activations.

    Args:
        layer_spec: a TransformerLayer (or MoETransformerLayer / subclass) ``ModuleSpec``, a
            ``TransformerBlockSubmodules`` (e.g. from ``get_gpt_decoder_block_spec``) or a
            ``ModuleSpec`` of a TransformerBlock whose submodules are one of those.
        manager_or_config: a shared :class:`ActivationOffloadManager`, or an
            :class:`OffloadConfig` from which one manager is made for all layers of the spec.
        device: :class:`OffloadDevice` for a new manager (default: CUDA if available).

    Use one manager per model chunk: it never offloads the last layer it has registered.
    The manager is reachable as ``spec.params["offload_manager"]`` and, after the model is
    built, with :func:`get_offload_manager`.
    """
    manager = _as_manager(manager_or_config, device)
    if isinstance(layer_spec, TransformerBlockSubmodules):
        return dataclasses.replace(
            layer_spec,
            layer_specs=[with_activation_offload(s, manager) for s in layer_spec.layer_specs],
        )
    if not isinstance(layer_spec, ModuleSpec):
        raise TypeError(
            f"with_activation_offload needs a ModuleSpec or TransformerBlockSubmodules, got "
            f"{type(layer_spec).__name__}"
        )
    from megatron.core.transformer.transformer_block import TransformerBlock

    if isinstance(layer_spec.module, type) and issubclass(layer_spec.module, TransformerBlock):
        return dataclasses.replace(
            layer_spec, submodules=with_activation_offload(layer_spec.submodules, manager)
        )
    return _layer_spec(layer_spec, manager)


def get_offload_manager(model: torch.nn.Module) -> Optional[ActivationOffloadManager]:
    """The (first) ActivationOffloadManager used by the layers of ``model``, or None."""
    for module in model.modules():
        manager = getattr(module, "offload_manager", None)
        if isinstance(manager, ActivationOffloadManager):
            return manager
    return None
