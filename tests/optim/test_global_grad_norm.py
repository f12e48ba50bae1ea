"""The CPU path's gradient norm at EP = 2 (2 gloo processes): the global norm Megatron's chained
optimizer clips with, the same on every rank. A per-rank ``clip_grad_norm_`` scales each rank's
dense gradients by its own norm (its experts differ), so the replicated dense parameters drift
apart -- which a checkpoint (one replica saved) then turns into a resume that is not exact."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.subproc import free_port


def _worker(rank, world, port, result_path):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    from tests.support.cuda_as_cpu import cuda_as_cpu
    from megatron_fastpath.distributed import init_distributed
    from megatron_fastpath.train.step import global_grad_norm

    init_distributed(backend="gloo", expert_model_parallel_size=world)
    gen = torch.Generator().manual_seed(0)
    dense = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)) for _ in range(2)]
    for p in dense:  # DP-replicated: the same (already all-reduced) gradient on both ranks
        p.grad = torch.randn(p.shape, generator=gen)
    expert = torch.nn.Parameter(torch.randn(4, 3))
    expert.allreduce = False  # as Megatron marks expert parameters
    expert.grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(100 + rank)) * (1 + rank)
    params = [*dense, expert]

    ours = float(global_grad_norm(params))
    local = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    with cuda_as_cpu():  # Megatron's own norm (ChainedOptimizer: dense and expert groups)
        d = get_grad_norm_fp32([p.grad for p in dense],
                               grad_stats_parallel_group=ps.get_model_parallel_group())
        e = get_grad_norm_fp32([expert.grad],
                               grad_stats_parallel_group=ps.get_expert_tensor_model_pipeline_parallel_group())
    megatron = (d ** 2 + e ** 2) ** 0.5
    with open(f"{result_path}.{rank}", "w") as f:
        json.dump(dict(ours=ours, local=local, megatron=megatron), f)
    torch.distributed.destroy_process_group()


@pytest.mark.integration  # two processes
def test_grad_norm_is_global_and_equals_megatrons(tmp_path):
    path = str(tmp_path / "r")
    mp.spawn(_worker, args=(2, free_port(), path), nprocs=2, join=True)
    r = [json.load(open(f"{path}.{i}")) for i in range(2)]
    assert r[0]["ours"] == r[1]["ours"]  # one norm: every rank clips by the same factor
    for x in r:
        assert abs(x["ours"] - x["megatron"]) <= 1e-6 * x["megatron"], x
    assert r[0]["local"] != r[1]["local"]  # what a per-rank clip_grad_norm_ would have used
