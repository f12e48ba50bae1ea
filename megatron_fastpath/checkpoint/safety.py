"""Loading without unpickling untrusted bytes.

A torch_dist checkpoint holds three kinds of files: tensor data (``__<rank>_<i>.distcp``, read
by torch.distributed.checkpoint with ``torch.load(weights_only=True)``), ``common.pt`` (read by
Megatron with torch.load's default, ``weights_only=True`` in torch >= 2.6) and ``.metadata``, a
plain pickle that torch.distributed.checkpoint reads with ``pickle.load``
(``FileSystemReader.read_metadata``). Before anything is loaded, :func:`check_safe_to_load`
reads ``.metadata`` with :class:`_MetadataUnpickler` and ``common.pt`` with
``weights_only=True``; a file that needs anything else is refused with what it asked for.
Byte items (Megatron ``ShardedObject``s, which torch.distributed.checkpoint would unpickle with
``weights_only=False``) are never written nor requested, and a ``.metadata`` that describes any
entry as bytes is refused: the planner would read it with full unpickling whatever was asked.
Everything else we write is JSON or safetensors.

The metadata unpickler closes the class of bug, not one payload:

* globals are explicit ``(module, name)`` pairs (:data:`_CLASSES`, :data:`_TORCH_VALUES`);
  a dotted name (``pickle`` resolves protocol-4 names as attribute paths, so an allowed module
  plus ``os.system`` would otherwise reach any object) is refused, and so is every name not
  listed, whatever its module;
* the resolved object must be what the table says: a class whose ``__module__`` and
  ``__qualname__`` are the listed ones (so a name re-exported from elsewhere, or replaced by
  an attribute of the module, is refused), or a ``torch.dtype`` / ``torch.memory_format`` /
  ``torch.layout`` value of module ``torch``;
* every opcode that calls something checks what it calls: REDUCE, NEWOBJ, NEWOBJ_EX, OBJ and
  INST only call a listed class (REDUCE also the one listed lookup function, torch's
  ``_get_layout``, with one string argument); BUILD only sets the state of an instance of a listed class;
  EXT1/2/4 (the ``copyreg`` extension registry) and
  persistent ids are refused.

It runs on pickle's pure-Python ``_Unpickler`` (whose opcode table can be checked per opcode),
which reads the same bytes as the C unpickler torch.distributed.checkpoint uses afterwards.
Before it builds anything, :func:`~megatron_fastpath.checkpoint.pickle_scan.scan` walks the
opcodes with the same allow-list and bounds the stream, the memo, nesting depth, objects built
and objects hashed or passed to calls by the file's size, so neither unpickler can be made to
crash, hang or exhaust memory by the file. Refusals are one line and never print the file's
objects, only their type and size.
"""

from __future__ import annotations

import gc
import importlib
import io
import os
import pickle

import torch

from megatron_fastpath.checkpoint.pickle_scan import Refusal, clip, scan
from megatron_fastpath.checkpoint.errors import UnsafeCheckpointError
from megatron_fastpath.compat.dist_ckpt import megatron_common_state_key

__all__ = ["UnsafeCheckpointError", "check_safe_to_load", "safe_load_metadata"]

# The classes a torch_dist ``.metadata`` holds (torch 2.6-2.13 torch.distributed.checkpoint,
# Megatron 0.16's ``mcore_data``), each as (module, qualified name). Nothing else is resolved.
_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
              "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.planner", n)
    for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData",
              "LoadPlan", "ReadItem", "LoadItemType")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}
# Functions a pickle may call (REDUCE only), each with the one argument type it takes: torch
# pickles a layout as ``_get_layout("torch.strided")`` (torch/serialization.py, copyreg.pickle
# for torch.layout), a lookup in a table of torch's layouts.
_FUNCTIONS = {("torch.serialization", "_get_layout"): str}
_FUNCTIONS_BY_OBJECT = {getattr(importlib.import_module(m), n): t for (m, n), t in _FUNCTIONS.items()}
# Values of module ``torch`` a pickle may name (dtypes, layouts and memory formats pickle
# themselves as globals); checked by type, not by name.
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


def _refuse(path: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} would {what}: refusing to load it (unpickling it could run arbitrary code "
        "from the file). A torch_dist .metadata holds only torch.distributed.checkpoint "
        "metadata classes, torch.Size, dtypes and plain containers; if this checkpoint was "
        "written by torch.distributed.checkpoint itself, report the class named above."
    )


