"""The memory estimate knows Megatron's distributed optimizer (ZeRO-1): at data parallelism DP
the optimizer state -- the two fp32 Adam moments and, for bf16, the fp32 main-parameter copy --
is an (DP x CP)-th per rank (experts: over expert data parallelism), the parameters and the fp32
gradient buffer stay whole. ``model=llama31_8b``'s full fine-tune at DP 8 fits an 80 GB GPU with
it and is refused without it, as at DP 1; LoRA's figures are those of the plain estimate.

The expected bytes are worked out here from the parameter count and Megatron's byte counts
(megatron_fastpath/train/memory.py cites the lines); the activations and the refusal are the
figures the estimate gave before it took the sharding (they do not depend on it)."""

import dataclasses
import types
from typing import Optional

import pytest
import torch
from tests.support.cuda_as_cpu import device_name_standin
from tests.support.hydra_compose import compose_job

from megatron_fastpath.train.config import parse_job_config
from megatron_fastpath.train.dry_run import dry_run
from megatron_fastpath.train.memory import (
    GIB,
    check_memory,
    estimate_memory,
    launched_data_parallel_size,
    parameter_count,
)
from megatron_fastpath.train.preflight import check_device

LLAMA31_8B = 8_030_261_248  # Llama-3.1-8B's parameters (untied embedding and output layer)
GB80 = 80 * 10**9  # the smallest reading of an "80 GB" GPU (74.5 GiB)
# activations of one 512-token microbatch (the default data.max_tokens), fp32 / bf16
ACTIVATIONS = {"float32": 6_967_787_520, "bfloat16": 3_746_562_048}
# the figures printed per rank at DP 8 with the distributed optimizer
PRINTED = {
    "float32": "73.8 GiB (params 29.9 GiB, grads 29.9 GiB, optimizer 7.5 GiB sharded over 8 "
               "data-parallel ranks, activations 6.5 GiB)",
    "bfloat16": "59.6 GiB (params 15.0 GiB, grads 29.9 GiB, optimizer 11.2 GiB sharded over 8 "
                "data-parallel ranks, activations 3.5 GiB)",
}
# without it: the refusal of the estimate that has no sharding (at any DP size)
REFUSED = {
    "float32": "126.1 GiB (params 29.9 GiB, grads 29.9 GiB, optimizer 59.8 GiB, activations 6.5 GiB)",
    "bfloat16": "138.1 GiB (params 15.0 GiB, grads 29.9 GiB, optimizer 89.7 GiB, activations 3.5 GiB)",
}


