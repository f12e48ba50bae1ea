"""Test-only worker (torchrun, 2 gloo ranks, TP = 2, inside the CUDA-as-CPU mode): the tiny GPT
with two LoRA adapters trained at once (``with_lora(..., adapters=2)``, all four linears) on a
packed batch mixing their sequences, with ``sequence_parallel`` False and True, next to one
single-adapter LoRA model per adapter (its slice of the weights, the same base) on the same
packed batch with the loss of that adapter's tokens only. Attention stays inside a sequence, so
an adapter's tokens see only that adapter's weights: the joint model's outputs on them and its
gradient slice must equal the single model's.

The norm is ``lora_sp_worker``'s stand-in for TENorm's contract; SP gradients are reduced by
Megatron's own ``_allreduce_non_tensor_model_parallel_grads``.

    torchrun --nproc_per_node=2 -m tests.workers.multi_lora_tp_worker OUT.pt   (PYTHONPATH=<repository>)   ->  OUT.pt.rank{r}
"""

from __future__ import annotations

import sys

import torch

from tests.support.cuda_as_cpu import cuda_as_cpu
from tests.support.tiny_gpt import LENGTHS, SHAPE, T, batch
from tests.workers.lora_sp_worker import build as lora_sp_build

ADAPTERS = [1, 0, 1, 0]  # LENGTHS' four sequences


def build(sequence_parallel: bool, cache, adapters=None, seed=0):
    """``lora_sp_worker``'s TP 2 model (``adapters`` LoRA adapters, None: one), base frozen."""
    from megatron_fastpath.lora import freeze_base_parameters

    model = lora_sp_build(sequence_parallel, cache, seed=seed, adapters=adapters)
    freeze_base_parameters(model)
    return model


def forward_backward(model, cache, mask, adapters=None):
    tokens, labels, _ = batch()
    kw = {} if adapters is None else {"adapters": adapters}
    with cache.batch(LENGTHS, **kw) as pb:
        out = model(tokens, pb.position_ids_1T, None, labels=labels,
                    packed_seq_params=pb.packed_seq_params)
        (out * mask).sum().backward()
    return out.detach()


def lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}


def main() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    from megatron_fastpath.distributed import destroy_distributed, init_distributed
    from megatron_fastpath.model import rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    def reduce_sp(model):
        model.ddp_config = DistributedDataParallelConfig()  # read by Megatron's reduction
        _allreduce_non_tensor_model_parallel_grads([model], model.config,
                                                   ps.get_tensor_model_parallel_group())

    init_distributed(backend="gloo", tensor_model_parallel_size=2)
    result = {"adapters": ADAPTERS}
    with cuda_as_cpu():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)  # SP's embedding dropout forks the tracker
        rope = rope_config_for(SHAPE)
        joint_cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, num_adapters=2,
                                                     rope=rope))
        single_cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, rope=rope))
        joint, joint_sp = build(False, joint_cache, 2), build(True, joint_cache, 2)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():  # non-zero, different adapters
            for n, p in joint.named_parameters():
                if "lora_" in n:
                    p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        joint_sp.load_state_dict(joint.state_dict())
        _, _, mask = batch()
        result["out"] = forward_backward(joint, joint_cache, mask, ADAPTERS)
        result["out_sp"] = forward_backward(joint_sp, joint_cache, mask, ADAPTERS)
        reduce_sp(joint_sp)
        result["grads"], result["grads_sp"] = lora_grads(joint), lora_grads(joint_sp)
        result["sp_marked"] = sorted(n for n, p in joint_sp.named_parameters()
                                     if getattr(p, "sequence_parallel", False) and "lora_" in n)
        for k in range(2):
            single = build(False, single_cache)
            single.load_state_dict({n: v for n, v in joint.state_dict().items()
                                    if "lora_" not in n}, strict=False)
            mods = dict(joint.named_modules())
            with torch.no_grad():
                for name, mod in single.named_modules():
                    if hasattr(mod, "lora_A"):
                        mod.lora_A.copy_(mods[name].lora_A[k])
                        mod.lora_B.copy_(mods[name].lora_B[k])
            mask_k = torch.zeros_like(mask)
            start = 0
            for n, a in zip(LENGTHS, ADAPTERS):
                if a == k:
                    mask_k[0, start : start + n] = 1
                start += n
            result[f"out_{k}"] = forward_backward(single, single_cache, mask_k)
            result[f"mask_{k}"] = mask_k
            result[f"grads_{k}"] = lora_grads(single)
    result["rank"] = torch.distributed.get_rank()
    torch.save(result, f"{sys.argv[1]}.rank{result['rank']}")
    destroy_distributed()


if __name__ == "__main__":
    main()
