"""Read a Hugging Face safetensors checkpoint tensor by tensor (one file or sharded).

:class:`SafetensorsCheckpoint` indexes ``model.safetensors`` or the shards listed in
``model.safetensors.index.json`` from the files' headers only, checks every file is complete
(its size covers the byte ranges its header declares: a truncated download is refused by name),
and reads one tensor -- or one slice of it (this rank's TP / EP shard) -- at a time through
``safetensors.safe_open(...).get_slice``, so no full copy of the model is held in host memory.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Optional

import torch

__all__ = ["CheckpointError", "SafetensorsCheckpoint"]

class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, or its tensors do not match config.json."""


def _read_header(path: str) -> dict:
    """The JSON header of a safetensors file, after checking the file holds all its data."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated safetensors file (header of {n} bytes, file "
                                  f"{size} bytes); re-download it")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: not a safetensors file (bad header: {exc})") from None
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: {size} bytes but its header declares "
            f"{8 + n + end}; re-download it")
    return header


class SafetensorsCheckpoint:
    """Name -> (file, shape, dtype) index of a checkpoint directory; per-tensor reads.

    get(name, rows=None, cols=None) -> tensor: the whole tensor, or the half-open row / column
    ranges ``(start, stop)`` read from disk without materialising the rest.
    """

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
            if not weight_map:
                raise CheckpointError(f"{index}: no 'weight_map'")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            files = ["model.safetensors"]
        else:
            found = sorted(p for p in os.listdir(path) if p.endswith((".bin", ".pt", ".safetensors")))
            raise CheckpointError(
                f"{path}: neither model.safetensors nor model.safetensors.index.json found "
                f"(found {found or 'no weight files'}); convert .bin checkpoints to safetensors")
        self.entries: dict[str, tuple[str, tuple, str]] = {}
        for name in files:
            fpath = os.path.join(path, name)
            if not os.path.isfile(fpath):
                raise CheckpointError(f"{fpath}: listed in model.safetensors.index.json but missing")
            for key, meta in _read_header(fpath).items():
                self.entries[key] = (fpath, tuple(meta["shape"]), meta["dtype"])
        self._handles: dict = {}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple:
        return self.entries[name][1]

    def file_of(self, name: str) -> str:
        return self.entries[name][0]

    def _handle(self, fpath: str):
        if fpath not in self._handles:
            from safetensors import safe_open

            self._handles[fpath] = safe_open(fpath, framework="pt")
        return self._handles[fpath]

    def get(self, name: str, rows: Optional[tuple] = None, cols: Optional[tuple] = None) -> torch.Tensor:
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: tensor '{name}' not found in the checkpoint")
        fpath = self.entries[name][0]
        sl = self._handle(fpath).get_slice(name)
        r = slice(*rows) if rows is not None else slice(None)
        if cols is None:
            return sl[r]
        return sl[r, slice(*cols)]

    def close(self) -> None:
        self._handles.clear()
