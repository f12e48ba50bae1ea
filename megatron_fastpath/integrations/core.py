"""The framework-neutral core of the NeMo 2 and Megatron-Bridge hooks (imports neither framework).

A hook is a thin adapter over three steps:

1. its framework's config -> :class:`ModelFacts` (what the model, parallelism, data, precision
   and PEFT are; read without building anything) plus the user's :class:`HookRequest`;
2. :func:`refusals` -> every reason megatron_fastpath cannot serve it (one list, all at once);
3. :func:`plan` -> :class:`HookPlan`: the :class:`FastpathSettings` values and the few model
   fields the hook writes back into its framework's config.

The rules a framework recipe shares with the main job (context parallelism, FP8 attention on
packed sequences, what CUDA graphs can capture) are :mod:`megatron_fastpath.rules`'; the
hook-only rules (layer specs, build overrides, PEFT schemes, packed data) live here once, so
the two hooks cannot drift apart. The adapters keep only what is framework-specific: reading
the facts, the type checks of the framework's objects, and writing the plan back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from megatron_fastpath import rules
from megatron_fastpath.integrations._runtime import FastpathSettings
from megatron_fastpath.lora.config import LORA_TARGETS
from megatron_fastpath.moe.config import EXPERT_BACKENDS  # the one list of expert backends
from megatron_fastpath.packed_seq.rope import Llama3RopeScaling
from megatron_fastpath.rules import NAMES  # how each framework spells the settings
from megatron_fastpath.rules import Names as FrameworkNames

__all__ = [
    "FrameworkNames",
    "HookPlan",
    "run_facts",
    "HookRequest",
    "ModelFacts",
    "PeftFacts",
    "NAMES",
    "model_config_facts",
    "decide",
    "plan",
    "refusals",
]

FP8_FORMATS = ("hybrid", "e4m3")
_POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")


@dataclasses.dataclass(frozen=True)
class HookRequest:
    """What the user asked the hook for (arguments of ``apply_fastpath`` /
    ``apply_fastpath_to_config``; see there)."""

    attention_backend: str = "auto"
    packed_cache: bool = True
    max_seqs: Optional[int] = None
    max_seqlen: Optional[int] = None
    cuda_graphs: Optional[bool] = None
    fp8: Any = None  # None (keep), False (off), "hybrid" | "e4m3"
    fp8_recipe: Optional[str] = None
    lora: Optional[Sequence[str]] = None
    moe_expert_backend: Optional[str] = None
    linear_cross_entropy: Optional[str] = None  # "chunked" | "off" | None (the default rule)


@dataclasses.dataclass(frozen=True)
class PeftFacts:
    """The config's PEFT: its class name, whether it is LoRA / DoRA (wraps the linears by
    name, which the fastpath layer keeps) and its target modules."""

    name: str
    supported: bool
    target_modules: tuple


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """Everything the rules read, framework-free.

    model: attribute view of the model config (TransformerConfig fields plus GPTModel's rotary
        fields); missing attributes read as their Megatron defaults.
    custom_layer_spec: name of a layer spec other than the framework's default GPT spec.
    build_override: name of an unknown override of the framework's model-building method.
    llama31_rope: Llama 3.1 scaling that the framework's (known) build override applies to
        Megatron's rotary embedding after building the model (NeMo ``Llama31Config`` / Bridge
        ``Llama31ModelProvider``).
    packed_size: tokens per packed microbatch; None or <= 0 when the data is not packed.
    graphs_on: per-layer CUDA graphs are on in the config now.
    has_precision: the config has a mixed-precision object FP8 can be set on.
    fp8_on: FP8 is on in the config now.
    peft: the PEFT scheme, None without one.
    """

    names: FrameworkNames
    model: Any
    custom_layer_spec: Optional[str]
    build_override: Optional[str]
    llama31_rope: Optional[Llama3RopeScaling]
    context_parallel_size: int
    virtual_pipeline_size: Optional[int]
    pipeline_size: int
    packed_size: Optional[int]
    micro_batch_size: int
    graphs_on: bool
    has_precision: bool
    fp8_on: bool
    peft: Optional[PeftFacts]
    expert_parallel_size: int = 1

    def get(self, name: str, default=None):
        return getattr(self.model, name, default)

    @property
    def is_moe(self) -> bool:
        return bool(self.get("num_moe_experts"))

    @property
    def packed(self) -> bool:
        return self.packed_size is not None and self.packed_size > 0


@dataclasses.dataclass(frozen=True)
class HookPlan:
    """What the hook writes back (only after :func:`refusals` found nothing).

    settings: keyword arguments of :class:`FastpathSettings`.
    position_embedding_type: new value of the model field, None to keep it. "none" when the
        cache applies RoPE; a framework build override that rescales Megatron's rotary
        embedding (Llama 3.1) needs that embedding, so "rope" stays (computed once, unused).
    fp8: the FP8 value to write (None: off) when ``set_fp8``.
    graph_warmup_steps: new ``cuda_graph_warmup_steps`` (None: keep). 0 when the hook turns
        graphs on for LoRA: Megatron 0.16.1's capture warm-up fails with a frozen embedding
        (see :mod:`megatron_fastpath.rules`); the first step runs eagerly before capture.
    """

    settings: dict
    position_embedding_type: Optional[str]
    set_fp8: bool
    fp8: Optional[str]
    graph_warmup_steps: Optional[int] = None


def model_config_facts(model, cls: type, method: str, base: type, llama31: Optional[type],
                       default_spec) -> dict:
    """The :class:`ModelFacts` fields read from the model config ``model`` (an attribute view)
    of class ``cls``, whose framework builds the model with ``cls.<method>`` (``base.<method>``
    is the framework's own GPT build, ``llama31.<method>`` Llama 3.1's RoPE-scaling override)
    and whose default ``transformer_layer_spec`` is ``default_spec``."""
    impl = getattr(cls, method, None)
    is_llama31 = (llama31 is not None and impl is not getattr(base, method)
                  and issubclass(cls, llama31) and impl is getattr(llama31, method))
    spec = model.transformer_layer_spec
    return dict(
        custom_layer_spec=None if spec is default_spec else (
            getattr(spec, "__qualname__", None) or repr(spec)),
        build_override=None if impl is getattr(base, method) or is_llama31 else f"{cls.__name__}.{method}",
        llama31_rope=Llama3RopeScaling(
            model.scale_factor, model.low_freq_factor, model.high_freq_factor,
            model.old_context_len) if is_llama31 else None,
    )


def refusals(facts: ModelFacts, request: HookRequest) -> list[str]:
    """Every reason megatron_fastpath cannot serve this model as requested (empty: it can)."""
    return (
        _model_reasons(facts, request)
        + _parallel_and_data_reasons(facts, request)
        + _feature_reasons(facts, request)
        + _peft_reasons(facts, request)
        + rules.refusals(run_facts(facts, request))
    )


def _graphs_on(facts: ModelFacts, request: HookRequest) -> bool:
    return facts.graphs_on if request.cuda_graphs is None else bool(request.cuda_graphs)


def _fp8_on(facts: ModelFacts, request: HookRequest) -> bool:
    return facts.fp8_on if request.fp8 is None else request.fp8 is not False


def _expert_backend(facts: ModelFacts, request: HookRequest) -> str:
    """The requested expert backend, else FP8 experts through TE's GroupedLinear except in
    captured layers (its host m_splits)."""
    return request.moe_expert_backend or (
        "te_grouped_linear" if _fp8_on(facts, request) and not _graphs_on(facts, request) else "grouped_mm")


def _graph_warmup_steps(facts: ModelFacts, request: HookRequest) -> Optional[int]:
    """The warm-up the hook writes: 0 when it turns graphs on for a PEFT model."""
    return 0 if request.cuda_graphs and facts.peft is not None else None


def run_facts(facts: ModelFacts, request: HookRequest) -> rules.RunFacts:
    """The run the hooked config describes, as the shared rules read it (after the plan's
    write-backs: graphs, FP8, the expert backend, the capture warm-up)."""
    import torch

    graphs = _graphs_on(facts, request)
    warmup = _graph_warmup_steps(facts, request)
    capacity = facts.get("moe_expert_capacity_factor")
    return rules.RunFacts(
        names=facts.names,
        packed_cache=request.packed_cache,
        context_parallel_size=facts.context_parallel_size,
        graphs_requested=graphs,
        graphs_captured=graphs,  # the hooks' frameworks train on GPUs
        graph_warmup_steps=warmup if warmup is not None else int(facts.get("cuda_graph_warmup_steps", 3)),
        lora=facts.peft is not None,
        is_moe=facts.is_moe,
        moe_dropless_ep=facts.is_moe and facts.expert_parallel_size > 1 and capacity is None,
        expert_backend=_expert_backend(facts, request),
        dtype=_model_dtype(facts),
        # no GPU here to ask (a submit host): the hooks plan on the training machine
        capability=torch.cuda.get_device_capability() if torch.cuda.is_available() else None,
        fp8_attention=_fp8_on(facts, request) and bool(facts.get("fp8_dot_product_attention", False)),
        head_dim=_head_dim(facts),
        # "auto" resolves at build (by the dtype): unknown here
        attention_backend=None if request.attention_backend == "auto" else request.attention_backend,
        linear_cross_entropy=request.linear_cross_entropy,
        logit_transforms=_logit_transforms(facts),
        **_fp8_gemm_facts(facts, request),
    )


def _logit_transforms(facts: ModelFacts) -> tuple:
    """What the model config changes the logits by between the output layer and the loss (what
    the chunked linear cross-entropy would skip: ``rules._linear_cross_entropy``)."""
    return tuple(what for what, on in (
        (f"multi-token prediction (mtp_num_layers={facts.get('mtp_num_layers')})", facts.get("mtp_num_layers")),
        ("MuP's logit scaling (use_mup)", facts.get("use_mup", False))) if on)


def _linear_cross_entropy(facts: ModelFacts, request: HookRequest) -> Optional[str]:
    """The forward step's loss (``rules.linear_cross_entropy_choice``): one rank's logits are
    the packed tokens over CP by the vocabulary over TP (None when the config has no vocabulary
    size yet: chosen at the first forward)."""
    tp, vocab = int(facts.get("tensor_model_parallel_size") or 1), facts.get("vocab_size")
    tokens = facts.packed_size // facts.context_parallel_size if facts.packed else None
    return rules.linear_cross_entropy_choice(request.linear_cross_entropy, _logit_transforms(facts),
                                             tokens, -(-int(vocab) // tp) if vocab else None)


def _model_dtype(facts: ModelFacts):
    """The dtype the model's layers compute in (bf16, else the config's params dtype)."""
    import torch

    return torch.bfloat16 if facts.get("bf16") else facts.get("params_dtype") or torch.float32


def _fp8_gemm_facts(facts: ModelFacts, request: HookRequest) -> dict:
    """The FP8 GEMM shapes the rules check (``rules._fp8_gemm_shapes``): FP8's recipe (the
    request's, else the config's, else Megatron's default), each TE GEMM of a layer on one
    tensor-parallel rank and the packed tokens on one context-parallel rank (unknown without
    packed sequences: then not checked)."""
    if not _fp8_on(facts, request):
        return {}
    from megatron_fastpath.fp8.config import te_gemms_of_config

    tp = int(facts.get("tensor_model_parallel_size") or 1)
    te_experts = facts.is_moe and _expert_backend(facts, request) == "te_grouped_linear"
    return dict(
        fp8_recipe=request.fp8_recipe or facts.get("fp8_recipe") or "delayed",
        fp8_gemms=tuple(te_gemms_of_config(facts.model, tp, te_experts)),
        fp8_tokens=facts.packed_size // facts.context_parallel_size if facts.packed_size else None,
    )


def _head_dim(facts: ModelFacts) -> Optional[int]:
    """The attention head width of the framework's model config (kv_channels, else hidden /
    heads, as Megatron's TransformerConfig derives it); None when the config has neither."""
    kv, hidden, heads = (facts.get(k) for k in ("kv_channels", "hidden_size", "num_attention_heads"))
    if kv:
        return int(kv)
    return int(hidden) // int(heads) if hidden and heads else None


