"""Optimizer state as sharded tensors keyed like the model parameters they belong to.

torch optimizers (the CPU path's AdamW): every per-parameter state tensor of the same shape as
its parameter (``exp_avg``, ``exp_avg_sq``) becomes a ShardedTensor
``optimizer.state.<name>.<parameter key>`` through Megatron's own
``get_param_id_to_sharded_param_map`` / ``make_sharded_optimizer_tensor``, so it reshards with
the model. The per-parameter ``step`` counters must all be equal and are kept as one number
(as Megatron's optimizers do, ``common_step``). Megatron optimizers (GPU path) bring their own
``sharded_state_dict`` / ``load_state_dict``; a DistributedOptimizer's (ZeRO-1: its state
sharded over data parallelism) is written in the format ``optimizer_format`` names
(``checkpoint.optimizer_format``, through ``compat/dist_optim_ckpt.py``).
"""

from __future__ import annotations

import torch

__all__ = ["optimizer_sharded_state", "load_optimizer_state", "optimizer_hyperparams", "distributed_format"]

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _is_megatron(optimizer) -> bool:
    return hasattr(optimizer, "sharded_state_dict")


def _params(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def _param_map(optimizer, model_sd):
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    params = _params(optimizer)
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    missing = [i for i in range(len(params)) if i not in id_map]
    if missing:
        raise ValueError(
            f"{len(missing)} optimizer parameter(s) are not in the model's sharded state dict "
            "(adapters_only saves only LoRA parameters: the optimizer must hold only those)"
        )
    return params, id_map


def common_step(optimizer) -> int:
    """The step every parameter's state is at (0: not stepped). Megatron optimizers keep theirs
    inside their own sharded state dict (``common_step``): 0 here."""
    if _is_megatron(optimizer):
        return 0
    steps = {int(s["step"]) for s in optimizer.state.values() if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"optimizer parameters are at different steps {sorted(steps)}")
    return steps.pop() if steps else 0


def distributed_format(optimizer, optimizer_format: str):
    """``optimizer_format`` when ``optimizer`` is (a chain of) Megatron DistributedOptimizer(s),
    else None (its state has no format to choose)."""
    if not _is_megatron(optimizer):
        return None
    from megatron_fastpath.compat.dist_optim_ckpt import distributed_optimizer_leaves

    return optimizer_format if distributed_optimizer_leaves(optimizer) else None


def optimizer_sharded_state(optimizer, model_sd, loading: bool = False, optimizer_format=None) -> dict:
    """Sharded view of the optimizer state (``loading``: fresh tensors to load into).
    ``optimizer_format``: a DistributedOptimizer's format (:func:`distributed_format`)."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    if optimizer_format is not None:  # Megatron's DistributedOptimizer
        from megatron_fastpath.compat.dist_optim_ckpt import distributed_optimizer_sharded_state

        return distributed_optimizer_sharded_state(optimizer, model_sd, loading, optimizer_format)
    if _is_megatron(optimizer):  # Megatron optimizer (GPU path)
        return optimizer.sharded_state_dict(model_sd, is_loading=loading)
    params, id_map = _param_map(optimizer, model_sd)
    out = {}
    for i, p in enumerate(params):
        state = optimizer.state.get(p, {})
        for name in _ADAM_KEYS:
            t = torch.zeros_like(p, memory_format=torch.contiguous_format) if loading else state.get(name)
            if t is None:
                continue  # optimizer not stepped yet
            out[f"{name}.{i}"] = make_sharded_optimizer_tensor(id_map[i], t, prefix=f"optimizer.state.{name}")
    return out


def optimizer_hyperparams(optimizer) -> list:
    """JSON-able param-group settings (everything but the parameters); Megatron optimizers save
    theirs in their own sharded state dict."""
    if _is_megatron(optimizer):
        return []
    groups = []
    for g in optimizer.param_groups:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                       if k != "params" and isinstance(v, (int, float, bool, str, tuple, list, type(None)))})
    return groups


def load_optimizer_state(optimizer, loaded: dict, step: int, hyperparams: list, optimizer_format=None,
                         adam_step=None) -> None:
    """Put loaded sharded optimizer tensors (from :func:`optimizer_sharded_state`) back
    (``adam_step``: a DistributedOptimizer's torch-Adam step, ``compat.dist_optim_ckpt.torch_adam_step``)."""
    if optimizer_format is not None:  # Megatron's DistributedOptimizer
        from megatron_fastpath.compat.dist_optim_ckpt import load_distributed_optimizer_state

        load_distributed_optimizer_state(optimizer, loaded, optimizer_format, adam_step)
        return
    if _is_megatron(optimizer):  # Megatron optimizer (GPU path)
        optimizer.load_state_dict(loaded)
        return
    sd = optimizer.state_dict()
    if len(hyperparams) != len(sd["param_groups"]):
        raise ValueError(
            f"the checkpoint's optimizer has {len(hyperparams)} parameter groups, this one "
            f"{len(sd['param_groups'])}"
        )
    for group, saved in zip(sd["param_groups"], hyperparams):
        group.update({k: (tuple(v) if isinstance(group.get(k), tuple) else v) for k, v in saved.items()})
    state = {}
    if step > 0:
        for i, _ in enumerate(_params(optimizer)):
            state[i] = {"step": torch.tensor(float(step), dtype=torch.float32)}
            for name in _ADAM_KEYS:
                state[i][name] = loaded[f"{name}.{i}"]
    sd["state"] = state
    optimizer.load_state_dict(sd)
