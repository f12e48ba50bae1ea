"""OffloadedTransformerLayer: a Megatron TransformerLayer whose activations go through the
offload manager.

``OffloadConfig.recompute=True`` (default): the layer is recomputed in backward (an
autograd.Function like Megatron's ``CheckpointFunction``, but CPU/CUDA-correct RNG handling and
TE FP8 recompute state) and only its input hidden states [s, b, h] are kept -- in the manager's
host pool. The Function's backward is the "layer i backward starts" point: it waits for layer
i's reload and issues the prefetch of layer i-1 before recomputing.

``recompute=False``: the layer runs normally under ``saved_tensors_hooks`` that hand every saved
tensor to the manager (TE quantized tensors split, parameters and do-not-offload marks
respected); identity Functions at the layer's output / input mark its backward start / end.

The layer accepts Megatron's TransformerLayer forward arguments (positional or keyword:
attention_mask, rotary_pos_emb, packed_seq_params, ...) and returns what TransformerLayer
returns, ``(hidden_states [s, b, h], context)``. Outside training with autograd (eval,
``torch.no_grad``, inference contexts) it is exactly TransformerLayer.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from megatron_fastpath.compat import offload as offload_compat
from megatron_fastpath._autograd import call_in_backward
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer
from megatron.core.utils import make_viewless_tensor

from megatron_fastpath.offload.manager import ActivationOffloadManager, OffloadGroup
from megatron_fastpath.compat.te_quantized import FP8RecomputeState

__all__ = [
    "ActivationOffloadMixin",
    "OffloadedTransformerLayer",
    "OffloadedMoETransformerLayer",
    "offloaded_layer_class",
]

_FORWARD_PARAMS = offload_compat.transformer_layer_forward_params()
_POSITIONAL_NAMES = [
    p.name for p in _FORWARD_PARAMS
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
]


# ---------------------------------------------------------------------------------------------
# RNG: CPU generator (+ Megatron's tracker when set up) on CPU; Megatron's full set on CUDA.
# ---------------------------------------------------------------------------------------------
def _get_rng_states(device: torch.device):
    if device.type == "cuda":
        get_all, _ = offload_compat.all_rng_state_tools()
        return ("cuda", get_all())
    tracker = get_cuda_rng_tracker()
    tracker_states = tracker.get_states() if tracker.is_initialized() else None
    return ("cpu", torch.get_rng_state(), tracker_states)


def _set_rng_states(states) -> None:
    if states[0] == "cuda":
        _, set_all = offload_compat.all_rng_state_tools()
        set_all(*states[1])
        return
    torch.set_rng_state(states[1])
    if states[2] is not None:
        get_cuda_rng_tracker().set_states(states[2])


@contextlib.contextmanager
def _rng_restored(states, device: torch.device):
    """Run with the RNG as it was in forward; restore the current state afterwards."""
    current = _get_rng_states(device)
    _set_rng_states(states)
    try:
        yield
    finally:
        _set_rng_states(current)


# ---------------------------------------------------------------------------------------------
# autograd Functions
# ---------------------------------------------------------------------------------------------
class _OffloadedCheckpoint(torch.autograd.Function):
    """Recompute the layer in backward from its input, staged through the offload manager.

    Inputs: run_fn, manager, key, names of the tensor kwargs, hidden_states [s, b, h], the
    manager's grad anchor, then the tensor kwargs (attention_mask, rotary_pos_emb, ...)."""

    @staticmethod
    def forward(ctx, run_fn, manager: ActivationOffloadManager, key: str, kw_names: tuple,
                hidden_states: torch.Tensor, anchor: torch.Tensor, *kw_tensors):
        ctx.run_fn = run_fn
        ctx.manager = manager
        ctx.kw_names = kw_names
        ctx.device = hidden_states.device
        ctx.rng = _get_rng_states(hidden_states.device)
        ctx.fp8 = FP8RecomputeState()
        ctx.hs_requires_grad = hidden_states.requires_grad
        ctx.kw_requires_grad = tuple(t.requires_grad for t in kw_tensors)

        group = manager.open_group(key)
        ctx.packed = manager.pack(group, hidden_states)
        manager.close_group(group)  # D2H copy overlaps this layer's forward
        ctx.group = group
        ctx.save_for_backward(*kw_tensors)

        manager.mark("compute_begin", key, phase="fwd")
        with ctx.fp8.forward_context():
            outputs = run_fn(hidden_states, dict(zip(kw_names, kw_tensors)))
        manager.mark("compute_end", key, phase="fwd")
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        manager: ActivationOffloadManager = ctx.manager
        group: OffloadGroup = ctx.group
        manager.begin_backward(group)

        hidden_states = manager.unpack(ctx.packed).detach()
        hidden_states.requires_grad_(ctx.hs_requires_grad)
        kw_tensors = [
            t.detach().requires_grad_(rg) for t, rg in zip(ctx.saved_tensors, ctx.kw_requires_grad)
        ]
        with _rng_restored(ctx.rng, ctx.device), torch.enable_grad(), ctx.fp8.recompute_context():
            outputs = ctx.run_fn(hidden_states, dict(zip(ctx.kw_names, kw_tensors)))
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [
            (o, g) for o, g in zip(outputs, grad_outputs)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        manager.end_backward(group)
        ctx.packed = None
        grads = [t.grad if rg else None for t, rg in zip(kw_tensors, ctx.kw_requires_grad)]
        hs_grad = hidden_states.grad if ctx.hs_requires_grad else None
        return (None, None, None, None, hs_grad, None, *grads)


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------
class ActivationOffloadMixin:
    """Mixin for TransformerLayer subclasses; see the module docstring.

    Extra constructor argument (passed through ModuleSpec ``params``):
        offload_manager: the :class:`ActivationOffloadManager` shared by the model chunk's layers.
    """

    def __init__(self, *args, offload_manager: Optional[ActivationOffloadManager] = None,
                 **kwargs):
        if not isinstance(offload_manager, ActivationOffloadManager):
            raise TypeError(
                f"{type(self).__name__} needs offload_manager=ActivationOffloadManager(...) "
                f"(got {type(offload_manager).__name__}); build the layer spec with "
                "megatron_fastpath.offload.with_activation_offload(spec, config_or_manager)"
            )
        config = kwargs.get("config", args[0] if args else None)
        if getattr(config, "recompute_granularity", None) == "full":
            raise ValueError(
                "TransformerConfig.recompute_granularity='full' makes TransformerBlock checkpoint "
                "the layers with Megatron's CheckpointFunction around this layer's own "
                "recompute; set recompute_granularity=None (OffloadConfig.recompute=True "
                "recomputes every offloaded layer) or 'selective' with "
                "OffloadConfig(recompute=False)"
            )
        graphs = getattr(config, "cuda_graph_impl", "none")
        if graphs not in (None, "none") or getattr(config, "enable_cuda_graph", False):
            raise ValueError(
                f"activation offload cannot be combined with CUDA graphs (TransformerConfig."
                f"cuda_graph_impl={graphs!r}): the offload copies fork side streams from the "
                "capture stream and the reload schedule is decided on the host every step, which "
                "a graph replay would freeze. Set cuda_graph_impl='none' "
                "(fastpath.cuda_graphs=false) or drop with_activation_offload "
                "(fastpath.offload=false)"
            )
        super().__init__(*args, **kwargs)
        self.offload_manager = offload_manager
        self.offload_key = offload_manager.register_layer(self.layer_number)

    def _offload_active(self, kwargs: dict) -> bool:
        return (
            self.training
            and torch.is_grad_enabled()
            and kwargs.get("inference_context") is None
            and kwargs.get("inference_params") is None
        )

    @staticmethod
    def _bind(args: tuple, kwargs: dict) -> dict:
        if len(args) > len(_POSITIONAL_NAMES):
            raise TypeError(
                f"TransformerLayer.forward takes at most {len(_POSITIONAL_NAMES)} positional "
                f"arguments ({len(args)} given)"
            )
        bound = dict(zip(_POSITIONAL_NAMES, args))
        for name in kwargs:
            if name in bound:
                raise TypeError(f"TransformerLayer.forward got multiple values for {name!r}")
        bound.update(kwargs)
        if bound.get("hidden_states") is None:
            raise TypeError("TransformerLayer.forward needs hidden_states [s, b, h]")
        return bound

    def forward(self, *args, **kwargs):
        """Same arguments and return value as ``TransformerLayer.forward``."""
        if not self._offload_active(kwargs):
            return super().forward(*args, **kwargs)
        bound = self._bind(args, kwargs)
        bound.pop("dynamic_inference_decode_only", None)
        hidden_states = bound.pop("hidden_states")
        manager = self.offload_manager
        if manager.config.recompute:
            return self._forward_recompute(manager, hidden_states, bound)
        return self._forward_saved_tensors(manager, hidden_states, bound)

    def _forward_recompute(self, manager, hidden_states, bound):
        kw_names = tuple(k for k, v in bound.items() if isinstance(v, torch.Tensor))
        kw_tensors = tuple(bound[k] for k in kw_names)
        static = {k: v for k, v in bound.items() if k not in kw_names}
        parent_forward = super().forward

        def run_fn(hs: torch.Tensor, tensor_kwargs: dict):
            return parent_forward(hidden_states=hs, **static, **tensor_kwargs)

        output, context = _OffloadedCheckpoint.apply(
            run_fn, manager, self.offload_key, kw_names, hidden_states,
            manager.grad_anchor(hidden_states), *kw_tensors,
        )
        return output, context

    def _forward_saved_tensors(self, manager, hidden_states, bound):
        group = manager.open_group(self.offload_key)
        ends = functools.partial(manager.end_backward, group)
        hidden_states = make_viewless_tensor(
            call_in_backward(hidden_states, ends), requires_grad=True, keep_graph=True
        )
        manager.mark("compute_begin", self.offload_key, phase="fwd")
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: manager.pack(group, t), manager.unpack
        ):
            output, context = super().forward(hidden_states=hidden_states, **bound)
        manager.mark("compute_end", self.offload_key, phase="fwd")
        manager.close_group(group)
        begins = functools.partial(manager.begin_backward, group)
        output = make_viewless_tensor(
            call_in_backward(output, begins), requires_grad=True, keep_graph=True
        )
        return output, context


