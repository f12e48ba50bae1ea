"""The grouped experts on the device: their initialisation per expert-parallel rank, and
torch._grouped_mm as sm100 computes it.

On the device (``use_cpu_initialization=False``) each expert-parallel rank initialises only
its own experts. They must come from Megatron's expert-parallel RNG stream (seeded per EP rank
by ``model_parallel_cuda_manual_seed``), as Megatron's GroupedMLP / TEGroupedLinear draw them;
from the default generator (seeded alike on every rank) every EP rank would draw the same
numbers, so experts E_l..2E_l-1 would be copies of 0..E_l-1. Run on CPU under the test-only
CUDA-as-CPU mode, whose "CUDA" generator Megatron's tracker forks for real."""

import torch
import torch.nn.functional as F
from tests.support.megatron_rng import run_as_rank
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_fastpath.moe.experts import GroupedSwiGLUExperts


def _build(ep_rank):
    tc = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
        moe_ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=False)
    return run_as_rank(lambda: GroupedSwiGLUExperts(2, tc), ep_rank=ep_rank)


def test_each_ep_rank_draws_its_experts_from_the_expert_parallel_stream(mcore_parallel):
    rank0, untouched0 = _build(0)
    rank1, untouched1 = _build(1)
    again, _ = _build(0)
    assert not torch.equal(rank0.weight1, rank1.weight1) and not torch.equal(rank0.weight2, rank1.weight2)
    assert torch.equal(rank0.weight1, again.weight1)  # deterministic per rank
    # the dense parameters' stream (the default generator) is not consumed by expert init
    assert untouched0 and untouched1
    # the std is Megatron's init_method_std (the fork changes the stream, not the scale)
    std = rank0.config.init_method_std
    assert abs(rank0.weight1.std().item() - std) < 0.3 * std


class _LeakyGroupedMM(torch.autograd.Function):
    """torch._grouped_mm as sm100 computes it: right values, and a weight gradient that is
    not zero for groups without tokens (here: ones, where zeros are right)."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return _REAL_GROUPED_MM(x, w, offs=offs)

    @staticmethod
    def backward(ctx, g):
        x, w, offs = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(), w.detach().requires_grad_()
            gx, gw = torch.autograd.grad(_REAL_GROUPED_MM(xd, wd, offs=offs), (xd, wd), g)
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        gw = torch.where((sizes == 0)[:, None, None], torch.ones_like(gw), gw)
        return gx, gw, None


_REAL_GROUPED_MM = torch._grouped_mm


def test_empty_groups_get_zero_weight_grads_where_grouped_mm_leaks(mcore_parallel, monkeypatch):
    """With the sm100 leak emulated, the experts mask the weight gradients of experts
    that got no token (on the device, per microbatch); with the mask off the leak shows."""
    monkeypatch.setattr(torch, "_grouped_mm", lambda x, w, offs: _LeakyGroupedMM.apply(x, w, offs))
    tc = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
        moe_ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True)
    sizes = torch.tensor([3, 0, 5, 0])
    grads = {}
    for masked in (False, True):
        torch.manual_seed(0)  # the same weights and inputs both times
        experts = GroupedSwiGLUExperts(4, tc)
        experts.mask_empty_group_grads = masked
        y, _ = experts(torch.randn(8, 16), sizes)
        y.square().sum().backward()
        grads[masked] = (experts.weight1.grad, experts.weight2.grad)
    for g in grads[True]:
        assert torch.count_nonzero(g[1]) == 0 and torch.count_nonzero(g[3]) == 0
        assert torch.count_nonzero(g[0]) > 0 and torch.count_nonzero(g[2]) > 0
    assert torch.count_nonzero(grads[False][0][1]) > 0  # the stand-in does leak
    for a, b in zip(grads[True], grads[False]):  # the used experts' gradients are unchanged
        assert torch.equal(a[[0, 2]], b[[0, 2]])
