"""``train_state.json``: each checkpoint's format version, step, world size, config fingerprint
and ``parts``, the JSON state of every part (:mod:`.parts`), each under its own name (main job:
``optimizer`` step and hyper-parameters, ``scheduler``, ``data`` position, ``history``: per-step
records and evaluations).

Format versions (``format_version``): 1 kept the trainer's JSON state in one ``extra`` dict
(optimizer, scheduler, data position and the run history's ``records`` / ``evals`` /
``eval_accuracy`` side by side); 2 keeps it in ``parts``, each part under its own name. A
format-1 checkpoint is read as format 2 (:func:`upgrade_train_state`: the history keys become
the ``history`` part); any other format is refused (:class:`CheckpointFormatError`). Parts are
JSON: nothing of a checkpoint is unpickled (``safety.py``).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from megatron_fastpath.checkpoint.errors import CheckpointFormatError

__all__ = ["FORMAT_VERSION", "HISTORY_PART", "config_fingerprint", "upgrade_train_state",
           "check_json", "config_diff", "eval_loss_of"]

FORMAT_VERSION = 2  # see the module docstring
HISTORY_PART = "history"  # the run history's part (checkpoint.keep_best reads its evaluations)
_V1_HISTORY_KEYS = ("records", "evals", "eval_accuracy")


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


def check_json(name: str, value, where: str = "") -> None:
    """Refuse (TypeError) a part that is not plain JSON: parts are never pickled."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json(name, v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise TypeError(f"checkpoint part {name!r}{where} has the key {k!r}: parts are "
                                "saved as JSON, whose keys are strings")
            check_json(name, v, f"{where}[{k!r}]")
        return
    raise TypeError(f"checkpoint part {name!r}{where} is a {type(value).__qualname__}: parts are "
                    "saved as JSON, never pickled; give its state_dict() of plain values")


def config_diff(saved: dict, now: dict, prefix: str = "", ignore=frozenset(), hints=None) -> list[str]:
    """One line per setting that differs between a checkpoint's config and this run's, except
    the dotted keys in ``ignore``; ``hints`` ({dotted key: what to do}): a line more for each
    of its keys the checkpoint lacks."""
    out = []
    for k in sorted(set(saved) | set(now)):
        if f"{prefix}{k}" in ignore:
            continue
        a, b = saved.get(k, "<absent>"), now.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{k}.", ignore, hints)
        elif a != b:
            out.append(f"  config {prefix}{k}: saved {a!r}, now {b!r}")
            if k not in saved and f"{prefix}{k}" in (hints or {}):
                out.append(f"  {prefix}{k}: {hints[prefix + k]}")
    return out


def eval_loss_of(path: str) -> Optional[float]:
    """The held-out loss measured right after the step checkpoint ``path`` saved (its run
    history's last evaluation, when that is at the checkpoint's step), else None."""
    try:
        with open(os.path.join(path, "train_state.json")) as f:
            state = upgrade_train_state(json.load(f), path)
        evals = state["parts"][HISTORY_PART].get("evals") or []
        step, loss = evals[-1][0], evals[-1][1]
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, CheckpointFormatError):
        return None
    return float(loss) if step == state.get("step") else None
