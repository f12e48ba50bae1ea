"""Megatron's DistributedOptimizer in the package's checkpoints, in one process (DP 1):
``checkpoint.optimizer_format`` and its refusals, the format recorded in the checkpoint and read
back, the refusals at load, and an exact resume through ``CheckpointManager`` +
``training_parts`` (Megatron's DDP + ``get_megatron_optimizer(use_distributed_optimizer=True)``
in the CUDA-as-CPU mode). Resharding over DP sizes: test_distributed_optimizer_resharding.py."""

import dataclasses
import json
import os

import pytest
import torch
from packaging.version import Version

from megatron_fastpath.checkpoint import CheckpointConfig
from megatron_fastpath.compat import mcore_line
from megatron_fastpath.compat import dist_optim_ckpt
from tests.support.cuda_as_cpu import cuda_as_cpu


def test_the_setting_defaults_to_dp_reshardable_as_megatrons_training():
    assert CheckpointConfig().optimizer_format == "dp_reshardable"
    assert CheckpointConfig(optimizer_format="fully_reshardable").optimizer_format == "fully_reshardable"


@pytest.mark.parametrize("fmt, why", [
    ("fsdp_dtensor", "it is Megatron FSDP's format, not the DistributedOptimizer's"),
    ("fully_sharded_model_space", "megatron-core's ShardedTensor refuses its flattened tensors "
                                  "(dist_checkpointing/mapping.py: flattened_range is not supported)"),
    ("zero1", "megatron-core %d.%d has no such format" % mcore_line()),
])
def test_other_formats_are_refused_in_one_line(fmt, why):
    with pytest.raises(ValueError) as info:
        CheckpointConfig(optimizer_format=fmt)
    assert str(info.value) == (f"checkpoint.optimizer_format={fmt!r} cannot be used: {why}; use "
                               "dp_reshardable or fully_reshardable")


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_both_lines_offer_the_two_reshardable_formats(version):
    v = Version(version)
    for fmt in ("dp_reshardable", "fully_reshardable"):
        assert dist_optim_ckpt.optimizer_format_problem(fmt, v) is None
    for fmt in dist_optim_ckpt.REFUSED_OPTIMIZER_FORMATS:
        assert dist_optim_ckpt.optimizer_format_problem(fmt, v) == dist_optim_ckpt.REFUSED_OPTIMIZER_FORMATS[fmt]
    with pytest.raises(ImportError, match="checked against megatron-core 0.16.x, 0.19.x only"):
        dist_optim_ckpt.optimizer_format_problem("fully_reshardable", Version("0.18.0"))


