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

import dataclasses
import json
import logging
import math
import os
import time
from typing import Any, Optional

import torch

from megatron_fastpath.data import DataConfig, SyntheticSFTDataset, iterate_forever, pack_microbatches
from megatron_fastpath.model import ModelConfig, build_gpt_model, build_transformer_config, rope_config_for
from megatron_fastpath.sync import SyncSentinel

__all__ = ["TrainingConfig", "FastpathConfig", "ParallelConfig", "StepRecord", "TrainSummary", "run", "main"]

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
    packed_cache: bool = True
    attention_backend: str = "auto"


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 1


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


def _all_reduce_grads(model: torch.nn.Module, group) -> None:
    """Average gradients over the data-parallel group (CPU path; one flat bucket)."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat, group=group)
    flat.div_(torch.distributed.get_world_size(group))
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


def run(cfg) -> TrainSummary:
    """Train per ``cfg`` (an OmegaConf/dict tree with groups model, data, training, fastpath,
    parallel) and return the summary. All config validation happens before any model is built."""
    from megatron_fastpath.distributed import init_distributed

    model_cfg = _section(cfg, "model", ModelConfig)
    data_cfg = _section(cfg, "data", DataConfig)
    train_cfg = _section(cfg, "training", TrainingConfig)
    fast_cfg = _section(cfg, "fastpath", FastpathConfig)
    par_cfg = _section(cfg, "parallel", ParallelConfig)
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
    if model_cfg.num_experts is None and par_cfg.expert_model_parallel_size > 1:
        raise ValueError("parallel.expert_model_parallel_size > 1 needs an MoE model (model.num_experts)")
    dtype = getattr(torch, train_cfg.dtype)

    init_distributed(
        tensor_model_parallel_size=par_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=par_cfg.pipeline_model_parallel_size,
        expert_model_parallel_size=par_cfg.expert_model_parallel_size,
        context_parallel_size=par_cfg.context_parallel_size,
    )
    from megatron.core import parallel_state as ps

    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    dp_group = ps.get_data_parallel_group()
    dp_rank, dp_world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    torch.manual_seed(train_cfg.seed)

    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    tcfg = build_transformer_config(
        model_cfg,
        params_dtype=dtype,
        tensor_model_parallel_size=par_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=par_cfg.pipeline_model_parallel_size,
        expert_model_parallel_size=par_cfg.expert_model_parallel_size,
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
        backend=fast_cfg.attention_backend,
        num_experts=model_cfg.num_experts,
        qk_layernorm=model_cfg.qk_layernorm,
        normalization=model_cfg.normalization,
    )
    model = build_gpt_model(tcfg, spec, model_cfg.vocab_size, data_cfg.max_tokens).to(device)

    dataset = SyntheticSFTDataset(data_cfg, model_cfg.vocab_size)
    microbatches = pack_microbatches(dataset, data_cfg, rank=dp_rank, world=dp_world)
    if len(microbatches) < train_cfg.micro_batches:
        raise ValueError(
            f"only {len(microbatches)} packed microbatches per rank; raise data.num_samples"
        )
    batches = iterate_forever(microbatches)

    if device.type == "cuda":  # pragma: no cover - GPU path
        step_fn, optimizer, scheduler = _gpu_step(model, tcfg, train_cfg, cache)
    else:
        step_fn, optimizer, scheduler = _cpu_step(model, tcfg, train_cfg, cache, dp_group)

    readback = LaggedReadback(device)
    records: list[StepRecord] = []
    show = rank == 0 or train_cfg.log_all_ranks
    prefix = f"[rank {rank}] " if train_cfg.log_all_ranks else ""
    if show:
        print(
            f"{prefix}megatron_fastpath: {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, "
            f"{sum(p.numel() for p in model.parameters()):,} params on {device} "
            f"(world {world}, dp {dp_world}), {len(microbatches)} packed microbatches/rank, "
            f"attention backend {spec.submodules.self_attention.submodules.core_attention.params['backend']}",
            flush=True,
        )

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
        )
        records.append(rec)
        if show:
            print(
                f"{prefix}step {rec.step:4d}/{train_cfg.steps} | loss {rec.loss:.4f} | lr {rec.lr:.2e} | "
                f"{rec.tokens_per_s:9.0f} tok/s | host syncs: fwd+bwd {rec.syncs_fwd_bwd}, "
                f"step {rec.syncs_step} | cache hits {rec.cache_hits} misses {rec.cache_misses}",
                flush=True,
            )

    for step in range(1, train_cfg.steps + 1):
        mbs = [next(batches) for _ in range(train_cfg.micro_batches)]
        stats_before = cache.stats.snapshot()
        t0 = time.perf_counter()
        with SyncSentinel(name=f"step {step}") as step_sentinel:
            loss_sum, fwd_bwd_sentinel = step_fn(mbs)
        step_ms = (time.perf_counter() - t0) * 1e3
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step(increment=1)
        d = cache.stats.since(stats_before)
        emit(
            readback.push(
                {"loss_sum": loss_sum},
                dict(
                    step=step, lr=lr, step_ms=step_ms,
                    tokens=sum(mb.num_tokens for mb in mbs),
                    loss_tokens=sum(mb.num_loss_tokens for mb in mbs),
                    syncs_fwd_bwd=fwd_bwd_sentinel.num_syncs,
                    syncs_step=step_sentinel.num_syncs,
                    sync_sites=tuple(sorted(step_sentinel.by_location())),
                    hits=d.hits, misses=d.misses,
                ),
            )
        )
    emit(readback.pop())

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
    if train_cfg.summary_json and rank == 0:
        with open(train_cfg.summary_json, "w") as f:
            json.dump(summary.to_json(), f, indent=1)
    return summary


def _loss_of(model, mb, pb, device):
    per_tok = model(
        mb.tokens_1T.to(device, non_blocking=True),
        pb.position_ids_1T,
        None,
        labels=mb.labels_1T.to(device, non_blocking=True),
        packed_seq_params=pb.packed_seq_params,
    )
    return (per_tok.float() * mb.loss_mask_1T.to(device, non_blocking=True)).sum()


def _warmup(train_cfg: TrainingConfig) -> int:
    """Megatron's scheduler needs warmup < decay steps: short runs get a shorter warmup."""
    return min(train_cfg.warmup_steps, train_cfg.steps - 1)


