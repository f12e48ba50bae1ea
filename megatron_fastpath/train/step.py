"""One training step, two paths chosen by device, behind one signature.

* :func:`cpu_train_step`: our own microbatch loop, fused torch AdamW, gradient all-reduce over the
  data-parallel group (Megatron 0.16.1's ``forward_backward_no_pipelining``, DDP and optimizer
  allocate on ``device="cuda"``).
* :func:`gpu_train_step`: Megatron's ``get_forward_backward_func`` schedule (pipeline parallel
  included), ``DistributedDataParallel`` and ``get_megatron_optimizer``.

Each builder returns a :class:`StepParts`: ``forward_backward(microbatches, global_loss_tokens)
-> (loss_sum, fwd_bwd_sentinel)`` (forward, backward, gradient reduction and optimizer step), the
optimizer and Megatron's ``OptimizerParamScheduler`` (both paths). :func:`train_step` wraps either
with the step's bookkeeping (SyncSentinel, cache and offload statistics, LR schedule).

Shape key: T = tokens of a packed microbatch (its batch dimension is 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Union

import torch

from megatron_fastpath.compat import tensor_parallel as tensor_parallel_compat
from megatron_fastpath.data import StepBatch
from megatron_fastpath.packed_seq.runtime import cp_local, forward, masked_loss_sum
from megatron_fastpath.sync import SyncSentinel
from megatron_fastpath.train.config import TrainingConfig
from megatron_fastpath.train.logger import StepResult

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_fastpath.optim import SyncFreeOptimizer
    from megatron_fastpath.packed_seq.inflight import InFlightBatches
    from megatron_fastpath.packed_seq.staging import PinnedStaging

__all__ = ["StepParts", "StepBatch", "cpu_train_step", "gpu_train_step", "train_step"]


class GraphLaunches(Protocol):
    """What the step reads of the full-iteration graphs (``train.full_iteration``'s
    ``FullIterationStep``, which imports this module): the graph launches of the last step."""

    launches: int


@dataclasses.dataclass(frozen=True)
class StepParts:
    """``in_flight``: the GPU path's cache-slot bookkeeping (None on the CPU path).
    ``optimizer``: fused torch AdamW (CPU path), Megatron's optimizer or its sync-free wrapper."""

    # (microbatches, global_loss_tokens, check_syncs) -> (loss_sum, sentinel or UNCHECKED)
    forward_backward: Callable[[list, int, bool], tuple]
    optimizer: Union[torch.optim.Optimizer, MegatronOptimizer, SyncFreeOptimizer]
    scheduler: OptimizerParamScheduler
    # gradient norm of the last step (device tensor or host float; None before the first)
    grad_norm: Callable[[], Union[torch.Tensor, float, None]] = lambda: None
    in_flight: Optional[InFlightBatches] = None
    staging: Optional[PinnedStaging] = None  # the GPU path (None on the CPU path)
    # cuda_graphs.scope=full_iteration: the FullIterationStep (its ``launches`` per step)
    graphs: Optional[GraphLaunches] = None
    # the GPU path's (microbatches, global_loss_tokens) -> None: forward and backward without an
    # optimizer step, gradients dropped (graphs/resume.py: per-layer graphs captured on resume)
    record_graphs: Optional[Callable] = None
    # () -> a context in which the model's parameters are the last step's, gathered
    # (:func:`gathered_params`): evaluation, checkpoint saves and exports run inside it
    params_current: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


class _Unchecked:
    """What a step not counted by :class:`SyncSentinel` reports: no count, no sites."""

    num_syncs = None

    @staticmethod
    def by_location() -> dict:
        return {}


UNCHECKED = _Unchecked()


def sync_check(enabled: bool, name: str):
    """``SyncSentinel(name)`` when ``enabled``, else a no-op block yielding :data:`UNCHECKED`:
    the sentinel is a Python function + dispatch mode around every op (a diagnosis, not
    something a production step runs: ``training.sync_check``)."""
    return SyncSentinel(name=name) if enabled else contextlib.nullcontext(UNCHECKED)


