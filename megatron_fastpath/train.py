"""The main job: Megatron-Core training of a Llama-style GPTModel on packed synthetic SFT data.

    python -m megatron_fastpath.train                      # embedded CPU default (gloo)
    python -m megatron_fastpath.train training.steps=50 model=tiny_dense
    torchrun --nproc_per_node=2 -m megatron_fastpath.train  # data parallel

One program for CPU and GPU, chosen by device:

* CPU: torch.distributed gloo, microbatches driven by our own loop (Megatron 0.16.1's
  ``forward_backward_no_pipelining`` allocates on ``device="cuda"``), torch AdamW, gradient
  all-reduce over the data-parallel group.
* GPU: NCCL, Megatron's ``get_forward_backward_func`` schedule (pipeline parallel included),
  Megatron ``DistributedDataParallel`` and ``get_megatron_optimizer``.

Both use Megatron's ``OptimizerParamScheduler`` for the LR schedule. Every step prints one line:
loss, tokens/s, host syncs inside the step (SyncSentinel), packed-cache hits/misses. Values that
live on the device (loss, step time) are copied non-blocking into host buffers and printed one
step late, so printing never stalls the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from typing import Any, Optional

import torch

from megatron_fastpath.data import DataConfig, SyntheticSFTDataset, pack_microbatches
from megatron_fastpath.model import ModelConfig, build_gpt_model, build_transformer_config, rope_config_for
from megatron_fastpath.sync import SyncSentinel

__all__ = ["TrainingConfig", "FastpathConfig", "ParallelConfig", "ClusterConfig", "StepRecord", "TrainSummary", "run", "main"]

log = logging.getLogger("megatron_fastpath.train")


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    steps: int = 40
    micro_batches: int = 2
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 4
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16
    log_all_ranks: bool = False
    summary_json: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class FastpathConfig:
    """Feature switches (each on/off); their settings live in the groups of the same name.

    packed_cache: attention reads the per-batch packed-sequence cache (required here).
    attention_backend: auto | sdpa | flex | flash | te.
    linear_impl: auto | local | te (te: Transformer Engine linears, needed for FP8).
    offload: double-buffered activation offload of layer inputs (group ``offload``).
    lora: LoRA adapters, base weights frozen (group ``lora``).
    cuda_graphs: per-layer CUDA graphs; on CPU the graph-safety audit (group ``cuda_graphs``).
    fp8: Transformer Engine FP8 (group ``fp8``).
    moe_capacity_factor: None = dropless MoE dispatch; a float = capacity mode (static shapes).
    """

    packed_cache: bool = True
    attention_backend: str = "auto"
    linear_impl: str = "auto"
    offload: bool = False
    lora: bool = False
    cuda_graphs: bool = False
    fp8: bool = False
    moe_capacity_factor: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 1


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """Where the job runs (the `cluster` group).

    name: label printed in the header. backend: auto (nccl on GPU, gloo on CPU) | gloo | nccl.
    expected_world_size: refuse to train when the launcher started a different number of
        processes (catches a mis-sized srun/torchrun before any step). timeout_s: collective
        and rendezvous timeout.
    """

    name: str = "local"
    backend: str = "auto"
    expected_world_size: Optional[int] = None
    timeout_s: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    lr: float
    tokens: int
    step_ms: float
    tokens_per_s: float
    syncs_fwd_bwd: int
    syncs_step: int
    sync_sites: tuple
    cache_hits: int
    cache_misses: int
    offload_bytes: int = 0
    offload_mode: str = "off"


@dataclasses.dataclass(frozen=True)
class TrainSummary:
    steps: int
    world_size: int
    device: str
    first_loss: float
    last_loss: float
    mean_tokens_per_s: float
    syncs_fwd_bwd_per_step: float
    syncs_per_step: float
    cache_hits: int
    cache_misses: int
    records: tuple
    trainable_params: int = 0
    total_params: int = 0
    audit: Optional[str] = None
    audit_ok: Optional[bool] = None
    notes: tuple = ()

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["records"] = [dataclasses.asdict(r) for r in self.records]
        return d


def _section(cfg: Any, name: str, cls):
    """A config group as its frozen dataclass (unknown keys are an error)."""
    from omegaconf import OmegaConf

    raw = cfg.get(name, {}) if cfg is not None else {}
    data = OmegaConf.to_container(raw, resolve=True) if not isinstance(raw, dict) else dict(raw)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in config group '{name}'; valid: {sorted(fields)}")
    return cls(**data)


class LaggedReadback:
    """Device scalars -> host, without a sync: ``push`` copies them non-blocking into pinned host
    buffers (recording an event); ``pop`` returns the *previous* push's values once its event
    has completed (a whole step later, so the wait is free)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pending: Optional[tuple[dict, Optional[torch.cuda.Event], dict]] = None

    def push(self, values: dict[str, torch.Tensor], extra: dict) -> Optional[tuple[dict, dict]]:
        prev = self.pop()
        pin = self.device.type == "cuda"
        host = {}
        for k, v in values.items():
            buf = torch.empty(v.shape, dtype=v.dtype, pin_memory=pin)
            buf.copy_(v.detach(), non_blocking=True)
            host[k] = buf
        event = None
        if pin:
            event = torch.cuda.Event()
            event.record()
        self.pending = (host, event, extra)
        return prev

    def pop(self) -> Optional[tuple[dict, dict]]:
        if self.pending is None:
            return None
        host, event, extra = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        return {k: v.tolist() for k, v in host.items()}, extra