def _model_reasons(facts: ModelFacts, request: HookRequest) -> list[str]:
    reasons = []
    if facts.get("multi_latent_attention", False):
        reasons.append(
            "multi-latent attention (MLA, DeepSeek-style) is not implemented by the packed "
            "cache's core attention; use it without megatron_fastpath"
        )
    if facts.custom_layer_spec is not None:
        reasons.append(
            f"the model uses its own layer spec {facts.custom_layer_spec} (e.g. Gemma's "
            "softcapping/sliding-window or DeepSeek's MLA/MoE block); megatron_fastpath replaces "
            "the framework's default GPT layer spec only"
        )
    if facts.build_override is not None:
        reasons.append(
            f"{facts.build_override} overrides how the framework builds the model; "
            "megatron_fastpath serves the framework's own GPT build (and Llama 3.1's)"
        )
    if facts.get("window_size") is not None:
        reasons.append(f"sliding-window attention (window_size={facts.get('window_size')}) is not supported")
    if facts.get("mtp_num_layers"):
        reasons.append("multi-token prediction (mtp_num_layers) is not supported")
    pe = facts.get("position_embedding_type", "learned_absolute")
    if pe not in _POSITION_EMBEDDINGS:
        reasons.append(
            f"position_embedding_type={pe!r} is not supported (the packed cache's RoPE is "
            "Megatron's 'rope', with Llama 3.1 scaling)"
        )
    backend = facts.get("attention_backend", "auto")
    if str(getattr(backend, "name", backend)) == "local":
        reasons.append(
            "attention_backend=local makes the framework overwrite the core attention with "
            "Megatron's DotProductAttention; leave it at 'auto'"
        )
    if facts.is_moe:
        reasons += _moe_reasons(facts)
    elif not request.packed_cache:
        reasons.append(
            "packed_cache=False on a dense model leaves nothing for megatron_fastpath to do "
            "(it would only swap the MoE layer)"
        )
    return reasons


