"""Child-process worker of ``test_fake_te_contracts.py``: each check builds or calls the fake
Transformer Engine (``tests/support/fake_te``) the way a broken caller would and asserts TE's
answer; prints ``{check name: "ok" | the failure}`` as JSON on the last line.

    python -m tests.te_standin.contracts_worker
"""

from tests.support.fake_te.activate import activate

activate()  # before Megatron is imported

import json  # noqa: E402
import traceback  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def te():
    import transformer_engine.pytorch as tep

    return tep


def recipe():
    from transformer_engine.common import recipe as r

    return r


# ------------------------------------------------------------------ import / version (Megatron)
@check
def megatron_sees_te_2_10():
    import megatron.core.extensions.transformer_engine as mte
    import megatron.core.fp8_utils as fp8_utils
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.utils import get_te_version, is_te_min_version

    assert mte.HAVE_TE and fp8_utils.HAVE_TE and mrandom.HAVE_TE
    assert str(get_te_version()) == "2.10.0" and is_te_min_version("2.10.0")
    assert not is_te_min_version("2.11.0")


# ------------------------------------------------------------------------ constructor keywords
@check
def unknown_keyword_raises_type_error():
    t = te()
    for cls, args in ((t.Linear, (16, 16)), (t.LayerNormLinear, (16, 16)),
                      (t.LayerNorm, (16,)), (t.RMSNorm, (16,))):
        with pytest.raises(TypeError):
            cls(*args, device="cpu", not_a_te_keyword=1)


@check
def te_2_10_keywords_accepted():
    t = te()
    t.Linear(16, 16, device="cpu", rng_tracker_name=None, save_original_input=True,
             symmetric_ar_type=None, name="x", delay_wgrad_compute=False)
    t.LayerNormLinear(16, 16, device="cpu", return_layernorm_output_gathered=True,
                      zero_centered_gamma=True, normalization="RMSNorm", name="y")
    with pytest.raises(TypeError):  # Linear has no normalization (LayerNormLinear does)
        t.Linear(16, 16, device="cpu", normalization="RMSNorm")
    with pytest.raises(TypeError):  # LayerNormLinear has no save_original_input in 2.10
        t.LayerNormLinear(16, 16, device="cpu", save_original_input=True)


@check
def parallel_mode_checked():
    # linear.py:1129-1131
    with pytest.raises(AssertionError, match="parallel_mode diagonal not supported"):
        te().Linear(16, 16, device="cpu", parallel_mode="diagonal")
    with pytest.raises(AssertionError, match="parallel_mode duplicated not supported"):
        te().LayerNormLinear(16, 16, device="cpu", parallel_mode="duplicated")


@check
def tp_size_divides_features():
    # linear.py:1133-1136 -> utils.py:148-150
    with pytest.raises(AssertionError, match="16 is not divisible by 3"):
        te().Linear(16, 16, device="cpu", parallel_mode="column", tp_size=3)
    with pytest.raises(AssertionError, match="16 is not divisible by 3"):
        te().Linear(16, 16, device="cpu", parallel_mode="row", tp_size=3)
    lin = te().Linear(16, 32, device="cpu", parallel_mode="column", tp_size=2)
    assert tuple(lin.weight.shape) == (16, 16) and not lin.sequence_parallel
    lin = te().Linear(32, 16, device="cpu", parallel_mode="row", tp_size=2, sequence_parallel=True)
    assert tuple(lin.weight.shape) == (16, 16) and lin.sequence_parallel
    assert (lin.weight.partition_dim, lin.weight.tensor_model_parallel) == (1, True)


@check
def tp_group_must_be_set_before_forward():
    # base.py:1051-1052
    lin = te().Linear(32, 16, device="cpu", parallel_mode="row", tp_size=2)
    with pytest.raises(AssertionError, match="TP group not initialized"):
        lin(torch.randn(4, 16))


@check
def normalization_checked():
    # layernorm_linear.py:1173
    with pytest.raises(AssertionError, match="Unsupported normalization type!"):
        te().LayerNormLinear(16, 16, device="cpu", normalization="BatchNorm")


