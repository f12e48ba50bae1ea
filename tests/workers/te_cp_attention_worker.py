"""Torchrun worker (2 processes, gloo) of ``test_fake_te_cp_attention.py``: the fake Transformer
Engine 2.10's ``DotProductAttention`` at context parallelism 2 -- Megatron's
``TEDotProductAttention`` at CP 2 against the same module at CP 1 on the whole sequence
(split with Megatron's ``get_batch_on_this_cp_rank``), per comm type, and each refusal TE has
for CP. Rank 0 prints ``{check name: "ok" | the failure on some rank}`` as JSON on the last line.

    torchrun --nproc_per_node=2 -m tests.workers.te_cp_attention_worker
"""

from tests.support.fake_te.activate import activate

activate()  # before Megatron is imported

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.workers.te_contracts_worker import recipe, te  # noqa: E402

CHECKS = {}
NO_BACKEND = "No dot product attention backend is available for the provided inputs"
S, B, H, G = 16, 2, 4, 2  # global sequence, batch, heads, GQA groups
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}  # one unit in the last place, about


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def init():
    """Megatron's parallel state at CP 2 on gloo (world 2)."""
    from megatron.core import parallel_state

    from megatron_fastpath.distributed import init_distributed

    init_distributed(backend="gloo", context_parallel_size=2, timeout_s=120)
    return parallel_state.get_context_parallel_group()


def split(x, fmt="sbhd"):
    """This CP rank's load-balanced chunks of a whole-sequence tensor (Megatron's
    ``get_batch_on_this_cp_rank``, which splits dim 1: sbhd goes through bshd)."""
    from tests.support.megatron_cp import megatron_cp_split

    t = x.transpose(0, 1) if fmt == "sbhd" else x
    t = megatron_cp_split({"x": t})["x"]
    return (t.transpose(0, 1) if fmt == "sbhd" else t).contiguous()


def whole(d=16, dv=None, h=H, g=G, dtype=torch.bfloat16, fmt="sbhd", seed=0):
    """q, k, v over the whole sequence, the same on both ranks."""
    gen = torch.Generator().manual_seed(seed)
    shape = (lambda n, e: (S, B, n, e)) if fmt == "sbhd" else (lambda n, e: (B, S, n, e))
    return [torch.randn(*shape(n, e), generator=gen).to(dtype)
            for n, e in ((h, d), (g, d), (g, dv or d))]


def run(dpa, tensors, fmt="sbhd", cp=True, seed=1, **kw):
    """(output, [dq, dk, dv]) of ``dpa`` on the whole tensors (cp=False) or this rank's
    chunks of them (cp=True), the output gradient a fixed random tensor split alike; the
    whole-sequence results are split for comparison."""
    xs = [(split(x, fmt) if cp else x).clone().requires_grad_() for x in tensors]
    out = dpa(*xs, **kw)
    extra = None
    if isinstance(out, tuple):
        out, extra = out
    gen = torch.Generator().manual_seed(seed)
    full_shape = list(out.shape)
    full_shape[fmt.index("s")] = S
    g = torch.randn(*full_shape, generator=gen).to(out.dtype)
    out.backward(split(g, fmt) if cp else g)
    res = [out.detach()] + [x.grad for x in xs]
    if not cp:
        res = [split(r, fmt) for r in res]
    return res, extra


def assert_same(a, b, dtype):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.float(), y.float(), rtol=TOL[dtype], atol=TOL[dtype])


def megatron_dpa(cp_size, cp_comm_type="p2p", dtype=torch.bfloat16, **kw):
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.support.cuda_as_cpu import cuda_as_cpu

    cfg = dict(num_layers=1, hidden_size=64, num_attention_heads=H, num_query_groups=G,
               use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
               context_parallel_size=cp_size, bf16=dtype == torch.bfloat16,
               fp16=dtype == torch.float16, params_dtype=dtype)
    cfg.update(kw)
    with cuda_as_cpu():  # Megatron makes a torch.cuda.Stream for TE's cp_stream (mcore L1232)
        return TEDotProductAttention(TransformerConfig(**cfg), layer_number=1,
                                     attn_mask_type=AttnMaskType.causal, attention_type="self",
                                     cp_comm_type=cp_comm_type)


