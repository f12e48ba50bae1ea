"""The main job: Megatron-Core training of a Llama-style GPTModel on packed SFT data.

    python -m megatron_fastpath.train                      # embedded CPU default (gloo)
    python -m megatron_fastpath.train training.steps=50 model=tiny_dense
    torchrun --nproc_per_node=2 -m megatron_fastpath.train  # data parallel
    python -m megatron_fastpath.train model=hf model.path=<hf dir> data=jsonl \
        data.path=<file.jsonl> fastpath.lora=true export.adapter_dir=<dir>   # fine-tune (hf/provider.py)

Read like torchtitan's ``train.py``::

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
from typing import Optional

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

__all__ = ["TrainingConfig", "FastpathConfig", "ParallelConfig", "ClusterConfig", "JobConfig",
           "Job", "StepRecord", "StepResult", "TrainSummary", "StepLogger", "parse_job_config",
           "build_job", "preflight", "train_step", "cpu_train_step", "gpu_train_step", "train", "run", "main",
           "config_dir", "PREEMPTED_EXIT_CODE"]

_section = section  # the name tests and older callers use


def _steps(job: Job, logger: StepLogger, ckpt, steps: range, audit: bool, eval_after,
           checked) -> Optional[str]:
    """Run ``steps``; returns why the job stopped early (None: it did not). ``checked(step)``:
    whether the step runs inside the sync sentinel (``training.sync_check``)."""
    for step in steps:
        result = train_step(job, job.data.batch(step), audit=audit, check_syncs=checked(step))
        logger.log(result, evaluation=eval_after(step))
        if ckpt is not None:
            stop = ckpt.after_step(step)
        else:
            stop = "stop_at_step" if step == job.cfg.training.stop_at_step else None
        if stop:
            return stop
    return None


def train(job: Job, logger: StepLogger, ckpt=None, start_step: int = 1) -> TrainSummary:
    """Steps ``start_step``..``training.steps`` of ``job`` (up to ``training.stop_at_step``); the
    first ``job.audit_steps`` run with the graph-safety audit's hooks installed (its context
    manager removes them, also on error). ``ckpt``: a :class:`JobCheckpointer` (saves, signals)."""
    t = job.cfg.training
    steps, last = t.steps, t.stop_at_step or t.steps
    audited = min(job.audit_steps, last)
    evaluate = getattr(job, "evaluator", None)
    every = getattr(job.cfg.data, "eval_every", 0)

    def eval_after(step: int):
        """Held-out evaluation after ``step`` (every ``data.eval_every`` steps and after the last)."""
        if evaluate is None or not (step == steps or (every and step % every == 0)):
            return None
        return evaluate()

    from megatron_fastpath.train.config import SYNC_CHECK_FIRST_STEPS

    mode = t.sync_check

    def checked(step: int) -> bool:
        return mode == "every" or (mode == "first" and step < start_step + SYNC_CHECK_FIRST_STEPS)

    try:
        if evaluate is not None and start_step == 1:
            logger.log_eval(0, evaluate())
        if start_step > 1:  # FP8 delayed scaling + per-layer graphs: the first step replays
            from megatron_fastpath.graphs.resume import capture_before_resumed_step

            if capture_before_resumed_step(job, job.data.batch(start_step)):
                logger.print(f"cuda graphs: captured before step {start_step} (resumed with FP8 "
                             "delayed scaling: its first step replays, as the straight run's)")
        stop = None
        logger.start_clock(start_step)
        if start_step <= audited:
            with job.audit:
                stop = _steps(job, logger, ckpt, range(start_step, audited + 1), True, eval_after,
                              checked)
        if stop is None:
            stop = _steps(job, logger, ckpt, range(max(start_step, audited + 1), last + 1), False,
                          eval_after, checked)
        logger.flush()
        if stop is None:  # the model provider's artefacts (model=hf: PEFT adapter / HF weights)
            from megatron_fastpath.providers import model_provider

            source = job.cfg.model_source
            logger.artifacts.update(model_provider(source.provider).export(job, log=logger.print))
        reports = job.reports + ((ckpt.finish(stop),) if ckpt is not None else ())
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise
    return logger.finish(stopped=stop, reports=reports)


def run(cfg, return_job: bool = False, announce: bool = True):
    """Train per ``cfg`` (an OmegaConf/dict tree with groups model, data, training, fastpath,
    parallel, cluster, checkpoint and the feature groups lora, offload, cuda_graphs, fp8) and
    return the summary (and the :class:`Job` with ``return_job``). All configuration is validated
    before any model is built or step runs (the parse, then the preflight that ``build_job``
    runs first: output directories, environment, the device's checks). When ``checkpoint.dir`` holds a checkpoint the run
    resumes from it, and its first line says so (``announce=False``: the caller printed it)."""
    if announce:
        from megatron_fastpath.train.checkpointing import announce_resume

        announce_resume(cfg)  # the first line: resuming or not (before anything is built)
    job_cfg = parse_job_config(cfg)
    job = build_job(job_cfg)
    logger = StepLogger(job)
    ckpt, start = None, 1
    if not job_cfg.checkpoint.enabled:  # nothing to save: a signal takes its default action
        from megatron_fastpath.train.checkpointing import EarlySignals, Preempted

        pending = EarlySignals.release()
        if pending:
            raise Preempted(f"{pending} during start-up (no checkpoint.dir: nothing to save)")
    if job_cfg.checkpoint.enabled:
        from megatron_fastpath.train.checkpointing import JobCheckpointer

        ckpt = JobCheckpointer(job, logger)
        try:
            start = ckpt.resume()
        except BaseException:
            ckpt.close()
            raise
        if ckpt.signals.received:  # preempted during start-up: no step ran, nothing new to save
            ckpt.close()
            if ckpt.signals.received == "SIGINT":  # Ctrl-C: stop, not a requeue
                raise KeyboardInterrupt
            from megatron_fastpath.train.checkpointing import Preempted

            raise Preempted(f"{ckpt.signals.received} before the first step")
    logger.header()
    summary = train(job, logger, ckpt, start)
    return (summary, job) if return_job else summary


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
    import hydra
    from omegaconf import DictConfig

    from megatron_fastpath.train.checkpointing import INTERRUPTED_EXIT_CODE, EarlySignals, Preempted

    EarlySignals.install()  # before anything slow: a preemption during start-up requeues the job
    USER_ERRORS = _user_errors()  # noqa: N806
    import sys

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
