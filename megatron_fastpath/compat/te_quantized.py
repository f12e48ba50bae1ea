"""Transformer Engine awareness, imported lazily (TE does not install on CPU machines).

* Quantized tensors (TE ``QuantizedTensor`` / ``Float8Tensor`` / ``MXFP8Tensor`` and their storage
  bases) are recognised by their save protocol: ``tensors, obj = t.prepare_for_saving()`` splits
  one into plain data tensors (``None`` for absent ones) and ``obj.restore_from_saved(tensors)``
  rebuilds it. ``prepare_for_saving`` clears the object it is called on, so the manager splits a
  detached view (same data, new object) and leaves the live tensor intact; it offloads the data
  tensors and rebuilds the view on reload.
* Do-not-offload marks: TE's ``mark_not_offload`` sets ``_TE_do_not_offload``; Megatron-Core's
  fine-grained offloading sets ``offloading_activation = False``. Parameters (and views of
  parameters) are never offloaded.
* FP8 recompute: when the forward runs under TE's FP8 autocast, the recompute in backward must run
  under the same recipe and inside TE's ``activation_recompute_forward(recompute_phase=True)`` so
  the amax history is not updated twice (what TE's own ``checkpoint`` does).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from megatron_fastpath._optional import optional_import

__all__ = [
    "is_quantized",
    "detached_view",
    "split_quantized",
    "restore_quantized",
    "never_offload",
    "FP8RecomputeState",
]


def is_quantized(t: Any) -> bool:
    """True for objects implementing TE's save protocol (QuantizedTensor & storage classes)."""
    return callable(getattr(t, "prepare_for_saving", None)) and callable(
        getattr(t, "restore_from_saved", None)
    )


def detached_view(t: Any) -> Optional[Any]:
    """A new quantized object sharing ``t``'s data tensors, or None when there is no way to make
    one. TE's ``prepare_for_saving`` clears the data attributes of the object it is called on
    (``self._data = None`` ...), and ``t`` is live: the forward may still read it. TE 2.10:
    ``QuantizedTensor`` subclasses implement ``detach()`` as ``make_like(self)`` (same data,
    new object); storage classes (``Float8TensorStorage``...) take ``get_metadata()`` back as
    their constructor keywords."""
    if isinstance(t, torch.Tensor):
        return t.detach()
    metadata = getattr(t, "get_metadata", None)
    if callable(metadata):
        return type(t)(**metadata())
    return None


def split_quantized(t: Any) -> Optional[tuple[list[Optional[torch.Tensor]], Any]]:
    """``prepare_for_saving()`` on a detached view of ``t``: (plain data tensors or None, object
    to rebuild from); ``t`` itself keeps its data. None when no view can be made."""
    view = detached_view(t)
    if view is None or view is t:
        return None
    tensors, obj = view.prepare_for_saving()
    return list(tensors), obj


def restore_quantized(obj: Any, tensors: list[Optional[torch.Tensor]]) -> Any:
    """``restore_from_saved()``: give the reloaded data tensors back; returns the object."""
    rest = obj.restore_from_saved(list(tensors))
    if rest:
        raise RuntimeError(
            f"{type(obj).__name__}.restore_from_saved left {len(rest)} tensors unused: "
            "the split and the rebuild disagree"
        )
    return obj


def never_offload(t: torch.Tensor) -> bool:
    """Parameters, views of parameters and tensors marked do-not-offload stay on the device."""
    if isinstance(t, torch.nn.Parameter):
        return True
    base = t._base
    if base is not None and isinstance(base, torch.nn.Parameter):
        return True
    if getattr(t, "_TE_do_not_offload", False):
        return True
    if getattr(t, "offloading_activation", True) is False:
        return True
    return False


class FP8RecomputeState:
    """FP8 autocast state captured in forward and re-entered for the recompute in backward.

    Inactive (``enabled`` False) when TE is missing or FP8 is not on in the forward."""

    def __init__(self):
        self.enabled = False
        self.recipe = None
        self.group = None
        self._dist = None
        te_fp8 = optional_import("transformer_engine.pytorch.fp8")
        manager = getattr(te_fp8, "FP8GlobalStateManager", None) if te_fp8 else None
        if manager is not None and manager.is_fp8_enabled():
            self.enabled = True
            self.recipe = manager.get_fp8_recipe()
            self.group = manager.get_fp8_group()
            self._dist = optional_import("transformer_engine.pytorch.distributed")

    def forward_context(self):
        """Forward of a recomputed region (no amax bookkeeping differences)."""
        if not self.enabled or self._dist is None:
            return contextlib.nullcontext()
        return self._dist.activation_recompute_forward(
            activation_recompute=True, recompute_phase=False
        )

    def recompute_context(self):
        """Backward recompute: same FP8 recipe, TE's recompute phase."""
        if not self.enabled:
            return contextlib.nullcontext()
        te = optional_import("transformer_engine.pytorch")
        stack = contextlib.ExitStack()
        if self._dist is not None:
            stack.enter_context(
                self._dist.activation_recompute_forward(
                    activation_recompute=True, recompute_phase=True
                )
            )
        autocast = getattr(te, "fp8_autocast", None)
        if autocast is not None:
            stack.enter_context(
                autocast(enabled=True, fp8_recipe=self.recipe, fp8_group=self.group)
            )
        else:  # TE >= 2.8 renamed it
            stack.enter_context(
                te.autocast(enabled=True, recipe=self.recipe, amax_reduction_group=self.group)
            )
        return stack
