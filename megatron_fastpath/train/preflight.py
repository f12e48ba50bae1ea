"""``preflight(job_config)``: what the main job does between the parse and its first device work.

:func:`~megatron_fastpath.train.config.parse_job_config` is pure: it reads the tree and what is
known without a device, and calls the rules once. The preflight then, in this order:

* creates ``checkpoint.dir`` and writes / removes a probe file in it, and checks that each
  export directory can be written (:func:`megatron_fastpath.paths.check_output_dir`) -- a file,
  a read-only disk or a missing permission is refused before anything is built;
* sets the plan's environment where the user has not (``graphs.config.apply_env``): before
  anything initialises CUDA, whose caching allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` once;
* :func:`check_device`: asks the GPU for its capability where a rule reads it, and takes the
  rules again with it (the same rules the parse called), then the memory check
  (:func:`memory_estimate`: per rank, at the launcher's data-parallel size, the optimizer
  state sharded where the distributed optimizer shards it).

Its errors are ValueError / CheckpointError, one line each (the main job's ``main()`` prints
them and exits 2). :func:`~megatron_fastpath.train.job.build_job` runs it first, so ``run()``
and the main entry point run it before any device work.
"""

from __future__ import annotations

import dataclasses

from megatron_fastpath import rules
from megatron_fastpath.train.config import JobConfig, refuse

__all__ = ["check_device", "check_output_dirs", "memory_estimate", "needs_capability", "preflight"]


def preflight(job: JobConfig) -> None:
    """Prepare the machine for ``job`` (a parsed ``JobConfig``) and refuse it when the machine
    cannot run it -- before any device work."""
    from megatron_fastpath.graphs.config import apply_env

    check_output_dirs(job)
    apply_env(job.plan.env)  # before CUDA initialises (check_device may initialise it)
    check_device(job)


def check_output_dirs(job: JobConfig) -> None:
    """``checkpoint.dir`` created and probed (the job locks it at start anyway); each export
    directory one the export at the end can write, created by nothing here."""
    from megatron_fastpath.paths import check_output_dir

    if job.checkpoint is not None and job.checkpoint.enabled:
        from megatron_fastpath.checkpoint.files import check_checkpoint_dir

        check_checkpoint_dir(job.checkpoint.dir)
    if job.export is not None:
        for key, path in job.export.dirs().items():
            check_output_dir(path, key, create=False)


def needs_capability(job: JobConfig) -> bool:
    """Whether a rule reads the GPU's capability for this job: the captured MoE layers'
    grouped GEMMs (``rules._grouped_mm_in_graphs``; asking initialises CUDA, so only then)."""
    return job.plan.capture and job.is_moe


def check_device(job: JobConfig) -> None:
    """The checks that ask the machine: the rules again with the GPU's capability (where one
    reads it) and the memory check (``training.skip_memory_check`` skips it)."""
    if needs_capability(job):
        import torch

        capability = tuple(torch.cuda.get_device_capability(job.device))
        refuse(rules.refusals(dataclasses.replace(job.facts, capability=capability)))
    if not job.training.skip_memory_check:
        memory_estimate(job)


def memory_estimate(job: JobConfig, check: bool = True):
    """The per-rank :class:`~megatron_fastpath.train.memory.MemoryEstimate` of ``job`` at the
    launcher's data-parallel size (WORLD_SIZE over TP x PP x CP), its optimizer state sharded
    over the data-parallel ranks where the distributed optimizer is on; with ``check``, refused
    (ValueError) where it exceeds the machine's memory. The preflight's check and the dry run's
    plan both take it from here."""
    from megatron_fastpath.train.memory import check_memory, estimate_memory, launched_data_parallel_size

    dp = launched_data_parallel_size(job.parallel)
    distributed = job.parallel.distributed_optimizer  # resolved at parse (train/parallel.py)
    if check:
        return check_memory(job, data_parallel_size=dp, distributed_optimizer=distributed)
    return estimate_memory(job, data_parallel_size=dp, distributed_optimizer=distributed)