def _cpu_step(model, tcfg, train_cfg: TrainingConfig, cache, dp_group):
    """Our own microbatch loop + torch AdamW (Megatron's optimizer and DDP need CUDA)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train_cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        # fused AdamW keeps its step counters on the device: no per-parameter .item()
        # (foreach AdamW on CPU reads each step count back: one host sync per parameter).
        lr=train_cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=train_cfg.lr, min_lr=train_cfg.min_lr,
        lr_warmup_steps=_warmup(train_cfg), lr_decay_steps=train_cfg.steps,
        lr_decay_style="cosine", start_wd=train_cfg.weight_decay, end_wd=train_cfg.weight_decay,
        wd_incr_steps=train_cfg.steps, wd_incr_style="constant",
    )

    def step(mbs):
        total_loss_tokens = sum(mb.num_loss_tokens for mb in mbs)  # host ints: no sync
        loss_sum = torch.zeros((), dtype=torch.float32)
        with SyncSentinel(name="fwd+bwd") as fwd_bwd:
            for mb in mbs:
                with cache.batch(mb.lengths) as pb:
                    loss = _loss_of(model, mb, pb, torch.device("cpu"))
                    (loss / total_loss_tokens).backward()
                loss_sum += loss.detach()
        _all_reduce_grads(model, dp_group)
        if train_cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, train_cfg.clip_grad, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum, fwd_bwd

    return step, optimizer, scheduler


def _gpu_step(model, tcfg, train_cfg: TrainingConfig, cache):  # pragma: no cover - CUDA only
    """Megatron's schedule (PP included), DDP and optimizer."""
    from functools import partial

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
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
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=train_cfg.lr, min_lr=train_cfg.min_lr,
        lr_warmup_steps=_warmup(train_cfg), lr_decay_steps=train_cfg.steps,
        lr_decay_style="cosine", start_wd=train_cfg.weight_decay, end_wd=train_cfg.weight_decay,
        wd_incr_steps=train_cfg.steps, wd_incr_style="constant",
    )
    forward_backward = get_forward_backward_func()
    device = cache.device

    def step(mbs):
        total_loss_tokens = sum(mb.num_loss_tokens for mb in mbs)
        handles = []
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)

        def forward_step(data_iterator, module):
            mb = next(data_iterator)
            pb = cache.set_batch(mb.lengths)  # slot held until the schedule's backward is done
            handles.append(pb)
            loss = _loss_of(module, mb, pb, device)

            def loss_func(output):
                loss_sum.add_(output.detach())
                return output / total_loss_tokens, {}

            return loss, loss_func

        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        with SyncSentinel(name="fwd+bwd") as fwd_bwd:
            forward_backward(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[ddp],
                num_microbatches=len(mbs), seq_length=cache.config.max_tokens,
                micro_batch_size=1, forward_only=False,
            )
        for pb in handles:
            cache.release(pb)
        optimizer.step()
        return loss_sum, fwd_bwd

    return step, optimizer, scheduler


def main() -> None:
    import hydra
    from omegaconf import DictConfig

    config_dir = os.environ.get(
        "MEGATRON_FASTPATH_CONFIGS",
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"),
    )

    @hydra.main(config_path=config_dir, config_name="config", version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        run(cfg)
        from megatron_fastpath.distributed import destroy_distributed

        destroy_distributed()

    _main()


if __name__ == "__main__":
    main()
