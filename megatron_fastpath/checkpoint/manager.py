"""Save and resume a training run through Megatron's distributed checkpointing (torch_dist).

:class:`CheckpointManager` saves a run's parts (:mod:`.parts`: each with ``state_dict`` /
``load_state_dict``; tensors through dist_checkpointing, the rest as JSON in
``train_state.json``, :mod:`.train_state`), every rank's RNGs and FP8 scaling state, into the
layout of :mod:`.files`, and resumes from the latest complete checkpoint.

A save goes to ``.tmp.step_N``, is published by ``rename`` to ``step_N`` and only then
``latest`` is replaced (write + ``os.replace``): a crash at any point leaves the previous
checkpoint loadable and never points ``latest`` at a partial one.

Rotation (``keep``) keeps the checkpoint just written, the one this run resumed from and the
newest others that did not fail verification in this run; a checkpoint leaves the published
set by ``rename`` to ``.trash.step_N`` before it is deleted (a kill mid-delete leaves no
half-deleted ``step_N``; trash is cleared at the next save).

A load opens only regular files of the checkpoint that its manifest lists, ``.metadata``'s
storage entries included (``storage.py``), after checking that ``.metadata`` unpickles safely
(``safety.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import time
from typing import Callable, Optional

import torch

from megatron_fastpath.checkpoint.config import CheckpointConfig
from megatron_fastpath.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointDirError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
)
from megatron_fastpath.checkpoint.files import (
    LOCK_FILE,
    STEP_PREFIX,
    TMP_PREFIX,
    _crc32,
    _dir_bytes,
    _disk_problem,
    _files,
    _fsync_dir,
    _read_manifest,
    _write_json,
    _write_pointer,
    complete_checkpoints,
    latest_checkpoint,
    remove_leftovers,
    step_dir,
    step_of,
    trash,
)
from megatron_fastpath.checkpoint.parts import SHARDED, sharded_to_load, split_state
from megatron_fastpath.checkpoint.train_state import (
    FORMAT_VERSION,
    check_json,
    config_diff,
    config_fingerprint,
    eval_loss_of,
    upgrade_train_state,
)

__all__ = ["CheckpointManager", "SaveResult", "ResumeState"]


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



def _dist():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank() -> int:
    return torch.distributed.get_rank() if _dist() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if _dist() else 1


def _barrier() -> None:
    if _dist():
        torch.distributed.barrier()


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

    :meth:`save` and :meth:`load` take the run's parts, ``{name: part}`` (:mod:`.parts`), and
    treat each the same: its tensors go through dist_checkpointing, its JSON state into
    ``train_state.json`` under its name (and back as :attr:`ResumeState.parts`).
    ``fingerprint_config``: the JSON-able settings that must match for a resume (compared key by
    key on mismatch); ``may_differ(train_state) -> dotted keys``: those a checkpoint may
    differ in; ``hints``: {dotted key: what to do}, added to a mismatch where the checkpoint's
    fingerprint lacks the key.
    """

    def __init__(self, cfg: CheckpointConfig, fingerprint_config: dict, log: Callable[[str], None] = print,
                 may_differ: Optional[Callable[[dict], set]] = None, hints: Optional[dict] = None):
        if not cfg.enabled:
            raise ValueError("CheckpointManager needs checkpoint.dir")
        self.cfg = cfg
        self.root = os.path.abspath(cfg.dir)
        self.fingerprint_config = fingerprint_config
        self.fingerprint = config_fingerprint(fingerprint_config)
        self.log = log
        self.may_differ = may_differ
        self.hints = dict(hints or {})
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
        return step_dir(self.root, step)

    def complete_checkpoints(self) -> list[str]:
        """Published checkpoints, newest first."""
        return complete_checkpoints(self.root)

    def latest(self) -> Optional[str]:
        return latest_checkpoint(self.root)

    # ------------------------------------------------------------------ save
    def save(self, step: int, parts: dict, fp8_state: Optional[dict] = None) -> SaveResult:
        """Write checkpoint ``step`` (all ranks call it). Returns once the step may continue:
        at once for a sync save, after staging for an async one (published later by
        :meth:`poll`). ``parts``: {name: part} (:mod:`.parts`; a part's JSON state that is not
        plain JSON is refused before anything is written).
        ``fp8_state``: this rank's TE FP8 tensors (``fp8.state``).
        A full disk (or a file-size limit) raises CheckpointDirError saying so and where; the
        earlier checkpoints are untouched (nothing is published)."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            return self._save(step, parts, fp8_state)
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

    def _save(self, step: int, parts: dict, fp8_state: Optional[dict]) -> SaveResult:
        from megatron.core import dist_checkpointing

        from megatron_fastpath.compat.dist_ckpt import (
            dist_checkpointing_on_cpu,
            dist_checkpointing_save_kwargs,
            preemption_proof_results_queue,
        )

        tensors, states = {}, {}
        for name, part in parts.items():  # before anything is written, on every rank
            sharded, state = split_state(part.state_dict())
            check_json(name, state)
            if sharded is not None:
                tensors[name] = sharded
            if sharded is None or state:  # a part of tensors only has no JSON entry
                states[name] = state
        self.poll(blocking=True)  # one save in flight at a time
        preemption_proof_results_queue()  # its helper survives the group's SIGTERM / SIGUSR1
        t0 = time.perf_counter()
        tmp = os.path.join(self.root, f"{TMP_PREFIX}{STEP_PREFIX}{step:08d}")
        if _rank() == 0:
            os.makedirs(self.root, exist_ok=True)
            remove_leftovers(self.root)
            os.makedirs(os.path.join(tmp, "model"))
            os.makedirs(os.path.join(tmp, "rng"))
        _barrier()
        from megatron_fastpath.checkpoint.rng import capture_rng

        _write_json(os.path.join(tmp, "rng", f"rank_{_rank():05d}.json"), capture_rng())
        from megatron_fastpath.fp8 import save_fp8_state

        save_fp8_state(os.path.join(tmp, "fp8"), _rank(), fp8_state or {})
        if _rank() == 0:
            _write_json(os.path.join(tmp, "train_state.json"), self._train_state(step, states))
        sharded = _drop_objects(tensors)
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
                trash(self.root, old)

    eval_loss_of = staticmethod(eval_loss_of)

    def best_checkpoint(self, candidates: Optional[list] = None) -> Optional[str]:
        """Of ``candidates`` (default: the complete checkpoints), the one with the lowest
        held-out loss at its step (the newest on a tie); None when none was evaluated."""
        scored = [(loss, p) for p in (candidates if candidates is not None else self.complete_checkpoints())
                  if (loss := self.eval_loss_of(p)) is not None]
        return min(scored, key=lambda lp: (lp[0], -step_of(lp[1])))[1] \
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
        # the dotted config keys this checkpoint may differ in (settings an older fingerprint
        # held that do not enter it; the schedule of a finished run extended)
        ignore = self.may_differ(state) if self.may_differ is not None else set()
        diffs = config_diff(state.get("config", {}), self.fingerprint_config, ignore=ignore,
                            hints=self.hints)
        if problems or diffs:
            lines = problems[:40] + ([f"  ... {len(problems) - 40} more"] if len(problems) > 40 else [])
            raise CheckpointMismatchError(
                f"checkpoint {path} does not fit this run:\n" + "\n".join(lines + diffs)
                + "\nuse another checkpoint.dir or the settings it was written with"
            )

    def load(self, parts: dict, restore_fp8=None) -> Optional[ResumeState]:
        """Resume ``parts`` ({name: part}, :mod:`.parts`) from the latest complete checkpoint
        (None: the directory has none). ``restore_fp8(tensors) -> modules restored``: where this
        rank's FP8 state goes."""
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
                loaded = self._load_one(path, parts, restore_fp8)
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

    def _load_one(self, path: str, parts: dict, restore_fp8=None) -> ResumeState:
        from megatron_fastpath.checkpoint.rng import restore_rng
        from megatron_fastpath.checkpoint.safety import check_safe_to_load
        from megatron_fastpath.checkpoint.storage import check_storage_files
        from megatron_fastpath.compat.dist_ckpt import dist_checkpointing_load

        state = self.verify(path)
        model_dir = os.path.join(path, "model")
        # every file the loaders open: inside model/, regular, listed in the manifest
        check_storage_files(model_dir, {os.path.relpath(os.path.join(path, n), model_dir)
                                        for n in _read_manifest(path)})
        check_safe_to_load(model_dir)
        saved = state["parts"]
        missing = [name for name, part in parts.items() if name not in saved  # a part of tensors only has none
                   and (hasattr(part, "sharded_to_load") or split_state(part.state_dict())[0] is None)]
        if missing:
            raise CheckpointCorruptError(f"{path}/train_state.json has no part {', '.join(map(repr, missing))}")
        sharded = {}
        for name, part in parts.items():
            tensors = sharded_to_load(part, saved.get(name, {}))
            if tensors is not None:
                sharded[name] = tensors
        sharded = _drop_objects(sharded)
        self.check_compatible(path, state, sharded)
        loaded = dist_checkpointing_load(sharded, model_dir)
        for name, part in parts.items():  # in order: the model before its optimizer
            part.load_state_dict({**saved.get(name, {}), **({SHARDED: loaded[name]} if name in loaded else {})})
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

