"""The files of ``checkpoint.dir``: its entries' names, atomic writes, the manifest and listing.

Layout of ``checkpoint.dir``::

    latest                      name of the newest complete checkpoint (written last)
    best                        checkpoint.keep_best: name of the lowest held-out loss's one
    step_00000010/
        model/                  torch_dist: the parts' sharded tensors (model, optimizer state)
        train_state.json        the parts' JSON state (:mod:`.train_state`)
        rng/rank_00000.json     every RNG of each rank
        fp8/rank_00000.safetensors  TE FP8 delayed-scaling state of each rank (FP8 runs only)
        manifest.json           size and CRC32 of every file (written by rank 0 last)
    .tmp.step_00000012/         a save in progress (never taken as a checkpoint)
    .trash.step_00000008/       a checkpoint being deleted by rotation
    .lock                       held by the run writing here (main job)

Entries with other names are not this package's: no save, rotation or clean-up touches them
(a ``step_notes`` or ``.tmp.mine`` of the user stays as it is). A file is written to a
``.part`` beside it, synced and renamed over its name; a pointer (``latest``, ``best``) also
syncs its directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from typing import Any, Optional

from megatron_fastpath.checkpoint.errors import CheckpointCorruptError, CheckpointDirError

__all__ = ["STEP_PREFIX", "TMP_PREFIX", "TRASH_PREFIX", "LOCK_FILE", "check_checkpoint_dir",
           "step_dir", "complete_checkpoints", "latest_checkpoint", "remove_leftovers"]

STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp."
TRASH_PREFIX = ".trash."
# the names this package gives the entries of checkpoint.dir (``{step:08d}``: 8 digits or more);
# rotation and clean-up touch nothing else
_STEP_NAME = re.compile(re.escape(STEP_PREFIX) + r"[0-9]{8,}")
_OWN_LEFTOVER = re.compile(rf"(?:{re.escape(TMP_PREFIX)}|{re.escape(TRASH_PREFIX)}){_STEP_NAME.pattern}")
LOCK_FILE = ".lock"


def check_checkpoint_dir(path: str) -> None:
    """Refuse, before anything is built, a ``checkpoint.dir`` the run could not save into: a
    file, a directory that cannot be created, or one that cannot be written (read-only disk).
    Creates the directory and writes / removes a probe file (:func:`megatron_fastpath.paths.
    check_output_dir`, which checks the export directories too)."""
    from megatron_fastpath.paths import check_output_dir

    check_output_dir(path, "checkpoint.dir", CheckpointDirError)



def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_pointer(pointer: str, name: str) -> None:
    """Atomically make the file ``pointer`` hold ``name`` (``latest``, ``best``)."""
    with open(f"{pointer}.part", "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{pointer}.part", pointer)
    _fsync_dir(os.path.dirname(pointer))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _disk_problem(root: str, exc: BaseException) -> Optional[str]:
    """Why a save failed when it is the disk: the OS error (ENOSPC, EFBIG, EDQUOT) in the chain,
    or -- torch's zip writer reports a short write only as 'unexpected pos N vs M' -- a file
    system left with (almost) no free space. None otherwise. torch's CheckpointException (an
    async writer's 'Worker failure: [Errno 28] ...') holds each rank's exception in ``failures``,
    the OS error only as text (it crossed a process)."""
    import errno
    import re

    todo, done = [exc], set()
    while todo:
        seen = todo.pop(0)
        if seen is None or id(seen) in done:
            continue
        done.add(id(seen))
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            where = f" writing {seen.filename}" if seen.filename else ""
            return f"{os.strerror(seen.errno)}{where}"
        code = re.search(r"\[Errno (\d+)\]", str(seen)) if not isinstance(seen, OSError) else None
        if code and int(code.group(1)) in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            return os.strerror(int(code.group(1)))
        failures = getattr(seen, "failures", None)
        if isinstance(failures, dict):  # {rank: (exception, traceback)}
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [seen.__cause__, seen.__context__]
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return None
    if free < (1 << 20):
        return f"the disk holding it is full ({free} bytes free)"
    return None


def _read_manifest(path: str) -> dict:
    """``manifest.json`` of checkpoint ``path`` ({file: {"bytes", "crc32"}})."""
    manifest_path = os.path.join(path, "manifest.json")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"{manifest_path}: unreadable manifest ({exc})") from exc
    if not isinstance(manifest, dict):
        raise CheckpointCorruptError(f"{manifest_path}: not a manifest object")
    return manifest


def _files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(out)


def _dir_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for f in _files(root))



def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"{STEP_PREFIX}{step:08d}")


def step_of(path: str) -> int:
    return int(os.path.basename(path)[len(STEP_PREFIX):])


def complete_checkpoints(root: str) -> list[str]:
    """Published checkpoints of ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if _STEP_NAME.fullmatch(n)
             and os.path.exists(os.path.join(root, n, "manifest.json"))]
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: int(n[len(STEP_PREFIX):]),
                                                  reverse=True)]


def latest_checkpoint(root: str) -> Optional[str]:
    """The checkpoint ``latest`` names (CheckpointCorruptError when it holds no checkpoint name),
    else the newest complete one (a crash between publish and pointer), else None."""
    pointer = os.path.join(root, "latest")
    if os.path.exists(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        if not name.startswith(STEP_PREFIX) or os.sep in name or name in (".", ".."):
            raise CheckpointCorruptError(
                f"{pointer} holds {name[:80]!r}, not a checkpoint name (set "
                "checkpoint.fallback_to_previous=true to resume from the newest complete one)")
        return os.path.join(root, name)
    done = complete_checkpoints(root)
    return done[0] if done else None


def remove_leftovers(root: str) -> None:
    """Remove this package's own leftovers: saves in progress (``.tmp.step_N``) and checkpoints
    rotated out (``.trash.step_N``) of an earlier (killed) run. Any other entry of the
    directory -- ``.tmp.mine``, ``.trash`` -- is the user's and left alone."""
    for n in os.listdir(root):
        if _OWN_LEFTOVER.fullmatch(n):
            p = os.path.join(root, n)
            if os.path.islink(p):  # a planted link: never write (or delete) through it
                os.unlink(p)
            else:
                shutil.rmtree(p, ignore_errors=True)


def trash(root: str, path: str) -> None:
    """Delete the checkpoint ``path``: out of the published set by ``rename`` first (atomic; a
    kill mid-delete leaves no half-deleted ``step_N``), then removed."""
    moved = os.path.join(root, TRASH_PREFIX + os.path.basename(path))
    os.rename(path, moved)
    _fsync_dir(root)
    shutil.rmtree(moved, ignore_errors=True)
