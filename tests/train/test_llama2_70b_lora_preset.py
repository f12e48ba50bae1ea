"""The MLPerf Llama-2-70B LoRA layout: ``parallel=llama2_70b_lora`` (TP4, PP1, CP2,
sequence parallelism) with ``model=llama2_70b`` parses and plans on ``training.device=cuda`` --
CP=2 served by the packed cache, the ``te`` attention backend (TE's THD + CP ring), per-layer
CUDA graphs captured, FP8 linears as MLPerf runs them.

Parsed inside the GPU stand-ins (``tests/support/graph_safe_standins.gpu_standins``: CUDA as
CPU), with Transformer Engine reported as installed FOR PLANNING ONLY: ``_optional.require``
answers ``transformer_engine*`` (``_require_with_te_standins``) so the checks that ask for TE's
linears, FP8 and RNG tracker pass. Nothing here runs a step: sequence parallelism needs TE's
norms and linears (``fastpath.linear_impl=te``), which run on a CPU only on the fake Transformer
Engine in child processes (tests/te_standin: SP at TP=2, FP8, not with CP); what runs of this
layout is CP=2 with TP and the te backend (``test_context_parallel_te.py``,
``test_context_parallel_te_graphs.py``) and SP at TP=2 on the fake TE.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest

PRESET = ["parallel=llama2_70b_lora", "model=llama2_70b", "training.device=cuda",
          "training.dtype=bfloat16", "fastpath.attention_backend=te", "fastpath.lora=true",
          "fastpath.cuda_graphs=true", "cuda_graphs.warmup_steps=0", "training.skip_memory_check=true"]


@contextlib.contextmanager
def _te_for_planning():
    from megatron_fastpath import _optional
    from tests.support.graph_safe_standins import _require_with_te_standins, gpu_standins

    with gpu_standins(), mock.patch.object(_optional, "require", _require_with_te_standins(_optional.require)):
        yield


def _parse(extra=()):
    from megatron_fastpath.train.config import parse_job_config
    from tests.support.hydra_compose import compose_job

    with _te_for_planning():
        return parse_job_config(compose_job([*PRESET, *extra]))


def _cache_of(job, cp_rank):
    """The packed cache the job builds on CP rank ``cp_rank`` (``train.job.build_cache``, its
    parallel state answered from the parsed job: no process group here)."""
    from megatron.core import parallel_state as ps

    from megatron_fastpath.train.job import build_cache

    with _te_for_planning(), \
            mock.patch.object(ps, "get_context_parallel_world_size", lambda: job.parallel.context_parallel_size), \
            mock.patch.object(ps, "get_context_parallel_rank", lambda: cp_rank), \
            mock.patch.object(ps, "get_pipeline_model_parallel_world_size", lambda: 1), \
            mock.patch.object(ps, "get_pipeline_model_parallel_rank", lambda: 0):
        return build_cache(job)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_preset_parses_and_plans_with_cp2_served_by_the_packed_cache(fp8):
    job = _parse(["fastpath.fp8=true"] if fp8 else [])
    par = job.parallel
    assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
            par.context_parallel_size, par.sequence_parallel) == (4, 1, 2, True)
    assert job.model.num_layers == 80 and job.lora is not None
    assert job.attention_backend == "te" and job.linear_impl == "te"  # SP needs TE's linears
    assert job.device.type == "cuda"
    # per-layer graphs captured (the te + CP + graphs refusal is lifted), not audited
    assert job.plan.capture and not job.plan.audit and not job.plan.full_iteration
    assert job.plan.transformer_config["cuda_graph_impl"] == "local"
    assert (job.fp8 is not None) == fp8
    # the packed cache serves CP=2: each rank holds half of every packed batch
    for rank in (0, 1):
        cache = _cache_of(job, rank)
        assert cache.config.context_parallel_size == 2 and cache.config.context_parallel_rank == rank
        assert cache.config.local_tokens == job.data.max_tokens // 2
        # ... which sequence parallelism splits over the 4 TP ranks
        assert cache.config.local_tokens % par.tensor_model_parallel_size == 0


def test_sp_with_cp_needs_max_tokens_split_over_cp_and_tp():
    """Each CP rank's max_tokens / CP tokens split over TP (and every piece over 2 x CP): a
    multiple of lcm(2 x CP, CP x TP) = 8 at TP4 CP2."""
    with pytest.raises(ValueError, match=r"make data.max_tokens=516 a multiple of 8"):
        _parse(["data.max_tokens=516"])  # 516 / 2 = 258 tokens a CP rank: not over 4 TP ranks
    assert _parse(["data.max_tokens=520"]).data.max_tokens == 520


@pytest.mark.parametrize("override, match", [
    # SP with CP under the conditions of SP without CP: CUDA, TE's linears
    ("training.device=cpu", "parallel.sequence_parallel needs CUDA"),
    ("fastpath.linear_impl=local", "parallel.sequence_parallel needs Transformer Engine's norms and linears"),
    # still refused with CP: full-iteration graphs with the te backend (not checked)
    ("cuda_graphs.scope=full_iteration", "the 'te' attention backend and cuda_graphs.scope=full_iteration"),
])
def test_what_the_layout_still_refuses(override, match):
    with pytest.raises(ValueError, match=match):
        _parse([override])
