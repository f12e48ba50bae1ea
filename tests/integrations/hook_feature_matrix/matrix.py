"""The matrix of :mod:`tests.integrations.hook_feature_matrix` (generator, classifier, runner; the package docstring
describes it): ``tests/integrations/test_hook_feature_matrix.py`` tests it, ``doc.py`` renders its page.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import inspect
import os
import re
import textwrap
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

import torch

from tests.support.matrix import FULL_ENV, NA, Combination, pairwise_cover

REPO = Path(__file__).resolve().parents[3]

DOC = REPO / "docs" / "hook-feature-matrix.md"

T = 32  # packed_sequence_size of the matrix's data

UNSUPPORTED_PEFT = "CanonicalLoRA"  # a PEFT scheme the hooks do not serve (PeftFacts.supported=False)


@dataclasses.dataclass(frozen=True)
class Axis:
    """One dimension: its values, where they come from, whether it applies to a partial
    combination (the axes before it) and which values it may take there."""

    name: str
    values: tuple
    source: str
    applies: Callable[[dict], bool] = lambda c: True
    allowed: Callable[[dict, object], bool] = lambda c, v: True
    # a value refused on its own (whatever the other settings): the axes after it keep their
    # first value (checked: test_lone_refusals_refuse_every_accepted_combination)
    alone: Callable[[dict, object], bool] = lambda c, v: False


def _parallel_sizes() -> tuple:
    """The parallel sizes the hooks read: ModelFacts' size fields of a parallelism, plus the
    model config's tensor-parallel size (read through ``ModelFacts.model``)."""
    from megatron_fastpath.integrations import core

    names = [f.name for f in dataclasses.fields(core.ModelFacts)
             if f.name.endswith("_size") and ("parallel" in f.name or "pipeline" in f.name)]
    return ("tensor_model_parallel_size",) + tuple(names)


def _layouts() -> tuple:
    """All sizes 1, or one parallel size 2 (a virtual pipeline needs a pipeline of 2 as well)."""
    return ("1",) + tuple(f"{n}=2" for n in _parallel_sizes())


def _lora_requests() -> tuple:
    """None (keep the PEFT's targets), the attention linears, every LoRA target."""
    from megatron_fastpath.lora.config import LORA_TARGETS

    attention = tuple(t for t, (where, _) in LORA_TARGETS.items() if where == "self_attention")
    return (None, attention, tuple(LORA_TARGETS))


def _capabilities() -> tuple:
    """No GPU to ask (a submit host), and the compute capabilities the grouped_mm check names."""
    return (None, (9, 0), (8, 0))


def _graphs(c: dict) -> bool:
    return c["graphs_on"] if c["cuda_graphs"] is None else bool(c["cuda_graphs"])


def _fp8(c: dict) -> bool:
    return c["fp8_on"] if c["fp8"] is None else c["fp8"] is not False


@functools.lru_cache(maxsize=None)
def axes() -> tuple:
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fastpath.attention.core_attention import BACKENDS
    from megatron_fastpath.integrations import core
    from megatron_fastpath.moe.config import EXPERT_BACKENDS
    from megatron_fastpath.train.config import DTYPES

    moe = lambda c: c["model"] == "moe"  # noqa: E731
    warmup = TransformerConfig.__dataclass_fields__["cuda_graph_warmup_steps"].default
    return (
        # ---- the framework config (ModelFacts) and the request's switches the rules read first
        Axis("model", ("dense", "moe"), "`ModelFacts.is_moe` (num_moe_experts)"),
        Axis("dispatch", ("dropless", "capacity"), "`moe_expert_capacity_factor` (None | 1.5)", moe),
        Axis("dtype", tuple(DTYPES), "`train.config.DTYPES` (the config's bf16 / params_dtype)"),
        Axis("packed_cache", (True, False), "`HookRequest.packed_cache`",
             alone=lambda c, v: v is False and not moe(c)),
        Axis("layout", _layouts(), "`ModelFacts.*parallel*_size` / `*pipeline*_size` + "
             "`tensor_model_parallel_size`: all 1, or one of them 2",
             allowed=lambda c, v: moe(c) or not v.startswith("expert"),
             # Megatron's expert_tensor_parallel_size follows the tensor-parallel size
             alone=lambda c, v: v.startswith("virtual") or (v.startswith("context") and c["packed_cache"])
             or (v.startswith("tensor") and moe(c))),
        Axis("data", ("packed", "unpacked"), "`ModelFacts.packed_size` (T | None)",
             alone=lambda c, v: v == "unpacked" and c["packed_cache"]),
        Axis("peft", (None, "LoRA", UNSUPPORTED_PEFT), "`ModelFacts.peft` (None, supported, not)",
             alone=lambda c, v: v == UNSUPPORTED_PEFT),
        Axis("lora", _lora_requests(), "`HookRequest.lora`: None, attention / all `LORA_TARGETS`",
             alone=lambda c, v: v is not None and (c["peft"] is None or (moe(c) and "linear_fc1" in v))),
        # ---- the rest of the request, and the config's values it overrides
        Axis("attention", ("auto",) + tuple(BACKENDS), "`core_attention.BACKENDS` + auto",
             lambda c: c["packed_cache"]),
        Axis("cuda_graphs", (None, True, False), "`HookRequest.cuda_graphs`"),
        Axis("graphs_on", (False, True), "`ModelFacts.graphs_on` (read when cuda_graphs=None)",
             lambda c: c["cuda_graphs"] is None),
        Axis("fp8", (None, False) + tuple(core.FP8_FORMATS), "None, False + `core.FP8_FORMATS`"),
        Axis("fp8_on", (False, True), "`ModelFacts.fp8_on` (read when fp8=None)",
             lambda c: c["fp8"] is None),
        # what does not depend on the format is crossed with the first format only
        Axis("has_precision", (True, False), "`ModelFacts.has_precision`",
             lambda c: c["fp8"] == core.FP8_FORMATS[0], alone=lambda c, v: v is False),
        Axis("fp8_attention", (False, True), "`fp8_dot_product_attention` (with FP8 on)",
             lambda c: _fp8(c) and c["fp8"] in (None, core.FP8_FORMATS[0]),
             alone=lambda c, v: v is True and c["packed_cache"]),
        Axis("experts", (None,) + tuple(EXPERT_BACKENDS), "None + `moe.config.EXPERT_BACKENDS`", moe),
        Axis("gpu", _capabilities(), "`torch.cuda.get_device_capability()` (None: no GPU)",
             lambda c: moe(c) and _graphs(c)),
        Axis("graph_warmup", (warmup, 0), "`cuda_graph_warmup_steps` (Megatron's default, 0)",
             lambda c: c["peft"] == "LoRA" and c["cuda_graphs"] is None and c["graphs_on"]),
        # the loss reads the model's shape, the layout, PEFT and dtype: crossed with the first
        # attention / graphs / FP8 values only (its refusal without the cache: ONE_AWAY)
        Axis("linear_cross_entropy", (None, "chunked", "off"), "`HookRequest.linear_cross_entropy`",
             lambda c: c["packed_cache"] and c["attention"] == "auto" and c["cuda_graphs"] is None
             and not c["graphs_on"] and c["fp8"] is None and not c["fp8_on"]),
    )


