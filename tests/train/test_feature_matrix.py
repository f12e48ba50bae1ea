"""The feature matrix (issue "GPU readiness", item 2): every combination of the main job's
features the config accepts, parsed the way the main job parses it and, where accepted, run.

* **Generator** (:func:`axes`, :func:`combinations`): the axes come from the code -- the
  attention backends (``core_attention.BACKENDS`` + ``auto``), the dtypes
  (``train.config.DTYPES``), the CPU-sized models (``configs/model/tiny_*.yaml``), the MoE
  expert backends (``moe.config.EXPERT_BACKENDS``), the FP8 recipes (``FP8Config``), the
  boolean feature switches and the parallel sizes (every ``*_size`` field of
  ``ParallelConfig``) -- so a new option joins the matrix by itself. Axes that do not apply
  (the expert backend of a dense model, the FP8 settings with FP8 off) collapse to ``-``.
* **Classifier** (:func:`classify`): each combination is parsed by ``parse_job_config`` on
  ``training.device=cuda`` under the GPU stand-ins (``tests/support/graph_safe_standins.py``:
  CUDA-as-CPU mode, fake CUDA graph, flash-attn / TE attention stand-ins). A refusal must be
  the first of ``rules.refusals(facts)`` for the facts the job handed the rules, or -- when the
  rules have nothing against the facts -- a missing-package message or one naming the setting.
* **Runner** (:func:`run_combination`): an accepted combination trains 4 steps straight, then
  3 steps with a checkpoint save, a resume and the 4th step; losses and learning rates of all
  4 steps and the final parameters must be bit-identical to the straight run (as
  tests/checkpoint/test_resume_main_job.py asserts on the CPU path). With graphs on, Megatron
  0.16.1 captures every layer at the end of step 1 and replays it in steps 2-4; the resumed run
  captures again at the end of its first step (step 4), so its step 4 runs eagerly against the
  straight run's replay.

Reduction (measured; the numbers are in docs/feature-matrix.md): the full product is parsed
(~2 ms a combination). Running one accepted combination costs ~10 s on an idle 2-core machine
(3 job builds, 8 steps, a checkpoint save and load), too many for ~10 minutes of CI, so the
integration test runs a **pairwise (all-pairs) cover** of the runnable combinations, extended
until **every way a rule touches** a runnable combination (one setting away from the rule's
refusal, that setting together with the others) is run at least once (:func:`selected`).
Accepted combinations that need 2 processes (a parallel size of 2) are parsed; one per layout
for the first two layouts runs under ``torchrun`` (:func:`test_world_of_two_under_torchrun`).
A combination a known bug breaks (:data:`KNOWN_BUGS`) is checked to fail exactly so.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import itertools
import re
import typing
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

import pytest
import torch
import yaml

from tests.support.matrix import NA, Combination, axes_table, cell

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "feature-matrix.md"

# Every combination starts from this: a tiny model and data (a step in well under a second),
# the GPU path on the stand-ins, and the settings a CPU can run each feature with.
SIZES = ["training.steps=4", "training.micro_batches=2", "training.warmup_steps=1",
         "data.num_samples=64", "data.max_tokens=64", "data.max_len=24", "data.max_seqs=8",
         "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64",
         "model.moe_ffn_hidden_size=32"]
FIXED = {
    "training.device=cuda": "the GPU step path (Megatron DDP, schedules, optimizer), on the CPU "
                            "through the CUDA-as-CPU mode",
    "training.skip_memory_check=true": "the memory check reads the GPU's properties; the "
                                       "stand-in has none",
    "cluster.backend=gloo": "no NCCL on a CPU",
    "fastpath.linear_impl=local": "Transformer Engine's linears have no CPU stand-in (auto "
                                  "picks them for the te attention backend)",
    "cuda_graphs.use_te_rng_tracker=false": "Transformer Engine's RNG tracker has no CPU "
                                            "stand-in; Megatron's graph-safe tracker instead",
    "lora.dropout=0.0": "a graph without TE's RNG tracker refuses dropout",
    "offload.min_offload_bytes=0": "the tiny layers' inputs are offloaded too",
}
BASE = SIZES + list(FIXED)
CAPACITY_FACTOR = 1.5  # fastpath.moe_capacity_factor of the "capacity" dispatch


# ---------------------------------------------------------------------------------- generator
@dataclasses.dataclass(frozen=True)
class Axis:
    """One dimension of the matrix: its values, where they come from, the overrides a value
    sets (``None``: the value cannot be expressed in the main job's config, ``why_not`` says
    why) and whether the axis applies to a partial combination (the axes before it)."""

    name: str
    values: tuple
    source: str
    overrides: Callable[[object], Optional[list]]
    applies: Callable[[dict], bool] = lambda c: True
    why_not: str = ""


def _bool_axis(name: str, key: str, applies=lambda c: True) -> Axis:
    return Axis(name, (False, True), f"`{key}` (bool)", lambda v: [f"{key}={str(v).lower()}"], applies)


def _fp8_recipes() -> tuple:
    """FP8Config's recipes: its Literal type when it has one, else the choices its validation
    names (``fp8.recipe must be a|b|c``)."""
    from megatron_fastpath.fp8 import FP8Config

    hint = typing.get_type_hints(FP8Config).get("recipe")
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    try:
        FP8Config(recipe="\0")
    except ValueError as exc:
        match = re.search(r"recipe must be ([\w|]+)", str(exc))
        if match:
            return tuple(match.group(1).split("|"))
    raise AssertionError("cannot read the FP8 recipes from FP8Config")


def _tiny_models() -> tuple:
    from megatron_fastpath.train import config_dir

    return tuple(sorted(p.stem for p in Path(config_dir(), "model").glob("tiny_*.yaml")))


@functools.lru_cache(maxsize=None)
def _base_tree(model: str) -> dict:
    """The composed config of ``model`` plus BASE, as the plain dict parse_job_config reads."""
    from omegaconf import OmegaConf

    from tests.support.hydra_compose import compose_job

    tree = OmegaConf.to_container(compose_job([f"model={model}", *BASE]), resolve=True)
    tree.pop("hydra", None)
    return tree


def _is_moe(model: str) -> bool:
    return _base_tree(model)["model"]["num_experts"] is not None


def built_expert_backend() -> str:
    """The expert backend the main job builds (it has no setting for it)."""
    from megatron_fastpath.moe.spec import get_moe_mlp_spec

    return inspect.signature(get_moe_mlp_spec).parameters["expert_backend"].default


def _expert_overrides(backend: str) -> Optional[list]:
    from megatron_fastpath.train.config import FastpathConfig

    setting = [f.name for f in dataclasses.fields(FastpathConfig) if "expert_backend" in f.name]
    if setting:  # a future fastpath setting joins the matrix here
        return [f"fastpath.{setting[0]}={backend}"]
    return [] if backend == built_expert_backend() else None


def _layouts() -> tuple:
    """All sizes 1, and each parallel size alone at 2: a world of 2 processes (this machine
    has 2 cores; two sizes of 2 need a world of 4)."""
    from megatron_fastpath.train.config import ParallelConfig

    sizes = [f.name for f in dataclasses.fields(ParallelConfig) if f.name.endswith("_size")]
    return ("1",) + tuple(f"{name}=2" for name in sizes)


def layout_label(value: str) -> str:
    return value if value == "1" else value.split("_")[0][0].upper() + "P2"


@functools.lru_cache(maxsize=None)
def axes() -> tuple:
    from megatron_fastpath.attention.core_attention import BACKENDS
    from megatron_fastpath.fp8 import FP8Config
    from megatron_fastpath.graphs.config import GRAPH_SCOPES, CudaGraphConfig
    from megatron_fastpath.moe.config import EXPERT_BACKENDS
    from megatron_fastpath.train.config import DTYPES

    moe = lambda c: _is_moe(c["model"])  # noqa: E731
    return (
        Axis("model", _tiny_models(), "`configs/model/tiny_*.yaml`", lambda v: [f"model={v}"]),
        Axis("experts", EXPERT_BACKENDS, "`moe.config.EXPERT_BACKENDS`", _expert_overrides, moe,
             why_not=f"the main job has no expert-backend setting: it builds "
                     f"`{built_expert_backend()}` experts (`moe.spec.get_moe_mlp_spec`'s default)"),
        Axis("dispatch", ("dropless", "capacity"), "`fastpath.moe_capacity_factor` (null | a number)",
             lambda v: [f"fastpath.moe_capacity_factor={CAPACITY_FACTOR}"] if v == "capacity" else [],
             moe),
        Axis("attention", ("auto",) + tuple(BACKENDS), "`core_attention.BACKENDS` + auto",
             lambda v: [f"fastpath.attention_backend={v}"]),
        Axis("dtype", tuple(DTYPES), "`train.config.DTYPES`", lambda v: [f"training.dtype={v}"]),
        _bool_axis("lora", "fastpath.lora"),
        Axis("fp8", ("off",) + _fp8_recipes(), "off + `FP8Config.recipe`",
             lambda v: ["fastpath.fp8=false"] if v == "off" else ["fastpath.fp8=true", f"fp8.recipe={v}"]),
        # the rules read the flag whatever the recipe: crossed with the default recipe only
        _bool_axis("fp8_attention", "fp8.dot_product_attention",
                   lambda c: c["fp8"] == FP8Config().recipe),
        _bool_axis("graphs", "fastpath.cuda_graphs"),
        Axis("graph_scope", GRAPH_SCOPES, "`graphs.config.GRAPH_SCOPES`",
             lambda v: [f"cuda_graphs.scope={v}"], lambda c: c["graphs"]),
        # the per-layer capture's warm-up passes (a full-iteration step has none)
        Axis("graph_warmup", (CudaGraphConfig().warmup_steps, 0),
             "`cuda_graphs.warmup_steps` (the default, 0)",
             lambda v: [f"cuda_graphs.warmup_steps={v}"],
             lambda c: c["graphs"] and c["graph_scope"] == "layers"),
        _bool_axis("offload", "fastpath.offload"),
        Axis("layout", _layouts(), "`ParallelConfig.*_size`: all 1, or one of them 2",
             lambda v: [] if v == "1" else [f"parallel.{v}"]),
        # sequence parallelism shards over the TP group: it needs TP > 1
        _bool_axis("sequence_parallel", "parallel.sequence_parallel",
                   lambda c: c["layout"].startswith("tensor_model_parallel_size")),
    )


@dataclasses.dataclass(frozen=True)
class Combo(Combination):
    """One combination of the main job's settings (:func:`axes`)."""

    @classmethod
    def axes(cls) -> tuple:
        return axes()

    def overrides(self) -> Optional[list]:
        """The Hydra overrides of this combination (after BASE), None when one of its values
        cannot be expressed in the main job's config."""
        out = []
        for axis, value in zip(axes(), self.values):
            if value is NA:
                continue
            o = axis.overrides(value)
            if o is None:
                return None
            out += o
        return out

    @property
    def label(self) -> str:
        c = dict(self.items())
        parts = [c["model"].replace("tiny_", "")]
        if c["experts"] is not NA:
            parts[0] += f"/{c['experts']}/{c['dispatch']}"
        parts += [c["attention"], {"float32": "fp32", "bfloat16": "bf16"}.get(c["dtype"], c["dtype"])]
        if c["lora"]:
            parts.append("lora")
        if c["fp8"] != "off":
            parts.append(f"fp8:{c['fp8']}" + ("+attn" if c["fp8_attention"] else ""))
        if c["graphs"]:
            parts.append(f"graphs(w{c['graph_warmup']})" if c["graph_scope"] == "layers"
                         else "graphs(full)")
        if c["offload"]:
            parts.append("offload")
        parts.append(layout_label(c["layout"]) + ("+SP" if c["sequence_parallel"] is True else ""))
        return " ".join(parts)