def train_step(job, batch: StepBatch, audit: bool = False, check_syncs: bool = True) -> StepResult:
    """Run one step of ``job`` on ``batch`` (``audit``: inside the graph-safety audit's step,
    whose hooks the caller holds installed; ``check_syncs``: count host syncs with
    :class:`SyncSentinel`). The loss stays on the device in the result."""
    stats_before = job.cache.stats.snapshot()
    if job.offload is not None:
        job.offload.begin_step()
    timing = None
    if job.cfg.device.type == "cuda":  # the step's device time, read when its loss is (a step late)
        timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        timing[0].record()
    t0 = time.perf_counter()
    with job.audit.step() if audit else contextlib.nullcontext():
        with sync_check(check_syncs, f"step {batch.step}") as step_sentinel:
            loss_sum, fwd_bwd = job.step.forward_backward(
                batch.microbatches, batch.global_loss_tokens, check_syncs)
    step_ms = (time.perf_counter() - t0) * 1e3
    if timing is not None:
        timing[1].record()
    off = job.offload.end_step() if job.offload is not None else None
    # the sync-free optimizer step's applied flag: a device tensor, logged a step late
    sync_free = getattr(job.step.optimizer, "last", None)
    lr = job.step.optimizer.param_groups[0]["lr"]
    job.step.scheduler.step(increment=1)
    d = job.cache.stats.since(stats_before)
    return StepResult(
        step=batch.step, loss_sum=loss_sum, lr=lr, tokens=batch.global_tokens,
        loss_tokens=batch.global_loss_tokens, step_ms=step_ms, device_timing=timing,
        syncs_fwd_bwd=fwd_bwd.num_syncs, syncs_step=step_sentinel.num_syncs,
        sync_sites=tuple(sorted(step_sentinel.by_location())),
        cache_builds=d.builds,
        offload_bytes=off.bytes_offloaded if off else 0,
        offload_mode=off.mode.value if off else "off",
        grad_norm=job.step.grad_norm(),
        applied=sync_free.applied_1 if sync_free is not None else None,
        graph_launches=job.step.graphs.launches if job.step.graphs is not None else None,
    )


def build_scheduler(optimizer, train_cfg: TrainingConfig):
    """Megatron's LR schedule: ``training.lr_schedule`` after a linear warm-up (its warmup must be shorter than the decay: short runs get
    a shorter warmup). A resume takes this run's values, not the checkpoint's
    (``override_opt_param_scheduler``, Megatron's --override-opt_param-scheduler): the
    fingerprint makes them equal but for a finished run extended (settings.SCHEDULE_SETTINGS),
    whose schedule is recomputed for the new total while the step count continues."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_fastpath.train.defaults import LR_SCHEDULES

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=train_cfg.lr, min_lr=train_cfg.min_lr,
        lr_warmup_steps=min(train_cfg.warmup_steps, train_cfg.steps - 1),
        lr_decay_steps=train_cfg.steps, lr_decay_style=LR_SCHEDULES[train_cfg.lr_schedule],
        start_wd=train_cfg.weight_decay, end_wd=train_cfg.weight_decay,
        wd_incr_steps=train_cfg.steps, wd_incr_style="constant",
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
    )


def is_expert_param(p: torch.Tensor) -> bool:
    """Megatron's mark of an expert-parallel parameter (``allreduce=False``, read by its DDP):
    reduced over the expert-DP group, its norm summed over the expert groups."""
    return getattr(p, "allreduce", True) is False


def all_reduce_grads(model: torch.nn.Module) -> None:
    """Sum gradients over data-parallel replicas (CPU path): dense parameters over the DP x CP
    group (Megatron's ``with_context_parallel=True``: each CP rank's gradient is its tokens'
    share), expert parameters (Megatron marks them ``allreduce=False``) over the expert-DP
    group. The loss is normalised by the *global* token count, so the sum equals one big batch."""
    from megatron.core import parallel_state as ps

    buckets = {}
    for p in model.parameters():
        if p.grad is None:
            continue
        expert = is_expert_param(p)
        group = (ps.get_expert_data_parallel_group() if expert
                 else ps.get_data_parallel_group(with_context_parallel=True))
        if torch.distributed.get_world_size(group) > 1:
            buckets.setdefault(expert, (group, []))[1].append(p.grad)
    for group, grads in buckets.values():
        flat = torch._utils._flatten_dense_tensors(grads)
        torch.distributed.all_reduce(flat, group=group)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def global_grad_norm(params) -> torch.Tensor:
    """The gradient norm Megatron's (chained) optimizer clips with, on the device: dense
    gradients over the model-parallel group (TP x PP), expert gradients over the expert
    tensor-model-pipeline group (ETP x EP x PP), skipping shared and TP-duplicate parameters
    (``get_main_grads_for_grad_norm``), combined as sqrt(dense^2 + expert^2) like
    ``ChainedOptimizer.get_grad_norm``. A local ``clip_grad_norm_`` would clip each rank with
    its own norm: at EP > 1 (or TP > 1) the replicas of the dense parameters then drift apart."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    dense, expert = [], []
    expert_tp = ps.get_expert_tensor_parallel_group()  # experts' duplicates are over expert-TP
    for p in params:
        if p.grad is None or not param_is_not_shared(p):
            continue
        if is_expert_param(p):
            if param_is_not_tensor_parallel_duplicate(p, expert_tp):
                expert.append(p.grad)
        elif param_is_not_tensor_parallel_duplicate(p):
            dense.append(p.grad)
    total_sq = torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)
    for grads, group in ((dense, ps.get_model_parallel_group()),
                         (expert, ps.get_expert_tensor_model_pipeline_parallel_group())):
        sq = (torch.nn.utils.get_total_norm(grads, foreach=True).float() ** 2 if grads
              else torch.zeros_like(total_sq))
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(sq, group=group)
        total_sq = total_sq + sq
    return total_sq.sqrt()


