"""Child-process worker of ``test_fake_te_contracts.py``: each check builds or calls the fake
Transformer Engine (``tests/support/fake_te``) the way a broken caller would and asserts TE's
answer; prints ``{check name: "ok" | the failure}`` as JSON on the last line.

    python -m tests.workers.te_contracts_worker
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


# --------------------------------------------------------------------------- GroupedLinear
def _gl_ref(x, ws, bs, m_splits):
    """Per-group reference with torch ops (autograd through it)."""
    outs, start = [], 0
    for i, m in enumerate(m_splits):
        y = x[start:start + m] @ ws[i].t()
        outs.append(y + bs[i] if bs is not None else y)
        start += m
    return torch.cat(outs)


def _gl(n=3, fin=32, fout=16, **kw):
    kw.setdefault("device", "cpu")
    return te().GroupedLinear(n, fin, fout, **kw)


@check
def grouped_linear_keywords():
    # grouped_linear.py:559-581: TE 2.10's keywords, no other (no ``name``, which Linear has)
    t = te()
    g = t.GroupedLinear(2, 16, 32, sequence_parallel=False, fuse_wgrad_accumulation=False,
                        tp_group=None, tp_size=1, get_rng_state_tracker=None,
                        rng_tracker_name="expert-parallel-rng", init_method=None, bias=True,
                        return_bias=False, params_dtype=torch.float32, parallel_mode=None,
                        device="cpu", ub_overlap_rs=False, ub_overlap_ag=False, ub_name=None,
                        delay_wgrad_compute=False, save_original_input=False)
    assert [n for n, _ in g.named_parameters()] == ["weight0", "bias0", "weight1", "bias1"]
    assert tuple(g.weight1.shape) == (32, 16) and tuple(g.bias0.shape) == (32,)
    assert torch.all(g.bias0 == 0)  # init_method_constant(0.0) (grouped_linear.py:665)
    for bad in ({"name": "x"}, {"not_a_te_keyword": 1}, {"normalization": "RMSNorm"}):
        with pytest.raises(TypeError):
            _gl(**bad)
    nb = _gl(bias=False)
    assert [n for n, _ in nb.named_parameters()] == ["weight0", "weight1", "weight2"]
    assert nb.bias0.numel() == 0 and not isinstance(nb.bias0, torch.nn.Parameter)
    with pytest.raises(AssertionError, match="GroupedLinear doesn't support Userbuffer overlap"):
        _gl(ub_overlap_ag=True)
    with pytest.raises(ValueError, match="doesn't support bias when TP > 1"):
        _gl(tp_size=2, parallel_mode="column")
    with pytest.raises(AssertionError, match="parallel_mode diagonal not supported"):
        _gl(parallel_mode="diagonal")
    with pytest.raises(AssertionError, match="16 is not divisible by 3"):
        _gl(fout=16, tp_size=3, bias=False, parallel_mode="column")
    col = _gl(fin=32, fout=64, tp_size=2, bias=False, parallel_mode="column", sequence_parallel=True)
    assert tuple(col.weight0.shape) == (32, 32) and col.sequence_parallel
    assert (col.weight2.partition_dim, col.weight2.tensor_model_parallel) == (0, True)
    row = _gl(fin=32, fout=64, tp_size=2, bias=False, parallel_mode="row")
    assert tuple(row.weight0.shape) == (64, 16) and row.weight1.partition_dim == 1
    with pytest.raises(AssertionError, match="TP group not initialized"):  # base.py:1051-1052
        row(torch.randn(4, 16), [4, 0, 0])
    cb = _gl(parallel_mode="column")  # a column bias is split with the weight
    assert cb.bias1.partition_dim == 0 and not hasattr(_gl().bias0, "partition_dim")
    with pytest.raises(NotImplementedError):
        _gl(delay_wgrad_compute=True)


@check
def grouped_linear_init_inside_rng_fork():
    """base.py:1221-1251: each weight{i}'s init_method runs inside
    get_rng_state_tracker().fork(rng_tracker_name); biases zero, outside any fork."""
    import contextlib

    forks = []

    class Tracker:
        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            forks.append(name)
            state = torch.get_rng_state()
            torch.manual_seed(1234)
            try:
                yield
            finally:
                torch.set_rng_state(state)

    seen = []

    def init(w):
        seen.append(tuple(w.shape))
        torch.nn.init.normal_(w)

    torch.manual_seed(0)
    g = _gl(n=2, get_rng_state_tracker=Tracker, rng_tracker_name="expert-parallel-rng",
            init_method=init)
    assert forks == ["expert-parallel-rng"] * 2 and seen == [(16, 32)] * 2
    torch.manual_seed(1234)
    torch.testing.assert_close(g.weight0, torch.randn(16, 32), rtol=0, atol=0)
    assert torch.equal(g.weight0, g.weight1)  # each fork starts from the tracker's state
    torch.manual_seed(0)
    free = _gl(n=2, init_method=init)  # no tracker: the default generator
    torch.manual_seed(0)
    a, b = torch.randn(16, 32), torch.randn(16, 32)
    assert torch.equal(free.weight0, a) and torch.equal(free.weight1, b)


@check
def grouped_linear_m_splits_asserted():
    t, r = te(), recipe()
    g = _gl(n=3, fin=32, fout=16, bias=False)
    x = torch.randn(48, 32)
    with pytest.raises(AssertionError, match="Number of splits should match number of GEMMs."):
        g(x, [16, 32])  # grouped_linear.py:753
    with pytest.raises(TypeError):  # a device tensor of sizes: torch.split refuses it
        g(x, torch.tensor([16, 0, 32]))
    with pytest.raises(RuntimeError, match="split_with_sizes"):  # sizes must sum to the rows
        g(x, [16, 0, 16])
    with pytest.raises(ValueError, match="is not compatible with weight tensor"):  # 131-135
        g(torch.randn(48, 24), [16, 0, 32])
    with t.fp8_autocast(enabled=True, fp8_recipe=r.Float8CurrentScaling()):
        with pytest.raises(TypeError):  # split_quantize's std::vector<int>
            g(x, torch.tensor([16, 0, 32]))
        with pytest.raises(RuntimeError, match="Attempted to split tensor with shape"):
            g(x, [16, 16, 32])  # cast.cpp:729-733
        with pytest.raises(RuntimeError, match="Attempted to split tensor with shape"):
            g(x, [64, -16, 0])
        y = g(x, [16, 0, 16])  # split_quantize allows splits summing below the rows
        assert tuple(y.shape) == (32, 16)


@check
def grouped_linear_math_forward_backward():
    """fp32, no FP8: out, dgrad, wgrad and bias grads equal a per-group torch reference; an
    empty group gets zero gradients; a 3-D input keeps its middle dims (grouped_linear.py:286);
    return_bias returns one bias per GEMM (816-817)."""
    torch.manual_seed(0)
    m_splits = [5, 0, 7, 4]
    g = _gl(n=4, fin=12, fout=8)
    with torch.no_grad():
        for i in range(4):
            getattr(g, f"bias{i}").normal_()
    ws = [getattr(g, f"weight{i}") for i in range(4)]
    bs = [getattr(g, f"bias{i}") for i in range(4)]
    x = torch.randn(16, 12, requires_grad=True)
    y = g(x, m_splits)
    gy = torch.randn_like(y)
    y.backward(gy)
    got = [x.grad.clone()] + [w.grad.clone() for w in ws] + [b.grad.clone() for b in bs]
    wr = [w.detach().clone().requires_grad_() for w in ws]
    br = [b.detach().clone().requires_grad_() for b in bs]
    xr = x.detach().clone().requires_grad_()
    yr = _gl_ref(xr, wr, br, m_splits)
    yr.backward(gy)
    torch.testing.assert_close(y, yr, rtol=1e-6, atol=1e-6)
    want = [xr.grad] + [w.grad for w in wr] + [b.grad for b in br]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(ws[1].grad) == 0 and torch.count_nonzero(bs[1].grad) == 0
    x3 = torch.randn(8, 2, 12)
    torch.testing.assert_close(g(x3, [6, 2, 8, 0]).reshape(16, 8),
                               _gl_ref(x3.reshape(16, 12), ws, bs, [6, 2, 8, 0]).detach())
    rb = _gl(n=2, fin=12, fout=8, return_bias=True)
    _, biases = rb(torch.randn(6, 12), [2, 4])
    assert isinstance(biases, list) and len(biases) == 2 and torch.equal(biases[1], rb.bias1)
    xb = torch.randn(6, 12)
    out, _ = rb(xb, [2, 4])  # the bias is returned, not added
    torch.testing.assert_close(out, _gl_ref(xb, [rb.weight0, rb.weight1], None, [2, 4]))


@check
def grouped_linear_fp8_alignment_as_te():
    """TE's C++ checks (no Python dims assert in GroupedLinear): per-tensor scaling needs
    k % 16 of every non-empty GEMM (cublaslt_gemm.cu:157-158) -- in features in the forward,
    the group's rows in the wgrad (so an unaligned split fails in the backward); MXFP8 every
    split's rows and the width % 32 (quantizer.cpp:1114-1116); block scaling also the outer
    dims % 8 (cublaslt_gemm.cu:205-210, 291-297). Without FP8 nothing is required."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as mgr

    t, r = te(), recipe()
    mgr.reset()
    torch.manual_seed(0)
    g24 = _gl(n=2, fin=24, fout=16, bias=False)
    with t.fp8_autocast(enabled=True, fp8_recipe=r.DelayedScaling()):
        with pytest.raises(RuntimeError, match="Leading dimension requirement on A for FP8 GEMM"):
            g24(torch.randn(32, 24), [16, 16])
    for rec in (r.DelayedScaling(), r.Float8CurrentScaling()):
        # a module per recipe: the fake's delayed-scaling buffer keeps a module's fp8_meta (TE
        # keeps its tensors), so one module switched from delayed to another recipe breaks it
        g = _gl(n=3, fin=32, fout=16, bias=False)
        x = torch.randn(40, 32, requires_grad=True)
        with t.fp8_autocast(enabled=True, fp8_recipe=rec):
            y = g(x, [8, 0, 32])  # forward: no row requirement
        with pytest.raises(RuntimeError, match="Leading dimension requirement on A for FP8 GEMM"):
            y.sum().backward()  # wgrad: k = 8 rows
        with t.fp8_autocast(enabled=True, fp8_recipe=rec):
            g(x[:32].detach().requires_grad_(), [16, 0, 16]).sum().backward()  # aligned + empty
    g = _gl(n=3, fin=32, fout=16, bias=False)
    with t.fp8_autocast(enabled=True, fp8_recipe=r.MXFP8BlockScaling()):
        with pytest.raises(RuntimeError, match="MXFP8 requires tensor dims that are divisible by 32"):
            g(torch.randn(48, 32), [16, 0, 32])
        with pytest.raises(RuntimeError, match=r"divisible by 32 \(got shape=\[16, 32\]\)"):
            g(torch.randn(64, 32), [32, 0, 32])  # the weights' casts: out features 16
        _gl(n=3, fin=32, fout=32, bias=False)(torch.randn(64, 32, requires_grad=True),
                                              [32, 0, 32]).sum().backward()
    with t.fp8_autocast(enabled=True, fp8_recipe=r.Float8BlockScaling()):
        with pytest.raises(RuntimeError, match="Outer dimension requirement on B for NVTE_BLOCK"):
            g(torch.randn(36, 32), [4, 0, 32])
        y = g(torch.randn(40, 32, requires_grad=True), [8, 0, 32])
    with pytest.raises(RuntimeError, match="Leading dimension requirement on NVTE_BLOCK_SCALING"):
        y.sum().backward()
    g(torch.randn(40, 32, requires_grad=True), [8, 0, 32]).sum().backward()  # no FP8: any split
    mgr.reset()


