"""The LoRA input dropout follows Megatron's RNG convention at TP > 1. A replicated input
(column-parallel base, no sequence parallelism) gets the same mask on every TP rank, from the
default generator, as Megatron's hidden dropout outside SP; a sharded input (row-parallel base)
gets its own mask per TP rank from the model-parallel stream, leaving the default stream alone.
Before, every adapter forked the model-parallel stream: each TP rank dropped different elements
of the same replicated activation. Run under the test-only CUDA-as-CPU mode with Megatron's real
RNG tracker, each TP rank simulated by its tracker seeding (megatron_rng.run_as_rank)."""

import pytest
import torch
from tests.support.megatron_rng import run_as_rank

from megatron_fastpath.lora import LoRAConfig, LoRALinear
from megatron_fastpath.model import build_transformer_config
from tests.support.tiny_gpt import SHAPE


def _adapter(parallel):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    cfg = build_transformer_config(SHAPE)
    kw = dict(config=cfg, init_method=cfg.init_method, bias=False, skip_bias_add=True, is_expert=False,
              lora=LoRAConfig(rank=4, dropout=0.5), parallel=parallel)
    if parallel == "column":
        m = LoRALinear(64, 64, gather_output=False, base=ColumnParallelLinear, **kw)
    else:
        m = LoRALinear(64, 64, input_is_parallel=True, base=RowParallelLinear, **kw)
    torch.nn.init.normal_(m.lora_B)
    return m.train()


@pytest.mark.parametrize("parallel, same_mask_on_tp_ranks, default_stream_used",
                         [("column", True, True), ("row", False, False)])
def test_lora_dropout_mask_per_tp_rank_by_megatron_convention(mcore_parallel, parallel,
                                                             same_mask_on_tp_ranks, default_stream_used):
    m = _adapter(parallel)
    x = torch.randn(8, 1, 64)
    (out0, untouched0), (out1, untouched1) = (run_as_rank(lambda: m.adapter(x), tp_rank=r) for r in (0, 1))
    again, _ = run_as_rank(lambda: m.adapter(x), tp_rank=0)
    assert torch.equal(out0, again)  # the mask comes from the seeded generator, not chance
    assert torch.equal(out0, out1) == same_mask_on_tp_ranks
    assert untouched0 == untouched1 == (not default_stream_used)
    assert m.input_sharded == (parallel == "row")
