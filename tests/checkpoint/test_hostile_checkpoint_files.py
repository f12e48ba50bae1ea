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


class _PrintsWhenUnpickled:
    """A common-state object whose unpickling calls a function (here a harmless print)."""

    def __reduce__(self):
        return (print, ("unpickled",))


@pytest.mark.parametrize("evil", [False, True])
def test_common_state_needing_arbitrary_unpickling_is_refused(mcore_parallel, tmp_path, evil):
    """Megatron's common state: common.pt on 0.16.x; on 0.19.x one byte object inside the
    torch_dist files (compat.dist_ckpt.megatron_common_state_key), which Megatron reads back
    with full unpickling: let through only when its exact bytes load weights-only."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_fastpath import compat
    from megatron_fastpath.checkpoint.safety import check_safe_to_load
    from megatron_fastpath.compat.dist_ckpt import (
        dist_checkpointing_on_cpu,
        dist_checkpointing_save_kwargs,
    )

    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3), replica_id=0),
          "step": 3}
    if evil:
        sd["extra"] = _PrintsWhenUnpickled()
    model = tmp_path / "model"
    model.mkdir()
    with dist_checkpointing_on_cpu():
        dist_checkpointing.save(sd, str(model), **dist_checkpointing_save_kwargs())
    on_0_19 = compat.mcore_line() == (0, 19)
    assert os.path.exists(model / "common.pt") is not on_0_19
    if not evil:
        check_safe_to_load(str(model))
        return
    where = (f"{model}/.metadata: Megatron's common state 'common_state/shard_0_1' needs "
             "arbitrary unpickling" if on_0_19 else f"{model}/common.pt needs arbitrary unpickling")
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load$") as err:
        check_safe_to_load(str(model))
    assert str(err.value).startswith(where) and "\n" not in str(err.value)
