"""The local Hugging Face Hub cache: a Hub id (``org/name``) for ``model.path`` or ``data.path``
resolves to the snapshot huggingface_hub downloaded there. The job downloads nothing (a
training job on a cluster node has no network to count on): what is not cached is refused with
the download command."""

from __future__ import annotations

import os
import re
from typing import Optional

__all__ = ["HUB_ID", "hub_cache", "hub_cache_snapshot", "looks_like_hub_id"]

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def looks_like_hub_id(path: str) -> bool:
    """``path`` names nothing on disk and has the shape of a Hub id (``org/name``)."""
    return not os.path.exists(path) and HUB_ID.match(path) is not None


def hub_cache() -> str:
    """huggingface_hub's cache directory: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (huggingface_hub/constants.py's order)."""
    return os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")


def hub_cache_snapshot(repo_id: str, repo_type: str = "model") -> Optional[str]:
    """The local hub cache's snapshot of ``repo_id`` at its ``main`` ref, or None. The layout is
    the one huggingface_hub writes: ``<models|datasets>--<org>--<name>/refs/main`` holds the
    commit, ``snapshots/<commit>/`` the files. A model snapshot must hold config.json; a dataset
    snapshot must exist."""
    if repo_type not in ("model", "dataset"):
        raise ValueError(f"repo_type must be 'model' or 'dataset'; got {repo_type!r}")
    repo = os.path.join(hub_cache(), f"{repo_type}s--" + repo_id.replace("/", "--"))
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            commit = f.read().strip()
    except OSError:
        return None
    snapshot = os.path.join(repo, "snapshots", commit)
    if not commit or not os.path.isdir(snapshot):
        return None
    if repo_type == "model" and not os.path.isfile(os.path.join(snapshot, "config.json")):
        return None
    return snapshot
