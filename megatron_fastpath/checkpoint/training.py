"""The model / optimizer / LR-scheduler side of a checkpoint, for :class:`CheckpointManager`.

``training_state(model, optimizer, scheduler, adapters_only)`` returns
``(state_fn, apply_fn, parts_fn)``:

* ``state_fn(loading, saved=None)``: the tensors, ``{"model": sharded model state,
  "optimizer": sharded optimizer state}`` (adapters only: the LoRA tensors and their optimizer
  state); ``saved``: the checkpoint's ``train_state.json`` when loading;
* ``apply_fn(loaded, parts)``: load them back (model, optimizer, scheduler), checking that only
  what a checkpoint legitimately leaves out is missing;
* ``parts_fn()``: the JSON parts, each under its own name: ``{"optimizer": its step and
  hyper-parameters, "scheduler": the LR scheduler's state_dict}``.

They go together: loading the optimizer's tensors needs its saved step (no state before the
first step), and the scheduler's state is the optimizer's learning rate.
"""

from __future__ import annotations

from megatron_fastpath.checkpoint.optim import (
    _is_megatron,
    common_step,
    load_optimizer_state,
    optimizer_hyperparams,
    optimizer_sharded_state,
)

__all__ = ["training_state", "is_adapter_key"]


def is_adapter_key(key: str) -> bool:
    return key.endswith((".lora_A", ".lora_B"))


def training_state(model, optimizer, scheduler, adapters_only: bool = False):
    def model_sd():
        sd = model.sharded_state_dict()
        if adapters_only:
            sd = {k: v for k, v in sd.items() if is_adapter_key(k)}
            if not sd:
                raise ValueError("checkpoint.adapters_only=true but the model has no LoRA adapters")
        return sd

    def state_fn(loading: bool, saved: dict = None):
        msd = model_sd()
        step = saved["parts"]["optimizer"]["step"] if loading else common_step(optimizer)
        stepped = step > 0 or _is_megatron(optimizer)  # Megatron's holds its own step
        opt = optimizer_sharded_state(optimizer, msd, loading=loading) if stepped else {}
        return {"model": msd, "optimizer": opt}

    def apply_fn(loaded: dict, parts: dict) -> None:
        result = model.load_state_dict(loaded["model"], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")
                   and not (adapters_only and not is_adapter_key(k))]
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"checkpoint model state does not match the model: missing {missing[:10]}, "
                f"unexpected {result.unexpected_keys[:10]}"
            )
        opt = parts["optimizer"]
        load_optimizer_state(optimizer, loaded["optimizer"], opt["step"], opt["groups"])
        scheduler.load_state_dict(parts["scheduler"])

    def parts_fn() -> dict:
        return {
            "optimizer": {"step": common_step(optimizer), "groups": optimizer_hyperparams(optimizer)},
            "scheduler": scheduler.state_dict(),
        }

    return state_fn, apply_fn, parts_fn