@functools.lru_cache(maxsize=None)
def combinations() -> tuple:
    """The product of the axes, each axis taking ``NA`` where it does not apply."""
    partial = [{}]
    for axis in axes():
        partial = [dict(c, **{axis.name: v}) for c in partial
                   for v in (axis.values if axis.applies(c) else (NA,))]
    return tuple(Combo(tuple(c[a.name] for a in axes())) for c in partial)


# --------------------------------------------------------------------------------- classifier
REFUSED, RUN, WORLD2, NO_CPU, NOT_SELECTABLE = (
    "refused at parse", "run", "accepted: needs 2 processes",
    "accepted: cannot run on a CPU", "not a main-job setting")
# accepted combinations this CPU cannot train, and why (the resolved attention backend)
CPU_LIMITS = {"flex": "torch FlexAttention has no backward on CPU (the backend refuses to "
                      "train there); on a GPU it runs compiled"}


@dataclasses.dataclass(frozen=True)
class Verdict:
    status: str
    reason: str = ""
    rule: Optional[str] = None  # the rules.RULES function that refused it
    refusing: tuple = ()  # every rules.RULES function that refuses its facts
    facts: object = None  # the RunFacts the main job handed the rules (last call)
    problem: Optional[str] = None  # the classification broke the contract (a test failure)