@check
def norm_shape_arguments_checked():
    # module/layernorm.py:71-91
    with pytest.raises(RuntimeError, match="Both `normalized_shape` and `hidden_size`"):
        te().LayerNorm(16, hidden_size=16, device="cpu")
    with pytest.raises(RuntimeError, match="Neither `normalized_shape` nor `hidden_size`"):
        te().RMSNorm(device="cpu")
    with pytest.raises(RuntimeError, match="Both `dtype` and `params_dtype`"):
        te().RMSNorm(16, params_dtype=torch.float32, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="are not compatible"):  # ops/basic/layer_norm.py:189-194
        te().LayerNorm(16, device="cpu")(torch.randn(2, 8))


@check
def gemm_shape_checked():
    # linear.py:140, layernorm_linear.py:157
    with pytest.raises(AssertionError, match="GEMM not possible"):
        te().Linear(16, 8, device="cpu")(torch.randn(4, 12))
    with pytest.raises(AssertionError, match="GEMM not possible"):
        te().LayerNormLinear(16, 8, device="cpu")(torch.randn(4, 12))


@check
def dtypes_must_match_outside_autocast():
    # base.py:938-944
    lin = te().Linear(16, 8, device="cpu", params_dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="Data types for parameters must match"):
        lin(torch.randn(4, 16))


# ------------------------------------------------------------------------------------- math
@check
def linear_math_and_return_bias():
    t = te()
    torch.manual_seed(0)
    lin = t.Linear(16, 8, device="cpu", return_bias=True)
    with torch.no_grad():
        lin.bias.normal_()
    x = torch.randn(3, 5, 16)
    out, b = lin(x)
    assert torch.equal(b, lin.bias)  # returned, not added (linear.py:1604-1606)
    torch.testing.assert_close(out, x @ lin.weight.t(), rtol=1e-6, atol=1e-6)
    lin2 = t.Linear(16, 8, device="cpu")
    with torch.no_grad():
        lin2.bias.normal_()
    torch.testing.assert_close(lin2(x), x @ lin2.weight.t() + lin2.bias, rtol=1e-6, atol=1e-6)
    assert [n for n, _ in lin2.named_parameters()] == ["weight", "bias"]
    # parallel_mode None: the weight is marked (dim 0), the bias is not (linear.py:1325-1345)
    assert lin2.weight.partition_dim == 0 and not hasattr(lin2.bias, "partition_dim")


@check
def layernorm_linear_returns_and_norms():
    t = te()
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    for normalization in ("LayerNorm", "RMSNorm"):
        for zc in (False, True):
            m = t.LayerNormLinear(16, 8, device="cpu", normalization=normalization,
                                  zero_centered_gamma=zc, return_bias=True, eps=1e-5)
            names = [n for n, _ in m.named_parameters()]
            want = ["layer_norm_weight"] + (["layer_norm_bias"] if normalization == "LayerNorm" else [])
            assert names == want + ["weight", "bias"], names
            # init: gamma 1, or 0 when zero-centred (layernorm_linear.py:1262-1266)
            assert torch.all(m.layer_norm_weight == (0.0 if zc else 1.0))
            with torch.no_grad():
                m.layer_norm_weight.normal_()
                m.bias.normal_()
                if m.layer_norm_bias is not None:
                    m.layer_norm_bias.normal_()
            gamma = m.layer_norm_weight + 1 if zc else m.layer_norm_weight
            if normalization == "LayerNorm":
                ref_ln = torch.nn.functional.layer_norm(x, (16,), gamma, m.layer_norm_bias, 1e-5)
            else:
                ref_ln = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma
            out, bias = m(x)
            torch.testing.assert_close(out, ref_ln @ m.weight.t(), rtol=1e-5, atol=1e-5)
            m.return_layernorm_output = True  # read at every forward (compat/te.py relies on it)
            out2, bias2, ln = m(x)
            torch.testing.assert_close(ln, ref_ln, rtol=1e-5, atol=1e-5)
            assert torch.equal(out2, out) and torch.equal(bias2, bias)
            m.return_bias = False
            m.apply_bias = True
            o3, ln3 = m(x)
            torch.testing.assert_close(o3, out + m.bias, rtol=1e-5, atol=1e-5)


