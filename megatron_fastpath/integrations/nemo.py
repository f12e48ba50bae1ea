"""NeMo 2 (``nemo-toolkit[llm]`` 2.7) recipe hook: one call puts megatron_fastpath into a NeMo-Run
recipe.

    from nemo.collections import llm
    from megatron_fastpath.integrations.nemo import apply_fastpath

    recipe = llm.llama3_8b.finetune_recipe(name="sft", dir="/ckpts", num_nodes=1,
                                           num_gpus_per_node=8, peft_scheme="lora",
                                           packed_sequence=True)
    recipe = apply_fastpath(recipe, cuda_graphs=True)

What it changes in the ``run.Partial(llm.finetune, ...)`` tree (all public NeMo config fields):

* ``model.config.transformer_layer_spec`` -> ``FastpathLayerSpec(settings)``: NeMo's
  ``GPTConfig.configure_model`` calls it with the built config; it creates this process's
  ``PackedSeqCache`` and returns ``get_fastpath_layer_spec(cache, ...)``.
* ``model.config.data_step_fn`` -> ``FastpathDataStep(settings)``. NeMo 2.7 builds
  ``PackedSeqParams`` in ``nemo/collections/llm/gpt/model/base.py``: ``gpt_data_step`` copies
  ``cu_seqlens`` to the GPU (``cu_seqlens_argmin`` / ``max_seqlen`` stay on the host) and
  ``gpt_forward_step`` -> ``get_packed_seq_params`` slices it with ``cu_seqlens_argmin.item()``
  into a new variable-length ``PackedSeqParams`` every microbatch. Our data step instead takes
  the collate's *host* ``cu_seqlens`` (trimmed at the host ``cu_seqlens_argmin``) and calls
  ``cache.set_batch(cu_seqlens=...)``: validated on the host, one H2D copy into static buffers,
  no device-to-host sync; ``cu_seqlens`` is never copied to the GPU by NeMo.
* ``model.config.forward_step_fn`` -> :class:`FastpathForwardStep`: the model gets the cache's
  static ``PackedSeqParams`` and ``attention_mask=None``.
* ``model.config.position_embedding_type`` "rope" -> "none": RoPE comes from the cache (built
  once per batch, from the config's rotary_base / rotary_percent / kv_channels). Llama 3.1 /
  3.2 configs keep "rope": their ``configure_model`` rescales Megatron's rotary module after
  building (computed once, not used); the cache gets the same scaling from the settings.
* ``data.packed_sequence_specs.pad_cu_seqlens = False`` and
  ``data.dataset_kwargs["pad_to_max_length"] = True``: the cache needs a constant token count
  T (= packed_sequence_size) and pads ``cu_seqlens`` to its own static capacity S+1 itself, so
  NeMo's padded ``cu_seqlens`` (and the packing-metadata file it requires) buys nothing.
* CUDA graphs (``enable_cuda_graph``, ``use_te_rng_tracker``), FP8 (``trainer.plugins.fp8`` /
  ``fp8_recipe``, mirrored into ``model.config.fp8``; Transformer Engine linears and experts),
  LoRA target modules (``peft.target_modules``).

Recipes it cannot serve are refused with every reason at once (:class:`RecipeNotSupportedError`);
the rules are :mod:`megatron_fastpath.integrations.core`'s, shared with the Bridge hook.
"""

import dataclasses
import json
from typing import Optional, Sequence

from megatron_fastpath.integrations import core
from megatron_fastpath.integrations._runtime import (
    FastpathLayerSpec,
    FastpathSettings,
    NotSupportedError,
    cache_for,
    host_cu_seqlens,
)

__all__ = [
    "FastpathDataStep",
    "FastpathForwardStep",
    "RecipeNotSupportedError",
    "apply_fastpath",
    "fastpath_forward_step",
    "max_seqlen_from_pack_metadata",
    "max_seqs_from_pack_metadata",
]

_PACKED_KEYS = (
    "cu_seqlens",
    "cu_seqlens_argmin",
    "max_seqlen",
    "cu_seqlens_unpadded",
    "cu_seqlens_unpadded_argmin",
)


