"""Child-process worker of ``test_fake_te_attention.py``: the fake Transformer Engine 2.10's
``DotProductAttention`` (``tests/support/fake_te/.../attention/dot_product_attention``) under
the calls Megatron-Core 0.16.1's ``TEDotProductAttention`` makes -- TE's checks, its backend
rule for FP8 attention, the math against ``torch.nn.functional.scaled_dot_product_attention``,
a whole GPT from Megatron's TE layer spec; prints ``{check name: "ok" | the failure}`` as JSON
on the last line.

    python -m tests.workers.te_attention_worker
"""

from tests.support.fake_te.activate import activate

activate()  # before Megatron is imported

import contextlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.workers.te_contracts_worker import recipe, run_checks, te  # noqa: E402

CHECKS = {}
NO_BACKEND = "No dot product attention backend is available for the provided inputs"


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn




def reference(q, k, v, fmt="sbhd", causal=True, scale=None, mask=None):
    """SDPA in float32 over [b, h, s, d] (GQA: K/V heads expanded), back to the TE layout's
    [s, b, h*d] / [b, s, h*d]."""
    perm = (1, 2, 0, 3) if fmt == "sbhd" else (0, 2, 1, 3)
    qq, kk, vv = (x.float().permute(*perm) for x in (q, k, v))
    rep = qq.shape[1] // kk.shape[1]
    kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=scale,
                                         attn_mask=None if mask is None else ~mask)
    b, h, s, d = out.shape
    if fmt == "sbhd":
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
    return out.permute(0, 2, 1, 3).reshape(b, s, h * d)


def qkv(s=8, b=2, h=4, g=2, d=16, dtype=torch.float32, fmt="sbhd", seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (lambda n: (s, b, n, d)) if fmt == "sbhd" else (lambda n: (b, s, n, d))
    return [torch.randn(*shape(n), generator=gen).to(dtype).requires_grad_()
            for n in (h, g, g)]


def megatron_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def megatron_dpa(cfg, mask="causal", **kw):
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_fastpath.distributed import init_distributed

    init_distributed(backend="gloo")
    return TEDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType[mask],
                                 attention_type="self", **kw)


# ---------------------------------------------------------------------------- construction
@check
def keywords_of_te_2_10_accepted_others_rejected():
    DPA = te().DotProductAttention
    DPA(4, (16, 16), num_gqa_groups=2, attention_dropout=0.1, qkv_format="bshd",
        attn_mask_type="padding,causal", window_size=None, sequence_parallel=False, tp_size=1,
        get_rng_state_tracker=None, tp_group=None, layer_number=3, attention_type="cross",
        cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p",
        softmax_scale=0.5, softmax_type="vanilla", return_max_logit=True)
    for bad in ({"num_splits": 1}, {"fp8_dpa": True}, {"device": "cpu"}, {"window": (1, 0)}):
        with pytest.raises(TypeError):
            DPA(4, 16, **bad)
    d = DPA(4, 16, attn_mask_type="causal,padding")
    assert d.attn_mask_type == "padding_causal" and d.window_size == (-1, 0)  # dpa.py:348-352
    assert d.layer_number == 1 and d.num_gqa_groups == 4 and d.softmax_scale == 0.25


@check
def constructor_checks_as_te():
    DPA = te().DotProductAttention
    with pytest.raises(AssertionError, match="Invalid attn_mask_type: diagonal"):
        DPA(4, 16, attn_mask_type="diagonal")  # utils.py:2077-2078
    with pytest.raises(AssertionError, match="attention_type bidirectional not supported"):
        DPA(4, 16, attention_type="bidirectional")  # dpa.py:419
    with pytest.raises(AssertionError, match="must be divisible by the number of GQA groups"):
        DPA(4, 16, num_gqa_groups=3)  # dpa.py:378-380
    with pytest.raises(AssertionError, match=r"window_size should be \(-1, 0\) or \(>=0, 0\)"):
        DPA(4, 16, attn_mask_type="causal", window_size=(-2, 0))
    with pytest.warns(UserWarning, match="window_size should be"):
        assert DPA(4, 16, attn_mask_type="causal", window_size=(4, 2)).window_size == (4, 0)
    with pytest.raises(NotImplementedError, match="softmax_type"):
        DPA(4, 16, softmax_type="learnable")


