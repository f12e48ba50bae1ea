"""Tensor-parallel gradient bookkeeping (hf/model.py, train/step.py)."""

from __future__ import annotations


from megatron_fastpath.compat import MCORE_0_19, _require_checked_mcore


# =============================================================================================
# Tensor-parallel gradient bookkeeping (hf/model.py, train/step.py).
#
# megatron-core 0.16.x marks a TP-sharded weight (``tensor_model_parallel``, ``partition_dim``,
# ``partition_stride``) only inside ``_initialize_affine_weight_cpu/gpu``
# (tensor_parallel/layers.py), which run only when ``config.perform_initialization``. A model
# built to be overwritten by a checkpoint (perform_initialization=False) has no marks, and the
# gradient norm (``param_is_not_tensor_parallel_duplicate``) then counts every sharded weight on
# TP rank 0 only: clipping at TP > 1 used a norm that missed the other ranks' shards.
# ``_allreduce_non_tensor_model_parallel_grads`` (distributed/finalize_model_grads.py) is
# Megatron's rule for TP-replicated weights whose gradient each rank computes in part (qk
# layernorm, sequence-parallel weights); finalize_model_grads calls it on the GPU path, the CPU
# path calls it here (it reads ``model_chunk.ddp_config`` and ``main_grad`` or ``grad``).
#
# 0.19.x sets the marks itself when perform_initialization is False (0.19.2
# tensor_parallel/layers.py:296 / :311 VocabParallelEmbedding, :991 / :1012 ColumnParallelLinear,
# :1354 / :1375 RowParallelLinear: ``else: set_tensor_model_parallel_attributes(...)``), so the
# marking is 0.16-only; ``_allreduce_non_tensor_model_parallel_grads(model, config, tp_group)``
# keeps its signature and its ``model_chunk.ddp_config`` read (distributed/finalize_model_grads.py:416).
# =============================================================================================
_TP_MARKS_REASON = ("Megatron's local TP layers set their weights' tensor_model_parallel marks "
                    "only when perform_initialization (tensor_parallel/layers.py)")
_TP_REDUCE_REASON = ("distributed/finalize_model_grads.py _allreduce_non_tensor_model_parallel_grads"
                     "(model_chunks, config, tp_group) reads model_chunk.ddp_config")


def mark_tensor_parallel_weights(model) -> int:
    """Give the weights of Megatron's local TP layers (vocab embedding and column linears:
    dim 0, row linears: dim 1) the marks Megatron sets when it initialises them, where they are
    missing; returns how many were marked (0 on 0.19.x, whose layers mark them themselves)."""
    if _require_checked_mcore("mark_tensor_parallel_weights", _TP_MARKS_REASON) == MCORE_0_19:
        return 0
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    dims = ((VocabParallelEmbedding, 0), (ColumnParallelLinear, 0), (RowParallelLinear, 1))
    marked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        dim = next((d for cls, d in dims if isinstance(module, cls)), None)
        if dim is not None and weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)
            marked += 1
    return marked


class _GradChunk:
    """A model as the model chunk Megatron's reduction reads (``ddp_config`` + ``.module``)."""

    def __init__(self, module):
        from megatron.core.distributed import DistributedDataParallelConfig

        self.module = module
        self.ddp_config = DistributedDataParallelConfig()


def allreduce_tp_partial_grads(model, config) -> None:
    """Megatron's own reduction of the gradients of TP-replicated weights that each TP rank
    computes only in part (qk layernorm with ``config.qk_layernorm``, weights marked
    ``sequence_parallel`` with ``config.sequence_parallel``), on a model without DDP."""
    _require_checked_mcore("allreduce_tp_partial_grads", _TP_REDUCE_REASON)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    _allreduce_non_tensor_model_parallel_grads(
        [_GradChunk(model)], config, ps.get_tensor_model_parallel_group())
