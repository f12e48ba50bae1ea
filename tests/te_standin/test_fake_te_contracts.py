"""The fake Transformer Engine (``tests/support/fake_te``) asserts what TE 2.10 asserts for the
calls Megatron-Core 0.16.1 makes, and computes what TE computes: each check of
``tests/workers/te_contracts_worker.py`` (run once, in a child process: TE must stay absent from this one) is
one test here."""

import sys

import pytest

from tests.support.fake_te.activate import run_check_worker

CHECK_NAMES = [
    "megatron_sees_te_2_10",
    "unknown_keyword_raises_type_error",
    "te_2_10_keywords_accepted",
    "parallel_mode_checked",
    "tp_size_divides_features",
    "tp_group_must_be_set_before_forward",
    "normalization_checked",
    "norm_shape_arguments_checked",
    "gemm_shape_checked",
    "dtypes_must_match_outside_autocast",
    "linear_math_and_return_bias",
    "layernorm_linear_returns_and_norms",
    "te_norm_modules_math",
    "fuse_wgrad_accumulation_into_main_grad",
    "extra_state_without_fp8_is_empty",
    "fp8_recipes_assert_as_te",
    "megatron_builds_every_recipe",
    "fp8_dims_asserted",
    "fp8_sequence_parallel_needs_amax_reduction",
    "fp8_tensorwise_numerics",
    "fp8_block_recipes_numerics",
    "fp8_delayed_scaling_state_and_extra_state",
    "fp8_delayed_buffer_registers_once_and_updates_every_module",
    "compat_restore_goes_through_te_methods",
    "fp8_recompute_state_reenters_the_recipe",
    "megatron_te_wrappers_build_and_compute",
    "grouped_linear_keywords",
    "grouped_linear_init_inside_rng_fork",
    "grouped_linear_m_splits_asserted",
    "grouped_linear_math_forward_backward",
    "grouped_linear_fp8_alignment_as_te",
    "grouped_linear_fp8_numerics_and_delayed_state",
    "grouped_linear_fuse_wgrad_into_main_grad",
    "grouped_linear_recipe_refusals",
    "megatron_te_grouped_linear_builds_and_computes",
    "package_te_experts_match_grouped_mm_experts",
    "package_te_experts_fp8_need_the_dispatch_padding",
]


@pytest.fixture(scope="module")
def results():
    return run_check_worker("tests.workers.te_contracts_worker")


@pytest.mark.integration  # a child process (the fake TE never enters this one)
def test_every_check_listed(results):
    assert sorted(results) == sorted(CHECK_NAMES)


@pytest.mark.integration
@pytest.mark.parametrize("name", CHECK_NAMES)
def test_contract(results, name):
    assert results[name] == "ok", results[name]


def test_fake_te_stays_out_of_this_process():
    assert "transformer_engine" not in sys.modules
    from tests.support.fake_te.activate import FAKE_TE_ROOT

    assert FAKE_TE_ROOT not in sys.path and "transformer_engine" not in sys.modules


def test_fake_te_importable_by_its_test_name_without_becoming_te():
    """The fake imports itself relatively, so the stand-in registry can import its classes as
    ``tests.support.fake_te.transformer_engine...`` in this process: no ``transformer_engine``
    module appears and Megatron's HAVE_TE stays False."""
    import megatron.core.extensions.transformer_engine as mte

    from tests.support.fake_te.transformer_engine.common import recipe
    from tests.support.fake_te.transformer_engine.pytorch import (
        LayerNorm, LayerNormLinear, Linear, RMSNorm, distributed, quantization,
    )

    assert all(callable(c) for c in (LayerNorm, LayerNormLinear, Linear, RMSNorm))
    assert recipe.DelayedScaling().delayed() and quantization.FP8GlobalStateManager
    assert distributed.activation_recompute_forward
    assert "transformer_engine" not in sys.modules and mte.HAVE_TE is False