def _moe_reasons(facts: ModelFacts) -> list[str]:
    from megatron_fastpath.moe.config import MoEDispatchConfig

    reasons = []
    if facts.get("moe_shared_expert_intermediate_size"):
        reasons.append(
            "shared experts (moe_shared_expert_intermediate_size) are not wired into the "
            "fastpath MoE layer by the hooks; use the model without megatron_fastpath"
        )
    if facts.get("add_bias_linear", True):
        reasons.append("the fastpath grouped experts have no bias: add_bias_linear must be False")
    if (facts.get("expert_tensor_parallel_size") or 1) > 1:
        reasons.append("the fastpath grouped experts do not support expert_tensor_parallel_size > 1")
    if facts.get("overlap_moe_expert_parallel_comm", False):
        reasons.append(
            "overlap_moe_expert_parallel_comm needs schedule plans of Megatron's own MoE layer; "
            "turn it off"
        )
    try:
        MoEDispatchConfig.from_transformer_config(facts.model)
    except ValueError as exc:
        reasons.append(str(exc))
    return reasons


def _parallel_and_data_reasons(facts: ModelFacts, request: HookRequest) -> list[str]:
    import torch

    reasons, names = [], facts.names
    if facts.virtual_pipeline_size:
        reasons.append(
            "virtual (interleaved) pipeline parallelism: its schedule reorders backward passes "
            "across model chunks, so cache slots cannot be released in call order; set "
            f"{names.virtual_pipeline}=None"
        )
    if request.packed_cache and not facts.packed:
        reasons.append(
            f"packed_cache=True needs packed sequences, but {names.config}'s data has no "
            f"packed-sequence specs with packed_sequence_size > 0 ({names.packing})"
        )
    if request.packed_cache and facts.packed and facts.micro_batch_size != 1:
        reasons.append(
            f"packed sequences need {names.micro_batch_size}=1; got {facts.micro_batch_size}"
        )
    if not request.packed_cache and facts.context_parallel_size > 1 and not _fp8_on(facts, request):
        # without the cache the layer spec keeps Megatron's attention; its linears are TE's only
        # with FP8 (plan: linear_impl), else Megatron's local DotProductAttention, which asserts
        # CP == 1 at build (megatron/core/transformer/dot_product_attention.py:57-59)
        reasons.append(
            f"{names.context_parallel}={facts.context_parallel_size} with packed_cache=False "
            "and FP8 off: the layer spec keeps Megatron's attention with local linears, whose "
            "DotProductAttention runs no context parallelism (it asserts context_parallel_size "
            f"== 1 at build); turn FP8 on (Transformer Engine's attention runs CP) or set "
            f"{names.context_parallel}=1"
        )
    elif not request.packed_cache and facts.context_parallel_size > 1 and _model_dtype(facts) == torch.float32:
        # FP8 on: Megatron's TEDotProductAttention. TE 2.10 runs CP on FlashAttention and
        # FusedAttention only, both fp16 / bf16; its fp32 backend (unfused) has no CP
        # (attention/dot_product_attention/utils.py:762-766): "No dot product attention backend"
        reasons.append(
            f"{names.context_parallel}={facts.context_parallel_size} with packed_cache=False in "
            "float32: Transformer Engine's attention has no context-parallel backend for float32 "
            "inputs (its unfused fp32 attention runs no CP; flash / cuDNN attention take fp16 / "
            f"bf16), so the first forward would stop; train in bf16 or set {names.context_parallel}=1"
        )
    if request.max_seqs is not None and facts.packed and not 0 < request.max_seqs <= facts.packed_size:
        reasons.append(
            f"max_seqs={request.max_seqs} must be in [1, packed_sequence_size={facts.packed_size}]"
        )
    if request.max_seqlen is not None and facts.packed and not 0 < request.max_seqlen <= facts.packed_size:
        reasons.append(
            f"max_seqlen={request.max_seqlen} must be in [1, packed_sequence_size={facts.packed_size}]"
        )
    return reasons


