"""Test-only worker (torchrun, 2 gloo ranks, TP = 2, inside the CUDA-as-CPU mode): for each case
(sequence parallel or not; untied, tied or frozen output weight; label smoothing 0 / 0.1; chunk
sizes), the per-token loss and the gradients of the hidden and of this rank's weight shard from
Megatron's own ``ColumnParallelLinear`` + ``vocab_parallel_cross_entropy``
(tests/loss/megatron_reference.py) and from ``linear_cross_entropy``, saved for the test.

    torchrun --nproc_per_node=2 -m tests.workers.linear_cross_entropy_worker OUT.pt   (PYTHONPATH=<repository>)   ->  OUT.pt.rank{r}
"""

from __future__ import annotations

import sys

import torch

from tests.support.cuda_as_cpu import cuda_as_cpu

S, B, H, V = 12, 2, 16, 64  # S divisible by TP (the sequence shard), V too (the vocab shard)
CASES = [(sp, kind, smoothing, chunk)
         for sp in (False, True) for kind in ("untied", "tied", "frozen")
         for smoothing in (0.0, 0.1) for chunk in (5, None)]


def run_case(sp, kind, smoothing, chunk, group, rank):
    from megatron_fastpath.loss import linear_cross_entropy
    from megatron_fastpath.model import ModelConfig, build_transformer_config
    from tests.loss.megatron_reference import megatron_loss, output_layer

    shape = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_query_groups=2,
                        ffn_hidden_size=32, vocab_size=V)
    config = build_transformer_config(shape, tensor_model_parallel_size=2, sequence_parallel=sp)
    layer = output_layer(config, H, V, tied=kind == "tied")
    g = torch.Generator().manual_seed(1)  # the same full tensors on both ranks
    full_w = torch.randn(V, H, generator=g) * 0.5
    hidden = torch.randn(S, B, H, generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[1, 2] = -100
    mask = (torch.rand(B, S, generator=g) > 0.3).float()
    grad_output = mask / mask.sum()
    vp = V // 2
    shard = full_w[rank * vp:(rank + 1) * vp].clone()
    if kind == "tied":
        weight = torch.nn.Parameter(shard)
    else:
        weight = layer.weight
        with torch.no_grad():
            weight.copy_(shard)
        weight.requires_grad_(kind != "frozen")
    if sp:
        hidden = hidden[rank * S // 2:(rank + 1) * S // 2]
    out = {}
    for side in ("megatron", "ours"):
        h = hidden.clone().requires_grad_(True)
        if side == "megatron":
            loss = megatron_loss(layer, h, labels, weight if kind == "tied" else None, smoothing)
        else:
            loss = linear_cross_entropy(h, weight, labels, tp_group=group, sequence_parallel=sp,
                                        label_smoothing=smoothing, chunk_tokens=chunk)
        wanted = [h] + ([weight] if weight.requires_grad else [])
        grads = torch.autograd.grad((loss * grad_output).sum(), wanted)
        out[side] = {"loss": loss.detach(), "grad_h": grads[0],
                     "grad_w": grads[1] if weight.requires_grad else None}
    return out


def main() -> None:
    from megatron.core import parallel_state as ps

    from megatron_fastpath.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(backend="gloo", tensor_model_parallel_size=2)
    rank = torch.distributed.get_rank()
    with cuda_as_cpu():
        group = ps.get_tensor_model_parallel_group()
        result = {case: run_case(*case, group, rank) for case in CASES}
    torch.save(result, f"{sys.argv[1]}.rank{rank}")
    destroy_distributed()


if __name__ == "__main__":
    main()