class RecipeNotSupportedError(NotSupportedError):
    """The recipe needs something megatron_fastpath does not provide; ``reasons`` lists why."""

    what = "this recipe"


@dataclasses.dataclass(frozen=True)
class FastpathDataStep:
    """NeMo ``GPTConfig.data_step_fn``: ``gpt_data_step`` with the packed boundaries loaded into
    this process's cache from the host instead of copying ``cu_seqlens`` to the device.

    Returns the batch dict NeMo's loss reduction expects (``tokens``, ``labels``, ``loss_mask``
    on the cache's device for the stages that need them) plus ``packed_seq_params`` (the cache
    slot's static params) and ``position_ids`` (the slot's [1, T] buffer)."""

    settings: FastpathSettings

    def __call__(self, dataloader_iter, use_mtp: bool = False) -> dict:
        from megatron.core import parallel_state

        batch = next(dataloader_iter)
        if isinstance(batch, tuple) and len(batch) == 3:  # (batch, batch_idx, dataloader_idx)
            batch = batch[0]
        cache, in_flight = cache_for(self.settings)
        tokens = batch.get("tokens")
        t = cache.config.max_tokens
        if tokens is not None and tuple(tokens.shape) != (1, t):
            raise ValueError(
                f"packed batch tokens have shape {tuple(tokens.shape)}; the cache needs [1, {t}] "
                "(micro_batch_size=1, dataset_kwargs pad_to_max_length=True, "
                f"packed_sequence_size={t})"
            )
        pb = in_flight.acquire(cu_seqlens=host_cu_seqlens(batch))  # host validation, ONE H2D copy

        first = parallel_state.is_pipeline_first_stage() or use_mtp
        last = parallel_state.is_pipeline_last_stage()
        device_keys = ({"tokens"} if first else set()) | ({"labels", "loss_mask"} if last else set())
        out = {key: None for key in batch}
        for key in device_keys:
            out[key] = batch[key].to(cache.device, non_blocking=True)
        for key in _PACKED_KEYS:
            out.pop(key, None)
        out["attention_mask"] = None
        out["position_ids"] = pb.position_ids_1T if first else None
        out["packed_seq_params"] = pb.packed_seq_params
        out["packed_batch"] = pb  # the slot handle the forward step runs on
        return out


@dataclasses.dataclass(frozen=True)
class FastpathForwardStep:
    """NeMo ``GPTConfig.forward_step_fn``: the model call of ``gpt_forward_step`` with the
    cache's static ``PackedSeqParams`` (no ``get_packed_seq_params``, no mask). A dataclass
    rather than a function so NeMo-Run's YAML form of the recipe loads back;
    ``linear_cross_entropy``: ``FastpathSettings.linear_cross_entropy``."""

    linear_cross_entropy: Optional[str] = None

    def __call__(self, model, batch: dict):
        return fastpath_forward_step(model, batch, self.linear_cross_entropy)


def fastpath_forward_step(model, batch: dict, linear_cross_entropy: Optional[str] = None):
    """The forward step as a plain function (see :class:`FastpathForwardStep`): the package's
    one packed forward (:func:`megatron_fastpath.packed_seq.runtime.forward`) on the module NeMo's
    ``GPTModel.forward`` calls. NeMo's ``GPTModel.forward`` (llm/gpt/model/base.py) has no
    ``padding_mask`` argument, so calling it would route the pack's padding tail through the
    MoE experts; its ``module`` (the Megatron ``GPTModel``, possibly inside DDP /
    ``Float16Module``, which pass keyword arguments through) takes it."""
    from megatron_fastpath.packed_seq.runtime import forward

    pb = batch.get("packed_batch")
    if pb is None:
        raise ValueError(
            "the batch has no 'packed_batch': FastpathForwardStep runs on batches made by "
            "FastpathDataStep (set both with megatron_fastpath.integrations.nemo.apply_fastpath)"
        )
    chunked = None if linear_cross_entropy is None else linear_cross_entropy == "chunked"
    return forward(getattr(model, "module", model), pb, batch["tokens"], batch["labels"],
                   linear_cross_entropy=chunked)