@check
def grouped_linear_fp8_numerics_and_delayed_state():
    """One fp8 meta for the module, num_gemms * 3 forward / * 2 backward (base.py:731), GEMM i
    on indices 3i (input), 3i + 1 (weight), 2i (output gradient) (grouped_linear.py:604-608,
    768-785, 894-898); registered once in the autocast's buffer; scales updated at the exit
    (forward) and in the first module's backward; _extra_state round-trips."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as mgr

    t, r = te(), recipe()
    mgr.reset()
    torch.manual_seed(0)
    m_splits = [16, 0, 32]
    g = _gl(n=3, fin=32, fout=16, bias=False)
    ws = [getattr(g, f"weight{i}").detach() for i in range(3)]
    x = torch.randn(48, 32, requires_grad=True)
    rec = r.DelayedScaling(amax_history_len=4, fp8_format=r.Format.HYBRID, margin=0)
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        y = g(x, m_splits)  # first step: every scale 1
    fwd, bwd = g.fp8_meta["scaling_fwd"], g.fp8_meta["scaling_bwd"]
    assert g.fp8_meta["num_gemms"] == 3
    assert fwd.scale.shape == (9,) and fwd.amax_history.shape == (4, 9) and bwd.scale.shape == (6,)
    one = torch.tensor(1.0)
    xs = [x.detach()[:16], x.detach()[16:16], x.detach()[16:]]
    def q(v):
        return _ref_qdq(v, one, torch.float8_e4m3fn, 448.0)

    ref = torch.cat([q(xs[0]) @ q(ws[0]).t(), q(xs[2]) @ q(ws[2]).t()])
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    for i in (0, 2):  # exit: scale = 448 / amax, per GEMM
        torch.testing.assert_close(fwd.scale[3 * i], 448.0 / xs[i].abs().amax())
        torch.testing.assert_close(fwd.scale[3 * i + 1], 448.0 / ws[i].abs().amax())
        assert fwd.scale[3 * i + 2] == 1.0  # the output is not cast
    assert fwd.scale[3] == 1.0  # the empty group's input: no amax
    torch.testing.assert_close(fwd.scale[4], 448.0 / ws[1].abs().amax())  # its weight is cast
    gy = torch.randn_like(y)
    y.backward(gy)  # the first module's backward
    for i in (0, 2):
        gi = gy[:16] if i == 0 else gy[16:]
        torch.testing.assert_close(bwd.scale[2 * i], 57344.0 / gi.abs().amax())
    assert bwd.scale[2] == 1.0 and bwd.scale[1] == 1.0
    keys = [k for k in mgr.global_amax_buffer]
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        g(x, m_splits)
    assert [len(mgr.global_amax_buffer[k]) for k in keys] == [1, 1]  # registered once
    state = g.state_dict()
    assert state["_extra_state"].numel() > 0
    g2 = _gl(n=3, fin=32, fout=16, bias=False)
    g2.load_state_dict(state)
    for key in ("scaling_fwd", "scaling_bwd"):
        assert torch.equal(g2.fp8_meta[key].scale, g.fp8_meta[key].scale)
        assert torch.equal(g2.fp8_meta[key].amax_history, g.fp8_meta[key].amax_history)
    with t.fp8_autocast(enabled=True, fp8_recipe=rec):
        assert torch.equal(g2(x, m_splits), g(x, m_splits))
    mgr.reset()
    # tensorwise (current scaling): each group's own scales; gradients in e5m2
    torch.manual_seed(1)
    xh = torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True)
    gb = _gl(n=3, fin=32, fout=16, bias=False, params_dtype=torch.bfloat16)
    with t.fp8_autocast(enabled=True, fp8_recipe=r.Float8CurrentScaling()):
        yb = gb(xh, m_splits)
    parts, start = [], 0
    for i, m in enumerate(m_splits):
        if m:
            xi, wi = xh.detach()[start:start + m].float(), getattr(gb, f"weight{i}").detach().float()
            parts.append((_ref_qdq(xi, 448.0 / xi.abs().amax(), torch.float8_e4m3fn, 448.0)
                          @ _ref_qdq(wi, 448.0 / wi.abs().amax(), torch.float8_e4m3fn, 448.0).t()
                          ).to(torch.bfloat16))
        start += m
    assert torch.equal(yb, torch.cat(parts))
    hp = gb(xh, m_splits)
    err = ((yb.float() - hp.float()).abs().max() / hp.float().abs().max()).item()
    assert 1e-3 < err < 0.1, err


@check
def grouped_linear_fuse_wgrad_into_main_grad():
    """grouped_linear.py:349-354, 394-478: the wgrad GEMM writes into weight.main_grad,
    accumulating unless is_first_microbatch is True or weight0.overwrite_main_grad; with
    Megatron's DDP mark (grad_added_to_main_grad) it is set and a dummy gradient returned;
    main_grad is read in the backward (no main_grad: AttributeError)."""
    torch.manual_seed(0)
    m_splits = [3, 0, 5]
    x = torch.randn(8, 16)
    gy = torch.randn(8, 8)
    g = _gl(n=3, fin=16, fout=8, bias=False, fuse_wgrad_accumulation=True)
    ws = [getattr(g, f"weight{i}") for i in range(3)]
    ref = [torch.zeros(8, 16), torch.zeros(8, 16), torch.zeros(8, 16)]
    ref[0], ref[2] = gy[:3].t() @ x[:3], gy[3:].t() @ x[3:]
    for w in ws:
        w.main_grad = torch.ones(8, 16)
        w.grad_added_to_main_grad = False
    g(x, m_splits).backward(gy)
    for w, rf in zip(ws, ref):
        torch.testing.assert_close(w.main_grad, 1 + rf)
        assert w.grad_added_to_main_grad is True and torch.count_nonzero(w.grad) == 0
    g(x, m_splits, is_first_microbatch=True).backward(gy)  # overwritten
    for w, rf in zip(ws, ref):
        torch.testing.assert_close(w.main_grad, rf)
    g(x, m_splits, is_first_microbatch=False).backward(gy)  # accumulated
    for w, rf in zip(ws, ref):
        torch.testing.assert_close(w.main_grad, 2 * rf)
    ws[0].overwrite_main_grad = True
    g(x, m_splits).backward(gy)
    for w, rf in zip(ws, ref):
        torch.testing.assert_close(w.main_grad, rf)
    plain = _gl(n=3, fin=16, fout=8, bias=False, fuse_wgrad_accumulation=True)
    for i in range(3):
        getattr(plain, f"weight{i}").main_grad = torch.zeros(8, 16)
    plain(x, m_splits).backward(gy)  # no DDP mark: no gradient returned
    assert all(getattr(plain, f"weight{i}").grad is None for i in range(3))
    with pytest.raises(AttributeError, match="main_grad"):
        _gl(n=3, fin=16, fout=8, bias=False, fuse_wgrad_accumulation=True)(x, m_splits).backward(gy)


@check
def grouped_linear_recipe_refusals():
    # grouped_linear.py:688-692 and 100-101
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as mgr

    t, r = te(), recipe()
    mgr.reset()
    g = _gl(n=2, fin=32, fout=32, bias=False, tp_size=2, parallel_mode="column")
    g.set_tensor_parallel_group(None)
    with t.fp8_autocast(enabled=True, fp8_recipe=r.Float8CurrentScaling()):
        with pytest.raises(AssertionError, match="doesn't support TP > 1 with Float8 current"):
            g(torch.randn(32, 32), [16, 16])
    s = _gl(n=2, fin=32, fout=16, save_original_input=True)
    with t.fp8_autocast(enabled=True, fp8_recipe=r.DelayedScaling()):
        with pytest.raises(ValueError, match="DelayedScaling recipe is not supported with save_orig"):
            s(torch.randn(32, 32), [16, 16])
    s = _gl(n=2, fin=32, fout=16, save_original_input=True)  # see grouped_linear_fp8_alignment
    with t.fp8_autocast(enabled=True, fp8_recipe=r.Float8CurrentScaling()):
        s(torch.randn(32, 32), [16, 16])  # only delayed scaling is refused
    mgr.reset()


@check
def megatron_te_grouped_linear_builds_and_computes():
    """Megatron's TEColumnParallelGroupedLinear / TERowParallelGroupedLinear (is_expert, world
    1) build on the fake with the keywords they pass, return (out, None) and compute per group."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelGroupedLinear, TERowParallelGroupedLinear)
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fastpath.distributed import init_distributed

    init_distributed(backend="gloo")
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                            use_cpu_initialization=True, add_bias_linear=False,
                            num_moe_experts=3, moe_ffn_hidden_size=48)
    init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
    fc1 = TEColumnParallelGroupedLinear(3, 32, 48, config=cfg, init_method=init, bias=False,
                                        skip_bias_add=False, is_expert=True)
    fc2 = TERowParallelGroupedLinear(3, 48, 32, config=cfg, init_method=init, bias=False,
                                     skip_bias_add=False, is_expert=True)
    assert [n for n, _ in fc1.named_parameters()] == ["weight0", "weight1", "weight2"]
    assert tuple(fc1.weight0.shape) == (48, 32) and tuple(fc2.weight2.shape) == (32, 48)
    assert fc1.rng_tracker_name == "expert-parallel-rng"
    x = torch.randn(10, 32)
    h, b = fc1(x, [4, 0, 6])
    assert b is None
    torch.testing.assert_close(h, _gl_ref(x, [fc1.weight0, fc1.weight1, fc1.weight2], None,
                                          [4, 0, 6]))
    y, _ = fc2(h, [4, 0, 6])
    assert tuple(y.shape) == (10, 32)


