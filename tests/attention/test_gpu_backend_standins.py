"""On CPU: the te / flash backends run over stand-ins that honour
the real libraries' contracts (tests/support/gpu_standins.py), and the configuration errors a
first GPU run would hit are refused before anything is built."""

import ast
import inspect
import types
from pathlib import Path

import pytest
import torch

from megatron_fastpath import _optional
from megatron_fastpath.attention import backend as attention_backend
from megatron_fastpath.attention import core_attention
from megatron_fastpath.layer_spec import get_fastpath_layer_spec
from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
from megatron_fastpath.sync import SyncSentinel
from tests.support.gpu_standins import TEDotProductAttentionStandIn
from tests.support.packed_reference import TINY
from tests.support.packed_reference import packed_inputs

T = 32


def build(backend, max_seqlen=None):
    cfg = build_transformer_config(TINY)
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, max_seqlen=max_seqlen,
                                           rope=rope_config_for(TINY)))
    torch.manual_seed(0)
    spec = get_fastpath_layer_spec(cache, backend=backend, linear_impl="local")
    return build_gpt_model(cfg, spec, TINY.vocab_size, T), cache


def step(model, cache, lengths):
    tokens, labels, mask = packed_inputs(lengths, T, TINY.vocab_size, torch.Generator().manual_seed(1))
    with cache.batch(lengths) as pb, SyncSentinel() as sentinel:
        out = model(tokens, pb.position_ids_1T, None, labels=labels,
                    packed_seq_params=pb.packed_seq_params)
        (out * mask).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.detach()[:, :sum(lengths)], grads, sentinel


def assert_same_as_sdpa(out, grads, lengths, max_seqlen=None):
    ref_model, ref_cache = build("sdpa", max_seqlen)
    ref_out, ref_grads, _ = step(ref_model, ref_cache, lengths)
    assert all(torch.isfinite(g).all() for g in grads.values()), "non-finite gradients"
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("max_seqlen", [None, 12], ids=["bound_T", "bound_12"])
def test_flash_backward_with_padding_tail_has_no_uninitialised_rows(mcore_parallel, fake_flash, max_seqlen):
    """FA2's varlen backward leaves dq / dk / dv rows after the last boundary uninitialised
    (NaN in the stand-in), which would flow into linear_qkv's weight gradient. The cache closes
    the tail at T (in pieces of at most max_seqlen), so every row is written."""
    lengths = [5, 11, 7]  # 23 of 32 tokens: a 9-token padding tail
    model, cache = build("flash", max_seqlen)
    out, grads, _ = step(model, cache, lengths)
    assert_same_as_sdpa(out, grads, lengths, max_seqlen)


def _megatron_te_attention_signature(method: str):
    import megatron.core.extensions.transformer_engine as te_ext

    tree = ast.parse(Path(te_ext.__file__).read_text())
    cls = next(n for n in ast.walk(tree)
               if isinstance(n, ast.ClassDef) and n.name == "TEDotProductAttention")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)
    names = [a.arg for a in fn.args.args]
    return names, [ast.unparse(d) for d in fn.args.defaults]


@pytest.mark.parametrize("method", ["__init__", "forward"])
def test_te_stand_in_has_megatrons_exact_signature(method):
    sig = inspect.signature(getattr(TEDotProductAttentionStandIn, method))
    names = list(sig.parameters)
    defaults = [repr(p.default) for p in sig.parameters.values() if p.default is not p.empty]
    assert (names, defaults) == _megatron_te_attention_signature(method)


def test_te_backend_passes_attn_mask_type_and_no_padded_cu_seqlens(mcore_parallel, fake_te):
    """Megatron's TEDotProductAttention.forward requires attn_mask_type (a TypeError at the
    first forward without it). cu_seqlens_*_padded that differ from cu_seqlens make TE decide pad_between_seqs with torch.equal on device tensors, a host sync per layer that
    aborts a capture: the cache passes none (its cu_seqlens close the tail at T)."""
    lengths = [5, 11, 7]
    model, cache = build("te")
    out, grads, sentinel = step(model, cache, lengths)
    assert TEDotProductAttentionStandIn.calls == [("padding_causal", False)] * TINY.num_layers
    assert [e for e in sentinel.events if "equal" in e.op] == []
    assert_same_as_sdpa(out, grads, lengths)