@check
def a_te_base_module_with_te_extra_state():
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    d = te().DotProductAttention(2, 128, attn_mask_type="causal")
    assert isinstance(d, TransformerEngineBaseModule)  # dpa.py:154
    sd = d.state_dict()
    assert set(sd) == {"_extra_state"} and sd["_extra_state"].numel() == 0
    assert list(d.parameters()) == []


# ------------------------------------------------------------------------------------ math
@check
def megatron_te_dpa_equals_sdpa_fp32_forward_and_gradients():
    cfg = megatron_config()
    dpa = megatron_dpa(cfg)
    from megatron.core.transformer.enums import AttnMaskType

    q, k, v = qkv()
    out = dpa(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    assert out.shape == (8, 2, 64) and out.dtype == torch.float32
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = reference(q2, k2, v2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
    # a softmax_scale given is the one used (Megatron hands it to TE: mcore L1279)
    dpa2 = megatron_dpa(cfg, softmax_scale=0.3)
    torch.testing.assert_close(dpa2(q, k, v, None, attn_mask_type=AttnMaskType.causal),
                               reference(q, k, v, scale=0.3), rtol=1e-5, atol=1e-5)
    # bf16 q/k/v: the same math, output in bf16 (FusedAttention's nominal dtype)
    qb, kb, vb = (x.detach().to(torch.bfloat16) for x in (q, k, v))
    ob = dpa(qb, kb, vb, None, attn_mask_type=AttnMaskType.causal)
    assert ob.dtype == torch.bfloat16
    torch.testing.assert_close(ob.float(), reference(qb, kb, vb), rtol=2e-2, atol=2e-2)


@check
def formats_and_mask_types_compute_as_te():
    DPA = te().DotProductAttention
    # bshd, no_mask, forward-time overrides of format and mask type
    q, k, v = qkv(fmt="bshd")
    d = DPA(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="no_mask")
    torch.testing.assert_close(d(q, k, v), reference(q, k, v, fmt="bshd", causal=False),
                               rtol=1e-5, atol=1e-5)
    qs, ks, vs = qkv(fmt="sbhd")
    torch.testing.assert_close(d(qs, ks, vs, qkv_format="sbhd", attn_mask_type="causal"),
                               reference(qs, ks, vs), rtol=1e-5, atol=1e-5)
    # padding: [b, 1, 1, s] True = padded; padded queries give zeros (backends.py:502-503)
    pad = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
    pad[1, ..., 5:] = True
    dp = DPA(4, 16, num_gqa_groups=2, attn_mask_type="padding_causal")
    out = dp(qs, ks, vs, attention_mask=pad)
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1)
    ref = reference(qs, ks, vs, causal=False, mask=(causal | pad.view(2, 1, 1, 8)))
    assert torch.all(out[5:, 1] == 0)
    torch.testing.assert_close(out[:, 0], ref[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:5, 1], ref[:5, 1], rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (qs, ks, vs))
    # causal_bottom_right, cross attention with s_q < s_kv
    q3 = torch.randn(4, 2, 4, 16)
    k3, v3 = torch.randn(8, 2, 2, 16), torch.randn(8, 2, 2, 16)
    db = DPA(4, 16, num_gqa_groups=2, attn_mask_type="causal_bottom_right", attention_type="cross")
    i, j = torch.arange(4).view(4, 1), torch.arange(8).view(1, 8)
    torch.testing.assert_close(db(q3, k3, v3), reference(q3, k3, v3, causal=False, mask=j > i + 4),
                               rtol=1e-5, atol=1e-5)
    # sliding window on a causal mask: keys [i - 2, i]
    dw = DPA(4, 16, num_gqa_groups=2, attn_mask_type="causal", window_size=(2, 0))
    i, j = torch.arange(8).view(8, 1), torch.arange(8).view(1, 8)
    torch.testing.assert_close(dw(qs, ks, vs), reference(qs, ks, vs, causal=False,
                                                         mask=(j > i) | (j < i - 2)),
                               rtol=1e-5, atol=1e-5)
    # arbitrary: the mask itself; a post-scale bias is added after the scale
    arb = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1)) < 0.3
    arb[..., 0] = False
    da = DPA(4, 16, num_gqa_groups=2, attn_mask_type="arbitrary")
    torch.testing.assert_close(da(qs, ks, vs, attention_mask=arb),
                               reference(qs, ks, vs, causal=False, mask=arb), rtol=1e-5, atol=1e-5)
    bias = torch.randn(1, 4, 8, 8)
    dn = DPA(4, 16, num_gqa_groups=2, attn_mask_type="no_mask")
    got = dn(qs, ks, vs, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    qq, kk, vv = (x.detach().permute(1, 2, 0, 3) for x in (qs, ks, vs))
    kk, vv = kk.repeat_interleave(2, 1), vv.repeat_interleave(2, 1)
    want = torch.softmax(qq @ kk.transpose(-2, -1) * 0.25 + bias, -1) @ vv
    torch.testing.assert_close(got, want.permute(2, 0, 1, 3).reshape(8, 2, 64), rtol=1e-5, atol=1e-5)
    # return_max_logit (TE 2.9+, Megatron's qk-clip): (out, max over b, s_q, s_kv per head)
    dm = DPA(4, 16, num_gqa_groups=2, return_max_logit=True)
    o, ml = dm(qs, ks, vs)
    s = (qq @ kk.transpose(-2, -1) * 0.25).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), -1e9)
    torch.testing.assert_close(ml, s.amax(dim=(0, 2, 3)))
    torch.testing.assert_close(o, reference(qs, ks, vs), rtol=1e-5, atol=1e-5)


