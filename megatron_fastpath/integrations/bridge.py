"""Megatron-Bridge hook: megatron_fastpath in a Bridge ``ConfigContainer`` (import-guarded).

Megatron-Bridge (``pip install megatron-bridge``) needs Transformer Engine, and its releases
after 0.3 need Python >= 3.12: it runs in NVIDIA's GPU containers, not on this project's CPU
machines, so this module is written against Bridge's public configuration API and imports
Bridge only inside the functions (importing this module needs nothing beyond Megatron-Core):

* ``GPTModelProvider.transformer_layer_spec`` (a ``ModuleSpec`` or ``provider -> ModuleSpec``
  callable, called in ``provide()``) -> :class:`FastpathLayerSpec`;
* the packed-dataset specs: ``cfg.dataset.packed_sequence_specs`` (``PackedSequenceSpecs``,
  Bridge <= 0.5) or ``cfg.dataset.offline_packing_specs`` (Bridge >= 0.6), ``pad_cu_seqlens``
  and ``dataset_kwargs["pad_to_max_length"]``;
* ``cfg.model.cuda_graph_impl`` / ``use_te_rng_tracker``, ``cfg.mixed_precision.fp8`` /
  ``fp8_recipe``, ``cfg.peft.target_modules``;
* a forward step for ``finetune(cfg, forward_step_func)`` (:class:`FastpathForwardStep`,
  signature ``(state, data_iterator, model, return_schedule_plan=False)``; Bridge injects its
  ``GlobalState`` because the first parameter is named ``state``). Bridge's own
  ``gpt_step.forward_step`` copies ``cu_seqlens`` to the GPU and builds a new
  ``PackedSeqParams`` per microbatch (``get_packed_seq_params``); ours loads the host
  ``cu_seqlens`` into the cache (one H2D copy, static buffers) and uses Bridge's
  ``masked_next_token_loss``.

Usage (inside a Bridge container)::

    from megatron.bridge.training.finetune import finetune
    from megatron_fastpath.integrations.bridge import apply_fastpath_to_config

    cfg, forward_step = apply_fastpath_to_config(cfg)   # cfg: a Bridge ConfigContainer
    finetune(cfg, forward_step)

Not exercised on this project's CI (no Bridge there): the framework-independent parts
(settings, layer spec, host ``cu_seqlens`` reading, slot ring) are tested with the NeMo hook.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional, Sequence

from megatron_fastpath._optional import MissingDependencyError
from megatron_fastpath.lora.config import LORA_TARGETS
from megatron_fastpath.integrations._runtime import (
    FastpathLayerSpec,
    FastpathSettings,
    NotSupportedError,
    cache_for,
    host_cu_seqlens,
)

__all__ = ["BridgeConfigNotSupportedError", "FastpathForwardStep", "apply_fastpath_to_config", "require_bridge"]

_LORA_TARGETS = tuple(LORA_TARGETS)


class BridgeConfigNotSupportedError(NotSupportedError):
    """The ConfigContainer needs something megatron_fastpath does not provide."""

    what = "this Bridge config"


def require_bridge():
    """Import ``megatron.bridge`` or raise :class:`MissingDependencyError` saying why."""
    try:
        import megatron.bridge as bridge
    except (ImportError, RuntimeError, OSError) as exc:  # a half-installed TE raises RuntimeError
        raise MissingDependencyError(
            "the Megatron-Bridge hook needs the package 'megatron-bridge' (Python >= 3.12 and "
            f"Transformer Engine: NVIDIA's NeMo/PyTorch GPU containers), which could not be "
            f"imported ({type(exc).__name__}: {exc}). On other machines use the NeMo 2 hook "
            "(megatron_fastpath.integrations.nemo) or megatron_fastpath.train."
        ) from exc
    return bridge


@dataclasses.dataclass(frozen=True)
class FastpathForwardStep:
    """Bridge ``forward_step_func`` for packed fine-tuning through the cache.

    Reads the next collate batch on the host, loads its boundaries into this process's cache
    (``cache.set_batch(cu_seqlens=...)`` via the slot ring), moves tokens / labels / loss_mask to
    the device for the pipeline stages that use them and calls the model with the cache's
    static ``PackedSeqParams``. Returns ``(output, loss_fn)`` as Bridge's ``forward_step``."""

    settings: FastpathSettings

    def __call__(self, state, data_iterator, model, return_schedule_plan: bool = False):
        from megatron.bridge.training.losses import masked_next_token_loss
        from megatron.core import parallel_state

        if return_schedule_plan:
            raise ValueError(
                "FastpathForwardStep does not build schedule plans (overlap_moe_expert_parallel_comm); "
                "disable that overlap"
            )
        batch = next(data_iterator)
        cache, in_flight = cache_for(self.settings)
        pb = in_flight.load(host_cu_seqlens(batch))
        first = parallel_state.is_pipeline_first_stage()
        last = parallel_state.is_pipeline_last_stage()

        def dev(key):
            return batch[key].to(cache.device, non_blocking=True)

        output = model(
            input_ids=dev("tokens") if first else None,
            position_ids=pb.position_ids_1T if first else None,
            attention_mask=None,
            labels=dev("labels") if last else None,
            packed_seq_params=pb.packed_seq_params,
        )
        loss_mask = dev("loss_mask") if last else None
        rerun = state.cfg.rerun_state_machine
        return output, partial(
            masked_next_token_loss,
            loss_mask,
            check_for_nan_in_loss=rerun.check_for_nan_in_loss,
            check_for_spiky_loss=rerun.check_for_spiky_loss,
        )


