"""training.sync_check: the sync sentinel (a Python function mode + dispatch mode around every
op) is a diagnosis. ``first`` (default) counts the first SYNC_CHECK_FIRST_STEPS steps of the
process and then runs the step with no Python mode at all; ``every`` counts every step; ``off``
none. Checked from inside the model: which modes are active while it runs."""

import pytest
import torch
from tests.support.hydra_compose import compose_job
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from megatron_fastpath.train import StepLogger, build_job, parse_job_config, train
from megatron_fastpath.train.config import SYNC_CHECK_FIRST_STEPS

STEPS = 5
FAST = [f"training.steps={STEPS}", "data.num_samples=64", "model.num_layers=1", "model.hidden_size=32",
        "model.ffn_hidden_size=64", "data.max_tokens=128", "metrics.wandb=off", "metrics.plot=false",
        "metrics.tensorboard=false"]


def _run(mode, capsys):
    cfg = compose_job(FAST + [f"training.sync_check={mode}"])
    job = build_job(parse_job_config(cfg))
    seen = []  # (function modes, dispatch modes) active at each forward of the model
    job.model.register_forward_pre_hook(
        lambda m, a: seen.append((len(_get_current_function_mode_stack()),
                                  len(_get_current_dispatch_mode_stack()))))
    logger = StepLogger(job)
    summary = train(job, logger)
    per_step = len(seen) // STEPS
    assert per_step * STEPS == len(seen) and per_step == job.cfg.training.micro_batches
    return summary, [seen[i * per_step:(i + 1) * per_step] for i in range(STEPS)], capsys.readouterr().out


@pytest.mark.parametrize("mode,counted", [("first", SYNC_CHECK_FIRST_STEPS), ("every", STEPS), ("off", 0)])
def test_no_python_mode_in_a_step_after_the_counted_ones(mcore_parallel, capsys, mode, counted):
    summary, steps, out = _run(mode, capsys)
    for i, modes in enumerate(steps):
        if i < counted:  # the sentinel's two modes (the audit adds none on this CPU job)
            assert all(f >= 1 and d >= 1 for f, d in modes), (i, modes)
        else:
            assert all(m == (0, 0) for m in modes), (i, modes)
    assert [r.syncs_step is not None for r in summary.records] == [i < counted for i in range(STEPS)]
    assert summary.sync_checked_steps == counted
    if counted:
        assert summary.syncs_per_step == 0 and summary.syncs_fwd_bwd_per_step == 0
        assert f"host syncs per step: fwd+bwd 0, whole step 0 ({counted} of {STEPS} steps counted)" in out
    else:
        assert summary.syncs_per_step is None
        assert "host syncs not counted (training.sync_check=off)" in out
    assert out.count("host syncs: not counted") == STEPS - counted
    assert out.count("host syncs: fwd+bwd 0, step 0") == counted


def test_sync_check_is_checked_at_parse():
    cfg = compose_job(FAST + ["training.sync_check=sometimes"])
    with pytest.raises(ValueError, match="training.sync_check must be first, every or off; got 'sometimes'"):
        parse_job_config(cfg)


def test_a_counted_step_still_finds_a_sync(mcore_parallel, capsys, monkeypatch):
    """The counted steps are real counts: a planted ``.item()`` in the model's forward shows up
    in them and in none of the uncounted ones (which run no mode to see it)."""
    summary, _, _ = _run_with_planted_sync(capsys)
    assert [r.syncs_step for r in summary.records][:SYNC_CHECK_FIRST_STEPS] == [2] * SYNC_CHECK_FIRST_STEPS
    assert all(r.syncs_step is None for r in summary.records[SYNC_CHECK_FIRST_STEPS:])


def _run_with_planted_sync(capsys):
    cfg = compose_job(FAST)
    job = build_job(parse_job_config(cfg))
    job.model.register_forward_pre_hook(lambda m, a: torch.ones(1).add(1).item() and None)
    summary = train(job, StepLogger(job))
    return summary, None, capsys.readouterr().out


def test_a_resume_may_change_sync_check():
    """Counting syncs changes no number: not part of the resume fingerprint (a checkpoint
    saved with sync_check=every resumes with first or off, and one saved before the key
    existed still fits)."""
    from megatron_fastpath.train.checkpointing import fingerprint_config

    prints = []
    for mode in ("first", "every", "off"):
        cfg = compose_job(FAST + [f"training.sync_check={mode}"])
        prints.append(fingerprint_config(parse_job_config(cfg), dp_world=1))
    assert prints[0] == prints[1] == prints[2] and "sync_check" not in prints[0]["training"]
