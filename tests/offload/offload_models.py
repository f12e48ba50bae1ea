"""CPU-buildable stacks of real Megatron TransformerLayers for the offload tests/benchmark.

Megatron's local DotProductAttention needs CUDA, so the layer spec's core attention is replaced
by :class:`CpuCausalAttention` (Megatron's core_attention call signature, torch SDPA, causal).
``moe=True`` uses the repository's MoE layer (``megatron_fastpath.moe.get_moe_mlp_spec``:
FastpathRouter + SortCountTokenDispatcher + grouped experts) as the MLP; :class:`TinyMoE` (a
top-k routed mixture with Megatron's MLP call signature) remains for ``moe="tiny"``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


class CpuCausalAttention(torch.nn.Module):
    """core_attention with Megatron's signature: q/k/v [s, b, heads, hn] -> [s, b, np * hn]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, cp_comm_type=None,
                 softmax_scale=None, pg_collection=None, **_):
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        s, b, np_, hn = query.shape
        if key.shape[2] != np_:  # GQA: repeat KV groups
            rep = np_ // key.shape[2]
            key = key.repeat_interleave(rep, dim=2, output_size=np_)
            value = value.repeat_interleave(rep, dim=2, output_size=np_)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
        p = self.config.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p,
                                             scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)


class TinyMoE(torch.nn.Module):
    """Top-k softmax-routed experts (dense masked compute: no data-dependent shapes).

    Megatron MLP signature: forward(hidden_states [s, b, h], padding_mask=None) -> (out, None).
    """

    def __init__(self, config, num_experts: int = 4, topk: int = 2, **_):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        dt = config.params_dtype
        self.topk = topk
        self.router = torch.nn.Linear(h, num_experts, bias=False, dtype=dt)
        self.w1 = torch.nn.Parameter(torch.randn(num_experts, h, f, dtype=dt) * 0.05)
        self.w2 = torch.nn.Parameter(torch.randn(num_experts, f, h, dtype=dt) * 0.05)

    def forward(self, hidden_states, padding_mask=None):
        s, b, h = hidden_states.shape
        x_TH = hidden_states.reshape(s * b, h)
        probs_TE = torch.softmax(self.router(x_TH).float(), dim=-1)
        top_p_TK, top_i_TK = probs_TE.topk(self.topk, dim=-1)
        gates_TE = torch.zeros_like(probs_TE).scatter(1, top_i_TK, top_p_TK).to(x_TH.dtype)
        y_ETH = torch.einsum("th,ehf->etf", x_TH, self.w1)
        y_ETH = torch.einsum("etf,efh->eth", F.gelu(y_ETH), self.w2)
        out_TH = torch.einsum("eth,te->th", y_ETH, gates_TE)
        return out_TH.reshape(s, b, h), None


def make_config(num_layers: int = 4, hidden: int = 64, heads: int = 4,
                dtype: torch.dtype = torch.float32, hidden_dropout: float = 0.0,
                attention_dropout: float = 0.0, moe: bool = False) -> TransformerConfig:
    moe_kw = {}
    if moe:
        moe_kw = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=hidden,
                      moe_router_dtype="fp32", add_bias_linear=False,
                      gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    return TransformerConfig(
        **moe_kw,
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=2 * hidden,
        num_attention_heads=heads,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=hidden_dropout,
        attention_dropout=attention_dropout,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
    )


def cpu_layer_spec(moe=False) -> ModuleSpec:
    """Megatron's local GPT layer spec with the CPU core attention; ``moe=True``: the
    repository's MoE layer as MLP (needs ``make_config(moe=True)``); ``moe="tiny"``: TinyMoE."""
    spec = get_gpt_layer_local_spec()
    attn = spec.submodules.self_attention
    attn = dataclasses.replace(
        attn, submodules=dataclasses.replace(attn.submodules, core_attention=CpuCausalAttention)
    )
    subs = dataclasses.replace(spec.submodules, self_attention=attn)
    if moe == "tiny":
        subs = dataclasses.replace(subs, mlp=ModuleSpec(module=TinyMoE))
    elif moe:
        from megatron_fastpath.moe import get_moe_mlp_spec

        subs = dataclasses.replace(subs, mlp=get_moe_mlp_spec())
    return dataclasses.replace(spec, submodules=subs)


class LayerStack(torch.nn.Module):
    """``num_layers`` layers built from one spec, run like TransformerBlock's loop (keywords)."""

    def __init__(self, spec: ModuleSpec, config: TransformerConfig):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [build_module(spec, config=config, layer_number=i + 1)
             for i in range(config.num_layers)]
        )

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None):
        for layer in self.layers:
            hidden_states, _ = layer(hidden_states=hidden_states, attention_mask=attention_mask,
                                     rotary_pos_emb=rotary_pos_emb)
        return hidden_states


def build_pair(spec: ModuleSpec, offload_spec: ModuleSpec, config: TransformerConfig):
    """Reference stack (plain spec) and offloaded stack with identical weights."""
    torch.manual_seed(0)
    ref = LayerStack(spec, config)
    off = LayerStack(offload_spec, config)
    off.load_state_dict(ref.state_dict())
    return ref, off


def run_step(model: torch.nn.Module, x: torch.Tensor, seed: int = 7,
             rotary_pos_emb: Optional[torch.Tensor] = None):
    """One forward/backward; returns (output, input grad, {param name: grad})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_(True)
    out = model(x, rotary_pos_emb=rotary_pos_emb)
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def run_manager_step(mgr, keys, tensors, at_layer_start=True, marks=True):
    """One step through an ActivationOffloadManager's API, one tensor per layer, in the order the
    offload layers call it (``at_layer_start``: recompute mode, the layer input is offloaded
    before its forward; False: saved-tensor mode, packed during and offloaded after it); every
    unpacked tensor equals what was packed. Returns the step's stats."""
    mgr.begin_step()
    groups, packed = [], []
    for key, t in zip(keys, tensors):
        g = mgr.open_group(key)
        if at_layer_start:
            packed.append(mgr.pack(g, t))
            mgr.close_group(g)
        if marks:
            mgr.mark("compute_begin", key, phase="fwd")
        if not at_layer_start:
            packed.append(mgr.pack(g, t))
        if marks:
            mgr.mark("compute_end", key, phase="fwd")
        if not at_layer_start:
            mgr.close_group(g)
        groups.append(g)
    for i in reversed(range(len(keys))):
        mgr.begin_backward(groups[i])
        torch.testing.assert_close(mgr.unpack(packed[i]), tensors[i], rtol=0, atol=0)
        mgr.end_backward(groups[i])
    return mgr.end_step()


def manager_step_trace(L: int, nbytes: int = 4000, at_layer_start: bool = True, **cfg):
    """(layer keys, the RecordingDevice trace of one real manager step over L layers with compute
    markers, host times zeroed); ``cfg``: OffloadConfig fields beyond the zero thresholds."""
    from megatron_fastpath.offload import ActivationOffloadManager, OffloadConfig, RecordingDevice

    dev = RecordingDevice()
    config = OffloadConfig(**{"min_offload_bytes": 0, "headroom_margin_bytes": 0, **cfg})
    mgr = ActivationOffloadManager(config, device=dev)
    keys = [mgr.register_layer(i + 1) for i in range(L)]
    run_manager_step(mgr, keys, [torch.randn(nbytes // 4) for _ in keys], at_layer_start)
    return keys, [dataclasses.replace(e, host_s=0.0) for e in dev.trace]