@check
def inputs_te_refuses_raise():
    DPA = te().DotProductAttention
    d = DPA(4, 16, num_gqa_groups=2)
    q, k, v = qkv()
    with pytest.raises(AssertionError, match="Attention mask type diagonal is not supported!"):
        d(q, k, v, attn_mask_type="diagonal")  # dpa.py:1076-1078
    with pytest.raises(AssertionError, match="only supports qkv_format"):
        d(q, k, v, qkv_format="sbh")  # dpa.py:1088-1092
    with pytest.raises(AssertionError, match="must be 4D tensors when qkv_format='sbhd'"):
        d(q[:, 0], k[:, 0], v[:, 0])  # dpa.py:1095-1097
    with pytest.raises(AssertionError, match="must have the same data type"):
        d(q, k.to(torch.bfloat16), v)  # dpa.py:1044-1046
    with pytest.raises(AssertionError, match="Keys and values must have the same batch size"):
        d(q, k, v[:4])  # dpa.py:1047-1049
    with pytest.raises(AssertionError, match="Queries and keys must have the same head dimension"):
        d(q, k[..., :8], v[..., :8])  # dpa.py:1052-1054
    with pytest.raises(AssertionError, match="Keys and values must have num_gqa_group = 2 heads"):
        d(q, q, q)  # dpa.py:1064-1067
    with pytest.raises(AssertionError, match="Keys have head_dim = 16, $"):
        DPA(4, 8, num_gqa_groups=2)(q, k, v)  # dpa.py:1056-1059 (TE's message, cut as TE's)
    with pytest.raises(AssertionError, match="Please provide attention_mask for padding!"):
        d(q, k, v, attn_mask_type="padding")  # dpa.py:1218-1221
    with pytest.raises(AssertionError, match=r"window_size should be \(-1, -1\)"):
        d(q, k, v, attn_mask_type="no_mask", window_size=(-3, 2))
    with pytest.raises(AssertionError, match="core_attention_bias must be in one of"):
        d(q, k, v, core_attention_bias_type="post_scale_bias",
          core_attention_bias=torch.zeros(3, 3, 8, 8))  # dpa.py:1293-1296
    with pytest.raises(ValueError, match=NO_BACKEND):  # num_splits is FA3's alone, utils.py:519-528
        d(q, k, v, num_splits=2)
    with pytest.raises(NotImplementedError, match="thd"):  # with or without CP (te_cp_attention_worker)
        d(q[:, 0], k[:, 0], v[:, 0], qkv_format="thd")


