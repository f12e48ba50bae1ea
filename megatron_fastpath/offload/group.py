"""What one layer's forward hands the offload manager: an :class:`OffloadGroup` of tensors laid
out in one flat byte slot, and the handles ``pack`` returns for ``unpack``.

Shape key: N = bytes. A group's host slot and the device reload buffer it comes back into are
flat uint8 tensors (``flat_N``); each tensor of the group is a view of ``flat_N`` at its
:class:`GroupItem` offset (:meth:`GroupItem.view`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

__all__ = ["GroupItem", "OffloadGroup", "Packed", "PackedQuantized"]


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass
class GroupItem:
    """One tensor of a group: where it lives in the group's flat host slot / device buffer."""

    shape: torch.Size
    dtype: torch.dtype
    offset: int
    nbytes: int
    device_tensor: Optional[torch.Tensor]  # until offloaded (or forever when kept)

    def view(self, flat_N: torch.Tensor) -> torch.Tensor:
        """This tensor inside a group's flat slot or buffer (same shape and dtype, no copy)."""
        return flat_N[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclasses.dataclass(frozen=True)
class PackedQuantized:
    """A packed TE quantized tensor: rebuild ``obj`` from its components on unpack."""

    obj: Any
    parts: tuple  # per component: Packed | torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class Packed:
    """What ``pack`` returns for a tensor the group holds: item ``index`` of ``group``."""

    group: "OffloadGroup"
    index: int


class OffloadGroup:
    """The tensors of one layer's forward, offloaded (or kept) and reloaded together."""

    def __init__(self, key: str, index: int, seq: int, stays_on_device: bool):
        self.key = key
        self.index = index  # the layer's position in forward (registration) order
        self.seq = seq
        self.stays_on_device = stays_on_device  # the last layer, or past max_offloaded_layers
        self.items: list[GroupItem] = []
        self.nbytes = 0
        self._dedup: dict[tuple, int] = {}
        self.closed = False
        self.offloaded = False
        self.host: Optional[torch.Tensor] = None  # the host slot (flat_N) it is offloaded into
        self.buffer: int = -1
        self.reload_event: Any = None
        self.offload_event: Any = None  # recorded on the offload stream after the group's d2h
        self.bwd_started = False

    def add(self, t: torch.Tensor, alignment_bytes: int) -> int:
        """Lay ``t`` out after the group's other tensors (each at an ``alignment_bytes``
        boundary); returns its item index. The same tensor saved twice is laid out once."""
        dkey = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        index = self._dedup.get(dkey)
        if index is None:
            nbytes = t.numel() * t.element_size()
            offset = _align(self.nbytes, alignment_bytes) if self.items else 0
            self.items.append(GroupItem(t.shape, t.dtype, offset, nbytes, t))
            self.nbytes = offset + nbytes
            index = len(self.items) - 1
            self._dedup[dkey] = index
        return index

    def close(self) -> None:
        """No more tensors: the forward of this layer has finished."""
        self.closed = True
        self._dedup.clear()

    def __repr__(self) -> str:
        return (f"OffloadGroup({self.key}, items={len(self.items)}, nbytes={self.nbytes}, "
                f"offloaded={self.offloaded}, buffer={self.buffer})")
