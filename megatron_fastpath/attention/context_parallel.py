"""Context-parallel attention pieces for the ``sdpa`` backend: the all-gather of keys / values
over the CP group (Megatron's ``cp_comm_type="all_gather"``), with a backward that returns each
rank the gradient of its own shard summed over every rank's queries.

Chosen over ``torch.distributed.nn.functional.all_gather`` because its backward on gloo goes
through an all-to-all emulation of reduce-scatter; here the backward is one ``all_reduce`` and a
slice, which every backend (gloo on CPU, NCCL) runs, in a fixed order (deterministic sums).
PyTorch's own context-parallel attention (``torch.distributed.tensor.experimental.
context_parallel``) works on DTensor-sharded whole sequences with a ring, not on a packed
THD batch with per-sequence causal masks, so it is not used.

Shape letters: T_l local tokens, K = CP x T_l gathered tokens, h heads, d head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_cp", "context_parallel_group"]


def context_parallel_group(pg_collection=None):
    """The CP process group: Megatron's ``pg_collection.cp`` when the layer got one, else the
    parallel state's."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


class _AllGatherCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_Thd, group):
        world = dist.get_world_size(group)
        ctx.group, ctx.rank, ctx.world = group, dist.get_rank(group), world
        x_Thd = x_Thd.contiguous()
        parts = [torch.empty_like(x_Thd) for _ in range(world)]
        dist.all_gather(parts, x_Thd, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad_Khd):
        grad_Khd = grad_Khd.contiguous().clone()
        dist.all_reduce(grad_Khd, group=ctx.group)  # every rank's queries' share of each shard
        return grad_Khd.chunk(ctx.world, dim=0)[ctx.rank], None


def all_gather_cp(x_Thd: torch.Tensor, group) -> torch.Tensor:
    """[T_l, h, d] on each CP rank -> [K = CP x T_l, h, d], rank 0's tokens first; gradients flow
    back to each rank's shard."""
    return _AllGatherCP.apply(x_Thd, group)
