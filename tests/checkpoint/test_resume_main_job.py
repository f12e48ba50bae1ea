"""Exact resume of the main job on CPU: ``training.steps=N`` straight vs the same command with
``checkpoint.dir=D training.stop_at_step=K`` followed by the same command without
``stop_at_step`` give bit-identical per-step losses (the summary JSON's records), learning
rates and final parameters -- dense, tiny_moe dropless and capacity, LoRA (full and
adapters-only checkpoints), activation offload."""

import json
import os

import pytest
import torch
from tests.support.hydra_compose import compose_job
from tests.support.matrix_runs import params

from megatron_fastpath.train import run

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

STEPS, STOP = 6, 3
FAST = [f"training.steps={STEPS}", "data.num_samples=256", "model.num_layers=2",
        "model.hidden_size=64", "model.ffn_hidden_size=160", "data.max_tokens=256",
        "training.lr=5e-3"]
MOE = ["model=tiny_moe", "model.moe_ffn_hidden_size=64"]
LORA = ["fastpath.lora=true", "lora.rank=4"]
CASES = {
    "dense": ([], []),
    "moe-dropless": (MOE, []),
    "moe-capacity": (MOE + ["fastpath.moe_capacity_factor=1.5"], []),
    "lora-full": (LORA, []),
    "lora-adapters-only": (LORA, ["checkpoint.adapters_only=true"]),
    "offload": (["fastpath.offload=true", "offload.min_offload_bytes=0"], []),
}


def cfg(overrides):
    return compose_job(list(overrides))


def losses(path):
    with open(path) as f:
        return [(r["step"], r["loss"], r["lr"]) for r in json.load(f)["records"]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_resume_main_job(mcore_parallel, tmp_path, capsys, case):
    model, ckpt_only = CASES[case]
    d = tmp_path / "ckpt"
    straight, job_s = run(cfg(FAST + model + [f"training.summary_json={tmp_path}/straight.json"]),
                          return_job=True)
    ckpt = [f"checkpoint.dir={d}", *ckpt_only]
    first = run(cfg(FAST + model + ckpt + [f"training.stop_at_step={STOP}"]))
    assert first.stopped == "stop_at_step" and first.steps == STOP
    assert [s["step"] for s in first.checkpoint_saves] == [STOP] and first.checkpoint_bytes > 0
    capsys.readouterr()
    resumed, job_r = run(cfg(FAST + model + ckpt + [f"training.summary_json={tmp_path}/resumed.json"]),
                         return_job=True)
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (f"resuming from {d}/step_{STOP:08d}: {STOP} of {STEPS} steps "
                                   f"done, continuing at step {STOP + 1}")
    assert resumed.resumed_from == f"{d}/step_{STOP:08d}" and resumed.stopped is None
    assert f"step    {STOP}/" not in out and f"step    {STOP + 1}/{STEPS}" in out
    assert len(losses(tmp_path / "straight.json")) == STEPS
    assert losses(tmp_path / "resumed.json") == losses(tmp_path / "straight.json")  # bit-identical
    a, b = params(job_s), params(job_r)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert resumed.checkpoint_saves[-1]["step"] == STEPS


def test_adapters_only_checkpoint_is_a_fraction_of_full(mcore_parallel, tmp_path):
    full = run(cfg(FAST + LORA + [f"checkpoint.dir={tmp_path}/full", "training.stop_at_step=1"]))
    small = run(cfg(FAST + LORA + [f"checkpoint.dir={tmp_path}/small", "training.stop_at_step=1",
                                   "checkpoint.adapters_only=true"]))
    assert 0 < small.checkpoint_bytes < full.checkpoint_bytes / 4


def test_rerun_of_a_finished_run_trains_nothing(mcore_parallel, tmp_path, capsys):
    d = tmp_path / "ckpt"
    done = run(cfg(FAST + [f"checkpoint.dir={d}", "checkpoint.interval=2", "checkpoint.keep=2"]))
    assert [s["step"] for s in done.checkpoint_saves] == [2, 4, 6]
    assert sorted(n for n in os.listdir(d) if n.startswith("step_")) == ["step_00000004", "step_00000006"]
    capsys.readouterr()
    again = run(cfg(FAST + [f"checkpoint.dir={d}"]))
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"resuming from {d}/step_{STEPS:08d}: all {STEPS} steps already done (nothing to train)"
    assert "\nstep " not in out and again.records == done.records and again.checkpoint_saves == ()


def test_other_config_refused_with_the_differences(mcore_parallel, tmp_path):
    from megatron_fastpath.checkpoint import CheckpointMismatchError

    run(cfg(FAST + [f"checkpoint.dir={tmp_path}", "training.stop_at_step=1"]))
    with pytest.raises(CheckpointMismatchError) as err:
        run(cfg(FAST + [f"checkpoint.dir={tmp_path}", "model.vocab_size=300", "training.lr=1e-3"]))
    msg = str(err.value)
    assert "embedding.word_embeddings.weight saved (256, 64), this model (300, 64)" in msg
    assert "config model.vocab_size: saved 256, now 300" in msg
    assert "config training.lr: saved 0.005, now 0.001" in msg


@pytest.mark.parametrize("bad, match", [
    (["training.stop_at_step=7"], r"stop_at_step=7 must be in \[1, training.steps=6\]"),
    (["checkpoint.adapters_only=true"], "adapters_only=true needs LoRA"),
    (["checkpoint.keep=0"], "checkpoint.keep must be >= 1"),
])
def test_bad_checkpoint_settings_rejected_before_building(bad, match, tmp_path):
    from megatron_fastpath.train import parse_job_config

    with pytest.raises(ValueError, match=match):
        parse_job_config(cfg(FAST + [f"checkpoint.dir={tmp_path}", *bad]))


def test_checkpoint_group_is_struct(tmp_path):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="intervall"):
        cfg(FAST + ["checkpoint.intervall=3"])


def test_lora_run_takes_its_base_from_a_plain_models_checkpoint(mcore_parallel, tmp_path):
    """checkpoint.base_dir: a LoRA job starts from another run's base weights (the keys of a
    model without LoRA), its adapters as initialised."""
    plain, job_p = run(cfg(FAST + [f"checkpoint.dir={tmp_path}/plain", "training.stop_at_step=2"]),
                       return_job=True)
    base = f"{tmp_path}/plain/step_00000002/model"
    lora, job_l = run(cfg(FAST + LORA + [f"checkpoint.dir={tmp_path}/lora", f"checkpoint.base_dir={base}",
                                         "training.stop_at_step=1"]), return_job=True)
    p = params(job_p)
    loaded = {k.replace(".base.", "."): v for k, v in params(job_l).items() if "lora_" not in k}
    assert loaded.keys() == p.keys()
    for k in p:  # base frozen: still exactly the plain run's step-2 weights
        assert torch.equal(loaded[k], p[k]), k
    assert lora.records[0].loss < plain.records[0].loss  # it starts from trained weights
