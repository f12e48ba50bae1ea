"""The matrix of :mod:`tests.train.feature_matrix` (generator, classifier, runner; the package docstring
describes it): ``tests/train/test_feature_matrix.py`` tests it, ``doc.py`` renders its page.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import re
import typing
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

import pytest
import yaml

from tests.support.matrix import FULL_ENV, NA, Combination, pairwise_cover, value_pairs  # noqa: F401 -- the tests import them here

REPO = Path(__file__).resolve().parents[3]

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
    "fastpath.linear_impl=local": "without Transformer Engine (its `auto` picks TE's linears "
                                  "for the te attention backend); with it the `linear` axis sets it",
    "cuda_graphs.use_te_rng_tracker=false": "without Transformer Engine Megatron's graph-safe "
                                            "tracker; with it the `te_rng` axis sets it",
    "lora.dropout=0.0": "a graph without TE's RNG tracker refuses dropout (and with it the "
                        "fake CUDA generator's graph-safe state is not a real one's)",
    "offload.min_offload_bytes=0": "the tiny layers' inputs are offloaded too",
}

# a feature group's fixed settings go with its switch (parse refuses them while it is off:
# settings.settings_while_off); the others into every combination
FEATURE_FIXED = {k for k in FIXED if k.split(".")[0] in ("lora", "offload", "cuda_graphs", "fp8")}
BASE = SIZES + [k for k in FIXED if k not in FEATURE_FIXED]

TINY_HEAD_DIM = 8  # model.hidden_size 32 over the tiny models' 4 heads (kv_channels unset)

CAPACITY_FACTOR = 1.5  # fastpath.moe_capacity_factor of the "capacity" dispatch


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


ABSENT = "absent"  # the transformer_engine axis without Transformer Engine


def fake_te_version() -> str:
    """The fake Transformer Engine's ``__version__`` (read from its source: the pytest process
    never imports it)."""
    from tests.support.fake_te.activate import FAKE_TE_ROOT

    text = Path(FAKE_TE_ROOT, "transformer_engine", "__init__.py").read_text(encoding="utf-8")
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


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


@functools.lru_cache(maxsize=None)
def built_expert_backend() -> str:
    """The expert backend the main job builds (it has no setting for it)."""
    from megatron_fastpath.moe.spec import get_moe_mlp_spec

    return inspect.signature(get_moe_mlp_spec).parameters["expert_backend"].default


@functools.lru_cache(maxsize=None)  # a pure function of the backend; classify asks it per combination
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

    sizes = [f.name for f in dataclasses.fields(ParallelConfig) if f.name.endswith("parallel_size")]
    return ("1",) + tuple(f"{name}=2" for name in sizes)


def layout_label(value: str) -> str:
    return value if value == "1" else value.split("_")[0][0].upper() + "P2"


@functools.lru_cache(maxsize=None)
def axes() -> tuple:
    from megatron_fastpath.attention.core_attention import BACKENDS
    from megatron_fastpath.fp8 import FP8Config
    from megatron_fastpath.graphs.config import GRAPH_SCOPES, default_warmup_steps
    from megatron_fastpath.moe.config import EXPERT_BACKENDS
    from megatron_fastpath.train.config import DTYPES

    moe = lambda c: _is_moe(c["model"])  # noqa: E731
    te = lambda c: c["transformer_engine"] != ABSENT  # noqa: E731
    return (
        Axis("transformer_engine", (ABSENT, fake_te_version()),
             "the process: without Transformer Engine, or with the fake TE (`tests/support/fake_te`, "
             "its `__version__`) importable", lambda v: []),
        Axis("model", _tiny_models(), "`configs/model/tiny_*.yaml`", lambda v: [f"model={v}"]),
        Axis("experts", EXPERT_BACKENDS, "`moe.config.EXPERT_BACKENDS`", _expert_overrides, moe,
             why_not=f"the main job has no expert-backend setting: it builds "
                     f"`{built_expert_backend()}` experts (`moe.spec.get_moe_mlp_spec`'s default)"),
        Axis("dispatch", ("dropless", "capacity"), "`fastpath.moe_capacity_factor` (null | a number)",
             lambda v: [f"fastpath.moe_capacity_factor={CAPACITY_FACTOR}"] if v == "capacity" else [],
             moe),
        Axis("attention", ("auto",) + tuple(BACKENDS), "`core_attention.BACKENDS` + auto",
             lambda v: [f"fastpath.attention_backend={v}"]),
        # the flex kernel's lower bound on a GPU (rules._flex_head_dim): the tiny models' heads
        # (hidden 32 / 4 heads) and the narrowest it takes
        Axis("head_dim", (TINY_HEAD_DIM, 16), "`model.kv_channels` (the tiny heads' 8, or 16)",
             lambda v: [] if v == TINY_HEAD_DIM else [f"model.kv_channels={v}"],
             lambda c: c["attention"] == "flex"),
        # auto resolves to one of these (te with the te attention backend, else local)
        Axis("linear", ("local", "te"), "`fastpath.linear_impl` (its `auto` resolves to one of these)",
             lambda v: [f"fastpath.linear_impl={v}"], te),
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
        Axis("graph_warmup", (default_warmup_steps(lora=False), 0),
             "`cuda_graphs.warmup_steps` (its default without LoRA, 0)",
             lambda v: [f"cuda_graphs.warmup_steps={v}"],
             lambda c: c["graphs"] and c["graph_scope"] == "layers"),
        _bool_axis("te_rng", "cuda_graphs.use_te_rng_tracker", lambda c: te(c) and c["graphs"]),
        _bool_axis("offload", "fastpath.offload"),
        Axis("layout", _layouts(), "`ParallelConfig.*_size`: all 1, or one of them 2",
             lambda v: [] if v == "1" else [f"parallel.{v}"]),
        # sequence parallelism shards over the TP group: it needs TP > 1
        _bool_axis("sequence_parallel", "parallel.sequence_parallel",
                   lambda c: c["layout"].startswith("tensor_model_parallel_size")),
        # the loss reads the model, the layout, LoRA, the dtype and the step (graphs): crossed
        # with the first attention / FP8 / offload values, without TE (its world's verdicts, the
        # committed JSON, stay as they are)
        Axis("loss", ("off", "chunked"), "`fastpath.linear_cross_entropy` (its null resolves to one of these)",
             lambda v: [f"fastpath.linear_cross_entropy={v}"],
             lambda c: not te(c) and c["attention"] == "auto" and c["fp8"] == "off" and not c["offload"]),
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
            on = {x.split("=")[0].split(".")[1] for x in o if x.startswith("fastpath.") and x.endswith("=true")}
            out += [k for k in FIXED if k in FEATURE_FIXED and k.split(".")[0] in on]
        return out

    @property
    def label(self) -> str:
        c = dict(self.items())
        parts = [] if c["transformer_engine"] == ABSENT else [f"TE{c['transformer_engine']}"]
        parts.append(c["model"].replace("tiny_", ""))
        if c["experts"] is not NA:
            parts[-1] += f"/{c['experts']}/{c['dispatch']}"
        parts.append(c["attention"] + ("" if c["head_dim"] in (NA, TINY_HEAD_DIM) else
                                       f"(hd{c['head_dim']})"))
        if c["linear"] is not NA:
            parts.append(f"{c['linear']}-linears")
        parts.append({"float32": "fp32", "bfloat16": "bf16"}.get(c["dtype"], c["dtype"]))
        if c["lora"]:
            parts.append("lora")
        if c["fp8"] != "off":
            parts.append(f"fp8:{c['fp8']}" + ("+attn" if c["fp8_attention"] is True else ""))
        if c["graphs"]:
            parts.append((f"graphs(w{c['graph_warmup']}" if c["graph_scope"] == "layers"
                          else "graphs(full") + (",te-rng)" if c["te_rng"] is True else ")"))
        if c["offload"]:
            parts.append("offload")
        parts.append(layout_label(c["layout"]) + ("+SP" if c["sequence_parallel"] is True else ""))
        if c["loss"] == "chunked":
            parts.append("chunked-loss")
        return " ".join(parts)


@functools.lru_cache(maxsize=None)
def combinations() -> tuple:
    """The product of the axes, each axis taking ``NA`` where it does not apply."""
    partial = [{}]
    for axis in axes():
        partial = [dict(c, **{axis.name: v}) for c in partial
                   for v in (axis.values if axis.applies(c) else (NA,))]
    return tuple(Combo(tuple(c[a.name] for a in axes())) for c in partial)


REFUSED, RUN, WORLD2, NOT_SELECTABLE = (
    "refused at parse", "run", "run under torchrun (a world of 2)", "not a main-job setting")


@dataclasses.dataclass(frozen=True)
class Verdict:
    status: str
    reason: str = ""
    rule: Optional[str] = None  # the rules.RULES function that refused it
    refusing: tuple = ()  # every rules.RULES function that refuses its facts
    facts: object = None  # the RunFacts the main job handed the rules (last call)
    problem: Optional[str] = None  # the classification broke the contract (a test failure)
    job: Optional[str] = dataclasses.field(default=None, compare=False)  # job_key, when accepted
    # an earlier accepted combination whose parsed job is this one's (:func:`share_jobs`)
    same_job_as: Optional["Combo"] = None


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


def classify(combo: Combo) -> Verdict:
    """Parse the combination as the main job does, then run the preflight's device checks
    (the rules again with the GPU's capability where one reads it; the memory check) -- not
    its output directories or environment (call inside :func:`parsing`)."""
    from megatron_fastpath import rules
    from megatron_fastpath._optional import MissingDependencyError
    from megatron_fastpath.train import parse_job_config
    from megatron_fastpath.train.preflight import check_device

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
            check_device(job)
        except (ValueError, MissingDependencyError) as exc:
            return _refused(str(exc), seen[-1] if seen else None)
    facts = seen[-1]
    if rules.refusals(facts):
        return Verdict(RUN, facts=facts, problem=f"accepted although the rules refuse it: "
                                                 f"{rules.refusals(facts)}")
    par = job.parallel
    if any(getattr(par, f) > 1 for f in vars(par) if f.endswith("parallel_size")):
        return Verdict(WORLD2, f"`parallel.{combo['layout']}`: a world of 2 processes", facts=facts,
                       job=job_key(job))
    return Verdict(RUN, facts=facts, job=job_key(job))


def job_key(job) -> str:
    """What a run of the parsed ``job`` (a ``JobConfig``) trains, as a digest: the whole
    config with the two settings the parse resolves (``fastpath.attention_backend`` and
    ``fastpath.linear_impl``, ``auto`` among their values) replaced by what they resolved to
    (``JobConfig.attention_backend`` / ``linear_impl``, which the job reads; nothing after the
    parse reads the raw settings: :func:`test_only_the_parse_reads_the_raw_backend_settings`).
    Two combinations with one key train the same job: ``auto`` and the backend it picks."""
    fast = dataclasses.replace(job.fastpath, attention_backend=job.attention_backend,
                               linear_impl=job.linear_impl)
    return hashlib.sha1(repr(dataclasses.replace(job, fastpath=fast)).encode()).hexdigest()


def share_jobs(verdicts: dict) -> dict:
    """``verdicts`` (in product order) with ``same_job_as`` set on every accepted combination
    whose job (:func:`job_key`) an earlier one trains: the runs train each job once."""
    first, out = {}, {}
    for c, v in verdicts.items():
        if v.job is not None and first.setdefault(v.job, c) is not c:
            v = dataclasses.replace(v, same_job_as=first[v.job])
        out[c] = v
    return out


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


def te_present() -> bool:
    """This process imports a ``transformer_engine`` (the fake: only child processes do)."""
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def classify_world(te: bool) -> dict:
    """{Combo: Verdict} of the combinations of one ``transformer_engine`` world, classified in
    this process, which must be that world (a few ms a combination)."""
    assert te_present() == te, "classify the TE world in a process with the fake TE (te_env)"
    with parsing():
        return share_jobs({c: classify(c) for c in combinations() if (world_of(c) == "te") == te})


# The TE world's verdicts, classified by a child process with the fake TE importable
# (``python -m tests.workers.feature_matrix_te_classify_worker --classify-te``; the pytest process never
# imports TE), committed
# run-length encoded: test_te_world_verdicts_are_current re-classifies and compares.
TE_VERDICTS = REPO / "tests" / "train" / "feature_matrix_te.json"


def _te_world() -> list:
    """The TE world's combinations, in product order."""
    return [c for c in combinations() if world_of(c) == "te"]


def encode_verdicts(verdicts: dict) -> dict:
    """{"verdicts": [[status, reason, rule, refusing, problem]], "runs": [[verdict index,
    count]], "same_job": [[index, index of the earlier combination with its job]]} over the TE
    world's combinations in product order."""
    table, runs = [], []
    index = {c: i for i, c in enumerate(_te_world())}
    same = [[index[c], index[v.same_job_as]] for c, v in verdicts.items() if v.same_job_as is not None]
    for c in _te_world():
        v = verdicts[c]
        row = [v.status, v.reason, v.rule, list(v.refusing), v.problem]
        if row not in table:
            table.append(row)
        i = table.index(row)
        if runs and runs[-1][0] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return {"fake_te_version": fake_te_version(), "verdicts": table, "runs": runs, "same_job": same}


def decode_verdicts(data: dict) -> dict:
    te_combos = _te_world()
    assert data["fake_te_version"] == fake_te_version(), "TE world verdicts of another fake TE"
    assert sum(n for _, n in data["runs"]) == len(te_combos), \
        "the TE world's verdicts are of another product: regenerate them (write())"
    out, it = {}, iter(te_combos)
    for i, n in data["runs"]:
        status, reason, rule, refusing, problem = data["verdicts"][i]
        v = Verdict(status, reason, rule=rule, refusing=tuple(refusing), problem=problem)
        for _ in range(n):
            out[next(it)] = v
    for i, j in data["same_job"]:
        out[te_combos[i]] = dataclasses.replace(out[te_combos[i]], same_job_as=te_combos[j])
    return out


def classify_te_world_in_child(tmp: Path) -> dict:
    """The TE world's encoded verdicts, classified now by a child process with the fake TE."""
    import json
    import subprocess
    import sys

    from tests.support.fake_te.activate import te_env

    out = Path(tmp) / "te_verdicts.json"
    subprocess.run([sys.executable, "-m", "tests.workers.feature_matrix_te_classify_worker", "--classify-te", str(out)],
                   env=te_env(), cwd=tmp, check=True, timeout=1200)
    return json.loads(out.read_text())


@functools.lru_cache(maxsize=None)
def classified() -> dict:
    """{Combo: Verdict} for the whole product, in product order: the world without
    Transformer Engine classified here, the TE world's verdicts read from TE_VERDICTS."""
    import json

    live = classify_world(False)
    live.update(decode_verdicts(json.loads(TE_VERDICTS.read_text(encoding="utf-8"))))
    return {c: live[c] for c in combinations()}


def parsing():
    from tests.support.graph_safe_standins import gpu_standins

    return gpu_standins()


WORLDS = ("absent", "te")  # the transformer_engine axis: without TE, with the fake TE

W1_SHARDS = {"absent": 1, "te": 1}  # world-1 tests per world; its CI jobs dealt round-robin

# torchrun launches per world of the world-2 CI jobs of every layout (each layout's jobs together:
# the job re-initialises Megatron's model-parallel state when the layout changes)
W2_PARTS = {"absent": 1, "te": 1}


def world_of(combo: Combo) -> str:
    return "absent" if combo["transformer_engine"] == ABSENT else "te"


def runnable(world: str = "absent") -> list:
    return [c for c, v in classified().items() if v.status == RUN and world_of(c) == world]


def run_groups() -> list:
    """The (world, layout) groups of accepted combinations the runs train: world 1 (``"1"``,
    status RUN) and each layout of 2 processes (WORLD2), per ``transformer_engine`` world."""
    return [(world, layout) for world in WORLDS for layout in _layouts()]


@functools.lru_cache(maxsize=None)
def accepted(world: str, layout: str) -> list:
    """A group's accepted combinations (see :func:`run_groups`)."""
    return runnable(world) if layout == "1" else world2_accepted(world, layout)


@functools.lru_cache(maxsize=None)
def ci_cover(world: str, layout: str) -> list:
    """The combinations of a group whose jobs the CI trains: a pairwise cover of the group
    (every pair of axis values that occurs together in an accepted combination of the group
    occurs together in one whose job runs). The full tier trains the rest by hand."""
    return pairwise_cover(accepted(world, layout))


def world2_layouts() -> tuple:
    return _layouts()[1:]


def world1_id(world: str, index: int) -> str:
    return f"test_world_of_one_runs[{'te-' if world == 'te' else ''}{index}]"


def world2_id(world: str, part: int) -> str:
    return f"test_world_of_two_runs[{'te-' if world == 'te' else ''}{part}]"


@functools.lru_cache(maxsize=None)
def world2_accepted(world: str, layout: str) -> list:
    return [c for c, v in classified().items()
            if v.status == WORLD2 and c["layout"] == layout and world_of(c) == world]


def trained_by(combo: Combo) -> Combo:
    """The combination whose run trains ``combo``'s job: itself, or the earlier one with its
    job (``Verdict.same_job_as``: ``auto`` is run as the backend it resolves to)."""
    return classified()[combo].same_job_as or combo


def distinct_jobs(combos: list) -> list:
    """The combinations that train ``combos``' jobs, each job once, in order."""
    return list(dict.fromkeys(trained_by(c) for c in combos))


@functools.lru_cache(maxsize=None)
def shards() -> dict:
    """{integration test id: the combinations it runs}: of every run group (:func:`run_groups`)
    the jobs of its pairwise cover (:func:`ci_cover`), the world-1 ones dealt round-robin to
    their world's W1_SHARDS tests, the world-2 ones of every layout, layout after layout, cut
    into W2_PARTS launches (one launch pays its processes' start and imports once). A job runs
    once (:func:`distinct_jobs`): combinations with one job share it."""
    out = {}
    for world in WORLDS:
        jobs = distinct_jobs(ci_cover(world, "1"))
        out.update({world1_id(world, i): jobs[i::W1_SHARDS[world]] for i in range(W1_SHARDS[world])})
        jobs = [c for layout in world2_layouts() for c in distinct_jobs(ci_cover(world, layout))]
        n = W2_PARTS[world]
        out.update({world2_id(world, p): jobs[p * len(jobs) // n:(p + 1) * len(jobs) // n] for p in range(n)})
    return out


@functools.lru_cache(maxsize=None)
def sharing() -> dict:
    """{a combination whose job another's run trains: that combination}, for the run jobs."""
    run = shard_of()
    return {c: v.same_job_as for c, v in classified().items() if v.same_job_as in run}


@functools.lru_cache(maxsize=None)
def shard_of() -> dict:
    """{combination: the id of the integration test that runs it}."""
    return {c: name for name, combos in shards().items() for c in combos}


@dataclasses.dataclass(frozen=True)
class KnownBug:
    """A combination the runner expects to fail (reported, not fixed here). When it stops
    failing the test fails: drop the entry and the combination gets the full check."""

    name: str
    applies: Callable[[Combo], bool]
    stage: str  # the run that raises (matrix_runs.straight_vs_resumed): straight | save | resume | compare
    error: type
    match: str  # re.search in the message
    what: str
    # the combinations of the bug that may also pass (the bug does not always show there)
    sometimes: Callable[[Combo], bool] = lambda c: False

    def matches(self, stage: str, error_type: str, message: str) -> bool:
        return (stage == self.stage and error_type == self.error.__name__
                and re.search(self.match, message) is not None)


# bf16-save (fixed): bf16 on the GPU path could not save a checkpoint (the local spec's fp32
# norms were outside Megatron's 16-bit optimizer groups); train/step.py casts them as
# Float16Module does.
# fp32-lora-graph-replay (fixed): fp32 LoRA with per-layer graphs at TP 2 (or on the fake TE's
# linears) resumed 1 ulp off the straight run: aten::matmul ran the frozen base GEMM as a batched
# bmm on an eager [S, 1, H] input with a non-canonical stride and as one mm on the graph's
# canonical static input; LoRALinear hands the base canonical strides (lora/adapter.py), and the
# fake TE runs one 2-D GEMM as TE does.
# fp8-delayed-layer-graphs-first-step (fixed): FP8 delayed scaling with per-layer graphs resumed
# with other amax histories (with LoRA other adapters) than the straight run: the resumed run's
# first step ran eagerly (Megatron records the graphs then), the straight run's step replayed,
# and the two update TE's delayed-scaling state on different schedules (cuda_graphs.py:648-652
# vs TE linear.py:969). A resumed run now captures on a recording pass whose effects are undone
# (graphs/resume.py), and its first step replays: all 234 such combinations (66 world 1, 168
# world 2 over every layout, beyond the 8 of the pairwise cover CI runs) resumed bit for bit.
KNOWN_BUGS: tuple = ()


def known_bug(combo: Combo) -> Optional[KnownBug]:
    return next((b for b in KNOWN_BUGS if b.applies(combo)), None)


def feature(combo: Combo) -> dict:
    """What the runner checks a run built (tests/support/matrix_runs.py): graphs, their scope,
    the expert backend (None: not applicable)."""
    return {k: None if combo[k] is NA else combo[k] for k in ("graphs", "graph_scope", "experts")}


def run_combination(combo: Combo, tmp_path: Path) -> str:
    """World 1, in this process (the tests that plant a break): straight vs resumed (module
    docstring). Returns what was checked; raises on any difference, and when a known bug's
    failure does not happen as stated."""
    from tests.support.matrix_runs import straight_vs_resumed

    bug, stage = known_bug(combo), []
    try:
        what = straight_vs_resumed(config_tree(combo), tmp_path / "ckpt", feature(combo), stage)
    except Exception as exc:
        if bug is None or not bug.matches(stage[-1], type(exc).__name__, str(exc)):
            raise
        return f"fails at {bug.stage} ({bug.name}, a known bug)"
    assert bug is None or bug.sometimes(combo), f"{bug.name} no longer fails: drop it from KNOWN_BUGS"
    return what


RAW_SETTINGS = ("attention_backend", "linear_impl")  # what job_key replaces by the resolved values


def _check_cover(every: list, cover: list, what: str) -> None:
    """``cover`` is a pairwise cover of ``every``, smaller, and no combination of it redundant."""
    pairs = value_pairs
    assert set().union(*map(pairs, every)) == set().union(*map(pairs, cover)), what
    assert set(cover) <= set(every) and len(cover) < len(every), what
    assert all(set().union(*map(pairs, cover[:k] + cover[k + 1:])) != set().union(*map(pairs, cover))
               for k in range(len(cover))), f"{what}: a combination of the cover covers no pair alone"


def _report(name: str, lines: list, failures: list, capsys) -> None:
    with capsys.disabled():
        print(f"\n{name}:")
        for line in lines:
            print(f"  {line}")
        for f in failures:
            print(f"  FAIL {f}")


def _moe_graphs_combo() -> Combo:
    """The first runnable MoE combination with graphs on and no known bug."""
    return next(c for c in runnable() if c["experts"] is not NA and c["graphs"] and known_bug(c) is None)


TIMEOUT = 2400  # s, one launch (~15-110 combinations, ~2-4 s each on an idle machine)


def _start(combos: list, d: Path, nproc: int):
    """A launch of tests/workers/matrix_worker.py training ``combos`` (under torchrun when
    ``nproc`` > 1; with the fake TE importable for the TE world's), its output in ``d``;
    returns (process, results prefix, log)."""
    import json
    import subprocess

    from tests.support.fake_te.activate import te_env
    from tests.support.main_job import job_env, main_job_cmd

    worlds = {world_of(c) for c in combos}
    assert len(worlds) == 1, "a launch trains the combinations of one transformer_engine world"
    te = worlds.pop() == "te"

    d.mkdir(parents=True)
    spec, out, log = d / "spec.json", d / "results", d / "log.txt"
    spec.write_text(json.dumps([{"label": c.label, "tree": config_tree(c), "feature": feature(c)}
                                for c in combos]))
    cmd = main_job_cmd([str(spec), str(out), str(d)] + (["--te"] if te else []), nproc=nproc,
                       entry=["-m", "tests.workers.matrix_worker"])
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=d, env=te_env() if te else job_env(), stdout=f,
                                stderr=subprocess.STDOUT, text=True)
    return proc, out, log


def _finish(combos: list, proc, out: Path, log: Path, nproc: int) -> tuple:
    """(lines, failures) of a launch from each rank's results (matrix_worker's JSON)."""
    import json

    try:
        code = proc.wait(timeout=TIMEOUT)
    except Exception:  # noqa: BLE001 -- a hang: killed, its unfinished combinations listed
        proc.kill()
        code = proc.wait()
    ranks = []
    for rank in range(nproc):
        path = Path(f"{out}.rank{rank}.json")
        ranks.append(json.loads(path.read_text()) if path.exists() else [])
    tail = f"; exit {code}: {log.read_text()[-1500:]}" if code else ""
    lines, failures = [], []
    for i, combo in enumerate(combos):
        got = [r[i] if i < len(r) else None for r in ranks]
        assert all(g is None or g["label"] == combo.label for g in got)
        bug = known_bug(combo)
        if any(g is None for g in got):
            failures.append(f"{combo.label}: no result from rank(s) "
                            f"{[k for k, g in enumerate(got) if g is None]} (the launch ended){tail}")
        elif all(g["ok"] for g in got):
            if bug is not None and bug.sometimes(combo):
                lines.append(f"run  {combo.label}  {got[0]['what']} ({bug.name} does not show here)")
            elif bug is not None:
                failures.append(f"{combo.label}: {bug.name} no longer fails: drop it from KNOWN_BUGS")
            else:
                lines.append(f"run  {combo.label}  {got[0]['what']}" + (" (both ranks)" if nproc > 1 else ""))
        elif bug is not None and all(g["ok"] or bug.matches(g["stage"], g["error_type"], g["error"])
                                     for g in got):
            lines.append(f"run  {combo.label}  fails at {bug.stage} ({bug.name}, a known bug)")
        else:
            failures.append(f"{combo.label}: " + "; ".join(
                f"rank {k} at {g['stage']}: {g['error_type']}: {g['error'][:400]}"
                for k, g in enumerate(got) if not g["ok"]))
    if code and not failures:
        failures.append(f"the launch exited with {code}{tail}")
    return lines, failures


def _run_world1(combos: list, tmp_path: Path) -> tuple:
    """(lines, failures) of ``combos`` (world 1) trained by 2 worker processes at once (the
    machine's 2 cores), each its half."""
    halves = [combos[0::2], combos[1::2]]
    started = [_start(half, tmp_path / f"p{k}", 1) for k, half in enumerate(halves)]
    lines, failures = [], []
    for half, launch in zip(halves, started):
        got = _finish(half, *launch, 1)
        lines += got[0]
        failures += got[1]
    return lines, failures


def _shared_lines(combos: list) -> list:
    """The report's lines for the combinations whose job one of ``combos`` trained."""
    return [f"same {c.label}  (the job of {rep.label})" for c, rep in sharing().items() if rep in combos]


FULL_RECORD = REPO / "tests" / "train" / "feature_matrix_full_run.json"

FULL_W1_PARTS = {"absent": 1, "te": 4}  # full-tier world-1 tests per world (2 processes each)

FULL_W2_PARTS = {"absent": 2, "te": 16}  # full-tier torchrun launches per layout and world


def _full_prefix(world: str) -> str:
    return "te-" if world == "te" else ""


def full_ids() -> list:
    """The full tier's test ids (known without classifying: worlds, parts and layouts)."""
    return [f"{_full_prefix(w)}{name}" for w in WORLDS for name in
            [f"w1-{i}" for i in range(FULL_W1_PARTS[w])]
            + [f"{layout_label(layout)}-{p}" for layout in world2_layouts() for p in range(FULL_W2_PARTS[w])]]


@functools.lru_cache(maxsize=None)
def full_tier() -> dict:
    """{full-tier id: combinations}: the jobs of the accepted combinations that no CI run trains
    (outside the groups' pairwise covers, :func:`ci_cover`) -- per world, the world-1 ones dealt
    round-robin to ``FULL_W1_PARTS`` tests, each layout's world-2 ones to ``FULL_W2_PARTS``
    launches. With the CI runs, every accepted combination's job."""
    ci = set(shard_of())
    out = {}
    for world in WORLDS:
        pre, n1, n2 = _full_prefix(world), FULL_W1_PARTS[world], FULL_W2_PARTS[world]
        rest = [c for c in distinct_jobs(accepted(world, "1")) if c not in ci]
        out.update({f"{pre}w1-{i}": rest[i::n1] for i in range(n1)})
        for layout in world2_layouts():
            rest = [c for c in distinct_jobs(accepted(world, layout)) if c not in ci]
            out.update({f"{pre}{layout_label(layout)}-{p}": rest[p::n2] for p in range(n2)})
    return out


def _full_params() -> list:
    import os

    if not os.environ.get(FULL_ENV):
        return [pytest.param(None, id="off", marks=pytest.mark.skip(
            reason=f"the full tier (3,257 jobs, about 2 hours on 2 cores) runs with {FULL_ENV}=<a directory for its records>"))]
    return [pytest.param(part, id=part) for part in full_ids()]


def _passed_labels(combos: list, failures: list) -> list:
    """The labels of ``combos`` no failure of ``_finish`` names (it writes "<label>: ..."; a
    label holds colons itself, "fp8:mxfp8")."""
    return [c.label for c in combos if not any(f.startswith(f"{c.label}: ") for f in failures)]


def _head_commit() -> str:
    """The commit the tests run from (HEAD of this checkout; ``+dirty`` with local changes)."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    return git("rev-parse", "HEAD").strip() + ("+dirty" if git("status", "--porcelain").strip() else "")


def record_full_run(directory: str, record: Path = FULL_RECORD) -> None:
    """Gather the full tier's part records (``<directory>/<part>.json``) into ``record``: every
    part must have recorded, all at one commit (the last part's date is the run's)."""
    import json

    parts = {p: json.loads(Path(directory, f"{p}.json").read_text()) for p in full_ids()}
    commits = {r["commit"] for r in parts.values()}
    assert len(commits) == 1, f"the full tier's parts ran at different commits: {sorted(commits)}"
    record.write_text(json.dumps({
        "commit": commits.pop(), "date": max(r["date"] for r in parts.values()),
        "seconds": round(sum(r["seconds"] for r in parts.values())),
        "parts": {p: {"passed": len(r["passed"]), "failed": len(r["failures"]), "seconds": r["seconds"]}
                  for p, r in parts.items()},
        "failures": [f for r in parts.values() for f in r["failures"]],
        "passed": sorted(label for r in parts.values() for label in r["passed"]),
    }, indent=1) + "\n", encoding="utf-8")
