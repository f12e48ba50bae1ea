"""Loading without unpickling untrusted bytes.

A torch_dist checkpoint holds three kinds of files: tensor data (``__<rank>_<i>.distcp``, read
by torch.distributed.checkpoint with ``torch.load(weights_only=True)``), ``common.pt`` (read by
Megatron with torch.load's default, ``weights_only=True`` in torch >= 2.6) and ``.metadata``, a
plain pickle that torch.distributed.checkpoint reads with ``pickle.load``. Before anything is
loaded, :func:`check_safe_to_load` unpickles ``.metadata`` with an allow-list (the
torch.distributed.checkpoint metadata classes, torch.Size, dtypes) and ``common.pt`` with
``weights_only=True``; a file that needs anything else is refused with the global it asked for.
Byte items (Megatron ``ShardedObject``s, which torch.distributed.checkpoint would unpickle with
``weights_only=False``) are never requested: our loads ask for tensors only.
Everything else we write is JSON.
"""

from __future__ import annotations

import os
import pickle

import torch

__all__ = ["UnsafeCheckpointError", "check_safe_to_load", "safe_load_metadata"]

# module -> allowed names (None: every name the module defines is a plain metadata class)
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem",
        "LoadItemType",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch._utils": {"_rebuild_tensor_v2"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class UnsafeCheckpointError(RuntimeError):
    """The checkpoint would need arbitrary unpickling (or an unsafe loader) to be read."""


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):
        allowed = _ALLOWED.get(module, set())
        ok = allowed is None or name in allowed
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            ok = True
        if not ok:
            raise UnsafeCheckpointError(
                f"{self.path} would unpickle {module}.{name}, which is not a checkpoint-metadata "
                "class: refusing to load it (loading it would run arbitrary code from the file). "
                "Only torch.distributed.checkpoint metadata, torch.Size and dtypes are accepted."
            )
        return super().find_class(module, name)


def safe_load_metadata(path: str):
    """torch.distributed.checkpoint's ``.metadata`` unpickled with the allow-list."""
    with open(path, "rb") as f:
        try:
            return _AllowListUnpickler(f, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as exc:
            raise UnsafeCheckpointError(f"{path} is not a readable checkpoint metadata file: {exc}") from exc


def check_safe_to_load(model_dir: str) -> None:
    """Refuse (with the reason) a torch_dist directory that would need arbitrary unpickling."""
    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
        raise UnsafeCheckpointError(
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: Megatron would read common.pt with full "
            "unpickling; unset it to load checkpoints"
        )
    legacy = [f for f in os.listdir(model_dir) if f.endswith((".pt", ".pth", ".bin", ".pkl")) and f != "common.pt"]
    if legacy:
        raise UnsafeCheckpointError(
            f"{model_dir} holds {sorted(legacy)}: a torch.save/pickle checkpoint needs arbitrary "
            "unpickling and is not loaded; convert it to Megatron's torch_dist format"
        )
    meta = os.path.join(model_dir, ".metadata")
    if not os.path.exists(meta):
        raise UnsafeCheckpointError(f"{model_dir} has no .metadata: not a torch_dist checkpoint")
    safe_load_metadata(meta)
    common = os.path.join(model_dir, "common.pt")
    if os.path.exists(common):
        try:
            torch.load(common, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"{common} needs arbitrary unpickling (torch.load weights_only=True refused it: "
                f"{str(exc).splitlines()[0]}); refusing to load"
            ) from exc