# ------------------------------------------------------------------------------------- math
@check
def megatron_te_dpa_cp2_equals_cp1_per_comm_type():
    """Output and q/k/v gradients per token: CP 2 == CP 1 on the whole sequence, causal, sbhd,
    GQA, for p2p / all_gather / a2a, bf16 and fp16 (TE has no CP backend for fp32)."""
    from megatron.core.transformer.enums import AttnMaskType

    group = init()
    for dtype in (torch.bfloat16, torch.float16):
        tensors = whole(dtype=dtype)
        ref, _ = run(megatron_dpa(1, dtype=dtype), tensors, cp=False,
                     attention_mask=None, attn_mask_type=AttnMaskType.causal)
        for comm in ("p2p", "all_gather", "a2a"):
            dpa = megatron_dpa(2, comm, dtype=dtype)
            assert dpa.cp_group is group and dpa.cp_comm_type == comm
            assert dpa.cp_global_ranks == [0, 1] and dpa.cp_stream is not None
            got, _ = run(dpa, tensors, attention_mask=None, attn_mask_type=AttnMaskType.causal)
            assert_same(got, ref, dtype)
            # no_mask too
            ref_n, _ = run(megatron_dpa(1, dtype=dtype), tensors, cp=False,
                           attention_mask=None, attn_mask_type=AttnMaskType.no_mask)
            got_n, _ = run(dpa, tensors, attention_mask=None, attn_mask_type=AttnMaskType.no_mask)
            assert_same(got_n, ref_n, dtype)


@check
def bshd_window_max_logit_and_hierarchical_cp_equal_cp1():
    """The fake's class at CP 2 on Megatron's CP group: bshd; a causal sliding window (a2a,
    all_gather: cp.py:4026-4029); the max logit all-reduced over CP (cp.py:1801-1804); a2a+p2p
    with a p2p level of one rank is a2a (cp.py:3996-4001)."""
    group = init()
    DPA = te().DotProductAttention
    cp = dict(cp_group=group, cp_global_ranks=[0, 1], cp_stream=None)
    t = whole(fmt="bshd")
    ref, _ = run(DPA(H, 16, num_gqa_groups=G, qkv_format="bshd"), t, "bshd", cp=False)
    for comm in ("p2p", "all_gather", "a2a"):
        got, _ = run(DPA(H, 16, num_gqa_groups=G, qkv_format="bshd", cp_comm_type=comm, **cp),
                     t, "bshd")
        assert_same(got, ref, torch.bfloat16)
    t = whole()
    ref, _ = run(DPA(H, 16, num_gqa_groups=G, window_size=(3, 0)), t, cp=False)
    for comm in ("all_gather", "a2a"):
        got, _ = run(DPA(H, 16, num_gqa_groups=G, window_size=(3, 0), cp_comm_type=comm, **cp), t)
        assert_same(got, ref, torch.bfloat16)
    ref, ml_ref = run(DPA(H, 16, num_gqa_groups=G, return_max_logit=True), t, cp=False)
    got, ml = run(DPA(H, 16, num_gqa_groups=G, return_max_logit=True, **cp), t)
    assert_same(got, ref, torch.bfloat16)
    torch.testing.assert_close(ml, ml_ref)
    me = [torch.distributed.new_group([r]) for r in range(2)][torch.distributed.get_rank()]
    hier = DPA(H, 16, num_gqa_groups=G, cp_group=[group, me], cp_global_ranks=[0, 1],
               cp_comm_type="a2a+p2p")
    got, _ = run(hier, t)
    ref, _ = run(DPA(H, 16, num_gqa_groups=G), t, cp=False)
    assert_same(got, ref, torch.bfloat16)


