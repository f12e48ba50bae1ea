"""LoRA adapters as ordinary submodules of Megatron's linear layers.

``LoRALinear`` wraps one Megatron linear (``ColumnParallelLinear``, ``RowParallelLinear`` or a
Transformer Engine linear) and adds ``scale * B(A(dropout(x)))`` to its output. The adapters
are plain ``nn.Parameter``s of the layer, so Megatron's ``CudaGraphManager`` sees them among
the layer's connected parameters, and their matmuls are plain torch ops: under TE's FP8
autocast they stay in the parameter dtype (bf16).

Tensor parallelism (as NeMo's ``ParallelLinearAdapter``):

* column-parallel base (input full, output sharded): A is replicated (in -> r); its output
  enters the TP region with ``copy_to_tensor_model_parallel_region`` (all-reduce of the
  gradient); B is sharded (r -> out / tp).
* row-parallel base (input sharded, output reduced): A is sharded (in / tp -> r), its partial
  output is summed with ``reduce_from_tensor_model_parallel_region``; B is replicated.

Sequence parallelism (``config.sequence_parallel``, TP > 1): the column base's input is this
rank's sequence shard [S/tp, B, in] (the base all-gathers it; TE's ``LayerNormLinear`` returns
its normalised input ungathered), the row base's output is reduce-scattered to [S/tp, B, out].
The adapter moves its rank-r activation instead of the base's: column, A runs on the shard and
``gather_from_sequence_parallel_region`` all-gathers h [S, B, r] (backward: reduce-scatter, the
sum copy_to_tensor_model_parallel_region's all-reduce did); row, the partial h [S, B, r] is
``reduce_scatter_to_sequence_parallel_region``-ed to [S/tp, B, r] before B. The weight that then
sees only this rank's sequence shard (column: A, row: B) gets a partial gradient, so it is
marked ``sequence_parallel = True``: Megatron's ``finalize_model_grads`` sums such gradients
over the TP group, as it does for the layernorm weights.

Dropout of the adapter's input follows Megatron's RNG convention: an input sharded over TP
(row-parallel base, or column-parallel under sequence parallelism) draws from Megatron's CUDA RNG
tracker (the Transformer Engine tracker when ``use_te_rng_tracker``; a different mask per TP
rank), a replicated one (column-parallel, no SP) from the default generator (the same mask on
every TP rank). Both are replayable by CUDA graphs (torch registers the default generator with
a capture, Megatron the tracker's). NeMo's ``ParallelLinearAdapter`` uses the default generator
for both, so its row-parallel masks repeat across TP ranks; ours do not. On CPU: the default
generator.

Shapes: x [S, B, in_local] -> delta [S, B, out_local].
"""

from __future__ import annotations

import contextlib
import math

import torch

from megatron_fastpath.compat import te as te_compat
from megatron_fastpath.lora.config import LoRAConfig

__all__ = ["LoRALinear", "AdaptersLockedError"]


class AdaptersLockedError(RuntimeError):
    """Adapters were toggled or merged after CUDA-graph capture froze the layer."""


def _tp_world_and_rank(base) -> tuple:
    group = getattr(base, "tp_group", None)
    if group is not None:
        return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank())


