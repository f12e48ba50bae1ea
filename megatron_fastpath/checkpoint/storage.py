"""The files a torch_dist directory makes the loader open, confined to that directory.

torch.distributed.checkpoint reads each tensor from the file its ``.metadata`` names
(``_StorageInfo.relative_path``, joined to the directory as given): a crafted ``.metadata``
could name ``../../elsewhere/__0_0.distcp`` (tensors from outside the checkpoint, which its
manifest's CRCs never see) or a FIFO (the load blocks for ever). :func:`check_storage_files`
refuses, before anything is loaded, any such name that leaves the directory, is not a regular
file (a link, FIFO, device or directory: checked with ``lstat``, so nothing is opened) or, for a
checkpoint of :class:`~megatron_fastpath.checkpoint.CheckpointManager`, is not listed in its
manifest -- and the same for the fixed files the loaders open (``.metadata``, ``common.pt``,
Megatron's ``metadata.json``).
"""

from __future__ import annotations

import os
import stat
from typing import Optional

from megatron_fastpath.checkpoint.safety import UnsafeCheckpointError, safe_load_metadata

__all__ = ["check_storage_files", "FIXED_FILES"]

# files of a torch_dist directory opened by name (torch.distributed.checkpoint, Megatron)
FIXED_FILES = (".metadata", "common.pt", "metadata.json")


def _refuse(model_dir: str, what: str, name, why: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{model_dir}: {what} {name!r} {why}: refusing to load the checkpoint "
                                 "(nothing of it was opened)")


def _check_one(root: str, real_root: str, name, listed: Optional[set], what: str) -> None:
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
        raise _refuse(root, what, name, "is not a file name inside the checkpoint")
    rel = os.path.normpath(name)
    if rel == os.curdir or rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise _refuse(root, what, name, "leaves the checkpoint directory")
    path = os.path.join(root, rel)
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        raise _refuse(root, what, name, f"cannot be read ({exc.strerror})") from exc
    if not stat.S_ISREG(mode):
        raise _refuse(root, what, name, "is not a regular file (a link, FIFO, device or directory)")
    real = os.path.realpath(path)  # a linked directory on the way out
    if os.path.commonpath([real, real_root]) != real_root:
        raise _refuse(root, what, name, f"resolves to {real}, outside the checkpoint directory")
    if listed is not None and rel not in listed:
        raise _refuse(root, what, name, "is not listed in the checkpoint's manifest.json")


def check_storage_files(model_dir: str, listed: Optional[set] = None) -> None:
    """Refuse (UnsafeCheckpointError, one line) a torch_dist ``model_dir`` whose loading would
    open a file outside it or one that is not a regular file (module docstring). ``listed``: the
    file names (relative to ``model_dir``) of the checkpoint's manifest, every opened file must
    be one of them; None for a directory without a manifest (``checkpoint.base_dir``). A missing
    ``.metadata`` is left to :func:`~megatron_fastpath.checkpoint.check_safe_to_load` to name."""
    root = os.path.abspath(model_dir)
    real_root = os.path.realpath(root)
    listed = None if listed is None else {os.path.normpath(n) for n in listed}
    for name in FIXED_FILES:
        if os.path.lexists(os.path.join(root, name)):
            _check_one(root, real_root, name, listed, "the file")
    if not os.path.lexists(os.path.join(root, ".metadata")):
        return
    storage = safe_load_metadata(os.path.join(root, ".metadata")).storage_data
    if not isinstance(storage, dict):
        raise _refuse(root, ".metadata's", "storage_data", f"is a {type(storage).__qualname__}, "
                      "not the storage entries of torch.distributed.checkpoint's file system writer")
    for name in sorted({getattr(info, "relative_path", None) for info in storage.values()}, key=repr):
        _check_one(root, real_root, name, listed, ".metadata's storage entry")
