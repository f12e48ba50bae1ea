"""The fake Transformer Engine 2.10's ``DotProductAttention`` (``tests/support/fake_te/
transformer_engine/pytorch/attention/dot_product_attention``) asserts what TE 2.10 asserts for
the calls Megatron-Core 0.16.1's ``TEDotProductAttention`` makes, selects a backend (or raises)
as TE does on the fake's sm90 -- FP8 attention included -- and computes what TE computes: each
check of ``tests/workers/te_attention_worker.py`` (run once, in a child process: TE must stay absent from this
one) is one test here; so is each check of ``tests/workers/te_cp_attention_worker.py`` (context parallelism 2:
one torchrun launch of 2 processes on gloo)."""

import json
import subprocess
import sys

import pytest

from tests.support.fake_te.activate import run_check_worker, te_env
from tests.support.main_job import REPO, main_job_cmd

CHECK_NAMES = [
    "keywords_of_te_2_10_accepted_others_rejected",
    "constructor_checks_as_te",
    "a_te_base_module_with_te_extra_state",
    "megatron_te_dpa_equals_sdpa_fp32_forward_and_gradients",
    "formats_and_mask_types_compute_as_te",
    "inputs_te_refuses_raise",
    "rng_tracker_checked_while_a_graph_is_captured",
    "captured_in_a_fake_cuda_graph_with_te_tracker_and_replayed",
    "dropout_draws_inside_the_tracker_fork",
    "fp8_attention_runs_where_te_has_a_backend",
    "fp8_attention_raises_what_te_raises_where_it_has_no_backend",
    "megatron_fp8_recipe_drives_fp8_attention",
    "megatron_te_spec_gpt_forward_backward_equals_local_spec",
    "megatron_te_spec_moe_gpt_bf16_under_fp8_attention",
]

CP_CHECK_NAMES = [
    "megatron_te_dpa_cp2_equals_cp1_per_comm_type",
    "bshd_window_max_logit_and_hierarchical_cp_equal_cp1",
    "fp8_attention_at_cp2_as_at_cp1",
    "cp_inputs_te_refuses_raise",
]


@pytest.fixture(scope="module")
def results():
    return run_check_worker("tests.workers.te_attention_worker")


@pytest.fixture(scope="module")
def cp_results():
    """``te_cp_attention_worker`` under torchrun (2 processes): rank 0's merged results."""
    cmd = main_job_cmd(nproc=2, entry=["-m", "tests.workers.te_cp_attention_worker"])
    proc = subprocess.run(cmd, cwd=REPO, env=te_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.integration  # a child process (the fake TE never enters this one)
def test_every_check_listed(results):
    assert sorted(results) == sorted(CHECK_NAMES)


@pytest.mark.integration
@pytest.mark.parametrize("name", CHECK_NAMES)
def test_attention_contract(results, name):
    assert results[name] == "ok", results[name]


@pytest.mark.integration  # torchrun children (the fake TE never enters this process)
def test_every_cp_check_listed(cp_results):
    assert sorted(cp_results) == sorted(CP_CHECK_NAMES)


@pytest.mark.integration
@pytest.mark.parametrize("name", CP_CHECK_NAMES)
def test_context_parallel_attention_contract(cp_results, name):
    assert cp_results[name] == "ok", cp_results[name]


def test_fake_dot_product_attention_importable_by_its_test_name():
    """The registry imports the fake's class as ``tests.support.fake_te...`` in this process:
    no ``transformer_engine`` module appears."""
    from tests.support.fake_te.transformer_engine.pytorch import DotProductAttention
    from tests.support.fake_te.transformer_engine.pytorch.module.base import (
        TransformerEngineBaseModule)

    assert issubclass(DotProductAttention, TransformerEngineBaseModule)
    assert "transformer_engine" not in sys.modules