def test_the_refusals_reasons_hold_in_the_installed_megatron(mcore_parallel):
    """What the refusals and the shim rest on: fully_sharded_model_space's flattened tensors are
    refused by megatron-core itself; fully_reshardable is one of its reshardable formats; the
    methods the shim calls exist."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    whole = ShardedTensor.from_rank_offsets("k", torch.zeros(4), replica_id=0)
    with pytest.raises(CheckpointingException, match=r"^ShardedTensor\.flattened_range is not supported\.$"):
        dataclasses.replace(whole, flattened_range=slice(0, 4))  # as the format makes them
    assert "fully_reshardable" in DistributedOptimizer.checkpoint_fully_reshardable_formats
    assert "fully_sharded_model_space" in DistributedOptimizer.checkpoint_fully_reshardable_formats
    for name in ("load_parameter_state_from_fully_reshardable", "load_parameter_state_from_dp_reshardable",
                 "_init_optimizer_states_with_dummy_values"):
        assert callable(getattr(DistributedOptimizer, name)), name


def _manager(path, async_save=False):
    from megatron_fastpath.checkpoint import CheckpointManager

    return CheckpointManager(CheckpointConfig(dir=str(path), async_save=async_save), {}, log=lambda s: None)


@pytest.mark.parametrize("te_installed", [False, True])
@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_exact_resume_at_dp1_records_the_format(mcore_parallel, tmp_path, monkeypatch, fmt, te_installed):
    """3 steps, saved, one more step; a model and optimizer drawn from another seed load the
    checkpoint: the optimizer state (fp32 main parameters, exp_avg, exp_avg_sq, step: one
    tensor per parameter) and the parameters after the next step equal the straight run's bit
    for bit. Without the shim's fresh-state, step and per-parameter-step handling the load
    raises or the next step differs (compat/dist_optim_ckpt.py). ``te_installed``: Megatron's
    module flags as with Transformer Engine installed while the inner optimizer is torch's Adam
    (the sync-free step's swap on a GPU): its state_dict keeps no step, the recorded one is used."""
    from megatron.core.optimizer import distrib_optimizer

    from megatron_fastpath.checkpoint import training_parts
    from tests.support.dist_optim import build, optimizer_shards, params, step

    if te_installed:
        monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
        monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)

    with cuda_as_cpu():
        straight = build(0)
        for i in (1, 2, 3):
            step(straight, i)
        _manager(tmp_path).save(3, training_parts(straight[0], straight[2], straight[3], optimizer_format=fmt))
        saved = optimizer_shards(straight)
        step(straight, 4)
        resumed = build(7)
        other = "fully_reshardable" if fmt == "dp_reshardable" else "dp_reshardable"  # the saved one is read
        assert _manager(tmp_path).load(training_parts(resumed[0], resumed[2], resumed[3], optimizer_format=other)).step == 3
        loaded = optimizer_shards(resumed)
        steps = [s["step"] for leaf in resumed[2].chained_optimizers for s in leaf.optimizer.state.values()]
        step(resumed, 4)
    assert sorted(loaded) == sorted(saved) == sorted(params(straight))  # every parameter
    for name, s in saved.items():
        assert (loaded[name]["start"], loaded[name]["end"]) == (0, params(straight)[name].numel())
        for key in ("param", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded[name][key], s[key]), (name, key)
    assert len({id(t) for t in steps}) == len(steps) == len(saved)  # each parameter its own step count
    after, expected = params(resumed), params(straight)
    for name in expected:
        assert torch.equal(after[name], expected[name]), name
    with open(os.path.join(tmp_path, "step_00000003", "train_state.json")) as f:
        saved_part = json.load(f)["parts"]["optimizer"]
    assert (saved_part["format"], saved_part["adam_step"]) == (fmt, 3)
    # dp_reshardable's param groups and bucket sizes, as JSON (fully_reshardable has none)
    assert sorted(saved_part["objects"]) == ([] if fmt == "fully_reshardable" else [
        f"optimizer.distributed.dp_group_idx_0.{k}/shard_0_1" for k in
        ("optimizer", "per_bucket_numel", "per_bucket_numel_unpadded")])


def test_a_load_of_the_other_kind_or_an_unreadable_format_is_refused(mcore_parallel):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_fastpath.checkpoint import CheckpointFormatError, CheckpointMismatchError, training_parts
    from tests.support.dist_optim import build
    from tests.support.tiny_gpt import build_tiny_gpt

    with cuda_as_cpu():
        model, ddp, opt, sched, _ = build(0)
        dist = training_parts(model, opt, sched)["optimizer"]
        assert dist.format == "dp_reshardable"
        with pytest.raises(CheckpointMismatchError) as info:
            dist.saved_format({"step": 0, "groups": []})
        assert str(info.value) == (
            "the checkpoint holds a non-distributed optimizer's state and this run has a "
            "DistributedOptimizer: resume with the optimizer it was saved with "
            "(parallel.distributed_optimizer / use_distributed_optimizer as saved)")
        with pytest.raises(CheckpointFormatError) as info:
            dist.saved_format({"step": 0, "groups": [], "format": "fully_sharded_model_space"})
        assert str(info.value) == (
            "the checkpoint's DistributedOptimizer state is in format 'fully_sharded_model_space', which "
            "cannot be loaded here: " + dist_optim_ckpt.REFUSED_OPTIMIZER_FORMATS["fully_sharded_model_space"]
            + "; load it with the megatron-core and megatron_fastpath that wrote it")
        other, _ = build_tiny_gpt(seed=1)
        plain = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [DistributedDataParallel(
            config=other.config, module=other, ddp_config=DistributedDataParallelConfig())])
        part = training_parts(other, plain, None, optimizer_format="fully_reshardable")["optimizer"]
        assert part.format is None  # a plain optimizer's state has no format: unchanged
        with pytest.raises(CheckpointMismatchError, match="^the checkpoint holds a DistributedOptimizer's "
                           "state and this run has a non-distributed optimizer: "):
            part.saved_format({"step": 0, "groups": [], "format": "fully_reshardable"})



