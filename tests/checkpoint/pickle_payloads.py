"""Crafted ``.metadata`` payloads that would run code or reach outside if unpickled (each creates
a marker file or changes a torch object), and a real metadata object as torch writes it: built
here, used by the unpickling-safety tests and the checker's bounds table."""

import os
import pickle
import struct

import torch

META = "torch.distributed.checkpoint.metadata"


def _s(text: str) -> bytes:  # SHORT_BINUNICODE
    b = text.encode()
    return b"\x8c" + bytes([len(b)]) + b


def _p4(*body: bytes) -> bytes:  # PROTO 4 ... STOP
    return b"\x80\x04" + b"".join(body) + b"."


def _stack_global(module: str, name: str) -> bytes:
    return _s(module) + _s(name) + b"\x93"


def _call(callable_: bytes, *args: bytes, op=b"R") -> bytes:  # callable (args...) REDUCE
    return callable_ + b"(" + b"".join(args) + b"t" + op


def _system(marker) -> bytes:
    return _s(f"touch {marker}")


def payloads(marker):
    """name -> (bytes, whether plain pickle runs the command)."""
    cmd = _system(marker)
    ext_code = 0xF3
    out = {
        # the reported exploit: an allowed module plus a dotted name resolves to os.system
        "dotted-name-via-allowed-module": (_p4(_call(_stack_global(META, "os.system"), cmd)), True),
        "dotted-name-through-class": (_p4(_call(_stack_global(
            META, "Metadata.__init__.__globals__.__builtins__.exec"), _s(f"open({str(marker)!r},'w')"))), False),
        "unlisted-global-posix-system": (_p4(_call(_stack_global("posix", "system"), cmd)), True),
        "builtins-eval": (_p4(_call(_stack_global("builtins", "eval"), _s(f"open({str(marker)!r},'w')"))), True),
        "builtins-getattr": (_p4(_call(_call(_stack_global("builtins", "getattr"), _stack_global("os", "path"),
                                             _s("exists")), _s("x"))), False),
        "module-attribute-not-a-class": (_p4(_stack_global(META, "os")), False),
        "unlisted-name-in-allowed-module": (_p4(_call(_stack_global(META, "field"))), False),
        "copyreg-reconstructor": (_p4(_call(_stack_global("copyreg", "_reconstructor"),
                                            _stack_global("os", "_wrap_close"), _stack_global("builtins", "object"),
                                            b"N")), False),
        "torch-function-not-a-value": (_p4(_call(_stack_global("torch", "save"), b"N", _s(str(marker)))), True),
        # protocol 0/1: GLOBAL + REDUCE, INST, OBJ
        "proto0-global-reduce": (b"cposix\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.", True),
        "proto0-inst": (b"(V" + f"touch {marker}".encode() + b"\nios\nsystem\n.", True),
        "proto1-obj": (b"(cos\nsystem\nV" + f"touch {marker}".encode() + b"\no.", True),
        # protocol 2 names are renamed (__builtin__ -> builtins) before the check
        "proto2-py2-name": (b"\x80\x02c__builtin__\neval\nq\x00(V" + f"open({str(marker)!r},'w')".encode()
                            + b"\ntR.", True),
        # calling opcodes on objects that are listed but are not classes
        "reduce-on-a-dtype": (_p4(_call(_stack_global("torch", "float32"))), False),
        "newobj-on-a-function": (_p4(_stack_global("torch.serialization", "_get_layout") + b")" + b"\x81"), False),
        "get-layout-with-a-non-string": (_p4(_call(_stack_global("torch.serialization", "_get_layout"),
                                                   b"]" + _s("x") + b"a")), False),
        # BUILD on a function would poison its attributes (here torch's layout table)
        "build-on-a-function": (_p4(_stack_global("torch.serialization", "_get_layout")
                                    + b"}" + _s("cache") + b"}" + _s("torch.strided") + b"N" + b"s" + b"s" + b"b"),
                                False),
        "build-on-a-class": (_p4(_stack_global(META, "Metadata") + b"}" + _s("x") + b"Ns" + b"b"), False),
        # a real Metadata carrying a hostile object anywhere inside
        "nested-in-metadata": (pickle.dumps(_Nested(marker), protocol=5), True),
        # copyreg's extension registry maps a code to (module, name)
        "ext1": (b"\x80\x02\x82" + bytes([ext_code]) + b"(V" + f"touch {marker}".encode() + b"\ntR.", True),
        "ext2": (b"\x80\x02\x83" + struct.pack("<H", ext_code) + b"(V" + f"touch {marker}".encode() + b"\ntR.", True),
        "persistent-id": (b"\x80\x02Vx\nQ.", False),
    }
    for proto in range(6):
        out[f"reduce-protocol-{proto}"] = (pickle.dumps(_Evil(marker), protocol=proto), True)
    return out, ext_code


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Nested:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        from torch.distributed.checkpoint.metadata import Metadata

        return (Metadata, ({"w": _Evil(self.marker)},))


def _real_metadata():
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    props = TensorProperties(dtype=torch.bfloat16, layout=torch.strided, requires_grad=False,
                             memory_format=torch.channels_last, pin_memory=False)
    tensor = TensorStorageMetadata(properties=props, size=torch.Size([4, 2]),
                                   chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]),
                                                                sizes=torch.Size([4, 2]))])
    return Metadata(state_dict_metadata={"w": tensor}, planner_data={"w": ("w",)},
                    storage_data={MetadataIndex("w", torch.Size([0, 0]), 0): _StorageInfo("__0_0.distcp", 0, 64)},
                    storage_meta=StorageMeta(checkpoint_id="x", save_id="s", load_id=None)), BytesStorageMetadata
