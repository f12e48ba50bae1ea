"""Hugging Face <-> Megatron weight layout: names, fused QKV / FC1, TP and EP shards.

Megatron layout (as Megatron-Bridge's ``merge_qkv_weights`` / ``split_qkv_weights``):

* ``linear_qkv``: rows grouped per query group g = 0..G-1 as ``[q heads of g (P/G of them),
  k_g, v_g]``, each head ``D`` rows; TP rank r holds the contiguous groups
  ``[r*G/tp, (r+1)*G/tp)``, so its shard is a contiguous block of the fused matrix.
* ``linear_fc1``: ``[gate; up]``; TP rank r holds ``[gate_r; up_r]`` (each half sharded).
* Gemma 2's four norms per layer: ``input_layernorm`` -> ``input_layernorm``,
  ``pre_feedforward_layernorm`` -> ``pre_mlp_layernorm``, ``post_attention_layernorm`` /
  ``post_feedforward_layernorm`` -> ``self_attention`` / ``mlp.post_layernorm`` (each the
  ``(1 + weight)`` norm's weight as stored).
* Phi-3 stores q, k, v fused as ``qkv_proj`` (rows ``[q; k; v]``, not per group) and gate, up
  as ``gate_up_proj`` (rows ``[gate; up]``): split into their parts, then laid out as above.
* ``linear_proj`` / ``linear_fc2``: row parallel (input columns sharded).
* experts (sort/count MoE, ``GroupedSwiGLUExperts``): ``weight1[e] = [gate_e; up_e]^T``
  ([H, 2F]), ``weight2[e] = down_e^T`` ([F, H]); EP rank s holds experts
  ``[s*E/ep, (s+1)*E/ep)``.

Key: P = query heads, G = query groups, D = head dim, H = hidden, F = FFN, V = vocab,
E = experts, r = TP rank, tp = TP size.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from megatron_fastpath.hf.config import HFModelSpec

__all__ = ["fuse_qkv", "split_qkv", "ShardPlan", "hf_layer_names", "plan_layer", "plan_globals"]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[P*D, ...], [G*D, ...], [G*D, ...] -> Megatron's per-group interleave [(P+2G)*D, ...]."""
    rest = q.shape[1:]
    q_G = q.reshape(groups, -1, *rest)
    k_G = k.reshape(groups, -1, *rest)
    v_G = v.reshape(groups, -1, *rest)
    return torch.cat([q_G, k_G, v_G], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Inverse of :func:`fuse_qkv` for the given (local) heads and groups -> (q, k, v)."""
    rest = qkv.shape[1:]
    per = heads // groups * head_dim
    x_G = qkv.reshape(groups, per + 2 * head_dim, *rest)
    q = x_G[:, :per].reshape(-1, *rest)
    k = x_G[:, per : per + head_dim].reshape(-1, *rest)
    v = x_G[:, per + head_dim :].reshape(-1, *rest)
    return q, k, v


def _rng(n: int, rank: int, size: int) -> tuple:
    step = n // size
    return (rank * step, (rank + 1) * step)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One Megatron tensor: where it goes, the HF tensors it is made of, and how to read them.

    target: dotted path of the parameter on the Megatron model (layer-relative for layers).
    hf_names: source tensors (their full shapes are checked against ``hf_shapes`` first).
    read: ckpt -> local tensor (this rank's shard only).
    """

    target: str
    hf_names: tuple
    hf_shapes: tuple
    read: Callable


def hf_layer_names(spec: HFModelSpec, i: int) -> dict:
    """HF tensor names of layer i by role."""
    p = f"model.layers.{i}."
    if spec.family == "phi3":  # fused tensors; the roles q / k / v, gate / up are row ranges
        return {"input_norm": p + "input_layernorm.weight", "qkv": p + "self_attn.qkv_proj.weight",
                "o": p + "self_attn.o_proj.weight",
                "post_norm": p + "post_attention_layernorm.weight",
                "gate_up": p + "mlp.gate_up_proj.weight", "down": p + "mlp.down_proj.weight"}
    names = {
        "input_norm": p + "input_layernorm.weight",
        "q": p + "self_attn.q_proj.weight", "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight", "o": p + "self_attn.o_proj.weight",
        "post_norm": p + "post_attention_layernorm.weight",
    }
    if spec.family in ("gemma2", "gemma3"):  # four norms: the pre-MLP one is pre_feedforward_layernorm
        names.update(post_norm=p + "pre_feedforward_layernorm.weight",
                     attn_out_norm=p + "post_attention_layernorm.weight",
                     mlp_out_norm=p + "post_feedforward_layernorm.weight")
    if spec.qkv_bias:
        names.update(q_bias=p + "self_attn.q_proj.bias", k_bias=p + "self_attn.k_proj.bias",
                     v_bias=p + "self_attn.v_proj.bias")
    if spec.qk_norm:
        names.update(q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight")
    if spec.family == "mixtral":
        names["router"] = p + "block_sparse_moe.gate.weight"
        names["expert"] = p + "block_sparse_moe.experts.{e}.{w}.weight"
        names["expert_roles"] = ("w1", "w3", "w2")  # gate, up, down
    elif spec.family == "qwen3_moe":
        names["router"] = p + "mlp.gate.weight"
        names["expert"] = p + "mlp.experts.{e}.{w}.weight"
        names["expert_roles"] = ("gate_proj", "up_proj", "down_proj")
    else:
        names.update(gate=p + "mlp.gate_proj.weight", up=p + "mlp.up_proj.weight",
                     down=p + "mlp.down_proj.weight")
    return names


def _qkv_plans(spec: HFModelSpec, n: dict, r: int, tp: int) -> list:
    P, G, D, H = spec.num_attention_heads, spec.num_query_groups, spec.head_dim, spec.hidden_size
    g0, g1 = _rng(G, r, tp)
    q_rows = (g0 * (P // G) * D, g1 * (P // G) * D)
    kv_rows = (g0 * D, g1 * D)
    groups = g1 - g0
    if "qkv" in n:  # Phi-3: q, k, v are row blocks [0, PD), [PD, PD+GD), [PD+GD, (P+2G)D)
        def shift(rows, by):
            return (rows[0] + by, rows[1] + by)

        def read_fused(ck):
            return fuse_qkv(ck.get(n["qkv"], q_rows), ck.get(n["qkv"], shift(kv_rows, P * D)),
                            ck.get(n["qkv"], shift(kv_rows, (P + G) * D)), groups)

        return [ShardPlan("self_attention.linear_qkv.weight", (n["qkv"],), (((P + 2 * G) * D, H),),
                          read_fused)]

    def read(ck, suffix=""):
        return fuse_qkv(ck.get(n["q" + suffix], q_rows), ck.get(n["k" + suffix], kv_rows),
                        ck.get(n["v" + suffix], kv_rows), groups)

    plans = [ShardPlan("self_attention.linear_qkv.weight", (n["q"], n["k"], n["v"]),
                       ((P * D, H), (G * D, H), (G * D, H)), read)]
    if spec.qkv_bias:
        plans.append(ShardPlan("self_attention.linear_qkv.bias",
                               (n["q_bias"], n["k_bias"], n["v_bias"]), ((P * D,), (G * D,), (G * D,)),
                               lambda ck: read(ck, "_bias")))
    return plans


def _dense_mlp_plans(spec: HFModelSpec, n: dict, r: int, tp: int) -> list:
    F, H = spec.ffn_hidden_size, spec.hidden_size
    rows = _rng(F, r, tp)
    if "gate_up" in n:  # Phi-3: gate rows [0, F), up rows [F, 2F)
        up_rows = (F + rows[0], F + rows[1])
        return [
            ShardPlan("mlp.linear_fc1.weight", (n["gate_up"],), ((2 * F, H),),
                      lambda ck: torch.cat([ck.get(n["gate_up"], rows),
                                            ck.get(n["gate_up"], up_rows)], 0)),
            ShardPlan("mlp.linear_fc2.weight", (n["down"],), ((H, F),),
                      lambda ck: ck.get(n["down"], None, rows)),
        ]
    return [
        ShardPlan("mlp.linear_fc1.weight", (n["gate"], n["up"]), ((F, H), (F, H)),
                  lambda ck: torch.cat([ck.get(n["gate"], rows), ck.get(n["up"], rows)], 0)),
        ShardPlan("mlp.linear_fc2.weight", (n["down"],), ((H, F),),
                  lambda ck: ck.get(n["down"], None, rows)),
    ]


def _moe_plans(spec: HFModelSpec, n: dict, ep_rank: int, ep: int) -> list:
    E, F, H = spec.num_experts, spec.moe_ffn_hidden_size, spec.hidden_size
    e0, e1 = _rng(E, ep_rank, ep)
    gate, up, down = n["expert_roles"]
    names = [n["expert"].format(e=e, w=w) for e in range(E) for w in (gate, up, down)]
    shapes = [(F, H), (F, H), (H, F)] * E

    def w1(ck):
        return torch.stack([torch.cat([ck.get(n["expert"].format(e=e, w=gate)),
                                       ck.get(n["expert"].format(e=e, w=up))], 0).t()
                            for e in range(e0, e1)])

    def w2(ck):
        return torch.stack([ck.get(n["expert"].format(e=e, w=down)).t() for e in range(e0, e1)])

    return [
        ShardPlan("mlp.router.weight", (n["router"],), ((E, H),), lambda ck: ck.get(n["router"])),
        ShardPlan("mlp.experts.weight1", tuple(names), tuple(shapes), w1),
        ShardPlan("mlp.experts.weight2", (), (), w2),
    ]


def plan_layer(spec: HFModelSpec, i: int, tp_rank: int = 0, tp: int = 1,
               ep_rank: int = 0, ep: int = 1) -> list:
    """Every Megatron tensor of decoder layer i (layer-relative targets) for this rank."""
    n = hf_layer_names(spec, i)
    H, P, D = spec.hidden_size, spec.num_attention_heads, spec.head_dim
    cols = _rng(P * D, tp_rank, tp)

    def whole(name):
        return lambda ck: ck.get(name)

    plans = [ShardPlan("input_layernorm.weight", (n["input_norm"],), ((H,),), whole(n["input_norm"]))]
    plans += _qkv_plans(spec, n, tp_rank, tp)
    plans.append(ShardPlan("self_attention.linear_proj.weight", (n["o"],), ((H, P * D),),
                           lambda ck: ck.get(n["o"], None, cols)))
    if spec.qk_norm:
        plans += [ShardPlan("self_attention.q_layernorm.weight", (n["q_norm"],), ((D,),), whole(n["q_norm"])),
                  ShardPlan("self_attention.k_layernorm.weight", (n["k_norm"],), ((D,),), whole(n["k_norm"]))]
    plans.append(ShardPlan("pre_mlp_layernorm.weight", (n["post_norm"],), ((H,),), whole(n["post_norm"])))
    if "attn_out_norm" in n:  # Gemma 2: attention / MLP outputs normed before the residual add
        plans += [ShardPlan(f"{owner}.post_layernorm.weight", (n[role],), ((H,),), whole(n[role]))
                  for owner, role in (("self_attention", "attn_out_norm"), ("mlp", "mlp_out_norm"))]
    plans += _moe_plans(spec, n, ep_rank, ep) if spec.is_moe else _dense_mlp_plans(spec, n, tp_rank, tp)
    return plans


def plan_globals(spec: HFModelSpec, tp_rank: int = 0, tp: int = 1, first_stage: bool = True,
                 last_stage: bool = True) -> list:
    """Embedding (first stage), final norm and LM head (last stage)."""
    V, H = spec.vocab_size, spec.hidden_size
    rows = _rng(V, tp_rank, tp)
    emb = "model.embed_tokens.weight"
    plans = []
    if first_stage:
        plans.append(ShardPlan("embedding.word_embeddings.weight", (emb,), ((V, H),),
                               lambda ck: ck.get(emb, rows)))
    if last_stage:
        plans.append(ShardPlan("decoder.final_layernorm.weight", ("model.norm.weight",), ((H,),),
                               lambda ck: ck.get("model.norm.weight")))
        if not spec.tie_embeddings:
            plans.append(ShardPlan("output_layer.weight", ("lm_head.weight",), ((V, H),),
                                   lambda ck: ck.get("lm_head.weight", rows)))
        elif not first_stage:  # PP: the last stage keeps its own copy of the tied matrix
            plans.append(ShardPlan("output_layer.weight", (emb,), ((V, H),), lambda ck: ck.get(emb, rows)))
    return plans


def resolve_param(root: torch.nn.Module, dotted: str) -> Optional[torch.Tensor]:
    """The parameter at ``dotted`` (LoRA wrappers forward ``weight``/``bias`` to their base);
    norms fused into TE linears are found as ``linear_qkv/fc1.layer_norm_weight``."""
    fused = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            break
    if isinstance(obj, torch.Tensor):
        return obj
    for unfused, te_name in fused.items():
        if dotted == unfused or dotted.endswith("." + unfused):
            return resolve_param(root, dotted[: len(dotted) - len(unfused)] + te_name)
    return None