@dataclasses.dataclass(frozen=True)
class Combo(Combination):
    """One combination of a hook request and the model facts (:func:`axes`)."""

    @classmethod
    def axes(cls) -> tuple:
        return axes()

    @property
    def label(self) -> str:
        c = dict(self.items())
        parts = [c["model"] + ("" if c["dispatch"] is NA else f"/{c['dispatch']}")
                 + ("" if c["experts"] in (NA, None) else f"/{c['experts']}"),
                 {"float32": "fp32", "bfloat16": "bf16"}.get(c["dtype"], c["dtype"])]
        parts.append(c["attention"] if c["packed_cache"] else "no-cache")
        if c["data"] != "packed":
            parts.append("unpacked")
        if c["peft"]:
            parts.append(c["peft"] + ("" if c["lora"] is None else f"{list(c['lora'])}"))
        elif c["lora"] is not None:
            parts.append(f"lora{list(c['lora'])}")
        graphs = {None: "graphs=cfg", True: "graphs", False: "graphs=off"}[c["cuda_graphs"]]
        if c["cuda_graphs"] is not None or c["graphs_on"]:
            parts.append(graphs + ("" if c["graph_warmup"] is NA else f"(w{c['graph_warmup']})"))
        if c["gpu"] is not NA:
            parts.append("no-gpu" if c["gpu"] is None else "sm%d%d" % c["gpu"])
        if c["fp8"] is not None or c["fp8_on"]:
            parts.append(f"fp8={'cfg' if c['fp8'] is None else c['fp8']}"
                         + ("+attn" if c["fp8_attention"] is True else "")
                         + ("/no-precision" if c["has_precision"] is False else ""))
        if c["layout"] != "1":
            parts.append(_layout_label(c["layout"]))
        if c["linear_cross_entropy"] not in (NA, None):
            parts.append(f"lce={c['linear_cross_entropy']}")
        return " ".join(parts)


def _layout_label(value: str) -> str:
    return value if value == "1" else "".join(w[0].upper() for w in value.split("=")[0].split("_")[:-1])[:2] + "2"


def _choices(axis: Axis, c: dict, lone: bool) -> tuple:
    if not axis.applies(c):
        return (NA,)
    values = tuple(v for v in axis.values if axis.allowed(c, v))
    return values[:1] if lone else values


@functools.lru_cache(maxsize=None)
def combinations() -> tuple:
    """The product of the axes (``NA`` where an axis does not apply; after a value refused on
    its own, the first value of every later axis)."""
    partial = [({}, False)]
    for axis in axes():
        partial = [(dict(c, **{axis.name: v}), lone or axis.alone(c, v)) for c, lone in partial
                   for v in _choices(axis, c, lone)]
    return tuple(Combo(tuple(c[a.name] for a in axes())) for c, _ in partial)


def lone_value(combo: Combo) -> Optional[tuple]:
    """(axis, value) of the combination's value refused on its own, None without one."""
    c = {}
    for axis, (name, v) in zip(axes(), combo.items()):
        if v is not NA and axis.alone(c, v):
            return name, v
        c[name] = v
    return None


@functools.lru_cache(maxsize=None)
def model_config(model: str, dispatch, dtype: str, tp: int, fp8_attention: bool, warmup, ep: int = 1,
                 pp: int = 1, cp: int = 1):
    """The model config the framework holds (a Megatron TransformerConfig with GPTModel's
    rotary fields, as NeMo's GPTConfig / Bridge's GPTModelProvider carry them; with the
    pipeline and context-parallel sizes the framework writes into it, and ``pipeline_dtype``: the model dtype)."""
    from megatron_fastpath.model import ModelConfig, build_transformer_config

    moe = model == "moe"
    shape = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=64, vocab_size=64, num_experts=4 if moe else None,
                        moe_ffn_hidden_size=32 if moe else None)
    extra = {}
    if dispatch == "capacity":
        extra.update(moe_expert_capacity_factor=1.5, moe_token_drop_policy="probs")
    if warmup is not NA:
        extra.update(cuda_graph_warmup_steps=warmup)
    config = build_transformer_config(shape, params_dtype=getattr(torch, dtype),
                                      tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                      pipeline_model_parallel_size=pp, context_parallel_size=cp,
                                      fp8_dot_product_attention=fp8_attention is True, **extra)
    config.position_embedding_type = "rope"
    return config


def facts_and_request(combo: Combo, names=None):
    from megatron_fastpath import rules
    from megatron_fastpath.integrations import core

    c = dict(combo.items())
    sizes = dict.fromkeys(_parallel_sizes(), 1)
    if c["layout"] != "1":
        sizes[c["layout"].split("=")[0]] = 2
    if sizes["virtual_pipeline_size"] == 2:
        sizes["pipeline_size"] = 2
    model = model_config(c["model"], c["dispatch"], c["dtype"], sizes["tensor_model_parallel_size"],
                         c["fp8_attention"], c["graph_warmup"], sizes["expert_parallel_size"],
                         sizes["pipeline_size"], sizes["context_parallel_size"])
    peft = None if c["peft"] is None else core.PeftFacts(
        c["peft"], c["peft"] == "LoRA", _lora_requests()[1])
    facts = core.ModelFacts(
        names=names or rules.NAMES["bridge"], model=model, custom_layer_spec=None, build_override=None,
        llama31_rope=None, context_parallel_size=sizes["context_parallel_size"],
        virtual_pipeline_size=sizes["virtual_pipeline_size"] if sizes["virtual_pipeline_size"] > 1 else None,
        pipeline_size=sizes["pipeline_size"], packed_size=T if c["data"] == "packed" else None,
        micro_batch_size=1, graphs_on=c["graphs_on"] is True, has_precision=c["has_precision"] is not False,
        fp8_on=c["fp8_on"] is True, peft=peft, expert_parallel_size=sizes["expert_parallel_size"])
    request = core.HookRequest(
        attention_backend=c["attention"] if c["attention"] is not NA else "auto",
        packed_cache=c["packed_cache"], cuda_graphs=c["cuda_graphs"], fp8=c["fp8"],
        lora=c["lora"], moe_expert_backend=None if c["experts"] is NA else c["experts"],
        linear_cross_entropy=None if c["linear_cross_entropy"] is NA else c["linear_cross_entropy"])
    return facts, request


def world_size(combo: Combo) -> int:
    return 1 if combo["layout"] == "1" else 2


