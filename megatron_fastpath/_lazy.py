"""Lazy public names of a package (PEP 562): importing the package does not import Megatron;
``package.Name`` imports the module that defines it on first use."""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_getattr(package: str, table: dict) -> Callable[[str], object]:
    """The package's module ``__getattr__``: ``table`` maps a public name to its module."""

    def __getattr__(name: str):
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