_SETTING = re.compile(r"\b(fastpath|parallel|training|cuda_graphs|fp8|lora|offload|model|data)\.[a-z_]+")


_yaml_value = functools.lru_cache(maxsize=None)(yaml.safe_load)  # as Hydra reads a value


def config_tree(combo: Combo) -> dict:
    """The combination's config as the plain tree Hydra composes (``model=`` picks the base
    tree; the other overrides set a key of a group: copied, the base stays as it was)."""
    tree = dict(_base_tree(combo["model"]))
    for o in combo.overrides():
        key, value = o.split("=", 1)
        if key == "model":
            continue
        group, leaf = key.split(".")
        assert leaf in tree[group], f"{key} is not a key of the composed config"
        tree[group] = dict(tree[group], **{leaf: _yaml_value(value)})
    return tree


class _CachedTyping:
    """``typing`` for ``settings.check_values`` with ``get_type_hints`` cached per class: a
    class's hints do not change, and evaluating them is most of a parse's time (speed only)."""

    get_type_hints = staticmethod(functools.lru_cache(maxsize=None)(typing.get_type_hints))

    def __getattr__(self, name):
        return getattr(typing, name)


def classify(combo: Combo) -> Verdict:
    """Parse the combination as the main job does (call inside :func:`parsing`)."""
    from megatron_fastpath import rules
    from megatron_fastpath._optional import MissingDependencyError
    from megatron_fastpath.train import parse_job_config

    if combo.overrides() is None:
        axis = next(a for a, v in zip(axes(), combo.values) if v is not NA and a.overrides(v) is None)
        return Verdict(NOT_SELECTABLE, axis.why_not)
    seen = []
    real = rules.refusals

    def recording(facts):
        seen.append(facts)
        return real(facts)

    with mock.patch.object(rules, "refusals", recording):
        try:
            job = parse_job_config(config_tree(combo))
        except (ValueError, MissingDependencyError) as exc:
            return _refused(str(exc), seen[-1] if seen else None)
    facts = seen[-1]
    if rules.refusals(facts):
        return Verdict(RUN, facts=facts, problem=f"accepted although the rules refuse it: "
                                                 f"{rules.refusals(facts)}")
    par = job.parallel
    if any(getattr(par, f) > 1 for f in vars(par) if f.endswith("_size")):
        return Verdict(WORLD2, f"`parallel.{combo['layout']}`: a world of 2 processes", facts=facts)
    if job.attention_backend in CPU_LIMITS:
        return Verdict(NO_CPU, f"attention `{job.attention_backend}`: {CPU_LIMITS[job.attention_backend]}",
                       facts=facts)
    return Verdict(RUN, facts=facts)


