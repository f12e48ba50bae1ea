"""The feature matrix (issue "GPU readiness", item 2): every combination of the main job's
features the config accepts, parsed the way the main job parses it and, where accepted, run.

* **Generator** (:func:`axes`, :func:`combinations`): the axes come from the code -- the
  attention backends (``core_attention.BACKENDS`` + ``auto``), the dtypes
  (``train.config.DTYPES``), the CPU-sized models (``configs/model/tiny_*.yaml``), the MoE
  expert backends (``moe.config.EXPERT_BACKENDS``), the FP8 recipes (``FP8Config``), the
  boolean feature switches and the parallel sizes (every ``*_size`` field of
  ``ParallelConfig``) -- so a new option joins the matrix by itself. Axes that do not apply
  (the expert backend of a dense model, the FP8 settings with FP8 off) collapse to ``-``.
* **Two worlds** (the ``transformer_engine`` axis): this machine without Transformer Engine,
  and a GPU user's with it -- the fake TE 2.10 (``tests/support/fake_te``), importable only in
  child processes. The TE world adds the ``linear`` (``fastpath.linear_impl``) and ``te_rng``
  (``cuda_graphs.use_te_rng_tracker``) axes; a child process classifies it
  (``python -m tests.train.test_feature_matrix --classify-te``) and its verdicts are committed
  (``feature_matrix_te.json``, checked current by :func:`test_te_world_verdicts_are_current`).
* **Classifier** (:func:`classify`): each combination is parsed by ``parse_job_config`` on
  ``training.device=cuda`` under the GPU stand-ins (``tests/support/graph_safe_standins.py``:
  CUDA-as-CPU mode, fake CUDA graph, flash-attn / TE attention stand-ins). A refusal must be
  the first of ``rules.refusals(facts)`` for the facts the job handed the rules, or -- when the
  rules have nothing against the facts -- a missing-package message or one naming the setting.
* **Runner** (tests/support/matrix_runs.py ``straight_vs_resumed``): an accepted combination
  trains 4 steps straight with checkpoints on, saving at step 3 (``checkpoint.interval=3``;
  the async save is written while step 4 trains) and at the end; then the step-3 checkpoint,
  copied alone into a fresh directory, is resumed and step 4 trained. The losses and learning
  rates of all 4 steps and the final parameters (every rank's) must be bit-identical between
  the two runs (as tests/checkpoint/test_resume_main_job.py asserts on the CPU path), and the
  straight run must have built what the combination asks (graph runners, expert class). With
  graphs on, Megatron 0.16.1 captures every layer at the end of step 1 and replays it in steps
  2-4; the resumed run captures again at the end of its first step (step 4), so its step 4
  runs eagerly against the straight run's replay. The sync sentinel counts the resumed run's
  step only (``training.sync_check=off`` in the straight run): every combination trains one
  step inside its modes, equal to the straight run's step without them, and showing exactly
  the host reads expected (``matrix_runs.expected_syncs``). Each run builds the job from
  ``config_tree(combo)`` (equal to Hydra's composition:
  :func:`test_config_tree_is_hydras_composition`), not from Hydra. (It used to be three runs:
  4 straight, 3 with ``training.stop_at_step`` and a save, the resume; the straight run saving
  at step 3 checks the same resume with 5 steps instead of 8.)
* **Runs** (integration tier): every accepted world-1 combination of both worlds and every
  world-2 one without TE runs -- of the TE world's world-2 ones a pairwise cover per layout
  (:data:`TE_WORLD2_NOT_RUN`) --, in worker
  processes that train their combinations one after the other (tests/support/matrix_worker.py)
  -- the world-1 ones (status ``RUN``) dealt round-robin to ``W1_SHARDS`` tests, each running
  its half-shards in 2 processes at once (:func:`test_world_of_one_runs`); the world-2 ones
  (``WORLD2``, one parallel size 2) per layout in ``W2_PARTS`` ``torchrun`` launches of 2
  processes (:func:`test_world_of_two_runs`). A job runs once: combinations whose parsed jobs
  are equal (:func:`job_key`; ``auto`` and the backend it resolves to) share one run
  (:func:`distinct_jobs`). Of the TE
  world's world-1 flex ones a pairwise cover runs (:data:`TE_FLEX_NOT_RUN`). The **full
  tier** (:func:`test_full_tier`, by hand: ``FASTPATH_FULL_MATRIX=<dir>``, ~70 min) trains the
  jobs of the TE world's combinations the CI runs leave out; its last run is recorded in
  ``feature_matrix_full_run.json`` (:func:`record_full_run`). A test
  lists every combination it ran and fails listing every one that failed. The flex backend,
  which has no backward on a CPU, trains on the test-only FlexAttention stand-in
  (``tests/support/flex_standin.py``: torch's real flex forward, a dense backward, the CUDA
  kernel's contracts, e.g. heads at least 16 wide). A
  combination a known bug breaks (:data:`KNOWN_BUGS`) is checked to fail exactly so.
  docs/feature-matrix.md lists every run combination with the test that runs it, and the
  measured wall times.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
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
    "fastpath.linear_impl=local": "without Transformer Engine (its `auto` picks TE's linears "
                                  "for the te attention backend); with it the `linear` axis sets it",
    "cuda_graphs.use_te_rng_tracker=false": "without Transformer Engine Megatron's graph-safe "
                                            "tracker; with it the `te_rng` axis sets it",
    "lora.dropout=0.0": "a graph without TE's RNG tracker refuses dropout (and with it the "
                        "fake CUDA generator's graph-safe state is not a real one's)",
    "offload.min_offload_bytes=0": "the tiny layers' inputs are offloaded too",
}
# a feature group's fixed settings go with its switch (parse refuses them while it is off:
# rules.settings_while_off); the others into every combination
FEATURE_FIXED = {k for k in FIXED if k.split(".")[0] in ("lora", "offload", "cuda_graphs", "fp8")}
BASE = SIZES + [k for k in FIXED if k not in FEATURE_FIXED]
TINY_HEAD_DIM = 8  # model.hidden_size 32 over the tiny models' 4 heads (kv_channels unset)
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


class _CachedTyping:
    """``typing`` for ``settings.check_values`` with ``get_type_hints`` cached per class: a
    class's hints do not change, and evaluating them is most of a parse's time (speed only)."""

    get_type_hints = staticmethod(functools.lru_cache(maxsize=None)(typing.get_type_hints))

    def __getattr__(self, name):
        return getattr(typing, name)


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
    if any(getattr(par, f) > 1 for f in vars(par) if f.endswith("_size")):
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
    from megatron_fastpath import settings

    assert te_present() == te, "classify the TE world in a process with the fake TE (te_env)"
    with parsing(), mock.patch.object(settings, "typing", _CachedTyping()):
        return share_jobs({c: classify(c) for c in combinations() if (world_of(c) == "te") == te})


# The TE world's verdicts, classified by a child process with the fake TE importable
# (``python -m tests.train.test_feature_matrix --classify-te``; the pytest process never
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
    subprocess.run([sys.executable, "-m", "tests.train.test_feature_matrix", "--classify-te", str(out)],
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


# ----------------------------------------------------------------------------------- shards
WORLDS = ("absent", "te")  # the transformer_engine axis: without TE, with the fake TE
W1_SHARDS = {"absent": 2, "te": 4}  # world-1 tests per world; its runnable combinations dealt round-robin
W2_PARTS = {"absent": 1, "te": 1}  # torchrun launches per layout of 2; its combinations dealt round-robin


def world_of(combo: Combo) -> str:
    return "absent" if combo["transformer_engine"] == ABSENT else "te"


def runnable(world: str = "absent") -> list:
    return [c for c, v in classified().items() if v.status == RUN and world_of(c) == world]


@functools.lru_cache(maxsize=None)
def te_flex_world1() -> list:
    """The TE world's runnable flex combinations (a pairwise cover of them runs)."""
    return [c for c in runnable("te") if c["attention"] == "flex"]


