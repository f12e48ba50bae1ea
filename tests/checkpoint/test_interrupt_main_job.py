"""Ctrl-C (SIGINT) in a run with checkpoint.dir: the job finishes the step, saves, prints how to
resume and exits 130 -- no KeyboardInterrupt traceback; the rerun resumes and its losses equal an
uninterrupted run's exactly. A second Ctrl-C stops at once."""

import json
import signal
import subprocess

import pytest

from megatron_fastpath.train.checkpointing import INTERRUPTED_EXIT_CODE
from tests.support.main_job import job_env, main_job_cmd, run_main_job, wait_for

pytestmark = pytest.mark.integration

STEPS = 10
FAST = [f"training.steps={STEPS}", "data.num_samples=256", "model.num_layers=2",
        "model.hidden_size=64", "model.ffn_hidden_size=160", "data.max_tokens=256",
        "metrics.tensorboard=false", "metrics.wandb=off", "metrics.plot=false"]


def _cmd(tmp_path, *overrides):
    return main_job_cmd([*FAST, f"hydra.run.dir={tmp_path}/hydra", *overrides])




def test_ctrl_c_saves_prints_how_to_resume_and_the_rerun_matches(tmp_path):
    (tmp_path / "straight").mkdir()
    straight = [(r["step"], r["loss"], r["lr"])
                for r in run_main_job(FAST, tmp_path / "straight", env=job_env()).summary["records"]]
    d, log = tmp_path / "ckpt", tmp_path / "first.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(_cmd(tmp_path, f"checkpoint.dir={d}"), env=job_env(), stdout=f,
                                stderr=subprocess.STDOUT)
        wait_for(proc, lambda: "step    2/" in log.read_text(), "step 2")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=300) == INTERRUPTED_EXIT_CODE
    text = log.read_text()
    stopped = int(open(d / "latest").read().removeprefix("step_"))
    assert 2 <= stopped < STEPS, text[-2000:]
    assert (d / f"step_{stopped:08d}" / "train_state.json").is_file()
    assert (f"interrupted: step {stopped} saved in checkpoint.dir={d}; rerun the same command to "
            f"resume at step {stopped + 1}") in text
    assert "KeyboardInterrupt" not in text and "Traceback" not in text
    summary = tmp_path / "resumed.json"
    second = subprocess.run(_cmd(tmp_path, f"checkpoint.dir={d}", f"training.summary_json={summary}"),
                            env=job_env(), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stdout.splitlines()[0].startswith(f"resuming from {d}/step_{stopped:08d}")
    with open(summary) as f:
        resumed = [(r["step"], r["loss"], r["lr"]) for r in json.load(f)["records"]]
    assert resumed == straight


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    d, log = tmp_path / "ckpt", tmp_path / "first.log"
    with open(log, "w") as f:
        # async saves on: the second Ctrl-C lands while the first one's step / save runs
        proc = subprocess.Popen(_cmd(tmp_path, f"checkpoint.dir={d}", "training.steps=400"),
                                env=job_env(), stdout=f, stderr=subprocess.STDOUT)
        wait_for(proc, lambda: "step    2/" in log.read_text(), "step 2")
        proc.send_signal(signal.SIGINT)
        wait_for(proc, lambda: "Ctrl-C again stops at once" in log.read_text(), "the first Ctrl-C")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=300) == INTERRUPTED_EXIT_CODE
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert ("interrupted (Ctrl-C): stopped at once" in text
            or "interrupted: step" in text), text[-3000:]  # the step may have ended first
