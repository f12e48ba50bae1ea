"""Cache slots of the packed microbatches a Megatron schedule has in flight: one class, used by
the main job and by the NeMo / Megatron-Bridge hooks, with two release policies.

Megatron's 1F1B schedule (``forward_backward_pipelining_without_interleaving``) on pipeline rank
r of P runs ``min(n, P - r - 1)`` warm-up forwards, then alternates one forward and one backward:
at most ``P - r`` microbatches are between their forward and the end of their backward on that
stage (one, without pipelining). So a cache of :func:`slots_for_1f1b` slots never runs out when
a slot is held from its microbatch's forward until its backward has run.

``release="backward"`` (the main job) observes "its backward has run": :meth:`mark` puts a
``call_in_backward`` marker on the stage's output, which fires when the schedule starts that
microbatch's backward; the schedule's backward call returns before it asks for the next
forward, so by then the backward has been issued (and on a GPU the next slot fill is ordered
after it on the stream). The marker also checks that the slot still holds *its* batch (a slot
overwritten before its backward raises instead of training on another microbatch's metadata).

``release="call_order"`` (the hooks, whose forward step hands its output to the framework's
loss function and schedule) releases the oldest batch when every slot is held: exactly right
for Megatron's no-pipelining and non-interleaved 1F1B schedules with ``num_slots`` = pipeline
size, where microbatch m's forward starts after microbatch m - P's backward finished
(interleaved schedules reorder backwards and are refused by the hooks' rules).

``release="step"`` (the main job's full-iteration CUDA graph, ``train/full_iteration.py``):
microbatch i of a step is loaded into slot i -- the captured graph reads fixed slots -- with its
record copied or not (``copy_record``: without it the graph builds the record from the lengths)
and nothing derived (the graph builds it: ``PackedSeqCache.build_slot``); every slot is held
until :meth:`release_all` at the end of the step.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Literal

import torch

from megatron_fastpath._autograd import call_in_backward

__all__ = ["InFlightBatches", "ReleasePolicy", "slots_for_1f1b"]

ReleasePolicy = Literal["backward", "call_order", "step"]
RELEASE_POLICIES: tuple[str, ...] = ("backward", "call_order", "step")


def slots_for_1f1b(num_microbatches: int, pipeline_size: int, pipeline_rank: int) -> int:
    """Cache slots a non-interleaved 1F1B schedule needs on ``pipeline_rank``."""
    if pipeline_size <= 1:
        return 1
    return max(1, min(num_microbatches, pipeline_size - pipeline_rank))


@dataclasses.dataclass
class _Entry:
    batch: object
    backward_started: bool = False


class InFlightBatches:
    """Acquire a slot per forward (:meth:`acquire`), release per ``release`` policy, release the
    rest at the end of a step (:meth:`release_all`). ``max_in_flight`` is the most slots held
    at once since :meth:`reset_stats`; ``backward_checks`` counts the slot checks that passed
    (``release="backward"`` only)."""

    def __init__(self, cache, release: ReleasePolicy = "backward"):
        if release not in RELEASE_POLICIES:
            raise ValueError(f"release must be one of {RELEASE_POLICIES}; got {release!r}")
        self.cache = cache
        self.release = release
        self.pending: collections.deque[_Entry] = collections.deque()
        self.max_in_flight = 0
        self.backward_checks = 0

    def acquire(self, lengths=None, *, cu_seqlens=None, copy_record: bool = True, adapters=None):
        """Load the next packed microbatch (host ``lengths`` or ``cu_seqlens``, and each
        sequence's ``adapters`` with a cache of adapters, see ``PackedSeqCache.set_batch``) into
        a free slot and hold it (``copy_record``: the ``"step"`` policy's, see the module
        docstring)."""
        if self.release == "step":
            batch = self.cache.load_slot(len(self.pending), lengths, cu_seqlens=cu_seqlens,
                                         copy_record=copy_record, adapters=adapters)
            self.pending.append(_Entry(batch))
            self.max_in_flight = max(self.max_in_flight, len(self.pending))
            return batch
        if self.release == "call_order":
            if len(self.pending) >= len(self.cache.slots):
                self.cache.release(self.pending.popleft().batch)
        else:
            while self.pending and self.pending[0].backward_started:
                self.cache.release(self.pending.popleft().batch)
        # raises when every slot is still in flight
        batch = self.cache.set_batch(lengths, cu_seqlens=cu_seqlens, adapters=adapters)
        self.pending.append(_Entry(batch))
        self.max_in_flight = max(self.max_in_flight, len(self.pending))
        return batch

    @property
    def held(self) -> list:
        """The batches whose slots are held, oldest first."""
        return [e.batch for e in self.pending]

    def mark(self, output: torch.Tensor, batch) -> torch.Tensor:
        """``output`` (a view) whose backward checks ``batch``'s slot and marks it finished."""
        if self.release != "backward":
            raise RuntimeError("mark() is for release='backward'; call_order releases by count")
        entry = next(e for e in self.pending if e.batch is batch)

        def on_backward():
            slot = self.cache.slots[batch.slot]
            if slot.version != batch.version or not slot.busy:
                raise RuntimeError(
                    f"packed-cache slot {batch.slot} was refilled (version {slot.version}) before "
                    f"the backward of its microbatch (version {batch.version}): size the cache "
                    "with slots_for_1f1b and release slots through InFlightBatches"
                )
            self.backward_checks += 1
            entry.backward_started = True

        if not output.requires_grad:  # forward only: no backward will read the slot
            entry.backward_started = True
            return output
        return call_in_backward(output, on_backward)

    def release_all(self) -> None:
        while self.pending:
            self.cache.release(self.pending.popleft().batch)

    def reset_stats(self) -> None:
        self.max_in_flight = 0
        self.backward_checks = 0