def _feature_reasons(facts: ModelFacts, request: HookRequest) -> list[str]:
    reasons = []
    graphs_on = _graphs_on(facts, request)
    if graphs_on and facts.get("cuda_graph_scope") == "full_iteration":
        reasons.append(
            "cuda_graph_scope='full_iteration' would capture the data step, whose host-side "
            "cache.set_batch must run every microbatch; use per-layer graphs"
        )
    if request.fp8 not in (None, False) and not facts.has_precision:
        reasons.append(f"fp8 requested but {facts.names.precision}")
    if request.fp8 not in (None, False) + FP8_FORMATS:
        reasons.append(f"fp8 must be None, False, 'hybrid' or 'e4m3'; got {request.fp8!r}")
    if request.attention_backend in ("te", "flash"):  # auto resolves by the dtype at build
        import torch

        from megatron_fastpath.attention.backend import check_backend_dtype

        try:  # the hooks' frameworks train on GPUs: the layer spec would refuse it at build
            check_backend_dtype(request.attention_backend, torch.device("cuda"), run_facts(facts, request).dtype)
        except ValueError as exc:
            reasons.append(str(exc))
    if request.linear_cross_entropy not in (None, "chunked", "off"):
        reasons.append(f"linear_cross_entropy must be 'chunked', 'off' or None; got {request.linear_cross_entropy!r}")
    elif request.linear_cross_entropy == "chunked" and not request.packed_cache:
        reasons.append("linear_cross_entropy='chunked' with packed_cache=False: the chunked loss runs "
                       "in the hook's forward step, which only the packed cache installs; use "
                       "packed_cache=True or linear_cross_entropy='off'")
    if request.moe_expert_backend not in (None,) + EXPERT_BACKENDS:
        reasons.append(
            f"moe_expert_backend must be 'grouped_mm' or 'te_grouped_linear'; got {request.moe_expert_backend!r}"
        )
    return reasons


