"""Unset training.lr / min_lr / warmup_steps take the model provider's defaults
(train/defaults.py: the tiny models' values, model=hf's LoRA and full fine-tune rows); a set value
wins; training.lr_schedule picks Megatron's OptimizerParamScheduler lr_decay_style."""

import math

import pytest
import torch
from tests.support.hydra_compose import compose_job

from megatron_fastpath.train.config import parse_job_config


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.hf.hf_reference import make_checkpoint

    path = str(tmp_path_factory.mktemp("llama"))
    make_checkpoint("llama", path)
    return path


def _training(overrides):
    t = parse_job_config(compose_job(overrides)).training
    return t.lr, t.min_lr, t.warmup_steps, t.lr_schedule


def test_tiny_model_defaults():
    assert _training([]) == (3e-3, 3e-4, 4, "cosine")


def test_hf_lora_and_full_defaults(hf_ckpt):
    hf = ["model=hf", f"model.path={hf_ckpt}"]
    assert _training(hf + ["fastpath.lora=true"]) == (3e-4, 0.0, 100, "cosine")  # torchtune
    assert _training(hf) == (2e-5, 0.0, 100, "cosine")  # Axolotl / TRL


def test_explicit_values_win(hf_ckpt):
    hf = ["model=hf", f"model.path={hf_ckpt}", "fastpath.lora=true"]
    assert _training(hf + ["training.lr=1e-4", "training.min_lr=1e-6", "training.warmup_steps=7",
                           "training.lr_schedule=linear"]) == (1e-4, 1e-6, 7, "linear")
    assert _training(hf + ["training.warmup_steps=0"])[2] == 0  # a set 0 is not "unset"


def test_lower_lr_keeps_the_rows_min_lr_ratio():
    # the tiny row is 3e-3 -> 3e-4; lr=1e-4 alone would sit under that min_lr
    assert _training(["training.lr=1e-4"])[:2] == (1e-4, pytest.approx(1e-5, rel=1e-12))


@pytest.mark.parametrize("overrides,message", [
    (["training.lr_schedule=step"], r"training.lr_schedule must be one of cosine, linear, constant; got 'step'"),
    (["training.lr=1e-3", "training.min_lr=2e-3"], r"training.min_lr=0.002 is above training.lr=0.001"),
])
def test_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        parse_job_config(compose_job(overrides))


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_is_megatrons(schedule):
    """build_scheduler's LR at each step equals Megatron's OptimizerParamScheduler built with
    the same lr_decay_style (megatron/core/optimizer_param_scheduler.py get_lr)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_fastpath.train.step import build_scheduler

    train = parse_job_config(compose_job([f"training.lr_schedule={schedule}", "training.steps=20"])).training
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    ours = build_scheduler(ours_opt, train)
    ref = OptimizerParamScheduler(
        ref_opt, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=4, lr_decay_steps=20,
        lr_decay_style=schedule, start_wd=0.01, end_wd=0.01, wd_incr_steps=20,
        wd_incr_style="constant")
    lrs = []
    for _ in range(20):
        ours.step(1)
        ref.step(1)
        assert ours_opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        lrs.append(ours_opt.param_groups[0]["lr"])
    assert lrs[1] == pytest.approx(3e-3 * 2 / 4, rel=1e-12)  # linear warm-up, step 2 of 4
    after = lrs[4:]  # past the warm-up
    mid = {"cosine": 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * 7 / 16)),
           "linear": 3e-4 + (3e-3 - 3e-4) * (1 - 7 / 16), "constant": 3e-3}[schedule]
    assert after[6] == pytest.approx(mid, rel=1e-12)  # step 11: 7 of the 16 decay steps done