class OffloadedTransformerLayer(ActivationOffloadMixin, TransformerLayer):
    """Megatron ``TransformerLayer`` with activation offload (see the module docstring)."""


class OffloadedMoETransformerLayer(ActivationOffloadMixin, MoETransformerLayer):
    """Megatron ``MoETransformerLayer`` with activation offload."""


_CLASS_CACHE: dict[type, type] = {
    TransformerLayer: OffloadedTransformerLayer,
    MoETransformerLayer: OffloadedMoETransformerLayer,
}


def offloaded_layer_class(layer_cls: type) -> type:
    """The offloading subclass of a TransformerLayer class (created once for custom ones)."""
    if not (isinstance(layer_cls, type) and issubclass(layer_cls, TransformerLayer)):
        raise TypeError(
            f"activation offload wraps TransformerLayer subclasses, got {layer_cls!r}"
        )
    if issubclass(layer_cls, ActivationOffloadMixin):
        return layer_cls
    if layer_cls not in _CLASS_CACHE:
        _CLASS_CACHE[layer_cls] = type(
            f"Offloaded{layer_cls.__name__}", (ActivationOffloadMixin, layer_cls),
            {"__module__": __name__, "__doc__": f"{layer_cls.__name__} with activation offload."},
        )
    return _CLASS_CACHE[layer_cls]