def _pack_metadata(path, key: str) -> list:
    with open(path) as f:
        meta = json.load(f)
    if not isinstance(meta, list) or not meta or not all(isinstance(m, dict) and key in m for m in meta):
        raise ValueError(f"{path} is not a NeMo packing metadata file (list of dicts with {key})")
    return meta


def max_seqs_from_pack_metadata(path) -> int:
    """``max_seqs`` for :func:`apply_fastpath` from NeMo's packing metadata JSON (written by
    ``prepare_packed_sequence_data``: one dict per packed split with ``max_samples_per_bin``),
    plus one for the padding chunk a collate without ``token_count`` keeps as a sequence."""
    return max(int(m["max_samples_per_bin"]) for m in _pack_metadata(path, "max_samples_per_bin")) + 1


def max_seqlen_from_pack_metadata(path) -> int:
    """``max_seqlen`` for :func:`apply_fastpath` from the same file: its ``dataset_max_seqlen``
    (the longest tokenized sample; the collate feeds one token less of it) rounded up by
    ``packed_seq.config.seqlen_bound`` and capped at the pack size."""
    from megatron_fastpath.packed_seq.config import seqlen_bound

    meta = _pack_metadata(path, "dataset_max_seqlen")
    return max(seqlen_bound(int(m["dataset_max_seqlen"]), int(m.get("pack_size") or m["dataset_max_seqlen"]))
               for m in meta)


def apply_fastpath(
    recipe,
    *,
    attention_backend: str = "auto",
    packed_cache: bool = True,
    max_seqs: Optional[int] = None,
    max_seqlen: Optional[int] = None,
    cuda_graphs: Optional[bool] = None,
    fp8: Optional[str | bool] = None,
    fp8_recipe: Optional[str] = None,
    lora: Optional[Sequence[str]] = None,
    moe_expert_backend: Optional[str] = None,
    linear_cross_entropy: Optional[str] = None,
):
    """Apply megatron_fastpath to a NeMo-Run recipe (``run.Partial(llm.finetune, ...)``) in place
    and return it.

    Args:
        recipe: a NeMo 2.7 LLM recipe whose ``model`` is a ``GPTModel`` config.
        attention_backend: core attention backend ("auto": te > flash on CUDA, sdpa on CPU).
        packed_cache: swap attention for the cache-reading one (needs ``packed_sequence=True``).
            False keeps Megatron's attention and only swaps the MoE layer (MoE models only).
        max_seqs: static sequences-per-pack capacity S. Default: packed_sequence_size (always
            enough). A tighter S makes the varlen kernels' grids smaller: use
            :func:`max_seqs_from_pack_metadata` once NeMo has packed the data.
        max_seqlen: bound M on the longest sequence (default: packed_sequence_size). The
            kernels' ``max_seqlen`` and the sdpa padded view's rows:
            :func:`max_seqlen_from_pack_metadata` reads it from NeMo's packing metadata.
        cuda_graphs: True sets ``enable_cuda_graph`` (+ ``use_te_rng_tracker``, which NeMo
            requires); False clears it; None keeps the recipe's value.
        fp8: "hybrid" / "e4m3" turns FP8 on in the recipe's ``MegatronMixedPrecision`` plugin,
            False turns it off, None keeps the recipe's. FP8 selects Transformer Engine linears
            and (MoE) the ``te_grouped_linear`` experts.
        fp8_recipe: plugin ``fp8_recipe`` ("delayed", "tensorwise", "mxfp8", "blockwise").
        lora: LoRA target modules (subset of linear_qkv, linear_proj, linear_fc1, linear_fc2)
            for the recipe's LoRA/DoRA; None keeps the recipe's.
        moe_expert_backend: "grouped_mm" / "te_grouped_linear"; default per FP8.
        linear_cross_entropy: the loss: "chunked" (output layer and cross-entropy fused over
            token chunks: no [T, V] logits), "off" (Megatron's), None (the default rule:
            ``rules.linear_cross_entropy_choice``).

    The rules are :mod:`megatron_fastpath.integrations.core`'s (shared with the Bridge hook);
    this function reads the recipe into its facts and writes the plan back.

    Raises:
        RecipeNotSupportedError: every reason the recipe cannot be served (nothing is changed).
        TypeError: ``recipe`` is not a NeMo-Run recipe.
    """
    import fiddle as fdl
    import nemo_run as run

    request = core.HookRequest(
        attention_backend=attention_backend, packed_cache=packed_cache, max_seqs=max_seqs,
        max_seqlen=max_seqlen, cuda_graphs=cuda_graphs, fp8=fp8, fp8_recipe=fp8_recipe, lora=lora,
        moe_expert_backend=moe_expert_backend, linear_cross_entropy=linear_cross_entropy,
    )
    model_cfg = _gpt_model_config(recipe)
    plan = core.decide(_recipe_facts(recipe, model_cfg), request, RecipeNotSupportedError)
    settings = run.Config(FastpathSettings, **plan.settings)
    fdl.build(settings)  # validate the values now, not on the cluster
    _write_plan(recipe, model_cfg, settings, plan, request)
    return recipe


