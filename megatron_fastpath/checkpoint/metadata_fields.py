"""What a safely unpickled torch_dist ``.metadata`` must hold before torch.distributed.checkpoint
reads by it (:func:`megatron_fastpath.checkpoint.safety.check_safe_to_load` calls both checks).

The unpickler allows only checkpoint-metadata classes, but not where each goes: a
``storage_meta`` that is a string, or a ``storage_data`` entry that is not a ``_StorageInfo``,
unpickles fine and then fails inside torch with a raw ``AttributeError``. And a ``.distcp``
replaced by other bytes (a pickle, zeros) fails inside ``torch.load`` with a multi-line
traceback. :func:`check_fields` checks each field's type; :func:`check_tensor_data` checks that
each tensor's byte range lies in its file and starts as ``torch.save`` writes (a zip archive);
both raise one line naming the file and what is wrong.
"""

from __future__ import annotations

import os

__all__ = ["check_fields", "check_tensor_data"]

# torch.save's zip archive (the format torch.distributed.checkpoint writes each tensor in)
ZIP_MAGIC = b"PK\x03\x04"


def _error(path: str, what: str):
    from megatron_fastpath.checkpoint.errors import UnsafeCheckpointError

    return UnsafeCheckpointError(f"{path} {what}: damaged or not written by torch.distributed."
                                 "checkpoint; refusing to load it")


def _type(x) -> str:
    return type(x).__qualname__


def check_fields(path: str, meta) -> None:
    """Each field of ``meta`` (a ``Metadata``, read from ``path``) of the type torch reads it as."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta

    if not isinstance(meta.state_dict_metadata, dict):
        raise _error(path, f"has a state_dict_metadata of type {_type(meta.state_dict_metadata)}, not a dict")
    if not isinstance(meta.storage_data, dict):
        raise _error(path, f"has a storage_data of type {_type(meta.storage_data)}, not a dict")
    if meta.storage_meta is not None and not isinstance(meta.storage_meta, StorageMeta):
        raise _error(path, f"has a storage_meta of type {_type(meta.storage_meta)}, not a StorageMeta")
    for key, info in meta.storage_data.items():
        if not isinstance(key, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise _error(path, f"has a storage_data entry {_type(key)} -> {_type(info)}, not "
                               "MetadataIndex -> _StorageInfo")
        if not (isinstance(info.relative_path, str) and type(info.offset) is int
                and type(info.length) is int and info.offset >= 0 and info.length >= 0):
            raise _error(path, f"has a storage_data entry for {str(key.fqn)[:200]!r} with relative_path "
                               f"{_type(info.relative_path)}, offset {info.offset!r:.40}, length "
                               f"{info.length!r:.40} (a name and two non-negative integers are required)")


def check_tensor_data(model_dir: str, meta) -> None:
    """Each tensor's bytes (``storage_data``: file, offset, length) inside its file and starting
    as a ``torch.save`` archive. Entries with storage transforms (compression), and files that
    are missing, not regular or outside ``model_dir`` are left to the reader and to the
    checks that own them."""
    real = os.path.realpath(model_dir)
    by_file: dict = {}
    for key, info in meta.storage_data.items():
        if getattr(info, "transform_descriptors", None):
            continue
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, key.fqn))
    for rel, items in sorted(by_file.items()):
        path = os.path.join(model_dir, rel)
        full = os.path.realpath(path)
        if os.path.commonpath([full, real]) != real or not os.path.isfile(full):
            continue
        size = os.path.getsize(full)
        with open(full, "rb") as f:
            for offset, length, fqn in sorted(items):
                if offset + length > size:
                    raise _error(path, f"is {size} bytes but holds tensor {str(fqn)[:200]!r} at bytes "
                                       f"[{offset}, {offset + length}) (truncated)")
                f.seek(offset)
                head = f.read(len(ZIP_MAGIC))
                if head != ZIP_MAGIC:
                    kind = " (a pickle)" if head[:1] == b"\x80" else ""
                    raise _error(path, f"holds tensor {str(fqn)[:200]!r} at byte {offset} as "
                                       f"{head!r} ...{kind}, not torch.save data")