@functools.lru_cache(maxsize=None)
def te_flex_cover() -> list:
    """The pairwise cover of :func:`te_flex_world1` that runs."""
    return pairwise_cover(te_flex_world1())


def world1_run(world: str) -> list:
    """The world-1 combinations a world's runs train: all of them, but of the TE world's flex
    ones only a pairwise cover (:data:`TE_FLEX_NOT_RUN`)."""
    if world == "absent":
        return runnable(world)
    cover = set(te_flex_cover())
    return [c for c in runnable(world) if c["attention"] != "flex" or c in cover]


def world2_layouts() -> tuple:
    return _layouts()[1:]


def world1_id(world: str, index: int) -> str:
    return f"test_world_of_one_runs[{'te-' if world == 'te' else ''}{index}]"


def world2_id(world: str, layout: str, part: int) -> str:
    return f"test_world_of_two_runs[{'te-' if world == 'te' else ''}{layout_label(layout)}-{part}]"


def pairwise_cover(combos: list) -> list:
    """A subset of ``combos`` (greedy, deterministic, none redundant) in which every pair of
    axis values that occurs together in some combination of ``combos`` occurs together in one
    of the subset."""
    def pairs(c):
        items = list(c.items())
        return {(a, b) for k, a in enumerate(items) for b in items[k + 1:]}

    todo = set().union(*(pairs(c) for c in combos)) if combos else set()
    chosen, left = [], list(combos)
    while todo:
        best = max(left, key=lambda c: len(pairs(c) & todo))  # the first of the best: deterministic
        chosen.append(best)
        left.remove(best)
        todo -= pairs(best)
    # greedy picks can be made redundant by later ones: drop each (latest first) whose pairs
    # the others cover
    for c in list(reversed(chosen)):
        rest = [o for o in chosen if o is not c]
        if pairs(c) <= set().union(*map(pairs, rest)):
            chosen = rest
    return sorted(chosen, key=combos.index)


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
    """{integration test id: the combinations it runs}: the job of every runnable (world-1)
    combination of both worlds in one of its world's W1_SHARDS tests; of every accepted world-2
    combination without TE in one of the W2_PARTS launches of its layout; of the TE world's
    world-2 combinations those of a pairwise cover per layout (:data:`TE_WORLD2_NOT_RUN` says
    why not all). A job runs once (:func:`distinct_jobs`): combinations with one job share it."""
    out = {}
    for world in WORLDS:
        jobs = distinct_jobs(world1_run(world))
        out.update({world1_id(world, i): jobs[i::W1_SHARDS[world]] for i in range(W1_SHARDS[world])})
        for layout in world2_layouts():
            mates = world2_accepted(world, layout)
            jobs = distinct_jobs(pairwise_cover(mates) if world == "te" else mates)
            out.update({world2_id(world, layout, p): jobs[p::W2_PARTS[world]]
                        for p in range(W2_PARTS[world])})
    return out


