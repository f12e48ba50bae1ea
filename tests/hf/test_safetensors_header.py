"""Crafted safetensors files and indexes are refused with the file named, never a raw
TypeError / KeyError / RecursionError, and without reading a huge declared header."""

import json
import os
import struct

import pytest
import torch

from megatron_fastpath.hf.checkpoint import CheckpointError, SafetensorsCheckpoint


def _write(path, header_bytes: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)


def _header(obj) -> bytes:
    return json.dumps(obj).encode()


GOOD = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
CASES = {
    "header-is-a-list": (_header([1, 2]), "its header is a list, not an object"),
    "entry-not-an-object": (_header({"w": 3}), "tensor 'w' has a header entry of type int"),
    "no-dtype": (_header({"w": {"shape": [2], "data_offsets": [0, 8]}}), "has no dtype string"),
    "negative-shape": (_header({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}), "has shape"),
    "shape-not-a-list": (_header({"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}), "has shape"),
    "reversed-offsets": (_header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}), "data_offsets"),
    "offsets-missing": (_header({"w": {"dtype": "F32", "shape": [2]}}), "data_offsets None"),
    "deep-nesting": (b"[" * 100000 + b"]" * 100000, "bad header: RecursionError"),
    "not-json": (b"\xff\xfe garbage", "bad header"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_header_refused_naming_the_file(tmp_path, case):
    raw, match = CASES[case]
    _write(tmp_path / "model.safetensors", raw, b"\0" * 8)
    with pytest.raises(CheckpointError, match="model.safetensors: .*" + match.replace("(", r"\(")):
        SafetensorsCheckpoint(str(tmp_path))


def test_huge_declared_header_is_not_read(tmp_path, monkeypatch):
    """A sparse file declaring a 4 GiB header: refused from its 8 length bytes."""
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 4 << 30))
        f.truncate(8 + (4 << 30) + 16)  # sparse: no disk used
    reads = []
    real_open = open

    def counting_open(p, mode="r", *a, **k):
        f = real_open(p, mode, *a, **k)
        if "b" in mode:
            real_read = f.read
            f.read = lambda n=-1: reads.append(n) or real_read(n)
        return f

    monkeypatch.setattr("builtins.open", counting_open)
    with pytest.raises(CheckpointError, match=r"declares a header of 4294967296 bytes; the format allows"):
        SafetensorsCheckpoint(str(tmp_path))
    assert reads == [8]


def test_real_file_still_reads(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.arange(4.0)}, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    assert torch.equal(ckpt.get("w"), torch.arange(4.0))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_index_naming_a_file_outside_the_directory_is_refused(tmp_path, name):
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory: refusing to open it"):
        SafetensorsCheckpoint(str(model))


def test_index_link_leaving_the_directory_is_refused(tmp_path):
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    os.symlink(tmp_path / "outside.safetensors", model / "shard.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "shard.safetensors"}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        SafetensorsCheckpoint(str(model))


def test_a_linked_model_safetensors_is_refused_by_its_own_name(tmp_path):
    """A single model.safetensors that links out of the directory: the message names it (not
    model.safetensors.index.json, which does not exist); a linked shard likewise."""
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    os.symlink(tmp_path / "outside.safetensors", model / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        SafetensorsCheckpoint(str(model))
    assert str(e.value) == (f"{model / 'model.safetensors'} is a link to {tmp_path / 'outside.safetensors'}, "
                            "which is outside the checkpoint directory: refusing to open it")
    os.unlink(model / "model.safetensors")
    os.symlink(tmp_path / "outside.safetensors", model / "shard.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "shard.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"model/shard.safetensors is a link to .*outside.safetensors"):
        SafetensorsCheckpoint(str(model))


LAYOUT = {
    "overlapping-offsets": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                             "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12,
                            "tensor 'b' has data_offsets [4, 12], overlapping tensor 'a' (which ends at 8)"),
    "same-offsets": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 8, "overlapping tensor"),
    "dtype-vs-bytes": ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 6]}}, 8,
                       "tensor 'w' is F32 [2] (8 bytes) but its data_offsets [0, 6] hold 6 bytes"),
    "bf16-vs-bytes": ({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 16]}}, 16,
                      "tensor 'w' is BF16 [4] (8 bytes) but its data_offsets [0, 16] hold 16 bytes"),
}


@pytest.mark.parametrize("case", sorted(LAYOUT))
def test_tensor_layout_is_checked_naming_the_file(tmp_path, case):
    """Overlapping byte ranges and a dtype / shape that does not fit its bytes: one
    CheckpointError naming the file and the tensor (safetensors' own SafetensorError, a
    traceback, came only when the tensor was read)."""
    header, size, match = LAYOUT[case]
    _write(tmp_path / "model.safetensors", _header(header), b"\0" * size)
    with pytest.raises(CheckpointError) as e:
        ckpt = SafetensorsCheckpoint(str(tmp_path))
        for name in header:
            ckpt.get(name)
    assert str(e.value).startswith(f"{tmp_path / 'model.safetensors'}: ") and match in str(e.value)
    assert str(e.value).endswith("not a valid safetensors file")


def test_the_librarys_own_errors_name_the_file(tmp_path, monkeypatch):
    """What the header checks leave to safetensors (e.g. a dtype it does not know) is one
    CheckpointError naming the file when the tensor is read."""
    _write(tmp_path / "model.safetensors", _header({"w": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}),
           b"\0" * 8)
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a valid safetensors file \(.*\); re-download"):
        ckpt.get("w")
