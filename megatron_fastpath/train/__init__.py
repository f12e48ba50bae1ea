"""The main job: Megatron-Core training of a Llama-style GPTModel on packed SFT data.

    python -m megatron_fastpath.train                      # embedded CPU default (gloo)
    python -m megatron_fastpath.train training.steps=50 model=tiny_dense
    torchrun --nproc_per_node=2 -m megatron_fastpath.train  # data parallel
    python -m megatron_fastpath.train model=hf model.path=<hf dir> data=jsonl \
        data.path=<file.jsonl> fastpath.lora=true lora.export_dir=<dir>   # fine-tune (hf/job.py)

Read like torchtitan's ``train.py``::

    cfg = parse_job_config(hydra_cfg)          # config.py: one frozen dataclass per group
    job = build_job(cfg)                       # job.py: model, cache, data, step path, audit
    logger = StepLogger(job)                   # logger.py: lagged read-back, step line, summary
    for step in ...: logger.log(train_step(job, job.data.batch(step)))   # step.py
    summary = logger.finish()

One program for CPU and GPU, chosen by device (``step.cpu_train_step`` / ``step.gpu_train_step``,
see :mod:`megatron_fastpath.train.step`). Every step prints one line: loss, tokens/s, host syncs
inside the step (SyncSentinel), packed-cache builds; device values are read one step late.
"""

from __future__ import annotations

import contextlib
import os

from megatron_fastpath.train.config import (
    ClusterConfig,
    FastpathConfig,
    JobConfig,
    ParallelConfig,
    TrainingConfig,
    parse_job_config,
    section,
)
from megatron_fastpath.train.job import Job, build_job
from megatron_fastpath.train.logger import StepLogger, StepRecord, StepResult, TrainSummary
from megatron_fastpath.train.step import cpu_train_step, gpu_train_step, train_step

__all__ = ["TrainingConfig", "FastpathConfig", "ParallelConfig", "ClusterConfig", "JobConfig",
           "Job", "StepRecord", "StepResult", "TrainSummary", "StepLogger", "parse_job_config",
           "build_job", "train_step", "cpu_train_step", "gpu_train_step", "train", "run", "main",
           "config_dir"]

_section = section  # the name tests and older callers use


def train(job: Job, logger: StepLogger) -> TrainSummary:
    """All steps of ``job``; the first ``job.audit_steps`` run with the graph-safety audit's
    hooks installed (its context manager removes them, also on error)."""
    audited, steps = job.audit_steps, job.cfg.training.steps
    evaluate = getattr(job, "evaluator", None)
    every = getattr(job.cfg.data, "eval_every", 0)

    def eval_after(step: int):
        """Held-out loss after ``step`` (every ``data.eval_every`` steps and after the last)."""
        if evaluate is None or not (step == steps or (every and step % every == 0)):
            return None
        return evaluate()

    if evaluate is not None:
        logger.log_eval(0, evaluate())
    with job.audit if audited else contextlib.nullcontext():
        for step in range(1, audited + 1):
            result = train_step(job, job.data.batch(step), audit=True)
            logger.log(result, eval_loss=eval_after(step))
    for step in range(audited + 1, steps + 1):
        result = train_step(job, job.data.batch(step))
        logger.log(result, eval_loss=eval_after(step))
    logger.flush()
    if job.cfg.hf is not None:  # model=hf: PEFT adapter / merged checkpoint (lora.export_*)
        from megatron_fastpath.hf.job import export_lora

        logger.artifacts.update(export_lora(job, log=logger.print))
    return logger.finish()


def run(cfg) -> TrainSummary:
    """Train per ``cfg`` (an OmegaConf/dict tree with groups model, data, training, fastpath,
    parallel, cluster and the feature groups lora, offload, cuda_graphs, fp8) and return the
    summary. All configuration is validated before any model is built or step runs."""
    job = build_job(parse_job_config(cfg))
    logger = StepLogger(job)
    logger.header()
    return train(job, logger)


def config_dir() -> str:
    """The Hydra config directory: $MEGATRON_FASTPATH_CONFIGS or the repository's configs/."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.environ.get(
        "MEGATRON_FASTPATH_CONFIGS", os.path.join(os.path.dirname(os.path.dirname(here)), "configs")
    )


def main() -> None:
    import hydra
    from omegaconf import DictConfig

    @hydra.main(config_path=config_dir(), config_name="config", version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        run(cfg)
        from megatron_fastpath.distributed import destroy_distributed

        destroy_distributed()

    from megatron_fastpath._noise import main_job_filters

    with main_job_filters():  # one line of absent packages instead of per-module fallbacks
        _main()
