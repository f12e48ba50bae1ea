"""A finished run extended with more epochs (training.epochs=2 -> 3, same checkpoint.dir): it
resumes at the step after its last, its LR schedule recomputed for the new total while the step
count continues (Megatron's --override-opt_param-scheduler; settings.SCHEDULE_SETTINGS), so the
resumed steps' learning rates equal a straight 3-epoch run's exactly; settings that do not change
the weights (settings.NOT_WEIGHT_SETTINGS) may change on the resume. Fewer epochs than done, or
more on a run that has not finished, stay refused."""

import json

import pytest
from tests.support.checkpoint_files import records
from tests.support.hydra_compose import compose_job

from megatron_fastpath.checkpoint import CheckpointError
from megatron_fastpath.train import run

pytestmark = pytest.mark.integration

# 48 samples pack into 11 bins (each counted padded to 2): 2 epochs = 11 steps of 2
# microbatches, 3 epochs = 17
SMALL = ["data.num_samples=48", "model.num_layers=2", "model.hidden_size=64",
         "model.ffn_hidden_size=160", "data.max_tokens=256", "data.pad_multiple=2", "training.lr=5e-3",
         "metrics.tensorboard=false", "metrics.wandb=off", "metrics.plot=false"]


def test_two_epochs_extended_to_three(mcore_parallel, tmp_path, capsys):
    d = tmp_path / "ckpt"
    straight = run(compose_job(SMALL + ["training.epochs=3",
                                        f"training.summary_json={tmp_path}/straight.json"]))
    total = straight.steps
    first = run(compose_job(SMALL + ["training.epochs=2", f"checkpoint.dir={d}"]))
    done = first.steps
    assert first.stopped is None and done < total
    capsys.readouterr()
    # the same run, one more epoch, with settings that do not change the weights changed too
    extended = run(compose_job(SMALL + ["training.epochs=3", f"checkpoint.dir={d}",
                                        "training.skip_memory_check=true", "training.sync_check=off",
                                        f"training.summary_json={tmp_path}/extended.json"]))
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        f"resuming from {d}/step_{done:08d}: its run of {done} steps (2 epochs) finished; "
        f"training.epochs=3 extends it (the LR schedule recomputed for the new total), continuing "
        f"at step {done + 1} (epoch 3)")
    assert extended.resumed_from == f"{d}/step_{done:08d}" and extended.stopped is None
    ext, ref = records(tmp_path / "extended.json"), records(tmp_path / "straight.json")
    assert [r[0] for r in ext] == list(range(1, total + 1))  # the history goes on
    assert [r[2] for r in ext[done:]] == [r[2] for r in ref[done:]]  # the LR: exactly the 3-epoch one
    assert ext[done][2] > ext[done - 1][2]  # the 2-epoch run had decayed to min_lr; 3 epochs restart higher
    with open(d / f"step_{total:08d}" / "train_state.json") as f:
        assert json.load(f)["config"]["training"]["epochs"] == 3
    # fewer epochs than done: not an extension, refused
    with pytest.raises(CheckpointError, match=r"config training.epochs: saved 3, now 2"):
        run(compose_job(SMALL + ["training.epochs=2", f"checkpoint.dir={d}"]))


def test_more_epochs_on_an_unfinished_run_is_refused(mcore_parallel, tmp_path):
    d = tmp_path / "ckpt"
    run(compose_job(SMALL + ["training.epochs=2", f"checkpoint.dir={d}", "training.stop_at_step=3"]))
    with pytest.raises(CheckpointError, match=r"config training.epochs: saved 2, now 3"):
        run(compose_job(SMALL + ["training.epochs=3", f"checkpoint.dir={d}"]))