@functools.lru_cache(maxsize=None)
def sharing() -> dict:
    """{a combination whose job another's run trains: that combination}, for the run jobs."""
    run = shard_of()
    return {c: v.same_job_as for c, v in classified().items() if v.same_job_as in run}


TE_FLEX_NOT_RUN = (
    "the TE world's runnable world-1 flex combinations ({total}: the flex ones without TE "
    "crossed with the linear, FP8 and te_rng settings TE adds) train in a pairwise cover "
    "({run}) -- the flex "
    "backend's own path is the same in both worlds, and every flex combination without TE runs")
TE_WORLD2_NOT_RUN = (
    "the TE world's accepted world-2 combinations are too many to train in CI time ({total}, "
    "{jobs} distinct jobs: ~2 s of both cores each, ~{minutes} min); a pairwise cover of each "
    "layout's ({run}) runs -- "
    "every pair of axis values that occurs together in an accepted combination of the layout "
    "occurs together in one that runs")


@functools.lru_cache(maxsize=None)
def shard_of() -> dict:
    """{combination: the id of the integration test that runs it}."""
    return {c: name for name, combos in shards().items() for c in combos}


# ---------------------------------------------------------------------------- known bugs
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


# ---------------------------------------------------------------------------------- runner
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


# Wall times of the integration tests, measured (render() prints them as they are).
MEASURED: tuple = (
    "",
    "**Measured** (2026-11-28, from the junit of a clean-clone `CI=true bash .ci/run` at 84ad74c",
    "on this 2-core machine, nothing else running; the whole suite took 3,365 s): this module",
    "took 1,074 s, all its tests passing. Per test: `test_world_of_one_runs[0-1]` 31 s each",
    "(41-42 runs), `[te-0..3]` 141-145 s each (199-200 runs; 572 s in all); `test_world_of_two_runs`",
    "TP2 50 s (31 runs), PP2 57 s (45), EP2 69 s (42), CP2 27 s (16), the TE world's TP2 / PP2 /",
    "EP2 / CP2 42 / 40 / 52 / 37 s (19 / 25 / 25 / 21); classifying the TE world in a child",
    "process (`test_te_world_verdicts_are_current`) 38 s. Earlier the same day: 1,240 s with the",
    "same runs in 4 / 8 world-1 tests and 2 launches per layout without TE (more worker",
    "processes to start), and 1,665 s at 646b10e (each combination its own run, the straight",
    "run's steps counted by the sync sentinel; `[te-i]` 111-119 s each for 136-137 runs).",
    "With the flex runs (session 32: 36 world-1 and 57 world-2 runs without TE, the 17-run",
    "flex cover and 11 more world-2 cover runs with TE), this module took 1,271 s in a run of",
    "it alone on this machine (its first ~10 minutes beside other probes): `[0-1]` 46 / 47 s,",
    "`[te-0..3]` 142-155 s, TP2 / PP2 / EP2 / CP2 76 / 96 / 106 / 27 s, the TE world's 55 / 41 /",
    "62 / 40 s, the TE world's classification 45 s. In the clean-clone `CI=true bash .ci/run`",
    "at ff01c38 (the whole suite 3,640 s, all passing) it took 1,470 s.",
)


