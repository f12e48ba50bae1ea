"""Crafted safetensors files and indexes are refused with the file named, never a raw
TypeError / KeyError / RecursionError, and without reading a huge declared header (issue 27
items 10 and 11)."""

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
