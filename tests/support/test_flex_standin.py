"""The FlexAttention stand-in (tests/support/flex_standin.py) the feature matrix trains the flex
backend on: its forward is torch's own flex_attention bit for bit, its gradients equal an fp64
reference nobody here wrote (torch SDPA with the packed boolean mask; explicit math with the
soft-cap), and it raises what torch's CUDA kernel raises."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from megatron_fastpath.packed_seq.params import packed_causal_mask_mod
from tests.support.flex_standin import REAL_FLEX, CompiledFlexStandin, flex_attention_standin

T, HQ = 128 * 3, 4
LENS = [100, 57, 130, 60]  # 347 real tokens + 37 padding (id -1)


def _seq():
    return torch.cat([torch.full((n,), i) for i, n in enumerate(LENS)]
                     + [torch.full((T - sum(LENS),), -1)])


@pytest.mark.parametrize("hkv, e, window, cap", [
    (4, 16, None, None), (4, 32, 64, None), (2, 16, None, 30.0), (2, 32, 50, 5.0), (1, 16, 17, 2.0)])
def test_forward_is_torchs_and_grads_equal_an_fp64_reference(hkv, e, window, cap):
    torch.manual_seed(0)
    mm = packed_causal_mask_mod(_seq(), window)
    bm = create_block_mask(mm, None, None, T, T, device="cpu", BLOCK_SIZE=128)
    q, k, v = (torch.randn(1, h, T, e, requires_grad=True) for h in (HQ, hkv, hkv))
    scale, gqa = 0.3, hkv != HQ
    extra = {} if cap is None else {"score_mod": lambda s, b, h, qi, ki: torch.tanh(s / cap) * cap}
    out = flex_attention_standin(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa, **extra)
    with torch.no_grad():
        real = REAL_FLEX(q.detach(), k.detach(), v.detach(), block_mask=bm, scale=scale,
                         enable_gqa=gqa, **extra)
    assert torch.equal(out, real)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), go)
    keep = create_mask(mm, 1, 1, T, T, device="cpu")
    q2, k2, v2 = (x.detach().double().requires_grad_() for x in (q, k, v))
    if cap is None:
        ref = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=keep, scale=scale, enable_gqa=gqa)
    else:
        kk, vv = k2.repeat_interleave(HQ // hkv, 1), v2.repeat_interleave(HQ // hkv, 1)
        s = torch.tanh(q2 @ kk.transpose(-1, -2) * scale / cap) * cap
        ref = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ vv
    refs = torch.autograd.grad(ref, (q2, k2, v2), go.double())
    for got, want in zip(grads, refs):
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_raises_what_torch_raises():
    q = torch.randn(1, 4, T, 16, requires_grad=True)
    bm = create_block_mask(packed_causal_mask_mod(_seq()), None, None, T, T, device="cpu")
    kv = lambda h, e=16: torch.randn(1, h, T, e)  # noqa: E731
    # the CUDA kernel's (_inductor/kernel/flex/flex_attention.py: torch 2.13 :156-163, 742-748;
    # torch 2.11 :138-145, 692-698)
    with pytest.raises(NotImplementedError, match="must be at least 16 but got E=8"):
        flex_attention_standin(q[..., :8], q[..., :8], q[..., :8], block_mask=bm)
    with pytest.raises(ValueError, match="mixed query, key, and value dtype"):
        flex_attention_standin(q, kv(4).bfloat16(), kv(4).bfloat16(), block_mask=bm)
    # torch's own Python checks, run by the real forward
    for k, gqa in ((kv(3), True), (kv(2), False), (kv(4, 32), False)):
        with pytest.raises(ValueError):
            flex_attention_standin(q, k, k, block_mask=bm, enable_gqa=gqa)
    with pytest.raises(ValueError):
        flex_attention_standin(q[:, :, :256], q[:, :, :256], q[:, :, :256], block_mask=bm)
    # and the limitation it stands in for is real
    with pytest.raises(NotImplementedError, match="backward"):
        REAL_FLEX(q, q, q, block_mask=bm)


def test_the_compiled_stand_in_refuses_more_specialisations_than_dynamo_compiles():
    fn = CompiledFlexStandin(flex_attention_standin, dynamic=False)
    limit = torch._dynamo.config.recompile_limit
    for n in range(limit):
        x = torch.randn(1, 1, 128 + n, 16)
        fn(x, x, x)
    with pytest.raises(AssertionError, match="recompile_limit"):
        x = torch.randn(1, 1, 128 + limit, 16)
        fn(x, x, x)
