"""Typed settings: every config group is a frozen dataclass, and :func:`check_values` checks a
group's raw values against its fields before the dataclass is built -- the type of each field
(``int``, ``float``, ``bool``, ``str``, ``Optional[...]``) and, where a field declares one with
:func:`setting`, its range -- so a bad override (``training.steps=abc``, ``training.lr=nan``,
``parallel.tensor_model_parallel_size=-1``) is refused at parse, naming the key, before any model
or optimizer exists.

Each field of a config group is declared with :func:`setting`: its default, its one-line
description (the one home of the key's description: ``python -m megatron_fastpath.train --help``
prints it, :func:`describe` reads it) and its bound, if any.

What the job knows about its keys as a whole lives here too: which switch turns a feature group
on (:data:`FEATURE_SWITCHES`, :func:`settings_while_off`), which keys may change on a resume
(:data:`NOT_WEIGHT_SETTINGS`, :data:`SCHEDULE_SETTINGS`) and the positive-int check the packed
cache's and the hooks' sizes share (:func:`check_positive_ints`). The rules over a run's facts
are :mod:`megatron_fastpath.rules`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any, Callable, Optional, Union

__all__ = ["Bound", "setting", "describe", "check_values", "parse_group", "POSITIVE", "NON_NEGATIVE", "FINITE_POSITIVE",
           "FINITE_NON_NEGATIVE"]


@dataclasses.dataclass(frozen=True)
class Bound:
    """A field's allowed range: ``text`` says it in the error, ``ok(value)`` checks it."""

    text: str
    ok: Callable[[Any], bool]


POSITIVE = Bound("> 0", lambda v: v > 0)
NON_NEGATIVE = Bound(">= 0", lambda v: v >= 0)
FINITE_POSITIVE = Bound("a finite number > 0", lambda v: math.isfinite(v) and v > 0)
FINITE_NON_NEGATIVE = Bound("a finite number >= 0", lambda v: math.isfinite(v) and v >= 0)


def setting(default: Any, help: str, bound: Optional[Bound] = None, **field: Any) -> Any:
    """A config group's dataclass field: ``default``, ``help`` (what the key sets, one line) and,
    when given, the ``bound`` its value must satisfy; ``field``: more ``dataclasses.field``
    arguments."""
    metadata = dict(field.pop("metadata", {}), help=help)
    if bound is not None:
        metadata["bound"] = bound
    return dataclasses.field(default=default, metadata=metadata, **field)


def describe(cls: type) -> dict:
    """{field name: its one-line description} of a config dataclass ("" where a field has none)."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


_KIND = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}


def _fits(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    return True


@functools.lru_cache(maxsize=256)
def _typed_fields(cls: type) -> tuple:
    """((field, kind, optional, bound), ...) of the fields of ``cls`` typed ``int``, ``float``, ``bool``,
    ``str`` or ``Optional`` of one of them, in field order: a class's fields and type hints are
    fixed, and reading them is most of a parse's time, so once per class."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind, optional = hints.get(f.name), False
        if typing.get_origin(kind) is Union:
            args = typing.get_args(kind)
            optional = type(None) in args
            rest = [a for a in args if a is not type(None)]
            kind = rest[0] if len(rest) == 1 else None
        if kind in _KIND:
            out.append((f, kind, optional, f.metadata.get("bound")))
    return tuple(out)


def check_values(group: str, cls: type, data: dict) -> None:
    """Raise ValueError naming ``<group>.<field>`` for the first value of ``data`` that does not
    fit the field of ``cls`` it sets (type, then bound). Fields typed otherwise (Any, tuples,
    nested configs) are left to the dataclass."""
    for f, kind, optional, bound in _typed_fields(cls):
        if f.name not in data:
            continue
        value, key = data[f.name], f"{group}.{f.name}"
        if value is None:
            if optional:
                continue
            raise ValueError(f"{key}=null: must be {_KIND[kind]} (the default is {f.default!r})")
        if not _fits(value, kind):
            raise ValueError(f"{key}={value!r}: must be {_KIND[kind]}"
                             + (" or null" if optional else "") + f" (the default is {f.default!r})")
        if bound is not None and not bound.ok(value):
            raise ValueError(f"{key}={value!r}: must be {bound.text} (the default is {f.default!r})")


