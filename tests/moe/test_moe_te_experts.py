"""TE GroupedLinear experts on a CPU stand-in of Transformer Engine's
``GroupedLinear``: expert parameters carry Megatron's ``allreduce`` flag, so Megatron's own DDP
puts them in its expert-parallel buffers (reduced over the expert-DP group) at EP > 1; the
forward equals the per-expert reference with exactly one counted host read."""

import inspect
import types

import pytest
import torch
import torch.nn.functional as F

from tests.support.cuda_as_cpu import cuda_as_cpu

H, FF, E = 16, 32, 4


class GroupedLinearStandIn(torch.nn.Module):
    """CPU stand-in honouring ``transformer_engine.pytorch.GroupedLinear`` (TE 2.x): the same
    constructor signature, per-GEMM parameters ``weight{i}`` of shape [out, in] (and a plain
    empty ``bias{i}`` tensor when ``bias=False``), ``forward(inp, m_splits: list[int],
    is_first_microbatch=None)`` with host split sizes. The parameters live on the CPU."""

    def __init__(self, num_gemms, in_features, out_features, sequence_parallel=False,
                 fuse_wgrad_accumulation=False, tp_group=None, tp_size=1,
                 get_rng_state_tracker=None, rng_tracker_name=None, init_method=None, bias=True,
                 return_bias=False, params_dtype=None, parallel_mode=None, device="cuda",
                 ub_overlap_rs=False, ub_overlap_ag=False, ub_name=None,
                 delay_wgrad_compute=False, save_original_input=False, name=None):
        super().__init__()
        dtype = params_dtype or torch.get_default_dtype()
        self.num_gemms = num_gemms
        self.use_bias = bias
        self.rng_tracker_name = rng_tracker_name
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            if init_method is not None:
                # TE initialises inside the tracker's fork of rng_tracker_name when a tracker
                # is given (module/base.py reset_parameters)
                if get_rng_state_tracker is not None:
                    with get_rng_state_tracker().fork(rng_tracker_name):
                        init_method(w.data)
                else:
                    init_method(w.data)
            self.register_parameter(f"weight{i}", w)
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.zeros(out_features, dtype=dtype)))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=dtype))

    def forward(self, inp, m_splits, is_first_microbatch=None):
        assert isinstance(m_splits, list) and all(isinstance(m, int) for m in m_splits), (
            "TE takes host split sizes (a list of ints)")
        assert len(m_splits) == self.num_gemms, "Number of splits should match number of GEMMs."
        outs = []
        for i, chunk in enumerate(torch.split(inp, m_splits)):
            y = chunk @ getattr(self, f"weight{i}").t()
            outs.append(y + getattr(self, f"bias{i}") if self.use_bias else y)
        return torch.cat(outs)


def test_stand_in_signature_is_te_grouped_linear():
    """The stand-in's parameters are TE 2.x's, in order (the documented constructor)."""
    te_params = ["num_gemms", "in_features", "out_features", "sequence_parallel",
                 "fuse_wgrad_accumulation", "tp_group", "tp_size", "get_rng_state_tracker",
                 "rng_tracker_name", "init_method", "bias", "return_bias", "params_dtype",
                 "parallel_mode", "device", "ub_overlap_rs", "ub_overlap_ag", "ub_name"]
    got = list(inspect.signature(GroupedLinearStandIn.__init__).parameters)[1:]
    assert got[: len(te_params)] == te_params
    assert list(inspect.signature(GroupedLinearStandIn.forward).parameters)[1:] == [
        "inp", "m_splits", "is_first_microbatch"]


def _tc(ep=1, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FF,
        moe_ffn_hidden_size=FF, num_moe_experts=E, moe_router_topk=2, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
        expert_model_parallel_size=ep, **kw,
    )


@pytest.fixture
def te_experts(monkeypatch):
    import megatron_fastpath.moe.experts as experts

    fake_te = types.SimpleNamespace(GroupedLinear=GroupedLinearStandIn)
    monkeypatch.setattr(experts, "require", lambda *a, **k: fake_te)

    def build(ep, num_local=E):
        with cuda_as_cpu():  # TE builds on CUDA (and forks Megatron's CUDA RNG tracker)
            return experts.TEGroupedSwiGLUExperts(num_local, _tc(ep=ep))

    return build


def test_expert_weights_drawn_from_the_expert_parallel_stream(mcore_parallel, te_experts):
    """For TE experts: Megatron's TEGroupedLinear hands TE its tracker and the
    expert-parallel stream's name; so do ours, and EP ranks draw different experts."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    weights = []
    for ep_rank in (0, 1):
        with cuda_as_cpu():
            model_parallel_cuda_manual_seed(1234, ep_rank=ep_rank)
            ex = te_experts(1)
        assert ex.linear_fc1.rng_tracker_name == ex.linear_fc2.rng_tracker_name == "expert-parallel-rng"
        weights.append(ex.linear_fc1.weight0.detach().clone())
    assert not torch.equal(*weights)


@pytest.mark.parametrize("ep", [1, 2])
def test_expert_params_marked_like_megatron(te_experts, ep):
    """Megatron's TEGroupedLinear: ``allreduce = not (is_expert and expert_parallel)``."""
    ex = te_experts(ep, E // ep)
    params = dict(ex.named_parameters())
    assert len(params) == 2 * (E // ep)  # weight{i} of fc1 and fc2, no bias
    for name, p in params.items():
        assert getattr(p, "allreduce", "unset") is (ep == 1), name


def test_megatron_ddp_reduces_expert_grads_over_expert_dp(mcore_parallel, te_experts):
    """Megatron's own DDP (CUDA-as-CPU test mode) puts the EP>1 expert weights in its
    expert-parallel buffers and the dense weight in the dense ones."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import MegatronModule

    tc = _tc(ep=2)

    class Block(MegatronModule):
        def __init__(self):
            super().__init__(config=tc)
            self.dense = torch.nn.Linear(H, H, bias=False)
            self.experts = te_experts(2, E // 2)

    with cuda_as_cpu():
        block = Block()
        ddp = DistributedDataParallel(tc, DistributedDataParallelConfig(), block)
        expert_ids = {id(p) for p in block.experts.parameters()}
        in_expert_buffers = {id(p) for b in ddp.expert_parallel_buffers for p in b.params}
        in_dense_buffers = {id(p) for b in ddp.buffers for p in b.params}
    assert in_expert_buffers == expert_ids
    assert in_dense_buffers == {id(block.dense.weight)}


def test_te_experts_forward_matches_reference_with_one_host_read(te_experts):
    from megatron_fastpath.moe.experts import grouped_mlp_reference
    from megatron_fastpath.sync import SyncSentinel

    ex = te_experts(1)
    with torch.no_grad():
        for i in range(E):
            getattr(ex.linear_fc1, f"weight{i}").normal_(0, H**-0.5)
            getattr(ex.linear_fc2, f"weight{i}").normal_(0, FF**-0.5)
    sizes = [5, 0, 7, 4]
    x = torch.randn(sum(sizes), H)
    with SyncSentinel() as s:
        y, bias = ex(x, torch.tensor(sizes))
    assert bias is None and s.num_syncs == 1 and ex.host_syncs == 1
    w1 = torch.stack([getattr(ex.linear_fc1, f"weight{i}").t() for i in range(E)])
    w2 = torch.stack([getattr(ex.linear_fc2, f"weight{i}").t() for i in range(E)])
    torch.testing.assert_close(y, grouped_mlp_reference(x, sizes, w1, w2, ex.config))
