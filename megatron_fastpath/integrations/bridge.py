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

On a CPU machine Bridge 0.6 imports only with a stand-in Transformer Engine
(``megatron/bridge/peft/lora_layers.py:20`` imports it unconditionally):
``tests/integrations/test_bridge_finetune_cpu.py`` runs Bridge's ``finetune`` with its LoRA
recipe with and without this hook there (the tests' fake TE and CPU stand-ins) and compares the
per-token losses with each other and the main job's; docs/integrations.md lists what else
Bridge needs there.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from megatron_fastpath._optional import MissingDependencyError
from megatron_fastpath.integrations import core
from megatron_fastpath.integrations._runtime import (
    FastpathLayerSpec,
    FastpathSettings,
    NotSupportedError,
    cache_for,
    host_cu_seqlens,
)

__all__ = ["BridgeConfigNotSupportedError", "FastpathForwardStep", "apply_fastpath_to_config", "require_bridge"]


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

        from megatron_fastpath.packed_seq.runtime import forward

        if return_schedule_plan:
            raise ValueError(
                "FastpathForwardStep does not build schedule plans (overlap_moe_expert_parallel_comm); "
                "disable that overlap"
            )
        batch = next(data_iterator)
        cache, in_flight = cache_for(self.settings)
        pb = in_flight.acquire(cu_seqlens=host_cu_seqlens(batch))
        first = parallel_state.is_pipeline_first_stage()
        last = parallel_state.is_pipeline_last_stage()

        def dev(key):
            return batch[key].to(cache.device, non_blocking=True)

        output = forward(model, pb, dev("tokens") if first else None, dev("labels") if last else None,
                         linear_cross_entropy=self.settings.chunked_loss)
        loss_mask = dev("loss_mask") if last else None
        rerun = state.cfg.rerun_state_machine
        return output, partial(
            masked_next_token_loss,
            loss_mask,
            check_for_nan_in_loss=rerun.check_for_nan_in_loss,
            check_for_spiky_loss=rerun.check_for_spiky_loss,
        )


def apply_fastpath_to_config(cfg, **options):
    """Apply megatron_fastpath to a Megatron-Bridge ``ConfigContainer`` in place.

    Returns ``(cfg, forward_step)``: pass both to ``megatron.bridge.training.finetune.finetune``.
    ``options`` are the keyword arguments of
    :func:`megatron_fastpath.integrations.nemo.apply_fastpath` (the fields of
    :class:`~megatron_fastpath.integrations.core.HookRequest`: attention_backend, max_seqs,
    cuda_graphs, fp8, fp8_recipe, lora, moe_expert_backend, linear_cross_entropy) except ``packed_cache``: the cache
    is always used, Bridge's own forward step cannot feed it. The rules are
    :mod:`megatron_fastpath.integrations.core`'s, shared with the NeMo hook.

    Raises:
        MissingDependencyError: Megatron-Bridge is not importable.
        BridgeConfigNotSupportedError: every reason the config cannot be served.
        TypeError: an unknown option, or ``packed_cache``.
    """
    require_bridge()
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    if not isinstance(cfg.model, GPTModelProvider):
        raise BridgeConfigNotSupportedError(
            [f"cfg.model is {type(cfg.model).__name__}, not a GPTModelProvider: megatron_fastpath "
             "swaps GPT decoder layers only"]
        )
    if isinstance(cfg.model.transformer_layer_spec, FastpathLayerSpec):
        raise BridgeConfigNotSupportedError(["apply_fastpath_to_config was already applied"])
    if "packed_cache" in options:
        raise TypeError("apply_fastpath_to_config always uses the packed cache (no packed_cache option)")
    request = core.HookRequest(**options)
    plan = core.decide(_config_facts(cfg), request, BridgeConfigNotSupportedError)
    settings = FastpathSettings(**plan.settings)
    _write_plan(cfg, settings, plan, request)
    return cfg, FastpathForwardStep(settings)


def _packing_specs(dataset):
    return getattr(dataset, "packed_sequence_specs", None) or getattr(dataset, "offline_packing_specs", None)


def _config_facts(cfg) -> core.ModelFacts:
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    try:  # Bridge releases whose Llama 3.1 provider rescales RoPE in provide()
        from megatron.bridge.models.llama.llama_provider import Llama31ModelProvider
    except ImportError:
        Llama31ModelProvider = None
    model = cfg.model
    default_spec = next(f.default for f in dataclasses.fields(GPTModelProvider)
                        if f.name == "transformer_layer_spec")
    specs = _packing_specs(cfg.dataset)
    mp, peft = cfg.mixed_precision, cfg.peft
    return core.ModelFacts(
        names=core.NAMES["bridge"],
        model=model,
        **core.model_config_facts(model, type(model), "provide", GPTModelProvider,
                                  Llama31ModelProvider, default_spec),
        context_parallel_size=model.context_parallel_size or 1,
        virtual_pipeline_size=model.virtual_pipeline_model_parallel_size,
        pipeline_size=model.pipeline_model_parallel_size or 1,
        packed_size=getattr(specs, "packed_sequence_size", None),
        micro_batch_size=getattr(cfg.train, "micro_batch_size", 1),
        graphs_on=getattr(model, "cuda_graph_impl", "none") != "none" or bool(model.enable_cuda_graph),
        has_precision=hasattr(mp, "fp8"),
        fp8_on=bool(getattr(mp, "fp8", None) or getattr(model, "fp8", None)),
        peft=None if peft is None else core.PeftFacts(
            name=type(peft).__name__,
            supported=hasattr(peft, "target_modules"),
            target_modules=tuple(getattr(peft, "target_modules", None) or ()),
        ),
        expert_parallel_size=getattr(model, "expert_model_parallel_size", None) or 1,
    )


def _write_plan(cfg, settings: FastpathSettings, plan: core.HookPlan, request: core.HookRequest):
    model, dataset = cfg.model, cfg.dataset
    model.transformer_layer_spec = FastpathLayerSpec(settings)
    if plan.position_embedding_type is not None:
        model.position_embedding_type = plan.position_embedding_type
    _packing_specs(dataset).pad_cu_seqlens = False
    dataset.dataset_kwargs = {**(getattr(dataset, "dataset_kwargs", None) or {}), "pad_to_max_length": True}
    if request.cuda_graphs is not None:
        model.cuda_graph_impl = "local" if request.cuda_graphs else "none"
        if request.cuda_graphs:
            model.use_te_rng_tracker = True
    if plan.graph_warmup_steps is not None:
        model.cuda_graph_warmup_steps = plan.graph_warmup_steps
    if plan.set_fp8 and hasattr(cfg.mixed_precision, "fp8"):
        cfg.mixed_precision.fp8 = plan.fp8
        if request.fp8_recipe is not None:
            cfg.mixed_precision.fp8_recipe = request.fp8_recipe
    if request.lora is not None:
        cfg.peft.target_modules = list(request.lora)
