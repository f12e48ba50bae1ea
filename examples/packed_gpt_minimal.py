"""Minimal use of the packed-sequence cache with a Megatron GPTModel (CPU or GPU).

    python examples/packed_gpt_minimal.py

Builds a 2-layer Llama-style GPTModel on the fastpath layer spec, packs three sequences into
one 64-token microbatch, runs forward+backward under a strict SyncSentinel (any host sync would
raise) and prints the cache counters.
"""

import torch

from megatron_fastpath import PackedSeqCache, PackedSeqConfig, SyncSentinel, get_fastpath_layer_spec
from megatron_fastpath.distributed import default_device, init_distributed
from megatron_fastpath.model import ModelConfig, build_gpt_model, build_transformer_config, rope_config_for


def main():
    init_distributed()
    device = default_device()
    shape = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=160, vocab_size=128)
    cache = PackedSeqCache(
        PackedSeqConfig(max_tokens=64, max_seqs=8, rope=rope_config_for(shape)), device=device
    )
    model = build_gpt_model(build_transformer_config(shape), get_fastpath_layer_spec(cache),
                            shape.vocab_size, 64).to(device)

    lengths = [20, 7, 30]  # from the packing collator, on the host; 7 padding tokens at the end
    tokens = torch.randint(0, shape.vocab_size, (1, 64), device=device)
    labels = torch.roll(tokens, -1, dims=1)
    loss_mask = torch.zeros(1, 64, device=device)
    loss_mask[0, : sum(lengths)] = 1

    with cache.batch(lengths) as pb, SyncSentinel(strict=True) as sentinel:
        per_token = model(tokens, pb.position_ids_1T, None, labels=labels,
                          packed_seq_params=pb.packed_seq_params)
        loss = (per_token * loss_mask).sum() / loss_mask.sum()
        loss.backward()
    print(f"host syncs: {sentinel.num_syncs}, aten ops: {sentinel.aten_ops}")
    print(f"cache: {cache.stats.builds} derived builds (mask, RoPE: once per batch for all layers), "
          f"{cache.stats.host_to_device_copies} host->device copy")
    print(f"cu_seqlens (static, tail closed at T): {pb.packed_seq_params.cu_seqlens_q.tolist()}")


if __name__ == "__main__":
    main()