def _template(node) -> Optional[str]:
    """A regex of the string an expression of core.py builds (f-string holes match anything)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(re.escape(v.value) if isinstance(v, ast.Constant) else ".*?" for v in node.values)
    return None


def _literal_head(node) -> str:
    if isinstance(node, ast.Constant):
        return node.value
    parts = [v.value if isinstance(v, ast.Constant) else "{}" for v in node.values]
    return "".join(parts)


@functools.lru_cache(maxsize=None)
def hook_messages() -> dict:
    """{kind: regex} of every reason the hook-only checks of core.py write (the string
    arguments of ``reasons.append`` / ``reasons += [...]`` / ``return [...]`` in its
    ``_*_reasons`` functions), plus the ValueErrors ``MoEDispatchConfig`` raises (core.py
    appends them as they are). A kind is the function and the message's start."""
    from megatron_fastpath.integrations import core
    from megatron_fastpath.moe import config as moe_config

    out = {}

    def add(where, node):
        regex = _template(node)
        if regex is not None:
            head = re.sub(r"\s+", " ", _literal_head(node))
            out[f"{where}: {head[:70]}{'...' if len(head) > 70 else ''}"] = re.compile(regex, re.S)

    for fn in ast.parse(inspect.getsource(core)).body:
        if isinstance(fn, ast.FunctionDef) and fn.name.endswith("_reasons"):
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "append" and node.args):
                    add(fn.name, node.args[0])
                elif isinstance(node, (ast.Return, ast.AugAssign)) and isinstance(node.value, ast.List):
                    for elt in node.value.elts:
                        add(fn.name, elt)
    from megatron_fastpath.attention import backend as attention_backend

    # the ValueErrors core.py appends as they are: MoEDispatchConfig's, and the attention
    # backend x dtype check the layer spec would apply at build (check_backend_dtype)
    for where, obj in (("MoEDispatchConfig", moe_config.MoEDispatchConfig),
                       ("check_backend_dtype", attention_backend.check_backend_dtype)):
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(obj)))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                add(where, node.exc.args[0])
    return out


def message_kind(reason: str) -> Optional[str]:
    return next((k for k, rx in hook_messages().items() if rx.fullmatch(reason)), None)


REFUSED, BUILD, WORLD2, RUN, RUN_TE, RUN2, RUN2_TE = (
    "refused by the hook", "accepted by the hook, refused when the model is built",
    "accepted: needs 2 processes, not run", "run (world 1)",
    "run (world 1) on the fake Transformer Engine, in a child process",
    "run (world 2), in a 2-process child",
    "run (world 2) on the fake Transformer Engine, in a 2-process child")

STATUSES = (REFUSED, BUILD, WORLD2, RUN, RUN_TE, RUN2, RUN2_TE)

RUN_STATUSES = {RUN: "w1", RUN_TE: "w1-te", RUN2: "w2", RUN2_TE: "w2-te"}  # and their keys

# the layouts of 2 processes the runner runs: TP / EP the same packed batch on both ranks, one
# forward + backward; PP Megatron's pipeline schedule (run_pipelined); CP the framework's CP
# split of the batch (run_context_parallel). The virtual pipeline is refused by the hooks
# whatever the rest.
RUN_LAYOUTS = ("tensor_model_parallel_size=2", "expert_parallel_size=2", "pipeline_size=2",
               "context_parallel_size=2")

# of them, those run through Megatron's pipeline schedule (run_pipelined)
PIPELINE_LAYOUTS = ("pipeline_size=2",)

# of them, those of context parallelism (run_context_parallel)
CP_LAYOUTS = ("context_parallel_size=2",)


def world2_limit(combo: Combo) -> Optional[str]:
    """Why an accepted combination of 2 processes is not run here (None: it is)."""
    layout = combo["layout"]
    if layout in RUN_LAYOUTS:
        return None
    return f"`{layout}`: the runner has no such layout"  # none accepted (test_classification_...)


def te_need(settings: dict, linear_impl: str, is_moe: bool) -> Optional[str]:
    """What of Transformer Engine beyond its attention (which the in-process stand-ins cover)
    an accepted plan builds: those combinations run in a child process that imports the fake
    TE 2.10 (``tests/support/fake_te``; the pytest process never imports TE)."""
    needs = []
    if linear_impl == "te":
        why = "FP8" if settings["linear_impl"] == "te" else "the 'te' attention backend's default"
        needs.append(f"{why}: Transformer Engine linears (`linear_impl=te`)")
    if is_moe and settings["moe_expert_backend"] == "te_grouped_linear":
        needs.append("the te_grouped_linear experts (Transformer Engine's GroupedLinear)")
    return "; ".join(needs) or None


def build_checks(combo: Combo, settings: dict) -> tuple:
    """(resolved attention backend, linear impl) the layer spec builds on the training GPU
    (``core_attention.resolve_backend`` on a CUDA device with the model dtype, as
    ``get_fastpath_layer_spec`` calls it; flash-attn / TE attention from the stand-ins), or
    raises what the build raises."""
    if not settings["packed_cache"]:
        return "megatron", settings["linear_impl"] or "local"
    out = _resolved(settings["attention_backend"], combo["dtype"], te_installed(combo, settings))
    if isinstance(out, Exception):
        raise out
    return out, settings["linear_impl"] or ("te" if out == "te" else "local")


def te_installed(combo: Combo, settings: dict) -> bool:
    """Whether the GPU machine of the combination has Transformer Engine installed: where the
    plan builds TE's linears (FP8) or its GroupedLinear, it must; elsewhere the matrix's machine
    has flash-attn and not TE (so ``auto`` resolves there as without TE; the same combinations
    on a machine with TE are the ones where ``auto`` picks te and so builds TE linears)."""
    return settings["linear_impl"] == "te" or (
        combo["model"] == "moe" and settings["moe_expert_backend"] == "te_grouped_linear")


@functools.lru_cache(maxsize=None)
def _resolved(backend: str, dtype: str, te: bool = False):
    """The backend resolve_backend picks inside the GPU stand-ins, or the ValueError it raises
    (``te``: Transformer Engine installed, as ``_optional.have`` sees it; else not)."""
    from megatron_fastpath import _optional
    from megatron_fastpath.attention.core_attention import resolve_backend
    from tests.support.graph_safe_standins import gpu_standins

    real = _optional.have

    def have(name: str) -> bool:
        return te if name.split(".")[0] == "transformer_engine" else real(name)

    with gpu_standins(), mock.patch.object(_optional, "have", have):
        try:
            return resolve_backend(backend, torch.device("cuda"), T, None, getattr(torch, dtype))
        except ValueError as exc:
            return exc


@dataclasses.dataclass(frozen=True)
class Verdict:
    status: str
    reasons: tuple = ()  # every reason, in core.refusals order
    kinds: tuple = ()  # the kind of each reason: a hook_messages() key or a rules.RULES name
    facts: object = None  # the RunFacts the hook hands the rules
    plan: object = None
    why: str = ""  # WORLD2: why it is not run here; RUN_TE / RUN2_TE: what of TE it builds
    problem: Optional[str] = None  # the contract is broken (a test failure)


_CAPABILITY = [None]  # the stand-in GPU of the combination being classified