def render() -> str:
    """docs/feature-matrix.md, generated (test_listing_is_up_to_date keeps the file equal)."""
    verdicts = classified()
    lines = [
        "# Feature matrix",
        "",
        "Generated by `tests/train/test_feature_matrix.py::render` -- do not edit; regenerate with",
        "`.venv/bin/python -c \"from tests.train.test_feature_matrix import write; write()\"`",
        "(`test_listing_is_up_to_date` fails when this file and the generator differ).",
        "",
        "Every combination of the main job's features below is parsed by `parse_job_config` on",
        "`training.device=cuda` inside the GPU stand-ins (CUDA-as-CPU mode, fake CUDA graph,",
        "flash-attn and Transformer Engine attention stand-ins). Every accepted combination a CPU",
        "can train runs in the integration tier: 4 steps straight, saving a checkpoint at step 3",
        "(written while step 4 trains) and at the end, vs the step-3 checkpoint resumed (copied",
        "alone into a fresh directory) and step 4 trained, bit-identical (losses and learning",
        "rates of every step, the final parameters of every rank); with graphs on, layers are",
        "captured at the end of step 1 and replayed after it. The sync sentinel's modes are on",
        "in the resumed run's step only (`training.sync_check=off` in the straight run), so the",
        "comparison also shows that the diagnosis changes no number; that step must show exactly",
        "the host reads expected (`matrix_runs.expected_syncs`: none, but dropless expert",
        "parallelism's split sizes, once per layer and microbatch, and with sequence parallelism",
        "on Megatron's RNG tracker its CPU-state check, twice per microbatch; the stand-ins' own",
        "checks are unseen by the sentinel). A worker process",
        "(`tests/support/matrix_worker.py`) trains a shard's combinations one after the other:",
        "world 1 in 2 processes at once (the 2 cores), world 2 in one `torchrun` launch of 2.",
        "",
        *axes_table(axes()),
    ]
    lines += ["", "Fixed settings of every combination (besides tiny sizes: "
              f"`{' '.join(SIZES)}`):", ""]
    lines += [f"* `{k}`: {why}" for k, why in FIXED.items()]
    lines += [
        "",
        "## Counts",
        "",
        "The `transformer_engine` axis is the process: `absent` is this machine (no TE; the",
        "main job refuses what needs it), the other the fake TE (`tests/support/fake_te`:",
        "Megatron's TE wrappers on a stand-in that keeps TE 2.10's contracts) -- a GPU user's",
        "machine. The TE world is classified by a child process with the fake importable",
        "(`python -m tests.train.test_feature_matrix --classify-te`; the pytest process never imports TE) and its",
        "verdicts committed, run-length encoded, in `tests/train/feature_matrix_te.json`",
        "(`test_te_world_verdicts_are_current` re-classifies and compares).",
        "",
        "| | without TE | with the fake TE | all |",
        "| --- | --- | --- | --- |",
    ]
    by_world = {w: collections.Counter(v.status for c, v in verdicts.items() if world_of(c) == w)
                for w in WORLDS}
    run_by = collections.Counter(world_of(c) for c in shard_of())

    def row(name, a, b):
        return f"| {name} | {a} | {b} | {a + b} |"

    lines.append(row("product of the axes", sum(by_world["absent"].values()), sum(by_world["te"].values())))
    lines += [row(status, by_world["absent"][status], by_world["te"][status])
              for status in (NOT_SELECTABLE, REFUSED, RUN, WORLD2)]
    lines.append(row("run by the integration tests", run_by["absent"], run_by["te"]))
    shared_by = collections.Counter(world_of(c) for c in sharing())
    lines.append(row("trained by the run of another (the same job)", shared_by["absent"], shared_by["te"]))
    te_w2 = by_world["te"][WORLD2]
    te_w2_run = sum(1 for c in shard_of() if world_of(c) == "te" and c["layout"] != "1")
    te_w2_jobs = sum(len(distinct_jobs(world2_accepted("te", layout))) for layout in world2_layouts())
    lines += [
        "",
        f"**Runs.** The world-1 combinations are dealt round-robin to {W1_SHARDS['absent']}",
        f"tests without TE (`test_world_of_one_runs[i]`) and {W1_SHARDS['te']} with it",
        "(`test_world_of_one_runs[te-i]`), each 2 worker processes at once; the world-2 ones",
        f"without TE, per layout, to {W2_PARTS['absent']} `torchrun` launches",
        "(`test_world_of_two_runs[<layout>-<part>]`). Not every TE-world world-2 combination runs:",
        TE_WORLD2_NOT_RUN.format(total=te_w2, jobs=te_w2_jobs, minutes=round(te_w2_jobs * 2 / 60),
                                 run=te_w2_run) + ",",
        "one launch per layout (`test_world_of_two_runs[te-<layout>-0]`); and",
        TE_FLEX_NOT_RUN.format(total=len(te_flex_world1()),
                               run=len(te_flex_cover())) + ".",
        "The **full tier** trains the jobs of the rest, by hand, not in CI",
        f"(`{FULL_ENV}=<a directory> pytest tests/train/test_feature_matrix.py -k test_full_tier`:",
        f"{FULL_W1_PARTS} world-1 tests and {FULL_W2_PARTS} `torchrun` launches per layout, each part",
        "recording its result; `record_full_run` gathers them into",
        "`tests/train/feature_matrix_full_run.json`): see \"Accepted, not run in CI\".",
        "The flex backend, which has no backward on a CPU, trains on the test-only",
        "FlexAttention stand-in (`tests/support/flex_standin.py`: torch's real flex forward, a",
        "dense fp32 backward over the BlockMask's blocks, and the CUDA kernel's contracts, e.g.",
        "heads at least 16 wide: the matrix's flex combinations with 8-wide heads are refused",
        "by `rules._flex_head_dim`, those with 16 run). A test lists every",
        "combination it ran and fails listing every one that failed. **A job runs once**: a",
        "combination whose parsed job equals an earlier one's (`job_key`: the whole `JobConfig`",
        "with `fastpath.attention_backend` / `linear_impl` replaced by what the parse resolved",
        "them to, which is all the job reads) is trained by that run -- `auto` by the run of the",
        "backend it picks; the Run table names it. A run builds the job from",
        "the config tree the",
        "matrix classified (`config_tree`, checked equal to Hydra's composition by",
        "`test_config_tree_is_hydras_composition`), so no run composes with Hydra.",
        *MEASURED,
    ]
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
    for status in (NOT_SELECTABLE, WORLD2):
        groups = collections.defaultdict(list)
        for c, v in verdicts.items():
            if v.status == status:
                groups[v.reason].append(c)
        lines += ["", f"## {status[0].upper()}{status[1:]}", "", "| reason | combinations | which |",
                  "| --- | --- | --- |"]
        for reason, combos in sorted(groups.items()):
            lines.append(f"| {cell(reason)} | {len(combos)} | {cell(_group_description(combos))} |")
    record = full_record()
    passed = set(record["passed"]) if record else set()
    lines += ["", "## Accepted, not run in CI", "",
              "The TE world's accepted world-2 combinations outside the pairwise cover of their "
              "layout and its world-1 flex ones outside theirs (see Runs), and those whose job "
              "no CI run trains; the full tier (`test_full_tier`, by hand) trains them: "
              + (f"its last run, at {record['commit'][:7]} on {record['date']}, took "
                 f"{record['seconds']:,} s ({sum(len(v) for v in full_tier().values()):,} jobs "
                 f"now; {len(record['passed']):,} passed, {len(record['failures'])} failed)"
                 if record else "it has not run") + ".", "",
              "| layout | accepted | trained in CI (the cover's jobs) | trained by the full tier's last run | neither |",
              "| --- | --- | --- | --- | --- |"]
    groups = [("1 (flex)", te_flex_world1())] + [(layout_label(layout), world2_accepted("te", layout))
                                                 for layout in world2_layouts()]
    for name, every in groups:
        ci = [c for c in every if trained_by(c) in shard_of()]
        full = [c for c in every if trained_by(c) not in shard_of() and trained_by(c).label in passed]
        lines.append(f"| {name} | {len(every)} | {len(ci)} | {len(full)} | {len(every) - len(ci) - len(full)} |")
    if record and record["failures"]:
        lines += ["", "Failed in the full tier's last run:", ""]
        lines += [f"* {cell(f[:300])}" for f in record["failures"]]
    lines += ["", "## Run", "",
              "Every combination run and the integration test that runs it; a combination with "
              "the job of an earlier one is trained by that one's run. Known "
              "bugs: the expected failure is checked instead.", "",
              "| combination | run by | known bug |", "| --- | --- | --- |"]
    test_of = shard_of()
    for c in verdicts:
        if c in test_of or c in sharing():
            by = (f"`{test_of[c]}`" if c in test_of else
                  f"`{test_of[trained_by(c)]}` (the job of {trained_by(c).label})")
            bug = known_bug(trained_by(c))
            lines.append(f"| {c.label} | {by} | {bug.name if bug else ''} |")
    lines += ["", "## Known bugs", "", "| bug | combinations | what |", "| --- | --- | --- |"]
    if not KNOWN_BUGS:
        lines.append("| none | | |")
    for bug in KNOWN_BUGS:
        n = sum(1 for c in shard_of() if known_bug(c) is bug)
        lines.append(f"| {bug.name} | {n} run | {cell(bug.what)} |")
    return "\n".join(lines) + "\n"


