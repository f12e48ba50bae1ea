"""Expert parallelism on 2 CPU processes (gloo): the EP=2 layer equals the EP=1 computation,
with 0 host syncs in capacity mode and exactly 1 in dropless mode (forward + backward)."""

import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.support.subproc import free_port

MODES = {
    # name: (dispatch overrides, expected host syncs per layer fwd+bwd)
    "capacity_static": (dict(capacity_factor=1.0, pad_to_capacity=True), 0),
    "capacity_no_drop": (dict(capacity_factor=4.0), 0),
    "dropless": (dict(), 1),
    "dropless_pad16": (dict(pad_multiple=16), 1),
}
H, FF, E, K, S, B = 16, 32, 8, 2, 6, 2


def _tc():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FF,
        moe_ffn_hidden_size=FF, num_moe_experts=E, moe_router_topk=K, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
        expert_model_parallel_size=2,
    )


def _reference(tc, cfg, router_w, w1, w2, x_TH, g_TH):
    """EP=1: the same router + plan + combine with all experts in one process."""
    from megatron_fastpath.moe.dispatch import build_dispatch_plan, combine_tokens, permute_tokens
    from megatron_fastpath.moe.experts import GroupedSwiGLUExperts
    from megatron_fastpath.moe.router import topk_routing

    full = GroupedSwiGLUExperts(E, tc)
    rw = router_w.clone().requires_grad_()
    with torch.no_grad():
        full.weight1.copy_(w1)
        full.weight2.copy_(w2)
    x = x_TH.clone().requires_grad_()
    probs, ids = topk_routing(x @ rw.t(), cfg)
    plan = build_dispatch_plan(ids, cfg, probs)
    y, _ = full(permute_tokens(x, plan), plan.group_sizes_E)
    out = combine_tokens(y, plan, probs, out_dtype=x.dtype)
    (out * g_TH).sum().backward()
    return out.detach(), x.grad, rw.grad, full.weight1.grad, full.weight2.grad


def _init_ep(rank, world, port):
    """One spawned rank: rendezvous on the loopback port, EP = world, one thread."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from megatron_fastpath.distributed import init_distributed

    init_distributed(backend="gloo", expert_model_parallel_size=world)


def _weights(gen):
    """(router [E, H], weight1 [E, H, 2F], weight2 [E, F, H]) of all E experts."""
    return (torch.randn(E, H, generator=gen) / H**0.5,
            torch.randn(E, H, 2 * FF, generator=gen) / H**0.5,
            torch.randn(E, FF, H, generator=gen) / FF**0.5)


def _ep_layer(tc, overrides, router_w, w1, w2, local):
    """This rank's MoE layer (dispatch overrides) holding the ``local`` experts' weights."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_fastpath.moe.config import MoEDispatchConfig
    from megatron_fastpath.moe.spec import get_moe_mlp_spec

    spec = get_moe_mlp_spec(num_experts=E)
    spec.params = {"dispatch_config": MoEDispatchConfig.from_transformer_config(tc, **overrides)}
    layer = build_module(spec, config=tc, layer_number=1)
    with torch.no_grad():
        layer.router.weight.copy_(router_w)
        layer.experts.weight1.copy_(w1[local])
        layer.experts.weight2.copy_(w2[local])
    return layer


def _worker(rank, world, port, result_path):
    _init_ep(rank, world, port)
    import torch.distributed as dist

    from megatron_fastpath.distributed import destroy_distributed
    from megatron_fastpath.moe.config import MoEDispatchConfig
    from megatron_fastpath.sync import SyncSentinel

    results = {}
    try:
        tc = _tc()
        gen = torch.Generator().manual_seed(0)
        router_w, w1, w2 = _weights(gen)
        xs = [torch.randn(S * B, H, generator=gen) for _ in range(world)]
        gs = [torch.randn(S * B, H, generator=gen) for _ in range(world)]
        E_l = E // world
        local = slice(rank * E_l, (rank + 1) * E_l)
        for name, (overrides, expected_syncs) in MODES.items():
            cfg = MoEDispatchConfig.from_transformer_config(tc, **overrides)
            layer = _ep_layer(tc, overrides, router_w, w1, w2, local)
            x = xs[rank].view(S, B, H).clone().requires_grad_()
            with SyncSentinel(name=f"EP=2 {name}") as s:
                out, _ = layer(x)
                (out * gs[rank].view(S, B, H)).sum().backward()
            # reference: EP=1 on every rank's tokens, all experts in this process
            ref = [_reference(tc, cfg, router_w, w1, w2,
                              xs[r], gs[r]) for r in range(world)]
            ref_out, ref_gx = ref[rank][0], ref[rank][1]
            ref_grw = sum(r[2] for r in ref)
            ref_gw1, ref_gw2 = sum(r[3] for r in ref), sum(r[4] for r in ref)
            grw = layer.router.weight.grad.clone()
            dist.all_reduce(grw)  # data-parallel router grads: sum over ranks
            err = lambda a, b: float((a.reshape(b.shape) - b).abs().max())  # noqa: E731
            results[name] = dict(
                syncs=s.num_syncs, expected=expected_syncs,
                reported=layer.expected_host_syncs_per_layer,
                sync_ops=[str(e) for e in s.events],
                out=err(out.detach(), ref_out), gx=err(x.grad, ref_gx), grouter=err(grw, ref_grw),
                gw1=err(layer.experts.weight1.grad, ref_gw1[local]),
                gw2=err(layer.experts.weight2.grad, ref_gw2[local]),
                ref_scale=float(ref_out.abs().max()),
            )
    finally:
        torch.save(results, f"{result_path}.{rank}")
        destroy_distributed()


