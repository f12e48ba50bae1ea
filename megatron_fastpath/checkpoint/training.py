"""The model, optimizer and LR-scheduler parts of a checkpoint (:mod:`.parts`).

``training_parts(model, optimizer, scheduler, adapters_only)`` returns ``{"model": ...,
"optimizer": ..., "scheduler": scheduler}``, in the order they load:

* ``model``: the sharded model state (adapters only: the LoRA tensors), loaded back checking
  that only what a checkpoint legitimately leaves out is missing;
* ``optimizer``: its step and hyper-parameters (JSON) and its sharded state (keyed like the
  parameters; none before the first step of a torch optimizer); a Megatron DistributedOptimizer's
  state in the format ``optimizer_format`` names, recorded as ``format`` beside it (with torch
  Adam's step count, ``adam_step``, and the format's non-tensor objects, ``objects``) and read
  back in that format;
* ``scheduler``: Megatron's ``OptimizerParamScheduler`` as it is (its own ``state_dict`` /
  ``load_state_dict``).

The optimizer's tensors to load into depend on the checkpoint's saved step (no state before the
first step, read from the part's saved JSON), and they are keyed by the model's sharded state.
"""

from __future__ import annotations

from megatron_fastpath.checkpoint.errors import CheckpointFormatError, CheckpointMismatchError
from megatron_fastpath.checkpoint.optim import (
    _is_megatron,
    common_step,
    distributed_format,
    load_optimizer_state,
    optimizer_hyperparams,
    optimizer_sharded_state,
)
from megatron_fastpath.checkpoint.parts import SHARDED
from megatron_fastpath.compat.dist_optim_ckpt import DEFAULT_OPTIMIZER_FORMAT

__all__ = ["training_parts", "is_adapter_key", "ModelPart", "OptimizerPart", "DEFAULT_OPTIMIZER_FORMAT"]


def is_adapter_key(key: str) -> bool:
    return key.endswith((".lora_A", ".lora_B"))


class ModelPart:
    """The model's sharded state (``adapters_only``: its LoRA tensors only)."""

    def __init__(self, model, adapters_only: bool = False):
        self.model, self.adapters_only = model, adapters_only

    def sharded(self) -> dict:
        sd = self.model.sharded_state_dict()
        if self.adapters_only:
            sd = {k: v for k, v in sd.items() if is_adapter_key(k)}
            if not sd:
                raise ValueError("checkpoint.adapters_only=true but the model has no LoRA adapters")
        return sd

    def state_dict(self) -> dict:
        return {SHARDED: self.sharded()}

    def load_state_dict(self, state_dict: dict) -> None:
        result = self.model.load_state_dict(state_dict[SHARDED], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")
                   and not (self.adapters_only and not is_adapter_key(k))]
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"checkpoint model state does not match the model: missing {missing[:10]}, "
                f"unexpected {result.unexpected_keys[:10]}"
            )


class OptimizerPart:
    """The optimizer: ``step`` and ``groups`` (hyper-parameters) as JSON, its state as sharded
    tensors keyed like the parameters of ``model`` (a :class:`ModelPart`). A Megatron
    DistributedOptimizer's state is written in ``optimizer_format``, recorded as ``format``."""

    def __init__(self, optimizer, model: ModelPart, optimizer_format: str = DEFAULT_OPTIMIZER_FORMAT):
        self.optimizer, self.model = optimizer, model
        self.format = distributed_format(optimizer, optimizer_format)
        self._to_load = None  # the sharded state asked to load (sharded_to_load)

    def _sharded(self, step: int, loading: bool, fmt) -> dict:
        stepped = step > 0 or _is_megatron(self.optimizer)  # Megatron's holds its own step
        return optimizer_sharded_state(self.optimizer, self.model.sharded(), loading=loading,
                                       optimizer_format=fmt) if stepped else {}

    def state_dict(self) -> dict:
        step = common_step(self.optimizer)
        state = {"step": step, "groups": optimizer_hyperparams(self.optimizer),
                 SHARDED: self._sharded(step, loading=False, fmt=self.format)}
        if self.format is not None:  # with torch Adam's step and the format's objects as JSON
            from megatron_fastpath.compat.dist_optim_ckpt import sharded_objects, torch_adam_step

            state.update(format=self.format, adam_step=torch_adam_step(self.optimizer),
                         objects=sharded_objects(state[SHARDED]))
        return state

    def saved_format(self, saved: dict):
        """The DistributedOptimizer format ``saved`` (this part's saved JSON) was written in;
        refused when it is not this optimizer's kind of state or not readable here."""
        from megatron_fastpath.compat.dist_optim_ckpt import optimizer_format_problem

        fmt = saved.get("format")
        if (fmt is None) != (self.format is None):
            saved_kind, this_kind = ("a DistributedOptimizer's", "a non-distributed optimizer") if \
                fmt is not None else ("a non-distributed optimizer's", "a DistributedOptimizer")
            raise CheckpointMismatchError(
                f"the checkpoint holds {saved_kind} state and this run has {this_kind}: resume "
                "with the optimizer it was saved with (parallel.distributed_optimizer / "
                "use_distributed_optimizer as saved)")
        why = None if fmt is None else optimizer_format_problem(fmt)
        if why is not None:
            raise CheckpointFormatError(
                f"the checkpoint's DistributedOptimizer state is in format {fmt!r}, which cannot "
                f"be loaded here: {why}; load it with the megatron-core and megatron_fastpath "
                "that wrote it")
        return fmt

    def sharded_to_load(self, saved: dict) -> dict:
        self._to_load = self._sharded(saved["step"], loading=True, fmt=self.saved_format(saved))
        return self._to_load

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("objects"):  # a DistributedOptimizer's, saved as JSON (compat/dist_optim_ckpt.py)
            from megatron_fastpath.compat.dist_optim_ckpt import put_objects_back

            put_objects_back(self._to_load, state_dict[SHARDED], state_dict["objects"])
        load_optimizer_state(self.optimizer, state_dict[SHARDED], state_dict["step"], state_dict["groups"],
                             self.saved_format(state_dict), state_dict.get("adam_step"))


def training_parts(model, optimizer, scheduler, adapters_only: bool = False,
                   optimizer_format: str = DEFAULT_OPTIMIZER_FORMAT) -> dict:
    """``{"model", "optimizer", "scheduler"}`` parts of a checkpoint (module docstring)."""
    model_part = ModelPart(model, adapters_only)
    return {"model": model_part, "optimizer": OptimizerPart(optimizer, model_part, optimizer_format),
            "scheduler": scheduler}