def _refused(message: str, facts) -> Verdict:
    from megatron_fastpath import rules

    reasons = rules.refusals(facts) if facts is not None else []
    if reasons:  # the rules refuse the facts: the job must report the first reason, verbatim
        refusing = tuple(r.__name__ for r in rules.RULES if r(facts))
        problem = None if message == reasons[0] else f"refused with {message!r}, rules say {reasons[0]!r}"
        return Verdict(REFUSED, message, rule=refusing[0], refusing=refusing, facts=facts,
                       problem=problem)
    # a missing package, or the setting to change (the main job's key; shared library checks
    # say "dtype" for training.dtype)
    clear = "needs the package" in message or _SETTING.search(message) or re.search(r"\bdtype\b", message)
    return Verdict(REFUSED, message, facts=facts,
                   problem=None if clear else f"refusal names no setting or package: {message!r}")


@functools.lru_cache(maxsize=None)
def classified() -> dict:
    """{Combo: Verdict} for the whole product (a few ms a combination)."""
    from megatron_fastpath import settings

    with parsing(), mock.patch.object(settings, "typing", _CachedTyping()):
        return {c: classify(c) for c in combinations()}


def parsing():
    from tests.support.graph_safe_standins import gpu_standins

    return gpu_standins()


# ------------------------------------------------------------------------ selection of runs
def runnable() -> list:
    return [c for c, v in classified().items() if v.status == RUN]


def _neighbours(combo: Combo):
    """(axis, value, neighbour): ``combo`` with one setting changed; an axis that starts to
    apply with it takes its first value (the default), one that stops takes NA."""
    for i, axis in enumerate(axes()):
        if combo.values[i] is NA:
            continue
        for v in axis.values:
            if v == combo.values[i]:
                continue
            c = dict(combo.items())
            c[axis.name] = v
            for later in axes()[i + 1:]:
                if not later.applies(c):
                    c[later.name] = NA
                elif c[later.name] is NA:
                    c[later.name] = later.values[0]
            yield axis.name, v, Combo(tuple(c[a.name] for a in axes()))


@functools.lru_cache(maxsize=None)
def _unconditional() -> set:
    """(rule, axis, value): the rule refuses every combination with that axis value that
    reaches the rules (a rule of one setting, e.g. FP8 attention on packed sequences: no other
    setting takes part in it)."""
    refusing = collections.defaultdict(list)  # (axis, value) -> [rules refusing, per combination]
    for c, v in classified().items():
        if v.facts is not None:
            for name, value in c.items():
                refusing[(name, value)].append(set(v.refusing))
    return {(rule, name, value) for (name, value), sets in refusing.items()
            for rule in set.intersection(*sets)}


@functools.lru_cache(maxsize=None)
def touches(combo: Combo) -> frozenset:
    """How rules touch a runnable combination: (rule, axis, value) when changing that one
    setting to that value makes the rule refuse it -- because of the value *together with* the
    combination's other settings (a rule that refuses the value on its own touches nothing)."""
    verdicts = classified()
    return frozenset((rule, name, str(value)) for name, value, n in _neighbours(combo)
                     for rule in verdicts[n].refusing if (rule, name, value) not in _unconditional())


def _pairs(combo: Combo) -> set:
    return set(itertools.combinations(list(enumerate(combo.values)), 2))