@check
def package_te_experts_match_grouped_mm_experts():
    """megatron_fastpath's TEGroupedSwiGLUExperts on the fake GroupedLinear (built on "cuda" in
    the CUDA-as-CPU mode) equals its GroupedSwiGLUExperts (torch._grouped_mm) with the same
    weights in fp32: outputs, input and weight gradients, with and without permuted probs."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fastpath.moe.experts import GroupedSwiGLUExperts, TEGroupedSwiGLUExperts
    from tests.support.cuda_as_cpu import cuda_as_cpu

    H, FF, E = 16, 32, 4
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FF,
                            moe_ffn_hidden_size=FF, num_moe_experts=E, moe_router_topk=2,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            use_cpu_initialization=True)
    torch.manual_seed(0)
    with cuda_as_cpu():
        te_ex = TEGroupedSwiGLUExperts(E, cfg)
        ref = GroupedSwiGLUExperts(E, cfg)
        assert type(te_ex.linear_fc1).__module__.startswith("transformer_engine.pytorch")
        with torch.no_grad():
            for i in range(E):
                getattr(te_ex.linear_fc1, f"weight{i}").copy_(ref.weight1[i].t())
                getattr(te_ex.linear_fc2, f"weight{i}").copy_(ref.weight2[i].t())
        sizes = [5, 0, 7, 4]
        for probs in (None, torch.rand(sum(sizes))):
            x = torch.randn(sum(sizes), H)
            gy = torch.randn(sum(sizes), H)
            outs = []
            for ex in (te_ex, ref):
                ex.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_()
                y, bias = ex(xi, torch.tensor(sizes), probs)
                assert bias is None
                y.backward(gy)
                outs.append((y.detach(), xi.grad))
            (y_te, dx_te), (y_ref, dx_ref) = outs
            torch.testing.assert_close(y_te, y_ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(dx_te, dx_ref, rtol=1e-5, atol=1e-6)
            for i in range(E):
                torch.testing.assert_close(getattr(te_ex.linear_fc1, f"weight{i}").grad,
                                           ref.weight1.grad[i].t(), rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(getattr(te_ex.linear_fc2, f"weight{i}").grad,
                                           ref.weight2.grad[i].t(), rtol=1e-5, atol=1e-6)
            assert torch.count_nonzero(te_ex.linear_fc1.weight1.grad) == 0  # the empty expert


@check
def package_te_experts_fp8_need_the_dispatch_padding():
    """The package's FP8 dispatch padding (MoEDispatchConfig.from_transformer_config: Megatron's
    get_fp8_align_size, 16 / 32 for MXFP8) makes every split of TEGroupedSwiGLUExperts what TE's
    FP8 GEMMs need: forward + backward run under delayed scaling and MXFP8. Unpadded splits
    (13, 20, 15 rows) fail as TE fails: MXFP8 in the forward's cast, delayed scaling in the
    backward's wgrad GEMM."""
    import dataclasses

    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fastpath.moe.config import MoEDispatchConfig
    from megatron_fastpath.moe.dispatch import build_dispatch_plan, combine_tokens, permute_tokens
    from megatron_fastpath.moe.experts import TEGroupedSwiGLUExperts
    from tests.support.cuda_as_cpu import cuda_as_cpu
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as mgr

    t, r = te(), recipe()
    H, FF, E, T = 32, 32, 4, 24
    counts = [13, 0, 20, 15]  # 48 = T * k pairs
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))].view(T, 2)
    for name, rec, align in (("delayed", r.DelayedScaling(), 16), ("mxfp8", r.MXFP8BlockScaling(), 32)):
        mgr.reset()
        cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                                ffn_hidden_size=FF, moe_ffn_hidden_size=FF, num_moe_experts=E,
                                moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu,
                                add_bias_linear=False, use_cpu_initialization=True, fp8="hybrid"
                                if name == "delayed" else "e4m3", fp8_recipe=name)
        dcfg = MoEDispatchConfig.from_transformer_config(cfg)
        assert dcfg.pad_multiple == align
        torch.manual_seed(0)
        with cuda_as_cpu():
            ex = TEGroupedSwiGLUExperts(E, cfg)
        x = torch.randn(T, H, requires_grad=True)
        plan = build_dispatch_plan(ids, dcfg)
        sizes = plan.group_sizes_E.tolist()
        assert all(s % align == 0 for s in sizes) and sum(sizes) == plan.num_rows, sizes
        with t.fp8_autocast(enabled=True, fp8_recipe=rec):
            y_R, _ = ex(permute_tokens(x, plan), plan.group_sizes_E)
        combine_tokens(y_R, plan).sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        unpadded = build_dispatch_plan(ids, dataclasses.replace(dcfg, pad_multiple=1))
        assert unpadded.group_sizes_E.tolist() == counts
        xu = permute_tokens(x.detach(), unpadded).requires_grad_()
        if name == "mxfp8":
            with t.fp8_autocast(enabled=True, fp8_recipe=rec):
                with pytest.raises(RuntimeError, match="MXFP8 requires tensor dims that are divisible"):
                    ex(xu, unpadded.group_sizes_E)
        else:
            with t.fp8_autocast(enabled=True, fp8_recipe=rec):
                y_R, _ = ex(xu, unpadded.group_sizes_E)
            with pytest.raises(RuntimeError, match="Leading dimension requirement on A for FP8"):
                y_R.sum().backward()
    mgr.reset()


def run_checks(checks: dict) -> None:
    """Run each check; print ``{name: "ok" | the traceback}`` as JSON (the parent reads the
    last line). Shared with ``te_attention_worker``."""
    results = {}
    for name, fn in checks.items():
        try:
            fn()
            results[name] = "ok"
        except BaseException:  # noqa: BLE001 -- reported to the parent test
            results[name] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    run_checks(CHECKS)
