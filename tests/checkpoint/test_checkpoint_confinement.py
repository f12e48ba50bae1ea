"""What a checkpoint run touches on disk: a save removes only its own leftovers, and a load opens
only regular files inside the checkpoint that its manifest lists (``.metadata``'s storage
entries included), refusing anything else in one line before opening it."""

import contextlib
import dataclasses
import json
import os
import pickle
import shutil
import signal

import pytest
import torch

from tests.checkpoint.ckpt_harness import Run
from megatron_fastpath.checkpoint import CheckpointCorruptError, UnsafeCheckpointError


@contextlib.contextmanager
def deadline(seconds=60):
    """Turn a hang (a FIFO opened for reading) into a test failure."""
    def expired(*_):
        raise TimeoutError(f"still blocked after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _relist(path, *names):
    """Record ``names`` (files of checkpoint ``path``) in its manifest as they are now."""
    from megatron_fastpath.checkpoint.files import _crc32

    mpath = os.path.join(path, "manifest.json")
    manifest = json.load(open(mpath))
    for name in names:
        fp = os.path.join(path, name)
        manifest[name] = {"bytes": os.path.getsize(fp), "crc32": _crc32(fp)}
    json.dump(manifest, open(mpath, "w"))


def _point_storage_at(path, relative_path):
    """Rewrite ``.metadata`` of checkpoint ``path`` so that every tensor is read from
    ``relative_path`` (and list the new ``.metadata`` in the manifest: only the storage names
    are wrong)."""
    from megatron_fastpath.checkpoint.safety import safe_load_metadata

    meta_path = os.path.join(path, "model", ".metadata")
    meta = safe_load_metadata(meta_path)
    meta.storage_data = {k: dataclasses.replace(v, relative_path=relative_path)
                         for k, v in meta.storage_data.items()}
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)
    _relist(path, "model/.metadata")


def test_a_save_leaves_entries_it_did_not_write_alone(mcore_parallel, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".tmp.mine").mkdir()
    (ckpt / ".tmp.mine" / "notes.txt").write_text("mine")
    (ckpt / ".trash.keep-me").write_text("mine too")
    (ckpt / "step_notes").mkdir()  # looks like a checkpoint by its prefix and manifest
    (ckpt / "step_notes" / "manifest.json").write_text("{}")
    (ckpt / ".tmp.step_00000007").mkdir()  # a killed save of this package: cleared
    (ckpt / ".trash.step_00000003").mkdir()  # a killed rotation of this package: cleared
    run = Run().train(1)
    run.save(ckpt, keep=1)
    run.train(1).save(ckpt, keep=1)
    assert sorted(os.listdir(ckpt)) == [".tmp.mine", ".trash.keep-me", "latest", "step_00000002",
                                        "step_notes"]
    assert (ckpt / ".tmp.mine" / "notes.txt").read_text() == "mine"
    assert (ckpt / ".trash.keep-me").read_text() == "mine too"
    assert (ckpt / "step_notes" / "manifest.json").read_text() == "{}"


def test_storage_entries_outside_the_checkpoint_are_refused(mcore_parallel, tmp_path):
    """A .metadata naming ``../../../elsewhere/__0_0.distcp``: the tensors there (a copy of the
    real shard, so loading them would succeed) are never read."""
    saved = Run().train(1).save(tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(os.path.join(saved.path, "model", "__0_0.distcp"), elsewhere / "__0_0.distcp")
    _point_storage_at(saved.path, "../../../elsewhere/__0_0.distcp")
    with pytest.raises(UnsafeCheckpointError,
                       match=r"/model: \.metadata's storage entry '\.\./\.\./\.\./elsewhere/__0_0\.distcp' "
                             r"leaves the checkpoint directory: refusing to load the checkpoint"):
        Run(seed=4).load(tmp_path / "ckpt")


@pytest.mark.parametrize("kind", ["absolute", "link", "unlisted"])
def test_storage_entries_that_are_not_listed_regular_files_inside_are_refused(mcore_parallel, tmp_path, kind):
    saved = Run().train(1).save(tmp_path / "ckpt")
    model = os.path.join(saved.path, "model")
    outside = tmp_path / "__0_0.distcp"
    shutil.copy(os.path.join(model, "__0_0.distcp"), outside)
    if kind == "absolute":
        name, why = str(outside), "is not a file name inside the checkpoint"
    elif kind == "link":  # a link inside, to the shard outside
        os.symlink(outside, os.path.join(model, "shard.distcp"))
        name, why = "shard.distcp", r"is not a regular file \(a link"
    else:  # a regular file inside that the manifest does not list (no CRC was checked)
        shutil.copy(outside, os.path.join(model, "other.distcp"))
        name, why = "other.distcp", r"is not listed in the checkpoint's manifest.json"
    _point_storage_at(saved.path, name)
    with pytest.raises(UnsafeCheckpointError, match=rf"storage entry '{name}' {why}"):
        Run(seed=4).load(tmp_path / "ckpt")


def test_a_storage_entry_naming_a_fifo_is_refused_without_blocking(mcore_parallel, tmp_path):
    saved = Run().train(1).save(tmp_path / "ckpt")
    os.mkfifo(os.path.join(saved.path, "model", "pipe"))
    _point_storage_at(saved.path, "pipe")
    with deadline(), pytest.raises(UnsafeCheckpointError,
                                   match=r"storage entry 'pipe' is not a regular file \(a link, FIFO"):
        Run(seed=4).load(tmp_path / "ckpt")


def test_a_fifo_listed_in_the_manifest_is_refused_without_blocking(mcore_parallel, tmp_path):
    saved = Run().train(1).save(tmp_path / "ckpt")
    os.mkfifo(os.path.join(saved.path, "model", "pipe"))
    manifest = json.load(open(os.path.join(saved.path, "manifest.json")))
    manifest["model/pipe"] = {"bytes": 0, "crc32": 0}
    json.dump(manifest, open(os.path.join(saved.path, "manifest.json"), "w"))
    with deadline(), pytest.raises(CheckpointCorruptError,
                                   match=r"model/pipe is not a regular file \(a link, FIFO, device or "
                                         r"directory\): refusing to open it"):
        Run(seed=4).load(tmp_path / "ckpt")


def test_an_intact_checkpoint_still_loads_exactly(mcore_parallel, tmp_path):
    run = Run().train(2)
    run.save(tmp_path / "ckpt")
    other = Run(seed=4)
    assert other.load(tmp_path / "ckpt").step == 2
    for k, v in run.params().items():
        assert torch.equal(other.params()[k], v), k


def test_checkpoint_base_dir_is_confined_the_same_way(mcore_parallel, tmp_path):
    """``checkpoint.base_dir`` is a bare torch_dist directory (no manifest): its storage entries
    must still be regular files inside it (what the main job's load_base checks first)."""
    from megatron_fastpath.checkpoint.storage import check_storage_files

    saved = Run().train(1).save(tmp_path / "ckpt")
    base = tmp_path / "base"
    shutil.copytree(os.path.join(saved.path, "model"), base)
    check_storage_files(str(base))  # as written: accepted
    shutil.copy(base / "__0_0.distcp", tmp_path / "__0_0.distcp")
    _point_storage_at(saved.path, "../__0_0.distcp")
    shutil.copy(os.path.join(saved.path, "model", ".metadata"), base / ".metadata")
    with pytest.raises(UnsafeCheckpointError, match=r"/base: \.metadata's storage entry "
                                                    r"'\.\./__0_0\.distcp' leaves the checkpoint"):
        check_storage_files(str(base))