def _unreadable(path: str, why: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{path} is not a readable checkpoint metadata file: {why}")


def _over_bound(path: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} would {what}: refusing to load it (a .metadata written by "
        "torch.distributed.checkpoint stays far below this bound; the file is damaged or crafted)"
    )


def _what(obj) -> str:
    """A loaded object named by type and size, never by its contents (which may be huge)."""
    if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):
        return clip(f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}")
    size = f" of {len(obj)} items" if isinstance(obj, (tuple, list, dict, set, frozenset)) else ""
    return f"a {type(obj).__qualname__}{size}"


def _resolve(path: str, module: str, name: str):
    """The object ``module.name`` if the table allows it, else UnsafeCheckpointError."""
    label = clip(f"{module}.{name}")
    if "." in name:
        raise _refuse(path, f"look up the attribute path {label}")
    listed = (module, name) in _CLASSES or (module, name) in _FUNCTIONS
    if not listed and module != "torch":
        raise _refuse(path, f"unpickle {label}, which is not a checkpoint-metadata class")
    try:
        obj = vars(importlib.import_module(module))[name]
    except (ImportError, KeyError) as exc:
        raise _refuse(path, f"unpickle {label}, which does not exist") from exc
    if listed:
        kind = type if (module, name) in _CLASSES else type(_resolve)
        if not (isinstance(obj, kind) and obj.__module__ == module and obj.__qualname__ == name):
            raise _refuse(path, f"unpickle {label}, which is not the listed {kind.__name__}")
        return obj
    if type(obj) in _TORCH_VALUE_TYPES:
        return obj
    raise _refuse(path, f"unpickle {label}, which is not a dtype, layout or memory format")


def _py3_name(module: str, name: str, proto: int) -> tuple:
    """The renaming of Python 2 names both unpicklers apply to protocols 0-2 (fix_imports)."""
    if proto < 3:
        from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING

        if (module, name) in NAME_MAPPING:
            return NAME_MAPPING[(module, name)]
        if module in IMPORT_MAPPING:
            return IMPORT_MAPPING[module], name
    return module, name


def _load_checked(path: str, data: bytes):
    """The bounded opcode walk, then the checked unpickler over the same bytes."""
    try:
        scan(data, lambda module, name, proto: _resolve(path, *_py3_name(module, name, proto)),
             _FUNCTIONS_BY_OBJECT)
    except Refusal as exc:
        if exc.kind == "unsafe":
            raise _refuse(path, exc.what) from None
        raise (_over_bound if exc.kind == "resource" else _unreadable)(path, exc.what) from None
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # anything else the opcode reader raises: the file is not a pickle
        raise _unreadable(path, clip(f"{type(exc).__name__}: {exc}", 300)) from None
    try:
        return _MetadataUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise _unreadable(path, clip(f"{type(exc).__name__}: {exc}", 300)) from exc


