"""The GPU step path's optimizer in a checkpoint: Megatron DDP + ``get_megatron_optimizer`` (run on
CPU through the test-only CUDA-as-CPU mode) saved after 2 steps and loaded into a model built
from another seed continue with bit-identical losses (Megatron's own optimizer
``sharded_state_dict`` / ``load_state_dict`` behind ``checkpoint.training_parts``)."""

import torch

from tests.checkpoint.ckpt_harness import LENGTHS, SHAPE, T
from tests.support.cuda_as_cpu import cuda_as_cpu


def _make(seed):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, rope=rope_config_for(SHAPE)))
    torch.manual_seed(seed)
    tcfg = build_transformer_config(SHAPE)
    model = build_gpt_model(tcfg, get_fastpath_layer_spec(cache, backend="sdpa"), SHAPE.vocab_size, T)
    ddp = DistributedDataParallel(config=tcfg, module=model,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, clip_grad=1.0), [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=1,
                                    lr_decay_steps=6, lr_decay_style="cosine", start_wd=0.01,
                                    end_wd=0.01, wd_incr_steps=6, wd_incr_style="constant")
    return model, ddp, opt, sched, cache


def _step(model, ddp, opt, sched, cache, i):
    tokens = torch.randint(0, SHAPE.vocab_size, (1, T), generator=torch.Generator().manual_seed(i))
    ddp.zero_grad_buffer()
    opt.zero_grad()
    with cache.batch(LENGTHS) as pb:
        out = ddp(tokens, pb.position_ids_1T, None, labels=torch.roll(tokens, -1, 1),
                  packed_seq_params=pb.packed_seq_params)
    loss = out[:, : sum(LENGTHS)].mean()
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()
    sched.step(increment=1)
    return loss.item()


def test_megatron_optimizer_round_trip_is_exact(mcore_parallel, tmp_path):
    from megatron_fastpath.checkpoint import CheckpointConfig, CheckpointManager, training_parts

    cfg = CheckpointConfig(dir=str(tmp_path), async_save=False)
    with cuda_as_cpu():
        straight = _make(0)
        expected = [_step(*straight, i) for i in range(1, 5)]
        first = _make(0)
        got = [_step(*first, i) for i in range(1, 3)]
        CheckpointManager(cfg, {}, log=lambda s: None).save(2, training_parts(first[0], first[2], first[3]))
        resumed = _make(5)
        parts = training_parts(resumed[0], resumed[2], resumed[3])
        assert CheckpointManager(cfg, {}, log=lambda s: None).load(parts).step == 2
        got += [_step(*resumed, i) for i in range(3, 5)]
    assert got == expected
    for (k, a), (_, b) in zip(straight[0].state_dict().items(), resumed[0].state_dict().items()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), k