def cover(combos: list, needs: Callable[[Combo], set]) -> list:
    """Greedy set cover: combinations from ``combos`` until every requirement some combination
    has (``needs``) is met by a chosen one (deterministic: the first best in matrix order)."""
    todo = set().union(*(needs(c) for c in combos)) if combos else set()
    chosen = []
    while todo:
        # the most requirements met; on a tie, one no known bug keeps from the full check
        best = max(combos, key=lambda c: (len(needs(c) & todo), known_bug(c) is None))
        chosen.append(best)
        todo -= needs(best)
    return chosen


@functools.lru_cache(maxsize=None)
def selected() -> dict:
    """{Combo: why it runs}, in matrix order: a pairwise (all-pairs) cover of the runnable
    combinations, extended until every way a rule touches one is run."""
    pairwise = cover(runnable(), _pairs)
    rest = [c for c in runnable() if c not in pairwise]
    missing = lambda c: set(touches(c)) - set().union(*(touches(p) for p in pairwise))  # noqa: E731
    extra = cover(rest, missing)
    why = {c: "pairwise" for c in pairwise}
    why.update({c: "rule boundary" for c in extra})
    for c in why:
        if touches(c):
            why[c] += "; touched by " + ", ".join(sorted({r.lstrip("_") for r, _, _ in touches(c)}))
    return {c: why[c] for c in runnable() if c in why}


# ---------------------------------------------------------------------------- known bugs
@dataclasses.dataclass(frozen=True)
class KnownBug:
    """A combination the runner expects to fail (reported, not fixed here). When it stops
    failing the test fails: drop the entry and the combination gets the full check."""

    name: str
    applies: Callable[[Combo], bool]
    stage: str  # "save": the 3-step run with a checkpoint raises
    error: type
    match: str
    what: str


# bf16-save (fixed): bf16 on the GPU path could not save a checkpoint (the local spec's fp32
# norms were outside Megatron's 16-bit optimizer groups); train/step.py casts them as
# Float16Module does.
KNOWN_BUGS: tuple = ()


def known_bug(combo: Combo) -> Optional[KnownBug]:
    return next((b for b in KNOWN_BUGS if b.applies(combo)), None)


# ---------------------------------------------------------------------------------- runner
STEPS, STOP = 4, 3


