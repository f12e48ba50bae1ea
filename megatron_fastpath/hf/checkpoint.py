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


# The safetensors format caps the JSON header at 100 MB (MAX_HEADER_SIZE, safetensors'
# lib.rs); a larger declared length is refused before anything is read (a sparse file could
# otherwise declare gigabytes).
MAX_HEADER_BYTES = 100_000_000

# Bytes per element of the safetensors dtypes (safetensors' Dtype); the sub-byte float types
# (F4, F6_*) are left to the library.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2,
               "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
               "F64": 8, "C64": 8}


def _read_header(path: str) -> dict:
    """The JSON header of a safetensors file, checked entry by entry, after checking the file
    holds all its data. Every problem raises CheckpointError naming the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: not a safetensors file (declares a header of {n} bytes; "
                                  f"the format allows {MAX_HEADER_BYTES})")
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated safetensors file (header of {n} bytes, file "
                                  f"{size} bytes); re-download it")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
            raise CheckpointError(f"{path}: not a safetensors file (bad header: {type(exc).__name__}: "
                                  f"{str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is a "
                              f"{type(header).__name__}, not an object)")
    header.pop("__metadata__", None)
    for key, meta in header.items():
        _check_entry(path, key, meta)
    _check_layout(path, header)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: {size} bytes but its header declares "
            f"{8 + n + end}; re-download it")
    return header


def _check_entry(path: str, key: str, meta) -> None:
    def bad(why: str):
        return CheckpointError(f"{path}: tensor {key[:200]!r} has {why}: not a valid safetensors file")

    if not isinstance(meta, dict):
        raise bad(f"a header entry of type {type(meta).__name__}")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"no dtype string ({dtype!r:.60})")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise bad(f"shape {shape!r:.60} (a list of non-negative integers is required)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {offsets!r:.60} (two integers 0 <= begin <= end are required)")


def _check_layout(path: str, header: dict) -> None:
    """Each tensor's bytes match its dtype and shape, and the tensors tile the data one after
    the other (what safetensors requires; overlapping ranges would alias two tensors)."""
    for key, meta in header.items():
        size = DTYPE_BYTES.get(meta["dtype"])
        begin, end = meta["data_offsets"]
        if size is not None:
            want = size
            for d in meta["shape"]:
                want *= d
            if end - begin != want:
                raise CheckpointError(
                    f"{path}: tensor {key[:200]!r} is {meta['dtype']} {meta['shape']} ({want} bytes) "
                    f"but its data_offsets [{begin}, {end}] hold {end - begin} bytes: not a valid "
                    "safetensors file")
    at, prev = 0, None
    for key, meta in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, end = meta["data_offsets"]
        if begin != at:
            what = (f"overlapping tensor {prev[:200]!r} (which ends at {at})" if begin < at
                    else f"leaving a gap after byte {at}")
            raise CheckpointError(f"{path}: tensor {key[:200]!r} has data_offsets [{begin}, {end}], "
                                  f"{what}: not a valid safetensors file")
        at, prev = end, key


def _inside(root: str, name: str) -> str:
    """``root/name`` if it stays inside ``root`` (links resolved), else CheckpointError naming
    the file refused: a name of the index that leaves the directory, or a link that does."""
    real_root = os.path.realpath(root)
    named = os.path.join(real_root, name)  # the name alone ('..', an absolute path), no links
    if os.path.commonpath([os.path.normpath(named), real_root]) != real_root:
        raise CheckpointError(f"{root}: model.safetensors.index.json names {name!r}, which is "
                              "outside the checkpoint directory: refusing to open it")
    full = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([full, real_root]) != real_root:
        raise CheckpointError(f"{os.path.join(root, name)} is a link to {full}, which is outside the "
                              "checkpoint directory: refusing to open it")
    return os.path.join(root, name)


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
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f).get("weight_map")
            except (ValueError, RecursionError, AttributeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({type(exc).__name__})") from None
            if not weight_map or not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map' object")
            if not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: 'weight_map' values must be file names")
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
            fpath = _inside(path, name)
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

            self._handles[fpath] = self._read(fpath, lambda: safe_open(fpath, framework="pt"))
        return self._handles[fpath]

    @staticmethod
    def _read(fpath: str, fn):
        """``fn()``, with the safetensors library's errors (what the header checks do not cover)
        as CheckpointError naming the file."""
        from safetensors import SafetensorError

        try:
            return fn()
        except SafetensorError as exc:
            raise CheckpointError(f"{fpath}: not a valid safetensors file ({str(exc)[:200]}); "
                                  "re-download it") from None

    def get(self, name: str, rows: Optional[tuple] = None, cols: Optional[tuple] = None) -> torch.Tensor:
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: tensor '{name}' not found in the checkpoint")
        fpath = self.entries[name][0]
        r = slice(*rows) if rows is not None else slice(None)

        def read():
            sl = self._handle(fpath).get_slice(name)
            return sl[r] if cols is None else sl[r, slice(*cols)]

        return self._read(fpath, read)

    def close(self) -> None:
        self._handles.clear()