def write() -> None:
    """Regenerate the TE world's verdicts (classified by a child process with the fake TE)
    and docs/feature-matrix.md."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        data = classify_te_world_in_child(Path(d))
    TE_VERDICTS.write_text(json.dumps(data, separators=(",", ":")) + "\n", encoding="utf-8")
    for cached in (classified, shards, shard_of, sharing, world2_accepted, te_flex_world1,
                   te_flex_cover, _values):
        cached.cache_clear()
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
        "on_cpu": "the matrix runs the GPU path (training.device=cuda)",
        # the TE world's verdicts are classified in a child and committed without their facts
        "linear_impl": "local without TE (te only with TE: the TE world's facts are not kept)",
        "packed_tokens": "data.max_tokens is one size (SIZES)",
        "megatron_optimizer_step": "training.optimizer_step is left auto",
    }
    unreachable = {"_te_grouped_linear_in_graphs": "the main job never builds te_grouped_linear",
                   "_full_iteration_megatron_step": "training.optimizer_step is left auto "
                                                    "(tests/train/test_full_iteration_graphs.py)",
                   "_fp8_attention_inputs": "the main job always packs: its attention is never TE's sbhd one"}
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


@pytest.mark.integration
def test_te_world_verdicts_are_current(tmp_path):
    """The TE world's committed verdicts are what a child process with the fake TE classifies
    now (the classifier checks each refusal against the rules there, as
    test_classification_follows_the_rules reads)."""
    import json

    fresh = classify_te_world_in_child(tmp_path)
    assert fresh == json.loads(TE_VERDICTS.read_text(encoding="utf-8")), (
        "tests/train/feature_matrix_te.json is stale: regenerate it with "
        "`python -c \"from tests.train.test_feature_matrix import write; write()\"`")


def test_listing_is_up_to_date():
    """Unit tier: docs/feature-matrix.md is what render() generates."""
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/feature-matrix.md is stale: regenerate it with "
        "`python -c \"from tests.train.test_feature_matrix import write; write()\"`")


def test_config_tree_is_hydras_composition():
    """Unit tier: the runs train ``config_tree(combo)``, not a Hydra composition of the overrides;
    the two are equal. config_tree sets each override's key on the model's composed tree, so
    composing with Hydra a set of run combinations in which every (model, override) pair of the
    run ones occurs checks it for all of them (an interpolation reading an overridden key, the
    one way they could differ, shows with that override)."""
    from omegaconf import OmegaConf

    from tests.support.hydra_compose import compose_job

    todo = {(c["model"], o) for c in shard_of() for o in c.overrides()}
    for combo in shard_of():
        pairs = {(combo["model"], o) for o in combo.overrides()}
        if pairs & todo:
            composed = OmegaConf.to_container(compose_job(BASE + combo.overrides()), resolve=True)
            composed.pop("hydra", None)
            assert composed == config_tree(combo), f"{combo.label}: Hydra's tree differs"
            todo -= pairs
    assert not todo


def test_every_accepted_combination_has_a_run():
    """Unit tier: the job of every runnable and every accepted world-2 combination (of the TE
    world's world-2 ones, the pairwise cover's) is in exactly one integration test's shard;
    a combination shares a run only with one whose job is its own."""
    runs = [c for combos in shards().values() for c in combos]
    covers = {c for layout in world2_layouts() for c in pairwise_cover(world2_accepted("te", layout))}
    flex_cover = set(te_flex_cover())
    wanted = [c for c, v in classified().items()
              if (v.status == RUN and (world_of(c) == "absent" or c["attention"] != "flex"
                                       or c in flex_cover))
              or (v.status == WORLD2 and (world_of(c) == "absent" or c in covers))]
    assert len(runs) == len(set(runs))
    assert set(runs) == {trained_by(c) for c in wanted}
    verdicts = classified()
    for c, rep in sharing().items():
        assert verdicts[rep].same_job_as is None and verdicts[c].status == verdicts[rep].status
        assert rep["layout"] == c["layout"] and world_of(rep) == world_of(c)
    live = [c for c in wanted if world_of(c) == "absent"]  # the jobs themselves (TE's: the JSON)
    assert all(verdicts[c].job == verdicts[trained_by(c)].job is not None for c in live)
    assert len(sharing()) > 0 and len(runs) < len(wanted)


RAW_SETTINGS = ("attention_backend", "linear_impl")  # what job_key replaces by the resolved values


def test_only_the_parse_reads_the_raw_backend_settings():
    """Unit tier: job_key's premise, read in the source -- ``fastpath.attention_backend`` and
    ``fastpath.linear_impl`` are read in train/config.py (the parse) and nowhere else in the
    package; the job reads the resolved ``JobConfig.attention_backend`` / ``linear_impl``."""
    import ast

    def raw_reads(tree):  # x.attention_backend where x is `fast`, `fastpath` or `<...>.fastpath`
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in RAW_SETTINGS:
                owner = node.value
                name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
                if name in ("fast", "fastpath"):
                    yield node

    package = REPO / "megatron_fastpath"
    readers = sorted({str(f.relative_to(package)) for f in package.rglob("*.py")
                      if any(raw_reads(ast.parse(f.read_text(encoding="utf-8"))))})
    assert readers == ["train/config.py"], readers


@pytest.mark.integration
def test_a_run_never_reads_the_raw_backend_settings(mcore_parallel, tmp_path):
    """Integration tier: job_key's premise, run -- ``auto`` MoE LoRA combinations with graphs
    and with offload (the two exclude each other) train straight and resumed with the
    parsed job's raw ``fastpath.attention_backend`` / ``linear_impl`` made unreadable (a read
    raises): after the parse only the resolved values are read (and the run's config recorded
    whole in the metrics files, ``metrics.jsonable``, which trains nothing)."""
    import sys

    from megatron_fastpath.train import config as train_config
    from megatron_fastpath.train.metrics import jsonable
    from tests.support.matrix_runs import straight_vs_resumed

    class Unreadable(train_config.FastpathConfig):
        def __getattribute__(self, name):
            # the run's config as recorded in the metrics files (W&B's run config) keeps them
            callers = (sys._getframe(1), sys._getframe(2))  # jsonable's dict comprehension, jsonable
            if name in RAW_SETTINGS and all(f.f_code is not jsonable.__code__ for f in callers):
                raise AssertionError(f"fastpath.{name} read after the parse")
            return object.__getattribute__(self, name)

    real = train_config.parse_job_config

    def parse(cfg):
        job = real(cfg)
        fast = Unreadable(**{f.name: getattr(job.fastpath, f.name)
                             for f in dataclasses.fields(train_config.FastpathConfig)})
        return dataclasses.replace(job, fastpath=fast)

    autos = [c for c in runnable() if c["attention"] == "auto" and c["experts"] is not NA and c["lora"]]
    with mock.patch("megatron_fastpath.train.parse_job_config", parse):
        for k, combo in enumerate([next(c for c in autos if c["graphs"]), next(c for c in autos if c["offload"])]):
            straight_vs_resumed(config_tree(combo), tmp_path / str(k), feature(combo))


def test_te_world1_flex_runs_cover_every_pair():
    """Unit tier: every pair of axis values occurring together in a runnable TE-world world-1
    flex combination occurs together in a run one; and the cover is smaller than the whole."""
    every, cover = te_flex_world1(), te_flex_cover()
    assert every and cover == pairwise_cover(every)
    _check_cover(every, cover, "world-1 flex")
    assert set(distinct_jobs(cover)) <= set(shard_of())
    assert all(c["attention"] == "flex" for c in every)


def test_te_world2_runs_cover_every_pair():
    """Unit tier: per layout, every pair of axis values occurring together in an accepted
    TE-world world-2 combination occurs together in a run one; and the cover is needed (no
    run combination can be dropped: it alone covers some pair)."""
    for layout in world2_layouts():
        every = world2_accepted("te", layout)
        cover = pairwise_cover(every)
        _check_cover(every, cover, layout)
        assert shards()[world2_id("te", layout, 0)] == distinct_jobs(cover)


def _check_cover(every: list, cover: list, what: str) -> None:
    """``cover`` is a pairwise cover of ``every``, smaller, and no combination of it redundant."""
    pairs = lambda c: {frozenset([a, b]) for a in c.items() for b in c.items() if a < b}  # noqa: E731
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


@pytest.mark.integration
def test_planted_host_read_in_captured_experts_fails_the_matrix(mcore_parallel, tmp_path, monkeypatch):
    """A contract break the matrix must catch: a ``.tolist()`` (host read) planted in the
    grouped_mm experts' forward fails the MoE + graphs combination at capture (the fake CUDA
    graph raises, as a GPU capture is invalidated); in the same combination with graphs off
    it trains, bit for bit, but the resumed run's counted step makes one host sync per layer
    and microbatch where none is expected (``matrix_runs.expected_syncs``): that fails too."""
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
    layers_x_micro = 2 * 2  # model.num_layers x training.micro_batches (SIZES)
    with pytest.raises(AssertionError, match=f"^{layers_x_micro} host syncs in the counted step, "
                                             "expected 0"):
        run_combination(eager, tmp_path / "eager")


# ------------------------------------------------------------------- the runs (matrix_worker)
TIMEOUT = 1800  # s, one launch (~15-35 combinations, ~2-3 s each on an idle machine)


def _start(combos: list, d: Path, nproc: int):
    """A launch of tests/support/matrix_worker.py training ``combos`` (under torchrun when
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
                       entry=["-m", "tests.support.matrix_worker"])
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


