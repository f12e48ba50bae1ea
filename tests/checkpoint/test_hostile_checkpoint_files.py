"""Hostile files inside a checkpoint are one error naming the file and what is wrong: a
``.metadata`` whose ``storage_meta`` is of the wrong type, a ``.distcp`` that is a pickle or truncated (torch's multi-line traceback text, or a raw
AttributeError, before)."""

import json
import os
import pickle
import zlib

import pytest

from megatron_fastpath.checkpoint import UnsafeCheckpointError


def _keep_manifest_true(step_dir, name):
    """The manifest entry of ``name`` rewritten to the file's bytes (as a tamperer would)."""
    path = os.path.join(step_dir, "manifest.json")
    manifest = json.load(open(path))
    data = open(os.path.join(step_dir, name), "rb").read()
    manifest[name] = {"bytes": len(data), "crc32": zlib.crc32(data) if manifest[name]["crc32"] is not None else None}
    json.dump(manifest, open(path, "w"))


def _saved(tmp_path):
    from tests.checkpoint.ckpt_harness import Run

    run = Run().train(1)
    return run.save(tmp_path, keep=3).path


def _load_error(tmp_path) -> str:
    from tests.checkpoint.ckpt_harness import Run

    with pytest.raises(UnsafeCheckpointError) as e:  # a user error (exit 2), never a fallback
        Run(seed=3).load(tmp_path)
    return str(e.value)


def test_storage_meta_of_the_wrong_type(mcore_parallel, tmp_path):
    step = _saved(tmp_path)
    meta_path = os.path.join(step, "model", ".metadata")
    meta = pickle.loads(open(meta_path, "rb").read())
    meta.storage_meta = "not a StorageMeta"
    open(meta_path, "wb").write(pickle.dumps(meta))
    _keep_manifest_true(step, "model/.metadata")
    assert _load_error(tmp_path) == (
        f"{meta_path} has a storage_meta of type str, not a StorageMeta: damaged or not written by "
        "torch.distributed.checkpoint; refusing to load it")


def _saved_distcp(tmp_path):
    """A saved step and its first ``.distcp``: (step dir, model dir, file name, path)."""
    step = _saved(tmp_path)
    model = os.path.join(step, "model")
    name = sorted(n for n in os.listdir(model) if n.endswith(".distcp"))[0]
    return step, model, name, os.path.join(model, name)


def test_a_distcp_that_is_a_pickle(mcore_parallel, tmp_path):
    step, model, name, path = _saved_distcp(tmp_path)
    payload = pickle.dumps({"a": 1})  # padded to the file's size: only its contents differ
    open(path, "r+b").write(payload + b"\0" * (os.path.getsize(path) - len(payload)))
    _keep_manifest_true(step, f"model/{name}")
    msg = _load_error(tmp_path)
    assert msg.startswith(f"{os.path.join(model, name)} holds tensor ") and "\n" not in msg
    assert msg.endswith("(a pickle), not torch.save data: damaged or not written by "
                        "torch.distributed.checkpoint; refusing to load it")


def test_a_truncated_distcp(mcore_parallel, tmp_path):
    step, model, name, path = _saved_distcp(tmp_path)
    os.truncate(path, os.path.getsize(path) // 2)
    _keep_manifest_true(step, f"model/{name}")
    msg = _load_error(tmp_path)
    assert msg.startswith(f"{path} is {os.path.getsize(path)} bytes but holds tensor ") and "(truncated)" in msg


def test_a_real_checkpoint_still_loads(mcore_parallel, tmp_path):
    from tests.checkpoint.ckpt_harness import Run

    _saved(tmp_path)
    assert Run(seed=3).load(tmp_path).step == 1
