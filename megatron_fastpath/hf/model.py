"""Build the fastpath GPTModel for a Hugging Face checkpoint and load its weights into it.

    spec = read_hf_config(path)                      # refuses unsupported configs first
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=..., max_seqs=..., rope=spec.rope_config()))
    model = load_hf_model(path, cache, lora=LoRAConfig(...))

Each rank builds only its own pipeline stage / TP / EP shard (Megatron's parallel state) and
reads only those slices from disk (:mod:`megatron_fastpath.hf.convert`).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from megatron_fastpath.hf.checkpoint import CheckpointError, SafetensorsCheckpoint
from megatron_fastpath.hf.config import HFModelSpec, read_hf_config
from megatron_fastpath.hf.convert import plan_globals, plan_layer, resolve_param

__all__ = ["build_hf_model", "build_hf_gpt", "hf_transformer_config", "load_hf_weights",
           "load_hf_model", "parallel_ranks"]


def parallel_ranks() -> dict:
    """This rank's TP / EP / PP coordinates from Megatron's parallel state (1 process if unset)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dict(tp_rank=0, tp=1, ep_rank=0, ep=1, first=True, last=True)
    return dict(
        tp_rank=ps.get_tensor_model_parallel_rank(), tp=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep=ps.get_expert_model_parallel_world_size(),
        first=ps.is_pipeline_first_stage(), last=ps.is_pipeline_last_stage(),
    )


def hf_transformer_config(spec: HFModelSpec, params_dtype=torch.float32, **config_overrides):
    """Megatron TransformerConfig of the checkpoint (parallel sizes from Megatron's state)."""
    from megatron_fastpath.model import build_transformer_config

    ranks = parallel_ranks()
    spec.check_parallel(ranks["tp"], ranks["ep"])
    overrides = dict(spec.transformer_overrides())
    overrides.setdefault("tensor_model_parallel_size", ranks["tp"])
    overrides.setdefault("expert_model_parallel_size", ranks["ep"])
    overrides.update(config_overrides)
    return build_transformer_config(spec.model_config(), params_dtype=params_dtype, **overrides)


def build_hf_gpt(spec: HFModelSpec, tcfg, cache, *, lora=None, backend: str = "sdpa",
                 linear_impl: Optional[str] = None, offload=None):
    """An (unloaded) GPTModel of the checkpoint's architecture for ``tcfg``: the package's one
    builder (:func:`megatron_fastpath.model.build_fastpath_gpt`) with the checkpoint's shape;
    ``lora`` / ``offload``: the features' configs."""
    from megatron_fastpath.model import build_fastpath_gpt

    return build_fastpath_gpt(tcfg, cache, spec.model_config(), backend=backend,
                              linear_impl=linear_impl, lora=lora, offload=offload,
                              tie_embeddings=spec.tie_embeddings, gemma=spec.gemma_options(),
                              **window_kwargs(spec))


def window_kwargs(spec: HFModelSpec) -> dict:
    """The builder's sliding-window arguments of the checkpoint (none without a window)."""
    if spec.sliding_window is None:
        return {}
    return dict(sliding_window=spec.sliding_window, window_layers=tuple(spec.window_layers))


def build_hf_model(spec: HFModelSpec, cache, *, lora=None, backend: str = "sdpa",
                   linear_impl: Optional[str] = None, params_dtype=torch.float32,
                   offload=None, **config_overrides):
    """(unloaded GPTModel, TransformerConfig) for the checkpoint; see :func:`build_hf_gpt`.
    config_overrides: extra TransformerConfig fields (graph / FP8 settings)."""
    spec.check_sequence_bound(  # LongRoPE: no sequence may exceed its original context
        cache.config.max_seqlen_bound, f"the cache's max_seqlen={cache.config.max_seqlen_bound}",
        f"build the cache with PackedSeqConfig(max_seqlen<={spec.max_sequence})")
    config_overrides.setdefault("use_cpu_initialization", cache.device.type != "cuda")
    tcfg = hf_transformer_config(spec, params_dtype, **config_overrides)
    model = build_hf_gpt(spec, tcfg, cache, lora=lora, backend=backend, linear_impl=linear_impl,
                         offload=offload)
    return model, tcfg


def _all_plans(model, spec: HFModelSpec, ranks: dict) -> list:
    plans = [("", p) for p in plan_globals(spec, ranks["tp_rank"], ranks["tp"],
                                            ranks["first"], ranks["last"])]
    for idx, layer in enumerate(model.decoder.layers):
        global_i = layer.layer_number - 1
        for p in plan_layer(spec, global_i, ranks["tp_rank"], ranks["tp"], ranks["ep_rank"], ranks["ep"]):
            plans.append((f"decoder.layers.{idx}.", p))
    return plans


def check_checkpoint(ckpt: SafetensorsCheckpoint, spec: HFModelSpec, plans: list) -> None:
    """Every tensor the model needs exists with the shape config.json implies (no reads)."""
    for _, plan in plans:
        for name, shape in zip(plan.hf_names, plan.hf_shapes):
            if name not in ckpt:
                raise CheckpointError(
                    f"{spec.path}: tensor '{name}' (needed for a {spec.model_type} model per "
                    "config.json) is not in the checkpoint")
            if tuple(ckpt.shape(name)) != tuple(shape):
                raise CheckpointError(
                    f"{ckpt.file_of(name)}: tensor '{name}' has shape {list(ckpt.shape(name))} "
                    f"but config.json implies {list(shape)}")


def _progress(total: int, show: bool):
    if not show:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with most stacks
        return None
    # disable=None: a bar on a terminal, nothing in a log file
    return tqdm(total=total, desc="loading checkpoint", unit="tensor", file=sys.stderr,
                mininterval=1.0, leave=False, disable=None)


@torch.no_grad()
def load_hf_weights(model, spec: HFModelSpec, ckpt: SafetensorsCheckpoint,
                    show_progress: bool = False) -> int:
    """Copy this rank's shard of every checkpoint tensor into ``model``; returns the count.
    All names and shapes are checked before the first tensor is read."""
    ranks = parallel_ranks()
    plans = _all_plans(model, spec, ranks)
    check_checkpoint(ckpt, spec, plans)
    targets = []
    for prefix, plan in plans:
        param = resolve_param(model, prefix + plan.target)
        if param is None:
            raise ValueError(f"the Megatron model has no parameter {prefix + plan.target} "
                             f"(needed for {plan.hf_names[:3]})")
        targets.append(param)
    bar = _progress(len(plans), show_progress)
    for (prefix, plan), param in zip(plans, targets):
        local = plan.read(ckpt)
        if tuple(local.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{spec.path}: {plan.hf_names[:3]} -> {prefix + plan.target}: shard shape "
                f"{list(local.shape)} != parameter shape {list(param.shape)}")
        param.copy_(local.to(param.dtype))
        del local
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return len(plans)


def load_hf_model(path: str, cache, *, lora=None, backend: str = "sdpa", show_progress=None,
                  **kwargs):
    """read_hf_config + index the checkpoint (headers only) + build + load. Returns
    (model, transformer_config, spec)."""
    spec = read_hf_config(path)
    ckpt = SafetensorsCheckpoint(path)  # file presence / truncation checked before building
    model, tcfg = build_hf_model(spec, cache, lora=lora, backend=backend, **kwargs)
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    try:
        load_hf_weights(model, spec, ckpt, show_progress=show_progress)
    finally:
        ckpt.close()
    return model, tcfg, spec