@check
def te_norm_modules_math():
    t = te()
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    ln = t.LayerNorm(hidden_size=16, eps=1e-5, sequence_parallel=True, zero_centered_gamma=True,
                     params_dtype=torch.float32, device="cpu")
    assert ln.weight.sequence_parallel and ln.bias.sequence_parallel
    assert torch.all(ln.weight == 0)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    torch.testing.assert_close(ln(x), torch.nn.functional.layer_norm(x, (16,), ln.weight + 1, ln.bias, 1e-5))
    rms = t.RMSNorm(16, eps=1e-6, device="cpu")
    assert rms.bias is None and [n for n, _ in rms.named_parameters()] == ["weight"]
    with torch.no_grad():
        rms.weight.normal_()
    torch.testing.assert_close(rms(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms.weight)


@check
def fuse_wgrad_accumulation_into_main_grad():
    # linear.py:944-966: wgrad added to weight.main_grad; a dummy grad when Megatron's DDP marks
    # the parameter (grad_added_to_main_grad)
    t = te()
    torch.manual_seed(0)
    lin = t.Linear(16, 8, device="cpu", bias=False, fuse_wgrad_accumulation=True)
    lin.weight.main_grad = torch.ones(8, 16)
    lin.weight.grad_added_to_main_grad = False
    x = torch.randn(4, 16)
    lin(x).sum().backward()
    ref = torch.ones(4, 8).t() @ x
    torch.testing.assert_close(lin.weight.main_grad, 1 + ref)
    assert lin.weight.grad_added_to_main_grad is True
    assert torch.count_nonzero(lin.weight.grad) == 0
    lin2 = t.Linear(16, 8, device="cpu", bias=False, fuse_wgrad_accumulation=True)
    with pytest.raises(AssertionError, match="main_grad"):
        lin2(x).sum().backward()


@check
def extra_state_without_fp8_is_empty():
    # base.py:839-841
    lin = te().Linear(16, 16, device="cpu")
    assert lin.get_extra_state().numel() == 0
    sd = lin.state_dict()
    assert set(sd) == {"weight", "bias", "_extra_state"}
    lin.load_state_dict(sd)


# -------------------------------------------------------------------------------------- FP8
@check
def fp8_recipes_assert_as_te():
    r = recipe()
    from pydantic import ValidationError

    for cls in (r.DelayedScaling, r.Float8CurrentScaling, r.MXFP8BlockScaling, r.Float8BlockScaling):
        with pytest.raises(ValidationError, match="Pure E5M2 training is not supported"):
            cls(fp8_format=r.Format.E5M2)
    with pytest.raises(ValidationError, match="2D by 2D block gemm not supported"):
        r.Float8BlockScaling(x_block_scaling_dim=2)
    with pytest.raises(ValidationError, match="Only 1D or 2D blocks supported for w"):
        r.Float8BlockScaling(w_block_scaling_dim=3)
    # pydantic ignores unknown keywords, which Megatron's TEDelayedScaling passes
    d = r.DelayedScaling(margin=0, fp8_format=r.Format.HYBRID, override_linear_precision=(0, 0, 1),
                         params_dtype=torch.bfloat16, device="cpu", amax_history_len=8)
    assert d.delayed() and d.amax_history_len == 8 and not hasattr(d, "override_linear_precision")
    assert r.MXFP8BlockScaling().fp8_format == r.Format.E4M3
    assert r.Float8CurrentScaling().fp8_format == r.Format.HYBRID


@check
def megatron_builds_every_recipe():
    from megatron.core.fp8_utils import get_fp8_recipe
    from megatron.core.transformer.transformer_config import TransformerConfig

    r = recipe()
    kinds = {"delayed": r.DelayedScaling, "tensorwise": r.Float8CurrentScaling,
             "mxfp8": r.MXFP8BlockScaling, "blockwise": r.Float8BlockScaling}
    for name, cls in kinds.items():
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, fp8="hybrid"
                                if name != "blockwise" else "e4m3", fp8_recipe=name,
                                use_cpu_initialization=True)
        got = get_fp8_recipe(cfg)
        assert isinstance(got, cls), (name, type(got))


