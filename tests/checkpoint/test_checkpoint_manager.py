"""CheckpointManager on a real training loop (torch_dist through Megatron's dist_checkpointing,
CPU): exact resume, atomic publish, rotation, corruption / mismatch / unsafe-pickle refusals,
fallback to the previous checkpoint, async save."""

import json
import os
import pickle

import pytest
import torch

from tests.checkpoint.ckpt_harness import LORA, SHAPE, STEPS, JsonPart, Run
from megatron_fastpath.checkpoint import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
)
from megatron_fastpath.lora import LoRAConfig


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("lora, adapters_only", [(None, False), (LORA, False), (LORA, True)],
                         ids=["dense", "lora-full", "lora-adapters-only"])
def test_exact_resume(mcore_parallel, tmp_path, lora, adapters_only):
    straight = Run(lora, seed=0).train(STEPS)
    first = Run(lora, seed=0).train(3)
    first.save(tmp_path, adapters_only=adapters_only)
    # adapters-only: the base comes from its source (here the same seeded init); full: any init
    resumed = Run(lora, seed=0 if adapters_only else 5)
    torch.manual_seed(77)  # the checkpoint's RNG state must win (LoRA dropout draws from it)
    assert resumed.load(tmp_path, adapters_only=adapters_only).step == 3
    resumed.train(STEPS - 3)
    assert resumed.losses == straight.losses
    assert_same(resumed.params(), straight.params())


def test_adapters_only_checkpoint_is_small_and_has_only_adapters(mcore_parallel, tmp_path):
    from megatron.core import dist_checkpointing

    run = Run(LORA).train(1)
    full = run.save(tmp_path / "full")
    small = run.save(tmp_path / "small", adapters_only=True)
    keys = set(dist_checkpointing.load_tensors_metadata(os.path.join(small.path, "model")))
    assert keys and all(k.split(".")[-1] in ("lora_A", "lora_B") for k in keys)
    assert small.bytes < full.bytes / 3


def test_no_checkpoint_means_fresh_start(mcore_parallel, tmp_path):
    assert Run().load(tmp_path / "empty") is None


