"""The tiny LoRA-able GPT the LoRA, checkpoint and LoRA-checkpoint tests share: our packed spec
(SDPA), optionally with LoRA, seeded weights."""

import torch

from megatron_fastpath.lora import with_lora
from megatron_fastpath.model import ModelConfig, build_gpt_model, build_transformer_config, rope_config_for
from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

SHAPE = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=96, vocab_size=97)
T = 32  # max_tokens of the cache and the model's sequence length


def build_tiny_gpt(lora=None, seed=0, shape=SHAPE):
    """(model, cache): our packed-spec GPT of ``shape`` (LoRA applied when ``lora`` is given),
    weights drawn after ``torch.manual_seed(seed)``."""
    from megatron_fastpath.layer_spec import get_fastpath_layer_spec

    cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, rope=rope_config_for(shape)))
    spec = get_fastpath_layer_spec(cache, backend="sdpa")
    if lora is not None:
        spec = with_lora(spec, lora)
    torch.manual_seed(seed)
    return build_gpt_model(build_transformer_config(shape), spec, shape.vocab_size, T), cache


# a packed batch for the tiny model: four sequences (one of length 1) in T tokens
LENGTHS = [9, 1, 14, 8]


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 97, (1, T), generator=g)
    labels = torch.randint(0, 97, (1, T), generator=g)
    mask = torch.zeros(1, T)
    mask[0, : sum(LENGTHS)] = 1
    return tokens, labels, mask
