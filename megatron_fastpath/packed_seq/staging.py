"""A packed microbatch's token ids, labels and loss mask to the device through pinned staging.

A host->device copy from pageable memory is not asynchronous: "for transfers from pageable host
memory to device memory, a stream sync is performed before the copy is initiated" (CUDA Runtime
API, *API synchronization behavior*). Copying the main job's bins straight from the dataset
(``mb.tokens_1T.to(device, non_blocking=True)``) is therefore a host wait for the GPU to drain
the stream, three times per microbatch, in every step -- a wait ``SyncSentinel`` does not see
(no value is read). Pinning the whole dataset instead would hold it all in page-locked RAM.

:class:`PinnedStaging` keeps a ring of pinned host buffers: each microbatch is copied on the
host into the next buffer (a memcpy) and from there to the device in one non-blocking copy per
buffer (ids, mask); an event recorded after the copies marks when the buffer may be refilled,
and it is waited on only if that copy has not finished (the packed cache stages its metadata
the same way). On a CPU device nothing is copied: the bins are already where the model runs.

Shape key: T = tokens of a packed microbatch.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["PinnedStaging", "StagingStats"]


@dataclasses.dataclass
class StagingStats:
    """copies: microbatches staged; bytes: host->device bytes; waits: refills that had to wait
    for a buffer's previous copy (0 when the ring is deep enough)."""

    copies: int = 0
    bytes: int = 0
    waits: int = 0


class PinnedStaging:
    """Ring of ``num_buffers`` pinned staging buffers for microbatches of ``max_tokens`` tokens."""

    def __init__(self, max_tokens: int, device, num_buffers: int = 2):
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1; got {num_buffers}")
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.stats = StagingStats()
        self._next = 0
        n = num_buffers if self.device.type == "cuda" else 0
        self.ids_2T = [torch.empty((2, max_tokens), dtype=torch.int64, pin_memory=True) for _ in range(n)]
        self.mask_T = [torch.empty((max_tokens,), dtype=torch.float32, pin_memory=True) for _ in range(n)]
        self._done = [None] * n

    def to_device(self, mb) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens_1T, labels_1T, loss_mask_1T) of ``mb`` on the device: new device tensors,
        never views of the staging buffers (which the next microbatches refill)."""
        if self.device.type != "cuda":
            return mb.tokens_1T, mb.labels_1T, mb.loss_mask_1T
        k = self._next
        self._next = (k + 1) % len(self.ids_2T)
        done = self._done[k]
        if done is not None and not done.query():
            done.synchronize()  # an event wait on this buffer's own copy, not a device drain
            self.stats.waits += 1
        ids_2T, mask_T = self.ids_2T[k], self.mask_T[k]
        ids_2T[0].copy_(mb.tokens_1T[0])
        ids_2T[1].copy_(mb.labels_1T[0])
        mask_T.copy_(mb.loss_mask_1T[0])
        dev_ids_2T = ids_2T.to(self.device, non_blocking=True, copy=True)
        dev_mask_T = mask_T.to(self.device, non_blocking=True, copy=True)
        event = torch.cuda.Event()
        event.record()
        self._done[k] = event
        self.stats.copies += 1
        self.stats.bytes += ids_2T.numel() * ids_2T.element_size() + mask_T.numel() * mask_T.element_size()
        return dev_ids_2T[0:1], dev_ids_2T[1:2], dev_mask_T.view(1, -1)
