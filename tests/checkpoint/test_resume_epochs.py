"""``training.epochs`` in the main job: 2 epochs straight vs stopped mid-epoch 2 and resumed give
bit-identical per-step losses (the data position and epoch in the checkpoint's ``data`` part); a
checkpoint written before epochs existed (no ``epoch`` in its data part) still resumes exactly."""

import json
import os

import pytest
import torch
from tests.support.checkpoint_files import as_format_1, records, rewrite_train_state
from tests.support.hydra_compose import compose_job

from megatron_fastpath.train import run

# the integration tier: runs the main job
pytestmark = pytest.mark.integration

# 48 samples pack into 11 bins (each counted padded to 2): 2 epochs x 11 microbatches / 2 per
# step = 11 steps; step 6 takes epoch 1's last bin and epoch 2's first; the stop (step 8) is
# mid-epoch 2
SMALL = ["data.num_samples=48", "model.num_layers=2", "model.hidden_size=64",
         "model.ffn_hidden_size=160", "data.max_tokens=256", "data.pad_multiple=2", "training.lr=5e-3"]
EPOCHS, STEPS, STOP = 2, 11, 8


def same_params(job_a, job_b):
    for (k, a), (_, b) in zip(job_a.model.state_dict().items(), job_b.model.state_dict().items()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), k


def test_two_epochs_stopped_mid_epoch_2_resume_exactly(mcore_parallel, tmp_path, capsys):
    d = tmp_path / "ckpt"
    job_args = SMALL + [f"training.epochs={EPOCHS}"]
    straight, job_s = run(compose_job(job_args + [f"training.summary_json={tmp_path}/straight.json"]),
                          return_job=True)
    assert job_s.cfg.training.steps == STEPS and straight.steps == STEPS
    first = run(compose_job(job_args + [f"checkpoint.dir={d}", f"training.stop_at_step={STOP}"]))
    assert first.stopped == "stop_at_step" and first.steps == STOP
    with open(d / f"step_{STOP:08d}" / "train_state.json") as f:
        state = json.load(f)
    data = state["parts"]["data"]
    assert data["epoch"] == 1 and data["next_first_microbatch"] == 5 and data["next_step"] == STOP + 1
    assert data["consumed_samples"] == job_s.data.consumed_samples(STOP) > 48
    assert state["config"]["training"]["epochs"] == EPOCHS
    assert state["config"]["training"]["steps"] == STEPS
    capsys.readouterr()
    resumed, job_r = run(compose_job(job_args + [f"checkpoint.dir={d}",
                                                 f"training.summary_json={tmp_path}/resumed.json"]),
                         return_job=True)
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (f"resuming from {d}/step_{STOP:08d}: {STOP} steps of {EPOCHS} "
                                   f"epochs done, continuing at step {STOP + 1} (epoch 2)")
    assert "next microbatch 5 of epoch 2" in out
    # the step lines name the epoch of each step's first microbatch
    assert [line.split(" | ")[0] for line in out.splitlines() if line.startswith("step ")] == [
        f"step {s:4d}/{STEPS} (epoch 2/{EPOCHS})" for s in range(STOP + 1, STEPS + 1)]
    assert resumed.resumed_from == f"{d}/step_{STOP:08d}" and resumed.stopped is None
    assert len(records(tmp_path / "straight.json")) == STEPS
    assert records(tmp_path / "resumed.json") == records(tmp_path / "straight.json")  # bit-identical
    same_params(job_s, job_r)
    # epoch 2 trains another order than epoch 1 (not a replay of its microbatches)
    e1, e2 = job_s.data.epochs.bins(0), job_s.data.epochs.bins(1)
    assert len(e1) == len(e2) == 11
    assert not all(torch.equal(a.tokens_1T, b.tokens_1T) for a, b in zip(e1, e2))


@pytest.mark.parametrize("fmt", ["format 2", "format 1"])
def test_checkpoint_without_the_epoch_field_resumes_exactly(mcore_parallel, tmp_path, capsys, fmt):
    d = tmp_path / "ckpt"
    job_args = SMALL + ["training.steps=6"]
    _, job_s = run(compose_job(job_args + [f"training.summary_json={tmp_path}/straight.json"]),
                   return_job=True)
    run(compose_job(job_args + [f"checkpoint.dir={d}", "training.stop_at_step=3"]))

    def before_epochs(state):
        assert "epochs" not in state["config"]["training"]  # as fingerprinted before epochs
        data = state["parts"]["data"]
        assert data.pop("epoch") is None
        return as_format_1(state) if fmt == "format 1" else state

    rewrite_train_state(d / "step_00000003", before_epochs)
    capsys.readouterr()
    resumed, job_r = run(compose_job(job_args + [f"checkpoint.dir={d}",
                                                 f"training.summary_json={tmp_path}/resumed.json"]),
                         return_job=True)
    out = capsys.readouterr().out
    assert f"loaded {d}/step_00000003: 3 of 6 steps done" in out and "of epoch" not in out
    assert resumed.resumed_from == f"{d}/step_00000003"
    assert records(tmp_path / "resumed.json") == records(tmp_path / "straight.json")  # bit-identical
    same_params(job_s, job_r)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny Llama checkpoint and a copy of the shipped chat JSONL (its token cache beside it)."""
    import shutil

    pytest.importorskip("transformers")
    import make_tiny_hf_llama

    data = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "examples", "data", "arith_chat.jsonl")
    tmp = tmp_path_factory.mktemp("epochs-hf")
    make_tiny_hf_llama.main(str(tmp / "tiny-llama"), data)
    shutil.copy(data, tmp / "chat.jsonl")
    return str(tmp / "tiny-llama"), str(tmp / "chat.jsonl")


def test_jsonl_two_epochs_stopped_mid_epoch_2_resume_exactly(mcore_parallel, tmp_path, tiny_hf):
    """data=jsonl: 360 training records pack into 19 bins of 1024 tokens: 2 epochs of 2
    microbatches per step are 19 steps; stopped at step 12 (epoch 2's microbatches 3 and 4)."""
    ckpt, data = tiny_hf
    d = tmp_path / "ckpt"
    job_args = ["model=hf", f"model.path={ckpt}", "data=jsonl", f"data.path={data}",
                "data.max_tokens=1024", "data.eval_every=0", "training.epochs=2",
                "metrics.tensorboard=false", "metrics.wandb=off"]
    straight, job_s = run(compose_job(job_args + [f"training.summary_json={tmp_path}/straight.json"]),
                          return_job=True)
    assert len(job_s.data.bins) == 19 and straight.steps == job_s.cfg.training.steps == 19
    run(compose_job(job_args + [f"checkpoint.dir={d}", "training.stop_at_step=12"]))
    with open(d / "step_00000012" / "train_state.json") as f:
        position = json.load(f)["parts"]["data"]
    assert (position["epoch"], position["next_first_microbatch"]) == (1, 5)
    resumed, job_r = run(compose_job(job_args + [f"checkpoint.dir={d}",
                                                 f"training.summary_json={tmp_path}/resumed.json"]),
                         return_job=True)
    assert resumed.resumed_from == f"{d}/step_00000012" and resumed.stopped is None
    assert len(records(tmp_path / "straight.json")) == 19
    assert records(tmp_path / "resumed.json") == records(tmp_path / "straight.json")  # bit-identical
    assert resumed.eval_loss == straight.eval_loss
    same_params(job_s, job_r)
