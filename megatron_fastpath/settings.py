"""Typed settings: every config group is a frozen dataclass, and :func:`check_values` checks a
group's raw values against its fields before the dataclass is built -- the type of each field
(``int``, ``float``, ``bool``, ``str``, ``Optional[...]``) and, where a field declares one with
:func:`setting`, its range -- so a bad override (``training.steps=abc``, ``training.lr=nan``,
``parallel.tensor_model_parallel_size=-1``) is refused at parse, naming the key, before any model
or optimizer exists.

Each field of a config group is declared with :func:`setting`: its default, its one-line
description (the one home of the key's description: ``python -m megatron_fastpath.train --help``
prints it, :func:`describe` reads it) and its bound, if any.
"""

from __future__ import annotations

import dataclasses
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


def check_values(group: str, cls: type, data: dict) -> None:
    """Raise ValueError naming ``<group>.<field>`` for the first value of ``data`` that does not
    fit the field of ``cls`` it sets (type, then bound). Fields typed otherwise (Any, tuples,
    nested configs) are left to the dataclass."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value, kind, optional = data[f.name], hints.get(f.name), False
        if typing.get_origin(kind) is Union:
            args = typing.get_args(kind)
            optional = type(None) in args
            rest = [a for a in args if a is not type(None)]
            kind = rest[0] if len(rest) == 1 else None
        if kind not in _KIND:
            continue
        key = f"{group}.{f.name}"
        if value is None:
            if optional:
                continue
            raise ValueError(f"{key}=null: must be {_KIND[kind]} (the default is {f.default!r})")
        if not _fits(value, kind):
            raise ValueError(f"{key}={value!r}: must be {_KIND[kind]}"
                             + (" or null" if optional else "") + f" (the default is {f.default!r})")
        bound = f.metadata.get("bound")
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