def _cpu_optimizer(params, train_cfg: TrainingConfig):
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    # wd_mult as Megatron's param groups carry it: OptimizerParamScheduler sets each group's
    # weight_decay to wd * wd_mult (1.0 when missing), so without it 1-dim parameters would decay.
    groups = [{"params": decay, "weight_decay": train_cfg.weight_decay, "wd_mult": 1.0}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0})
    return torch.optim.AdamW(
        # fused AdamW keeps its step counters on the device: no per-parameter .item()
        # (foreach AdamW on CPU reads each step count back: one host sync per parameter).
        groups, lr=train_cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )


def cpu_train_step(model, tcfg, train_cfg: TrainingConfig, cache, parallel=None,
                   linear_cross_entropy: bool = False) -> StepParts:
    """Our own microbatch loop + fused torch AdamW (Megatron's optimizer and DDP need CUDA;
    ``parallel``'s data-parallel optimizer settings are refused on a CPU by the rules;
    ``linear_cross_entropy``: the chunked loss, :func:`~megatron_fastpath.packed_seq.runtime.forward`)."""
    from megatron.core import parallel_state as ps

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _cpu_optimizer(params, train_cfg)
    last = {}

    dp_world = ps.get_data_parallel_world_size()
    aux_scale = torch.ones(())

    def forward_backward(mbs, global_loss_tokens: int, check_syncs: bool = True):
        loss_sum = torch.zeros((), dtype=torch.float32)
        if getattr(tcfg, "num_moe_experts", None):
            # As Megatron's schedule (schedules.py forward_step_calc_loss) and DDP weigh the MoE
            # aux loss: its mean over the microbatches of the global batch (we sum gradients
            # over DP where DDP averages them).
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            MoEAuxLossAutoScaler.set_loss_scale(aux_scale.fill_(1.0 / (len(mbs) * dp_world)))
        with sync_check(check_syncs, "fwd+bwd") as fwd_bwd:
            for mb in mbs:
                with cache.batch(mb.lengths) as pb:
                    tokens_1T, labels_1T, mask_1T = (
                        cp_local(pb, x) for x in (mb.tokens_1T, mb.labels_1T, mb.loss_mask_1T))
                    loss = masked_loss_sum(forward(model, pb, tokens_1T, labels_1T,
                                                   linear_cross_entropy=linear_cross_entropy), mask_1T)
                    (loss / global_loss_tokens).backward()
                loss_sum += loss.detach()
        all_reduce_grads(model)
        tensor_parallel_compat.allreduce_tp_partial_grads(model, tcfg)  # qk layernorm at TP > 1, as Megatron
        # global loss for the log: summed over DP and over CP (each CP rank holds part of every
        # microbatch), as Megatron reduces the loss over the DP x CP group
        dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        if torch.distributed.get_world_size(dp_group) > 1:
            torch.distributed.all_reduce(loss_sum, group=dp_group)
        last["grad_norm"] = global_grad_norm(params)
        if train_cfg.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(
                params, train_cfg.clip_grad, last["grad_norm"], foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum, fwd_bwd

    return StepParts(forward_backward, optimizer, build_scheduler(optimizer, train_cfg),
                     grad_norm=lambda: last.get("grad_norm"))


ADAPTER_PARAMS = ("lora_A", "lora_B")  # LoRALinear's own parameters: kept in lora.dtype


def cast_like_float16_module(model, dtype: torch.dtype) -> int:
    """Every fp32 parameter but the LoRA adapters' to ``dtype``, in place (the same Parameter
    objects), as Megatron's ``Float16Module`` casts the whole model (``module.bfloat16()``,
    transformer/module.py) before its optimizer sees it. The local spec's norms are built in
    fp32 whatever ``params_dtype`` says; left so, ``Float16OptimizerWithFloat16Params`` trains
    them as "fp32_from_fp32" parameters but its ``sharded_state_dict`` maps only its 16-bit
    groups (optimizer.py) and the first checkpoint save fails ("Param id N does not match any
    model sharded param"). Returns how many parameters were cast."""
    n = 0
    for name, p in model.named_parameters():
        if p.dtype == torch.float32 and name.rsplit(".", 1)[-1] not in ADAPTER_PARAMS:
            p.data = p.data.to(dtype)
            n += 1
    return n


def megatron_ddp_and_optimizer(model, tcfg, train_cfg: TrainingConfig, parallel=None):
    """Megatron DDP around ``model``, ``get_megatron_optimizer`` (wrapped in the sync-free step
    per ``training.optimizer_step``), and the model-config hooks Megatron's training loop wires
    in for its schedules. ``parallel`` (a resolved ``ParallelConfig``; None: all off): the
    distributed optimizer, overlapped gradient reduce / parameter gather and bucket size."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if tcfg.bf16:
        cast_like_float16_module(model, torch.bfloat16)
    dist_opt = bool(parallel is not None and parallel.distributed_optimizer)
    ddp = DistributedDataParallel(
        config=tcfg,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt,
            overlap_grad_reduce=bool(parallel is not None and parallel.overlap_grad_reduce),
            overlap_param_gather=bool(parallel is not None and parallel.overlap_param_gather),
            bucket_size=parallel.bucket_size if parallel is not None else None),
        module=model,
    )
    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=train_cfg.lr, min_lr=train_cfg.min_lr,
        weight_decay=train_cfg.weight_decay, adam_beta1=0.9, adam_beta2=0.95,
        clip_grad=train_cfg.clip_grad, bf16=train_cfg.dtype == "bfloat16",
        use_distributed_optimizer=dist_opt,
    )
    optimizer = _optimizer_step(get_megatron_optimizer(opt_cfg, [ddp]), train_cfg.optimizer_step)
    tcfg.grad_scale_func = optimizer.scale_loss
    tcfg.no_sync_func = ddp.no_sync
    tcfg.finalize_model_grads_func = finalize_model_grads
    return ddp, optimizer


@contextlib.contextmanager
def gathered_params(ddp):
    """The model's parameters gathered and current for the block, as Megatron's training loop
    does around evaluation and checkpoint saves with ``overlap_param_gather`` (Megatron-LM
    core_v0.16.1 megatron/training/training.py:2918-2919 and :2959-2960 around evaluation,
    :2192-2193 before a save, :3006-3007 at the end): DDP's forward pre-hooks, which would
    all-gather each bucket during the next forward, are removed and the all-gather finished
    (``disable_forward_pre_hook(param_sync=True)``), then put back. Without the overlap (no
    hooks) the parameters are gathered by the optimizer step itself: nothing to do."""
    if ddp is None or not getattr(ddp, "use_forward_hook", False):
        yield
        return
    ddp.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        ddp.enable_forward_pre_hook()


def _optimizer_step(optimizer, mode: str):
    """Megatron's optimizer, wrapped for the sync-free step unless ``mode`` is "megatron" (or
    "auto" and the wrapper does not support Megatron's choice of Adam)."""
    from megatron_fastpath.optim import SyncFreeOptimizer

    if mode == "megatron":
        return optimizer
    try:
        return SyncFreeOptimizer(optimizer)
    except (TypeError, ImportError):  # unsupported optimizer class / unchecked megatron-core
        if mode == "sync_free":
            raise
        return optimizer


def gpu_train_step(model, tcfg, train_cfg: TrainingConfig, cache, parallel=None,
                   linear_cross_entropy: bool = False) -> StepParts:
    """Megatron's schedule (PP 1F1B included), DDP, gradient finalisation and optimizer. Each
    microbatch holds a cache slot from its forward until its backward has run on this stage
    (:class:`~megatron_fastpath.packed_seq.inflight.InFlightBatches`); ``linear_cross_entropy``:
    the last stage's loss chunked (:func:`~megatron_fastpath.packed_seq.runtime.forward`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_fastpath.packed_seq.inflight import InFlightBatches
    from megatron_fastpath.packed_seq.staging import PinnedStaging

    ddp, optimizer = megatron_ddp_and_optimizer(model, tcfg, train_cfg, parallel)
    schedule = get_forward_backward_func()
    device = cache.device
    # Megatron's DDP averages gradients over DP x CP (its dp_cp group)
    dp_world = ps.get_data_parallel_world_size(with_context_parallel=True)
    # ... and its schedule multiplies a (loss, dict) loss by the CP size (megatron-core 0.16.1
    # pipeline_parallel/schedules.py forward_step: ``output_tensor *= cp_group_size``)
    cp_world = ps.get_context_parallel_world_size()
    last = {}
    in_flight = InFlightBatches(cache)
    # one staging buffer per microbatch a stage can hold, plus one being filled
    staging = PinnedStaging(cache.config.max_tokens, device, num_buffers=len(cache.slots) + 1)

    def run_schedule(mbs, global_loss_tokens: int, loss_sum: torch.Tensor) -> None:
        """Megatron's schedule over ``mbs``: forward, backward, gradient finalisation (and, on
        a run's first schedule with per-layer graphs, their capture at its end,
        schedules.py:698); the last stage's loss is added to ``loss_sum``."""
        n = len(mbs)

        def forward_step(data_iterator, module):
            mb = next(data_iterator)
            pb = in_flight.acquire(mb.lengths)
            # First stage reads tokens, last stage labels; middle stages get hidden states.
            tokens_1T, labels_1T, mask_1T = (  # pinned: no stream sync; then this CP rank's share
                cp_local(pb, x) for x in staging.to_device(mb))
            output = in_flight.mark(forward(module, pb, tokens_1T, labels_1T,
                                            linear_cross_entropy=linear_cross_entropy), pb)

            def loss_func(per_token_1T):  # last pipeline stage only
                loss = masked_loss_sum(per_token_1T, mask_1T)
                loss_sum.add_(loss.detach())
                # The schedule multiplies by the CP size and divides by the microbatch count, and
                # DDP averages over DP x CP: undo all three so gradients are those of the global
                # token-normalised loss (each CP rank's loss is its own tokens' share).
                return loss * (n * dp_world / (cp_world * global_loss_tokens)), {}

            return output, loss_func

        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        in_flight.reset_stats()
        schedule(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[ddp],
            num_microbatches=n, seq_length=cache.config.max_tokens,
            micro_batch_size=1, forward_only=False,
        )
        in_flight.release_all()

    def forward_backward(mbs, global_loss_tokens: int, check_syncs: bool = True):
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        with sync_check(check_syncs, "fwd+bwd") as fwd_bwd:
            run_schedule(mbs, global_loss_tokens, loss_sum)
        _, last["grad_norm"], _ = optimizer.step()  # (update ok, grad norm, zeros in grad)
        if ps.get_pipeline_model_parallel_world_size() > 1:  # the loss lives on the last stage
            torch.distributed.all_reduce(loss_sum, group=ps.get_pipeline_model_parallel_group())
        if dp_world > 1:
            torch.distributed.all_reduce(
                loss_sum, group=ps.get_data_parallel_group(with_context_parallel=True))
        return loss_sum, fwd_bwd

    def record_graphs(mbs, global_loss_tokens: int) -> None:
        """The schedule without the optimizer step, its gradients dropped: the per-layer graphs
        are recorded and captured (graphs/resume.py undoes the rest of what it touched)."""
        run_schedule(mbs, global_loss_tokens, torch.zeros((), dtype=torch.float32, device=device))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()

    return StepParts(forward_backward, optimizer, build_scheduler(optimizer, train_cfg),
                     grad_norm=lambda: last.get("grad_norm"), in_flight=in_flight, staging=staging,
                     record_graphs=record_graphs, params_current=lambda: gathered_params(ddp))
