"""The whole training step as two CUDA graphs (``cuda_graphs.scope=full_iteration``).

Per-layer graphs leave the embedding, the loss, the optimizer and everything between layers
eager. Here the GPU step (:func:`~megatron_fastpath.train.step.gpu_train_step`'s pieces: Megatron's
schedule, DDP, ``get_megatron_optimizer`` wrapped in the sync-free step) is captured whole:

1. **forward + backward of every microbatch** through Megatron's own
   ``megatron.core.full_cuda_graph.FullCudaGraphWrapper`` around the no-pipelining schedule:
   it copies each microbatch's inputs into its ``StaticBufferLoader``'s static buffers, runs
   step 1 eagerly, captures at step 2 (with the RNG generators registered) and replays from
   then on. Inside the captured region: gradient-buffer zeroing, the packed cache's device-side
   build of each slot's boundary record from the packed lengths and of every derived tensor
   (RoPE, masks, real-token mask, padded view) from it, the model, the loss and its scaling (a device scalar), the backward and
   Megatron's gradient finalisation.
2. **the optimizer step** (:class:`~megatron_fastpath.optim.SyncFreeOptimizer`: norm, clip
   coefficient, found-inf skip, Adam) and the LR schedule advancing on the device
   (:class:`~megatron_fastpath.optim.DeviceLRSchedule`), captured by us at step 2 as a second
   graph: Megatron 0.16.1's wrapper captures ``forward_backward_func`` only.

Outside the graphs, per step: the host validates each microbatch's packing (``PackedSeqCache.
load_slot``: counts and bounds, no device read) and queues the host->device copies of the
wrapper's static buffers from pinned host buffers -- token ids / labels / loss mask / loss scale
and the packed lengths -- then two graph launches. Inside the forward graph the cache builds
each slot's boundary record from those lengths (cu_seqlens, position ids, sequence ids:
``packed_seq.device_record``) and every derived tensor from the record. With context
parallelism the record (each rank's load-balanced token share) is built on the host and copied
into the slot instead. The loss, gradient norm and
applied flag stay in static device tensors that the logger copies back one step late (its
non-blocking copies are queued before the next step's replay, so that replay cannot overwrite
them first).

Where Megatron's wrapper does not fit: it keeps its graph and buffers in class attributes (one
wrapper per process: :func:`~megatron_fastpath.compat.graphs.reset_full_cuda_graph_state` gives
every job a clean one) and has no optimizer graph. Static bounds: every step has the same
number of microbatches (``training.micro_batches``), each at most ``data.max_tokens`` tokens /
``data.max_seqs`` sequences / the cache's ``max_seqlen`` (the host checks each packing before
any copy); anything else is refused, never recaptured.

Shape key: N = microbatches per step, T = tokens of a packed microbatch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from megatron_fastpath.compat.graphs import static_inputs_wait_upstream
from megatron_fastpath.packed_seq.runtime import cp_local, forward, masked_loss_sum
from megatron_fastpath.train.config import TrainingConfig

if TYPE_CHECKING:
    from megatron_fastpath.optim import DeviceLRSchedule

__all__ = ["FullIterationStep", "full_iteration_train_step"]


@dataclasses.dataclass
class _HostInputs:
    """One set of pinned host buffers for the N microbatches of a step (two sets alternate:
    a set is refilled only after the copies out of it, two steps ago, have completed)."""

    ids_N2T: torch.Tensor  # int64: row 0 token ids, row 1 labels
    mask_NT: torch.Tensor  # float32 loss mask
    scale_N: torch.Tensor  # float32: the loss scale, one per microbatch dict
    lengths_NS: torch.Tensor  # int32: each microbatch's sequence lengths, zeros after the last
    done: Optional[object] = None  # CUDA event after the copies out of this set


class FullIterationStep:
    """The GPU step captured whole; ``forward_backward`` has :class:`StepParts`' signature.

    ``launches``: graph launches of the last step (0 while eager, 2 after capture);
    ``eager_steps``: steps before capture (1)."""

    eager_steps = 1

    def __init__(self, model, tcfg, train_cfg: TrainingConfig, cache, parallel=None,
                 linear_cross_entropy: bool = False):
        from megatron.core import parallel_state as ps
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_fastpath.compat.graphs import reset_full_cuda_graph_state
        from megatron_fastpath.packed_seq.inflight import InFlightBatches
        from megatron_fastpath.optim import SyncFreeOptimizer
        from megatron_fastpath.train.step import build_scheduler, megatron_ddp_and_optimizer

        n, slots = train_cfg.micro_batches, len(cache.slots)
        if slots != n:
            raise ValueError(
                f"a full-iteration graph holds every microbatch of a step in its own cache slot: "
                f"the cache has {slots} slots for training.micro_batches={n}; build it with "
                "num_slots=training.micro_batches")
        if ps.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("cuda_graphs.scope=full_iteration runs without pipeline parallelism")
        self.cache, self.n, self.device = cache, n, cache.device
        self.linear_cross_entropy = linear_cross_entropy  # the chunked loss in the captured forward
        # as gpu_train_step: Megatron's DDP averages gradients over DP x CP and its schedule
        # multiplies the loss by the CP size; the loss is summed over DP x CP for the log
        self.dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.dp_world = ps.get_data_parallel_world_size(with_context_parallel=True)
        self.cp_world = ps.get_context_parallel_world_size()
        self.ddp, self.optimizer = megatron_ddp_and_optimizer(model, tcfg, train_cfg, parallel)
        if not isinstance(self.optimizer, SyncFreeOptimizer):
            raise ValueError(
                "cuda_graphs.scope=full_iteration needs the sync-free optimizer step "
                "(training.optimizer_step=auto or sync_free): Megatron's own step reads the "
                "gradient norm back to the host, which a captured graph cannot")
        self.scheduler = build_scheduler(self.optimizer, train_cfg)
        # the device schedule is built at the first step, from the scheduler and param groups
        # as a checkpoint load left them (torch's load_state_dict replaces the group dicts)
        self.lr: Optional[DeviceLRSchedule] = None
        reset_full_cuda_graph_state()
        schedule = get_forward_backward_func()

        def forward_backward_func(**kwargs):  # what the wrapper runs, then captures
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            self.loss_sum_0.zero_()
            out = schedule(**kwargs)
            if self.dp_world > 1:
                torch.distributed.all_reduce(self.loss_sum_0, group=self.dp_group)
            return out

        self.wrapper = FullCudaGraphWrapper(forward_backward_func, cuda_graph_warmup_steps=self.eager_steps)
        self.loss_sum_0 = torch.zeros((), dtype=torch.float32, device=self.device)
        t = cache.config.max_tokens
        pin = self.device.type == "cuda"
        self.host = [_HostInputs(torch.zeros((n, 2, t), dtype=torch.int64, pin_memory=pin),
                                 torch.zeros((n, t), dtype=torch.float32, pin_memory=pin),
                                 torch.zeros((n,), dtype=torch.float32, pin_memory=pin),
                                 torch.zeros((n, cache.config.max_seqs), dtype=torch.int32,
                                             pin_memory=pin))
                     for _ in range(2)]
        # without CP the graph builds each slot's boundary record from the lengths too; the CP
        # layout (each rank's token share) is built on the host and its record copied
        self.lengths_in_graph = self.cp_world == 1
        self.in_flight = InFlightBatches(cache, release="step")
        self.opt_graph = None
        self.calls = 0
        self.launches = 0
        self._graph_builds = None  # the cache builds the forward graph re-runs at each replay
        self.last_grad_norm = None

    # ------------------------------------------------------------------ per step
    def forward_backward(self, mbs, global_loss_tokens: int, check_syncs: bool = True):
        from megatron_fastpath.optim import DeviceLRSchedule
        from megatron_fastpath.train.step import sync_check

        if len(mbs) != self.n:
            raise ValueError(
                f"a full-iteration graph is captured for {self.n} microbatches per step; this "
                f"step has {len(mbs)} (data whose shape bound changes is refused, not recaptured)")
        inputs = self._stage(mbs, global_loss_tokens)
        if self.calls == 0:  # after any checkpoint load, before the first update
            self.lr = DeviceLRSchedule.from_scheduler(self.scheduler, self.device)
            self.optimizer.use_device_lr(self.lr)
        before = self.cache.stats.snapshot()
        if not static_inputs_wait_upstream():  # 0.16.x: the loader's copies would not wait
            self.wrapper.static_loader.stream.wait_stream(torch.cuda.current_stream())
        with sync_check(check_syncs, "fwd+bwd") as fwd_bwd:
            self.wrapper(forward_step_func=self._forward_step, data_iterator=iter(inputs),
                         model=[self.ddp], num_microbatches=self.n,
                         seq_length=self.cache.config.max_tokens, micro_batch_size=1,
                         forward_only=False)
        built = self.cache.stats.since(before)
        replayed = self.calls >= self.eager_steps
        if self.calls == self.eager_steps:
            self._graph_builds = built  # the capture's builds: each replay re-runs them
        elif replayed:
            self.cache.stats.add(self._graph_builds)
        self._optimizer_step()
        self.in_flight.release_all()
        event = self.host[self.calls % 2]
        if self.device.type == "cuda":
            event.done = torch.cuda.Event()
            event.done.record()
        self.launches = 2 if replayed else 0
        self.calls += 1
        return self.loss_sum_0, fwd_bwd

    def grad_norm(self):
        return self.last_grad_norm

    def _stage(self, mbs, global_loss_tokens: int):
        """Host side: each microbatch's record into its slot (validated first) and its ids,
        mask and loss scale into this step's pinned host set; the wrapper's static loader
        copies the set to the device."""
        host = self.host[self.calls % 2]
        if host.done is not None and not host.done.query():
            host.done.synchronize()  # the copies out of this set, two steps ago (an event wait)
        self.in_flight.reset_stats()  # validated on the host, before any copy; slot i <- mb i
        handles = [self.in_flight.acquire(mb.lengths, copy_record=not self.lengths_in_graph)
                   for mb in mbs]
        # undo the schedule's / N and x CP and DDP's average over DP x CP (as gpu_train_step):
        # gradients of the global token-normalised loss
        host.scale_N.fill_(self.n * self.dp_world / (self.cp_world * global_loss_tokens))
        inputs = []
        for i, mb in enumerate(mbs):
            host.ids_N2T[i, 0].copy_(mb.tokens_1T[0])
            host.ids_N2T[i, 1].copy_(mb.labels_1T[0])
            host.mask_NT[i].copy_(mb.loss_mask_1T[0])
            item = {"ids_2T": host.ids_N2T[i], "mask_T": host.mask_NT[i],
                    "scale_0": host.scale_N[i], "slot": i}
            if self.lengths_in_graph:
                lengths_N = handles[i].lengths_N
                host.lengths_NS[i].zero_()[: len(lengths_N)].copy_(torch.from_numpy(lengths_N))
                item["lengths_S"] = host.lengths_NS[i]
            inputs.append(item)
        return inputs

    def _forward_step(self, data_iterator, module):
        """Megatron's ``forward_step_func`` over the wrapper's static buffers of one microbatch."""
        mb = next(data_iterator)
        # the slot's record (from the lengths, without CP) and derived tensors, in the graph
        pb = self.cache.build_slot(mb["slot"], mb.get("lengths_S"))
        ids_2T, scale_0 = mb["ids_2T"], mb["scale_0"]
        tokens_1T, labels_1T, mask_1T = (  # this CP rank's share (the inputs themselves at CP 1)
            cp_local(pb, x) for x in (ids_2T[0:1], ids_2T[1:2], mb["mask_T"].view(1, -1)))
        output = forward(module, pb, tokens_1T, labels_1T, linear_cross_entropy=self.linear_cross_entropy)

        def loss_func(per_token_1T):
            loss = masked_loss_sum(per_token_1T, mask_1T)
            self.loss_sum_0.add_(loss.detach())
            return loss * scale_0, {}

        return output, loss_func

    def _optimizer_step(self) -> None:
        """Eager at step 1; captured at step 2 and replayed (a capture runs nothing on a GPU);
        replayed from then on."""
        if self.calls < self.eager_steps:
            self._optimizer_body()
            return
        if self.opt_graph is None:
            torch.cuda.synchronize()
            self.opt_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.opt_graph, stream=torch.cuda.Stream(),
                                  capture_error_mode="thread_local"):
                self._optimizer_body()
            torch.cuda.synchronize()
        self.opt_graph.replay()

    def _optimizer_body(self) -> None:
        _, grad_norm_1, _ = self.optimizer.step()  # lr from the device schedule
        self.lr.step()  # OptimizerParamScheduler.step(1), on the device
        self.last_grad_norm = grad_norm_1


def full_iteration_train_step(model, tcfg, train_cfg: TrainingConfig, cache, parallel=None,
                              linear_cross_entropy: bool = False):
    """:class:`~megatron_fastpath.train.step.StepParts` of the full-iteration GPU step
    (``parallel``: the distributed optimizer or not; its overlaps are refused with full-iteration
    graphs, ``rules._data_parallel_in_full_iteration``; ``linear_cross_entropy``: the chunked loss)."""
    from megatron_fastpath.train.step import StepParts

    step = FullIterationStep(model, tcfg, train_cfg, cache, parallel, linear_cross_entropy)
    return StepParts(step.forward_backward, step.optimizer, step.scheduler,
                     grad_norm=step.grad_norm, in_flight=step.in_flight, graphs=step)
