"""compat.dist_checkpointing_without_cuda: Megatron's own dist_checkpointing save/load of a
GPTModel round-trips bit-exactly on a CPU (no test mode involved), the shim is inert when CUDA
is available, and it fails loudly on an unchecked megatron-core."""

import os
from unittest import mock

import pytest
import torch

from megatron_fastpath import compat


def _model(seed):
    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.model import ModelConfig, build_gpt_model, build_transformer_config, rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    mc = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
                     num_query_groups=1, vocab_size=64)
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=64, max_seqs=4, num_slots=1,
                                           rope=rope_config_for(mc)), device=torch.device("cpu"))
    torch.manual_seed(seed)
    return build_gpt_model(build_transformer_config(mc), get_fastpath_layer_spec(cache), 64, 64)


def test_sites_still_exist():
    import megatron.core

    root = os.path.dirname(megatron.core.__file__)
    for rel, line_no, text in compat.DIST_CKPT_CUDA_SITES:
        lines = open(os.path.join(root, rel), encoding="utf-8").read().splitlines()
        assert text in lines[line_no - 1], f"megatron/core/{rel}:{line_no} moved ({text!r})"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is inert with CUDA")
def test_save_load_round_trip_on_cpu(mcore_parallel, tmp_path):
    from megatron.core import dist_checkpointing

    src, dst = _model(0), _model(1)
    assert not all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))
    (tmp_path / "plain").mkdir()
    (tmp_path / "ckpt").mkdir()
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        dist_checkpointing.save(src.sharded_state_dict(), str(tmp_path / "plain"))
    with compat.dist_checkpointing_without_cuda():
        dist_checkpointing.save(src.sharded_state_dict(), str(tmp_path / "ckpt"))
        loaded = dist_checkpointing.load(dst.sharded_state_dict(), str(tmp_path / "ckpt"))
    dst.load_state_dict(loaded)
    for (n, a), b in zip(src.named_parameters(), dst.parameters()):
        assert torch.equal(a, b), n
    # restored afterwards
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


def test_inert_when_cuda_available_and_version_checked(monkeypatch):
    from packaging.version import Version

    sync = torch.cuda.synchronize
    with mock.patch("torch.cuda.is_available", lambda: True):
        with compat.dist_checkpointing_without_cuda():
            assert torch.cuda.synchronize is sync
    if not torch.cuda.is_available():
        monkeypatch.setattr(compat, "MCORE_VERSION", Version("0.17.0"))
        with pytest.raises(ImportError, match="checked for"):
            with compat.dist_checkpointing_without_cuda():
                pass
        assert torch.cuda.synchronize is sync
