"""compat's TP gradient bookkeeping on its own (the TP = 2 vs one-process runs in
tests/hf/test_hf_tp.py show why it matters): Megatron 0.16.1 leaves a weight it did not
initialise without TP marks; the shim gives it the ones Megatron's initialiser sets."""

import pytest
import torch
from packaging.version import Version

from megatron_fastpath import compat
from megatron_fastpath.compat import tensor_parallel as tensor_parallel_compat
from megatron_fastpath.model import build_transformer_config
from tests.support.tiny_gpt import SHAPE


def _layers(perform_initialization):
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    cfg = build_transformer_config(SHAPE, perform_initialization=perform_initialization)
    kw = dict(config=cfg, init_method=cfg.init_method, bias=False)
    return [VocabParallelEmbedding(98, 64, init_method=cfg.init_method, config=cfg),
            ColumnParallelLinear(64, 32, gather_output=False, **kw),
            RowParallelLinear(32, 64, input_is_parallel=True, skip_bias_add=True, **kw)]


def _marks(layers):
    return [(getattr(m.weight, "tensor_model_parallel", None), getattr(m.weight, "partition_dim", None),
             getattr(m.weight, "partition_stride", None)) for m in layers]


REFERENCE = [(True, 0, 1), (True, 0, 1), (True, 1, 1)]


def _strip_marks(layers):
    for m in layers:
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(m.weight, attr):
                delattr(m.weight, attr)


def test_marks_equal_what_megatron_sets_when_it_initialises(mcore_parallel):
    assert _marks(_layers(perform_initialization=True)) == REFERENCE
    unloaded = torch.nn.ModuleList(_layers(perform_initialization=False))
    if compat.mcore_line() == (0, 19):
        # 0.19 marks them without initialising (tensor_parallel/layers.py:296, :991, :1354):
        # the shim leaves that to Megatron
        assert _marks(unloaded) == REFERENCE
        assert tensor_parallel_compat.mark_tensor_parallel_weights(unloaded) == 0
        return
    assert _marks(unloaded) == [(None, None, None)] * 3  # what the shim is for (0.16.x)
    assert tensor_parallel_compat.mark_tensor_parallel_weights(unloaded) == 3
    assert _marks(unloaded) == REFERENCE
    assert tensor_parallel_compat.mark_tensor_parallel_weights(unloaded) == 0  # marked weights are left alone


@pytest.mark.parametrize("version,marked", [("0.16.1", 3), ("0.19.2", 0)])
def test_marking_follows_the_line(mcore_parallel, monkeypatch, version, marked):
    """The line picks the branch: 0.16.x marks unmarked weights, 0.19.x leaves them to
    Megatron (which marks them itself there); driven on unmarked weights under either line."""
    monkeypatch.setattr(compat, "MCORE_VERSION", Version(version))
    layers = torch.nn.ModuleList(_layers(perform_initialization=False))
    _strip_marks(layers)
    assert tensor_parallel_compat.mark_tensor_parallel_weights(layers) == marked
    assert _marks(layers) == (REFERENCE if marked else [(None, None, None)] * 3)


def test_tp_shims_refuse_an_unchecked_megatron(mcore_parallel, monkeypatch):
    monkeypatch.setattr(compat, "MCORE_VERSION", Version("0.17.0"))
    model = torch.nn.ModuleList(_layers(perform_initialization=False))
    config = build_transformer_config(SHAPE)
    for call in (lambda: tensor_parallel_compat.mark_tensor_parallel_weights(model),
                 lambda: tensor_parallel_compat.allreduce_tp_partial_grads(model, config)):
        with pytest.raises(ImportError, match=r"checked against megatron-core 0\.16\.x, 0\.19\.x only"):
            call()
