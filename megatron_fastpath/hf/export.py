"""Export a fastpath LoRA run for Hugging Face: a PEFT adapter directory, or merged weights.

PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors`` + the source tokenizer
files, keys
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ...): a fused adapter
delta ``s * B @ A`` on ``linear_qkv`` (rows in Megatron's per-group order) is exactly three
rank-r PEFT adapters sharing A: ``q_proj: (A, B_q)``, ``k_proj: (A, B_k)``, ``v_proj: (A, B_v)``
with ``B_q, B_k, B_v = split_qkv(B)``; ``linear_fc1`` likewise gives ``gate_proj`` / ``up_proj``.
Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` take one adapter each: ``(A, [B_q; B_k; B_v])``
and ``(A, B)`` (``linear_fc1``'s rows are already ``[gate; up]``).

Merged checkpoint: Megatron weights (+ adapter deltas) back in HF names, one safetensors file
per layer plus ``model.safetensors.index.json`` (one layer in host memory at a time), the
source ``config.json`` and tokenizer files copied.

TP / EP shards are gathered over Megatron's groups; files are written by global rank 0.
Key: r = LoRA rank, s = alpha / r; other letters as :mod:`megatron_fastpath.hf.convert`.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterator

import torch

from megatron_fastpath.hf.config import HFModelSpec
from megatron_fastpath.hf.convert import hf_layer_names, resolve_param, split_qkv
from megatron_fastpath.lora.config import HF_TARGETS

__all__ = ["peft_state_dict", "save_peft_adapter", "save_merged_checkpoint", "PEFT_MODULES",
           "peft_modules", "copy_tokenizer_files"]

# Megatron LoRA target -> HF module names it becomes (the same table reads lora.targets).
PEFT_MODULES = HF_TARGETS
PHI3_MODULES = {"linear_qkv": ("qkv_proj",), "linear_proj": ("o_proj",),
                "linear_fc1": ("gate_up_proj",), "linear_fc2": ("down_proj",)}


def peft_modules(spec: HFModelSpec) -> dict:
    """Megatron LoRA target -> the checkpoint family's HF module names."""
    return PHI3_MODULES if spec.family == "phi3" else PEFT_MODULES
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json", "vocab.json", "merges.txt",
                   "chat_template.jinja")


def copy_tokenizer_files(src_dir: str, out_dir: str) -> list:
    """Copy the checkpoint's tokenizer files (chat template and generation config included)
    that exist in ``src_dir`` into ``out_dir``, so the exported folder loads with
    ``AutoTokenizer.from_pretrained``; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(out_dir, name))
            copied.append(name)
    return copied


def _tp_group():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_model_parallel_group()


def _gather(t: torch.Tensor, dim: int, group) -> list:
    """All shards of ``t`` over ``group`` (a 1-list without a group)."""
    if group is None:
        return [t]
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return parts


def _full_column(t: torch.Tensor, halves: int, group) -> list:
    """Column-parallel output rows, gathered: ``halves`` == 2 for [gate_r; up_r] shards ->
    [gate, up]; 1 -> [full]."""
    parts = [p.chunk(halves, 0) for p in _gather(t, 0, group)]
    return [torch.cat([p[h] for p in parts], 0) for h in range(halves)]


def _layer_adapters(layer, spec: HFModelSpec, i: int, group) -> Iterator[tuple]:
    """(hf module name, A [r, in], B [out, r]) of every adapter of one layer, full (TP-gathered)."""
    from megatron_fastpath.lora import LoRALinear

    prefix = f"model.layers.{i}."
    for target, (owner, _) in _lora_targets().items():
        mod = getattr(getattr(layer, owner), target, None)
        if not isinstance(mod, LoRALinear):
            continue
        A, B = mod.lora_A.detach().float(), mod.lora_B.detach().float()
        if mod.parallel == "row":
            A, B = torch.cat(_gather(A, 1, group), 1), B
        else:
            B = _full_column(B, 2 if target == "linear_fc1" else 1, group)
            B = B[0] if target != "linear_fc1" else torch.cat(B, 0)
        sub = "self_attn." if owner == "self_attention" else "mlp."
        names = peft_modules(spec)[target]
        if target == "linear_qkv":
            parts = split_qkv(B, spec.num_attention_heads, spec.num_query_groups, spec.head_dim)
            if spec.family == "phi3":  # one fused qkv_proj adapter, rows [q; k; v]
                parts = (torch.cat(parts, 0),)
        elif target == "linear_fc1" and spec.family == "phi3":
            parts = (B,)
        elif target == "linear_fc1":
            parts = B.chunk(2, 0)
        else:
            parts = (B,)
        for name, b in zip(names, parts):
            yield prefix + sub + name, A, b


def _lora_targets():
    from megatron_fastpath.lora import LORA_TARGETS

    return LORA_TARGETS


def peft_state_dict(model, spec: HFModelSpec) -> dict:
    """PEFT adapter tensors (float32, contiguous) under PEFT's saved key names."""
    group = _tp_group()
    out = {}
    for layer in model.decoder.layers:
        for name, A, B in _layer_adapters(layer, spec, layer.layer_number - 1, group):
            out[f"base_model.model.{name}.lora_A.weight"] = A.contiguous().clone()
            out[f"base_model.model.{name}.lora_B.weight"] = B.contiguous().clone()
    return out


