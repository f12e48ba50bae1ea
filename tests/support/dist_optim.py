"""Test-only: the tiny GPT (tests/support/tiny_gpt.py) under Megatron's DDP with its
DistributedOptimizer (``get_megatron_optimizer(OptimizerConfig(use_distributed_optimizer=True))``),
stepped on packed batches, and each rank's shard of the optimizer state read out by parameter
name. Call everything inside ``cuda_as_cpu()`` with Megatron's parallel state initialised.

The global batch of a step is ``MICRO`` packed microbatches, microbatch ``m`` of step ``i``
drawn from seed ``1000 * i + m``: at DP size ``d`` rank ``r`` runs microbatches ``r * MICRO / d``
onwards, each loss divided by its rank's count, so every DP size steps on the same mean loss
(Megatron's DDP divides the summed gradients by the DP size).
"""

from __future__ import annotations

import torch

from tests.support.tiny_gpt import LENGTHS, SHAPE, T, build_tiny_gpt

MICRO = 2  # microbatches per step, over all ranks


def _tiny_moe(seed: int, num_experts: int):
    """The tiny GPT with ``num_experts`` experts per layer (the package's MoE layer, top 2), at
    Megatron's expert-parallel size (the experts split over the EP ranks)."""
    import dataclasses

    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    from megatron.core import parallel_state as ps

    shape = dataclasses.replace(SHAPE, num_experts=num_experts, moe_ffn_hidden_size=32)
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, rope=rope_config_for(shape)))
    spec = get_fastpath_layer_spec(cache, backend="sdpa", num_experts=num_experts)
    tcfg = build_transformer_config(shape, expert_model_parallel_size=ps.get_expert_model_parallel_world_size())
    torch.manual_seed(seed)
    return build_gpt_model(tcfg, spec, shape.vocab_size, T), cache


def build(seed: int, num_experts=None):
    """(model, ddp, optimizer, scheduler, cache): the tiny GPT drawn from ``seed`` (with
    ``num_experts`` experts per layer: two chained optimizers, dense and expert parameters),
    fp32, under DDP with the distributed optimizer (Adam, clip 1.0, weight decay) and a cosine
    schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model, cache = build_tiny_gpt(seed=seed) if num_experts is None else _tiny_moe(seed, num_experts)
    ddp = DistributedDataParallel(
        config=model.config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, clip_grad=1.0, weight_decay=0.01,
                        use_distributed_optimizer=True), [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=1,
                                    lr_decay_steps=8, lr_decay_style="cosine", start_wd=0.01,
                                    end_wd=0.01, wd_incr_steps=8, wd_incr_style="constant")
    return model, ddp, opt, sched, cache


def step(built, i: int) -> float:
    """Training step ``i`` on this rank's microbatches; returns this rank's loss."""
    model, ddp, opt, sched, cache = built
    dp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mine = range(rank * MICRO // dp, (rank + 1) * MICRO // dp)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    total = 0.0
    for m in mine:
        tokens = torch.randint(0, SHAPE.vocab_size, (1, T), generator=torch.Generator().manual_seed(1000 * i + m))
        with cache.batch(LENGTHS) as pb:
            out = ddp(tokens, pb.position_ids_1T, None, labels=torch.roll(tokens, -1, 1),
                      packed_seq_params=pb.packed_seq_params)
        loss = out[:, : sum(LENGTHS)].mean() / len(mine)
        loss.backward()
        total += loss.item()
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok
    sched.step(increment=1)
    return total


def optimizer_shards(built) -> dict:
    """This rank's optimizer state: parameter name -> ``{"start", "end"}`` (the range of the
    flattened parameter this rank's shard covers) and its ``param`` (fp32 main parameter),
    ``exp_avg``, ``exp_avg_sq`` (flat) and ``step``, copied. Read through the
    DistributedOptimizer's public maps: ``gbuf_ranges`` (its buckets' ``param_map``: parameter ->
    ``{"param": Range}``) and ``model_param_group_index_map`` (parameter -> (group, index) in the
    inner torch optimizer), as its own ``_get_main_param_and_optimizer_states`` reads them
    (0.16.1 optimizer/distrib_optimizer.py:883-912, 0.19.2 :1090-1119)."""
    model, _, opt, _, _ = built
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for leaf in opt.chained_optimizers:
        for gbuf_range_maps in leaf.gbuf_ranges:
            for buckets in gbuf_range_maps.values():
                for bucket in buckets:
                    for param, ranges in bucket["param_map"].items():
                        group, index = leaf.model_param_group_index_map[param]
                        main = leaf.optimizer.param_groups[group]["params"][index]
                        state = leaf.optimizer.state[main]
                        out[names[param]] = {
                            "start": ranges["param"].start, "end": ranges["param"].end,
                            "param": main.detach().clone(), "exp_avg": state["exp_avg"].clone(),
                            "exp_avg_sq": state["exp_avg_sq"].clone(), "step": state["step"].clone()}
    return out


def params(built) -> dict:
    """The model's parameters by name, copied (whole on every rank after a step: the
    distributed optimizer all-gathers them)."""
    return {n: p.detach().clone() for n, p in built[0].named_parameters()}