@pytest.mark.integration
@pytest.mark.parametrize("world,index", [pytest.param(w, i, id=f"{'te-' if w == 'te' else ''}{i}")
                                         for w in WORLDS for i in range(W1_SHARDS[w])])
def test_world_of_one_runs(tmp_path, capsys, world, index):
    """Integration tier: a shard of the runnable (world-1) combinations of one
    ``transformer_engine`` world in 2 processes at once (the machine's 2 cores; with the fake
    TE importable for the TE world), each training its half one after the other
    (tests/support/matrix_worker.py): straight vs resumed (matrix_runs.straight_vs_resumed)."""
    combos = shards()[world1_id(world, index)]
    lines, failures = _run_world1(combos, tmp_path)
    _report(world1_id(world, index), lines + _shared_lines(combos), failures, capsys)
    assert failures == []
    assert len(lines) == len(combos)


@pytest.mark.integration
@pytest.mark.parametrize("world,layout,part", [
    pytest.param(w, layout, part, id=f"{'te-' if w == 'te' else ''}{layout_label(layout)}-{part}")
    for w in WORLDS for layout in world2_layouts() for part in range(W2_PARTS[w])])
def test_world_of_two_runs(tmp_path, capsys, world, layout, part):
    """Integration tier: a shard of the world-2 combinations of one layout and world, in ONE
    ``torchrun`` launch of 2 processes (gloo, each inside the GPU stand-ins) that trains them one
    after the other (tests/support/matrix_worker.py): straight vs resumed, the losses and
    learning rates on both ranks and each rank's final parameters equal."""
    combos = shards()[world2_id(world, layout, part)]
    assert combos
    lines, failures = _finish(combos, *_start(combos, tmp_path / "launch", 2), 2)
    _report(world2_id(world, layout, part), lines + _shared_lines(combos), failures, capsys)
    assert failures == []
    assert len(lines) == len(combos)


