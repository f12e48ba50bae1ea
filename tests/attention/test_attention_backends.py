"""Attention backends off the same cache: flex equals sdpa on CPU; te/flash are refused with a
clear message where their packages are missing, and tested for real on a GPU."""

import pytest
import torch

from megatron_fastpath._optional import MissingDependencyError, have
from megatron_fastpath.sync import SyncSentinel
from tests.support.packed_reference import packed_inputs


def run(model, cache, lengths, inputs):
    tokens, labels, mask = inputs
    with cache.batch(lengths) as pb:
        out = model(tokens, pb.position_ids_1T, None, labels=labels,
                    packed_seq_params=pb.packed_seq_params)
        (out * mask).sum().backward()
    return out.detach()


def forward_only(model, cache, lengths, inputs):
    tokens, labels, _ = inputs
    with torch.no_grad(), cache.batch(lengths) as pb:
        return model(tokens, pb.position_ids_1T, None, labels=labels,
                     packed_seq_params=pb.packed_seq_params)


def test_flex_backend_forward_equals_sdpa_on_cpu(build_pair):
    """FlexAttention has no CPU backward in torch; its forward must agree with sdpa (and its
    backward is covered by the gpu test)."""
    lengths = [40, 1, 60, 27]
    inputs = packed_inputs(lengths, 128, 97, torch.Generator().manual_seed(0))
    sdpa, _, c1 = build_pair(max_tokens=128, max_seqs=8, backend="sdpa")
    flex, _, c2 = build_pair(max_tokens=128, max_seqs=8, backend="flex")
    a, b = forward_only(sdpa, c1, lengths, inputs), forward_only(flex, c2, lengths, inputs)
    n = sum(lengths)
    torch.testing.assert_close(a[:, :n], b[:, :n], rtol=1e-4, atol=1e-4)
    assert c2.stats.per_kind["flex_block_mask"] == 1  # built once per batch for both layers


def test_flex_training_on_cpu_refused_with_reason(build_pair):
    flex, _, cache = build_pair(max_tokens=16, max_seqs=4, backend="flex")
    with pytest.raises(ValueError, match="no backward on CPU"):
        run(flex, cache, [16], packed_inputs([16], 16, 97, torch.Generator().manual_seed(0)))


@pytest.mark.skipif(have("flash_attn"), reason="flash-attn is installed here")
def test_missing_flash_package_is_named_with_alternatives(build_pair):
    with pytest.raises(MissingDependencyError, match=r"flash-attn.*Alternatives.*'sdpa'"):
        build_pair(backend="flash")


@pytest.mark.skipif(have("transformer_engine.pytorch"), reason="TE is installed here")
def test_missing_te_package_is_named_with_alternatives(build_pair):
    with pytest.raises(MissingDependencyError, match=r"transformer-engine.*megatron_fastpath\[te\]"):
        build_pair(backend="te")


def test_unknown_backend_and_oversized_sdpa_mask_refused(mcore_parallel):
    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    cache = PackedSeqCache(PackedSeqConfig(max_tokens=64, max_seqs=4, sdpa_mask_max_tokens=32))
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        get_fastpath_layer_spec(cache, backend="xformers")
    with pytest.raises(ValueError, match="use the 'flex', 'flash' or 'te' backend"):
        cache.register("sdpa_mask")
    spec = get_fastpath_layer_spec(cache, backend="auto")  # CPU: auto -> sdpa
    assert spec.submodules.self_attention.submodules.core_attention.params["backend"] == "sdpa"


def test_cpu_backends_make_no_cuda_calls(build_pair, monkeypatch):
    """Our modules must not touch torch.cuda on CPU (Megatron's local attention does)."""
    import torch.cuda

    def boom(*a, **k):
        raise AssertionError("torch.cuda touched on the CPU path")

    packed, _, cache = build_pair(max_tokens=16, max_seqs=4)
    monkeypatch.setattr(torch.cuda, "current_device", boom)
    monkeypatch.setattr(torch.cuda, "current_stream", boom)
    monkeypatch.setattr(torch.cuda, "Event", boom)
    run(packed, cache, [16], packed_inputs([16], 16, 97, torch.Generator().manual_seed(0)))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash", "te"])
def test_gpu_backends_match_cpu_reference_and_are_sync_free(mcore_parallel, backend):
    """On a GPU: every available backend equals the sdpa result computed on the CPU, with no
    host sync (CUDA sync debug mode armed by the sentinel)."""

    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
    from tests.support.packed_reference import TINY

    if backend == "flash" and not have("flash_attn"):
        pytest.skip("flash-attn not installed")
    if backend == "te" and not have("transformer_engine.pytorch"):
        pytest.skip("transformer-engine not installed")
    dtype = torch.bfloat16 if backend in ("flash", "te") else torch.float32
    lengths = [100, 1, 60, 95]
    inputs = packed_inputs(lengths, 256, 97, torch.Generator().manual_seed(0))
    outs = {}
    for device in ("cpu", "cuda"):
        b = "sdpa" if device == "cpu" else backend
        cfg = build_transformer_config(TINY, params_dtype=dtype if device == "cuda" else torch.float32)
        cfg.use_cpu_initialization = True
        cache = PackedSeqCache(PackedSeqConfig(max_tokens=256, max_seqs=8, rope=rope_config_for(TINY)),
                               device=torch.device(device))
        torch.manual_seed(0)
        model = build_gpt_model(cfg, get_fastpath_layer_spec(cache, backend=b), TINY.vocab_size, 256)
        model = model.to(device)
        inp = [t.to(device) for t in inputs]
        # flex compiles inside the sentinel (its dispatch mode ignores compile internals; the
        # compiled kernel's syncs are CUDA's sync debug mode's to catch)
        strict = device == "cuda"
        with SyncSentinel(strict=strict) if strict else torch.enable_grad():
            outs[device] = run(model, cache, lengths, inp).float().cpu()
    n = sum(lengths)
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(outs["cuda"][:, :n], outs["cpu"][:, :n], rtol=tol, atol=tol)


@pytest.mark.parametrize("layers", [2, 4])
def test_sdpa_saves_one_mask_per_step_shared_by_all_layers(build_pair, layers):
    """The additive mask in the compute dtype is used as is: ONE [T, T] storage saved for
    backward per step, whatever L (a bool mask converted with a `where` in every layer would
    have autograd save L distinct [T, T] tensors per step)."""
    import dataclasses

    from tests.support.packed_reference import TINY

    t = 80  # no weight of TINY is 80 x 80
    packed, _, cache = build_pair(model_cfg=dataclasses.replace(TINY, num_layers=layers),
                                  max_tokens=t, max_seqs=8)
    tokens, labels, mask = packed_inputs([20, 30, 5], t, 97, torch.Generator().manual_seed(0))
    saved = {}

    def pack(x):
        if x.dim() >= 2 and tuple(x.shape[-2:]) == (t, t):
            saved.setdefault(x.untyped_storage().data_ptr(), x)
        return x

    with cache.batch([20, 30, 5]) as pb, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = packed(tokens, pb.position_ids_1T, None, labels=labels,
                     packed_seq_params=pb.packed_seq_params)
        (out * mask).sum().backward()
        assert list(saved) == [pb.packed_seq_params.sdpa_mask_TT.untyped_storage().data_ptr()]
