"""Lazy, guarded imports of GPU-only packages (Transformer Engine, flash-attn, apex).

None of them installs or runs on a CPU machine, and a half-installed Transformer Engine raises
``RuntimeError`` (missing CUDA libraries) or ``OSError`` rather than ``ImportError`` at import
time. Every optional import in this package goes through :func:`optional_import` so a missing
or broken package is reported once, by name, with the alternatives.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Optional

__all__ = ["MissingDependencyError", "optional_import", "require", "have"]

# pip name and what to use instead, per importable module.
_PACKAGES = {
    "transformer_engine": ("transformer-engine[pytorch]", "megatron_fastpath[te]"),
    "transformer_engine.pytorch": ("transformer-engine[pytorch]", "megatron_fastpath[te]"),
    "flash_attn": ("flash-attn", "megatron_fastpath[flash]"),
    "apex": ("NVIDIA apex (build from source; not on PyPI under that name)", None),
    "nemo": ("nemo-toolkit[llm]>=2.7,<2.8", "megatron_fastpath[nemo]"),
}


class MissingDependencyError(ImportError):
    """An optional package needed by the requested feature is missing or broken."""


@functools.lru_cache(maxsize=None)
def _try_import(name: str) -> tuple[Optional[ModuleType], Optional[str]]:
    try:
        return importlib.import_module(name), None
    except (ImportError, RuntimeError, OSError, AttributeError) as exc:  # half-installed TE
        return None, f"{type(exc).__name__}: {exc}"


def optional_import(name: str) -> Optional[ModuleType]:
    """Import ``name`` or return None when it is missing or fails to initialise."""
    return _try_import(name)[0]


def have(name: str) -> bool:
    return optional_import(name) is not None


def require(name: str, feature: str, alternatives: str = "") -> ModuleType:
    """Import ``name`` or raise :class:`MissingDependencyError` naming the package to install,
    the reason the import failed, and the alternatives (e.g. other attention backends)."""
    module, why = _try_import(name)
    if module is not None:
        return module
    pip_name, extra = _PACKAGES.get(name, (name, None))
    msg = f"{feature} needs the package '{pip_name}', which could not be imported ({why})."
    if extra:
        msg += f" Install it with `pip install {extra}` on a CUDA machine."
    if alternatives:
        msg += f" Alternatives that need nothing extra: {alternatives}."
    raise MissingDependencyError(msg)
