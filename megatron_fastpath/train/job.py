"""``build_job(cfg) -> Job``: distributed init, the packed cache, the model with its features,
the data, the step path (optimizer and LR schedule included) and the graph-safety audit.

Each piece has its own builder so that a variant replaces one function: a Hugging Face model
builder replaces :func:`build_model`, a checkpoint load runs on the returned :class:`Job`
(``job.model``, ``job.step.optimizer``, ``job.step.scheduler``) before the first step.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Optional

import torch

from megatron_fastpath.data import StepData
from megatron_fastpath.model import build_fastpath_gpt, build_transformer_config
from megatron_fastpath.providers import data_provider, model_provider
from megatron_fastpath.train.config import JobConfig, set_from_data
from megatron_fastpath.train.step import StepParts, cpu_train_step, gpu_train_step

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from megatron_fastpath.graphs import GraphSafetyAudit
    from megatron_fastpath.offload import ActivationOffloadManager
    from megatron_fastpath.packed_seq import PackedSeqCache
    from megatron_fastpath.train.evaluate import Evaluator
    from megatron_fastpath.train.metrics import MetricsWriter
    from megatron_fastpath.train.report import SummaryReport

__all__ = ["Job", "StepData", "build_job", "build_cache", "build_model", "build_reports"]


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything a step needs. ``step``: the CPU or GPU step path (optimizer, scheduler).
    ``offload``: the activation offload manager; ``audit``: the graph-safety audit (CPU with
    ``fastpath.cuda_graphs``); None when off. ``reports``: the features' parts of the run
    summary, in the order it prints them (:mod:`megatron_fastpath.train.report`)."""

    cfg: JobConfig
    tcfg: TransformerConfig
    cache: PackedSeqCache
    model: torch.nn.Module
    step: StepParts
    data: StepData
    offload: Optional[ActivationOffloadManager]
    audit: Optional[GraphSafetyAudit]
    rank: int
    world: int
    dp_world: int
    total_params: int
    trainable_params: int
    env_set: dict[str, str]  # the plan's environment variables in effect
    evaluator: Optional[Evaluator] = None  # data=jsonl: held-out loss
    metrics: Optional[MetricsWriter] = None  # TensorBoard / W&B / plot; None without a metrics group
    data_report: Optional[dict] = None  # data=jsonl: record counts (malformed, too long, splits)
    reports: tuple[SummaryReport, ...] = ()  # the packed cache's, the offload's, the audit's

    @property
    def audit_steps(self) -> int:
        """Steps run inside the audit (0 without one)."""
        if self.audit is None:
            return 0
        return min(self.cfg.cuda_graphs.audit_steps, self.cfg.training.steps)


def _init_distributed(cfg: JobConfig) -> None:
    from megatron_fastpath.distributed import init_distributed

    backend = cfg.cluster.backend
    if backend == "auto":
        backend = "nccl" if cfg.device.type == "cuda" else "gloo"
    par = cfg.parallel
    init_distributed(
        backend=backend,
        timeout_s=cfg.cluster.timeout_s,
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        expert_model_parallel_size=par.expert_model_parallel_size,
        context_parallel_size=par.context_parallel_size,
    )


def build_transformer(cfg: JobConfig) -> TransformerConfig:
    """Megatron TransformerConfig of the job (capacity-mode MoE and graph/FP8 fields included)."""
    moe = {}
    if cfg.is_moe and cfg.fastpath.moe_capacity_factor is not None:
        moe = dict(moe_expert_capacity_factor=cfg.fastpath.moe_capacity_factor,
                   moe_pad_expert_input_to_capacity=True, moe_token_drop_policy="probs")
    par = cfg.parallel
    return build_transformer_config(
        cfg.model,
        params_dtype=getattr(torch, cfg.training.dtype),
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        expert_model_parallel_size=par.expert_model_parallel_size,
        sequence_parallel=par.sequence_parallel,
        # Megatron's default waits for the whole device (torch.cuda.synchronize) after every
        # batched pipeline send/recv, "to work around a bug in older versions of PyTorch"
        # (model_parallel_config.py); torch >= 2.6 here: no host sync per p2p.
        batch_p2p_sync=False,
        **moe,
        **model_provider(cfg.model_source.provider).transformer_overrides(cfg.model_source, cfg.device),
        **cfg.plan.transformer_config,
    )