def _spawn_two(worker, path: str) -> list:
    """Each rank's results of ``worker`` run in 2 spawned processes (EP=2 over gloo)."""
    mp.spawn(worker, args=(2, free_port(), path), nprocs=2, join=True)
    return [torch.load(f"{path}.{rank}") for rank in range(2)]


@pytest.mark.integration
@pytest.mark.every_line
def test_ep2_gloo_equals_ep1_and_counts_syncs(tmp_path):
    for rank, results in enumerate(_spawn_two(_worker, str(tmp_path / "ep_results"))):
        assert set(results) == set(MODES), results.keys()
        for name, r in results.items():
            where = f"rank {rank}, {name}: {r}"
            assert r["syncs"] == r["expected"] == r["reported"], where
            assert r["ref_scale"] > 0.1, where  # the comparison is not against zeros
            for key in ("out", "gx", "grouter", "gw1", "gw2"):
                assert r[key] < 1e-5, f"{key} differs; {where}"


# ------------------------------------------------------------------------------------------
# padding tokens at EP=2: only the padding content changes between two runs
# ------------------------------------------------------------------------------------------
PAD_MODES = {"capacity_static": MODES["capacity_static"], "dropless": MODES["dropless"]}
PAD_LENGTHS = {0: (9, 5), 1: (12, 3)}  # real tokens per row on each rank


def _padding_worker(rank, world, port, result_path):
    _init_ep(rank, world, port)
    from megatron_fastpath.distributed import destroy_distributed
    from megatron_fastpath.sync import SyncSentinel
    from tests.moe.padding_support import compare_runs, padding_mask_BS, run_layer, two_paddings

    results = {}
    try:
        import dataclasses

        tc = dataclasses.replace(_tc(), moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                                 moe_router_dtype="fp32")
        gen = torch.Generator().manual_seed(0)
        router_w, w1, w2 = _weights(gen)
        x = torch.randn(S, B, H, generator=gen) + rank
        g = torch.randn(S, B, H, generator=gen)
        pad = padding_mask_BS(PAD_LENGTHS[rank], S)
        local = slice(rank * (E // world), (rank + 1) * (E // world))
        for name, (overrides, expected_syncs) in PAD_MODES.items():
            layer = _ep_layer(tc, overrides, router_w, w1, w2, local)
            layer.set_layer_number(1)
            xa, xb = two_paddings(x, pad, router_w)
            ra = run_layer(layer, xa, pad, g)
            with SyncSentinel(name=f"EP=2 {name} padded") as s:
                rb = run_layer(layer, xb, pad, g)
            try:
                compare_runs(ra, rb, pad, where=f"rank {rank} {name}")
                results[name] = dict(ok=True, syncs=s.num_syncs, expected=expected_syncs,
                                     scale=float(ra["grads"]["experts.weight1"].abs().max()))
            except AssertionError as exc:
                results[name] = dict(ok=False, error=str(exc))
    finally:
        torch.save(results, f"{result_path}.{rank}")
        destroy_distributed()


@pytest.mark.integration
def test_ep2_padding_content_changes_nothing_real(tmp_path):
    for rank, results in enumerate(_spawn_two(_padding_worker, str(tmp_path / "ep_padding"))):
        assert set(results) == set(PAD_MODES), results
        for name, r in results.items():
            assert r["ok"], r["error"]
            assert r["syncs"] == r["expected"], (rank, name, r)
            assert r["scale"] > 1e-3, (rank, name, r)  # expert grads are not all zero