# -------------------------------------------------------------------------------------- RNG
@contextlib.contextmanager
def _te_capture_flag():
    from transformer_engine.pytorch import graph as te_graph

    te_graph.set_capture_start()
    try:
        yield
    finally:
        te_graph.set_capture_end()


@check
def rng_tracker_checked_while_a_graph_is_captured():
    """dpa.py:1009-1016 through Megatron's constructor (mcore L1325-1327: the tracker getter
    when Megatron's tracker is initialized, none with sequence parallelism)."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.enums import AttnMaskType

    from tests.support.cuda_as_cpu import cuda_as_cpu

    q, k, v = qkv()
    with cuda_as_cpu():
        mrandom.initialize_rng_tracker(use_te_rng_tracker=False, force_reset=True)
        mrandom.model_parallel_cuda_manual_seed(123)
        dpa = megatron_dpa(megatron_config())  # Megatron's own CudaRNGStatesTracker
        assert dpa.rng_states_tracker is mrandom.get_cuda_rng_tracker()
        dpa(q, k, v, None, attn_mask_type=AttnMaskType.causal)  # eager: no check
        with _te_capture_flag(), pytest.raises(AssertionError, match="Unsupported RNG states tracker."):
            dpa(q, k, v, None, attn_mask_type=AttnMaskType.causal)
        # dpa.py:383: no tracker with sequence parallelism (what Megatron hands at TP > 1)
        sp = te().DotProductAttention(4, 16, num_gqa_groups=2, sequence_parallel=True,
                                      get_rng_state_tracker=mrandom.get_cuda_rng_tracker)
        assert sp.rng_states_tracker is None
        with _te_capture_flag():
            sp(q, k, v)
        mrandom.initialize_rng_tracker(use_te_rng_tracker=False, force_reset=True)


@check
def captured_in_a_fake_cuda_graph_with_te_tracker_and_replayed():
    """Under the fake CUDA graph (torch has graph-safe RNG there: its CUDAGraph has
    register_generator_state), with TE's capture flag set, a TE tracker (Megatron's
    TECudaRNGStatesTracker, use_te_rng_tracker) passes dpa.py:1009-1016 and the forward is
    captured -- no host read (the fake graph refuses them) -- and replays over new inputs;
    Megatron's own tracker is refused there as on a GPU."""
    from megatron.core.extensions.transformer_engine import TECudaRNGStatesTracker
    from megatron.core.tensor_parallel import random as mrandom

    from tests.support.fake_cuda_graph import fake_cuda_graphs

    DPA = te().DotProductAttention
    q, k, v = (x.detach() for x in qkv())
    with fake_cuda_graphs():
        tracker = TECudaRNGStatesTracker()
        tracker.add("model-parallel-rng", 1234)
        dpa = DPA(4, 16, num_gqa_groups=2, get_rng_state_tracker=lambda: tracker)
        g = torch.cuda.CUDAGraph()
        with _te_capture_flag(), torch.cuda.graph(g):
            out = dpa(q, k, v)
        q2, k2, v2 = (x.detach() for x in qkv(seed=5))
        for static, new in ((q, q2), (k, k2), (v, v2)):
            static.copy_(new)
        g.replay()
        torch.testing.assert_close(out, reference(q2, k2, v2), rtol=1e-5, atol=1e-5)
        # Megatron's own tracker while TE's flag is set: refused
        mrandom.initialize_rng_tracker(use_te_rng_tracker=False, force_reset=True)
        mrandom.model_parallel_cuda_manual_seed(123)
        meg = DPA(4, 16, num_gqa_groups=2, get_rng_state_tracker=mrandom.get_cuda_rng_tracker)
        g2 = torch.cuda.CUDAGraph()
        with pytest.raises(AssertionError, match="Unsupported RNG states tracker."):
            with _te_capture_flag(), torch.cuda.graph(g2):
                meg(q, k, v)
        mrandom.initialize_rng_tracker(use_te_rng_tracker=False, force_reset=True)