@check
def fp8_dims_asserted():
    t, r = te(), recipe()
    lin = t.Linear(24, 16, device="cpu")
    with t.fp8_autocast(enabled=True, fp8_recipe=r.DelayedScaling()):
        with pytest.raises(AssertionError, match="FP8 execution requires the product of all "
                                                 "dimensions except the last to be divisible by 8"):
            lin(torch.randn(8, 24))
        with pytest.raises(AssertionError, match="divisible by 16"):
            t.Linear(32, 16, device="cpu")(torch.randn(4, 32))  # 4 rows: not a multiple of 8
    lin = t.Linear(32, 32, device="cpu")
    with t.fp8_autocast(enabled=True, fp8_recipe=r.MXFP8BlockScaling()):
        with pytest.raises(AssertionError, match="Tensor dims must be divisible by 32"):
            lin(torch.randn(16, 32))  # tensor/mxfp8_tensor.py:112-118
        lin(torch.randn(32, 32))


@check
def fp8_sequence_parallel_needs_amax_reduction():
    # base.py:1060-1064
    t, r = te(), recipe()
    lin = t.Linear(32, 32, device="cpu", parallel_mode="row", tp_size=2, sequence_parallel=True)
    lin.set_tensor_parallel_group(None)
    with t.fp8_autocast(enabled=True, fp8_recipe=r.DelayedScaling(reduce_amax=False)):
        with pytest.raises(AssertionError, match="Amax reduction across tensor parallel group"):
            lin(torch.randn(16, 16))


def _ref_qdq(x, scale, dtype, fmax):
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