@check
def fp8_attention_at_cp2_as_at_cp1():
    """Delayed scaling + fp8_dpa, head_dim 128, first step (scales 1): p2p / a2a at CP 2 give the
    CP-1 FP8 attention per token; all_gather gives the high-precision one (TE does not pass
    fp8 to it, cp.py:4088-4092)."""
    t, r = te(), recipe()
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    group = init()
    tensors = whole(d=128, h=2, g=2)
    DPA = t.DotProductAttention

    def fp8_run(comm=None, fp8=True):
        FP8GlobalStateManager.reset()
        cp = {} if comm is None else dict(cp_group=group, cp_global_ranks=[0, 1],
                                           cp_comm_type=comm)
        d = DPA(2, 128, **cp)
        with t.fp8_autocast(enabled=fp8, fp8_recipe=r.DelayedScaling(fp8_dpa=True)):
            return run(d, tensors, cp=comm is not None)[0]

    ref, hp = fp8_run(), fp8_run(fp8=False)
    assert not torch.equal(ref[0], hp[0])
    for comm in ("p2p", "a2a"):
        assert_same(fp8_run(comm), ref, torch.bfloat16)
    assert_same(fp8_run("all_gather"), hp, torch.bfloat16)
    FP8GlobalStateManager.reset()


# ---------------------------------------------------------------------------------- refusals
@check
def cp_inputs_te_refuses_raise():
    """Each CP refusal of TE 2.10, with TE's error (where TE has no backend: its ValueError)."""
    t, r = te(), recipe()
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    group = init()
    DPA = t.DotProductAttention
    cp = dict(cp_group=group, cp_global_ranks=[0, 1])
    q, k, v = (split(x) for x in whole())

    def raises(exc, match, init_kw=None, tensors=None, **call):
        d = DPA(H, (tensors or (q, k, v))[0].shape[-1], num_gqa_groups=G,
                **{**cp, **(init_kw or {})})
        with pytest.raises(exc, match=match):
            d(*(tensors or (q, k, v)), **call)

    # no backend: fp32 (FusedAttention takes fp16 / bf16, utils.py:444-465; Unfused no CP,
    # utils.py:762-766); bottom-right causal (utils.py:801-806); causal cross attention of
    # unequal lengths (utils.py:807-812); a pre-scale bias (utils.py:813-819); arbitrary mask
    # (utils.py:851-859)
    raises(ValueError, NO_BACKEND, tensors=[x.float() for x in (q, k, v)])
    raises(ValueError, NO_BACKEND, attn_mask_type="causal_bottom_right")
    raises(ValueError, NO_BACKEND, {"attention_type": "cross"},
           tensors=(q, torch.cat([k, k]), torch.cat([v, v])))
    raises(ValueError, NO_BACKEND, core_attention_bias_type="pre_scale_bias",
           core_attention_bias=torch.zeros(1, H, 8, 16, dtype=torch.bfloat16))
    raises(ValueError, NO_BACKEND, attn_mask_type="arbitrary",
           attention_mask=torch.zeros(B, 1, 8, 16, dtype=torch.bool))
    # backends.py:1796-1799: padding
    raises(AssertionError, "Padding mask not supported with context parallelism!",
           attn_mask_type="padding_causal",
           attention_mask=torch.zeros(B, 1, 1, 8, dtype=torch.bool))
    # cp.py:4026-4029: a sliding window only with a2a / all_gather (TE's message has no f-prefix)
    raises(AssertionError, r"sliding window attention with \{cp_comm_type=\}!",
           {"window_size": (3, 0)})
    # cp.py:4032-4035: MLA only with p2p / a2a+p2p
    mla = (q, k, v[..., :8])
    for comm in ("all_gather", "a2a"):
        d = DPA(H, (16, 8), num_gqa_groups=G, cp_comm_type=comm, **cp)
        with pytest.raises(AssertionError, match=r"does not support MLA with \{cp_comm_type=\}!"):
            d(*mla)
    # cp.py:1432-1434, 2846-2848, 3377-3379: the local sequence in two halves
    odd = [x[:7] for x in (q, k, v)]
    for comm in ("p2p", "all_gather", "a2a"):
        raises(AssertionError, "Sequence length per GPU needs to be divisible by 2!",
               {"cp_comm_type": comm}, tensors=odd)
    # cp.py:2805, 3319: no bias with all_gather / a2a; cp.py:3993-3995 with a2a+p2p
    bias = dict(core_attention_bias_type="post_scale_bias",
                core_attention_bias=torch.zeros(1, H, 8, 16, dtype=torch.bfloat16))
    for comm in ("all_gather", "a2a"):
        raises(AssertionError, "post_scale_bias bias type is not supported!",
               {"cp_comm_type": comm}, **bias)
    raises(NotImplementedError, "attention bias with context parallelism", **bias)  # p2p
    me = [torch.distributed.new_group([rk]) for rk in range(2)][torch.distributed.get_rank()]
    raises(AssertionError, "not supported with hierarchical CP",
           {"cp_comm_type": "a2a+p2p", "cp_group": [group, me]}, **bias)
    # cp.py:2806, 3320: head dim % 8 with all_gather / a2a
    q4, k4, v4 = (x[..., :4] for x in (q, k, v))
    for comm in ("all_gather", "a2a"):
        raises(AssertionError, "Hidden size per attention head should be multiple of 8!",
               {"cp_comm_type": comm}, tensors=(q4, k4, v4))
    # cp.py:3365-3367: a2a scatters heads over CP
    q3, k3, v3 = (split(x) for x in whole(h=3, g=3))
    d = DPA(3, 16, cp_comm_type="a2a", **cp)
    with pytest.raises(AssertionError, match="number of attention heads needs to be divisible"):
        d(q3, k3, v3)
    # cp.py:3986-3988, 4003-4005: the group's type for the comm type
    raises(AssertionError, r"requires cp_group = \[a2a_cp_group, p2p_cp_group\]!",
           {"cp_comm_type": "a2a+p2p"})
    raises(AssertionError, "cp_group must be .*ProcessGroup.* type for cp_comm_type='p2p'!",
           {"cp_group": [group, me]})
    # cp.py:4107-4108
    raises(ValueError, "Unsupported communication type: ring!", {"cp_comm_type": "ring"})
    # THD is not stood in, with CP as without
    raises(NotImplementedError, "thd", tensors=[x[:, 0] for x in (q, k, v)], qkv_format="thd")
    # FP8: backends.py:1855-1858 delayed scaling needs the amax reduction; utils.py:826-831 no
    # FP8 MLA (here inference, where CP 1 has a backend)
    q8, k8, v8 = (split(x) for x in whole(d=128, h=2, g=2))
    FP8GlobalStateManager.reset()
    with t.fp8_autocast(enabled=True, fp8_recipe=r.DelayedScaling(fp8_dpa=True, reduce_amax=False)):
        with pytest.raises(AssertionError, match="Amax reduction across TP.CP group is necessary"):
            DPA(2, 128, **cp)(q8, k8, v8)
    FP8GlobalStateManager.reset()
    mla8 = (q8, k8, v8[..., :64])
    with t.fp8_autocast(enabled=True, fp8_recipe=r.DelayedScaling(fp8_dpa=True)):
        DPA(2, (128, 64)).eval()(*mla8)
        with pytest.raises(ValueError, match=NO_BACKEND):
            DPA(2, (128, 64), **cp).eval()(*mla8)
    FP8GlobalStateManager.reset()


def main():
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except BaseException:  # noqa: BLE001 -- reported to the parent test
            results[name] = traceback.format_exc()
            print(results[name], file=sys.stderr, flush=True)  # a failed rank may desync
    every = [None, None]
    torch.distributed.all_gather_object(every, results)
    if torch.distributed.get_rank() == 0:
        merged = {n: next((f"rank {r}: {res[n]}" for r, res in enumerate(every) if res[n] != "ok"),
                          "ok") for n in results}
        print(json.dumps(merged))


if __name__ == "__main__":
    main()