@check
def dropout_draws_inside_the_tracker_fork():
    """dpa.py:382-388, backends.py:511-512: attention dropout runs in the tracker's fork(), so
    its mask follows the tracker's seed, not the default generator's; without a tracker it
    follows the default generator."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.enums import AttnMaskType

    from tests.support.cuda_as_cpu import cuda_as_cpu

    q, k, v = qkv()
    outs = []
    with cuda_as_cpu():
        for tracker_seed, default_seed in ((7, 1), (7, 2), (8, 1)):
            mrandom.initialize_rng_tracker(use_te_rng_tracker=False, force_reset=True)
            mrandom.model_parallel_cuda_manual_seed(tracker_seed)
            dpa = megatron_dpa(megatron_config(attention_dropout=0.5))
            torch.manual_seed(default_seed)
            outs.append(dpa(q, k, v, None, attn_mask_type=AttnMaskType.causal).detach())
        assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
        nodrop = te().DotProductAttention(4, 16, num_gqa_groups=2, attention_dropout=0.5)
        torch.manual_seed(1)
        a = nodrop(q, k, v)
        torch.manual_seed(1)
        assert torch.equal(a, nodrop(q, k, v))
        nodrop.eval()  # no dropout in eval
        torch.testing.assert_close(nodrop(q, k, v), reference(q, k, v), rtol=1e-5, atol=1e-5)
        mrandom.initialize_rng_tracker(use_te_rng_tracker=False, force_reset=True)


# -------------------------------------------------------------------------------------- FP8
def _qdq(x, fmax=448.0, dtype=torch.float8_e4m3fn):
    return x.float().clamp(-fmax, fmax).to(dtype).float()  # scale 1: the first delayed step


@check
def fp8_attention_runs_where_te_has_a_backend():
    """Delayed scaling + fp8_dpa, bf16, head_dim 128, sbhd, causal, training: FusedAttention's
    FP8 sub-backend on sm90 (utils.py:468-480, fused_attn.cpp:230-265), emulated as TE's own
    FP8EmulationFunc (backends.py:157-204): q/k/v, S and O quantised in the forward."""
    t, r = te(), recipe()
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.reset()
    q, k, v = qkv(s=16, b=2, h=2, g=1, d=128, dtype=torch.bfloat16)
    d = t.DotProductAttention(2, 128, num_gqa_groups=1)
    hp = d(q, k, v).detach()
    rec = r.DelayedScaling(fp8_dpa=True, amax_history_len=4)
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        out = d(q, k, v)
    assert d.fp8 and d.fp8_meta["recipe"] is rec
    assert d.fp8_meta["scaling_fwd"].scale.shape == (9,)  # 3 "GEMMs" x 3 (dpa.py:776-779)
    assert d.fp8_meta["scaling_bwd"].scale.shape == (6,)
    # reference: the first step's scales are 1
    qq, kk, vv = (_qdq(x.detach()).to(torch.bfloat16).float().permute(1, 2, 0, 3) for x in (q, k, v))
    kk, vv = kk.repeat_interleave(2, 1), vv.repeat_interleave(2, 1)
    s = (qq @ kk.transpose(-2, -1)) / 128 ** 0.5
    s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    o = _qdq(torch.softmax(s, -1)) @ vv
    want = _qdq(o).to(torch.bfloat16).permute(2, 0, 1, 3).reshape(16, 2, 256)
    assert torch.equal(out, want), (out.float() - want.float()).abs().max()
    err = (out.float() - hp.float()).abs().max() / hp.float().abs().max()
    assert 0 < err < 0.1, err
    # the QKV slot recorded max |q, k, v| before the autocast's exit rolled it into the history
    hist = d.fp8_meta["scaling_fwd"].amax_history
    amax = max(x.detach().float().abs().max() for x in (q, k, v))
    assert hist[-1, 2] == amax and hist[-1, 8] > 0 and hist[-1, 3] > 0
    out.float().sum().backward()  # backward: dO (slot 3), dP (5), dQKV (0) recorded
    bw = d.fp8_meta["scaling_bwd"].amax_history[0]
    assert bw[3] > 0 and bw[5] > 0 and bw[0] > 0 and torch.isfinite(q.grad.float()).all()
    # _extra_state carries the attention's delayed-scaling state (base.py:806-918)
    d2 = t.DotProductAttention(2, 128, num_gqa_groups=1)
    d2.load_state_dict(d.state_dict())
    assert torch.equal(d2.fp8_meta["scaling_fwd"].scale, d.fp8_meta["scaling_fwd"].scale)
    # fp8_dpa off: high precision under the same autocast
    with t.fp8_autocast(enabled=True, fp8_recipe=r.DelayedScaling()):
        assert torch.equal(t.DotProductAttention(2, 128, num_gqa_groups=1)(q, k, v), hp)
    # not training: head dims <= 256 and % 16 (the 9.7 rule), here 64
    q6, k6, v6 = qkv(s=16, b=2, h=2, g=2, d=64, dtype=torch.bfloat16)
    d6 = t.DotProductAttention(2, 64).eval()
    with t.fp8_autocast(enabled=True, fp8_recipe=r.DelayedScaling(fp8_dpa=True)):
        d6(q6, k6, v6)
    FP8GlobalStateManager.reset()


@check
def fp8_attention_raises_what_te_raises_where_it_has_no_backend():
    t, r = te(), recipe()
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.reset()
    ds = r.DelayedScaling(fp8_dpa=True)
    q, k, v = qkv(s=16, b=2, h=2, g=2, d=128, dtype=torch.bfloat16)
    cases = [
        # fp32 q/k/v: FusedAttention takes bf16 / fp16 only (utils.py:444-465), Unfused no FP8
        (ds, [x.detach().float() for x in (q, k, v)], {}, {}),
        # training with head_dim 64: sm90's FP8 backward is d = 128 only (fused_attn.cpp:247-251)
        (ds, qkv(s=16, b=2, h=2, g=2, d=64, dtype=torch.bfloat16), {}, {}),
        # current scaling: FusedAttention FP8 only on sm100+ (utils.py:484-487)
        (r.Float8CurrentScaling(fp8_dpa=True), (q, k, v), {}, {}),
        # an arbitrary mask is Unfused's alone (utils.py:851-859)
        (ds, (q, k, v), {"attn_mask_type": "arbitrary"},
         {"attention_mask": torch.zeros(2, 1, 16, 16, dtype=torch.bool)}),
        # bottom-right causal: not in the FP8 rule's mask types (fused_attn.cpp:252-256)
        (ds, (q, k, v), {"attn_mask_type": "causal_bottom_right"}, {}),
        # a bias: the FP8 rule takes none (fused_attn.cpp:231)
        (ds, (q, k, v), {}, {"core_attention_bias_type": "post_scale_bias",
                            "core_attention_bias": torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16)}),
        # max logit with FP8 attention (utils.py:538-542)
        (ds, (q, k, v), {"return_max_logit": True}, {}),
    ]
    for i, (rec, tensors, init, call) in enumerate(cases):
        d = t.DotProductAttention(2, tensors[0].shape[-1], num_gqa_groups=2, **init)
        with t.fp8_autocast(enabled=True, fp8_recipe=rec), pytest.raises(ValueError, match=NO_BACKEND):
            d(*tensors, **call)
        FP8GlobalStateManager.reset()
    # the same inputs without fp8_dpa run (high precision)
    with t.fp8_autocast(enabled=True, fp8_recipe=r.DelayedScaling()):
        t.DotProductAttention(2, 128, num_gqa_groups=2)(*[x.detach().float() for x in (q, k, v)])
    # block recipes with fp8_dpa: dpa.py:670-673
    with t.fp8_autocast(enabled=True, fp8_recipe=r.MXFP8BlockScaling(fp8_dpa=True)):
        with pytest.raises(AssertionError, match="does not support MXFP8BlockScaling recipe"):
            t.DotProductAttention(2, 128, num_gqa_groups=2)(q, k, v)
    FP8GlobalStateManager.reset()


@check
def megatron_fp8_recipe_drives_fp8_attention():
    """Megatron's recipe (fp8_utils.get_fp8_recipe: TEDelayedScaling with fp8_dpa =
    config.fp8_dot_product_attention) under Megatron's TEDotProductAttention, head_dim 128."""
    t = te()
    from megatron.core.fp8_utils import get_fp8_recipe
    from megatron.core.transformer.enums import AttnMaskType
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.reset()
    cfg = megatron_config(hidden_size=256, num_attention_heads=2, num_query_groups=1,
                          fp8="hybrid", fp8_recipe="delayed", fp8_dot_product_attention=True,
                          bf16=True, params_dtype=torch.bfloat16)
    rec = get_fp8_recipe(cfg)
    assert rec.fp8_dpa and rec.delayed()
    dpa = megatron_dpa(cfg)
    q, k, v = qkv(s=16, b=2, h=2, g=1, d=128, dtype=torch.bfloat16)
    hp = dpa(q, k, v, None, attn_mask_type=AttnMaskType.causal).detach()
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        out = dpa(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    assert not torch.equal(out, hp) and dpa.fp8_meta["scaling_fwd"].scale.shape == (9,)
    # tensorwise with fp8_dot_product_attention: Megatron passes fp8_dpa, TE has no backend
    cfg_cs = megatron_config(hidden_size=256, num_attention_heads=2, num_query_groups=1,
                             fp8="hybrid", fp8_recipe="tensorwise", fp8_dot_product_attention=True)
    rec_cs = get_fp8_recipe(cfg_cs)
    assert rec_cs.fp8_dpa
    with t.fp8_autocast(enabled=True, fp8_recipe=rec_cs), pytest.raises(ValueError, match=NO_BACKEND):
        megatron_dpa(cfg_cs)(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    # mxfp8 with fp8_dot_product_attention: megatron-core 0.16.1's recipe carries no fp8_dpa
    # (fp8_utils.py:570-572), so attention silently runs in bf16; 0.19.2's carries it
    # (fp8_utils.py:747-750) and TE refuses it at the attention (dpa.py:670-673)
    from megatron_fastpath import compat

    cfg_mx = megatron_config(hidden_size=256, num_attention_heads=2, num_query_groups=1,
                             fp8="e4m3", fp8_recipe="mxfp8", fp8_dot_product_attention=True)
    rec_mx = get_fp8_recipe(cfg_mx)
    if compat.mcore_line() >= (0, 19):
        assert rec_mx.fp8_dpa
        with t.fp8_autocast(enabled=True, fp8_recipe=rec_mx), \
                pytest.raises(AssertionError, match="does not support MXFP8BlockScaling recipe"):
            megatron_dpa(cfg_mx)(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    else:
        assert not rec_mx.fp8_dpa
    FP8GlobalStateManager.reset()


# ------------------------------------------------------------------------------ whole model
def _gpt(spec, cfg, seed=0):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=128,
                    max_sequence_length=32, position_embedding_type="rope")


@check
def megatron_te_spec_gpt_forward_backward_equals_local_spec():
    """GPTModel from get_gpt_layer_with_transformer_engine_spec() built on "cuda" under the
    CUDA-as-CPU mode: forward and backward; with the local spec's weights (names mapped to TE's
    fused-norm layout) it computes the local spec's loss and gradients in fp32."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_fastpath.distributed import init_distributed
    from tests.support.cuda_as_cpu import cuda_as_cpu
    from tests.workers.te_spec_worker import te_name

    init_distributed(backend="gloo")
    with cuda_as_cpu():
        mrandom.initialize_rng_tracker(use_te_rng_tracker=False, force_reset=True)
        mrandom.model_parallel_cuda_manual_seed(0)
        cfg = megatron_config(num_layers=2, ffn_hidden_size=96, normalization="RMSNorm",
                              use_cpu_initialization=False)
        te_model = _gpt(get_gpt_layer_with_transformer_engine_spec(), cfg)
        local = _gpt(get_gpt_layer_local_spec(normalization="RMSNorm"), cfg, seed=1)
        kinds = {type(m).__name__ for m in te_model.modules()}
        assert "TEDotProductAttention" in kinds and "TELayerNormColumnParallelLinear" in kinds
        own = dict(te_model.named_parameters())
        with torch.no_grad():
            for name, p in local.named_parameters():
                own[te_name(name)].copy_(p)
        tokens = torch.randint(0, 128, (2, 32), device="cuda")
        labels = torch.randint(0, 128, (2, 32), device="cuda")
        pos = torch.arange(32, device="cuda").unsqueeze(0).expand(2, -1)
        losses = []
        for m in (te_model, local):
            loss = m(tokens, pos, None, labels=labels).mean()
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
        for name, p in local.named_parameters():
            torch.testing.assert_close(own[te_name(name)].grad, p.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")


@check
def megatron_te_spec_moe_gpt_bf16_under_fp8_attention():
    """An MoE GPT (Megatron's TE spec, SequentialMLP experts) in bf16, under Megatron's delayed
    recipe with fp8_dot_product_attention and head_dim 128: forward + backward, attention in
    (emulated) FP8, every gradient finite."""
    from megatron.core.fp8_utils import get_fp8_recipe
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel import random as mrandom
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    from megatron_fastpath.distributed import init_distributed
    from tests.support.cuda_as_cpu import cuda_as_cpu

    FP8GlobalStateManager.reset()
    init_distributed(backend="gloo")
    with cuda_as_cpu():
        mrandom.initialize_rng_tracker(use_te_rng_tracker=False, force_reset=True)
        mrandom.model_parallel_cuda_manual_seed(0)
        cfg = megatron_config(num_layers=2, hidden_size=256, num_attention_heads=2,
                              num_query_groups=1, ffn_hidden_size=128, num_moe_experts=2,
                              moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                              normalization="RMSNorm", use_cpu_initialization=False, bf16=True,
                              params_dtype=torch.bfloat16, fp8="hybrid", fp8_recipe="delayed",
                              fp8_dot_product_attention=True)
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=2, moe_grouped_gemm=False)
        model = _gpt(spec, cfg)
        tokens = torch.randint(0, 128, (2, 32), device="cuda")
        pos = torch.arange(32, device="cuda").unsqueeze(0).expand(2, -1)
        # megatron-core 0.19 compiles the router's expert-bias update (router.py:727, jit_fuser
        # = torch.compile, jit.py:21); dynamo cannot target the CUDA-as-CPU device (its triton
        # check asks the driver for the device's properties), so the step runs it eagerly here,
        # as 0.16.1 does (no jit_fuser there)
        with te().fp8_autocast(enabled=True, fp8_recipe=get_fp8_recipe(cfg)), \
                torch._dynamo.config.patch(disable=True):
            loss = model(tokens, pos, None, labels=tokens).float().mean()
        loss.backward()
        attn = [m for m in model.modules() if type(m).__name__ == "TEDotProductAttention"]
        assert len(attn) == 2 and all(a.fp8 and a.fp8_meta["recipe"].fp8_dpa for a in attn)
        # the autocast's exit turned the QKV slot's amax into its scale (fp8 max / amax)
        assert all(0 < a.fp8_meta["scaling_fwd"].scale[2] < 448 for a in attn)
        assert all(torch.isfinite(p.grad.float()).all() for p in model.parameters()
                   if p.grad is not None)
    FP8GlobalStateManager.reset()


if __name__ == "__main__":
    run_checks(CHECKS)