class LoRALinear(torch.nn.Module):
    """A Megatron linear plus a LoRA adapter (built from a ModuleSpec, see ``with_lora``).

    Args:
        *args, **kwargs: the base linear's constructor arguments (Megatron passes them).
        base: the linear class to build (e.g. ``ColumnParallelLinear``).
        lora: :class:`LoRAConfig`.
        parallel: "column" or "row" -- how the base shards its weight.
    """

    def __init__(self, *args, base: type, lora: LoRAConfig, parallel: str, **kwargs):
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel must be 'column' or 'row'; got {parallel!r}")
        self.base = base(*args, **kwargs)
        self.lora_config = lora
        self.parallel = parallel
        self.scale = lora.alpha / lora.rank
        self._enabled = True
        self._locked = False
        weight = self.base.weight
        tp, tp_rank = _tp_world_and_rank(self.base)
        dtype = lora.dtype_or(weight.dtype)
        self.lora_A, self.lora_B = self._adapter_parameters(weight, tp, tp_rank, dtype)
        # Megatron's TP marks, read by the gradient norm (param_is_not_tensor_parallel_duplicate:
        # a sharded weight counts on every rank, a replicated one on TP rank 0 only).
        from megatron.core.tensor_parallel import (
            set_defaults_if_not_set_tensor_model_parallel_attributes,
            set_tensor_model_parallel_attributes,
        )

        sharded, replicated, dim = ((self.lora_B, self.lora_A, 0) if parallel == "column"
                                    else (self.lora_A, self.lora_B, 1))
        dim += self.lora_A.dim() - 2  # a leading adapter axis (MultiLoRALinear) shifts it
        set_tensor_model_parallel_attributes(sharded, True, dim, 1)
        set_defaults_if_not_set_tensor_model_parallel_attributes(replicated)
        self.tp_size = tp
        self.sequence_parallel = tp > 1 and bool(
            getattr(getattr(self.base, "config", None), "sequence_parallel", False))
        if self.sequence_parallel:  # partial gradient: summed over TP by finalize_model_grads
            setattr(self.lora_A if parallel == "column" else self.lora_B, "sequence_parallel", True)
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else None
        self._fused_layernorm = hasattr(self.base, "layer_norm_weight")
        if self._fused_layernorm:
            # TE LayerNormLinear: the adapter must see the *normalised* input.
            te_compat.return_layernorm_output(self.base)

    def _adapter_parameters(self, weight, tp: int, tp_rank: int, dtype) -> tuple:
        """(A [r, in_local], B [out_local, r]) as new parameters. Kaiming-uniform A (as PEFT /
        NeMo) drawn over the full input on every rank (same stream) and sliced to this rank's
        shard for a row base: the fan-in and the values are those of TP = 1 at any TP. Zero B:
        the adapter starts as an exact no-op. Column base: B holds this rank's output shard;
        row base: the full output."""
        out_local, in_local = weight.shape
        rank = self.lora_config.rank
        in_full = in_local * tp if self.parallel == "row" else in_local
        a_full = torch.empty(rank, in_full, device=weight.device, dtype=dtype)
        torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5))
        a_local = a_full.narrow(1, tp_rank * in_local, in_local) if in_full != in_local else a_full
        return (torch.nn.Parameter(a_local.clone()),
                torch.nn.Parameter(torch.zeros(out_local, rank, device=weight.device, dtype=dtype)))

    # ------------------------------------------------------------------ state
    @property
    def enabled(self) -> bool:
        return self._enabled

    def set_enabled(self, enabled: bool) -> None:
        if self._locked and enabled != self._enabled:
            raise AdaptersLockedError(
                "LoRA adapters cannot be toggled after CUDA-graph capture: the captured graphs "
                "would keep running the old branch. Toggle before the first captured step or "
                "rebuild the model."
            )
        self._enabled = enabled

    def lock(self) -> None:
        """Freeze the adapter's on/off state (called when CUDA graphs are captured)."""
        self._locked = True

    # ------------------------------------------------------------------ compute
    @property
    def input_sharded(self) -> bool:
        """The adapter's input differs per TP rank: a row-parallel base's input is split along
        the hidden dimension, a column-parallel base's is this rank's sequence shard under
        sequence parallelism; otherwise (column, no SP) every TP rank holds the same input."""
        return self.parallel == "row" or self.sequence_parallel

    def _dropout_rng(self):
        """Where the input dropout draws, by Megatron's convention: a sharded activation from
        the model-parallel RNG stream (a different mask per TP rank, as Megatron's attention
        dropout and its sequence-parallel hidden dropout), a replicated one from the default
        generator (the same mask on every TP rank, as Megatron's hidden dropout outside
        sequence parallelism). Forking for a replicated input gave each TP rank its own mask
        of the same activation. On a CPU (no CUDA tracker): the default generator."""
        if (self.dropout is None or not self.training or not self.input_sharded
                or not torch.cuda.is_available()):
            return contextlib.nullcontext()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return get_cuda_rng_tracker().fork()

    def adapter(self, x: torch.Tensor) -> torch.Tensor:
        """delta = scale * B(A(dropout(x))): [..., in_local] -> [..., out_local]."""
        if self.dropout is not None:
            with self._dropout_rng():
                x = self.dropout(x)
        h = torch.nn.functional.linear(x.to(self.lora_A.dtype), self.lora_A)
        if self.tp_size > 1:
            h = self._between_a_and_b(h)
        return torch.nn.functional.linear(h, self.lora_B) * self.scale

    def _between_a_and_b(self, h: torch.Tensor) -> torch.Tensor:
        """The TP collective on A's output h [.., r] (see the module docstring)."""
        from megatron.core.tensor_parallel import mappings

        group = getattr(self.base, "tp_group", None)
        if self.parallel == "column":
            if self.sequence_parallel:
                return mappings.gather_from_sequence_parallel_region(h, group=group)
            return mappings.copy_to_tensor_model_parallel_region(h, group=group)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(h, group=group)
        return mappings.reduce_from_tensor_model_parallel_region(h, group=group)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        if x.is_contiguous():
            # canonical strides, no copy: a contiguous [S, 1, H] may carry any stride on its
            # size-1 dim (Megatron's embedding: transpose(0, 1).contiguous() is a no-op at
            # micro-batch 1). aten::matmul with the frozen base weight folds to one mm only for
            # canonical strides (should_fold), else S batched 1-row GEMMs (bmm) that round
            # differently -- while a CUDA graph's static input is always canonical, so an eager
            # step and a replayed one differed in the last bits (fp32, TP 2 / TE linears)
            x = x.view(x.shape)
        out = self.base(x, *args, **kwargs)
        if self._fused_layernorm:
            output, bias, adapter_in = te_compat.split_layernorm_linear_output(out)
        else:
            output, bias = out
            adapter_in = x
        if self._enabled:
            output = output + self.adapter(adapter_in).to(output.dtype)
        return output, bias

    # ------------------------------------------------------------------ merge
    @torch.no_grad()
    def merged_weight_delta(self) -> torch.Tensor:
        """scale * B @ A in the base weight's local shape ([out_local, in_local])."""
        return (self.lora_B.float() @ self.lora_A.float() * self.scale).to(self.base.weight.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the adapter into the base weight and disable it (outputs unchanged)."""
        if self._locked:
            raise AdaptersLockedError("cannot merge LoRA adapters after CUDA-graph capture")
        self.base.weight.add_(self.merged_weight_delta())
        self._enabled = False

    # Megatron code reads attributes of its linears (weight, bias, backward_dw, ...).
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)

    def backward_dw(self) -> None:  # delayed weight-grad hook used by Megatron's overlap path
        if hasattr(self.base, "backward_dw"):
            self.base.backward_dw()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's distributed-checkpoint view of this layer.

        Checkpoint keys: the base layer's entries keep exactly the keys of a model without LoRA
        (``<prefix>weight``, ...), so a base checkpoint loads into a LoRA model and back; the
        adapters are ``<prefix>lora_A`` / ``<prefix>lora_B``, sharded like the adapter itself
        (column base: A replicated over TP, B split on dim 0; row base: A split on dim 1, B
        replicated) after the caller's ``sharded_offsets`` (layer / expert axes). The dict keys
        are this module's own state-dict names (``<prefix>base.weight``, ``<prefix>lora_A``), so
        ``load_state_dict`` of the loaded dict works unchanged."""
        from megatron.core import parallel_state
        from megatron.core.utils import (
            make_sharded_tensor_for_checkpoint,
            make_tp_sharded_tensor_for_checkpoint,
        )

        base_sd = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        out = {f"{prefix}base.{k[len(prefix):]}": v for k, v in base_sd.items()}
        tp_group = getattr(self.base, "tp_group", None)
        dp_cp_group = (metadata or {}).get("dp_cp_group")
        if tp_group is None or dp_cp_group is None:
            tp_group = parallel_state.get_tensor_model_parallel_group()
            dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        groups = dict(tp_group=tp_group, dp_cp_group=dp_cp_group)
        tp_axis = {"lora_A": None if self.parallel == "column" else 1,
                   "lora_B": 0 if self.parallel == "column" else None}
        lead = self.lora_A.dim() - 2  # a leading adapter axis (MultiLoRALinear), not sharded
        for name, axis in tp_axis.items():
            tensor, key = getattr(self, name), f"{prefix}{name}"
            axis = None if axis is None else axis + lead
            out[key] = (
                make_sharded_tensor_for_checkpoint(tensor, key, sharded_offsets, **groups)
                if axis is None
                else make_tp_sharded_tensor_for_checkpoint(
                    tensor, key, axis, prepend_offsets=sharded_offsets, **groups
                )
            )
        return out