# ------------------------------------------------------- the full tier (run by hand, not in CI)
FULL_ENV = "FASTPATH_FULL_MATRIX"  # a directory: set, the full tier runs and each part records there
FULL_RECORD = REPO / "tests" / "train" / "feature_matrix_full_run.json"
FULL_W1_PARTS = 2  # tests for the TE world's world-1 flex jobs outside the CI cover
FULL_W2_PARTS = 16  # torchrun launches per layout for its TE-world world-2 jobs outside the CI cover


def full_ids() -> list:
    """The full tier's test ids (known without classifying: parts and layouts)."""
    return ([f"w1-{i}" for i in range(FULL_W1_PARTS)]
            + [f"{layout_label(layout)}-{p}" for layout in world2_layouts() for p in range(FULL_W2_PARTS)])


@functools.lru_cache(maxsize=None)
def full_tier() -> dict:
    """{full-tier id: combinations}: the jobs of the TE world's accepted combinations that no
    CI run trains (:data:`TE_WORLD2_NOT_RUN`, :data:`TE_FLEX_NOT_RUN`) -- the world-1 flex ones
    dealt round-robin to ``FULL_W1_PARTS`` tests, each layout's world-2 ones to
    ``FULL_W2_PARTS`` launches. With the CI runs, every accepted combination's job."""
    ci = set(shard_of())
    flex = [c for c in distinct_jobs(te_flex_world1()) if c not in ci]
    out = {f"w1-{i}": flex[i::FULL_W1_PARTS] for i in range(FULL_W1_PARTS)}
    for layout in world2_layouts():
        rest = [c for c in distinct_jobs(world2_accepted("te", layout)) if c not in ci]
        out.update({f"{layout_label(layout)}-{p}": rest[p::FULL_W2_PARTS] for p in range(FULL_W2_PARTS)})
    return out


