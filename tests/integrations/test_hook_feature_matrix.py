"""Tests of the feature matrix in tests/integrations/hook_feature_matrix/ (described in its package docstring;
``doc.py`` there renders its page)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from pathlib import Path

import pytest

from tests.support.matrix import NA, value_pairs
from tests.integrations.hook_feature_matrix.matrix import (
    BUILD, Combo, DOC, FIXED_BY_THE_MODEL, FULL_ENV, LAUNCHES, NOT_CROSSED, NOT_SET_BY_HOOKS, ONE_AWAY,
    REFUSED, REQUEST_AXES, RUN, RUN2_TE, RUN_STATUSES, RUN_TE, STATUSES, T, UNREACHABLE_MESSAGES,
    UNREACHABLE_RULES, WORLD2, _CAPABILITY, _gpu, _of_layout, _resolved, _swap,
    _without_recipe_rules, axes, child_launches, ci_runs, classified, classify, combinations,
    facts_and_request, first_runnable, hook_messages, lone_reasons, message_kind, model_config,
    one_away, run_combination, runnable, runs, selected,
)
from tests.integrations.hook_feature_matrix.doc import render


def test_classification_follows_the_rules():
    """Unit tier: every refusal is hook-only reasons core.py writes, then the rules' reasons for
    run_facts (verbatim, in order); decide raises them all; every accepted plan makes settings
    and is not refused by the rules."""
    from megatron_fastpath import rules

    problems = [f"{c.label}: {v.problem}" for c, v in classified().items() if v.problem]
    assert problems == []
    counts = collections.Counter(v.status for v in classified().values())
    assert all(counts[s] for s in STATUSES if s not in (BUILD, WORLD2)), counts
    # nothing the hook accepts is refused when the model is built: the hook refuses it while
    # planning, before the framework's config is written (te / flash with an fp32 model were)
    assert counts[BUILD] == 0, counts
    # every accepted layout of 2 processes runs
    assert counts[WORLD2] == 0, counts
    for v in classified().values():
        if v.status != REFUSED:
            assert rules.refusals(v.facts) == [] and v.plan is not None


def test_matrix_reaches_every_rule_and_every_fact():
    """Every shared rule refuses some combination (or is listed with why it cannot from the
    hooks) and every RunFacts field the hooks set takes two values across the matrix."""
    from megatron_fastpath import rules

    verdicts = classified().values()
    fired = {k for v in verdicts for k in v.kinds if ":" not in k}
    assert fired == {r.__name__ for r in rules.RULES} - set(UNREACHABLE_RULES)
    facts = [v.facts for v in verdicts]
    defaults = rules.RunFacts(names=rules.NAMES["bridge"])
    for f in dataclasses.fields(rules.RunFacts):
        values = {getattr(x, f.name) for x in facts}
        if f.name in NOT_SET_BY_HOOKS:
            assert values == {getattr(defaults, f.name)}, (f.name, values)
        elif f.name in FIXED_BY_THE_MODEL:
            assert len(values) == 1 and None not in values, (f.name, values)
        else:
            assert len(values) >= 2, f"RunFacts.{f.name} never varies in the matrix: add an axis"


def test_every_request_field_is_an_axis_or_said_why():
    from megatron_fastpath.integrations import core

    fields = {f.name for f in dataclasses.fields(core.HookRequest)}
    assert fields == set(REQUEST_AXES) | set(NOT_CROSSED)
    assert set(REQUEST_AXES.values()) <= {a.name for a in axes()}


def test_not_crossed_fields_do_what_the_listing_says():
    """fp8_recipe changes no plan, and no refusal but those of the two rules that read it: the
    FP8 GEMM shapes (MXFP8 at TP 2 / CP 2: a 16-wide split or 16 packed tokens on a rank,
    blocks of 32) and FP8 attention (recipes it does not run with); max_seqs / max_seqlen are accepted up to
    the packed size and refused with their bound above it and at 0."""
    from megatron_fastpath import rules
    from megatron_fastpath.integrations import core
    from megatron_fastpath.integrations._runtime import FastpathSettings

    mxfp8_split = 0
    HALVED = ("tensor_model_parallel_size=2", "context_parallel_size=2")  # 32 -> 16 on a rank
    with _gpu():
        sample = [c for i, c in enumerate(combinations()) if i % 97 == 0]
        for c in sample:
            _CAPABILITY[0] = None if c["gpu"] is NA else c["gpu"]
            facts, request = facts_and_request(c)
            want = core.refusals(facts, request)
            for recipe in ("delayed", "tensorwise", "mxfp8", "blockwise"):
                r = dataclasses.replace(request, fp8_recipe=recipe)
                got = core.refusals(facts, r)
                if got != want:  # only the rules that read the recipe
                    assert _without_recipe_rules(got, facts, r) == _without_recipe_rules(want, facts, request), (
                        c.label, recipe, got, want)
                    gemms = rules._fp8_gemm_shapes(core.run_facts(facts, r))
                    if gemms in got:  # MXFP8's blocks of 32, broken by a 16-wide split on a TP / CP rank
                        assert recipe == "mxfp8" and c["layout"] in HALVED, (c.label, gemms)
                        mxfp8_split += 1
                elif not want:
                    assert core.plan(facts, r) == core.plan(facts, request)
        assert mxfp8_split, "the sample reaches no MXFP8 refusal of a 16-wide split"
        facts, request = facts_and_request(first_runnable())
        for field in ("max_seqs", "max_seqlen"):
            plan = core.plan(facts, dataclasses.replace(request, **{field: T}))
            assert plan.settings[field] == T and FastpathSettings(**plan.settings)
            for bad in (0, T + 1):
                reasons = core.refusals(facts, dataclasses.replace(request, **{field: bad}))
                assert reasons == [f"{field}={bad} must be in [1, packed_sequence_size={T}]"], reasons


def test_lone_refusals_refuse_every_accepted_combination():
    """The reduction's claim: a value the generator treats as refused on its own is refused,
    for one of the reasons it has in the product, in every accepted combination (every 5th)
    it can be swapped into."""
    accepted = [c for c, v in classified().items() if v.status != REFUSED]
    claims = lone_reasons()
    assert claims and all(claims.values())
    with _gpu():
        for (name, value), kinds in sorted(claims.items(), key=str):
            tried = 0
            for c in accepted[::5]:
                swapped = _swap(c, name, value)
                if swapped is None:
                    continue
                prefix = dict(itertools.takewhile(lambda kv: kv[0] != name, swapped.items()))
                if not axes()[Combo.index()[name]].alone(prefix, value):
                    continue
                verdict = classify(swapped)
                assert verdict.status == REFUSED and set(verdict.kinds) & kinds, (
                    f"{name}={value} in {swapped.label}: {verdict.reasons}")
                tried += 1
            assert tried, (name, value)


def test_every_hook_message_is_reached():
    """Every message core.py writes is the reason of some combination of the matrix or of a
    combination one listed setting away from a runnable one (ONE_AWAY); MoEDispatchConfig's
    checks of values a TransformerConfig cannot hold are listed as unreachable."""
    from megatron_fastpath.integrations import core

    reached = {k for v in classified().values() for k in v.kinds}
    with _gpu():
        for name in ONE_AWAY:
            _CAPABILITY[0] = None
            reasons = core.refusals(*one_away(name))
            assert len(reasons) == 1 and message_kind(reasons[0]), (name, reasons)
            reached.add(message_kind(reasons[0]))
    want = {k for k in hook_messages() if not k.startswith(UNREACHABLE_MESSAGES)}
    assert want - reached == set()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hook_layer_spec_resolves_auto_by_the_model_dtype(dtype):
    """The hooks' layer spec resolves ``auto`` with the model dtype, as the classifier's build
    check and the main job do: on a GPU with flash-attn, an fp32 model gets sdpa (before, the
    spec resolved without the dtype, picked flash, and the fp32 model failed to build)."""
    from megatron_fastpath.integrations import FastpathLayerSpec, FastpathSettings, clear_caches
    from tests.support.graph_safe_standins import gpu_standins

    config = model_config("dense", NA, dtype, 1, NA, NA)
    clear_caches()
    try:
        with gpu_standins():
            spec = FastpathLayerSpec(FastpathSettings(max_tokens=T, max_seqs=4))(config)
    finally:
        clear_caches()
    core_attention = spec.submodules.self_attention.submodules.core_attention
    assert core_attention.params["backend"] == _resolved("auto", dtype)
    assert _resolved("auto", dtype) == {"float32": "sdpa", "bfloat16": "flash"}[dtype]


def test_listing_is_up_to_date():
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/hook-feature-matrix.md is stale: regenerate it with `.venv/bin/python -c \"from "
        "tests.integrations.hook_feature_matrix.doc import write; write()\"`")


def test_ci_runs_cover_every_pair_of_each_launch():
    """Unit tier: of each status and layout, the CI's runs are distinct builds (one per build
    group) and every pair of axis values that some runnable combination of it has is in a
    combination whose build the CI runs; the full tier runs every distinct build."""
    total = 0
    for status, layout in [(RUN, "1"), *child_launches()]:
        chosen = ci_runs(status, layout)
        builds = selected(status)
        assert chosen and set(chosen) <= set(_of_layout(status, layout)), (status, layout)
        members = [m for c in chosen for m in builds[c]]
        want = set().union(*(value_pairs(c) for c in runnable(status) if c["layout"] == layout))
        assert want <= set().union(*map(value_pairs, members)), (status, layout)
        total += len(chosen)
    assert total < sum(len(_of_layout(s, lay)) for s, lay in [(RUN, "1"), *child_launches()]) / 3


def test_full_tier_switch_runs_every_build(monkeypatch):
    monkeypatch.delenv(FULL_ENV, raising=False)
    assert runs(RUN, "1") == ci_runs(RUN, "1")
    monkeypatch.setenv(FULL_ENV, "/tmp/anywhere")
    assert runs(RUN, "1") == _of_layout(RUN, "1") == list(selected())


@pytest.mark.integration
def test_hook_feature_matrix_runs(mcore_parallel, capsys):
    """Integration tier: the runnable combinations of this process (the CI's pairwise cover of
    them, :func:`ci_runs`; every distinct build in the full tier), built as the hooked config
    builds it, one forward + backward inside the GPU stand-ins."""
    from megatron_fastpath.integrations import clear_caches
    from tests.support.graph_safe_standins import gpu_standins

    results, failures = [], []
    try:
        for combo in runs(RUN, "1"):
            try:
                with gpu_standins():
                    results.append((combo.label, run_combination(combo)))
            except Exception as exc:  # noqa: BLE001 -- listed below, the test fails
                failures.append(f"{combo.label}: {type(exc).__name__}: {str(exc)[:400]}")
    finally:
        clear_caches()
    with capsys.disabled():
        print("\nhook feature matrix runs:")
        for label, what in results:
            print(f"  run  {label}  {what}")
        for f in failures:
            print(f"  FAIL {f}")
    assert failures == []


@pytest.mark.integration
@pytest.mark.parametrize("status", [pytest.param(s, id=RUN_STATUSES[s]) for s in dict.fromkeys(s for s, _ in LAUNCHES)])
def test_hook_feature_matrix_child_runs(status, tmp_path, capsys):
    """Integration tier: the runnable combinations this process cannot run -- those that build
    Transformer Engine modules beyond its attention (the fake TE 2.10 is imported in a child
    only) and those of 2 processes (torchrun) -- the CI's pairwise cover of each launch's, or
    every distinct build in the full tier -- run as :func:`test_hook_feature_matrix_runs` runs
    the others, in a child process: one per status, its layouts one after the other (one
    start and one import per status, not per layout). The child classifies each combination
    it is handed itself: the status must be this process's."""
    import json
    import subprocess

    from tests.support.fake_te.activate import te_env
    from tests.support.main_job import job_env, main_job_cmd

    layouts = [layout for s, layout in child_launches() if s == status]
    assert layouts, "a launch with nothing to run"
    assert layouts == ["1"] or "1" not in layouts, "a launch is of world 1 or of world 2"
    want = [c for layout in layouts for c in runs(status, layout)]
    nproc = 2 if layouts != ["1"] else 1
    out, spec = tmp_path / "runs", tmp_path / "labels.json"
    spec.write_text(json.dumps([c.label for c in want]))
    cmd = main_job_cmd(["run", RUN_STATUSES[status], str(spec), str(out)], nproc=nproc,
                       entry=["-m", "tests.workers.hook_matrix_worker"])
    proc = subprocess.run(cmd, cwd=tmp_path, env=te_env() if status in (RUN_TE, RUN2_TE) else job_env(),
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    failures, lines = [], []
    for rank in range(nproc):
        got = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert [r["label"] for r in got["runs"]] == [c.label for c in want], rank
        failures += [f"rank {rank}: {r['label']}: {r['error']}" for r in got["runs"] if not r["ok"]]
        if rank == 0:
            lines = [f"  {'run ' if r['ok'] else 'FAIL'} {r['label']}  {r.get('what', r.get('error'))}"
                     for r in got["runs"]]
    with capsys.disabled():
        print(f"\nhook feature matrix runs ({status}, {', '.join(layouts)}):", *lines, sep="\n")
    assert failures == []
