"""Test-only worker (torchrun, 2 gloo ranks, TP = 2, inside the CUDA-as-CPU mode): the tiny
LoRA GPT (our packed spec, LoRA on all four linears) built twice from the same weights, with
``sequence_parallel`` False and True; one forward+backward each on the same packed batch.

Megatron's own sequence-parallel linears, embedding scatter and output gather run for real; the
norm is a stand-in for TENorm's contract (Megatron's local torch norm refuses
``sequence_parallel``; TE's RMSNorm marks its weight ``sequence_parallel`` so that
``finalize_model_grads`` sums it over TP). The SP model's gradients are reduced by Megatron's
own ``_allreduce_non_tensor_model_parallel_grads`` (what ``finalize_model_grads`` calls).

    torchrun --nproc_per_node=2 -m tests.workers.lora_sp_worker OUT.pt   (PYTHONPATH=<repository>)   ->  OUT.pt.rank{r}
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from tests.support.cuda_as_cpu import cuda_as_cpu
from tests.support.tiny_gpt import LENGTHS, SHAPE, T, batch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """TENorm's contract, as far as this test needs it: RMSNorm over whatever rows it is given
    (this rank's sequence shard) with the weight marked ``sequence_parallel``."""

    def __init__(self, config, hidden_size, eps=1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def build(sequence_parallel: bool, cache, seed=0, adapters=None):
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.lora import LoRAConfig, with_lora
    from megatron_fastpath.model import build_gpt_model, build_transformer_config

    shape = dataclasses.replace(SHAPE, vocab_size=98)  # divisible by TP
    lora = LoRAConfig(rank=4, alpha=8, dropout=0.0,
                      targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    spec = with_lora(get_fastpath_layer_spec(cache, backend="sdpa"), lora, adapters=adapters)
    subs = dataclasses.replace(spec.submodules, input_layernorm=SequenceParallelRMSNorm,
                               pre_mlp_layernorm=SequenceParallelRMSNorm)
    spec = dataclasses.replace(spec, submodules=subs)
    block = TransformerBlockSubmodules(layer_specs=[spec] * shape.num_layers,
                                       layer_norm=SequenceParallelRMSNorm)
    config = build_transformer_config(shape, tensor_model_parallel_size=2,
                                      sequence_parallel=sequence_parallel)
    torch.manual_seed(seed)
    return build_gpt_model(config, block, shape.vocab_size, T)


def forward_backward(model, cache):
    tokens, labels, mask = batch()
    with cache.batch(LENGTHS) as pb:
        out = model(tokens, pb.position_ids_1T, None, labels=labels,
                    packed_seq_params=pb.packed_seq_params)
        ((out * mask).sum() / mask.sum()).backward()
    return out.detach()


def main() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    from megatron_fastpath.distributed import destroy_distributed, init_distributed
    from megatron_fastpath.model import rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    init_distributed(backend="gloo", tensor_model_parallel_size=2)
    result = {}
    with cuda_as_cpu():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)  # SP's embedding dropout forks the tracker
        cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, rope=rope_config_for(SHAPE)))
        ref, sp = build(False, cache), build(True, cache)
        with torch.no_grad():  # B = 0 at init would leave every A without a gradient
            for n, p in ref.named_parameters():
                if n.endswith("lora_B"):
                    p.normal_(0.0, 0.1)
        sp.load_state_dict(ref.state_dict())
        result["out"] = forward_backward(ref, cache)
        result["out_sp"] = forward_backward(sp, cache)
        result["grads"] = {n: p.grad.clone() for n, p in ref.named_parameters()}
        result["grads_sp_local"] = {n: p.grad.clone() for n, p in sp.named_parameters()}
        result["sp_marked"] = sorted(n for n, p in sp.named_parameters()
                                     if getattr(p, "sequence_parallel", False))
        sp.ddp_config = DistributedDataParallelConfig()  # read by Megatron's reduction
        _allreduce_non_tensor_model_parallel_grads([sp], sp.config, ps.get_tensor_model_parallel_group())
        result["grads_sp"] = {n: p.grad.clone() for n, p in sp.named_parameters()}
    result["rank"] = torch.distributed.get_rank()
    torch.save(result, f"{sys.argv[1]}.rank{result['rank']}")
    destroy_distributed()


if __name__ == "__main__":
    main()
