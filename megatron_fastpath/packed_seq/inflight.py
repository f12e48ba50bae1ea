"""Cache slots of the microbatches a Megatron pipeline schedule has in flight.

Megatron's 1F1B schedule (``forward_backward_pipelining_without_interleaving``) on pipeline rank
r of P runs ``min(n, P - r - 1)`` warm-up forwards, then alternates one forward and one backward:
at most ``P - r`` microbatches are between their forward and the end of their backward on that
stage (one, without pipelining). :class:`InFlightBatches` holds each microbatch's cache slot from
its forward until its backward has run, and releases it at the next forward, so a cache of
:func:`slots_for_1f1b` slots never runs out; the backward of each microbatch checks that its slot
still holds *its* batch (a slot overwritten before its backward raises instead of training on
another microbatch's metadata).

"Its backward has run" is observed, not assumed: a ``call_in_backward`` marker on the stage's
output fires when the schedule starts that microbatch's backward; the schedule's backward call
returns before it asks for the next forward, so by then the backward has been issued (and on a
GPU the next slot fill is ordered after it on the stream).
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from megatron_fastpath._autograd import call_in_backward

__all__ = ["InFlightBatches", "slots_for_1f1b"]


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
    """Acquire a slot per forward (``acquire``), mark the stage output (``mark``), release the
    rest at the end of the step (``release_all``). ``max_in_flight`` is the most slots held at
    once this step; ``backward_checks`` counts the slot checks that passed."""

    def __init__(self, cache):
        self.cache = cache
        self.pending: collections.deque[_Entry] = collections.deque()
        self.max_in_flight = 0
        self.backward_checks = 0

    def acquire(self, lengths):
        while self.pending and self.pending[0].backward_started:
            self.cache.release(self.pending.popleft().batch)
        batch = self.cache.set_batch(lengths)  # raises when every slot is still in flight
        self.pending.append(_Entry(batch))
        self.max_in_flight = max(self.max_in_flight, len(self.pending))
        return batch

    def mark(self, output: torch.Tensor, batch) -> torch.Tensor:
        """``output`` (a view) whose backward checks ``batch``'s slot and marks it finished."""
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