class _MetadataUnpickler(pickle._Unpickler):
    """pickle's pure-Python unpickler with every calling opcode checked (module docstring)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path
        self.classes: set = set()  # the listed classes this file resolved, by identity
        self.functions: dict = {}  # the listed functions it resolved -> their argument type

    def find_class(self, module: str, name: str):
        module, name = _py3_name(module, name, self.proto)
        obj = _resolve(self.path, module, name)
        if isinstance(obj, type):
            self.classes.add(obj)
        elif (module, name) in _FUNCTIONS:
            self.functions[obj] = _FUNCTIONS[(module, name)]
        return obj

    def persistent_load(self, pid):
        raise _refuse(self.path, "resolve a persistent id")

    def _callable(self, cls, opcode: str):
        if not (isinstance(cls, type) and cls in self.classes):
            raise _refuse(self.path, f"call {_what(cls)} ({opcode})")
        return cls

    def _load_reduce(self):
        func, args = self.stack[-2], self.stack[-1]
        if type(func) is type(_resolve) and func in self.functions:
            if not (type(args) is tuple and len(args) == 1 and type(args[0]) is self.functions[func]):
                raise _refuse(self.path, f"call {func.__qualname__} with {_what(args)} (REDUCE)")
        else:
            self._callable(func, "REDUCE")
        pickle._Unpickler.load_reduce(self)

    def _load_newobj(self):
        self._callable(self.stack[-2], "NEWOBJ")
        pickle._Unpickler.load_newobj(self)

    def _load_newobj_ex(self):
        self._callable(self.stack[-3], "NEWOBJ_EX")
        pickle._Unpickler.load_newobj_ex(self)

    def _instantiate(self, klass, args):
        self._callable(klass, "INST/OBJ")
        return pickle._Unpickler._instantiate(self, klass, args)

    def _load_build(self):
        inst = self.stack[-2]
        if type(inst) not in self.classes:
            raise _refuse(self.path, f"set the state of a {type(inst).__qualname__} (BUILD)")
        pickle._Unpickler.load_build(self)

    def _load_ext(self):
        raise _refuse(self.path, "call through the copyreg extension registry (EXT1/2/4)")

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _load_build
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _load_ext
    del _op


def safe_load_metadata(path: str):
    """torch.distributed.checkpoint's ``.metadata`` unpickled with every call checked, after a
    bounded walk of its opcodes (module docstring)."""
    with open(path, "rb") as f:
        data = f.read()
    # Both passes allocate an object or two per opcode and (cycles being refused) free them by
    # reference counting: the cyclic collector would only rescan them, again and again.
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        meta = _load_checked(path, data)
    finally:
        if gc_was_on:
            gc.enable()
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(meta, Metadata):
        raise UnsafeCheckpointError(f"{path} holds a {type(meta).__qualname__}, not torch.distributed."
                                    "checkpoint Metadata: not a torch_dist checkpoint")
    return meta


def _check_common_state_bytes(model_dir: str, meta_path: str, metadata, key: str) -> None:
    """The bytes torch.distributed.checkpoint would unpickle for ``key`` (Megatron 0.19's common
    state, compat.dist_ckpt) load with ``weights_only=True``: the same bytes, read from the
    same file slice, hold nothing a full unpickling could run beyond tensors and plain data."""
    infos = [i for k, i in metadata.storage_data.items() if k.fqn == key]
    if len(infos) != 1 or getattr(infos[0], "transform_descriptors", None):
        raise UnsafeCheckpointError(f"{meta_path} stores {key!r} in {len(infos)} places or "
                                    "through a storage transform: refusing to load")
    info = infos[0]
    real = os.path.realpath(model_dir)
    path = os.path.realpath(os.path.join(model_dir, info.relative_path))
    if os.path.commonpath([path, real]) != real or not os.path.isfile(path) \
            or info.offset + info.length > os.path.getsize(path):
        raise UnsafeCheckpointError(f"{meta_path} places {key!r} outside the checkpoint's "
                                    "files: refusing to load")
    with open(path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, or bytes that are no torch.save archive
        raise UnsafeCheckpointError(
            f"{meta_path}: Megatron's common state {key!r} needs arbitrary unpickling "
            f"(torch.load weights_only=True refused it: {str(exc).splitlines()[0][:200]}); "
            "refusing to load") from exc


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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_fastpath.checkpoint.metadata_fields import check_fields, check_tensor_data

    metadata = safe_load_metadata(meta)
    check_fields(meta, metadata)
    not_tensors = sorted(k for k, v in metadata.state_dict_metadata.items()
                         if not isinstance(v, TensorStorageMetadata))
    common_key = megatron_common_state_key()
    common_in_files = common_key in not_tensors  # megatron-core 0.19: checked below
    if common_in_files:
        not_tensors.remove(common_key)
    if not_tensors:
        # torch.distributed.checkpoint's planner reads an entry described as bytes with
        # torch.load(weights_only=False) (default_planner.py, load_bytes), even for a key the
        # caller asked as a tensor: a metadata file could route a tensor through full unpickling.
        raise UnsafeCheckpointError(
            f"{meta} describes {not_tensors[:3]}{' ...' if len(not_tensors) > 3 else ''} as byte "
            "objects, which torch.distributed.checkpoint would read with full unpickling; "
            "checkpoints written by megatron_fastpath hold tensors only: refusing to load"
        )
    check_tensor_data(model_dir, metadata)
    if common_in_files:
        _check_common_state_bytes(model_dir, meta, metadata, common_key)
    common = os.path.join(model_dir, "common.pt")
    if os.path.exists(common):
        try:
            torch.load(common, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"{common} needs arbitrary unpickling (torch.load weights_only=True refused it: "
                f"{str(exc).splitlines()[0]}); refusing to load"
            ) from exc
