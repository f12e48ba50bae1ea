"""The FP8 GEMM shape check the main job makes at parse (``fp8.config.fp8_gemm_shape_problem``):
Transformer Engine 2.10 asserts these shapes at the first forward (every recipe:
pytorch/utils.py:439-447; mxfp8: tensor/mxfp8_tensor.py:112-118); the fake TE
(tests/support/fake_te) asserts the same in the feature matrix's runs, where an MXFP8 model at
TP 2 with a 16-wide projection failed before this check refused it."""

import pytest

from megatron_fastpath.fp8.config import fp8_gemm_shape_problem as _problem
from megatron_fastpath.fp8.config import te_linear_gemms
from megatron_fastpath.model import ModelConfig
from megatron_fastpath.rules import NAMES

def fp8_gemm_shape_problem(recipe, gemms, tokens):
    """The check in the main job's spelling."""
    return _problem(recipe, gemms, tokens, NAMES["main"])


TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=64)


def test_gemms_of_a_layer_per_tensor_parallel_rank():
    # head dim 8: q 32, kv 16 -> qkv out 64; SwiGLU fc1 out 2 x 64
    assert te_linear_gemms(TINY, 1) == [("linear_qkv", 32, 64), ("linear_proj", 32, 32),
                                        ("linear_fc1", 32, 128), ("linear_fc2", 64, 32)]
    assert te_linear_gemms(TINY, 2) == [("linear_qkv", 32, 32), ("linear_proj", 16, 32),
                                        ("linear_fc1", 32, 64), ("linear_fc2", 32, 32)]
    moe = ModelConfig(hidden_size=32, num_attention_heads=4, num_query_groups=2, num_experts=4,
                      moe_ffn_hidden_size=32)
    assert [g[0] for g in te_linear_gemms(moe, 1)] == ["linear_qkv", "linear_proj"]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_tp1_tiny_model_is_accepted(recipe):
    assert fp8_gemm_shape_problem(recipe, te_linear_gemms(TINY, 1), 64) is None


def test_mxfp8_refuses_a_16_wide_split():
    problem = fp8_gemm_shape_problem("mxfp8", te_linear_gemms(TINY, 2), 64)
    assert problem.startswith("fp8.recipe=mxfp8") and "linear_proj on a rank is 64 tokens x 16 -> 32" in problem
    # the other recipes take 16 (TE: last dim % 16)
    assert fp8_gemm_shape_problem("delayed", te_linear_gemms(TINY, 2), 64) is None


@pytest.mark.parametrize("tokens,gemm,bad", [(60, ("g", 32, 32), "60 tokens"), (64, ("g", 24, 32), "x 24"),
                                             (64, ("g", 32, 12), "-> 12")])
def test_every_recipe_needs_8_and_16(tokens, gemm, bad):
    problem = fp8_gemm_shape_problem("delayed", [gemm], tokens)
    assert problem and bad in problem and "fastpath.fp8=false" in problem
    assert fp8_gemm_shape_problem("mxfp8", [gemm], tokens).startswith("fp8 (fastpath.fp8=true)")


def test_mxfp8_tokens_per_context_parallel_rank():
    assert "48 tokens" in fp8_gemm_shape_problem("mxfp8", te_linear_gemms(TINY, 1), 48)