def classify(combo: Combo) -> Verdict:
    """``core.refusals`` / ``core.plan`` of the combination (call inside :func:`_gpu`)."""
    from megatron_fastpath import rules
    from megatron_fastpath.integrations import core
    from megatron_fastpath.integrations._runtime import FastpathSettings

    _CAPABILITY[0] = None if combo["gpu"] is NA else combo["gpu"]
    facts, request = facts_and_request(combo)
    reasons = core.refusals(facts, request)
    run = core.run_facts(facts, request)
    shared = rules.refusals(run)
    fired = tuple(r.__name__ for r in rules.RULES if r(run))
    own = reasons[:len(reasons) - len(shared)]
    kinds = tuple(message_kind(r) for r in own) + fired
    problem = None
    if shared and reasons[len(own):] != shared:
        problem = f"the rules' reasons {shared} are not the last of {reasons}"
    elif None in kinds:
        problem = f"a reason core.py does not write: {own[kinds.index(None)]!r}"
    if reasons:
        try:
            core.decide(facts, request, ValueError)
            problem = problem or "decide accepted what refusals refuses"
        except ValueError as exc:
            problem = problem or (None if exc.args[0] == reasons else f"decide raised {exc}")
        return Verdict(REFUSED, tuple(reasons), kinds, run, problem=problem)
    plan = core.plan(facts, request)
    try:
        FastpathSettings(**plan.settings)
    except ValueError as exc:
        problem = f"the plan's settings are refused: {exc}"
    try:
        backend, linear_impl = build_checks(combo, plan.settings)
    except ValueError as exc:
        return Verdict(BUILD, facts=run, plan=plan, why=str(exc), problem=problem)
    two = world_size(combo) > 1
    limit = world2_limit(combo) if two else None
    if limit:
        return Verdict(WORLD2, facts=run, plan=plan, problem=problem, why=limit)
    te = te_need(plan.settings, linear_impl, combo["model"] == "moe")
    status = {(False, False): RUN, (False, True): RUN_TE, (True, False): RUN2, (True, True): RUN2_TE}[two, bool(te)]
    return Verdict(status, facts=run, plan=plan, why=te or "", problem=problem)


def _gpu():
    """torch.cuda as the combination's stand-in GPU sees it (``_CAPABILITY``)."""
    from contextlib import ExitStack

    stack = ExitStack()
    stack.enter_context(mock.patch.object(torch.cuda, "is_available", lambda: _CAPABILITY[0] is not None))
    stack.enter_context(mock.patch.object(torch.cuda, "get_device_capability",
                                          lambda device=None: _CAPABILITY[0]))
    return stack


@functools.lru_cache(maxsize=None)
def classified() -> dict:
    """{Combo: Verdict} of the whole product (~0.2 ms a combination) with the combination's GPU."""
    with _gpu():
        return {c: classify(c) for c in combinations()}


@functools.lru_cache(maxsize=None)
def verdict_of(combo: Combo) -> Verdict:
    """``classified()[combo]``, without classifying the whole product where it is not (a child
    of test_hook_feature_matrix_child_runs runs a few hundred of the ~54000; ~13 s a process)."""
    if classified.cache_info().currsize:
        return classified()[combo]
    with _gpu():
        return classify(combo)


# HookRequest fields the product does not cross, and why (a new field fails
# test_every_request_field_is_an_axis_or_said_why until it is an axis or listed here).
REQUEST_AXES = {"attention_backend": "attention", "packed_cache": "packed_cache",
                "cuda_graphs": "cuda_graphs", "fp8": "fp8", "lora": "lora",
                "moe_expert_backend": "experts", "linear_cross_entropy": "linear_cross_entropy"}

NOT_CROSSED = {
    "fp8_recipe": "passed through to the framework's precision config; read by the FP8 GEMM-shape "
                  "and FP8-attention rules only (MXFP8's blocks of 32: refused at TP 2 / CP 2, 16 wide "
                  "on a rank; the recipes FP8 attention runs with), checked on a sample: no other "
                  "refusal and no plan changes with it",
    "max_seqs": "a bound, not a feature: checked at the packed size, 0 and one above",
    "max_seqlen": "a bound, not a feature: checked at the packed size, 0 and one above",
}

# hook-only refusals of a model or request setting the product does not vary: each is reached
# from the first runnable combination by changing that one setting (test_every_hook_message_is_reached)
ONE_AWAY = {
    "multi-latent attention": dict(model=dict(multi_latent_attention=True)),
    "custom layer spec": dict(facts=dict(custom_layer_spec="gemma2_layer_spec")),
    "build override": dict(facts=dict(build_override="MyConfig.configure_model")),
    "sliding window": dict(model=dict(window_size=(128, 0))),
    "multi-token prediction": dict(model=dict(mtp_num_layers=1)),
    "position embedding": dict(model=dict(position_embedding_type="yarn")),
    "local attention": dict(model=dict(attention_backend="local")),
    "micro-batch size": dict(facts=dict(micro_batch_size=2)),
    "max_seqs above": dict(request=dict(max_seqs=T + 1)),
    "max_seqlen above": dict(request=dict(max_seqlen=T + 1)),
    "full-iteration graph": dict(model=dict(cuda_graph_scope="full_iteration"), request=dict(cuda_graphs=True)),
    "fp8 format": dict(request=dict(fp8="e5m2")),
    "expert backend name": dict(request=dict(moe_expert_backend="cutlass")),
    "unknown LoRA target": dict(request=dict(lora=("linear_q",)), facts=dict(peft="LoRA")),
    "shared experts": dict(moe=True, model=dict(moe_shared_expert_intermediate_size=32)),
    "MoE bias": dict(moe=True, model=dict(add_bias_linear=True)),
    "MoE overlap": dict(moe=True, model=dict(overlap_moe_expert_parallel_comm=True)),
    "MoE load balancing": dict(moe=True, model=dict(moe_router_load_balancing_type="seq_aux_loss")),
    "linear_cross_entropy name": dict(request=dict(linear_cross_entropy="fused")),
    "chunked loss without the cache": dict(moe=True, request=dict(linear_cross_entropy="chunked",
                                                                   packed_cache=False)),
}

# MoEDispatchConfig's checks of the MoE fields' own values (top-k, groups, capacity, policies),
# which the matrix keeps valid (MoEDispatchConfig's own tests, tests/moe, cover them)
UNREACHABLE_MESSAGES = ("MoEDispatchConfig: num_experts", "MoEDispatchConfig: topk",
                        "MoEDispatchConfig: capacity_factor", "MoEDispatchConfig: drop_policy",
                        "MoEDispatchConfig: pad_multiple", "MoEDispatchConfig: strict_capacity",
                        "MoEDispatchConfig: expert_backend", "MoEDispatchConfig: score_function",
                        "MoEDispatchConfig: num_groups", "MoEDispatchConfig: group_topk",
                        "MoEDispatchConfig: TransformerConfig.num_moe_experts is None")

# rules the hooks cannot break, and why (none: every shared rule fires in the matrix)
UNREACHABLE_RULES: dict = {
    "_fp8_gemm_shapes": "with the config's recipe (Megatron's default, delayed) the matrix's model and "
                        "packed length are aligned on every rank (tests/test_rules.py checks the rule "
                        "from the hooks)",
    "_full_iteration_graphs": "a full-iteration capture is the main job's cuda_graphs.scope; the "
                              "hooks never set RunFacts.full_iteration",
    "_moe_tensor_parallel": "the hooks never set RunFacts.tensor_parallel_size",
    "_sequence_parallel": "the main job's parallel.sequence_parallel; the hooks never set "
                          "RunFacts.sequence_parallel",
    "_offload_with_pipeline": "the hooks have no activation offload",
    "_full_iteration_megatron_step": "the hooks never set RunFacts.full_iteration",
    "_data_parallel_optimizer": "the main job's parallel group; the hooks' frameworks configure "
                                "Megatron's DDP and optimizer themselves",
    "_data_parallel_in_full_iteration": "the hooks never set RunFacts.full_iteration",
    "_pad_multiple": "the main job's data.pad_multiple; the hooks' frameworks pack their own "
                     "data (RunFacts.pad_multiple stays None)",
    "_linear_cross_entropy": "the matrix's model has no MuP scaling and no multi-token prediction "
                             "(which the hooks refuse whatever the loss); tests/test_rules.py "
                             "checks the rule from the hooks",
}

