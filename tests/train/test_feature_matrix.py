"""Tests of the feature matrix in tests/train/feature_matrix/ (described in its package docstring;
``doc.py`` there renders its page)."""

from __future__ import annotations

import collections
import dataclasses
import datetime
from pathlib import Path
from unittest import mock

import pytest

from tests.support.matrix import NA
from tests.train.feature_matrix.matrix import (
    BASE, Combo, DOC, FULL_ENV, RAW_SETTINGS, REFUSED, REPO, RUN, TE_VERDICTS, W1_SHARDS, W2_PARTS,
    WORLD2, WORLDS, _check_cover, _finish, _full_params, _head_commit, _moe_graphs_combo,
    _passed_labels, _report, _run_world1, _shared_lines, _start, classified,
    classify_te_world_in_child, config_tree, distinct_jobs, feature, full_ids, full_tier,
    accepted, ci_cover, layout_label, pairwise_cover, record_full_run, run_combination, run_groups,
    runnable, shard_of, shards, sharing, trained_by, world1_id, world2_id, world2_layouts,
    world_of,
)
from tests.train.feature_matrix.doc import render


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
        "pad_multiple": "data.pad_multiple is left at its default (tests/train/test_packing_across_cp.py)",
        "logit_transforms": "the tiny models transform no logits (Gemma 2's soft-capping: tests/test_rules.py)",
    }
    # the parallel group's data-parallel optimizer settings are left null and the matrix parses
    # at a world of 1 (DP 1: they resolve off); tests/train/test_distributed_optimizer_torchrun.py
    # runs them at DP 2, tests/train/test_parallel_optimizer_settings.py parses and refuses them
    fixed_in_main_job.update(dict.fromkeys(
        ("distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "bucket_size"),
        "parallel.distributed_optimizer / overlaps / bucket_size: null, resolved at DP 1"))
    unreachable = {"_te_grouped_linear_in_graphs": "the main job never builds te_grouped_linear",
                   "_full_iteration_megatron_step": "training.optimizer_step is left auto "
                                                    "(tests/train/test_full_iteration_graphs.py)",
                   "_fp8_attention_inputs": "the main job always packs: its attention is never TE's sbhd one",
                   "_data_parallel_optimizer": "the parallel group's optimizer settings are left "
                                               "null (tests/train/test_parallel_optimizer_settings.py)",
                   "_data_parallel_in_full_iteration": "the parallel group's optimizer settings are "
                                                       "left null (test_parallel_optimizer_settings.py)",
                   "_pad_multiple": "data.pad_multiple is left at its default, which covers the "
                                    "matrix's CP 2 (tests/test_rules.py refuses the others)",
                   "_linear_cross_entropy": "the tiny models transform no logits (tests/test_rules.py "
                                            "refuses the chunked loss with a Gemma 2 checkpoint)"}
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
        "`python -c \"from tests.train.feature_matrix.doc import write; write()\"`")


def test_listing_is_up_to_date():
    """Unit tier: docs/feature-matrix.md is what render() generates."""
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/feature-matrix.md is stale: regenerate it with "
        "`python -c \"from tests.train.feature_matrix.doc import write; write()\"`")


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
    """Unit tier: the job of every combination of each run group's pairwise cover is in exactly
    one integration test's shard; a combination shares a run only with one whose job is its
    own."""
    runs = [c for combos in shards().values() for c in combos]
    wanted = [c for world, layout in run_groups() for c in ci_cover(world, layout)]
    assert len(runs) == len(set(runs))
    assert set(runs) == {trained_by(c) for c in wanted}
    verdicts = classified()
    for c, rep in sharing().items():
        assert verdicts[rep].same_job_as is None and verdicts[c].status == verdicts[rep].status
        assert rep["layout"] == c["layout"] and world_of(rep) == world_of(c)
    live = [c for c in wanted if world_of(c) == "absent"]  # the jobs themselves (TE's: the JSON)
    assert all(verdicts[c].job == verdicts[trained_by(c)].job is not None for c in live)
    assert len(sharing()) > 0


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
    with mock.patch("megatron_fastpath.train.loop.parse_job_config", parse):
        for k, combo in enumerate([next(c for c in autos if c["graphs"]), next(c for c in autos if c["offload"])]):
            straight_vs_resumed(config_tree(combo), tmp_path / str(k), feature(combo))


