"""The one place that knows which Megatron-Core version is installed.

Tested against megatron-core 0.16.1 (the newest release for Python 3.11). Every import of a
Megatron-Core symbol whose location or behaviour differs between releases goes through here.
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version

MIN_MCORE = Version("0.16.1")


def mcore_version() -> Version:
    try:
        return Version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError as exc:  # pragma: no cover - install error
        raise ImportError(
            "megatron_fastpath needs megatron-core>=0.16.1 (`pip install megatron-core`)"
        ) from exc


MCORE_VERSION = mcore_version()
if MCORE_VERSION < MIN_MCORE:  # pragma: no cover - guarded by install_requires
    raise ImportError(f"megatron-core {MCORE_VERSION} is too old; need >= {MIN_MCORE}")