# RunFacts fields the hooks leave at their defaults (the main job's layout / backend facts)
NOT_SET_BY_HOOKS = {
    "names": "one spelling per framework; tests/test_rules.py checks every spelling",
    "pipeline_parallel_size": "read by the CP rule for the main job only (the hooks refuse CP)",
    "sequence_parallel": "read by the main job's rules only (CP, sequence parallelism)",
    "offload": "the hooks have no activation offload",
    "full_iteration": "the hooks capture per-layer graphs only (the main job's cuda_graphs.scope)",
    "on_cpu": "the hooks' frameworks train on GPUs",
    "tensor_parallel_size": "read by the main job's MoE-with-TP and sequence-parallel rules only",
    "linear_impl": "read by the main job's sequence-parallel rule only",
    "packed_tokens": "read by the main job's sequence-parallel rule only",
    "megatron_optimizer_step": "read by the main job's full-iteration rule only",
    "pad_multiple": "the main job's data.pad_multiple (the frameworks pack their own data)",
    **dict.fromkeys(("distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                     "bucket_size"), "the main job's parallel group (the frameworks configure "
                                     "Megatron's DDP and optimizer themselves)"),
}

# RunFacts fields the hooks set from the model's shape, which the matrix keeps fixed
FIXED_BY_THE_MODEL = {
    "logit_transforms": "the matrix's model transforms no logits (no MTP, no MuP): "
                        "tests/test_rules.py checks the rule with MuP",
    "head_dim": "one model shape (head_dim 8): tests/test_rules.py checks the FP8-attention rule "
                "per head_dim and GPU; flex with it is refused (rules._flex_head_dim), flex with "
                "16-wide heads trains in the main job's feature matrix",
}


def one_away(name: str):
    """(facts, request) of the first runnable combination of the model kind the change needs,
    with that one setting changed."""
    change = ONE_AWAY[name]
    base = first_runnable(moe=change.get("moe", False))
    facts, request = facts_and_request(base)
    model = facts.model
    if "model" in change:
        model = _copy_config(model)
        for k, v in change["model"].items():
            setattr(model, k, v)
    fields = dict(change.get("facts", {}))
    if fields.get("peft") == "LoRA":
        fields["peft"] = _lora_peft()
    facts = dataclasses.replace(facts, model=model, **fields)
    return facts, dataclasses.replace(request, **change.get("request", {}))


def _lora_peft():
    from megatron_fastpath.integrations import core

    return core.PeftFacts("LoRA", True, _lora_requests()[1])


def _copy_config(config):
    import copy

    return copy.copy(config)


def first_runnable(moe: bool = False) -> Combo:
    return next(c for c, v in classified().items() if v.status == RUN and (c["model"] == "moe") == moe)


def _swap(combo: Combo, name: str, value) -> Optional[Combo]:
    """``combo`` with axis ``name`` set to ``value`` (axes that stop applying take NA, ones that
    start take their first value), None where the axis does not apply or allow it."""
    c = {}
    for axis, (n, v) in zip(axes(), combo.items()):
        if n == name:
            if not axis.applies(c) or not axis.allowed(c, value):
                return None
            v = value
        elif not axis.applies(c):
            v = NA
        elif v is NA or not axis.allowed(c, v):
            v = next(x for x in axis.values if axis.allowed(c, x))
        c[n] = v
    return Combo(tuple(c[a.name] for a in axes()))


def run_combination(combo: Combo) -> str:
    """Build the model the hooked config builds (call inside the GPU stand-ins, with Megatron's
    model-parallel state of world 1) and run one forward + backward on a packed batch; compare
    per-token losses with the same weights under Megatron's own layer spec where that is a
    reference. Returns what was checked."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_fastpath.integrations import FastpathLayerSpec, FastpathSettings, cache_for, clear_caches
    from megatron_fastpath.packed_seq.runtime import forward
    from tests.support.packed_reference import reference_layer_spec

    verdict = verdict_of(combo)
    assert verdict.status in RUN_STATUSES, verdict
    uses_te = verdict.status in (RUN_TE, RUN2_TE)
    if uses_te:  # a child of test_hook_feature_matrix_child_runs with the fake TE
        import transformer_engine

        from tests.support.fake_te.activate import FAKE_TE_ROOT

        assert transformer_engine.__file__.startswith(FAKE_TE_ROOT), transformer_engine.__file__
    assert torch.distributed.get_world_size() == world_size(combo), combo.label
    facts, _ = facts_and_request(combo)
    config = _copy_config(facts.model)
    plan = verdict.plan
    settings = FastpathSettings(**plan.settings)
    if plan.graph_warmup_steps is not None:
        config.cuda_graph_warmup_steps = plan.graph_warmup_steps
    fp8 = fp8_format(combo, plan)
    config.fp8 = fp8  # what the framework's precision config writes (plan.set_fp8 / fp8_on)
    pe = plan.position_embedding_type or config.position_embedding_type
    dtype = getattr(torch, combo["dtype"])
    clear_caches()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)  # Megatron's own attention / MoE fork its RNG tracker
    spec = FastpathLayerSpec(settings)(config)
    vocab = 64
    if combo["layout"] in PIPELINE_LAYOUTS:
        return run_pipelined(combo, config, spec, settings, pe, dtype, fp8, uses_te)
    if combo["layout"] in CP_LAYOUTS:
        return run_context_parallel(combo, config, spec, settings, pe, dtype, fp8, uses_te)
    model = GPTModel(config, spec, vocab_size=vocab, max_sequence_length=T, position_embedding_type=pe,
                     share_embeddings_and_output_weights=False)
    if dtype != torch.float32:
        model = model.to(dtype)
    gen = torch.Generator().manual_seed(1)
    lengths = [11, 7, 9]  # 27 of T=32 tokens: a padding tail
    n = sum(lengths)
    tokens = torch.zeros(1, T, dtype=torch.long)
    labels = torch.zeros(1, T, dtype=torch.long)
    tokens[0, :n] = torch.randint(1, vocab, (n,), generator=gen)
    labels[0, :n] = torch.randint(1, vocab, (n,), generator=gen)
    if settings.packed_cache:
        pb = cache_for(settings)[1].acquire(lengths)
        loss_1T = forward(model, pb, tokens, labels, linear_cross_entropy=settings.chunked_loss)
    else:  # Megatron's own attention on the framework's unpacked batch
        loss_1T = model(tokens, torch.arange(T)[None], None, labels=labels)
    loss = (loss_1T[0, :n].float()).mean()
    loss.backward()
    assert torch.isfinite(loss), loss
    grads = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [k for k, g in grads.items() if g is None or not torch.isfinite(g).all()]
    # the build is what the classifier predicted; TE's modules ran, under FP8 exactly when on
    checked = "finite loss and gradients" + _built_as_predicted(combo, model, settings, fp8, uses_te, config)
    te_modules = _te_modules(model)
    reference = (settings.packed_cache and dtype == torch.float32 and fp8 is None
                 and not any(m.__class__.__name__ != "GroupedLinear" for m in te_modules.values())
                 and (combo["model"] == "dense" or combo["dispatch"] == "dropless"))
    if not reference:
        return checked + ("" if settings.packed_cache else " (Megatron's attention; no packed reference)")
    # same weights, Megatron's SelfAttention + an unpacked causal reference attention with
    # Megatron's RoPE function, one sequence at a time (the MLP / MoE block is the hooked one)
    ref_attn = reference_layer_spec(cache_for(settings)[0].config.rope).submodules.self_attention
    ref_spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=ref_attn))
    ref = GPTModel(config, ref_spec, vocab_size=vocab, max_sequence_length=T, position_embedding_type="none",
                   share_embeddings_and_output_weights=False)
    missing = ref.load_state_dict(model.state_dict(), strict=False)
    assert not missing.unexpected_keys and all("_extra_state" in k for k in missing.missing_keys), missing
    start = 0
    with torch.no_grad():
        for length in lengths:
            sl = slice(start, start + length)
            alone = ref(tokens[:, sl], torch.arange(length)[None], None, labels=labels[:, sl])
            torch.testing.assert_close(alone[0], loss_1T.detach()[0, sl], rtol=1e-4, atol=1e-4)
            start += length
    return checked + "; per-token losses == Megatron's attention, one sequence at a time"


# the pipelined runs' global batch: packed lengths of T=32, one microbatch more than the cache's
# slots (the pipeline size), so the third reuses the first's slot, released in call order (on
# each stage after the first's backward, under 1F1B)
MICROBATCHES = ([11, 7, 9], [5, 14], [20, 3, 6])


def _packed_batch(lengths: list, gen: torch.Generator, vocab: int) -> tuple:
    """(tokens [1, T], labels [1, T], n): ``lengths`` packed from the start, a padding tail."""
    n = sum(lengths)
    tokens = torch.zeros(1, T, dtype=torch.long)
    labels = torch.zeros(1, T, dtype=torch.long)
    tokens[0, :n] = torch.randint(1, vocab, (n,), generator=gen)
    labels[0, :n] = torch.randint(1, vocab, (n,), generator=gen)
    return tokens, labels, n


def run_pipelined(combo: Combo, config, spec, settings, pe: str, dtype, fp8, uses_te: bool) -> str:
    """A pipeline layout (a child of 2 processes, Megatron's parallel state of that layout):
    this rank's stage of the hooked model (``pre_process`` / ``post_process`` by its pipeline
    rank, as the frameworks build it; no virtual pipeline: the hooks refuse it) driven as the
    framework drives it -- Megatron's own schedule
    (``get_forward_backward_func``) over :data:`MICROBATCHES`, forward and backward, on the bare
    model (no DDP: ``finalize_model_grads_func`` None). The forward step is the hooks' (the main
    job's ``gpu_train_step`` shape): each microbatch takes a slot of the packed cache
    (``cache_for``'s ``InFlightBatches``, released in call order) and runs
    ``packed_seq.runtime.forward``, tokens on the first stage, labels on the last, hidden states
    from the schedule in between; without the cache, Megatron's attention on the unpacked
    batch. Checked on each stage: the schedule ran every microbatch, the last stage's loss is
    finite, every trainable parameter has a finite gradient, the build is the predicted one
    (attention backend, experts, TE modules in FP8 exactly when FP8 is on)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_fastpath.integrations import cache_for
    from megatron_fastpath.packed_seq.runtime import forward

    pp = ps.get_pipeline_model_parallel_world_size()
    assert pp == 2 == config.pipeline_model_parallel_size, (pp, config.pipeline_model_parallel_size)
    assert config.virtual_pipeline_model_parallel_size is None
    model = GPTModel(config, spec, vocab_size=64, max_sequence_length=T, position_embedding_type=pe,
                     share_embeddings_and_output_weights=False,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    if dtype != torch.float32:
        model = model.to(dtype)
    # no DDP: nothing reduces gradients after the schedule (the framework's DDP would)
    config.finalize_model_grads_func = None
    gen = torch.Generator().manual_seed(1)
    batches = [_packed_batch(lengths, gen, 64) + (lengths,) for lengths in MICROBATCHES]
    in_flight = cache_for(settings)[1] if settings.packed_cache else None
    calls, losses = [], []

    def forward_step(data_iterator, module):
        tokens, labels, n, lengths = next(data_iterator)
        calls.append(n)
        if settings.packed_cache:  # the hooks' data step: a slot per microbatch, held in call order
            pb = in_flight.acquire(lengths)
            output = forward(module, pb, tokens, labels, linear_cross_entropy=settings.chunked_loss)
        else:  # Megatron's own attention on the framework's unpacked batch
            output = module(tokens, torch.arange(T)[None], None, labels=labels)

        def loss_func(per_token_1T):  # last pipeline stage only
            loss = per_token_1T[0, :n].float().mean()
            losses.append(loss.detach().clone())  # the schedule divides its loss in place
            return loss, {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=model,
        num_microbatches=len(batches), seq_length=T, micro_batch_size=1, forward_only=False)
    if in_flight is not None:
        assert in_flight.max_in_flight == settings.num_slots < len(batches), (in_flight.max_in_flight, settings)
        in_flight.release_all()
    assert len(calls) == len(batches), calls
    last = ps.is_pipeline_last_stage()
    assert len(losses) == (len(batches) if last else 0), (last, losses)
    assert all(torch.isfinite(x) for x in losses), losses
    grads = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [k for k, g in grads.items() if g is None or not torch.isfinite(g).all()]
    te = _built_as_predicted(combo, model, settings, fp8, uses_te, config)
    checked = (f"Megatron's schedule, {len(batches)} microbatches, stage {ps.get_pipeline_model_parallel_rank()} "
               f"of {pp}: " + ("finite loss and gradients" if last else "finite gradients") + te
               + ("" if settings.packed_cache else " (Megatron's attention)"))
    if fp8 is not None:  # FP8's delayed scaling state moved with the run: no equal reference
        return checked
    _unpipelined_reference(config, spec, pe, dtype, model, grads, batches, losses, settings)
    return checked + "; losses and gradients == the same weights without pipelining"


def _global_names(model) -> dict:
    """Parameter / state name of a pipeline stage -> the whole model's name (the stage's layer
    offset added to ``decoder.layers.{i}``)."""
    layers = model.decoder.layers
    offset = layers[0].layer_number - 1 if len(layers) else 0
    return {n: re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", n)
            for n in model.state_dict()}


def _unpipelined_reference(config, spec, pe, dtype, stage, grads, batches, losses, settings) -> None:
    """The same weights as one model (every stage's state gathered; the config's pipeline size
    1), the same microbatches through it, one after the other, its loss the schedule's (the mean
    over the microbatches): its per-microbatch losses equal the last stage's and its gradients
    of this stage's parameters equal the schedule's."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_fastpath.integrations import cache_for
    from megatron_fastpath.packed_seq.runtime import forward

    names = _global_names(stage)
    mine = {names[k]: v for k, v in stage.state_dict().items() if not k.endswith("_extra_state")}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    state = {k: v for part in gathered for k, v in part.items()}
    whole = _copy_config(config)
    whole.pipeline_model_parallel_size = 1
    ref = GPTModel(whole, spec, vocab_size=64, max_sequence_length=T, position_embedding_type=pe,
                   share_embeddings_and_output_weights=False)
    if dtype != torch.float32:
        ref = ref.to(dtype)
    missing = ref.load_state_dict(state, strict=False)
    assert not missing.unexpected_keys and all("_extra_state" in k for k in missing.missing_keys), missing
    ref_losses = []
    for tokens, labels, n, lengths in batches:  # each microbatch's backward before the next fills a slot
        if settings.packed_cache:
            per_token = forward(ref, cache_for(settings)[1].acquire(lengths), tokens, labels)
        else:
            per_token = ref(tokens, torch.arange(T)[None], None, labels=labels)
        ref_losses.append(per_token[0, :n].float().mean())
        (ref_losses[-1] / len(batches)).backward()
    if settings.packed_cache:
        cache_for(settings)[1].release_all()
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    if losses:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses).detach(), **tol)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for k, g in grads.items():
        torch.testing.assert_close(g, ref_grads[names[k]], msg=lambda m, k=k: f"{k}: {m}", **tol)


def run_context_parallel(combo: Combo, config, spec, settings, pe: str, dtype, fp8, uses_te: bool) -> str:
    """A context-parallel layout (a child of 2 processes, Megatron's parallel state with CP 2;
    the hooks accept it without the packed cache only, so Megatron's own Transformer Engine
    attention runs the CP exchange): the framework's unpacked batch split as the framework
    splits it -- Megatron's ``get_batch_on_this_cp_rank`` (chunks r and 2 CP - 1 - r of the
    sequence on rank r) -- one forward + backward of this rank's tokens, the loss the
    token-mean over both ranks. Checked: finite loss and gradients, the build as predicted,
    every attention ran Transformer Engine's CP over the 2 ranks; where routing is per token
    (dense, dropless experts) the per-token losses gathered from both ranks equal the same
    weights run without CP on the whole sequence (a model with CP 1 on a CP group of one rank;
    its FP8 state fresh, so both forwards quantise with TE's initial scales)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from tests.support.megatron_cp import megatron_cp_split

    assert not settings.packed_cache, "the hooks refuse context parallelism with the packed cache"
    cp = ps.get_context_parallel_world_size()
    assert cp == 2 == config.context_parallel_size, (cp, config.context_parallel_size)
    model = GPTModel(config, spec, vocab_size=64, max_sequence_length=T, position_embedding_type=pe,
                     share_embeddings_and_output_weights=False)
    if dtype != torch.float32:
        model = model.to(dtype)
    gen = torch.Generator().manual_seed(1)
    tokens, labels, n = _packed_batch([11, 7, 9], gen, 64)
    full = {"tokens": tokens, "labels": labels, "position_ids": torch.arange(T)[None],
            "loss_mask": (torch.arange(T) < n)[None].float()}
    mine = megatron_cp_split(full)
    per_token = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"])
    assert per_token.shape == (1, T // cp), per_token.shape
    local = (per_token.float() * mine["loss_mask"]).sum()
    (local / n).backward()  # this rank's share of the token mean (DDP would sum over CP)
    total = local.detach().clone()
    torch.distributed.all_reduce(total, group=ps.get_context_parallel_group())
    assert torch.isfinite(total), total
    grads = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [k for k, g in grads.items() if g is None or not torch.isfinite(g).all()]
    checked = "finite loss and gradients" + _built_as_predicted(combo, model, settings, fp8, uses_te, config)
    attn = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert all(getattr(a, "cp_group", None) is not None and torch.distributed.get_world_size(a.cp_group) == cp
               for a in attn), [getattr(a, "cp_group", None) for a in attn]
    checked += f"; Transformer Engine's attention over CP {cp} ({attn[0].cp_comm_type})"
    if combo["model"] == "moe" and combo["dispatch"] != "dropless":
        return checked + " (capacity dispatch: capacities are per rank, no whole-sequence reference)"
    _whole_sequence_reference(config, spec, pe, dtype, model, full, per_token, mine)
    return checked + "; per-token losses == the same weights without CP on the whole sequence"


def _whole_sequence_reference(config, spec, pe, dtype, model, full, per_token, mine) -> None:
    """The same weights built with CP 1 (its CP group: this rank alone) on the whole sequence,
    TE's FP8 state fresh as the CP model's was at its forward: its per-token losses at this
    rank's positions equal the CP run's."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank = torch.distributed.get_rank()
    alone = [torch.distributed.new_group([r]) for r in range(torch.distributed.get_world_size())][rank]
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.cp = alone
    whole = _copy_config(config)
    whole.context_parallel_size = 1
    ref = GPTModel(whole, spec, vocab_size=64, max_sequence_length=T, position_embedding_type=pe,
                   share_embeddings_and_output_weights=False, pg_collection=pgs)
    if dtype != torch.float32:
        ref = ref.to(dtype)
    # the weights only: TE's FP8 state (_extra_state) starts as the CP model's did at its forward
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing = ref.load_state_dict(weights, strict=False)
    assert not missing.unexpected_keys and all("_extra_state" in k for k in missing.missing_keys), missing
    with torch.no_grad():
        ref_1T = ref(full["tokens"], full["position_ids"], None, labels=full["labels"])
    positions = mine["position_ids"][0]
    # float32 per-token losses at float32 tolerances: the CP run's first forward and the
    # reference's compute the same GEMMs with the same FP8 scales, and attention over the same
    # keys (measured equal to the bit; a wrongly ordered K/V gather is off by ~1e-2)
    torch.testing.assert_close(per_token.detach()[0].float() * mine["loss_mask"][0],
                               ref_1T[0, positions].float() * mine["loss_mask"][0])


def _built_as_predicted(combo: Combo, model, settings, fp8, uses_te: bool, config) -> str:
    """Assert the build is what the classifier predicted -- the attention backend (packed cache),
    the experts, Transformer Engine modules exactly when the status says so, in FP8 exactly when
    FP8 is on -- and say what of TE was checked."""
    verdict = verdict_of(combo)
    if settings.packed_cache:
        backend, _ = build_checks(combo, verdict.plan.settings)
        assert {layer.self_attention.core_attention.backend for layer in model.decoder.layers} == {backend}
    if combo["model"] == "moe":
        from megatron_fastpath.moe.experts import expert_class

        assert {type(layer.mlp.experts) for layer in model.decoder.layers} == {
            expert_class(settings.moe_expert_backend)}
    te_modules = _te_modules(model)
    assert bool(te_modules) == uses_te, (verdict.status, sorted(te_modules))
    if not te_modules:
        return ""
    in_fp8 = {name: m.fp8 for name, m in te_modules.items()}
    assert set(in_fp8.values()) == {fp8 is not None}, (fp8, in_fp8)
    return f"; {len(te_modules)} TE modules" + (f" in FP8 ({fp8}, {config.fp8_recipe})" if fp8 else "")


def fp8_format(combo: Combo, plan) -> Optional[str]:
    """The FP8 format the framework's model config holds when the hooked model is built: the
    plan's (``set_fp8``), else the config's own (``fp8_on``: the matrix's config holds the
    first of ``core.FP8_FORMATS``), else none."""
    from megatron_fastpath.integrations import core

    if plan.set_fp8:
        return plan.fp8
    return core.FP8_FORMATS[0] if combo["fp8_on"] is True else None


def _te_modules(model) -> dict:
    """{name: module} of the model's Transformer Engine modules (none without TE imported)."""
    import sys

    base = getattr(sys.modules.get("transformer_engine.pytorch.module.base"), "TransformerEngineBaseModule", None)
    if base is None:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, base)}


# the axes that change the model the runner builds (the others change refusals or settings the
# CPU run does not read: graphs are captured after the first step, LoRA is the framework's PEFT)
BUILT = ("model", "dispatch", "dtype", "packed_cache", "attention", "experts", "data", "layout")


def runnable(status: str = RUN) -> list:
    return [c for c, v in classified().items() if v.status == status]


def build_inputs(combo: Combo) -> tuple:
    """Everything :func:`run_combination` reads of a combination: the :data:`BUILT` axes, the
    hook's plan (settings, graph warm-up, position embedding) and the framework's model config.
    Two combinations with the same inputs build the same model and run the same batch through
    it, so one run checks both."""
    verdict = classified()[combo]
    facts, _ = facts_and_request(combo)
    plan = verdict.plan
    config = tuple(sorted((k, repr(v)) for k, v in vars(facts.model).items() if not k.startswith("_")))
    return (tuple(combo[a] for a in BUILT), tuple(sorted((k, repr(v)) for k, v in plan.settings.items())),
            plan.graph_warmup_steps, plan.position_embedding_type, config)


@functools.lru_cache(maxsize=None)
def selected(status: str = RUN) -> dict:
    """{one runnable combination: the runnable combinations with its build inputs}: the
    runnable combinations (of ``status``: :data:`RUN` in this process, :data:`RUN_TE` in the
    fake TE's child) grouped by :func:`build_inputs`, each group keyed by its first in matrix
    order: the build a run trains (the CI's, :func:`ci_runs`; all of them, the full tier)."""
    groups = collections.defaultdict(list)
    for c in runnable(status):
        groups[build_inputs(c)].append(c)
    return {members[0]: tuple(members) for members in groups.values()}


def _without_recipe_rules(reasons: list, facts, request) -> list:
    """``reasons`` without those of the rules that read the FP8 recipe (GEMM shapes, FP8
    attention), for the run ``facts`` / ``request`` describe."""
    from megatron_fastpath import rules
    from megatron_fastpath.integrations import core

    run = core.run_facts(facts, request)
    drop = {rule(run) for rule in (rules._fp8_gemm_shapes, rules._fp8_attention_inputs)}
    return [r for r in reasons if r not in drop]


@functools.lru_cache(maxsize=None)
def lone_reasons() -> dict:
    """{(axis, value): the reason kinds that value adds}: over the combinations refused for a
    lone value, the kinds it has and the same combination with the axis's first value has not."""
    out = collections.defaultdict(set)
    with _gpu():
        for c, v in classified().items():
            lone = lone_value(c)
            if lone:
                name = lone[0]
                first = _swap(c, name, axes()[Combo.index()[name]].values[0])
                out[lone] |= set(v.kinds) - set(classify(first).kinds)
    return dict(out)


# (status, layout) of each child launch: the fake TE's world-1 combinations, and each run
# layout of 2 processes with and without the fake TE (CP only with it: the hooks accept CP
# without the cache with FP8 only, i.e. Transformer Engine's attention)
LAUNCHES = ((RUN_TE, "1"), *((status, layout) for status in (RUN2, RUN2_TE) for layout in RUN_LAYOUTS
                             if (status, layout) not in ((RUN2, lay) for lay in CP_LAYOUTS)))


def child_launches() -> list:
    """The :data:`LAUNCHES` with something to run."""
    return [(status, layout) for status, layout in LAUNCHES if _of_layout(status, layout)]


def _of_layout(status: str, layout: str) -> list:
    return [c for c in selected(status) if c["layout"] == layout]


def full_tier() -> bool:
    """Whether the runs train every distinct build (by hand, ``FASTPATH_FULL_MATRIX=<dir>``, the
    main job's full tier's switch) rather than the CI's cover (:func:`ci_runs`)."""
    return bool(os.environ.get(FULL_ENV))


@functools.lru_cache(maxsize=None)
def ci_runs(status: str, layout: str) -> list:
    """The distinct builds the CI runs of one status and layout: those of a pairwise cover of
    its runnable combinations (every pair of axis values some accepted combination of the
    layout has is in a combination whose build runs), in matrix order. Every axis the runner
    reads (:data:`BUILT`, the plan) takes each of its values and each pair of values in a run;
    what only a triple of values could break is left to the full tier."""
    rep = {c: r for r, members in selected(status).items() for c in members}
    cover = pairwise_cover([c for c in runnable(status) if c["layout"] == layout])
    chosen = {rep[c] for c in cover}
    return [c for c in _of_layout(status, layout) if c in chosen]


def runs(status: str, layout: str) -> list:
    """The distinct builds a run test trains: :func:`ci_runs`, or with the full tier's switch
    every one (:func:`_of_layout`)."""
    return _of_layout(status, layout) if full_tier() else ci_runs(status, layout)


def _run_child(key: str, spec: str, out: str) -> None:
    """A child of :func:`test_hook_feature_matrix_child_runs`: run the combinations ``spec``
    (a JSON list of labels, layout after layout) names, each of which must have status ``key``
    (a :data:`RUN_STATUSES` value) here too, each layout started as a fresh process would
    (``init_distributed`` re-initialises Megatron's model-parallel state when the layout
    changes; ``fresh_process_state``); write the results to ``out.rank{rank}.json``."""
    import json

    from megatron_fastpath.distributed import init_distributed
    from megatron_fastpath.integrations import clear_caches
    from tests.support.graph_safe_standins import gpu_standins
    from tests.support.main_job import fresh_process_state

    status = next(s for s, k in RUN_STATUSES.items() if k == key)
    by_label = {c.label: c for c in combinations()}
    combos = [by_label[label] for label in json.loads(Path(spec).read_text())]
    sizes = {"1": {}, "tensor_model_parallel_size=2": dict(tensor_model_parallel_size=2),
             "expert_parallel_size=2": dict(expert_model_parallel_size=2),
             "pipeline_size=2": dict(pipeline_model_parallel_size=2),
             "context_parallel_size=2": dict(context_parallel_size=2)}
    runs, layout = [], None
    for combo in combos:
        if combo["layout"] != layout:  # each layout starts as a fresh process would
            layout = combo["layout"]
            init_distributed(backend="gloo", **sizes[layout])
            # Megatron's MoE aux-loss scale is a class attribute: a CPU step's lazy 0-dim one
            # and a pipeline schedule's [1] one cannot share it
            fresh_process_state()
        try:
            verdict = verdict_of(combo)
            assert verdict.status == status, f"{verdict.status} here ({verdict.why})"
            with gpu_standins():
                runs.append({"label": combo.label, "ok": True, "what": run_combination(combo)})
        except Exception as exc:  # noqa: BLE001 -- reported; the parent test fails
            runs.append({"label": combo.label, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:600]}"})
            if torch.distributed.get_world_size() > 1:
                # one rank's failure leaves the other inside a collective: going on would pair
                # mismatched collectives or wait for gloo's 30-minute timeout; stop both now
                # (torchrun ends the other rank, the parent shows this traceback)
                raise RuntimeError(f"{combo.label} failed on rank {torch.distributed.get_rank()}") from exc
        finally:
            clear_caches()
    rank = torch.distributed.get_rank()
    Path(f"{out}.rank{rank}.json").write_text(json.dumps({"runs": runs}))
