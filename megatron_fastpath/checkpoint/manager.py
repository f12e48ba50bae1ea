"""Save and resume a training run through Megatron's distributed checkpointing (torch_dist).

Layout of ``checkpoint.dir``::

    latest                      name of the newest complete checkpoint (written last)
    best                        checkpoint.keep_best: name of the lowest held-out loss's one
    step_00000010/
        model/                  torch_dist: model + optimizer state as sharded tensors
        train_state.json        format version, step, world size, config fingerprint and
                                "parts": the trainer's JSON state, one entry per named part
                                (main job: "optimizer" step and hyper-parameters, "scheduler",
                                "data" position, "history": per-step records and evaluations)
        rng/rank_00000.json     every RNG of each rank
        fp8/rank_00000.safetensors  TE FP8 delayed-scaling state of each rank (FP8 runs only)
        manifest.json           size and CRC32 of every file (written by rank 0 last)
    .tmp.step_00000012/         a save in progress (never taken as a checkpoint)
    .trash.step_00000008/       a checkpoint being deleted by rotation
    .lock                       held by the run writing here (main job)

Entries with other names are not this package's: no save, rotation or clean-up touches them
(a ``step_notes`` or ``.tmp.mine`` of the user stays as it is).

A save goes to ``.tmp.step_N``, is published by ``rename`` to ``step_N`` and only then
``latest`` is replaced (write + ``os.replace``): a crash at any point leaves the previous
checkpoint loadable and never points ``latest`` at a partial one.

Rotation (``keep``) keeps the checkpoint just written, the one this run resumed from and the
newest others that did not fail verification in this run; a checkpoint leaves the published
set by ``rename`` to ``.trash.step_N`` before it is deleted (a kill mid-delete leaves no
half-deleted ``step_N``; trash is cleared at the next save).

Format versions (``train_state.json``'s ``format_version``): 1 kept the trainer's JSON state in
one ``extra`` dict (optimizer, scheduler, data position and the run history's ``records`` /
``evals`` / ``eval_accuracy`` side by side); 2 keeps it in ``parts``, each part under its own
name. A format-1 checkpoint is read as format 2 (:func:`upgrade_train_state`: the history keys
become the ``history`` part); any other format is refused (:class:`CheckpointFormatError`).
Parts are JSON: nothing of a checkpoint is unpickled (``safety.py``). A load opens only regular
files of the checkpoint that its manifest lists, ``.metadata``'s storage entries included
(``storage.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
import time
import zlib
from typing import Any, Callable, Optional

import torch

from megatron_fastpath.checkpoint.config import CheckpointConfig
from megatron_fastpath.checkpoint.errors import (  # noqa: F401 (their home; named here too)
    CheckpointCorruptError,
    CheckpointDirError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
)

__all__ = [
    "CheckpointManager", "CheckpointError", "CheckpointCorruptError", "CheckpointMismatchError",
    "CheckpointDirError", "CheckpointFormatError", "SaveResult", "ResumeState", "config_fingerprint",
    "check_checkpoint_dir", "upgrade_train_state", "FORMAT_VERSION", "HISTORY_PART",
]

STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp."
TRASH_PREFIX = ".trash."
FORMAT_VERSION = 2  # see the module docstring
# the names this package gives the entries of checkpoint.dir (``{step:08d}``: 8 digits or more);
# rotation and clean-up touch nothing else
_STEP_NAME = re.compile(re.escape(STEP_PREFIX) + r"[0-9]{8,}")
_OWN_LEFTOVER = re.compile(rf"(?:{re.escape(TMP_PREFIX)}|{re.escape(TRASH_PREFIX)}){_STEP_NAME.pattern}")
HISTORY_PART = "history"  # the run history's part (checkpoint.keep_best reads its evaluations)
_V1_HISTORY_KEYS = ("records", "evals", "eval_accuracy")


LOCK_FILE = ".lock"


def check_checkpoint_dir(path: str) -> None:
    """Refuse, before anything is built, a ``checkpoint.dir`` the run could not save into: a
    file, a directory that cannot be created, or one that cannot be written (read-only disk).
    Creates the directory and writes / removes a probe file (:func:`megatron_fastpath.paths.
    check_output_dir`, which checks the export directories too)."""
    from megatron_fastpath.paths import check_output_dir

    check_output_dir(path, "checkpoint.dir", CheckpointDirError)


@dataclasses.dataclass(frozen=True)
class SaveResult:
    step: int
    path: str
    bytes: int  # on disk, all files (0 until published for an async save)
    blocking_s: float  # time the save call blocked the training loop (async: staging only)
    is_async: bool
    wait_s: float = 0.0  # async: time the loop later waited for the background writer


@dataclasses.dataclass(frozen=True)
class ResumeState:
    """What a resumed run continues from (``parts``: the trainer's JSON state, by part name)."""

    step: int
    path: str
    parts: dict
    notes: tuple = ()


def config_fingerprint(config: dict) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def upgrade_train_state(state: dict, path: str = "checkpoint") -> dict:
    """``train_state.json`` of a format this version reads, as the current format (see the
    module docstring); CheckpointFormatError for any other."""
    version = state.get("format_version")
    if type(version) is int and version == FORMAT_VERSION:
        return state
    if type(version) is int and version == 1:
        parts = dict(state.get("extra") or {})
        history = {k: parts.pop(k) for k in _V1_HISTORY_KEYS if k in parts}
        if history:
            parts[HISTORY_PART] = history
        upgraded = {k: v for k, v in state.items() if k != "extra"}
        upgraded.update(format_version=FORMAT_VERSION, parts=parts)
        return upgraded
    newer = isinstance(version, int) and version > FORMAT_VERSION
    raise CheckpointFormatError(
        f"{os.path.join(path, 'train_state.json')} is checkpoint format {version!r}; this "
        f"megatron_fastpath reads formats 1 to {FORMAT_VERSION}, "
        + ("and this one was written by a newer version: resume it with that version (or "
           "upgrade megatron_fastpath)" if newer else
           "and this one was not written by megatron_fastpath")
        + ", or point checkpoint.dir at another directory to start a new run")


def _check_json(name: str, value, where: str = "") -> None:
    """Refuse (TypeError) a part that is not plain JSON: parts are never pickled."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(name, v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise TypeError(f"checkpoint part {name!r}{where} has the key {k!r}: parts are "
                                "saved as JSON, whose keys are strings")
            _check_json(name, v, f"{where}[{k!r}]")
        return
    raise TypeError(f"checkpoint part {name!r}{where} is a {type(value).__qualname__}: parts are "
                    "saved as JSON, never pickled; give its state_dict() of plain values")


def _dist():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank() -> int:
    return torch.distributed.get_rank() if _dist() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if _dist() else 1


def _barrier() -> None:
    if _dist():
        torch.distributed.barrier()


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


def _tensor_entries(sharded_sd) -> dict:
    """checkpoint key -> ShardedTensor (factories applied to a copy, byte objects dropped)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {v.key: v for v in nested_values(sharded_sd) if isinstance(v, ShardedTensor)}


def _drop_objects(sharded_sd):
    """Only tensors: ShardedObjects (``_extra_state``) would be unpickled with
    ``weights_only=False`` by torch.distributed.checkpoint, so they are neither saved nor read."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if isinstance(sharded_sd, dict):
        return {k: _drop_objects(v) for k, v in sharded_sd.items() if not isinstance(v, ShardedObject)}
    return sharded_sd


class CheckpointManager:
    """Checkpoints of one run (see the module docstring).

    ``state_fn(loading) -> sharded state dict`` builds ``{"model": ..., "optimizer": ...}``
    (``loading``: with fresh tensors to load into); ``apply_fn(loaded, parts)`` puts a loaded
    dict back into the model and optimizer. A save's ``parts`` ({name: JSON state}) come back
    as :attr:`ResumeState.parts`. ``fingerprint_config``: the JSON-able settings that
    must match for a resume (compared key by key on mismatch); ``may_differ(train_state) ->
    dotted keys``: those a checkpoint may differ in.
    """

    def __init__(self, cfg: CheckpointConfig, fingerprint_config: dict, log: Callable[[str], None] = print,
                 may_differ: Optional[Callable[[dict], set]] = None):
        if not cfg.enabled:
            raise ValueError("CheckpointManager needs checkpoint.dir")
        self.cfg = cfg
        self.root = os.path.abspath(cfg.dir)
        self.fingerprint_config = fingerprint_config
        self.fingerprint = config_fingerprint(fingerprint_config)
        self.log = log
        self.may_differ = may_differ
        self._async_queue = None
        self._pending: list = []
        self.saves: list[SaveResult] = []
        self._lock_fd: Optional[int] = None
        self.resumed_path: Optional[str] = None  # never rotated away
        self.failed: set = set()  # checkpoints that failed verification or loading in this run

    # ------------------------------------------------------------------ ownership
    def lock(self) -> None:
        """Take ``checkpoint.dir`` for this run (rank 0, until the process exits or
        :meth:`unlock`): a second job writing there would delete this one's saves in progress.
        Refused, naming the holder, when another process holds it."""
        import fcntl
        import socket

        if _rank() != 0 or self._lock_fd is not None:
            return
        os.makedirs(self.root, exist_ok=True)
        path = os.path.join(self.root, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CheckpointDirError(
                f"checkpoint.dir={self.root!r} is in use by {holder}: one job writes a checkpoint "
                "directory at a time (a second would delete its saves in progress); wait for it "
                "to end or use another checkpoint.dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def check_free_space(self, need_bytes: int) -> None:
        """Refuse (before step 1) a ``checkpoint.dir`` without room for one more checkpoint of
        about ``need_bytes`` (old ones are rotated away only after a new one is published)."""
        free = shutil.disk_usage(self.root).free
        if free < need_bytes:
            raise CheckpointDirError(
                f"checkpoint.dir={self.root!r} has {free / 2**20:.1f} MiB free, a checkpoint of "
                f"this run needs about {need_bytes / 2**20:.1f} MiB: the first save would fail; "
                "free space or choose another directory")

    # ------------------------------------------------------------------ discovery
    def _step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"{STEP_PREFIX}{step:08d}")

    def complete_checkpoints(self) -> list[str]:
        """Published checkpoints, newest first."""
        if not os.path.isdir(self.root):
            return []
        names = [n for n in os.listdir(self.root) if _STEP_NAME.fullmatch(n)
                 and os.path.exists(os.path.join(self.root, n, "manifest.json"))]
        return [os.path.join(self.root, n) for n in sorted(names, key=lambda n: int(n[len(STEP_PREFIX):]),
                                                           reverse=True)]

    def latest(self) -> Optional[str]:
        pointer = os.path.join(self.root, "latest")
        if os.path.exists(pointer):
            with open(pointer) as f:
                name = f.read().strip()
            if not name.startswith(STEP_PREFIX) or os.sep in name or name in (".", ".."):
                raise CheckpointCorruptError(
                    f"{pointer} holds {name[:80]!r}, not a checkpoint name (set "
                    "checkpoint.fallback_to_previous=true to resume from the newest complete one)")
            return os.path.join(self.root, name)
        done = self.complete_checkpoints()  # crash between publish and pointer: newest complete
        return done[0] if done else None

    # ------------------------------------------------------------------ save
    def save(self, step: int, state_fn, parts: dict, fp8_state: Optional[dict] = None) -> SaveResult:
        """Write checkpoint ``step`` (all ranks call it). Returns once the step may continue:
        at once for a sync save, after staging for an async one (published later by
        :meth:`poll`). ``parts``: {name: JSON state} of the trainer's stateful parts (each
        under its own name in ``train_state.json``; a value that is not plain JSON is refused).
        ``fp8_state``: this rank's TE FP8 tensors (``fp8.state``).
        A full disk (or a file-size limit) raises CheckpointDirError saying so and where; the
        earlier checkpoints are untouched (nothing is published)."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            return self._save(step, state_fn, parts, fp8_state)
        except (OSError, RuntimeError, CheckpointException) as exc:
            self._raise_if_disk(step, exc)
            raise

    def _raise_if_disk(self, step: int, exc: BaseException) -> None:
        """CheckpointDirError when the failed save of ``step`` (sync, or its async writer) is a
        full disk or a file-size limit."""
        reason = _disk_problem(self.root, exc)
        if reason is None:
            return
        failures = getattr(exc, "failures", None)  # torch's CheckpointException: the first rank's
        shown = next(iter(failures.values())) if isinstance(failures, dict) and failures else exc
        shown = shown[0] if isinstance(shown, tuple) else shown  # (exception, traceback)
        detail = (str(shown).splitlines() or [""])[0][:200]
        raise CheckpointDirError(
            f"saving checkpoint step {step} under {self.root} failed: {reason} ({type(shown).__name__}: "
            f"{detail}); the earlier checkpoints are intact. Free space (or raise the file-size "
            "limit) and resume, or lower checkpoint.keep") from exc

    def _save(self, step: int, state_fn, parts: dict, fp8_state: Optional[dict]) -> SaveResult:
        from megatron.core import dist_checkpointing

        from megatron_fastpath.compat.dist_ckpt import (
            dist_checkpointing_on_cpu,
            dist_checkpointing_save_kwargs,
            preemption_proof_results_queue,
        )

        for name, value in parts.items():  # before anything is written, on every rank
            _check_json(name, value)
        self.poll(blocking=True)  # one save in flight at a time
        preemption_proof_results_queue()  # its helper survives the group's SIGTERM / SIGUSR1
        t0 = time.perf_counter()
        tmp = os.path.join(self.root, f"{TMP_PREFIX}{STEP_PREFIX}{step:08d}")
        if _rank() == 0:
            os.makedirs(self.root, exist_ok=True)
            self._remove_partial()
            os.makedirs(os.path.join(tmp, "model"))
            os.makedirs(os.path.join(tmp, "rng"))
        _barrier()
        from megatron_fastpath.checkpoint.rng import capture_rng

        _write_json(os.path.join(tmp, "rng", f"rank_{_rank():05d}.json"), capture_rng())
        from megatron_fastpath.fp8 import save_fp8_state

        save_fp8_state(os.path.join(tmp, "fp8"), _rank(), fp8_state or {})
        if _rank() == 0:
            _write_json(os.path.join(tmp, "train_state.json"), self._train_state(step, parts))
        sharded = _drop_objects(state_fn(False))
        with dist_checkpointing_on_cpu():
            request = dist_checkpointing.save(
                sharded, os.path.join(tmp, "model"), async_sharded_save=self.cfg.async_save,
                **dist_checkpointing_save_kwargs())
        if request is None:
            self._publish(tmp, step)
            result = SaveResult(step, self._step_dir(step), _dir_bytes(self._step_dir(step)),
                                time.perf_counter() - t0, False)
            self.saves.append(result)
            return result
        request.add_finalize_fn(lambda: self._publish(tmp, step))
        with dist_checkpointing_on_cpu():
            self._queue().schedule_async_request(request)
        result = SaveResult(step, self._step_dir(step), 0, time.perf_counter() - t0, True)
        self._pending.append(result)
        return result

    def _queue(self):
        if self._async_queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._async_queue = AsyncCallsQueue()
        return self._async_queue

    def poll(self, blocking: bool = False) -> list[SaveResult]:
        """Publish finished async saves (all ranks call it at the same points)."""
        if self._async_queue is None or not self._pending:
            return []
        from megatron_fastpath.compat.dist_ckpt import dist_checkpointing_on_cpu

        from torch.distributed.checkpoint.api import CheckpointException

        t0 = time.perf_counter()
        try:
            with dist_checkpointing_on_cpu():
                done = self._async_queue.maybe_finalize_async_calls(blocking=blocking)
        except (OSError, RuntimeError, CheckpointException) as exc:  # the background writer's
            step = self._pending.pop(0).step  # never published
            self._raise_if_disk(step, exc)
            raise
        waited = time.perf_counter() - t0
        published = []
        for _ in done:
            r = self._pending.pop(0)
            r = dataclasses.replace(r, bytes=_dir_bytes(r.path), wait_s=waited)
            self.saves.append(r)
            published.append(r)
        return published

    def _train_state(self, step: int, parts: dict) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": _world(),
            "adapters_only": self.cfg.adapters_only,
            "fingerprint": self.fingerprint,
            "config": self.fingerprint_config,
            "parts": parts,
        }

    def _remove_partial(self) -> None:
        """Remove this package's own leftovers: saves in progress (``.tmp.step_N``) and
        checkpoints rotated out (``.trash.step_N``) of an earlier (killed) run. Any other entry
        of the directory -- ``.tmp.mine``, ``.trash`` -- is the user's and left alone."""
        for n in os.listdir(self.root):
            if _OWN_LEFTOVER.fullmatch(n):
                p = os.path.join(self.root, n)
                if os.path.islink(p):  # a planted link: never write (or delete) through it
                    os.unlink(p)
                else:
                    shutil.rmtree(p, ignore_errors=True)

    def _rotate(self, written: str) -> None:
        """Keep ``written``, the checkpoint resumed from and the newest ``keep`` of the others
        that did not fail in this run; move the rest out of the published set, then delete."""
        good = [p for p in self.complete_checkpoints() if p not in self.failed]
        kept = {written, self.resumed_path} | set(good[: self.cfg.keep])
        if self.cfg.keep_best:
            best = self.best_checkpoint(good)
            if best is not None:
                kept.add(best)
                _write_pointer(os.path.join(self.root, "best"), os.path.basename(best))
        for old in self.complete_checkpoints():
            if old not in kept:
                trash = os.path.join(self.root, TRASH_PREFIX + os.path.basename(old))
                os.rename(old, trash)  # out of the published set first: atomic
                _fsync_dir(self.root)
                shutil.rmtree(trash, ignore_errors=True)

    @staticmethod
    def eval_loss_of(path: str) -> Optional[float]:
        """The held-out loss measured right after the step ``path`` saved (its run history's
        last evaluation, when that is at the checkpoint's step), else None."""
        try:
            with open(os.path.join(path, "train_state.json")) as f:
                state = upgrade_train_state(json.load(f), path)
            evals = state["parts"][HISTORY_PART].get("evals") or []
            step, loss = evals[-1][0], evals[-1][1]
        except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, CheckpointFormatError):
            return None
        return float(loss) if step == state.get("step") else None

    def best_checkpoint(self, candidates: Optional[list] = None) -> Optional[str]:
        """Of ``candidates`` (default: the complete checkpoints), the one with the lowest
        held-out loss at its step (the newest on a tie); None when none was evaluated."""
        scored = [(loss, p) for p in (candidates if candidates is not None else self.complete_checkpoints())
                  if (loss := self.eval_loss_of(p)) is not None]
        return min(scored, key=lambda lp: (lp[0], -int(os.path.basename(lp[1])[len(STEP_PREFIX):])))[1] \
            if scored else None

    def _publish(self, tmp: str, step: int) -> None:
        _barrier()  # every rank's files are written
        if _rank() == 0:
            manifest = {f: {"bytes": os.path.getsize(os.path.join(tmp, f)),
                            "crc32": _crc32(os.path.join(tmp, f)) if self.cfg.verify else None}
                        for f in _files(tmp)}
            _write_json(os.path.join(tmp, "manifest.json"), manifest)
            final = self._step_dir(step)
            if os.path.exists(final):  # an older run's checkpoint of the same step
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            _write_pointer(os.path.join(self.root, "latest"), os.path.basename(final))
            self._rotate(final)
        _barrier()

    # ------------------------------------------------------------------ load
    def verify(self, path: str) -> dict:
        """Check every file against the manifest; returns train_state.json (in the current
        format: :func:`upgrade_train_state`)."""
        manifest_path = os.path.join(path, "manifest.json")
        manifest = _read_manifest(path)
        real = os.path.realpath(path)
        for name, info in manifest.items():
            fp = os.path.join(path, name)
            if os.path.commonpath([os.path.realpath(fp), real]) != real:
                raise CheckpointCorruptError(f"{manifest_path} names {name!r}, which is outside "
                                             "the checkpoint: refusing to open it")
            if not os.path.lexists(fp):
                raise CheckpointCorruptError(f"{fp} is missing")
            if not stat.S_ISREG(os.lstat(fp).st_mode):  # before opening it: a FIFO would block
                raise CheckpointCorruptError(f"{fp} is not a regular file (a link, FIFO, device or "
                                             "directory): refusing to open it")
            size = os.path.getsize(fp)
            if size != info["bytes"]:
                raise CheckpointCorruptError(f"{fp} is truncated or altered: {size} bytes, expected {info['bytes']}")
            if info["crc32"] is not None and _crc32(fp) != info["crc32"]:
                raise CheckpointCorruptError(f"{fp} is corrupted: CRC32 differs from the manifest")
        with open(os.path.join(path, "train_state.json")) as f:
            state = json.load(f)
        if not isinstance(state, dict):
            raise CheckpointCorruptError(f"{path}/train_state.json: not a train-state object")
        return upgrade_train_state(state, path)

    def check_compatible(self, path: str, state: dict, sharded) -> None:
        """Config fingerprint and every requested tensor's key and global shape."""
        from megatron.core import dist_checkpointing

        saved = dist_checkpointing.load_tensors_metadata(os.path.join(path, "model"))
        problems = []
        for key, ten in sorted(_tensor_entries(sharded).items()):
            if key not in saved:
                problems.append(f"  missing in checkpoint: {key} {tuple(ten.global_shape)}")
            elif tuple(saved[key].global_shape) != tuple(ten.global_shape):
                problems.append(f"  shape: {key} saved {tuple(saved[key].global_shape)}, "
                                f"this model {tuple(ten.global_shape)}")
        if state.get("adapters_only") != self.cfg.adapters_only:
            problems.append(f"  checkpoint.adapters_only: saved {state.get('adapters_only')}, now {self.cfg.adapters_only}")
        # the dotted config keys this checkpoint may differ in (e.g. settings an older
        # fingerprint held that no longer enter it; the schedule of a finished run extended)
        ignore = self.may_differ(state) if self.may_differ is not None else set()
        diffs = _config_diff(state.get("config", {}), self.fingerprint_config, ignore=ignore)
        if problems or diffs:
            lines = problems[:40] + ([f"  ... {len(problems) - 40} more"] if len(problems) > 40 else [])
            raise CheckpointMismatchError(
                f"checkpoint {path} does not fit this run:\n" + "\n".join(lines + diffs)
                + "\nuse another checkpoint.dir or the settings it was written with"
            )

    def load(self, state_fn, apply_fn, restore_fp8=None) -> Optional[ResumeState]:
        """Resume from the latest complete checkpoint (None: the directory has none).
        ``restore_fp8(tensors) -> modules restored``: where this rank's FP8 state goes."""
        from torch.distributed.checkpoint.api import CheckpointException

        notes = []
        try:
            latest = self.latest()
        except CheckpointCorruptError as exc:  # garbage / empty ``latest``
            if not self.cfg.fallback_to_previous:
                raise
            latest = None
            notes.append(f"ignored {exc}")
            self.log(f"checkpoint: {notes[-1]}; trying the newest complete checkpoint")
        complete = self.complete_checkpoints()
        if latest is None and not notes:
            return None
        candidates = ([latest] if latest else []) + (
            [p for p in complete if p != latest] if self.cfg.fallback_to_previous else [])
        for path in candidates:
            try:
                loaded = self._load_one(path, state_fn, apply_fn, restore_fp8)
                self.resumed_path = path
                return dataclasses.replace(loaded, notes=tuple(notes) + loaded.notes)
            except (CheckpointMismatchError, CheckpointFormatError, UnsafeCheckpointError):
                # another run's checkpoint, a newer version's or a tampered one: never fall back
                # silently (rotation would then delete it)
                raise
            # CheckpointException: torch.distributed.checkpoint's load failure (a BaseException)
            except (CheckpointCorruptError, OSError, ValueError, RuntimeError, KeyError,
                    CheckpointException) as exc:
                self.failed.add(path)
                if not self.cfg.fallback_to_previous:
                    if isinstance(exc, CheckpointError):
                        raise
                    raise CheckpointCorruptError(f"cannot load {path}: {exc}") from exc
                notes.append(f"skipped {path}: {str(exc).splitlines()[0]}")
                self.log(f"checkpoint: {notes[-1]}; trying the previous one")
        raise CheckpointCorruptError("no loadable checkpoint in " + self.root + ":\n  " + "\n  ".join(notes))

    def _load_one(self, path: str, state_fn, apply_fn, restore_fp8=None) -> ResumeState:
        from megatron.core import dist_checkpointing

        from megatron_fastpath.checkpoint.rng import restore_rng
        from megatron_fastpath.checkpoint.safety import check_safe_to_load
        from megatron_fastpath.checkpoint.storage import check_storage_files
        from megatron_fastpath.compat.dist_ckpt import dist_checkpointing_on_cpu

        state = self.verify(path)
        model_dir = os.path.join(path, "model")
        # every file the loaders open: inside model/, regular, listed in the manifest
        check_storage_files(model_dir, {os.path.relpath(os.path.join(path, n), model_dir)
                                        for n in _read_manifest(path)})
        check_safe_to_load(model_dir)
        sharded = _drop_objects(state_fn(True, state))
        self.check_compatible(path, state, sharded)
        with dist_checkpointing_on_cpu():
            loaded = dist_checkpointing.load(sharded, model_dir)
        apply_fn(loaded, state["parts"])
        notes = []
        rng_file = os.path.join(path, "rng", f"rank_{_rank():05d}.json")
        if state["world_size"] == _world() and os.path.exists(rng_file):
            with open(rng_file) as f:
                restore_rng(json.load(f))
        else:
            notes.append(f"RNG states not restored: saved at world {state['world_size']}, now {_world()}")
        fp8_dir = os.path.join(path, "fp8")
        if os.path.isdir(fp8_dir):
            from megatron_fastpath.fp8 import load_fp8_state

            if restore_fp8 is None:
                notes.append("FP8 scaling history not restored: this run has no FP8 modules")
            else:
                notes.append(load_fp8_state(fp8_dir, _rank(), restore_fp8))
        return ResumeState(step=state["step"], path=path, parts=state["parts"], notes=tuple(notes))


def _config_diff(saved: dict, now: dict, prefix: str = "", ignore=frozenset()) -> list[str]:
    out = []
    for k in sorted(set(saved) | set(now)):
        if f"{prefix}{k}" in ignore:
            continue
        a, b = saved.get(k, "<absent>"), now.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_diff(a, b, f"{prefix}{k}.", ignore)
        elif a != b:
            out.append(f"  config {prefix}{k}: saved {a!r}, now {b!r}")
    return out