def _gpt_model_config(recipe):
    """The recipe's ``GPTConfig`` (a fiddle config); refuses what is not a GPT recipe."""
    import fiddle as fdl
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.base import GPTConfig

    for name in ("model", "data", "trainer"):
        if not isinstance(recipe, fdl.Buildable) or name not in recipe.__arguments__:
            raise TypeError(
                "apply_fastpath expects a NeMo-Run recipe (run.Partial(llm.finetune, model=..., "
                f"data=..., trainer=...)); got {type(recipe).__name__} without '{name}'"
            )
    model_cls = fdl.get_callable(recipe.model)
    model_cfg = recipe.model.__arguments__.get("config")
    if not (isinstance(model_cls, type) and issubclass(model_cls, llm.GPTModel)) or not isinstance(
        model_cfg, fdl.Buildable
    ):
        raise RecipeNotSupportedError(
            [f"model {getattr(model_cls, '__name__', model_cls)} is not a NeMo GPTModel with a "
             "GPTConfig: megatron_fastpath swaps GPT decoder layers only (T5, Mamba/hybrid and "
             "multimodal models are not supported)"]
        )
    cfg_cls = fdl.get_callable(model_cfg)
    if not (isinstance(cfg_cls, type) and issubclass(cfg_cls, GPTConfig)):
        raise RecipeNotSupportedError(
            [f"model config {getattr(cfg_cls, '__name__', cfg_cls)} is not a GPTConfig (e.g. an "
             "SSM/hybrid config): megatron_fastpath swaps GPT decoder layers only"]
        )
    spec_arg = model_cfg.__arguments__.get("transformer_layer_spec")
    if isinstance(spec_arg, fdl.Buildable) and fdl.get_callable(spec_arg) is FastpathLayerSpec:
        raise RecipeNotSupportedError(["apply_fastpath was already applied to this recipe"])
    return model_cfg


def _recipe_facts(recipe, model_cfg) -> core.ModelFacts:
    """The recipe's facts, read without building (GPTConfig.__post_init__ checks fusions that
    need Transformer Engine, which a CPU submit host does not have)."""
    import fiddle as fdl
    from nemo.collections.llm.gpt.model.base import GPTConfig, default_layer_spec
    from nemo.collections.llm.gpt.model.llama import Llama31Config

    config = _ConfigView(model_cfg)
    strategy, data = recipe.trainer.strategy, recipe.data
    specs = data.__arguments__.get("packed_sequence_specs") if isinstance(data, fdl.Buildable) else None
    precision = _precision_plugin(recipe)
    return core.ModelFacts(
        names=core.NAMES["nemo"],
        model=config,
        **core.model_config_facts(config, fdl.get_callable(model_cfg), "configure_model",
                                  GPTConfig, Llama31Config, default_layer_spec),
        context_parallel_size=strategy.context_parallel_size or 1,
        virtual_pipeline_size=strategy.virtual_pipeline_model_parallel_size,
        pipeline_size=strategy.pipeline_model_parallel_size or 1,
        packed_size=specs.packed_sequence_size if specs is not None else None,
        micro_batch_size=data.micro_batch_size,
        graphs_on=bool(config.enable_cuda_graph),
        has_precision=precision is not None,
        fp8_on=bool(precision is not None and precision.fp8),
        peft=_peft_facts(recipe.__arguments__.get("peft")),
        expert_parallel_size=strategy.expert_model_parallel_size or 1,
    )


