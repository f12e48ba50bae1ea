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
  once per batch, from the config's rotary_base / rotary_percent / kv_channels).
* ``data.packed_sequence_specs.pad_cu_seqlens = False`` and
  ``data.dataset_kwargs["pad_to_max_length"] = True``: the cache needs a constant token count
  T (= packed_sequence_size) and pads ``cu_seqlens`` to its own static capacity S+1 itself, so
  NeMo's padded ``cu_seqlens`` (and the packing-metadata file it requires) buys nothing.
* CUDA graphs (``enable_cuda_graph``, ``use_te_rng_tracker``), FP8 (``trainer.plugins.fp8`` /
  ``fp8_recipe``, mirrored into ``model.config.fp8``; Transformer Engine linears and experts),
  LoRA target modules (``peft.target_modules``).

Recipes it cannot serve are refused with every reason at once (:class:`RecipeNotSupportedError`).
"""

import dataclasses
import json
from typing import Optional, Sequence

from megatron_fastpath.lora.config import LORA_TARGETS
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
    "max_seqs_from_pack_metadata",
]

_PACKED_KEYS = (
    "cu_seqlens",
    "cu_seqlens_argmin",
    "max_seqlen",
    "cu_seqlens_unpadded",
    "cu_seqlens_unpadded_argmin",
)
_LORA_TARGETS = tuple(LORA_TARGETS)


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
        pb = in_flight.load(host_cu_seqlens(batch))  # host validation, ONE H2D copy

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
        return out


@dataclasses.dataclass(frozen=True)
class FastpathForwardStep:
    """NeMo ``GPTConfig.forward_step_fn``: the model call of ``gpt_forward_step`` with the
    cache's static ``PackedSeqParams`` (no ``get_packed_seq_params``, no mask). A (field-less)
    dataclass rather than a function so NeMo-Run's YAML form of the recipe loads back."""

    def __call__(self, model, batch: dict):
        return fastpath_forward_step(model, batch)


def fastpath_forward_step(model, batch: dict):
    """The forward step as a plain function (see :class:`FastpathForwardStep`)."""
    return model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=None,
        labels=batch["labels"],
        packed_seq_params=batch["packed_seq_params"],
    )


def max_seqs_from_pack_metadata(path) -> int:
    """``max_seqs`` for :func:`apply_fastpath` from NeMo's packing metadata JSON (written by
    ``prepare_packed_sequence_data``: one dict per packed split with ``max_samples_per_bin``),
    plus one for the padding chunk the collate appends as its own ``cu_seqlens`` entry."""
    with open(path) as f:
        meta = json.load(f)
    if not isinstance(meta, list) or not meta or not all("max_samples_per_bin" in m for m in meta):
        raise ValueError(f"{path} is not a NeMo packing metadata file (list of dicts with max_samples_per_bin)")
    return max(int(m["max_samples_per_bin"]) for m in meta) + 1


