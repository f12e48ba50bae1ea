"""``training.dry_run=true``: what the job would do, without doing it.

The config is parsed (every refusal the real run raises at parse), the data is built (its
records, the packed microbatches, the steps ``training.epochs`` takes), the memory estimate is
made and checked against the machine (:func:`~megatron_fastpath.train.preflight.memory_estimate`,
unless ``training.skip_memory_check``), and the plan is printed. No process group, model or
step; no checkpoint or export is written (``checkpoint.dir`` and the export directories are
not created).
"""

from __future__ import annotations

from megatron_fastpath.train.config import JobConfig, set_from_data

__all__ = ["dry_run"]


def dry_run(cfg: JobConfig, log=print) -> dict:
    """Print the plan of ``cfg`` (a parsed :class:`JobConfig`) and return it as a dict."""
    from megatron_fastpath.providers import data_provider
    from megatron_fastpath.train.memory import launched_data_parallel_size
    from megatron_fastpath.train.preflight import memory_estimate

    dp_world = launched_data_parallel_size(cfg.parallel)
    parts = data_provider(cfg.data_provider).build(cfg, 0, dp_world)
    cfg = set_from_data(cfg, parts.train)
    est = memory_estimate(cfg, check=not cfg.training.skip_memory_check)
    m, p, t, data = cfg.model, cfg.parallel, cfg.training, parts.train
    steps = t.stop_at_step or t.steps
    records = (parts.report or {}).get("records", getattr(cfg.data, "num_samples", None))
    plan = dict(
        params=est.params_total, memory_bytes=est.total, dp_world=dp_world,
        records=records, packed_microbatches=data.num_microbatches, steps=steps,
        microbatches_per_step=data.per_step, max_tokens=steps * data.per_step * cfg.data.max_tokens,
        lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, lr_schedule=t.lr_schedule,
    )
    experts = f", {m.num_experts} experts top-{m.moe_router_topk}" if cfg.is_moe else ""
    log("dry run (training.dry_run=true): the plan; no step runs, no checkpoint or export is written")
    log(f"  model: {m.num_layers} layers, hidden {m.hidden_size}{experts}, {est.params_total:,} params"
        f" ({cfg.model_source.provider if cfg.model_source else 'synthetic'}), {t.dtype} on {cfg.device}")
    log(f"  parallelism: dp {dp_world}, tp {p.tensor_model_parallel_size}, pp "
        f"{p.pipeline_model_parallel_size}, ep {p.expert_model_parallel_size}, cp "
        f"{p.context_parallel_size}{', sequence parallel' if p.sequence_parallel else ''}")
    log(f"  features: {', '.join(cfg.features) or 'none'}; attention {cfg.attention_backend}, "
        f"linears {cfg.linear_impl}, loss {cfg.linear_cross_entropy} (fastpath.linear_cross_entropy)")
    log(f"  data: {records if records is not None else '?'} records -> {data.num_microbatches} packed "
        f"microbatches of <= {cfg.data.max_tokens} tokens; {steps} steps x {data.per_step} "
        f"microbatches (at most {plan['max_tokens']:,} tokens)"
        + (f", {t.epochs} epochs" if t.epochs else ""))
    for key, value in (parts.report or {}).items():
        if key != "records":
            log(f"    {key}: {value}")
    batch = data.batch_size  # training.batch_sequences / batch_tokens
    if batch is not None:
        plan["batch"] = dict(setting=batch.key, asked=batch.asked, micro_batches=batch.micro_batches,
                             per_step=batch.per_step)
        log(f"  batch: {batch.describe()}")
    plan.update(distributed_optimizer=p.distributed_optimizer, overlap_grad_reduce=p.overlap_grad_reduce,
                overlap_param_gather=p.overlap_param_gather)
    sharded = (", distributed optimizer" + (" with overlapped reduce / gather" if p.overlap_param_gather
                                            else " with overlapped reduce" if p.overlap_grad_reduce else "")
               if p.distributed_optimizer else "")
    log(f"  optimizer: lr {t.lr:g} -> {t.min_lr:g} ({t.lr_schedule}), {t.warmup_steps} warm-up "
        f"steps{sharded}")
    log(f"  memory: estimated {est.describe()} per process"
        + (" (not checked: training.skip_memory_check)" if t.skip_memory_check else " (fits)"))
    return plan