def test_te_backend_applies_the_yarn_attention_factor(mcore_parallel, fake_te):
    """TE's fused RoPE takes angles only: YaRN's attention factor reaches TE through the softmax
    scale it is built with, as it reaches sdpa (same outputs and grads)."""
    import dataclasses

    from megatron_fastpath.packed_seq import YarnRopeScaling

    rope = dataclasses.replace(rope_config_for(TINY),
                               yarn=YarnRopeScaling(factor=4.0, original_max_position=16))
    assert rope.cos_sin_scale > 1.1
    lengths, runs = [5, 11, 7], {}
    for backend in ("te", "sdpa"):
        cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, rope=rope))
        torch.manual_seed(0)
        spec = get_fastpath_layer_spec(cache, backend=backend, linear_impl="local")
        model = build_gpt_model(build_transformer_config(TINY), spec, TINY.vocab_size, T)
        runs[backend] = step(model, cache, lengths)
    torch.testing.assert_close(runs["te"][0], runs["sdpa"][0], rtol=1e-5, atol=1e-5)
    for n, g in runs["sdpa"][1].items():
        torch.testing.assert_close(runs["te"][1][n], g, rtol=1e-4, atol=1e-5, msg=n)


def _cuda_cache(config=None):
    return types.SimpleNamespace(device=torch.device("cuda"),
                                 config=config or PackedSeqConfig(max_tokens=T, max_seqs=4))


def test_auto_picks_a_backend_that_runs_the_dtype(monkeypatch):
    """The default config (fp32, attention auto) on a GPU machine with TE and flash-attn
    installed parses: auto picks te / flash only for bf16 / fp16 (te refuses fp32) and sdpa
    (flex above the mask limit) otherwise."""
    monkeypatch.setattr(_optional, "have", lambda name: True)  # TE and flash-attn installed
    cuda = torch.device("cuda")
    assert core_attention.resolve_backend("auto", cuda, T, 16384, dtype=torch.float32) == "sdpa"
    assert core_attention.resolve_backend("auto", cuda, 32768, 16384, dtype=torch.float32) == "flex"
    for half in (torch.bfloat16, torch.float16):
        assert core_attention.resolve_backend("auto", cuda, T, 16384, dtype=half) == "te"
    monkeypatch.setattr(_optional, "have", lambda name: name == "flash_attn")
    assert core_attention.resolve_backend("auto", cuda, T, 16384, dtype=torch.bfloat16) == "flash"
    assert core_attention.resolve_backend("auto", cuda, T, 16384, dtype=torch.float32) == "sdpa"


@pytest.mark.parametrize("layout, backend", [("auto", "sdpa"), ("padded", "sdpa"), ("mask", "flex")])
def test_layer_spec_auto_above_the_mask_limit_keeps_sdpa_for_the_padded_view(monkeypatch, layout, backend):
    """The layer spec gives resolve_backend the mask's size limit of the mask layout only
    (``PackedSeqConfig.sdpa_max_tokens``): above it auto on CUDA (no TE / flash-attn) keeps sdpa
    in the layouts that take the padded view, which has no mask, and takes flex in the mask's."""
    monkeypatch.setattr(_optional, "have", lambda name: False)
    cfg = PackedSeqConfig(max_tokens=40000, max_seqs=8, sdpa_layout=layout)
    spec = get_fastpath_layer_spec(_cuda_cache(cfg), backend="auto", linear_impl="local",
                                   params_dtype=torch.float32)
    assert spec.submodules.self_attention.submodules.core_attention.params["backend"] == backend
    assert core_attention.resolve_backend("auto", torch.device("cuda"), 40000, cfg.sdpa_max_tokens,
                                          dtype=torch.float32) == backend


@pytest.mark.parametrize("backend", ["te", "flash"])
def test_fp32_with_te_or_flash_on_cuda_refused_before_building(fake_flash, monkeypatch, backend):
    """TE has no fp32 THD backend and flash-attn takes fp16 / bf16 only."""
    monkeypatch.setattr(attention_backend, "require", lambda *a, **k: None)
    monkeypatch.setattr(_optional, "have", lambda name: True)  # auto on CUDA picks te
    with pytest.raises(ValueError, match=r"bf16 / fp16 only.*set the model dtype to bfloat16"):
        get_fastpath_layer_spec(_cuda_cache(), backend=backend, linear_impl="local",
                                params_dtype=torch.float32)
    resolved = core_attention.resolve_backend(backend, torch.device("cuda"), T, 16384,
                                              dtype=torch.bfloat16)
    assert resolved == ("te" if backend == "auto" else backend)
    assert core_attention.resolve_backend("sdpa", torch.device("cuda"), T, 16384,
                                          dtype=torch.float32) == "sdpa"


def test_pipeline_parallel_config_carries_pipeline_dtype():
    """megatron-core refuses PP > 1 without TransformerConfig.pipeline_dtype."""
    for dtype in (torch.float32, torch.bfloat16):
        cfg = build_transformer_config(TINY, params_dtype=dtype, pipeline_model_parallel_size=2)
        assert cfg.pipeline_dtype == dtype


