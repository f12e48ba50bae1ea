"""The main job: Megatron-Core training of a Llama-style GPTModel on packed SFT data.

    python -m megatron_fastpath.train                      # embedded CPU default (gloo)
    python -m megatron_fastpath.train training.steps=50 model=tiny_dense
    torchrun --nproc_per_node=2 -m megatron_fastpath.train  # data parallel
    python -m megatron_fastpath.train model=hf model.path=<hf dir> data=jsonl \
        data.path=<file.jsonl> fastpath.lora=true export.adapter_dir=<dir>   # fine-tune (hf/provider.py)

The entry point (:func:`main`, Hydra) and the public names; the loop itself is
:mod:`megatron_fastpath.train.loop` (``run`` / ``train``), read like torchtitan's ``train.py``::

    cfg = parse_job_config(hydra_cfg)          # config.py: one frozen dataclass per group (pure)
    job = build_job(cfg)                       # job.py: preflight (preflight.py), then model,
                                               # cache, data, step path, audit
    logger = StepLogger(job)                   # logger.py: lagged read-back, step line, summary
    for step in ...: logger.log(train_step(job, job.data.batch(step)))   # step.py
    summary = logger.finish(stop, job.reports) # report.py: each feature's summary lines

One program for CPU and GPU, chosen by device (``step.cpu_train_step`` / ``step.gpu_train_step``,
see :mod:`megatron_fastpath.train.step`). Every step prints one line: loss, tokens/s, host syncs
inside the step (SyncSentinel), packed-cache builds; device values are read one step late.
"""

from __future__ import annotations

import os

from megatron_fastpath.train.config import (
    ClusterConfig,
    FastpathConfig,
    JobConfig,
    ParallelConfig,
    TrainingConfig,
    config_dir,
    parse_job_config,
    section,
)
from megatron_fastpath.train.job import Job, build_job
from megatron_fastpath.train.preflight import preflight
from megatron_fastpath.train.logger import StepLogger, StepRecord, StepResult, TrainSummary
from megatron_fastpath.train.step import cpu_train_step, gpu_train_step, train_step
from megatron_fastpath.train.checkpointing import PREEMPTED_EXIT_CODE
from megatron_fastpath.train.loop import run, train

__all__ = ["TrainingConfig", "FastpathConfig", "ParallelConfig", "ClusterConfig", "JobConfig",
           "Job", "StepRecord", "StepResult", "TrainSummary", "StepLogger", "parse_job_config",
           "build_job", "preflight", "train_step", "cpu_train_step", "gpu_train_step", "train", "run", "main",
           "config_dir", "PREEMPTED_EXIT_CODE"]

_section = section  # the name tests use


def _exit_preempted(code: int = PREEMPTED_EXIT_CODE, barrier: bool = True) -> None:
    """Saved after SIGTERM/SIGUSR1: every rank exits with PREEMPTED_EXIT_CODE (the launcher,
    slurm/train.sbatch, requeues the job); after Ctrl-C with ``code`` INTERRUPTED_EXIT_CODE
    (``barrier=False``: a second Ctrl-C, each rank on its own). All ranks leave together, right
    after a barrier and without interpreter teardown: ``srun --kill-on-bad-exit`` would
    otherwise kill a rank still tearing down when the first one exits with a non-zero code."""
    import multiprocessing
    import sys

    import torch

    from megatron_fastpath.compat.dist_ckpt import shutdown_writer_helper

    sys.stdout.flush()
    sys.stderr.flush()
    shutdown_writer_helper()  # the checkpoint writer's queue server (it ignores SIGTERM)
    for child in multiprocessing.active_children():  # anything else a save started
        child.terminate()
        child.join(timeout=10)
    if barrier and torch.distributed.is_initialized():
        torch.distributed.barrier()
    os._exit(code)


USER_ERROR_EXIT_CODE = 2


def _user_errors() -> tuple:
    from megatron_fastpath.checkpoint import CheckpointError, UnsafeCheckpointError

    return (ValueError, CheckpointError, UnsafeCheckpointError)


def main() -> None:
    import sys

    from megatron_fastpath.train.help import HELP_FLAGS, job_help, wants_help

    if wants_help(sys.argv[1:]):  # every key, its value and description (train/help.py); no device
        try:
            print(job_help([a for a in sys.argv[1:] if a not in HELP_FLAGS]), flush=True)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(USER_ERROR_EXIT_CODE)
        return

    import hydra
    from omegaconf import DictConfig

    from megatron_fastpath.train.checkpointing import INTERRUPTED_EXIT_CODE, EarlySignals, Preempted

    EarlySignals.install()  # before anything slow: a preemption during start-up requeues the job
    USER_ERRORS = _user_errors()  # noqa: N806
    from megatron_fastpath.train.overrides import check_overrides

    try:  # a key the config lacks: "did you mean", not Hydra's "+key" advice
        check_overrides(sys.argv[1:])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT_CODE)

    @hydra.main(config_path=config_dir(), config_name="config", version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        from megatron_fastpath._noise import absent_packages_line
        from megatron_fastpath.train.checkpointing import announce_resume

        try:
            announce_resume(cfg)  # first: whether this run resumes from a checkpoint
            line = absent_packages_line()
            if line and os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
                print(line, flush=True)
            summary = run(cfg, announce=False)
        except Preempted as exc:
            print(f"preempted: {exc}; exiting with {PREEMPTED_EXIT_CODE} to be requeued", flush=True)
            _exit_preempted()
        except KeyboardInterrupt:  # Ctrl-C before the first step, or a second one: no traceback
            print("\ninterrupted (Ctrl-C): stopped at once, nothing saved since the last "
                  "checkpoint", flush=True)
            _exit_preempted(INTERRUPTED_EXIT_CODE, barrier=False)
        except USER_ERRORS as exc:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            # a configuration / data / checkpoint problem: its message says what, why and the
            # fix; the traceback would only hide it (HYDRA_FULL_ERROR=1 shows it)
            import sys

            print(f"error: {exc}\n(set HYDRA_FULL_ERROR=1 for the traceback)", file=sys.stderr, flush=True)
            sys.exit(USER_ERROR_EXIT_CODE)
        if isinstance(summary, dict):  # training.dry_run: the plan printed, nothing started
            return
        if summary.stopped == "signal SIGINT":  # saved; how to resume is printed
            _exit_preempted(INTERRUPTED_EXIT_CODE)
        if summary.stopped and summary.stopped.startswith("signal"):
            _exit_preempted()
        from megatron_fastpath.distributed import destroy_distributed

        destroy_distributed()

    from megatron_fastpath._noise import main_job_filters

    # one line of absent packages instead of per-module fallbacks (printed by _main, after the
    # resume line)
    with main_job_filters(rank0=False):
        _main()
