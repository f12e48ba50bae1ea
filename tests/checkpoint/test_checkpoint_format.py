"""The checkpoint's format: named parts, each under its own key (format 2), a format-1 checkpoint
(one ``extra`` dict, the run history's keys mixed in) still resumes exactly, any other format is
refused with what, why and the fix -- and never fallen back from -- and a part that is not plain
JSON is refused before anything is written."""

import json
import os

import pytest
import torch
from tests.checkpoint.ckpt_harness import JsonPart, Run
from tests.support.checkpoint_files import as_format_1, records, rewrite_train_state
from tests.support.hydra_compose import compose_job

from megatron_fastpath.checkpoint import CheckpointFormatError
from megatron_fastpath.checkpoint.train_state import FORMAT_VERSION
from megatron_fastpath.train import run

STEPS, STOP = 6, 3
FAST = [f"training.steps={STEPS}", "data.num_samples=256", "model.num_layers=2",
        "model.hidden_size=64", "model.ffn_hidden_size=160", "data.max_tokens=256",
        "training.lr=5e-3"]


@pytest.mark.integration
def test_main_job_saves_each_part_under_its_own_key(mcore_parallel, tmp_path):
    d = tmp_path / "ckpt"
    first = run(compose_job(FAST + [f"checkpoint.dir={d}", f"training.stop_at_step={STOP}"]))
    with open(d / f"step_{STOP:08d}" / "train_state.json") as f:
        state = json.load(f)
    assert state["format_version"] == FORMAT_VERSION == 2 and "extra" not in state
    parts = state["parts"]
    assert list(parts) == ["optimizer", "scheduler", "data", "history"]
    assert parts["optimizer"]["step"] == STOP and parts["data"]["next_step"] == STOP + 1
    assert set(parts["history"]) == {"records", "evals", "eval_accuracy"}
    assert [r["step"] for r in parts["history"]["records"]] == [1, 2, 3]
    assert [r["loss"] for r in parts["history"]["records"]] == [r.loss for r in first.records]


@pytest.mark.integration
def test_format_1_checkpoint_resumes_exactly(mcore_parallel, tmp_path, capsys):
    d = tmp_path / "ckpt"
    _, job_s = run(compose_job(FAST + [f"training.summary_json={tmp_path}/straight.json"]), return_job=True)
    run(compose_job(FAST + [f"checkpoint.dir={d}", f"training.stop_at_step={STOP}"]))
    rewrite_train_state(d / f"step_{STOP:08d}", as_format_1)
    capsys.readouterr()
    resumed, job_r = run(compose_job(FAST + [f"checkpoint.dir={d}", f"training.summary_json={tmp_path}/resumed.json"]),
                         return_job=True)
    out = capsys.readouterr().out
    assert f"loaded {d}/step_{STOP:08d}: {STOP} of {STEPS} steps done" in out
    assert resumed.resumed_from == f"{d}/step_{STOP:08d}"
    assert records(tmp_path / "resumed.json") == records(tmp_path / "straight.json")  # bit-identical
    for (k, a), (_, b) in zip(job_s.model.state_dict().items(), job_r.model.state_dict().items()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), k
    with open(d / f"step_{STEPS:08d}" / "train_state.json") as f:  # the next save: format 2
        assert json.load(f)["format_version"] == FORMAT_VERSION


@pytest.mark.parametrize("version, why", [
    (3, "written by a newer version: resume it with that version"),
    (0, "not written by megatron_fastpath"),
    (None, "not written by megatron_fastpath"),
])
def test_other_formats_are_refused_saying_what_why_and_the_fix(mcore_parallel, tmp_path, version, why):
    run_ = Run().train(1)
    older = run_.save(tmp_path)
    newest = run_.train(1).save(tmp_path)
    rewrite_train_state(newest.path, lambda s: {**s, "format_version": version})
    for fallback in (False, True):  # never falls back: rotation would delete the newer checkpoint
        with pytest.raises(CheckpointFormatError) as err:
            Run(seed=4).load(tmp_path, fallback_to_previous=fallback)
        msg = str(err.value)
        assert f"{newest.path}/train_state.json is checkpoint format {version!r}" in msg
        assert f"reads formats 1 to {FORMAT_VERSION}" in msg and why in msg
        assert "point checkpoint.dir at another directory to start a new run" in msg
    assert os.path.isdir(older.path) and os.path.isdir(newest.path)


def test_format_1_of_the_checkpoint_manager_loads(mcore_parallel, tmp_path):
    """A format-1 checkpoint's other ``extra`` keys become parts of their own."""
    first = Run().train(2)
    saved = first.save(tmp_path)
    rewrite_train_state(saved.path, as_format_1)
    resumed = Run(seed=4)
    state = resumed.load(tmp_path)
    assert state.step == 2 and resumed.losses == first.losses
    assert set(state.parts) == {"optimizer", "scheduler", "losses"}


def test_a_part_that_is_not_plain_json_is_refused_before_writing(mcore_parallel, tmp_path):
    run_ = Run().train(1)
    mgr, parts = run_.manager(tmp_path)
    with pytest.raises(TypeError, match=r"checkpoint part 'history'\['records'\]\[0\] is a Tensor: "
                                        "parts are saved as JSON, never pickled"):
        mgr.save(1, {**parts, "history": JsonPart({"records": [torch.zeros(1)]})})
    assert os.listdir(tmp_path) == []  # nothing written