def _all_reduce_grads(model: torch.nn.Module) -> None:
    """Sum gradients over data-parallel replicas (CPU path): dense parameters over the DP group,
    expert parameters (Megatron marks them ``allreduce=False``) over the expert-DP group. The
    loss is normalised by the *global* token count, so the sum equals one big batch."""
    from megatron.core import parallel_state as ps

    buckets = {}
    for p in model.parameters():
        if p.grad is None:
            continue
        expert = getattr(p, "allreduce", True) is False
        group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
        if torch.distributed.get_world_size(group) > 1:
            buckets.setdefault(expert, (group, []))[1].append(p.grad)
    for group, grads in buckets.values():
        flat = torch._utils._flatten_dense_tensors(grads)
        torch.distributed.all_reduce(flat, group=group)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def _resolve_device(name: str) -> torch.device:
    from megatron_fastpath.distributed import default_device

    if name == "auto":
        return default_device()
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("training.device=cuda but no CUDA device is available; use device=cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"training.device must be auto, cpu or cuda; got {name!r}")
    return default_device() if name == "cuda" else torch.device("cpu")


def _feature_section(cfg: Any, name: str, cls, enabled: bool):
    """Settings group of a feature switched on in ``fastpath`` (None when off)."""
    return _section(cfg, name, cls) if enabled else None


def run(cfg) -> TrainSummary:
    """Train per ``cfg`` (an OmegaConf/dict tree with groups model, data, training, fastpath,
    parallel, and the feature groups lora, offload, cuda_graphs, fp8) and return the summary.
    All configuration is validated before any model is built or step runs."""
    from megatron_fastpath.distributed import init_distributed
    from megatron_fastpath.graphs.config import CudaGraphConfig, FP8Config, apply_env, plan_graphs_and_fp8
    from megatron_fastpath.lora import LoRAConfig
    from megatron_fastpath.offload import OffloadConfig

    model_cfg = _section(cfg, "model", ModelConfig)
    data_cfg = _section(cfg, "data", DataConfig)
    train_cfg = _section(cfg, "training", TrainingConfig)
    fast_cfg = _section(cfg, "fastpath", FastpathConfig)
    par_cfg = _section(cfg, "parallel", ParallelConfig)
    cluster_cfg = _section(cfg, "cluster", ClusterConfig)
    lora_cfg = _feature_section(cfg, "lora", LoRAConfig, fast_cfg.lora)
    offload_cfg = _feature_section(cfg, "offload", OffloadConfig, fast_cfg.offload)
    graph_cfg = _section(cfg, "cuda_graphs", CudaGraphConfig) if fast_cfg.cuda_graphs else CudaGraphConfig()
    graph_cfg = dataclasses.replace(graph_cfg, enabled=fast_cfg.cuda_graphs)
    fp8_cfg = _section(cfg, "fp8", FP8Config) if fast_cfg.fp8 else FP8Config()
    fp8_cfg = dataclasses.replace(fp8_cfg, enabled=fast_cfg.fp8)

    if not fast_cfg.packed_cache:
        raise ValueError(
            "fastpath.packed_cache=false is not a supported training mode of this job: its "
            "attention reads the packed cache (run benchmarks/packed_seq.py for the baselines)"
        )
    if train_cfg.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"training.dtype must be float32 or bfloat16; got {train_cfg.dtype!r}")
    if train_cfg.steps <= 0 or train_cfg.micro_batches <= 0:
        raise ValueError("training.steps and training.micro_batches must be positive")
    device = _resolve_device(train_cfg.device)
    if cluster_cfg.backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"cluster.backend must be auto, gloo or nccl; got {cluster_cfg.backend!r}")
    if cluster_cfg.backend == "nccl" and device.type != "cuda":
        raise ValueError("cluster.backend=nccl needs CUDA devices; use gloo (or auto) on CPU")
    launched = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    if cluster_cfg.expected_world_size is not None and launched != cluster_cfg.expected_world_size:
        raise ValueError(
            f"cluster '{cluster_cfg.name}' expects {cluster_cfg.expected_world_size} processes but "
            f"the launcher started {launched}"
        )
    if device.type == "cpu" and par_cfg.pipeline_model_parallel_size > 1:
        raise ValueError(
            "pipeline parallelism needs Megatron's pipeline schedules, which allocate on CUDA in "
            "megatron-core 0.16.1; use parallel.pipeline_model_parallel_size=1 on CPU"
        )
    if par_cfg.context_parallel_size > 1:
        raise ValueError(
            "context parallelism is not supported with the packed cache (its attention reads "
            "whole sequences); use parallel.context_parallel_size=1, or Megatron's own TE spec "
            "for CP without the cache"
        )
    is_moe = model_cfg.num_experts is not None
    if not is_moe and par_cfg.expert_model_parallel_size > 1:
        raise ValueError("parallel.expert_model_parallel_size > 1 needs an MoE model (model.num_experts)")
    if fast_cfg.moe_capacity_factor is not None and not is_moe:
        raise ValueError("fastpath.moe_capacity_factor is set but the model has no experts")
    if offload_cfg is not None and par_cfg.pipeline_model_parallel_size > 1:
        raise ValueError(
            "fastpath.offload with pipeline parallelism is not supported yet (one pass in flight "
            "per offload manager); use parallel.pipeline_model_parallel_size=1"
        )
    from megatron_fastpath.attention.core_attention import resolve_backend

    backend = resolve_backend(fast_cfg.attention_backend, device, data_cfg.max_tokens, 16384)
    linear_impl = fast_cfg.linear_impl if fast_cfg.linear_impl != "auto" else (
        "te" if backend == "te" else "local")
    plan = plan_graphs_and_fp8(
        graph_cfg, fp8_cfg, device,
        dropout=0.0,  # build_transformer_config sets hidden/attention dropout to 0
        lora_dropout=lora_cfg.dropout if lora_cfg else 0.0,
        linear_impl=linear_impl,
        moe_dropless_ep=is_moe and par_cfg.expert_model_parallel_size > 1
        and fast_cfg.moe_capacity_factor is None,
    )
    dtype = getattr(torch, train_cfg.dtype)
    env_set = apply_env(plan.env)

    init_distributed(
        backend=cluster_cfg.backend if cluster_cfg.backend != "auto" else (
            "nccl" if device.type == "cuda" else "gloo"),
        timeout_s=cluster_cfg.timeout_s,
        tensor_model_parallel_size=par_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=par_cfg.pipeline_model_parallel_size,
        expert_model_parallel_size=par_cfg.expert_model_parallel_size,
        context_parallel_size=par_cfg.context_parallel_size,
    )
    from megatron.core import parallel_state as ps

    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    dp_rank, dp_world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    torch.manual_seed(train_cfg.seed)

    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    moe_overrides = {}
    if is_moe and fast_cfg.moe_capacity_factor is not None:
        moe_overrides = dict(
            moe_expert_capacity_factor=fast_cfg.moe_capacity_factor,
            moe_pad_expert_input_to_capacity=True,
            moe_token_drop_policy="probs",
        )
    tcfg = build_transformer_config(
        model_cfg,
        params_dtype=dtype,
        tensor_model_parallel_size=par_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=par_cfg.pipeline_model_parallel_size,
        expert_model_parallel_size=par_cfg.expert_model_parallel_size,
        **moe_overrides,
        **plan.transformer_config,
    )
    in_flight = train_cfg.micro_batches if device.type == "cuda" else 1
    cache = PackedSeqCache(
        PackedSeqConfig(
            max_tokens=data_cfg.max_tokens,
            max_seqs=data_cfg.max_seqs,
            num_slots=in_flight,
            rope=rope_config_for(model_cfg),
        ),
        device=device,
    )
    spec = get_fastpath_layer_spec(
        cache,
        backend=backend,
        num_experts=model_cfg.num_experts,
        qk_layernorm=model_cfg.qk_layernorm,
        normalization=model_cfg.normalization,
        linear_impl=linear_impl,
    )
    if lora_cfg is not None:
        from megatron_fastpath.lora import with_lora

        spec = with_lora(spec, lora_cfg)
    if offload_cfg is not None:
        from megatron_fastpath.offload import with_activation_offload

        spec = with_activation_offload(spec, offload_cfg)
    model = build_gpt_model(
        tcfg, spec, model_cfg.vocab_size, data_cfg.max_tokens,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
    ).to(device)
    total_params = sum(p.numel() for p in model.parameters())
    trainable = total_params
    if lora_cfg is not None:
        from megatron_fastpath.lora import freeze_base_parameters, lock_lora

        trainable = freeze_base_parameters(model)
        if plan.capture:
            lock_lora(model)  # captured graphs freeze the adapter branch
    offload_mgr = None
    if offload_cfg is not None:
        from megatron_fastpath.offload import get_offload_manager

        offload_mgr = get_offload_manager(model)

    dataset = SyntheticSFTDataset(data_cfg, model_cfg.vocab_size)
    bins = pack_microbatches(dataset, data_cfg)
    per_step = train_cfg.micro_batches * dp_world
    if len(bins) < per_step:
        raise ValueError(
            f"only {len(bins)} packed microbatches for {per_step} per step; raise data.num_samples"
        )

    def step_batches(step: int):
        """Global microbatches of a step (identical on every rank), and this rank's share."""
        first = ((step - 1) * per_step) % (len(bins) - per_step + 1)
        global_mbs = bins[first : first + per_step]
        mine = global_mbs[dp_rank * train_cfg.micro_batches : (dp_rank + 1) * train_cfg.micro_batches]
        return global_mbs, mine

    if device.type == "cuda":  # pragma: no cover - GPU path
        step_fn, optimizer, scheduler = _gpu_step(model, tcfg, train_cfg, cache)
    else:
        step_fn, optimizer, scheduler = _cpu_step(model, tcfg, train_cfg, cache)

    readback = LaggedReadback(device)
    records: list[StepRecord] = []
    show = rank == 0 or train_cfg.log_all_ranks
    prefix = f"[rank {rank}] " if train_cfg.log_all_ranks else ""
    features = [f for f in ("lora", "offload", "cuda_graphs", "fp8") if getattr(fast_cfg, f)]
    if show:
        print(
            f"{prefix}megatron_fastpath: {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}"
            f"{f', {model_cfg.num_experts} experts top-{model_cfg.moe_router_topk}' if is_moe else ''}, "
            f"{total_params:,} params ({trainable:,} trainable) on {device} (world {world}, dp "
            f"{dp_world}, ep {par_cfg.expert_model_parallel_size}), {len(bins)} packed "
            f"microbatches, attention {backend}, features: {', '.join(features) or 'none'}",
            flush=True,
        )
        for note in plan.notes:
            print(f"{prefix}  {note}", flush=True)
        if env_set:
            print(f"{prefix}  environment: {env_set}", flush=True)

    def emit(prev):
        if prev is None:
            return
        vals, extra = prev
        loss = vals["loss_sum"] / max(extra["loss_tokens"], 1)
        rec = StepRecord(
            step=extra["step"], loss=loss, lr=extra["lr"], tokens=extra["tokens"],
            step_ms=extra["step_ms"], tokens_per_s=extra["tokens"] / (extra["step_ms"] / 1e3),
            syncs_fwd_bwd=extra["syncs_fwd_bwd"], syncs_step=extra["syncs_step"],
            sync_sites=extra["sync_sites"], cache_hits=extra["hits"], cache_misses=extra["misses"],
            offload_bytes=extra["offload_bytes"], offload_mode=extra["offload_mode"],
        )
        records.append(rec)
        if show:
            off = (f" | offload {rec.offload_mode} {rec.offload_bytes / 2**20:.1f} MiB"
                   if offload_mgr is not None else "")
            print(
                f"{prefix}step {rec.step:4d}/{train_cfg.steps} | loss {rec.loss:.4f} | lr {rec.lr:.2e} | "
                f"{rec.tokens_per_s:9.0f} tok/s | host syncs: fwd+bwd {rec.syncs_fwd_bwd}, "
                f"step {rec.syncs_step} | cache hits {rec.cache_hits} misses {rec.cache_misses}{off}",
                flush=True,
            )

    audit = None
    if plan.audit:
        from megatron_fastpath.graphs import GraphSafetyAudit

        audit = GraphSafetyAudit(model, strict=graph_cfg.strict_audit)
        audit.__enter__()
    try:
        for step in range(1, train_cfg.steps + 1):
            global_mbs, mbs = step_batches(step)
            global_loss_tokens = sum(mb.num_loss_tokens for mb in global_mbs)  # host ints
            stats_before = cache.stats.snapshot()
            if offload_mgr is not None:
                offload_mgr.begin_step()
            auditing = audit is not None and step <= graph_cfg.audit_steps
            t0 = time.perf_counter()
            with audit.step() if auditing else contextlib.nullcontext():
                with SyncSentinel(name=f"step {step}") as step_sentinel:
                    loss_sum, fwd_bwd_sentinel = step_fn(mbs, global_loss_tokens)
            step_ms = (time.perf_counter() - t0) * 1e3
            if audit is not None and step == graph_cfg.audit_steps:
                audit.__exit__(None, None, None)
            off_stats = offload_mgr.end_step() if offload_mgr is not None else None
            lr = optimizer.param_groups[0]["lr"]
            scheduler.step(increment=1)
            d = cache.stats.since(stats_before)
            emit(
                readback.push(
                    {"loss_sum": loss_sum},
                    dict(
                        step=step, lr=lr, step_ms=step_ms,
                        tokens=sum(mb.num_tokens for mb in global_mbs),
                        loss_tokens=global_loss_tokens,
                        syncs_fwd_bwd=fwd_bwd_sentinel.num_syncs,
                        syncs_step=step_sentinel.num_syncs,
                        sync_sites=tuple(sorted(step_sentinel.by_location())),
                        hits=d.hits, misses=d.misses,
                        offload_bytes=off_stats.bytes_offloaded if off_stats else 0,
                        offload_mode=off_stats.mode.value if off_stats else "off",
                    ),
                )
            )
        emit(readback.pop())
    finally:
        if audit is not None and audit._handles:
            audit.__exit__(None, None, None)

    audit_report = audit.report() if audit is not None else None
    k = min(3, len(records))
    summary = TrainSummary(
        steps=len(records),
        world_size=world,
        device=str(device),
        first_loss=sum(r.loss for r in records[:k]) / k,
        last_loss=sum(r.loss for r in records[-k:]) / k,
        mean_tokens_per_s=sum(r.tokens_per_s for r in records[1:] or records) / max(len(records) - 1, 1),
        syncs_fwd_bwd_per_step=sum(r.syncs_fwd_bwd for r in records) / len(records),
        syncs_per_step=sum(r.syncs_step for r in records) / len(records),
        cache_hits=sum(r.cache_hits for r in records),
        cache_misses=sum(r.cache_misses for r in records),
        records=tuple(records),
        trainable_params=trainable,
        total_params=total_params,
        audit=audit_report.summary() if audit_report else None,
        audit_ok=audit_report.ok if audit_report else None,
        notes=plan.notes,
    )
    if show:
        sites = sorted({s for r in records for s in r.sync_sites})
        print(
            f"{prefix}summary: {summary.steps} steps | loss {summary.first_loss:.4f} -> "
            f"{summary.last_loss:.4f} | {summary.mean_tokens_per_s:.0f} tok/s | host syncs per "
            f"step: fwd+bwd {summary.syncs_fwd_bwd_per_step:g}, whole step "
            f"{summary.syncs_per_step:g} | cache hits {summary.cache_hits} misses "
            f"{summary.cache_misses} ({cache.stats.host_to_device_copies} H2D copies, "
            f"{cache.stats.bytes_copied} bytes)",
            flush=True,
        )
        for s in sites:
            print(f"{prefix}  sync site: {s}", flush=True)
        if offload_mgr is not None and offload_mgr.history:
            last = offload_mgr.history[-1]
            print(
                f"{prefix}  offload: mode {last.mode.value} ({last.mode_reason}), "
                f"{last.bytes_offloaded:,} B offloaded/{last.bytes_reloaded:,} B reloaded per step, "
                f"{last.prefetched_reloads} prefetched / {last.just_in_time_reloads} just-in-time "
                f"reloads (est. exposed copy {last.est_exposed_copy_s * 1e3:.3f} ms), device "
                f"buffers {last.device_buffer_bytes:,} B, host pool {last.host_pool_bytes:,} B",
                flush=True,
            )
        if audit_report is not None:
            print("\n".join(f"{prefix}  {line}" for line in audit_report.summary().splitlines()),
                  flush=True)
    if train_cfg.summary_json and rank == 0:
        with open(train_cfg.summary_json, "w") as f:
            json.dump(summary.to_json(), f, indent=1)
    return summary


