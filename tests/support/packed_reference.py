"""Independent unpacked reference for the packed-sequence equivalence tests: Megatron's own RoPE
function + plain causal SDPA, one sequence at a time."""

import dataclasses

import torch
import torch.nn.functional as F

from megatron_fastpath.model import ModelConfig

TINY = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
    vocab_size=97,
)


class ReferenceCausalAttention(torch.nn.Module):
    """Unpacked core attention: Megatron's `_apply_rotary_pos_emb_bshd` with positions 0..s-1
    and `is_causal=True` SDPA. Shares nothing with the packed path but the weights."""

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self",
                 cp_comm_type=None, softmax_scale=None, pg_collection=None, rope=None):
        super().__init__()
        self.config, self.rope = config, rope

    def forward(self, q, k, v, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        s = q.shape[0]
        inv = self.rope.inv_freq()
        freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), -1)[:, None, None, :]
        q = _apply_rotary_pos_emb_bshd(q, emb)
        k = _apply_rotary_pos_emb_bshd(k, emb)
        rep = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True
        )
        return out.permute(2, 0, 1, 3).reshape(s, q.shape[1], -1)


def reference_layer_spec(rope):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    base = get_gpt_layer_local_spec(normalization="RMSNorm")
    attn = base.submodules.self_attention
    core = ModuleSpec(module=ReferenceCausalAttention, params={"rope": rope})
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=core))
    return dataclasses.replace(base, submodules=dataclasses.replace(base.submodules, self_attention=attn))


def packed_inputs(lengths, max_tokens, vocab, gen):
    total = sum(lengths)
    tokens = torch.zeros(1, max_tokens, dtype=torch.long)
    labels = torch.zeros(1, max_tokens, dtype=torch.long)
    tokens[0, :total] = torch.randint(0, vocab, (total,), generator=gen)
    labels[0, :total] = torch.randint(0, vocab, (total,), generator=gen)
    loss_mask = torch.zeros(1, max_tokens)
    loss_mask[0, :total] = 1
    return tokens, labels, loss_mask