def test_setup_transformer_engine_range_is_megatrons():
    """transformer_engine.pytorch.attention.rope exists from TE 2.3; megatron-core
    0.16.1 itself pins transformer-engine >= 2.9.0a0, < 2.12.0."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    megatron = next(Requirement(r) for r in requires("megatron-core")
                    if r.startswith("transformer-engine"))
    tree = ast.parse((Path(__file__).resolve().parents[2] / "setup.py").read_text())
    extras = next(kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                  for kw in node.keywords if kw.arg == "extras_require")
    te = ast.literal_eval(extras)["te"]
    ours = Requirement(te[0])
    assert ours.name == "transformer-engine"
    if str(megatron.specifier):
        assert ours.specifier == megatron.specifier
    else:  # megatron-core 0.19's "te" extra names no range: ours stays 0.16.1's
        assert megatron.marker is not None and "te" in str(megatron.marker)
        assert ours.specifier == SpecifierSet(">=2.9.0a0,<2.12.0")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "te"])
def test_gpu_bf16_backward_with_padding_tail_matches_cpu_sdpa(mcore_parallel, backend):
    """On a GPU, the real kernels: bf16 forward+backward over a batch with a padding tail,
    several packings; gradients finite and close to the CPU fp32 sdpa run (bf16 tolerance), no
    torch.equal host sync (TE), and the params' buffers keep their addresses."""
    from megatron_fastpath._optional import have

    if not have("flash_attn" if backend == "flash" else "transformer_engine.pytorch"):
        pytest.skip(f"{backend} not installed")
    grads = {}
    for device, b, dtype in (("cpu", "sdpa", torch.float32), ("cuda", backend, torch.bfloat16)):
        cfg = build_transformer_config(TINY, params_dtype=dtype)
        cache = PackedSeqCache(PackedSeqConfig(max_tokens=256, max_seqs=8, num_slots=3,
                                               rope=rope_config_for(TINY)), device=torch.device(device))
        torch.manual_seed(0)
        model = build_gpt_model(cfg, get_fastpath_layer_spec(cache, backend=b, linear_impl="local",
                                                             params_dtype=dtype),
                                TINY.vocab_size, 256).to(device)
        for i, lengths in enumerate(([100, 1, 60], [7, 200], [255])):  # tails of 95, 49, 1
            tokens, labels, mask = (x.to(device) for x in packed_inputs(
                lengths, 256, TINY.vocab_size, torch.Generator().manual_seed(i)))
            with cache.batch(lengths) as pb, SyncSentinel(strict=device == "cuda"):
                out = model(tokens, pb.position_ids_1T, None, labels=labels,
                            packed_seq_params=pb.packed_seq_params)
                (out.float() * mask).sum().backward()
        grads[device] = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    for n, g in grads["cpu"].items():
        assert torch.isfinite(grads["cuda"][n]).all(), n
        torch.testing.assert_close(grads["cuda"][n], g, rtol=5e-2, atol=5e-2, msg=n)


def test_auto_at_context_parallel_picks_a_backend_cp_runs(monkeypatch):
    """attention_backend=auto at CP > 1 picks among rules.CP_ATTENTION_BACKENDS only (te, else
    sdpa), never flash (flash-attn installed, no TE) or flex (above the mask limit), which the
    context-parallel rule refuses."""
    from megatron_fastpath import rules

    cuda = torch.device("cuda")
    monkeypatch.setattr(_optional, "have", lambda name: name == "flash_attn")
    assert core_attention.resolve_backend("auto", cuda, T, 16384, dtype=torch.bfloat16) == "flash"
    assert core_attention.resolve_backend("auto", cuda, T, 16384, dtype=torch.bfloat16,
                                          context_parallel_size=2) == "sdpa"
    assert core_attention.resolve_backend("auto", cuda, 32768, 16384, dtype=torch.float32,
                                          context_parallel_size=2) == "sdpa"
    monkeypatch.setattr(_optional, "have", lambda name: True)
    assert core_attention.resolve_backend("auto", cuda, T, 16384, dtype=torch.bfloat16,
                                          context_parallel_size=2) == "te"
    for backend in ("sdpa", "te"):
        assert rules.refusals(rules.RunFacts(names=rules.NAMES["main"], packed_cache=True,
                                             context_parallel_size=2, attention_backend=backend)) == []


def test_main_job_auto_at_cp2_with_flash_installed_parses(fake_flash, monkeypatch):
    """The main job's parse at CP 2, bf16, CUDA, attention auto, flash-attn installed and no
    TE: sdpa, accepted (it stopped at the context-parallel refusal of flash)."""
    from megatron_fastpath.train import parse_job_config
    from tests.support.graph_safe_standins import gpu_standins
    from tests.support.hydra_compose import compose_job

    monkeypatch.setattr(_optional, "have", lambda name: name == "flash_attn")
    with gpu_standins():
        job = parse_job_config(compose_job([
            "training.device=cuda", "training.dtype=bfloat16", "cluster.backend=gloo",
            "parallel.context_parallel_size=2", "fastpath.attention_backend=auto",
            "data.max_tokens=64", "data.max_len=24", "training.skip_memory_check=true"]))
    assert job.attention_backend == "sdpa"
