"""The main job's training loop, read like torchtitan's ``train.py``: build, step, log.

* build -- :func:`run`: parse the config, build the job (:mod:`.job`, its preflight first),
  the step logger and the checkpointer (resume), then :func:`train`;
* step -- :func:`train` / :func:`_steps`: each step is :func:`.step.train_step` on the data's
  batch, the first ``job.audit_steps`` inside the graph-safety audit, the checkpointer told
  after each one (saves, preemption signals);
* log -- the :class:`.logger.StepLogger` prints each step's line (device values a step late),
  the evaluation, the provider's artefacts and the summary (each feature's :mod:`.report`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from megatron_fastpath.train.config import SYNC_CHECK_FIRST_STEPS, parse_job_config
from megatron_fastpath.train.job import Job, build_job
from megatron_fastpath.train.logger import StepLogger, TrainSummary
from megatron_fastpath.train.step import train_step

if TYPE_CHECKING:
    from megatron_fastpath.train.checkpointing import JobCheckpointer
    from megatron_fastpath.train.evaluate import EvalResult

__all__ = ["train", "run"]


# ------------------------------------------------------------------------------------- build
def run(cfg, return_job: bool = False, announce: bool = True):
    """Train per ``cfg`` (an OmegaConf/dict tree with groups model, data, training, fastpath,
    parallel, cluster, checkpoint and the feature groups lora, offload, cuda_graphs, fp8) and
    return the summary (and the :class:`Job` with ``return_job``). All configuration is validated
    before any model is built or step runs (the parse, then the preflight that ``build_job``
    runs first: output directories, environment, the device's checks). When ``checkpoint.dir``
    holds a checkpoint the run resumes from it, and its first line says so (``announce=False``:
    the caller printed it)."""
    if announce:
        from megatron_fastpath.train.checkpointing import announce_resume

        announce_resume(cfg)  # the first line: resuming or not (before anything is built)
    job_cfg = parse_job_config(cfg)
    if job_cfg.training.dry_run:  # the plan (a dict), nothing built on the device or written
        from megatron_fastpath.train.dry_run import dry_run

        return dry_run(job_cfg)
    job = build_job(job_cfg)
    logger = StepLogger(job)
    ckpt, start = _checkpointer(job, logger)
    logger.header()
    summary = train(job, logger, ckpt, start)
    return (summary, job) if return_job else summary


def _checkpointer(job: Job, logger: StepLogger) -> tuple[Optional[JobCheckpointer], int]:
    """The job's checkpointer (None without ``checkpoint.dir``) and the first step to run (the
    checkpoint's next step on resume). A signal received during start-up raises
    :class:`Preempted`: no step ran, nothing new to save."""
    from megatron_fastpath.train.checkpointing import EarlySignals, JobCheckpointer, Preempted

    if not job.cfg.checkpoint.enabled:  # nothing to save: a signal takes its default action
        pending = EarlySignals.release()
        if pending:
            raise Preempted(f"{pending} during start-up (no checkpoint.dir: nothing to save)")
        return None, 1
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
        raise Preempted(f"{ckpt.signals.received} before the first step")
    return ckpt, start


# -------------------------------------------------------------------------------------- step
def train(job: Job, logger: StepLogger, ckpt: Optional[JobCheckpointer] = None,
          start_step: int = 1) -> TrainSummary:
    """Steps ``start_step``..``training.steps`` of ``job`` (up to ``training.stop_at_step``); the
    first ``job.audit_steps`` run with the graph-safety audit's hooks installed (its context
    manager removes them, also on error). ``ckpt``: a :class:`JobCheckpointer` (saves, signals)."""
    t = job.cfg.training
    last = t.stop_at_step or t.steps
    audited = min(job.audit_steps, last)
    eval_after = _eval_schedule(job)
    mode = t.sync_check

    def checked(step: int) -> bool:
        """Whether ``step`` runs inside the sync sentinel (``training.sync_check``)."""
        return mode == "every" or (mode == "first" and step < start_step + SYNC_CHECK_FIRST_STEPS)

    try:
        _before_first_step(job, logger, start_step)
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
        if stop is None:
            _export(job, logger)
        reports = job.reports + ((ckpt.finish(stop),) if ckpt is not None else ())
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise
    return logger.finish(stopped=stop, reports=reports)


def _steps(job: Job, logger: StepLogger, ckpt: Optional[JobCheckpointer], steps: range,
           audit: bool, eval_after: Callable[[int], Optional[EvalResult]],
           checked: Callable[[int], bool]) -> Optional[str]:
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


def _before_first_step(job: Job, logger: StepLogger, start_step: int) -> None:
    """The held-out evaluation before a fresh run's first step; on resume with FP8 delayed
    scaling and per-layer graphs, the capture before the first step (which then replays, as the
    straight run's does)."""
    evaluate = getattr(job, "evaluator", None)
    if evaluate is not None and start_step == 1:
        with job.step.params_current():
            logger.log_eval(0, evaluate())
    if start_step > 1:
        from megatron_fastpath.graphs.resume import capture_before_resumed_step

        if capture_before_resumed_step(job, job.data.batch(start_step)):
            logger.print(f"cuda graphs: captured before step {start_step} (resumed with FP8 "
                         "delayed scaling: its first step replays, as the straight run's)")


# --------------------------------------------------------------------------------------- log
def _eval_schedule(job: Job) -> Callable[[int], Optional[EvalResult]]:
    """``eval_after(step)``: the held-out evaluation after ``step`` (every ``data.eval_every``
    steps and after the last; None between them and without an evaluator)."""
    evaluate, steps = getattr(job, "evaluator", None), job.cfg.training.steps
    every = getattr(job.cfg.data, "eval_every", 0)

    def eval_after(step: int) -> Optional[EvalResult]:
        if evaluate is None or not (step == steps or (every and step % every == 0)):
            return None
        with job.step.params_current():  # gathered: the overlapped all-gather is the next forward's
            return evaluate()

    return eval_after


def _export(job: Job, logger: StepLogger) -> None:
    """The model provider's artefacts of a run that finished (model=hf: PEFT adapter / HF
    weights), recorded with the summary."""
    from megatron_fastpath.providers import model_provider

    source = job.cfg.model_source
    with job.step.params_current():
        logger.artifacts.update(model_provider(source.provider).export(job, log=logger.print))