def _train(overrides: list):
    """(summary, job) of the main job, in this process, inside the stand-ins."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_fastpath.train import run
    from tests.support.graph_safe_standins import gpu_standins
    from tests.support.hydra_compose import compose_job

    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # as a fresh process
    get_cuda_rng_tracker().reset()
    with gpu_standins():
        return run(compose_job(overrides), return_job=True, announce=False)


def _records(summary) -> list:
    return [(r.step, r.loss, r.lr) for r in summary.records]


def _params(job) -> dict:
    return {k: v.detach().clone() for k, v in job.model.state_dict().items() if torch.is_tensor(v)}


def _check_graphs(job, combo: Combo) -> None:
    from tests.support.megatron_graphs import graph_runners

    runners = graph_runners(job.model)
    micro = job.cfg.training.micro_batches
    if not combo["graphs"]:
        assert runners == [], "graph runners without cuda_graphs"
        return
    if combo["graph_scope"] == "full_iteration":  # two graphs, captured at step 2
        from megatron_fastpath.compat.graphs import full_cuda_graph_captured

        assert runners == [], "per-layer graph runners inside a full-iteration step"
        fwd_bwd, opt = full_cuda_graph_captured(), job.step.graphs.opt_graph
        assert fwd_bwd.replays == opt.replays == STEPS - 1
        return
    assert len(runners) == job.cfg.model.num_layers, "one runner per layer"
    for r in runners:  # captured at the end of step 1, replayed by every microbatch after it
        assert r.fwd_graph.captured and r.bwd_graph.captured
        assert r.fwd_graph.replays == r.bwd_graph.replays == (STEPS - 1) * micro


def _check_experts(job, combo: Combo) -> None:
    from megatron_fastpath.moe.experts import expert_class

    if combo["experts"] is NA:
        return
    built = {type(m) for n, m in job.model.named_modules() if n.endswith(".experts")}
    assert built == {expert_class(combo["experts"])}, built


def run_combination(combo: Combo, tmp_path: Path) -> str:
    """Straight 4 steps vs 3 steps + checkpoint + resume + step 4 (module docstring). Returns
    what was checked; raises on any difference."""
    overrides = BASE + combo.overrides()
    from omegaconf import OmegaConf

    from tests.support.hydra_compose import compose_job

    composed = OmegaConf.to_container(compose_job(overrides), resolve=True)
    composed.pop("hydra", None)
    assert composed == config_tree(combo), "Hydra's tree differs from the one classified"
    straight, job_s = _train(overrides)
    assert _records(straight) and len(straight.records) == STEPS
    _check_graphs(job_s, combo)
    _check_experts(job_s, combo)
    d = tmp_path / "ckpt"
    ckpt = [f"checkpoint.dir={d}"]
    bug = known_bug(combo)
    if bug is not None and bug.stage == "save":
        with pytest.raises(bug.error, match=bug.match):
            _train(overrides + ckpt + [f"training.stop_at_step={STOP}"])
        return f"straight run; the save fails ({bug.name}, a known bug)"
    first, _ = _train(overrides + ckpt + [f"training.stop_at_step={STOP}"])
    assert first.stopped == "stop_at_step" and [s["step"] for s in first.checkpoint_saves] == [STOP]
    assert _records(first) == _records(straight)[:STOP]
    resumed, job_r = _train(overrides + ckpt)
    assert resumed.resumed_from == f"{d}/step_{STOP:08d}"
    assert _records(resumed) == _records(straight), "resumed run differs from the straight run"
    a, b = _params(job_s), _params(job_r)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    return "straight == 3 + save + resume + 1"


# ----------------------------------------------------------------------------------- listing
@functools.lru_cache(maxsize=None)
def _values(selectable: bool) -> dict:
    """{axis: values} over the combinations the main job can express (or over all)."""
    every = collections.defaultdict(set)
    for c, v in classified().items():
        if v.status != NOT_SELECTABLE or not selectable:
            for name, value in c.items():
                every[name].add(value)
    return every


def _group_description(combos: list) -> str:
    """The axis values a group of combinations is restricted to (an axis the group spans
    fully, among the values it could take, is left out)."""
    every = _values(all(classified()[c].status != NOT_SELECTABLE for c in combos))
    parts = []
    for axis in axes():
        vals = {c[axis.name] for c in combos}
        if vals != every[axis.name]:
            shown = sorted(vals - {NA}, key=str) + ([NA] if NA in vals else [])
            parts.append(f"{axis.name} ∈ {{{', '.join(map(str, shown))}}}")
    return "; ".join(parts) or "all"


def render() -> str:
    """docs/feature-matrix.md, generated (test_listing_is_up_to_date keeps the file equal)."""
    verdicts = classified()
    counts = collections.Counter(v.status for v in verdicts.values())
    run_set = selected()
    lines = [
        "# Feature matrix",
        "",
        "Generated by `tests/train/test_feature_matrix.py::render` -- do not edit; regenerate with",
        "`.venv/bin/python -c \"from tests.train.test_feature_matrix import write; write()\"`",
        "(`test_listing_is_up_to_date` fails when this file and the generator differ).",
        "",
        "Every combination of the main job's features below is parsed by `parse_job_config` on",
        "`training.device=cuda` inside the GPU stand-ins (CUDA-as-CPU mode, fake CUDA graph,",
        "flash-attn and Transformer Engine attention stand-ins). Accepted combinations run, on the",
        "CPU: 4 steps straight vs 3 steps + checkpoint save + resume + step 4, bit-identical",
        "(losses, learning rates, parameters); with graphs on, layers are captured at the end of",
        "step 1 and replayed after it.",
        "",
        *axes_table(axes()),
    ]
    lines += ["", "Fixed settings of every combination (besides tiny sizes: "
              f"`{' '.join(SIZES)}`):", ""]
    lines += [f"* `{k}`: {why}" for k, why in FIXED.items()]
    n_sel = len(run_set)
    lines += [
        "",
        "## Counts",
        "",
        "| | combinations |",
        "| --- | --- |",
        f"| product of the axes | {len(verdicts)} |",
    ]
    lines += [f"| {status} | {counts[status]} |" for status in (NOT_SELECTABLE, REFUSED, WORLD2, NO_CPU, RUN)]
    touched = [c for c in runnable() if touches(c)]
    ways = set().union(*(touches(c) for c in runnable())) if runnable() else set()
    lines += [
        f"| runnable and touched by a rule | {len(touched)} |",
        f"| run by the integration test | {n_sel} |",
        "",
        "**Reduction.** One combination costs ~10 s on an idle 2-core machine (3 job builds, 8",
        f"steps, a checkpoint save and load; 30-50 s while other jobs share it): the {counts[RUN]}",
        f"runnable ones would take ~{counts[RUN] * 10 // 60} minutes, the {len(touched)} a rule touches",
        f"~{len(touched) * 10 // 60}. The integration test runs {n_sel}: a pairwise (all-pairs) cover of the",
        "runnable combinations -- every two axis values that occur together in a runnable",
        "combination occur together in a run one -- extended until each of the",
        f"{len(ways)} ways a rule touches a runnable combination is run at least once. A rule touches",
        "a combination when changing one setting makes the rule refuse it because of that",
        "setting *together with* the others (a rule that refuses the setting on its own touches",
        "nothing). The full product is parsed. Combinations that need 2 processes are parsed;",
        f"{TORCHRUN_LAYOUTS} of them (one per layout) run under `torchrun`",
        "(`test_world_of_two_under_torchrun`).",
        "",
        "Ways a rule touches a runnable combination (rule: the one setting that makes it refuse):",
        "",
    ]
    lines += [f"* `{rule.lstrip('_')}`: {name} = {value}" for rule, name, value in sorted(ways)]
    for status in (REFUSED,):
        groups = collections.defaultdict(list)
        for c, v in verdicts.items():
            if v.status == status:
                groups[(v.reason, v.rule)].append(c)
        lines += ["", f"## {status[0].upper()}{status[1:]}", ""]
        lines += ["| reason | rule | combinations | which |", "| --- | --- | --- | --- |"]
        for (reason, rule), combos in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0][0])):
            lines.append(f"| {cell(reason)} | {rule or 'config'} | {len(combos)} | "
                         f"{cell(_group_description(combos))} |")
    for status in (NOT_SELECTABLE, WORLD2, NO_CPU):
        groups = collections.defaultdict(list)
        for c, v in verdicts.items():
            if v.status == status:
                groups[v.reason].append(c)
        lines += ["", f"## {status[0].upper()}{status[1:]}", "", "| reason | combinations | which |",
                  "| --- | --- | --- |"]
        for reason, combos in sorted(groups.items()):
            lines.append(f"| {cell(reason)} | {len(combos)} | {cell(_group_description(combos))} |")
    lines += ["", "## Runnable (accepted, world 1)", "",
              "`run`: trained by the integration test (why it was chosen); `parsed`: accepted, "
              "left out by the reduction. Known bugs: the expected failure is checked instead.", "",
              "| combination | | known bug |", "| --- | --- | --- |"]
    for c in runnable():
        bug = known_bug(c)
        lines.append(f"| {c.label} | {'run (' + run_set[c] + ')' if c in run_set else 'parsed'} | "
                     f"{bug.name if bug else ''} |")
    lines += ["", "## Known bugs", "", "| bug | combinations | what |", "| --- | --- | --- |"]
    if not KNOWN_BUGS:
        lines.append("| none | | |")
    for bug in KNOWN_BUGS:
        n = sum(1 for c in runnable() if known_bug(c) is bug)
        lines.append(f"| {bug.name} | {n} runnable | {cell(bug.what)} |")
    return "\n".join(lines) + "\n"


def write() -> None:
    DOC.write_text(render(), encoding="utf-8")


# ------------------------------------------------------------------------------------ tests
def test_classification_follows_the_rules():
    """Unit tier: every refusal is the rules' first reason for the facts the job built (or a
    message naming a setting or package), and nothing the rules refuse is accepted."""
    problems = [f"{c.label}: {v.problem}" for c, v in classified().items() if v.problem]
    assert problems == []
    counts = collections.Counter(v.status for v in classified().values())
    assert counts[REFUSED] and counts[RUN] and counts[WORLD2]


def test_matrix_reaches_every_rule_and_every_fact():
    """Every rule refuses some combination and every RunFacts field takes two values across
    the matrix (``capability``: asked only for a captured MoE run; the stand-in GPU is sm90),
    except what the main job cannot vary (said why): a new rule input without an axis fails
    here."""
    from megatron_fastpath import rules

    fixed_in_main_job = {
        "names": "the main job's spelling",
        "packed_cache": "the main job always packs",
        "expert_backend": "the main job has no expert-backend setting",
    }
    unreachable = {"_te_grouped_linear_in_graphs": "the main job never builds te_grouped_linear"}
    verdicts = classified().values()
    fired = {v.rule for v in verdicts if v.rule}
    assert fired == {r.__name__ for r in rules.RULES} - set(unreachable)
    facts = [v.facts for v in verdicts if v.facts is not None]
    for f in dataclasses.fields(rules.RunFacts):
        values = {getattr(x, f.name) for x in facts}
        if f.name in fixed_in_main_job:
            assert len(values) == 1, (f.name, values)
        else:
            assert len(values) >= 2, f"RunFacts.{f.name} never varies in the matrix: add an axis"


def test_listing_is_up_to_date():
    """Unit tier: docs/feature-matrix.md is what render() generates."""
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/feature-matrix.md is stale: regenerate it with "
        "`python -c \"from tests.train.test_feature_matrix import write; write()\"`")


@pytest.mark.integration
def test_feature_matrix_runs(mcore_parallel, tmp_path, capsys):
    """Integration tier: each selected runnable combination, straight vs resumed."""
    results, failures = [], []
    for i, (combo, why) in enumerate(selected().items()):
        try:
            results.append((combo.label, why, run_combination(combo, tmp_path / f"c{i}")))
        except Exception as exc:  # noqa: BLE001 -- listed below, the test fails
            failures.append(f"{combo.label}: {type(exc).__name__}: {str(exc)[:400]}")
    with capsys.disabled():
        print("\nfeature matrix runs:")
        for label, why, what in results:
            print(f"  run  {label}  [{why}]  {what}")
        for f in failures:
            print(f"  FAIL {f}")
    assert failures == []
    assert len(results) == len(selected())


def _moe_graphs_combo() -> Combo:
    """The first selected MoE combination with graphs on and no known bug."""
    return next(c for c in selected() if c["experts"] is not NA and c["graphs"] and known_bug(c) is None)


@pytest.mark.integration
def test_planted_host_read_in_captured_experts_fails_the_matrix(mcore_parallel, tmp_path, monkeypatch):
    """A contract break the matrix must catch: a ``.tolist()`` (host read) planted in the
    grouped_mm experts' forward fails the MoE + graphs combination at capture (the fake CUDA
    graph raises, as a GPU capture is invalidated), while the same plant in the same
    combination with graphs off runs (the capture is what it breaks)."""
    from megatron_fastpath.moe import experts
    from tests.support.fake_cuda_graph import HostReadDuringCapture

    combo = _moe_graphs_combo()
    real = experts._activation

    def planted(config, h_RF):
        h_RF.tolist()  # the break: a device -> host read inside the captured MoE layer
        return real(config, h_RF)

    monkeypatch.setattr(experts, "_activation", planted)
    with pytest.raises(HostReadDuringCapture, match="Tensor.tolist"):
        run_combination(combo, tmp_path / "graphs")
    eager = Combo(tuple(False if n == "graphs" else NA if n in ("graph_warmup", "graph_scope") else v
                        for n, v in combo.items()))
    assert classified()[eager].status == RUN
    run_combination(eager, tmp_path / "eager")


@pytest.mark.integration
def test_cpu_limited_combinations_fail_as_stated(mcore_parallel):
    """What the matrix lists as accepted but not runnable on a CPU fails here for the stated
    reason (one combination per reason), so the listing cannot hide a runnable one."""
    reasons = {}
    for c, v in classified().items():
        if v.status == NO_CPU:
            reasons.setdefault(v.reason, c)
    assert reasons
    for reason, combo in reasons.items():
        backend = reason.split("`")[1]
        with pytest.raises(ValueError, match=f"the '{backend}' backend has no backward on CPU"):
            _train(BASE + combo.overrides())


# ---------------------------------------------------------------------- world of 2 (torchrun)
TORCHRUN_LAYOUTS = 2  # layouts run under torchrun (each: 3 launches of 2 processes, ~1 min)


def torchrun_picks() -> list:
    """For the TORCHRUN_LAYOUTS layouts with the most accepted world-2 combinations, the one
    (without a known bug) whose facts give the rules the most to read: the most RunFacts
    fields away from their defaults, then the most axes away from their first value."""
    from megatron_fastpath import rules

    by_layout = collections.defaultdict(list)
    for c, v in classified().items():
        if v.status == WORLD2 and known_bug(c) is None:
            by_layout[c["layout"]].append(c)
    layouts = sorted(by_layout, key=lambda k: (-len(by_layout[k]), k))[:TORCHRUN_LAYOUTS]

    defaults = rules.RunFacts(names=rules.NAMES["main"])

    def richness(c):
        facts = classified()[c].facts
        read = sum(getattr(facts, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(facts))
        return read, sum(x is not NA and x != a.values[0] for a, (_, x) in zip(axes(), c.items()))

    return [max(by_layout[k], key=richness) for k in layouts]


@pytest.mark.integration
@pytest.mark.parametrize("index", range(TORCHRUN_LAYOUTS))
def test_world_of_two_under_torchrun(tmp_path, index):
    """An accepted world-2 combination under torchrun (2 processes, gloo, each inside the GPU
    stand-ins via tests/support/standin_main.py): straight vs 3 + save + resume + 1, equal."""
    from tests.support.main_job import run_main_job

    combo = torchrun_picks()[index]
    entry = ["-m", "tests.support.standin_main"]
    args = BASE + combo.overrides()
    d = tmp_path / "ckpt"
    straight = run_main_job(args, tmp_path, nproc=2, name="straight", entry=entry)
    first = run_main_job(args + [f"checkpoint.dir={d}", f"training.stop_at_step={STOP}"], tmp_path,
                         nproc=2, name="first", entry=entry)
    resumed = run_main_job(args + [f"checkpoint.dir={d}"], tmp_path, nproc=2, name="resumed", entry=entry)

    def records(run):
        return [(r["step"], r["loss"], r["lr"]) for r in run.summary["records"]]

    assert len(records(straight)) == STEPS, combo.label
    assert records(first) == records(straight)[:STOP], combo.label
    assert f"resuming from {d}/step_{STOP:08d}" in resumed.stdout
    assert records(resumed) == records(straight), combo.label
