"""Transformer Engine FP8 delayed-scaling state (scales, amax histories) of every TE module, per
rank, as safetensors -- what TE's pickled ``_extra_state`` holds, without the pickle.

Saved beside the RNG states (``fp8/rank_00000.safetensors``, keys ``<module path>.<TE key>``,
the parallel layout in the file's metadata) and restored only into the same layout: a different
world or TP / PP / EP split gets a note instead, and TE rebuilds the history over
``fp8.amax_history_len`` steps, as after a fresh start. The TE calls live in
:mod:`megatron_fastpath.compat` (``te_fp8_delayed_scaling_state`` and its restore).
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

__all__ = ["collect_fp8_state", "restore_fp8_state", "save_fp8_state", "load_fp8_state", "layout"]


def layout() -> str:
    """World size and TP / PP / EP sizes (the rank is in the file name): the FP8 state of a
    rank belongs to the modules (and experts) this exact layout gave it."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return "world=1"
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return (f"world={world} tp={ps.get_tensor_model_parallel_world_size()} "
            f"pp={ps.get_pipeline_model_parallel_world_size()} "
            f"ep={ps.get_expert_model_parallel_world_size()}")


def collect_fp8_state(model: torch.nn.Module) -> dict:
    """``{"<module path>.<scale_fwd|amax_history_fwd|scale_bwd|amax_history_bwd>": tensor}``
    for every TE module with delayed-scaling state (empty without FP8 / on stateless recipes)."""
    from megatron_fastpath.compat.te import te_fp8_delayed_scaling_state

    out, on_device = {}, False
    for name, module in model.named_modules():
        for key, t in (te_fp8_delayed_scaling_state(module) or {}).items():
            if t.is_cuda:  # pinned + non-blocking: one synchronize for all, not one per tensor
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                on_device = True
            else:
                host = t.clone(memory_format=torch.contiguous_format)
            out[f"{name}.{key}"] = host
    if on_device:
        torch.cuda.synchronize()
    return out


def restore_fp8_state(model: torch.nn.Module, tensors: dict, recipe) -> int:
    """Put ``tensors`` (from :func:`collect_fp8_state`) back; returns the modules restored.
    Raises when a saved module is absent from ``model``."""
    from megatron_fastpath.compat.te import TE_FP8_STATE_KEYS, te_restore_fp8_delayed_scaling_state

    by_module: dict = {}
    for key, t in tensors.items():
        name, _, field = key.rpartition(".")
        if field not in TE_FP8_STATE_KEYS:
            raise ValueError(f"unexpected FP8 state key {key!r}")
        by_module.setdefault(name, {})[field] = t
    modules = dict(model.named_modules())
    absent = sorted(n for n in by_module if n not in modules)
    if absent:
        raise ValueError(f"FP8 state saved for modules this model lacks: {absent[:10]}")
    for name, state in by_module.items():
        te_restore_fp8_delayed_scaling_state(modules[name], state, recipe)
    return len(by_module)


def save_fp8_state(directory: str, rank: int, tensors: dict) -> Optional[str]:
    """Write this rank's tensors (nothing when empty); returns the file written."""
    if not tensors:
        return None
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank_{rank:05d}.safetensors")
    save_file(tensors, path, metadata={"layout": layout()})
    return path


def load_fp8_state(directory: str, rank: int, restore: Callable[[dict], int]) -> str:
    """Restore this rank's saved FP8 state (``directory``: a checkpoint's ``fp8/``) through
    ``restore``; returns the note for the log: what was restored, or why not."""
    path = os.path.join(directory, f"rank_{rank:05d}.safetensors")
    if not os.path.exists(path):
        return "FP8 scaling history not restored: this rank has no saved state (layout changed)"
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as f:
        saved = (f.metadata() or {}).get("layout")
    if saved != layout():
        return (f"FP8 scaling history not restored: saved at {saved}, now {layout()} (TE rebuilds "
                "it over fp8.amax_history_len steps)")
    n = restore(load_file(path))
    return f"FP8 scaling history restored for {n} Transformer Engine modules"