def test_dp_reshardable_objects_round_trip_through_json():
    """What dp_reshardable keeps as ShardedObjects -- param groups (tuples, None, floats), bucket
    sizes keyed by dtype pairs, a grad scaler's tensors -- comes back equal from JSON text."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    groups = {"param_groups": [{"lr": 0.008305704108364302, "betas": (0.9, 0.999), "min_lr": None,
                                "is_expert_parallel": False, "step": 3}]}
    buckets = [{(torch.float32, torch.bfloat16): [74240, 128]}]
    scaler = {"scale": torch.tensor([65536.0]), "growth_tracker": 2}
    sharded = {"optimizer": ShardedObject("k.optimizer", groups, (1,), (0,)),
               "param_state": {"per_bucket_numel": ShardedObject("k.per_bucket_numel", buckets, (1,), (0,)),
                               0: {"keep": "a tensor's place"}},
               "grad_scaler": ShardedObject("k.grad_scaler", scaler, (1,), (0,))}
    saved = json.loads(json.dumps(dist_optim_ckpt.sharded_objects(sharded)))
    assert sorted(saved) == ["k.grad_scaler/shard_0_1", "k.optimizer/shard_0_1", "k.per_bucket_numel/shard_0_1"]
    loaded = {"param_state": {0: {"keep": "a tensor's place"}}}  # as dist_checkpointing returns it
    dist_optim_ckpt.put_objects_back(sharded, loaded, saved)
    assert loaded["optimizer"] == groups and type(loaded["optimizer"]["param_groups"][0]["betas"]) is tuple
    assert loaded["param_state"]["per_bucket_numel"] == buckets and loaded["param_state"][0] == {"keep": "a tensor's place"}
    assert torch.equal(loaded["grad_scaler"]["scale"], scaler["scale"]) and loaded["grad_scaler"]["growth_tracker"] == 2
    with pytest.raises(KeyError, match="the checkpoint's optimizer part has no object 'k.optimizer/shard_0_1'"):
        dist_optim_ckpt.put_objects_back(sharded, {"param_state": {0: {}}}, {})
    with pytest.raises(TypeError, match="holds a object, which is not saved as JSON"):
        dist_optim_ckpt.sharded_objects({"x": ShardedObject("x", object(), (1,), (0,))})


def test_an_async_save_resumes_exactly(mcore_parallel, tmp_path):
    """The main job saves asynchronously by default: a dp_reshardable DistributedOptimizer saved
    by Megatron's background writer (published at the next poll) resumes exactly too."""
    from megatron_fastpath.checkpoint import training_parts
    from tests.support.dist_optim import build, optimizer_shards, params, step

    with cuda_as_cpu():
        straight = build(0)
        for i in (1, 2):
            step(straight, i)
        manager = _manager(tmp_path, async_save=True)
        assert manager.save(2, training_parts(straight[0], straight[2], straight[3])).is_async
        saved = optimizer_shards(straight)
        step(straight, 3)  # the step runs while the writer writes
        assert [r.step for r in manager.poll(blocking=True)] == [2]
        resumed = build(7)
        assert _manager(tmp_path).load(training_parts(resumed[0], resumed[2], resumed[3])).step == 2
        loaded = optimizer_shards(resumed)
        step(resumed, 3)
    for name, s in saved.items():
        for key in ("param", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded[name][key], s[key]), (name, key)
    after, expected = params(resumed), params(straight)
    assert all(torch.equal(after[n], expected[n]) for n in expected)
