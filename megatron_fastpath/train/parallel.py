"""The ``parallel`` and ``cluster`` groups: Megatron's parallel sizes, its data-parallel
optimizer settings resolved once, and where the job runs.

:func:`resolve_data_parallel` turns the optimizer settings left null into what the run uses --
a pure function of the settings, the device, the launcher's world size and the graph scope,
called once by ``train.config.parse_job_config``. A null setting is on where the run can use it,
as NeMo / Megatron-Bridge recipes set it (Megatron-Bridge
``src/megatron/bridge/recipes/llama/llama3.py`` ``llama32_1b_pretrain_config`` and the other
pre-train recipes: ``cfg.ddp.overlap_grad_reduce = True``, ``cfg.ddp.overlap_param_gather =
True``, ``cfg.ddp.use_distributed_optimizer = True``), and off where it cannot: on a CPU (the
CPU step runs its own loop and torch AdamW, not Megatron's DDP) and with one data-parallel rank
(nothing to shard or overlap); the overlaps are off with full-iteration graphs too (``rules.py``
``_data_parallel_in_full_iteration``). A value set where the run cannot use it is refused by the
rules (:mod:`megatron_fastpath.rules`), with the reason and the fix.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_fastpath.settings import FINITE_POSITIVE, POSITIVE, setting

__all__ = ["ParallelConfig", "ClusterConfig", "resolve_data_parallel", "launched_world_size",
           "data_parallel_size"]

DP_OPTIMIZER_KEYS = ("distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The ``parallel`` group: Megatron's parallel sizes (data parallel: the world size over
    their product) and its data-parallel optimizer (null: resolved by
    :func:`resolve_data_parallel`)."""

    tensor_model_parallel_size: int = setting(1, "tensor-parallel size (TP)", POSITIVE)
    pipeline_model_parallel_size: int = setting(1, "pipeline-parallel size (PP; needs CUDA)", POSITIVE)
    expert_model_parallel_size: int = setting(1, "expert-parallel size (EP; needs an MoE model)", POSITIVE)
    context_parallel_size: int = setting(1, "context-parallel size (CP)", POSITIVE)
    sequence_parallel: bool = setting(
        False, "shard the sequence of the non-TP regions (norms, dropout, residuals) over the TP "
        "group (needs TP > 1 and CUDA)")
    distributed_optimizer: Optional[bool] = setting(
        None, "Megatron's distributed optimizer (ZeRO-1: optimizer state and fp32 main weights "
        "sharded over data parallelism); null: on with CUDA and more than one data-parallel "
        "rank (as NeMo / Megatron-Bridge recipes), off on a CPU and at DP 1")
    overlap_grad_reduce: Optional[bool] = setting(
        None, "reduce (reduce-scatter with the distributed optimizer) gradient buckets during "
        "the backward; null: as parallel.distributed_optimizer resolves, off with "
        "cuda_graphs.scope=full_iteration")
    overlap_param_gather: Optional[bool] = setting(
        None, "all-gather the updated parameters during the next forward (needs the "
        "distributed optimizer and overlap_grad_reduce); null: as "
        "parallel.overlap_grad_reduce resolves")
    bucket_size: Optional[int] = setting(
        None, "elements per gradient bucket with overlap_grad_reduce; null: Megatron's default "
        "(max(40M, 1M x DP))", POSITIVE)


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """Where the job runs (the ``cluster`` group)."""

    name: str = setting("local", "label printed in the header")
    backend: str = setting("auto", "process-group backend: auto (nccl on GPU, gloo on CPU) | gloo | nccl")
    expected_world_size: Optional[int] = setting(
        None, "refuse to train when the launcher started a different number of processes "
        "(a mis-sized srun / torchrun)", POSITIVE)
    timeout_s: Optional[float] = setting(
        None, "collective and rendezvous timeout in seconds (null: torch's default)", FINITE_POSITIVE)


def launched_world_size(environ=None) -> int:
    """The processes the launcher started (torchrun's WORLD_SIZE, srun's SLURM_NTASKS; 1)."""
    import os

    env = os.environ if environ is None else environ
    return int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))


def data_parallel_size(par: ParallelConfig, world_size: int) -> int:
    """Megatron's data-parallel size of the dense parameters with context parallelism folded
    in (its DDP and distributed optimizer shard over DP x CP): the world over TP x PP."""
    return max(1, world_size // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size))


def resolve_data_parallel(par: ParallelConfig, on_cuda: bool, world_size: int,
                          full_iteration: bool) -> ParallelConfig:
    """``par`` with its null data-parallel optimizer settings decided (module docstring): on
    with CUDA and more than one DP x CP rank, else off; the overlaps follow the distributed
    optimizer (the recipes set the three together) but for full-iteration graphs, where they are
    off; a set value is kept (the rules refuse what cannot run)."""
    usable = on_cuda and data_parallel_size(par, world_size) > 1
    dist = usable if par.distributed_optimizer is None else par.distributed_optimizer
    overlap = usable and dist and not full_iteration  # DDP's hooks do nothing in a capture
    grad = overlap if par.overlap_grad_reduce is None else par.overlap_grad_reduce
    gather = (overlap and grad) if par.overlap_param_gather is None else par.overlap_param_gather
    return dataclasses.replace(par, distributed_optimizer=dist, overlap_grad_reduce=grad,
                               overlap_param_gather=gather)