def apply_fastpath(
    recipe,
    *,
    attention_backend: str = "auto",
    packed_cache: bool = True,
    max_seqs: Optional[int] = None,
    cuda_graphs: Optional[bool] = None,
    fp8: Optional[str | bool] = None,
    fp8_recipe: Optional[str] = None,
    lora: Optional[Sequence[str]] = None,
    moe_expert_backend: Optional[str] = None,
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
        cuda_graphs: True sets ``enable_cuda_graph`` (+ ``use_te_rng_tracker``, which NeMo
            requires); False clears it; None keeps the recipe's value.
        fp8: "hybrid" / "e4m3" turns FP8 on in the recipe's ``MegatronMixedPrecision`` plugin,
            False turns it off, None keeps the recipe's. FP8 selects Transformer Engine linears
            and (MoE) the ``te_grouped_linear`` experts.
        fp8_recipe: plugin ``fp8_recipe`` ("delayed", "tensorwise", "mxfp8", "blockwise").
        lora: LoRA target modules (subset of linear_qkv, linear_proj, linear_fc1, linear_fc2)
            for the recipe's LoRA/DoRA; None keeps the recipe's.
        moe_expert_backend: "grouped_mm" / "te_grouped_linear"; default per FP8.

    Raises:
        RecipeNotSupportedError: every reason the recipe cannot be served (nothing is changed).
        TypeError: ``recipe`` is not a NeMo-Run recipe.
    """
    import fiddle as fdl
    import nemo_run as run
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.base import GPTConfig, default_layer_spec

    for name in ("model", "data", "trainer"):
        if not isinstance(recipe, fdl.Buildable) or name not in recipe.__arguments__:
            raise TypeError(
                "apply_fastpath expects a NeMo-Run recipe (run.Partial(llm.finetune, model=..., "
                f"data=..., trainer=...)); got {type(recipe).__name__} without '{name}'"
            )
    reasons: list[str] = []
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
    # Read values (set or default) without building: GPTConfig.__post_init__ checks fusions
    # that need Transformer Engine, which a CPU submit host does not have.
    config = _ConfigView(model_cfg)
    strategy = recipe.trainer.strategy
    data = recipe.data

    # ---- model
    if getattr(config, "multi_latent_attention", False):
        reasons.append(
            "multi-latent attention (MLA, DeepSeek-style) is not implemented by the packed "
            "cache's core attention; use the recipe without apply_fastpath"
        )
    if config.transformer_layer_spec is not default_layer_spec:
        spec = config.transformer_layer_spec
        reasons.append(
            f"the model uses its own layer spec {getattr(spec, '__qualname__', None) or spec!r} "
            "(e.g. Gemma's softcapping/sliding-window or DeepSeek's MLA/MoE block); "
            "megatron_fastpath replaces NeMo's default GPT layer spec only"
        )
    if cfg_cls.configure_model is not GPTConfig.configure_model:
        what = (
            f"Llama 3.1-style RoPE scaling (scale_factor={config.scale_factor}) is applied to "
            "the model's rotary embedding, which the packed cache's RoPE (linear "
            "seq_len_interpolation_factor only) does not reproduce"
            if hasattr(config, "scale_factor")
            else "its config overrides GPTConfig.configure_model"
        )
        reasons.append(f"{cfg_cls.__name__}: {what}")
    if getattr(config, "window_size", None) is not None:
        reasons.append(f"sliding-window attention (window_size={config.window_size}) is not supported")
    if getattr(config, "mtp_num_layers", None):
        reasons.append("multi-token prediction (mtp_num_layers) is not supported")
    if config.position_embedding_type not in ("rope", "learned_absolute", "none"):
        reasons.append(f"position_embedding_type={config.position_embedding_type!r} is not supported")
    if str(getattr(config.attention_backend, "name", config.attention_backend)) == "local":
        reasons.append(
            "attention_backend=local makes NeMo's configure_model overwrite the core attention "
            "with Megatron's DotProductAttention; leave it at 'auto'"
        )
    num_experts = config.num_moe_experts
    if num_experts:
        reasons += _moe_reasons(config)
    elif not packed_cache:
        reasons.append(
            "packed_cache=False on a dense model leaves nothing for megatron_fastpath to do "
            "(it would only swap the MoE layer)"
        )

    # ---- parallelism
    cp = strategy.context_parallel_size or 1
    if packed_cache and cp > 1:
        reasons.append(
            f"context_parallel_size={cp}: the packed cache serves whole packed sequences per "
            "rank (no CP partitioning); set trainer.strategy.context_parallel_size=1"
        )
    if strategy.virtual_pipeline_model_parallel_size:
        reasons.append(
            "virtual (interleaved) pipeline parallelism: its schedule reorders backward passes "
            "across model chunks, so cache slots cannot be released in call order; set "
            "trainer.strategy.virtual_pipeline_model_parallel_size=None"
        )
    pp = strategy.pipeline_model_parallel_size or 1

    # ---- data
    specs = data.__arguments__.get("packed_sequence_specs") if isinstance(data, fdl.Buildable) else None
    packed_size = specs.packed_sequence_size if specs is not None else -1
    if packed_cache and (packed_size is None or packed_size <= 0):
        reasons.append(
            "packed_cache=True needs packed sequences, but the recipe's data has no "
            "packed_sequence_specs with packed_sequence_size > 0 (build the recipe with "
            "packed_sequence=True, or pass packed_cache=False)"
        )
    if packed_cache and packed_size and packed_size > 0 and data.micro_batch_size != 1:
        reasons.append(f"packed sequences need data.micro_batch_size=1; got {data.micro_batch_size}")

    # ---- graphs, FP8, LoRA
    graphs_on = bool(config.enable_cuda_graph) if cuda_graphs is None else bool(cuda_graphs)
    if graphs_on and getattr(config, "cuda_graph_scope", None) == "full_iteration":
        reasons.append(
            "cuda_graph_scope='full_iteration' would capture the data step, whose host-side "
            "cache.set_batch must run every microbatch; use per-layer graphs"
        )
    plugins = recipe.trainer.__arguments__.get("plugins")
    precision = plugins if isinstance(plugins, fdl.Buildable) and "fp8" in _signature(plugins) else None
    if fp8 not in (None, False) and precision is None:
        reasons.append(
            "fp8 requested but trainer.plugins is not a MegatronMixedPrecision config (NeMo sets "
            "FP8 there); add one, e.g. llm.recipes.precision.mixed_precision.bf16_with_fp8_mixed()"
        )
    if fp8 not in (None, False, "hybrid", "e4m3"):
        reasons.append(f"fp8 must be None, False, 'hybrid' or 'e4m3'; got {fp8!r}")
    fp8_on = bool(precision is not None and precision.fp8) if fp8 is None else fp8 is not False
    peft = recipe.__arguments__.get("peft")
    reasons += _peft_reasons(peft, lora, bool(num_experts))
    if moe_expert_backend is not None and moe_expert_backend not in ("grouped_mm", "te_grouped_linear"):
        reasons.append(f"moe_expert_backend must be 'grouped_mm' or 'te_grouped_linear'; got {moe_expert_backend!r}")
    if max_seqs is not None and packed_size and packed_size > 0 and not (0 < max_seqs <= packed_size):
        reasons.append(f"max_seqs={max_seqs} must be in [1, packed_sequence_size={packed_size}]")

    if reasons:
        raise RecipeNotSupportedError(reasons)

    # ---- apply (all checks passed)
    uses_rope = config.position_embedding_type == "rope"
    max_tokens = packed_size if packed_cache else max(config.seq_length, 1)
    settings = run.Config(
        FastpathSettings,
        max_tokens=max_tokens,
        max_seqs=max_seqs or max_tokens,
        num_slots=pp,
        attention_backend=attention_backend,
        linear_impl="te" if fp8_on else None,
        moe_expert_backend=moe_expert_backend or ("te_grouped_linear" if fp8_on else "grouped_mm"),
        rope=packed_cache and uses_rope,
        packed_cache=packed_cache,
    )
    fdl.build(settings)  # validate the values now, not on the cluster
    model_cfg.transformer_layer_spec = run.Config(FastpathLayerSpec, settings=settings)
    if packed_cache:
        model_cfg.data_step_fn = run.Config(FastpathDataStep, settings=settings)
        model_cfg.forward_step_fn = run.Config(FastpathForwardStep)
        if uses_rope:
            model_cfg.position_embedding_type = "none"
        specs.pad_cu_seqlens = False
        data.dataset_kwargs = {**(data.__arguments__.get("dataset_kwargs") or {}), "pad_to_max_length": True}
    if cuda_graphs is not None:
        model_cfg.enable_cuda_graph = bool(cuda_graphs)
        if cuda_graphs:
            model_cfg.use_te_rng_tracker = True
    if fp8 is not None:
        precision.fp8 = fp8 or None
        if fp8_recipe is not None:
            precision.fp8_recipe = fp8_recipe
        model_cfg.fp8 = fp8 or None
    if lora is not None:
        peft.target_modules = list(lora)
    return recipe


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


def _moe_reasons(config) -> list[str]:
    from megatron_fastpath.moe.config import MoEDispatchConfig

    reasons = []
    if config.moe_shared_expert_intermediate_size:
        reasons.append(
            "shared experts (moe_shared_expert_intermediate_size) are not wired into the fastpath "
            "MoE layer by this hook; use the recipe without apply_fastpath"
        )
    if config.add_bias_linear:
        reasons.append("the fastpath grouped experts have no bias: add_bias_linear must be False")
    if (getattr(config, "expert_tensor_parallel_size", None) or 1) > 1:
        reasons.append("the fastpath grouped experts do not support expert_tensor_parallel_size > 1")
    try:
        MoEDispatchConfig.from_transformer_config(config)
    except ValueError as exc:
        reasons.append(str(exc))
    return reasons


def _peft_reasons(peft, lora, is_moe: bool) -> list[str]:
    import fiddle as fdl
    from nemo.collections.llm.peft import DoRA, LoRA

    if peft is None:
        return ["lora target modules were given but the recipe has no PEFT (peft_scheme=None)"] if lora else []
    cls = fdl.get_callable(peft) if isinstance(peft, fdl.Buildable) else type(peft)
    if not (isinstance(cls, type) and issubclass(cls, (LoRA, DoRA))):
        return [
            f"PEFT scheme {getattr(cls, '__name__', cls)} is not supported (LoRA and DoRA wrap "
            "the attention/MLP linears by name, which the fastpath layer keeps; others are "
            "untested): use peft_scheme='lora', 'dora' or None"
        ]
    targets = list(lora) if lora is not None else list(_ConfigView(peft).target_modules)
    reasons = []
    unknown = [t for t in targets if t not in _LORA_TARGETS]
    if unknown or not targets:
        reasons.append(f"LoRA target modules {unknown or targets} are not among {list(_LORA_TARGETS)}")
    expert = [t for t in targets if t in ("linear_fc1", "linear_fc2")]
    if is_moe and expert:
        reasons.append(
            f"LoRA on {expert} in an MoE model: the fastpath experts are grouped weight tensors, "
            "not per-expert linears; target ['linear_qkv', 'linear_proj'] (NeMo's MoE recipes do)"
        )
    return reasons