def _peft_reasons(facts: ModelFacts, request: HookRequest) -> list[str]:
    peft = facts.peft
    if peft is None:
        if request.lora:
            return [f"LoRA target modules were given but {facts.names.config} has no PEFT ({facts.names.no_peft})"]
        return []
    if not peft.supported:
        return [
            f"PEFT scheme {peft.name} is not supported (LoRA and DoRA wrap the attention/MLP "
            "linears by name, which the fastpath layer keeps; others are untested): use LoRA, "
            "DoRA or none"
        ]
    targets = list(request.lora) if request.lora is not None else list(peft.target_modules)
    reasons = []
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        reasons.append(f"LoRA target modules {unknown or targets} are not among {list(LORA_TARGETS)}")
    expert = [t for t in targets if t in ("linear_fc1", "linear_fc2")]
    if facts.is_moe and expert:
        reasons.append(
            f"LoRA on {expert} in an MoE model: the fastpath experts are grouped weight tensors, "
            "not per-expert linears; target ['linear_qkv', 'linear_proj'] (NeMo's MoE recipes do)"
        )
    return reasons


def decide(facts: ModelFacts, request: HookRequest, error: type) -> HookPlan:
    """:func:`plan`, or ``error(reasons)`` with every reason of :func:`refusals`."""
    reasons = refusals(facts, request)
    if reasons:
        raise error(reasons)
    return plan(facts, request)


def plan(facts: ModelFacts, request: HookRequest) -> HookPlan:
    """The settings and model-field changes for a config :func:`refusals` accepted."""
    uses_rope = facts.get("position_embedding_type") == "rope"
    rope_in_cache = request.packed_cache and uses_rope
    max_tokens = facts.packed_size if request.packed_cache else max(facts.get("seq_length", 1), 1)
    settings = dict(
        max_tokens=max_tokens,
        max_seqs=request.max_seqs or max_tokens,
        max_seqlen=request.max_seqlen,
        num_slots=facts.pipeline_size,
        attention_backend=request.attention_backend,
        linear_impl="te" if _fp8_on(facts, request) else None,
        moe_expert_backend=_expert_backend(facts, request),
        rope=rope_in_cache,
        packed_cache=request.packed_cache,
        linear_cross_entropy=_linear_cross_entropy(facts, request) if request.packed_cache else "off",
    )
    if rope_in_cache:
        settings.update(FastpathSettings.llama3_fields(facts.llama31_rope))
    keep_megatron_rope = facts.llama31_rope is not None  # its build override rescales it
    return HookPlan(
        settings=settings,
        position_embedding_type="none" if rope_in_cache and not keep_megatron_rope else None,
        set_fp8=request.fp8 is not None,
        fp8=request.fp8 or None,
        graph_warmup_steps=_graph_warmup_steps(facts, request),
    )
