"""What a checkpoint saves of a run: its parts, each behind one protocol.

A part is anything with ``state_dict()`` and ``load_state_dict(state)``, the two methods of
``torch.distributed.checkpoint.stateful.Stateful`` (torchtitan's CheckpointManager saves its
model, optimizers, LR schedulers, data loader and train state the same way). The manager saves
and loads a ``{name: part}`` dict without knowing what each part is: the main job's are
``model``, ``optimizer``, ``scheduler`` (:func:`megatron_fastpath.checkpoint.training_parts`;
the LR scheduler is a part as it is), ``data`` (the data position) and ``history``.

A part's state is a dict. Its tensors, if it has any, are Megatron's sharded state dict under
the key :data:`SHARDED` (saved by dist_checkpointing in ``model/``, resharded on load); the rest
is plain JSON, saved under the part's name in ``train_state.json`` (never pickled). To load, the
manager asks each part that has tensors for fresh ones to load into (:func:`sharded_to_load`)
and hands every part its saved JSON with its loaded tensors under :data:`SHARDED`, in the order
of the dict (the model before the optimizer that steps its parameters).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["CheckpointPart", "SHARDED", "split_state", "sharded_to_load"]

SHARDED = "sharded"  # a part's sharded tensors (dist_checkpointing), beside its JSON state


@runtime_checkable
class CheckpointPart(Protocol):
    """One part of a checkpoint (module docstring). A part whose tensors to load into are not
    the ones it saves (an optimizer before its first step has none) also has
    ``sharded_to_load(saved) -> sharded state dict``, given the JSON state it saved."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


def split_state(state: dict) -> tuple:
    """(sharded tensors or None, JSON state) of a part's state dict."""
    if not isinstance(state, dict):
        raise TypeError(f"a checkpoint part's state_dict() must be a dict; got a {type(state).__qualname__}")
    return state.get(SHARDED), {k: v for k, v in state.items() if k != SHARDED}


def sharded_to_load(part, saved: dict):
    """The tensors ``part`` loads into (None: it has none), given the JSON state it saved."""
    hook = getattr(part, "sharded_to_load", None)
    if hook is not None:
        return hook(saved)
    return split_state(part.state_dict())[0]