def parse_group(name: str, cls: type, data: dict, fixed: Optional[dict] = None, switch: str = ""):
    """A config group's dict as its frozen dataclass ``cls``: unknown keys and values that do not
    fit (type, bound) are errors naming the key. ``fixed`` fields are set by the caller, not the
    group (``switch`` names where they are set instead)."""
    fixed = fixed or {}
    fields = {f.name for f in dataclasses.fields(cls)} - set(fixed)
    unknown = sorted(set(data) - fields)
    if unknown:
        where = f" ({', '.join(sorted(fixed))} is set by {switch})" if fixed and switch else ""
        raise ValueError(f"unknown key(s) {unknown} in config group '{name}'{where}; valid: {sorted(fields)}")
    check_values(name, cls, data)
    return cls(**data, **fixed)


# The main job's feature groups and the switch that turns each on: a group's keys are read only
# while its switch is on (train/config.py), so a key set away from its default while the switch
# is off would be silently ignored (lora.rank=8 without fastpath.lora=true: a full fine-tune).
FEATURE_SWITCHES = {"lora": "fastpath.lora", "offload": "fastpath.offload",
                    "cuda_graphs": "fastpath.cuda_graphs", "fp8": "fastpath.fp8"}


# Resuming a checkpoint: the settings that do not change the trained weights (logging, held-out
# evaluation, where and how the job runs) may differ from the saved run's; every other setting
# of the model, data, training and LoRA groups is in the checkpoint's fingerprint and must match
# (train/checkpointing.py fingerprint_config). SCHEDULE_SETTINGS change the weights too, but a
# finished run may be extended with more of them: the LR schedule is then recomputed for the new
# total and the resumed steps continue from the saved step -- Megatron's
# --override-opt_param-scheduler (megatron/training/training_config.py:164 at core_v0.16.1;
# OptimizerParamScheduler._check_and_set takes the class value,
# megatron/core/optimizer_param_scheduler.py:322-324, and load_state_dict steps on from the
# saved num_steps, :384).
NOT_WEIGHT_SETTINGS = (
    "training.stop_at_step", "training.summary_json", "training.log_all_ranks", "training.device",
    "training.sync_check", "training.skip_memory_check", "training.dry_run",
    "data.eval_every", "data.eval_samples", "data.eval_max_new_tokens", "data.cache",
    "data.eval_path", "data.cache_dir",
)
SCHEDULE_SETTINGS = ("training.steps", "training.epochs")


def changed_settings(group: str, settings: Any, defaults: Any, fixed: tuple = ()) -> list[str]:
    """``group.key=value`` of each field of the dataclass ``settings`` that differs from
    ``defaults`` (the group's default option parsed the same way; ``fixed``: fields the job sets)."""
    return [f"{group}.{f.name}={getattr(settings, f.name)!r}" for f in dataclasses.fields(settings)
            if f.name not in fixed and getattr(settings, f.name) != getattr(defaults, f.name)]


def settings_while_off(group: str, changed: list[str]) -> Optional[str]:
    """The refusal of ``changed`` settings of a feature group whose switch is off (None: none)."""
    if not changed:
        return None
    switch = FEATURE_SWITCHES[group]
    return (f"{', '.join(changed)} set while {switch}=false: the {group} group is read only when "
            f"its switch is on, so the run would silently ignore it; add {switch}=true (or drop "
            f"the {group}.* settings)")


def check_positive_ints(owner: str, obj: Any, names: tuple) -> None:
    """Raise ValueError naming ``<owner>.<name>`` for the first of ``names`` whose value on
    ``obj`` is not a positive int (a bool is not one): the sizes of the packed cache
    (``PackedSeqConfig``) and of the hooks' settings (``FastpathSettings``)."""
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{owner}.{name} must be a positive int; got {v!r}")