def _write_plan(recipe, model_cfg, settings, plan: core.HookPlan, request: core.HookRequest):
    import nemo_run as run

    model_cfg.transformer_layer_spec = run.Config(FastpathLayerSpec, settings=settings)
    if request.packed_cache:
        model_cfg.data_step_fn = run.Config(FastpathDataStep, settings=settings)
        model_cfg.forward_step_fn = run.Config(
            FastpathForwardStep, linear_cross_entropy=plan.settings["linear_cross_entropy"])
        recipe.data.packed_sequence_specs.pad_cu_seqlens = False
        recipe.data.dataset_kwargs = {
            **(recipe.data.__arguments__.get("dataset_kwargs") or {}), "pad_to_max_length": True}
    if plan.position_embedding_type is not None:
        model_cfg.position_embedding_type = plan.position_embedding_type
    if request.cuda_graphs is not None:
        model_cfg.enable_cuda_graph = bool(request.cuda_graphs)
        if request.cuda_graphs:
            model_cfg.use_te_rng_tracker = True
    if plan.graph_warmup_steps is not None:
        model_cfg.cuda_graph_warmup_steps = plan.graph_warmup_steps
    precision = _precision_plugin(recipe)
    if plan.set_fp8 and precision is not None:
        precision.fp8 = plan.fp8
        if request.fp8_recipe is not None:
            precision.fp8_recipe = request.fp8_recipe
    if plan.set_fp8:
        model_cfg.fp8 = plan.fp8
    if request.lora is not None:
        recipe.peft.target_modules = list(request.lora)


def _precision_plugin(recipe):
    """The recipe's ``MegatronMixedPrecision`` plugin config (where NeMo sets FP8), or None."""
    import fiddle as fdl

    plugins = recipe.trainer.__arguments__.get("plugins")
    if isinstance(plugins, fdl.Buildable) and "fp8" in _signature(plugins):
        return plugins
    return None


def _peft_facts(peft) -> Optional[core.PeftFacts]:
    import fiddle as fdl
    from nemo.collections.llm.peft import DoRA, LoRA

    if peft is None:
        return None
    cls = fdl.get_callable(peft) if isinstance(peft, fdl.Buildable) else type(peft)
    supported = isinstance(cls, type) and issubclass(cls, (LoRA, DoRA))
    return core.PeftFacts(
        name=getattr(cls, "__name__", str(cls)),
        supported=supported,
        target_modules=tuple(_ConfigView(peft).target_modules) if supported else (),
    )


class _ConfigView:
    """Attribute access to a fiddle config's values: the set argument, else the dataclass
    default (or ``default_factory()``), else the signature default."""

    def __init__(self, buildable):
        self._buildable = buildable

    def __getattr__(self, name):
        import fiddle as fdl

        b = self.__dict__["_buildable"]
        if name in b.__arguments__:
            return b.__arguments__[name]
        cls = fdl.get_callable(b)
        if dataclasses.is_dataclass(cls):
            for f in dataclasses.fields(cls):
                if f.name == name:
                    if f.default is not dataclasses.MISSING:
                        return f.default
                    if f.default_factory is not dataclasses.MISSING:
                        return f.default_factory()
        try:
            return getattr(b, name)
        except (AttributeError, ValueError) as exc:
            raise AttributeError(name) from exc


def _signature(buildable) -> set:
    import inspect

    import fiddle as fdl

    return set(inspect.signature(fdl.get_callable(buildable)).parameters)