@check
def fp8_tensorwise_numerics():
    t, r = te(), recipe()
    torch.manual_seed(0)
    lin = t.Linear(32, 16, device="cpu", bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    hp = lin(x)
    with t.fp8_autocast(enabled=True, fp8_recipe=r.Float8CurrentScaling()):
        y = lin(x)
    xs = 448.0 / x.detach().float().abs().amax()
    ws = 448.0 / lin.weight.detach().float().abs().amax()
    ref = (_ref_qdq(x.detach(), xs, torch.float8_e4m3fn, 448.0)
           @ _ref_qdq(lin.weight.detach(), ws, torch.float8_e4m3fn, 448.0).t()).to(torch.bfloat16)
    assert torch.equal(y, ref)
    err = (y.float() - hp.float()).abs().max() / hp.float().abs().max()
    assert 1e-3 < err < 0.1, err  # e4m3 has a 3-bit mantissa: a few percent, not zero
    g = torch.randn_like(y)
    y.backward(g)  # HYBRID: gradients in e5m2 (quantization.py:117-123)
    gs = 57344.0 / g.float().abs().amax()
    dx = (_ref_qdq(g, gs, torch.float8_e5m2, 57344.0)
          @ _ref_qdq(lin.weight.detach(), ws, torch.float8_e4m3fn, 448.0)).to(torch.bfloat16)
    assert torch.equal(x.grad, dx)


@check
def fp8_block_recipes_numerics():
    t, r = te(), recipe()
    torch.manual_seed(0)
    x = torch.randn(32, 256)
    x[:, :32] *= 100  # one block far larger: per-block scales keep the others precise
    lin = t.Linear(256, 32, device="cpu", bias=False)
    hp = lin(x)
    outs = {}
    for name, rec in (("mxfp8", r.MXFP8BlockScaling()), ("blockwise", r.Float8BlockScaling()),
                      ("tensorwise", r.Float8CurrentScaling())):
        with t.fp8_autocast(enabled=True, fp8_recipe=rec):
            outs[name] = lin(x)
    # reference MXFP8: 32-wide blocks along the last dim, power-of-two scales
    def mx(v):
        b = v.reshape(v.shape[0], -1, 32)
        sinv = torch.exp2(torch.ceil(torch.log2(b.abs().amax(-1, keepdim=True) / 448.0)))
        return ((b / sinv).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sinv).reshape(v.shape)
    torch.testing.assert_close(outs["mxfp8"], mx(x) @ mx(lin.weight.detach()).t(), rtol=1e-5, atol=1e-5)
    err = {k: ((v - hp).abs().max() / hp.abs().max()).item() for k, v in outs.items()}
    assert all(0 < e < 0.1 for e in err.values()), err
    assert err["mxfp8"] < err["tensorwise"] and err["blockwise"] < err["tensorwise"], err


@check
def fp8_delayed_scaling_state_and_extra_state():
    t, r = te(), recipe()
    torch.manual_seed(0)
    rec = r.DelayedScaling(amax_history_len=4, fp8_format=r.Format.HYBRID, margin=0)
    lin = t.Linear(32, 16, device="cpu", bias=False)
    x = torch.randn(16, 32)
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        y = lin(x)  # first step: scale 1
    st = lin.fp8_meta["scaling_fwd"]
    assert st.scale.shape == (3,) and st.amax_history.shape == (4, 3)
    ref = (_ref_qdq(x, torch.tensor(1.0), torch.float8_e4m3fn, 448.0)
           @ _ref_qdq(lin.weight.detach(), torch.tensor(1.0), torch.float8_e4m3fn, 448.0).t())
    assert torch.equal(y, ref)
    # at the autocast's exit the amaxes became the scales (quantization.py:880-904), history rolled
    torch.testing.assert_close(st.scale[0], 448.0 / x.abs().amax())
    torch.testing.assert_close(st.scale[1], 448.0 / lin.weight.detach().abs().amax())
    assert torch.all(st.amax_history[0] == 0)
    torch.testing.assert_close(st.amax_history[-1, 0], x.abs().amax())
    y.sum().backward()  # the first module's backward updates the backward scales
    g = lin.fp8_meta["scaling_bwd"]
    assert g.scale.shape == (2,) and g.scale[0] == 57344.0  # grad amax 1: 57344 / 1
    # get_extra_state / set_extra_state (base.py:806-918) carry the state
    lin2 = t.Linear(32, 16, device="cpu", bias=False)
    lin2.load_state_dict(lin.state_dict())
    for key in ("scaling_fwd", "scaling_bwd"):
        assert torch.equal(lin2.fp8_meta[key].scale, lin.fp8_meta[key].scale)
        assert torch.equal(lin2.fp8_meta[key].amax_history, lin.fp8_meta[key].amax_history)
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        assert torch.equal(lin2(x), lin(x))


@check
def fp8_delayed_buffer_registers_once_and_updates_every_module():
    """TE's delayed-scaling buffer (quantization.py:350-402, 487-539): a module registers once
    (its first forward); every later update of the buffer -- at an autocast's exit (forward) or
    in the first module's backward -- updates every registered module, whether or not it ran
    since (a replayed graph runs no module code: Megatron's replay calls the update itself,
    cuda_graphs.py:648-652); no backward update while a graph is captured (linear.py:969)."""
    from transformer_engine.pytorch import graph as te_graph
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as mgr

    t, r = te(), recipe()
    mgr.reset()
    rec = r.DelayedScaling(amax_history_len=4)
    a, b = t.Linear(32, 16, device="cpu", bias=False), t.Linear(32, 16, device="cpu", bias=False)
    x = torch.randn(16, 32)
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        a(x), b(x)
    assert [len(v) for v in mgr.global_amax_buffer.values()] == [2, 2]  # forward_ and backward_
    hist_b = b.fp8_meta["scaling_fwd"].amax_history.clone()
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        a(x)  # b does not run: its history still rolls at the exit
    assert [len(v) for v in mgr.global_amax_buffer.values()] == [2, 2]  # registered once
    assert torch.equal(b.fp8_meta["scaling_fwd"].amax_history, torch.roll(hist_b, -1, 0).index_fill_(0, torch.tensor([0]), 0.0))
    bwd = b.fp8_meta["scaling_bwd"]
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        y = a(x)  # a is the autocast's first module: its backward updates the backward buffer
    before = bwd.amax_history.clone()
    te_graph.set_capture_start()
    try:
        y.sum().backward()
    finally:
        te_graph.set_capture_end()
    assert torch.equal(bwd.amax_history, before), "updated while a graph was captured"
    bwd.amax_history[0, 0] = 2.0  # an amax b recorded (b does not run below)
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        y = a(x)
    y.sum().backward()  # a's backward updates b too: scale = fp8 max / amax, history rolled
    assert bwd.scale[0] == 57344.0 / 2.0 and bwd.amax_history[-1, 0] == 2.0 and bwd.amax_history[0, 0] == 0
    mgr.reset()


@check
def compat_restore_goes_through_te_methods():
    from megatron_fastpath.compat.te import (te_fp8_delayed_scaling_state,
                                             te_restore_fp8_delayed_scaling_state)

    t, r = te(), recipe()
    rec = r.DelayedScaling(amax_history_len=4)
    lin = t.Linear(32, 16, device="cpu")
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        lin(torch.randn(16, 32)).sum().backward()
    state = {k: v.clone() for k, v in te_fp8_delayed_scaling_state(lin).items()}
    fresh = t.Linear(32, 16, device="cpu")
    assert te_fp8_delayed_scaling_state(fresh) is None
    te_restore_fp8_delayed_scaling_state(fresh, state, rec)
    got = te_fp8_delayed_scaling_state(fresh)
    assert all(torch.equal(got[k], state[k]) for k in state)


@check
def fp8_recompute_state_reenters_the_recipe():
    """compat/te_quantized.FP8RecomputeState (the offload layer's recompute): captured inside
    an FP8 autocast it re-enters the same recipe and group in TE's recompute phase
    (distributed.py:228-263)."""
    from megatron_fastpath.compat.te_quantized import FP8RecomputeState
    from transformer_engine.pytorch import distributed as te_dist
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    t, r = te(), recipe()
    assert not FP8RecomputeState().enabled  # outside any autocast
    rec = r.Float8CurrentScaling()
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        state = FP8RecomputeState()
        with state.forward_context():
            assert not te_dist.in_fp8_activation_recompute_phase()
            assert te_dist.is_fp8_activation_recompute_enabled()
    assert state.enabled and state.recipe is rec and not FP8GlobalStateManager.is_fp8_enabled()
    with state.recompute_context():
        assert FP8GlobalStateManager.is_fp8_enabled()
        assert FP8GlobalStateManager.get_fp8_recipe() is rec
        assert te_dist.in_fp8_activation_recompute_phase()
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert not te_dist.in_fp8_activation_recompute_phase()


@check
def megatron_te_wrappers_build_and_compute():
    """Megatron's TEColumnParallelLinear / TERowParallelLinear / TELayerNormColumnParallelLinear
    / TENorm on the fake (world 1): (out, bias) returns, TE's parameter names in their sharded
    state dicts, the math; gather_output / input_is_parallel=False refused by Megatron."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear, TELayerNormColumnParallelLinear, TENorm, TERowParallelLinear)
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fastpath.distributed import init_distributed

    init_distributed(backend="gloo")
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                            use_cpu_initialization=True, add_bias_linear=True,
                            normalization="RMSNorm")
    init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
    col = TEColumnParallelLinear(32, 48, config=cfg, init_method=init, gather_output=False,
                                 bias=True, skip_bias_add=True, is_expert=False)
    row = TERowParallelLinear(48, 32, config=cfg, init_method=init, bias=True,
                              input_is_parallel=True, skip_bias_add=False, is_expert=False)
    lnl = TELayerNormColumnParallelLinear(32, 48, config=cfg, init_method=init,
                                          gather_output=False, bias=False, skip_bias_add=False,
                                          is_expert=False)
    norm = TENorm(cfg, 32, eps=1e-5)
    x = torch.randn(8, 2, 32)
    with torch.no_grad():
        col.bias.normal_()
        row.bias.normal_()
    out, b = col(x)
    torch.testing.assert_close(out, x @ col.weight.t())
    assert torch.equal(b, col.bias)  # skip_bias_add: returned
    out, b = row(out)
    assert b is None
    out2, _ = lnl(x)
    torch.testing.assert_close(out2, norm(x) @ lnl.weight.t(), rtol=1e-5, atol=1e-6)
    keys = set(lnl.sharded_state_dict(prefix="l.", metadata={"dp_cp_group": None}).keys())
    assert {"l.weight", "l.layer_norm_weight", "l._extra_state"} <= keys, keys
    with pytest.raises(ValueError, match="gather_output = True"):
        TEColumnParallelLinear(32, 48, config=cfg, init_method=init, gather_output=True,
                               bias=False, skip_bias_add=False, is_expert=False)
    with pytest.raises(ValueError, match="input_is_parallel = False"):
        TERowParallelLinear(48, 32, config=cfg, init_method=init, bias=False,
                            input_is_parallel=False, skip_bias_add=False, is_expert=False)


if __name__ == "__main__":
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except BaseException:  # noqa: BLE001 -- reported to the parent test
            results[name] = traceback.format_exc()
    print(json.dumps(results))