def build_cache(cfg: JobConfig, longest_sequence: Optional[int] = None) -> PackedSeqCache:
    """The packed-sequence cache: one slot per microbatch in flight -- on the GPU path as many
    as Megatron's 1F1B schedule holds between a forward and its backward on this pipeline
    stage (``slots_for_1f1b``: one without pipelining), one on the CPU path; its sequence bound
    from the data (``packed_seq.config.seqlen_bound``; T when not given)."""
    from megatron.core import parallel_state as ps

    from megatron_fastpath.compat.graphs import graph_inputs_per_microbatch
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
    from megatron_fastpath.packed_seq.config import seqlen_bound
    from megatron_fastpath.packed_seq.inflight import slots_for_1f1b

    in_flight = 1
    pipelined = ps.get_pipeline_model_parallel_world_size() > 1
    if cfg.plan.full_iteration:  # the captured step holds every microbatch in its own slot
        in_flight = cfg.training.micro_batches
    elif cfg.plan.capture and pipelined and graph_inputs_per_microbatch():
        in_flight = cfg.training.micro_batches  # no slot shared by two microbatches' graphs
    elif cfg.device.type == "cuda":
        in_flight = slots_for_1f1b(cfg.training.micro_batches,
                                   ps.get_pipeline_model_parallel_world_size(),
                                   ps.get_pipeline_model_parallel_rank())
    bound = None if longest_sequence is None else seqlen_bound(longest_sequence, cfg.data.max_tokens)
    cp = ps.get_context_parallel_world_size()
    if cp > 1 and bound is not None:  # the longest sequence padded to 2 x CP fits the bound
        bound = seqlen_bound(-(-longest_sequence // (2 * cp)) * 2 * cp, cfg.data.max_tokens)
    return PackedSeqCache(
        PackedSeqConfig(max_tokens=cfg.data.max_tokens, max_seqs=cfg.data.max_seqs,
                        max_seqlen=bound, num_slots=in_flight, rope=cfg.model_source.rope,
                        rope_local=cfg.model_source.rope_local,
                        sdpa_layout=cfg.fastpath.sdpa_layout,
                        context_parallel_size=ps.get_context_parallel_world_size(),
                        context_parallel_rank=ps.get_context_parallel_rank()),
        device=cfg.device,
    )


def build_model(cfg: JobConfig, tcfg, cache) -> tuple[torch.nn.Module, int, int]:
    """GPTModel of the model provider's architecture on the fastpath layer spec with the
    switched-on features (LoRA, offload), its weights from the provider (a checkpoint's shard,
    or Megatron's initialisation); returns (model, total parameters, trainable parameters)."""
    source = cfg.model_source
    model = build_fastpath_gpt(tcfg, cache, cfg.model, backend=cfg.attention_backend,
                               linear_impl=cfg.linear_impl, lora=cfg.lora, offload=cfg.offload,
                               tie_embeddings=source.tie_embeddings,
                               sliding_window=source.sliding_window,
                               window_layers=source.window_layers or None,
                               gemma=source.gemma)
    model_provider(source.provider).load_weights(model, source, log=lambda m: print(m, flush=True))
    total = trainable = sum(p.numel() for p in model.parameters())
    if cfg.lora is not None:
        from megatron_fastpath.lora import freeze_base_parameters, lock_lora

        trainable = freeze_base_parameters(model)
        if cfg.plan.capture:
            lock_lora(model)  # captured graphs freeze the adapter branch
    return model, total, trainable


def _build_audit(cfg: JobConfig, model: torch.nn.Module) -> Optional[GraphSafetyAudit]:
    if not cfg.plan.audit:
        return None
    from megatron_fastpath.graphs import GraphSafetyAudit

    return GraphSafetyAudit(model, strict=cfg.cuda_graphs.strict_audit)


def build_reports(cache: PackedSeqCache, offload: Optional[ActivationOffloadManager],
                  audit: Optional[GraphSafetyAudit]) -> tuple[SummaryReport, ...]:
    """The summary reports of the job's features: packed cache, offload (when on), graph-safety
    audit (when on), in the order the summary prints them."""
    from megatron_fastpath.packed_seq.report import PackedCacheReport

    reports = [PackedCacheReport(cache)]
    if offload is not None:
        from megatron_fastpath.offload.report import OffloadReport

        reports.append(OffloadReport(offload))
    if audit is not None:
        from megatron_fastpath.graphs.report import GraphAuditReport

        reports.append(GraphAuditReport(audit))
    return tuple(reports)


def build_job(cfg: JobConfig) -> Job:
    """Run the preflight (output directories, environment, the device's checks), then
    initialise torch.distributed / Megatron parallel state and build the job's pieces."""
    from megatron.core import parallel_state as ps

    from megatron_fastpath.train.preflight import preflight

    preflight(cfg)  # before torch.distributed / CUDA initialise
    env_set = {k: v for k, v in cfg.plan.env.items() if os.environ.get(k) == v}  # in effect
    _init_distributed(cfg)
    if cfg.device.type == "cuda":
        # Megatron's CUDA RNG tracker, seeded as Megatron's own training seeds it
        # (training/initialize.py _set_random_seed): its states are forked by LoRA dropout and, with
        # sequence parallelism, by the embedding dropout; unseeded, the first fork raises "cuda
        # rng state model-parallel-rng is not added". Before torch.manual_seed: on CPU-initialised
        # weights the CPU stream stays the seed's.
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(cfg.training.seed)
    torch.manual_seed(cfg.training.seed)
    # Megatron keeps MoE aux-loss trackers in a process-wide dict sized by the first model's
    # layer count; a job (or a second run in one process) starts from an empty one.
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()
    if cfg.plan.capture:  # graph-safe RNG tracker + 0.16.x input-buffer shim, before the model
        from megatron_fastpath.graphs import prepare_cuda_graphs

        prepare_cuda_graphs(cfg.training.seed, use_te_rng_tracker=cfg.cuda_graphs.use_te_rng_tracker)
    tcfg = build_transformer(cfg)
    dp_world = ps.get_data_parallel_world_size()
    # the data first: the cache's sequence bound comes from its longest sequence
    parts = data_provider(cfg.data_provider).build(cfg, ps.get_data_parallel_rank(), dp_world)
    # the one place training.micro_batches (batch_sequences / batch_tokens) and training.steps
    # (epochs) are set from the data
    cfg = set_from_data(cfg, parts.train)
    cache = build_cache(cfg, parts.longest_sequence)
    model, total, trainable = build_model(cfg, tcfg, cache)
    offload = None
    if cfg.offload is not None:
        from megatron_fastpath.offload import get_offload_manager

        offload = get_offload_manager(model)
    evaluator = None
    if parts.evaluate:  # held-out bins: evaluated every data.eval_every steps
        from megatron_fastpath.train.evaluate import Evaluator

        evaluator = Evaluator(model, cache, parts.eval_bins, cfg.device, parts.eval_prompts,
                              linear_cross_entropy=cfg.linear_cross_entropy == "chunked")
    metrics = None
    if cfg.metrics is not None:
        from megatron_fastpath.train.metrics import MetricsWriter, jsonable

        metrics = MetricsWriter(cfg.metrics, torch.distributed.get_rank(), run_config=jsonable(cfg))
    path = gpu_train_step if cfg.device.type == "cuda" else cpu_train_step
    if cfg.plan.full_iteration:
        from megatron_fastpath.train.full_iteration import full_iteration_train_step

        path = full_iteration_train_step
    step = path(model, tcfg, cfg.training, cache, parallel=cfg.parallel,
                linear_cross_entropy=cfg.linear_cross_entropy == "chunked")
    audit = _build_audit(cfg, model)  # after the step path
    return Job(
        cfg=cfg, tcfg=tcfg, cache=cache, model=model, step=step, data=parts.train, offload=offload,
        audit=audit, rank=torch.distributed.get_rank(),
        world=torch.distributed.get_world_size(), dp_world=dp_world,
        total_params=total, trainable_params=trainable, env_set=env_set,
        evaluator=evaluator, metrics=metrics, data_report=parts.report,
        reports=build_reports(cache, offload, audit),
    )