@pytest.fixture
def gpu_80gb(monkeypatch):
    """One stand-in CUDA device of 80 GB (what the memory check asks: total memory and name)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(total_memory=GB80))
    monkeypatch.setattr(torch.cuda, "get_device_name", device_name_standin("stand-in GPU"))


def job_of(overrides, distributed_optimizer=None):
    """The parsed main job; ``distributed_optimizer``: ``parallel.distributed_optimizer`` set to
    it (None: the setting's default)."""
    if distributed_optimizer is not None:
        overrides = [*overrides, f"parallel.distributed_optimizer={str(distributed_optimizer).lower()}"]
    return parse_job_config(compose_job(list(overrides)))


def full_8b(dtype):
    return ["model=llama31_8b", "training.device=cuda", f"training.dtype={dtype}"]


def hand(dtype, dp):
    """Per-rank bytes at DP ``dp`` with the distributed optimizer, from the parameter count."""
    n = LLAMA31_8B
    width, main_copy = (2, 4) if dtype == "bfloat16" else (4, 0)  # fp32 params: no main copy
    return dict(params=n * width,  # whole on each rank
                grads=n * 4,  # the fp32 grad buffer (grad_reduce_in_fp32), whole on each rank
                optimizer=-(-n // dp) * (4 + 4 + main_copy),  # exp_avg, exp_avg_sq (+ main) of a shard
                activations=ACTIVATIONS[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_8b_full_fine_tune_at_dp8_fits_80gb_with_its_per_rank_figures(gpu_80gb, dtype):
    job = job_of(full_8b(dtype))
    assert sum(parameter_count(job.model)) == LLAMA31_8B
    est = check_memory(job, available=GB80, data_parallel_size=8, distributed_optimizer=True)
    want = hand(dtype, 8)
    assert {k: getattr(est, k) for k in want} == want and est.total == sum(want.values()) < GB80
    assert est.optimizer_shards == (8, 8)
    assert est.describe() == PRINTED[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_sharding_the_8b_is_refused_as_at_dp1(gpu_80gb, dtype):
    job = job_of(full_8b(dtype))
    for dp in (1, 8):
        with pytest.raises(ValueError) as info:
            check_memory(job, available=GB80, data_parallel_size=dp)
        assert str(info.value) == (
            f"this job will not fit: a 8.03B-parameter model needs an estimated {REFUSED[dtype]} per "
            "process, and the cuda has 74.5 GiB available. Use a smaller model (e.g. "
            "model=tiny_dense), fastpath.lora=true, training.dtype=bfloat16, smaller data.max_tokens "
            "or more model-parallel ranks -- or training.skip_memory_check=true if you know better")
    # one rank has nothing to shard over: the distributed optimizer at DP 1 is refused the same
    with pytest.raises(ValueError, match=r"estimated 126\.1 GiB|estimated 138\.1 GiB"):
        check_memory(job, available=GB80, data_parallel_size=1, distributed_optimizer=True)


def test_the_preflight_and_dry_run_take_the_launchers_dp_and_the_setting(gpu_80gb, monkeypatch):
    """The preflight's check reads WORLD_SIZE and ``parallel.distributed_optimizer``; the dry
    run prints the per-rank figures it accepted."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    sharded = job_of(full_8b("float32"), distributed_optimizer=True)
    check_device(sharded)  # fits: no error
    lines = []
    plan = dry_run(sharded, log=lines.append)
    assert plan["dp_world"] == 8 and plan["memory_bytes"] == sum(hand("float32", 8).values())
    assert f"  memory: estimated {PRINTED['float32']} per process (fits)" in lines
    # the setting left unset follows the recipes on a GPU at DP > 1: on, so the default fits too
    default = job_of(full_8b("float32"))
    assert default.parallel.distributed_optimizer is True
    check_device(default)
    with pytest.raises(ValueError, match=r"estimated 126\.1 GiB .* and the cuda has 74\.5 GiB on "
                                         r"stand-in GPU\."):
        check_device(job_of(full_8b("float32"), distributed_optimizer=False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_figures_are_the_plain_estimates(dtype):
    job = job_of(["model=llama31_8b", "training.device=cpu", "fastpath.lora=true", f"training.dtype={dtype}"])
    adapters = 32 * 16 * ((4096 + 6144) + (4096 + 4096))  # rank 16 on linear_qkv and linear_proj
    per = 8 if dtype == "float32" else 12
    width = 4 if dtype == "float32" else 2
    plain = dict(params=LLAMA31_8B * width, grads=adapters * 4, optimizer=adapters * per,
                 activations=ACTIVATIONS[dtype])
    printed = {"float32": "36.5 GiB (params 29.9 GiB, grads 0.0 GiB, optimizer 0.1 GiB, activations 6.5 GiB)",
               "bfloat16": "18.6 GiB (params 15.0 GiB, grads 0.0 GiB, optimizer 0.1 GiB, activations 3.5 GiB)"}
    for args in ((), (8, False), (1, True)):  # the default, DP 8 plain, DP 1 sharded over one rank
        est = estimate_memory(job, *args)
        assert {k: getattr(est, k) for k in plain} == plain and est.describe() == printed[dtype]
    sharded = estimate_memory(job, 8, True)  # only the adapters' optimizer state is sharded
    assert {k: getattr(sharded, k) for k in plain} == {**plain, "optimizer": adapters // 8 * per}


def test_experts_shard_over_expert_data_parallelism_and_cp_widens_the_dense_shard():
    moe = job_of(["model=tiny_moe", "training.device=cpu", "parallel=ep2"])
    dense, experts = parameter_count(moe.model)
    # world 4 at TP 1, PP 1, CP 1: DP 4; dense over DP x CP = 4, experts (each EP rank holding
    # half) over expert DP = world / (EP x PP x expert TP 1) = 2
    est = estimate_memory(moe, 4, True)
    assert est.optimizer_shards == (4, 2)
    assert est.optimizer == (-(-dense // 4) + -(-(experts // 2) // 2)) * 8
    assert est.describe().endswith("sharded over 4 data-parallel ranks, experts over 2, activations "
                                   f"{est.activations / GIB:.1f} GiB)")
    cp = job_of(["model=tiny_dense", "training.device=cpu", "parallel.context_parallel_size=2",
                 "fastpath.attention_backend=sdpa"])
    d, _ = parameter_count(cp.model)
    est = estimate_memory(cp, 3, True)
    assert est.optimizer_shards == (6, 6) and est.optimizer == -(-d // 6) * 8
    with pytest.raises(ValueError, match="data_parallel_size must be a positive int; got 0"):
        estimate_memory(cp, 0, True)


def test_launched_data_parallel_size_is_the_world_over_tp_pp_cp(monkeypatch):
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    par = types.SimpleNamespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                context_parallel_size=2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launched_data_parallel_size(par) == 1
    monkeypatch.setenv("SLURM_NTASKS", "16")
    assert launched_data_parallel_size(par) == 4
    monkeypatch.setenv("WORLD_SIZE", "8")  # torchrun's world first
    assert launched_data_parallel_size(par) == 2