def test_ci_runs_cover_every_pair():
    """Unit tier: per run group (world 1 and each layout of 2, per world), every pair of axis
    values occurring together in an accepted combination occurs together in one whose job a
    CI test trains; the cover is needed (each of its combinations alone covers some pair) and
    smaller than the group."""
    for world, layout in run_groups():
        every, cover = accepted(world, layout), ci_cover(world, layout)
        assert every and cover == pairwise_cover(every), (world, layout)
        _check_cover(every, cover, f"{world} {layout}")
        assert set(distinct_jobs(cover)) <= set(shard_of())


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


@pytest.mark.integration
@pytest.mark.parametrize("world,index", [pytest.param(w, i, id=f"{'te-' if w == 'te' else ''}{i}")
                                         for w in WORLDS for i in range(W1_SHARDS[w])])
def test_world_of_one_runs(tmp_path, capsys, world, index):
    """Integration tier: a shard of the runnable (world-1) combinations of one
    ``transformer_engine`` world in 2 processes at once (the machine's 2 cores; with the fake
    TE importable for the TE world), each training its half one after the other
    (tests/workers/matrix_worker.py): straight vs resumed (matrix_runs.straight_vs_resumed)."""
    combos = shards()[world1_id(world, index)]
    lines, failures = _run_world1(combos, tmp_path)
    _report(world1_id(world, index), lines + _shared_lines(combos), failures, capsys)
    assert failures == []
    assert len(lines) == len(combos)


@pytest.mark.integration
@pytest.mark.parametrize("world,part", [pytest.param(w, part, id=f"{'te-' if w == 'te' else ''}{part}")
                                        for w in WORLDS for part in range(W2_PARTS[w])])
def test_world_of_two_runs(tmp_path, capsys, world, part):
    """Integration tier: the world-2 combinations of one world, every layout's, in ONE
    ``torchrun`` launch of 2 processes (gloo, each inside the GPU stand-ins) that trains them one
    after the other, layout after layout (tests/workers/matrix_worker.py): straight vs resumed,
    the losses and learning rates on both ranks and each rank's final parameters equal."""
    combos = shards()[world2_id(world, part)]
    assert combos and {world_of(c) for c in combos} == {world}
    assert {c["layout"] for c in combos} == set(world2_layouts()) or W2_PARTS[world] > 1
    lines, failures = _finish(combos, *_start(combos, tmp_path / "launch", 2), 2)
    _report(world2_id(world, part), lines + _shared_lines(combos), failures, capsys)
    assert failures == []
    assert len(lines) == len(combos)


def test_ci_and_the_full_tier_train_every_accepted_job():
    """Unit tier: the CI runs and the full tier's parts together train the job of every
    accepted combination of both worlds, each job once; the full tier trains most of them."""
    every = [c for c, v in classified().items() if v.status in (RUN, WORLD2)]
    ci = [c for combos in shards().values() for c in combos]
    full = [c for combos in full_tier().values() for c in combos]
    assert len(ci) + len(full) == len(set(ci) | set(full))
    assert set(ci) | set(full) == set(distinct_jobs(every))
    assert len(full) > 4 * len(ci) and {world_of(c) for c in full} == set(WORLDS)
    assert sorted(full_tier()) == sorted(full_ids()) and all(full_tier().values())


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
    first, second = full_ids()[:2]
    assert got["passed"] == sorted(got["passed"]) and got["parts"][first] == {"passed": 2, "failed": 1, "seconds": 1.5}
    Path(tmp_path, f"{second}.json").write_text(json.dumps(dict(
        json.loads(Path(tmp_path, f"{second}.json").read_text()), commit="c1")))
    with pytest.raises(AssertionError, match="different commits"):
        record_full_run(str(tmp_path), tmp_path / "record.json")


def test_a_failed_label_with_colons_is_not_recorded_passed():
    """Unit tier: a failure names its combination by the whole label, colons and all."""
    combos = [mock.Mock(label="TE2.10.0 dense fp8:mxfp8 TP2"), mock.Mock(label="TE2.10.0 dense fp8:mxfp8 lora TP2")]
    failures = ["TE2.10.0 dense fp8:mxfp8 TP2: rank 0 at straight: AssertionError: x"]
    assert _passed_labels(combos, failures) == ["TE2.10.0 dense fp8:mxfp8 lora TP2"]