def test_ci_and_the_full_tier_train_every_accepted_job():
    """Unit tier: the CI runs and the full tier's parts together train the job of every
    accepted combination of both worlds, each job once; the full tier only the TE world's."""
    accepted = [c for c, v in classified().items() if v.status in (RUN, WORLD2)]
    ci = [c for combos in shards().values() for c in combos]
    full = [c for combos in full_tier().values() for c in combos]
    assert len(ci) + len(full) == len(set(ci) | set(full))
    assert set(ci) | set(full) == set(distinct_jobs(accepted))
    assert full and all(world_of(c) == "te" for c in full)
    assert sorted(full_tier()) == sorted(full_ids()) and all(full_tier().values())


def _full_params() -> list:
    import os

    if not os.environ.get(FULL_ENV):
        return [pytest.param(None, id="off", marks=pytest.mark.skip(
            reason=f"the full tier (~70 min on 2 cores) runs with {FULL_ENV}=<a directory for its records>"))]
    return [pytest.param(part, id=part) for part in full_ids()]


@pytest.mark.integration
@pytest.mark.parametrize("part", _full_params())
def test_full_tier(tmp_path, capsys, part):
    """The full tier, by hand (``FASTPATH_FULL_MATRIX=<dir> pytest -k test_full_tier``): the TE
    world's accepted combinations the CI runs leave out (:func:`full_tier`), trained as the CI
    runs train theirs (world 1 in 2 processes at once, world 2 in one ``torchrun`` launch);
    each part writes ``<dir>/<part>.json`` (:func:`record_full_run` gathers them into
    ``tests/train/feature_matrix_full_run.json``, which docs/feature-matrix.md reports)."""
    import json
    import os
    import time

    combos = full_tier()[part]
    start = time.monotonic()
    if part.startswith("w1-"):
        lines, failures = _run_world1(combos, tmp_path)
    else:
        lines, failures = _finish(combos, *_start(combos, tmp_path / "launch", 2), 2)
    Path(os.environ[FULL_ENV], f"{part}.json").write_text(json.dumps({
        "part": part, "commit": _head_commit(), "date": datetime.date.today().isoformat(),
        "seconds": round(time.monotonic() - start, 1),
        "passed": _passed_labels(combos, failures), "failures": failures}, indent=1))
    _report(f"test_full_tier[{part}]", lines, failures, capsys)
    assert failures == []
    assert len(lines) == len(combos)


def full_record() -> Optional[dict]:
    """The full tier's last run (:data:`FULL_RECORD`), or None when it has not run."""
    import json

    return json.loads(FULL_RECORD.read_text()) if FULL_RECORD.exists() else None


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


def test_record_full_run_gathers_every_part(tmp_path):
    """Unit tier: the record holds every part's counts and failures, the passed labels sorted,
    the parts' one commit and last date; parts at two commits are refused."""
    import json

    for k, part in enumerate(full_ids()):
        Path(tmp_path, f"{part}.json").write_text(json.dumps({
            "part": part, "commit": "c0", "date": f"2026-11-{28 + (k == 1)}", "seconds": 1.5,
            "passed": [f"{part} b", f"{part} a"], "failures": ["x fp8:mxfp8 TP2: boom"] if k == 0 else []}))
    record_full_run(str(tmp_path), tmp_path / "record.json")
    got = json.loads((tmp_path / "record.json").read_text())
    n = len(full_ids())
    assert (got["commit"], got["date"], got["seconds"]) == ("c0", "2026-11-29", round(1.5 * n))
    assert got["failures"] == ["x fp8:mxfp8 TP2: boom"] and len(got["passed"]) == 2 * n
    assert got["passed"] == sorted(got["passed"]) and got["parts"]["w1-0"] == {"passed": 2, "failed": 1, "seconds": 1.5}
    Path(tmp_path, "w1-1.json").write_text(json.dumps(dict(
        json.loads(Path(tmp_path, "w1-1.json").read_text()), commit="c1")))
    with pytest.raises(AssertionError, match="different commits"):
        record_full_run(str(tmp_path), tmp_path / "record.json")


def test_a_failed_label_with_colons_is_not_recorded_passed():
    """Unit tier: a failure names its combination by the whole label, colons and all."""
    combos = [mock.Mock(label="TE2.10.0 dense fp8:mxfp8 TP2"), mock.Mock(label="TE2.10.0 dense fp8:mxfp8 lora TP2")]
    failures = ["TE2.10.0 dense fp8:mxfp8 TP2: rank 0 at straight: AssertionError: x"]
    assert _passed_labels(combos, failures) == ["TE2.10.0 dense fp8:mxfp8 lora TP2"]


if __name__ == "__main__":  # the TE world's classifier: python -m tests.train.test_feature_matrix --classify-te OUT
    import json
    import sys

    from tests.support.fake_te.activate import activate

    assert sys.argv[1] == "--classify-te", sys.argv
    activate()  # before Megatron is imported (this module imports it lazily): HAVE_TE at import
    Path(sys.argv[2]).write_text(json.dumps(encode_verdicts(classify_world(True))), encoding="utf-8")
