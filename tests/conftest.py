"""Shared test fixtures: a one-process gloo group + Megatron parallel state on CPU, and the
`gpu` marker (tests that need CUDA are skipped, with the reason, on CPU machines), and the
flash-attn / Transformer Engine attention stand-ins as fixtures. data=jsonl's token caches go to
a temporary XDG_CACHE_HOME (child processes inherit it), never the user's ~/.cache."""

import os
import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked `gpu`); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mcore_parallel():
    """Initialise torch.distributed (gloo, world 1) and Megatron's model-parallel state once."""
    from megatron_fastpath.distributed import init_distributed

    init_distributed(backend="gloo")
    yield


@pytest.fixture(scope="module")
def main_job_runs(request, tmp_path_factory):
    """The module's shared main-job runs (tests/support/main_job.py SharedRuns): each named run
    happens once, whichever test asks first; a module's ``MAIN_JOB_COMMON`` overrides go first."""
    from tests.support.main_job import SharedRuns

    return SharedRuns(tmp_path_factory.mktemp("runs"), getattr(request.module, "MAIN_JOB_COMMON", ()))


@pytest.fixture(autouse=True, scope="session")
def _token_cache_home(tmp_path_factory):
    """XDG_CACHE_HOME (the default data.cache_dir's base) in a temporary directory."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture(autouse=True)
def _fresh_megatron_moe_globals():
    """Megatron keeps the MoE aux-loss backward scale in a class attribute (a backward outside
    its schedules creates it 0-dim, and a later schedule's ``copy_`` of a [1] scale into it
    fails) and the layer-wise aux-loss tracker in a module global. Every test starts as a fresh
    process would."""
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        get_moe_layer_wise_logging_tracker,
    )

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    # the layer-wise aux-loss tracker is a module global sized by the first model's num_layers:
    # a later model with more MoE layers indexes past it (the main job clears it at build)
    get_moe_layer_wise_logging_tracker().clear()
    yield


@pytest.fixture
def build_pair(mcore_parallel):
    """(packed_model, reference_model, cache) with identical weights: our packed spec and an
    independent unpacked reference (Megatron's own RoPE function + plain causal SDPA, one
    sequence at a time; tests/support/packed_reference.py)."""
    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
    from tests.support.packed_reference import TINY, reference_layer_spec

    def build(model_cfg=TINY, max_tokens=32, max_seqs=8, num_slots=1, backend="sdpa",
              dtype=torch.float32):
        cfg = build_transformer_config(model_cfg, params_dtype=dtype)
        rope = rope_config_for(model_cfg)
        cache = PackedSeqCache(PackedSeqConfig(max_tokens=max_tokens, max_seqs=max_seqs,
                                               num_slots=num_slots, rope=rope))
        torch.manual_seed(0)
        packed = build_gpt_model(cfg, get_fastpath_layer_spec(cache, backend=backend),
                                 model_cfg.vocab_size, max_tokens)
        ref = build_gpt_model(cfg, reference_layer_spec(rope), model_cfg.vocab_size, max_tokens)
        missing = ref.load_state_dict(packed.state_dict(), strict=False)
        assert not missing.unexpected_keys and all("_extra_state" in k for k in missing.missing_keys)
        return packed, ref, cache

    return build


@pytest.fixture
def fake_flash(monkeypatch):
    """flash-attn's stand-in (tests/support/gpu_standins.py) importable as ``flash_attn``."""
    from megatron_fastpath import _optional
    from tests.support.gpu_standins import fake_flash_attn_module

    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn_module())
    _optional._try_import.cache_clear()
    yield
    _optional._try_import.cache_clear()


@pytest.fixture
def fake_te(monkeypatch):
    """Transformer Engine's attention and fused RoPE stand-ins behind the attention seams
    (``core_attention``'s TE class, ``kernels``' fused RoPE, both modules' ``require``)."""
    from megatron_fastpath.attention import backend as attention_backend
    from megatron_fastpath.attention import core_attention, kernels
    from tests.support.gpu_standins import TEDotProductAttentionStandIn, te_apply_rotary_pos_emb

    monkeypatch.setattr(core_attention, "_te_dot_product_attention_cls",
                        lambda: TEDotProductAttentionStandIn)
    monkeypatch.setattr(kernels, "_te_apply_rotary_pos_emb", lambda: te_apply_rotary_pos_emb)
    monkeypatch.setattr(attention_backend, "require", lambda *a, **k: None)
    monkeypatch.setattr(kernels, "require", lambda *a, **k: None)
    TEDotProductAttentionStandIn.calls = []