def apply_fastpath_to_config(
    cfg,
    *,
    attention_backend: str = "auto",
    max_seqs: Optional[int] = None,
    cuda_graphs: Optional[bool] = None,
    fp8: Optional[str | bool] = None,
    fp8_recipe: Optional[str] = None,
    lora: Optional[Sequence[str]] = None,
    moe_expert_backend: Optional[str] = None,
):
    """Apply megatron_fastpath to a Megatron-Bridge ``ConfigContainer`` in place.

    Returns ``(cfg, forward_step)``: pass both to ``megatron.bridge.training.finetune.finetune``.
    Arguments as :func:`megatron_fastpath.integrations.nemo.apply_fastpath` (the cache is always
    used: Bridge's own forward step cannot feed it).

    Raises:
        MissingDependencyError: Megatron-Bridge is not importable.
        BridgeConfigNotSupportedError: every reason the config cannot be served.
    """
    require_bridge()
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    model = cfg.model
    if not isinstance(model, GPTModelProvider):
        raise BridgeConfigNotSupportedError(
            [f"cfg.model is {type(model).__name__}, not a GPTModelProvider: megatron_fastpath "
             "swaps GPT decoder layers only"]
        )
    reasons: list[str] = []
    if isinstance(model.transformer_layer_spec, FastpathLayerSpec):
        raise BridgeConfigNotSupportedError(["apply_fastpath_to_config was already applied"])
    if getattr(model, "multi_latent_attention", False):
        reasons.append("multi-latent attention (MLA) is not implemented by the packed cache's attention")
    if getattr(model, "window_size", None) is not None:
        reasons.append(f"sliding-window attention (window_size={model.window_size}) is not supported")
    if model.position_embedding_type == "yarn":
        # Llama 3.1 scaling (rope_scaling / rope_scaling_factor) is reproduced by the cache.
        reasons.append("YaRN RoPE is not reproduced by the packed cache's RoPE")
    if getattr(model, "mtp_num_layers", None):
        reasons.append("multi-token prediction (mtp_num_layers) is not supported")
    if str(getattr(model.attention_backend, "name", model.attention_backend)) == "local":
        reasons.append(
            "attention_backend=local makes GPTModelProvider.provide() overwrite the core "
            "attention with Megatron's DotProductAttention; leave it at 'auto'"
        )
    if (model.context_parallel_size or 1) > 1:
        reasons.append(f"context_parallel_size={model.context_parallel_size}: the packed cache has no CP partitioning")
    if model.virtual_pipeline_model_parallel_size:
        reasons.append("virtual (interleaved) pipeline parallelism reorders backwards; cache slots cannot be released in order")
    if getattr(model, "num_moe_experts", None):
        if model.moe_shared_expert_intermediate_size:
            reasons.append("shared experts are not wired into the fastpath MoE layer by this hook")
        if getattr(model, "overlap_moe_expert_parallel_comm", False):
            reasons.append("overlap_moe_expert_parallel_comm needs Bridge's schedule plans (Megatron's MoE layer)")

    dataset = cfg.dataset
    specs = getattr(dataset, "packed_sequence_specs", None) or getattr(dataset, "offline_packing_specs", None)
    packed_size = getattr(specs, "packed_sequence_size", -1) if specs is not None else -1
    if packed_size is None or packed_size <= 0:
        reasons.append(
            "the dataset has no packed-sequence specs with packed_sequence_size > 0 "
            "(packed_sequence_specs / offline_packing_specs): the packed cache needs packed batches"
        )
    if getattr(cfg.train, "micro_batch_size", 1) != 1:
        reasons.append(f"packed sequences need train.micro_batch_size=1; got {cfg.train.micro_batch_size}")
    mp = cfg.mixed_precision
    if fp8 not in (None, False) and not hasattr(mp, "fp8"):
        reasons.append(
            "fp8 requested but cfg.mixed_precision is not a MixedPrecisionConfig object (resolve "
            "the named recipe first, e.g. get_mixed_precision_config(name))"
        )
    fp8_on = bool(getattr(mp, "fp8", None) or getattr(model, "fp8", None)) if fp8 is None else fp8 is not False
    peft = cfg.peft
    if lora is not None or peft is not None:
        targets = list(lora) if lora is not None else list(getattr(peft, "target_modules", None) or [])
        if peft is None or not hasattr(peft, "target_modules"):
            reasons.append(f"LoRA targets given but cfg.peft is {type(peft).__name__}, not LoRA/DoRA")
        elif any(t not in _LORA_TARGETS for t in targets):
            reasons.append(f"LoRA target modules {targets} are not among {list(_LORA_TARGETS)}")
        elif getattr(model, "num_moe_experts", None) and {"linear_fc1", "linear_fc2"} & set(targets):
            reasons.append("LoRA on expert linears: the fastpath experts are grouped weight tensors")
    if reasons:
        raise BridgeConfigNotSupportedError(reasons)

    settings = FastpathSettings(
        max_tokens=packed_size,
        max_seqs=max_seqs or packed_size,
        num_slots=model.pipeline_model_parallel_size or 1,
        attention_backend=attention_backend,
        linear_impl="te" if fp8_on else None,
        moe_expert_backend=moe_expert_backend or ("te_grouped_linear" if fp8_on else "grouped_mm"),
        rope=model.position_embedding_type == "rope",
    )
    model.transformer_layer_spec = FastpathLayerSpec(settings)
    if model.position_embedding_type == "rope":
        model.position_embedding_type = "none"
    specs.pad_cu_seqlens = False
    dataset.dataset_kwargs = {**(getattr(dataset, "dataset_kwargs", None) or {}), "pad_to_max_length": True}
    if cuda_graphs is not None:
        model.cuda_graph_impl = "local" if cuda_graphs else "none"
        if cuda_graphs:
            model.use_te_rng_tracker = True
    if fp8 is not None:
        mp.fp8 = fp8 or None
        if fp8_recipe is not None:
            mp.fp8_recipe = fp8_recipe
    if lora is not None:
        peft.target_modules = list(lora)
    return cfg, FastpathForwardStep(settings)