def _forward(model, mb, pb, device):
    """Model output for one packed microbatch: per-token losses [1, T] on the last pipeline
    stage, hidden states on the others."""
    return model(
        mb.tokens_1T.to(device, non_blocking=True),
        pb.position_ids_1T,
        None,
        labels=mb.labels_1T.to(device, non_blocking=True),
        packed_seq_params=pb.packed_seq_params,
    )


def _masked_loss_sum(per_token, mb, device):
    """Sum of per-token losses over the microbatch's loss mask (response tokens)."""
    return (per_token.float() * mb.loss_mask_1T.to(device, non_blocking=True)).sum()


def _warmup(train_cfg: TrainingConfig) -> int:
    """Megatron's scheduler needs warmup < decay steps: short runs get a shorter warmup."""
    return min(train_cfg.warmup_steps, train_cfg.steps - 1)


def _cpu_step(model, tcfg, train_cfg: TrainingConfig, cache):
    """Our own microbatch loop + fused torch AdamW (Megatron's optimizer and DDP need CUDA)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": train_cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(
        # fused AdamW keeps its step counters on the device: no per-parameter .item()
        # (foreach AdamW on CPU reads each step count back: one host sync per parameter).
        groups, lr=train_cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )
    scheduler = _scheduler(optimizer, train_cfg)

    def step(mbs, global_loss_tokens: int):
        from megatron.core import parallel_state as ps

        loss_sum = torch.zeros((), dtype=torch.float32)
        with SyncSentinel(name="fwd+bwd") as fwd_bwd:
            for mb in mbs:
                with cache.batch(mb.lengths) as pb:
                    cpu = torch.device("cpu")
                    loss = _masked_loss_sum(_forward(model, mb, pb, cpu), mb, cpu)
                    (loss / global_loss_tokens).backward()
                loss_sum += loss.detach()
        _all_reduce_grads(model)
        dp_group = ps.get_data_parallel_group()
        if torch.distributed.get_world_size(dp_group) > 1:
            torch.distributed.all_reduce(loss_sum, group=dp_group)  # global loss for the log
        if train_cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, train_cfg.clip_grad, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum, fwd_bwd

    return step, optimizer, scheduler


def _scheduler(optimizer, train_cfg: TrainingConfig):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=train_cfg.lr, min_lr=train_cfg.min_lr,
        lr_warmup_steps=_warmup(train_cfg), lr_decay_steps=train_cfg.steps,
        lr_decay_style="cosine", start_wd=train_cfg.weight_decay, end_wd=train_cfg.weight_decay,
        wd_incr_steps=train_cfg.steps, wd_incr_style="constant",
    )


def _gpu_step(model, tcfg, train_cfg: TrainingConfig, cache):  # pragma: no cover - CUDA only
    """Megatron's schedule (PP included), DDP, gradient finalisation and optimizer."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp = DistributedDataParallel(
        config=tcfg,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        module=model,
    )
    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=train_cfg.lr, min_lr=train_cfg.min_lr,
        weight_decay=train_cfg.weight_decay, adam_beta1=0.9, adam_beta2=0.95,
        clip_grad=train_cfg.clip_grad, bf16=train_cfg.dtype == "bfloat16",
        use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    scheduler = _scheduler(optimizer, train_cfg)
    # What Megatron's training loop wires into the model config for its schedules.
    tcfg.grad_scale_func = optimizer.scale_loss
    tcfg.no_sync_func = ddp.no_sync
    tcfg.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    device = cache.device
    dp_world = ps.get_data_parallel_world_size()

    def step(mbs, global_loss_tokens: int):
        handles = []
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        n = len(mbs)

        def forward_step(data_iterator, module):
            mb = next(data_iterator)
            pb = cache.set_batch(mb.lengths)  # slot held until the schedule's backward is done
            handles.append(pb)
            # First stage reads tokens, last stage labels; middle stages get hidden states.
            output = _forward(module, mb, pb, device)

            def loss_func(per_token):  # last pipeline stage only
                loss = _masked_loss_sum(per_token, mb, device)
                loss_sum.add_(loss.detach())
                # The schedule divides by the microbatch count and DDP averages over DP: undo
                # both so gradients are those of the global token-normalised loss.
                return loss * (n * dp_world / global_loss_tokens), {}

            return output, loss_func

        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        with SyncSentinel(name="fwd+bwd") as fwd_bwd:
            forward_backward(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[ddp],
                num_microbatches=n, seq_length=cache.config.max_tokens,
                micro_batch_size=1, forward_only=False,
            )
        for pb in handles:
            cache.release(pb)
        optimizer.step()
        if ps.get_pipeline_model_parallel_world_size() > 1:  # the loss lives on the last stage
            torch.distributed.all_reduce(loss_sum, group=ps.get_pipeline_model_parallel_group())
        if dp_world > 1:
            torch.distributed.all_reduce(loss_sum, group=ps.get_data_parallel_group())
        return loss_sum, fwd_bwd

    return step, optimizer, scheduler


def config_dir() -> str:
    """The Hydra config directory: $MEGATRON_FASTPATH_CONFIGS or the repository's configs/."""
    return os.environ.get(
        "MEGATRON_FASTPATH_CONFIGS",
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"),
    )


def main() -> None:
    import hydra
    from omegaconf import DictConfig

    @hydra.main(config_path=config_dir(), config_name="config", version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        run(cfg)
        from megatron_fastpath.distributed import destroy_distributed

        destroy_distributed()

    _main()


if __name__ == "__main__":
    main()