def _is_writer() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def save_peft_adapter(model, spec: HFModelSpec, lora_cfg, out_dir: str) -> dict:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` and the checkpoint's
    tokenizer files (as the merged export does); returns the config."""
    from safetensors.torch import save_file

    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("PEFT export with pipeline parallelism is not supported (PP=1 only)")
    tensors = peft_state_dict(model, spec)
    modules = sorted({m for t in lora_cfg.targets for m in peft_modules(spec)[t]})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank,
        "lora_alpha": lora_cfg.alpha, "lora_dropout": lora_cfg.dropout,
        "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "inference_mode": True,
        "base_model_name_or_path": os.path.abspath(spec.path), "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
    }
    if _is_writer():
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        copy_tokenizer_files(spec.path, out_dir)
    return config


@torch.no_grad()
def _weight(layer, owner: str, name: str) -> torch.Tensor:
    """Weight of ``layer.<owner>.<name>`` (float32) plus its LoRA delta when the adapter is on."""
    from megatron_fastpath.lora import LoRALinear

    mod = getattr(getattr(layer, owner), name)
    w = mod.weight.detach().float()
    if isinstance(mod, LoRALinear) and mod.enabled:
        w = w + mod.merged_weight_delta().float()
    return w


def _merged_layer(layer, spec: HFModelSpec, i: int, group, ep_group) -> dict:
    """One layer's tensors in HF names (float32, full)."""
    n = hf_layer_names(spec, i)
    P, G, D = spec.num_attention_heads, spec.num_query_groups, spec.head_dim
    out = {n["input_norm"]: resolve_param(layer, "input_layernorm.weight").detach().float(),
           n["post_norm"]: resolve_param(layer, "pre_mlp_layernorm.weight").detach().float()}
    if "attn_out_norm" in n:  # Gemma 2's post-attention / post-MLP norms
        out[n["attn_out_norm"]] = layer.self_attention.post_layernorm.weight.detach().float()
        out[n["mlp_out_norm"]] = layer.mlp.post_layernorm.weight.detach().float()
    qkv = _full_column(_weight(layer, "self_attention", "linear_qkv"), 1, group)[0]
    if spec.family == "phi3":
        out[n["qkv"]] = torch.cat(split_qkv(qkv, P, G, D), 0)
    else:
        out[n["q"]], out[n["k"]], out[n["v"]] = split_qkv(qkv, P, G, D)
    if spec.qkv_bias:
        bias = _full_column(layer.self_attention.linear_qkv.bias.detach().float(), 1, group)[0]
        out[n["q_bias"]], out[n["k_bias"]], out[n["v_bias"]] = split_qkv(bias, P, G, D)
    out[n["o"]] = torch.cat(_gather(_weight(layer, "self_attention", "linear_proj"), 1, group), 1)
    if spec.qk_norm:
        out[n["q_norm"]] = layer.self_attention.q_layernorm.weight.detach().float()
        out[n["k_norm"]] = layer.self_attention.k_layernorm.weight.detach().float()
    if spec.is_moe:
        out[n["router"]] = layer.mlp.router.weight.detach().float()
        w1 = torch.cat(_gather(layer.mlp.experts.weight1.detach().float(), 0, ep_group), 0)
        w2 = torch.cat(_gather(layer.mlp.experts.weight2.detach().float(), 0, ep_group), 0)
        gate, up, down = n["expert_roles"]
        for e in range(spec.num_experts):
            g, u = w1[e].t().chunk(2, 0)
            out[n["expert"].format(e=e, w=gate)] = g
            out[n["expert"].format(e=e, w=up)] = u
            out[n["expert"].format(e=e, w=down)] = w2[e].t()
    elif spec.family == "phi3":
        out[n["gate_up"]] = torch.cat(_full_column(_weight(layer, "mlp", "linear_fc1"), 2, group), 0)
        out[n["down"]] = torch.cat(_gather(_weight(layer, "mlp", "linear_fc2"), 1, group), 1)
    else:
        out[n["gate"]], out[n["up"]] = _full_column(_weight(layer, "mlp", "linear_fc1"), 2, group)
        out[n["down"]] = torch.cat(_gather(_weight(layer, "mlp", "linear_fc2"), 1, group), 1)
    return out


def _ep_group():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_expert_model_parallel_world_size() == 1:
        return None
    return ps.get_expert_model_parallel_group()


@torch.no_grad()
def save_merged_checkpoint(model, spec: HFModelSpec, out_dir: str, dtype=None) -> list:
    """Merged (base + LoRA) weights as a Hugging Face checkpoint directory; returns the files.

    dtype: torch dtype of the saved tensors (default: the source config's ``torch_dtype``)."""
    from safetensors.torch import save_file

    src_dtype = spec.raw.get("torch_dtype") or spec.raw.get("dtype") or "float32"
    dtype = dtype or getattr(torch, str(src_dtype), torch.float32)
    group, ep_group = _tp_group(), _ep_group()
    writer = _is_writer()
    if writer:
        os.makedirs(out_dir, exist_ok=True)
    n_files = len(model.decoder.layers) + 1
    weight_map, files = {}, []

    def write(tensors: dict, k: int):
        fname = f"model-{k + 1:05d}-of-{n_files:05d}.safetensors"
        if writer:
            save_file({key: v.to(dtype).contiguous() for key, v in tensors.items()},
                      os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({key: fname for key in tensors})
        files.append(fname)

    for k, layer in enumerate(model.decoder.layers):
        write(_merged_layer(layer, spec, layer.layer_number - 1, group, ep_group), k)
    emb = torch.cat(_gather(model.embedding.word_embeddings.weight.detach().float(), 0, group), 0)
    glob = {"model.embed_tokens.weight": emb,
            "model.norm.weight": model.decoder.final_layernorm.weight.detach().float()}
    if not spec.tie_embeddings:
        glob["lm_head.weight"] = torch.cat(_gather(model.output_layer.weight.detach().float(), 0, group), 0)
    write(glob, n_files - 1)
    if writer:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
        cfg = dict(spec.raw)
        for key in [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]:
            cfg[key] = str(dtype).replace("torch.", "")
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        copy_tokenizer_files(spec.path, out_dir)
    return files