def test_crash_during_save_keeps_previous_latest(mcore_parallel, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    run = Run().train(2)
    good = run.save(tmp_path)
    run.train(1)
    real_save = dist_checkpointing.save

    def crashing_save(sd, path, **kw):
        real_save(sd, path, **kw)  # all tensor files written ...
        os.truncate(os.path.join(path, "__0_0.distcp"), 10)
        raise RuntimeError("simulated crash in the middle of a save")  # ... never published

    monkeypatch.setattr(dist_checkpointing, "save", crashing_save)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run.save(tmp_path)
    monkeypatch.undo()
    assert any(n.startswith(".tmp.") for n in os.listdir(tmp_path))
    assert open(tmp_path / "latest").read() == os.path.basename(good.path)
    fresh = Run(seed=3)
    assert fresh.load(tmp_path).step == 2
    run.save(tmp_path)  # the next save clears the partial directory
    assert not any(n.startswith(".tmp.") for n in os.listdir(tmp_path))


def test_keep_rotates_old_checkpoints(mcore_parallel, tmp_path):
    run = Run()
    for _ in range(3):
        run.train(1).save(tmp_path, keep=2)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == [
        "step_00000002", "step_00000003"]


def _two_checkpoints(tmp_path):
    run = Run().train(1)
    older = run.save(tmp_path)
    latest = run.train(1).save(tmp_path)
    return older, latest


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_checkpoint_named_and_fallback_loads_previous(mcore_parallel, tmp_path, damage):
    older, latest = _two_checkpoints(tmp_path)
    victim = os.path.join(latest.path, "model", "__0_0.distcp")
    if damage == "truncate":
        os.truncate(victim, os.path.getsize(victim) // 2)
    else:
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptError, match="__0_0.distcp") as err:
        Run(seed=4).load(tmp_path)
    assert ("truncated" if damage == "truncate" else "CRC32") in str(err.value)
    fresh = Run(seed=4)
    resumed = fresh.load(tmp_path, fallback_to_previous=True)
    assert resumed.path == older.path and resumed.step == 1
    assert any("__0_0.distcp" in n for n in resumed.notes)


def test_other_lora_rank_lists_mismatched_keys(mcore_parallel, tmp_path):
    Run(LORA).train(1).save(tmp_path)
    with pytest.raises(CheckpointMismatchError) as err:
        Run(LoRAConfig(rank=8, alpha=8, dropout=0.1)).load(tmp_path)
    msg = str(err.value)
    assert "decoder.layers.self_attention.linear_qkv.lora_A saved (2, 4, 64), this model (2, 8, 64)" in msg
    assert "optimizer.state.exp_avg.decoder.layers.self_attention.linear_proj.lora_B" in msg


def test_other_vocab_lists_mismatched_keys(mcore_parallel, tmp_path):
    import dataclasses

    Run().train(1).save(tmp_path)
    with pytest.raises(CheckpointMismatchError) as err:
        Run(shape=dataclasses.replace(SHAPE, vocab_size=101)).load(tmp_path)
    msg = str(err.value)
    assert "embedding.word_embeddings.weight saved (97, 64), this model (101, 64)" in msg
    assert "output_layer.weight saved (97, 64), this model (101, 64)" in msg
    assert "config shape" in msg  # the fingerprinted settings differ too


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _rewrite_manifest(path, name):
    from megatron_fastpath.checkpoint.files import _crc32

    mpath = os.path.join(path, "manifest.json")
    manifest = json.load(open(mpath))
    fp = os.path.join(path, name)
    manifest[name] = {"bytes": os.path.getsize(fp), "crc32": _crc32(fp)}
    json.dump(manifest, open(mpath, "w"))


def test_metadata_needing_arbitrary_unpickling_is_refused(mcore_parallel, tmp_path):
    saved = Run().train(1).save(tmp_path)
    with open(os.path.join(saved.path, "model", ".metadata"), "wb") as f:
        pickle.dump(_Evil(), f)
    _rewrite_manifest(saved.path, "model/.metadata")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata would unpickle posix.system"):
        Run().load(tmp_path)


def test_common_pt_needing_arbitrary_unpickling_is_refused(mcore_parallel, tmp_path):
    saved = Run().train(1).save(tmp_path)
    torch.save({"x": _Evil()}, os.path.join(saved.path, "model", "common.pt"))
    _rewrite_manifest(saved.path, "model/common.pt")
    with pytest.raises(UnsafeCheckpointError, match="common.pt needs arbitrary unpickling"):
        Run().load(tmp_path)


def test_real_metadata_passes_the_allow_list(mcore_parallel, tmp_path):
    from megatron_fastpath.checkpoint.safety import safe_load_metadata

    saved = Run(LORA).train(1).save(tmp_path)
    meta = safe_load_metadata(os.path.join(saved.path, "model", ".metadata"))
    assert "decoder.layers.self_attention.linear_qkv.lora_A" in meta.state_dict_metadata


def test_async_save_round_trip(mcore_parallel, tmp_path):
    run = Run().train(2)
    mgr, parts = run.manager(tmp_path, async_save=True)
    pending = mgr.save(run.step, parts)
    run.train(1)  # the step continues while the background process writes
    assert not os.path.exists(tmp_path / "latest") or open(tmp_path / "latest").read() != "step_00000002"
    published = mgr.poll(blocking=True)
    assert [r.step for r in published] == [2] and published[0].bytes > 0
    assert open(tmp_path / "latest").read() == "step_00000002"
    fresh = Run(seed=9)
    assert fresh.load(tmp_path).step == 2
    straight = Run().train(2)
    assert_same(fresh.params(), straight.params())
    assert pending.blocking_s < published[0].blocking_s + 60


def test_grouped_experts_shard_over_ep_and_te_experts_refuse_ep(mcore_parallel):
    """The grouped_mm experts' checkpoint view puts the expert axis in the global shape (EP
    offset = ep_rank * local experts); the TE experts refuse EP > 1 (Megatron's default view
    would keep one rank's experts only)."""
    import types

    from megatron_fastpath.moe.experts import GroupedSwiGLUExperts, TEGroupedSwiGLUExperts

    def config(E):
        return types.SimpleNamespace(num_moe_experts=E)

    ns = types.SimpleNamespace(config=config(8), num_local_experts=4, ep_rank=1,
                               weight1=torch.zeros(4, 16, 32), weight2=torch.zeros(4, 16, 16))
    sd = GroupedSwiGLUExperts.sharded_state_dict(ns, "mlp.experts.", ((0, 3, 4),))
    w1 = sd["mlp.experts.weight1"]
    assert w1.key == "mlp.experts.weight1" and w1.global_shape == (4, 8, 16, 32)
    assert w1.global_offset == (3, 4, 0, 0)  # layer 3, experts 4..7
    with pytest.raises(NotImplementedError, match="expert-parallel size 2"):
        TEGroupedSwiGLUExperts.sharded_state_dict(
            types.SimpleNamespace(config=config(8), num_local_experts=4), "mlp.experts.")


def _corrupt(path):
    victim = os.path.join(path, "model", "__0_0.distcp")
    os.truncate(victim, os.path.getsize(victim) // 2)


def test_rotation_keeps_the_resumed_and_the_written_checkpoint(mcore_parallel, tmp_path):
    """keep=1 + fallback: the newest checkpoint is corrupt, the previous one is loaded; the next
    save must leave both the loaded checkpoint and the new one, never only the corrupt one."""
    run = Run().train(1)
    run.save(tmp_path, keep=1)
    run.train(1).save(tmp_path, keep=2)
    loaded_path = os.path.join(tmp_path, "step_00000001")
    _corrupt(os.path.join(tmp_path, "step_00000002"))
    resumed = Run(seed=4)
    mgr, parts = resumed.manager(tmp_path, keep=1, fallback_to_previous=True)
    state = mgr.load(parts)
    assert state.path == loaded_path
    resumed.step = state.step
    resumed.train(2)  # step 3
    mgr.save(resumed.step, parts)
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("step_"))
    assert names == ["step_00000001", "step_00000003"]  # the corrupt step 2 rotated away
    assert open(tmp_path / "latest").read() == "step_00000003"
    assert not any(n.startswith(".trash.") for n in os.listdir(tmp_path))
    assert Run(seed=5).load(tmp_path).step == 3


@pytest.mark.parametrize("pointer", ["", "garbage\x00", "../../etc", "step_00000009"])
def test_garbage_latest_falls_back_to_the_newest_complete(mcore_parallel, tmp_path, pointer):
    older, latest = _two_checkpoints(tmp_path)
    (tmp_path / "latest").write_text(pointer)
    if pointer != "step_00000009":  # a name: refused without fallback, naming the file
        with pytest.raises(CheckpointCorruptError, match="latest holds .* not a checkpoint name"):
            Run(seed=4).load(tmp_path)
    resumed = Run(seed=4).load(tmp_path, fallback_to_previous=True)
    assert resumed.path == latest.path and resumed.step == 2


def test_torch_checkpoint_exception_falls_back(mcore_parallel, tmp_path, monkeypatch):
    """torch.distributed.checkpoint raises CheckpointException, a BaseException: it must not
    escape the fallback."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    older, latest = _two_checkpoints(tmp_path)
    real_load = dist_checkpointing.load

    def failing_load(sd, path, *a, **kw):
        if os.path.basename(os.path.dirname(path)) == os.path.basename(latest.path):
            raise CheckpointException("simulated read failure", {0: _wrap_exception(RuntimeError("x"))})
        return real_load(sd, path, *a, **kw)

    monkeypatch.setattr(dist_checkpointing, "load", failing_load)
    resumed = Run(seed=4).load(tmp_path, fallback_to_previous=True)
    assert resumed.path == older.path and any(f"skipped {latest.path}" in n for n in resumed.notes)


def test_rotation_moves_out_of_the_published_set_before_deleting(mcore_parallel, tmp_path, monkeypatch):
    """A kill while deleting an old checkpoint must not leave a half-deleted step_N that still
    counts as complete: the delete is simulated to stop half way."""
    import shutil

    run = Run()
    run.train(1).save(tmp_path, keep=1)
    real_rmtree = shutil.rmtree

    def killed_midway(path, *a, **kw):
        os.remove(os.path.join(path, "train_state.json"))  # half of the files gone ...
        raise KeyboardInterrupt("killed during rotation")  # ... then the process dies

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        run.train(1).save(tmp_path, keep=1)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == ["step_00000002"]
    assert Run(seed=3).load(tmp_path).step == 2
    run.train(1).save(tmp_path, keep=1)  # the next save clears the trash
    assert not any(n.startswith(".trash.") for n in os.listdir(tmp_path))


def test_planted_tmp_link_is_not_followed(mcore_parallel, tmp_path):
    """A .tmp.step_N symlink planted in checkpoint.dir: the save never writes through it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(outside, ckpt / ".tmp.step_00000001")
    Run().train(1).save(ckpt)
    assert os.listdir(outside) == [] and (ckpt / "step_00000001").is_dir()


@pytest.mark.parametrize("name", ["../../outside.txt", "/etc/hostname"])
def test_manifest_naming_a_file_outside_the_checkpoint_is_refused(mcore_parallel, tmp_path, name):
    saved = Run().train(1).save(tmp_path)
    manifest = json.load(open(os.path.join(saved.path, "manifest.json")))
    manifest[name] = {"bytes": 1, "crc32": 0}
    json.dump(manifest, open(os.path.join(saved.path, "manifest.json"), "w"))
    with pytest.raises(CheckpointCorruptError, match="outside the checkpoint: refusing to open it"):
        Run(seed=4).load(tmp_path)


@pytest.mark.integration
@pytest.mark.parametrize("keep_best", [False, True])
def test_keep_best_keeps_the_lowest_held_out_loss(mcore_parallel, tmp_path, keep_best):
    """checkpoint.keep_best: besides the newest ``keep``, the checkpoint saved right after the
    evaluation with the lowest held-out loss survives rotation and ``dir/best`` names it (a
    checkpoint whose step had no evaluation is no candidate)."""
    run = Run()
    evals = []
    for step_loss in (3.0, 2.0, 2.5, None, 2.7):  # step 4: saved without an evaluation
        run.train(1)
        if step_loss is not None:
            evals.append([run.step, step_loss])
        mgr, parts = run.manager(tmp_path, keep=1, keep_best=keep_best)
        mgr.save(run.step, {**parts, "history": JsonPart({"evals": list(evals)})})
    kept = sorted(n for n in os.listdir(tmp_path) if n.startswith("step_"))
    if keep_best:
        assert kept == ["step_00000002", "step_00000005"]
        assert (tmp_path / "best").read_text() == "step_00000002"
        assert mgr.best_checkpoint() == str(tmp_path / "step_00000002")
        assert mgr.eval_loss_of(str(tmp_path / "step_00000002")) == 2.0
    else:
        assert kept == ["step_00000005"] and not (tmp_path / "best").exists()


def test_keep_best_needs_held_out_evaluation(tmp_path):
    from tests.support.hydra_compose import compose_job

    from megatron_fastpath.train import parse_job_config

    cfg = compose_job([
        f"checkpoint.dir={tmp_path}", "checkpoint.keep_best=true"])
    with pytest.raises(ValueError, match="checkpoint.keep_best .* needs checkpoint.dir and held-out evaluation"):
        parse_job_config(cfg)
