"""The directories a job writes, checked before anything is built (stdlib only).

:func:`check_output_dir` refuses an output directory the job could not write into (a file, a
path under a file, a read-only disk); :func:`refuse_overlap` refuses an output directory that
is, contains or is inside a directory the job reads (writing there would change its input).
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["check_output_dir", "refuse_overlap"]


def _nearest_existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists (as seen by ``os.path.lexists``)."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return probe


def check_output_dir(path: str, key: str, error: type = ValueError, create: bool = True) -> None:
    """Refuse (``error``, one line naming ``key``) a directory the job could not write into.

    ``create``: make the directory and write / remove a probe file in it (``checkpoint.dir``,
    which the job locks at start anyway). Without it nothing is created: the directory, or the
    nearest ancestor it would be created in, must be a directory the process may write on a
    file system mounted read-write."""
    where = f"{key}={path!r}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise error(f"{where} is a file, not a directory: point {key} at a directory (it is "
                    "created if missing)")
    if not create:
        base = _nearest_existing(path)
        if not os.path.isdir(base):
            raise error(f"{where} cannot be created ({base} is a file, not a directory): point "
                        f"{key} at a directory on a writable disk")
        if os.statvfs(base).f_flag & os.ST_RDONLY:
            raise error(f"{where} is not writable (Read-only file system: {base}): the export at "
                        "the end of the run would fail; choose a directory on a writable disk")
        if not os.access(base, os.W_OK | os.X_OK):
            raise error(f"{where} is not writable (Permission denied: {base}): the export at the "
                        "end of the run would fail; choose a writable directory")
        return
    import socket

    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise error(f"{where} cannot be created ({exc.strerror}: {exc.filename}): choose a "
                    "directory on a writable disk") from exc
    probe = os.path.join(path, f".write_test.{socket.gethostname()}.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise error(f"{where} is not writable ({exc.strerror}): the first save would fail and "
                    "the run's work be lost; choose a writable directory") from exc
    finally:
        if os.path.exists(probe):
            os.remove(probe)


def refuse_overlap(key: str, path: str, other_key: str, other: Optional[str],
                   error: type = ValueError) -> None:
    """Refuse output directory ``key=path`` when it is, contains or is inside ``other_key=other``
    (compared after resolving links: a link to the model directory is the model directory)."""
    if not path or not other:
        return
    mine, theirs = os.path.realpath(path), os.path.realpath(other)
    if mine == theirs:
        how = "is"
    elif os.path.commonpath([mine, theirs]) == theirs:
        how = "is inside"
    elif os.path.commonpath([mine, theirs]) == mine:
        how = "contains"
    else:
        return
    raise error(f"{key}={path!r} {how} {other_key}={other!r}: the job would write its files "
                f"among those it reads (and overwrite them); point {key} at a directory outside "
                f"{other_key}")
