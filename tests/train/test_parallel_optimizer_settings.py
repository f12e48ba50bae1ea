"""The ``parallel`` group's data-parallel optimizer settings, resolved once at parse: null is on
with CUDA and more than one DP x CP rank (as NeMo / Megatron-Bridge recipes set them), off on a
CPU, at DP 1 and with full-iteration graphs; a value the run cannot use is refused in one line
naming the fix."""

import pytest

from tests.support.hydra_compose import compose_job

KEYS = ("distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather")


def parse(*overrides, world=1, monkeypatch):
    from megatron_fastpath.train import parse_job_config

    monkeypatch.setenv("WORLD_SIZE", str(world))
    return parse_job_config(compose_job(["training.steps=2", *overrides]))


def parse_on_cuda(*overrides, world=1, monkeypatch):
    from tests.support.cuda_as_cpu import cuda_as_cpu

    with cuda_as_cpu():
        return parse("training.device=cuda", *overrides, world=world, monkeypatch=monkeypatch)


def resolved(job) -> tuple:
    return tuple(getattr(job.parallel, k) for k in KEYS) + (job.parallel.bucket_size,)


def test_cpu_defaults_are_off_and_facts_carry_them(monkeypatch):
    job = parse("training.device=cpu", world=2, monkeypatch=monkeypatch)
    assert resolved(job) == (False, False, False, None)
    assert (job.facts.distributed_optimizer, job.facts.overlap_grad_reduce,
            job.facts.overlap_param_gather) == (False, False, False)


def test_cuda_defaults_follow_the_recipes_where_data_parallel(monkeypatch):
    assert resolved(parse_on_cuda(world=2, monkeypatch=monkeypatch)) == (True, True, True, None)
    # DP 1 (one process, or TP 2 over a world of 2): nothing to shard or overlap
    assert resolved(parse_on_cuda(world=1, monkeypatch=monkeypatch)) == (False, False, False, None)
    assert resolved(parse_on_cuda("parallel.tensor_model_parallel_size=2", world=2,
                                  monkeypatch=monkeypatch)) == (False, False, False, None)
    # context parallelism shards with DP: Megatron's DDP reduces over DP x CP
    assert resolved(parse_on_cuda("parallel.context_parallel_size=2", world=2,
                                  monkeypatch=monkeypatch))[:3] == (True, True, True)


def test_set_values_are_kept_and_the_overlaps_follow_the_optimizer(monkeypatch):
    job = parse_on_cuda("parallel.distributed_optimizer=false", world=2, monkeypatch=monkeypatch)
    assert resolved(job) == (False, False, False, None)
    job = parse_on_cuda("parallel.overlap_param_gather=false", "parallel.bucket_size=1000",
                        world=2, monkeypatch=monkeypatch)
    assert resolved(job) == (True, True, False, 1000)
    job = parse_on_cuda("parallel.overlap_grad_reduce=true", "parallel.distributed_optimizer=false",
                        world=2, monkeypatch=monkeypatch)
    assert resolved(job) == (False, True, False, None)


def test_full_iteration_graphs_resolve_the_overlaps_off(monkeypatch):
    """DDP's hooks do nothing while a graph is captured: the overlaps resolve off, the
    distributed optimizer (its reduce-scatter and all-gather captured) stays on."""
    job = parse_on_cuda("fastpath.cuda_graphs=true", "cuda_graphs.scope=full_iteration",
                        "cuda_graphs.use_te_rng_tracker=false", world=2, monkeypatch=monkeypatch)
    assert resolved(job) == (True, False, False, None)


@pytest.mark.parametrize("key", KEYS)
def test_each_set_on_a_cpu_is_refused(key, monkeypatch):
    extra = {"overlap_param_gather": ["parallel.distributed_optimizer=true",
                                      "parallel.overlap_grad_reduce=true"]}.get(key, [])
    with pytest.raises(ValueError) as err:
        parse("training.device=cpu", f"parallel.{key}=true", *extra, world=2, monkeypatch=monkeypatch)
    assert str(err.value).startswith("parallel.")
    assert f"parallel.{key}=true" in str(err.value)
    assert str(err.value).endswith(
        " with training.device=cpu: the CPU step runs its own loop with torch AdamW, not "
        "Megatron's DistributedDataParallel and DistributedOptimizer; set "
        "parallel.distributed_optimizer, overlap_grad_reduce and overlap_param_gather to false "
        "(or null) and bucket_size to null, or train on CUDA")


@pytest.mark.parametrize("overrides, message", [
    (["parallel.distributed_optimizer=false", "parallel.overlap_param_gather=true",
      "parallel.overlap_grad_reduce=true"],
     "parallel.overlap_param_gather=true needs parallel.distributed_optimizer=true: without it "
     "there is no parameter all-gather to overlap (Megatron asserts use_distributed_optimizer in "
     "start_param_sync); set parallel.distributed_optimizer=true or "
     "parallel.overlap_param_gather=false"),
    (["parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=true"],
     "parallel.overlap_param_gather=true needs parallel.overlap_grad_reduce=true (as Megatron-LM "
     "asserts: 'Must use --overlap-param-gather with --overlap-grad-reduce'); set "
     "parallel.overlap_grad_reduce=true or parallel.overlap_param_gather=false"),
    (["parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false",
      "parallel.bucket_size=4096"],
     "parallel.bucket_size=4096 without parallel.overlap_grad_reduce: Megatron's DDP then puts "
     "every gradient in one bucket and drops the size; set parallel.overlap_grad_reduce=true or "
     "parallel.bucket_size=null"),
    (["fastpath.cuda_graphs=true", "cuda_graphs.scope=full_iteration",
      "cuda_graphs.use_te_rng_tracker=false", "parallel.overlap_grad_reduce=true"],
     "cuda_graphs.scope=full_iteration with parallel.overlap_grad_reduce=true: Megatron's DDP "
     "skips its gradient-reduce and parameter-gather hooks while a graph is captured, so the "
     "captured step would reduce and gather nothing; set parallel.overlap_grad_reduce and "
     "parallel.overlap_param_gather to false (or null), or use cuda_graphs.scope=layers"),
])
def test_what_megatron_cannot_run_is_refused_with_the_fix(overrides, message, monkeypatch):
    with pytest.raises(ValueError) as err:
        parse_on_cuda(*overrides, world=2, monkeypatch=monkeypatch)
    assert str(err.value) == message


def test_bucket_size_is_bounded(monkeypatch):
    with pytest.raises(ValueError, match="parallel.bucket_size"):
        parse_on_cuda("parallel.bucket_size=0", world=2, monkeypatch=monkeypatch)


def test_help_describes_every_new_key():
    from megatron_fastpath.settings import describe
    from megatron_fastpath.train.parallel import ParallelConfig

    helps = describe(ParallelConfig)
    assert all(helps[key] for key in KEYS + ("bucket_size",))


def test_the_dry_run_plan_says_what_runs(monkeypatch):
    from megatron_fastpath.train.dry_run import dry_run

    lines = []
    plan = dry_run(parse_on_cuda("training.skip_memory_check=true", world=2, monkeypatch=monkeypatch),
                   log=lines.append)
    assert (plan["distributed_optimizer"], plan["overlap_grad_reduce"],
            plan["overlap_param_gather"]) == (True, True, True)
    assert any(line.startswith("  optimizer: ") and line.endswith(
        ", distributed optimizer with overlapped reduce / gather") for line in lines), lines
    plan = dry_run(parse("training.device=cpu", world=2, monkeypatch=monkeypatch), log=lines.append)
    assert plan["distributed_optimizer"] is False and lines[-2].endswith("warm-up steps")
