"""training.dry_run=true: the config parsed, the data built, the memory estimated and checked,
the plan printed; exit 0 with no step and nothing written."""

import os

from tests.support.hydra_compose import compose_job
from tests.support.main_job import run_main_job

from megatron_fastpath.train import run

TINY = ["data.num_samples=64", "model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64",
        "data.max_tokens=128"]


def test_dry_run_plan_matches_the_built_job(mcore_parallel, capsys):
    plan = run(compose_job(TINY + ["training.dry_run=true", "training.epochs=2"]))
    out = capsys.readouterr().out
    assert "\nstep " not in out and not out.startswith("step ") and "summary:" not in out
    # the job the same config builds (one step of it): the same packed data and steps
    _, job = run(compose_job(TINY + ["training.epochs=2", "training.stop_at_step=1"]), return_job=True)
    assert plan["packed_microbatches"] == job.data.num_microbatches
    assert plan["steps"] == job.cfg.training.steps == job.data.epochs.steps(job.data.per_step)
    assert plan["records"] == 64 and plan["microbatches_per_step"] == 2
    assert plan["max_tokens"] == plan["steps"] * 2 * 128
    assert plan["params"] == job.total_params
    assert (plan["lr"], plan["warmup_steps"], plan["lr_schedule"]) == (3e-3, 4, "cosine")
    assert (f"  data: 64 records -> {plan['packed_microbatches']} packed microbatches of <= 128 "
            f"tokens; {plan['steps']} steps x 2 microbatches") in out


def test_dry_run_main_job_exits_0_writing_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = run_main_job(TINY + ["training.dry_run=true", f"checkpoint.dir={ckpt}"], tmp_path)
    assert job.returncode == 0
    assert "dry run (training.dry_run=true)" in job.stdout and "  memory: estimated" in job.stdout
    assert "\nstep " not in job.stdout and "summary:" not in job.stdout
    assert not os.path.exists(ckpt) and job.summary is None  # no checkpoint, no summary JSON
