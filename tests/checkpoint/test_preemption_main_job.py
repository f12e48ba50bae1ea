"""The main job as a process: SIGUSR1 / SIGTERM mid-run -> it finishes the step, saves and exits
with PREEMPTED_EXIT_CODE; the rerun resumes and ends bit-identical to an uninterrupted run. A
SIGKILL in the middle of a save leaves the previous checkpoint as latest, and the rerun resumes
from it."""

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from megatron_fastpath.train import PREEMPTED_EXIT_CODE
from tests.support.main_job import job_env, main_job_cmd, run_main_job, wait_for

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

STEPS = 16
FAST = [f"training.steps={STEPS}", "data.num_samples=256", "model.num_layers=2",
        "model.hidden_size=64", "model.ffn_hidden_size=160", "data.max_tokens=256"]


def _env():
    return job_env(HYDRA_FULL_ERROR="1")


def _cmd(tmp_path, *overrides, launcher=None):
    return main_job_cmd([*FAST, f"hydra.run.dir={tmp_path}/hydra", *overrides],
                        entry=[str(launcher)] if launcher else None)


def _records(path):
    with open(path) as f:
        return [(r["step"], r["loss"], r["lr"]) for r in json.load(f)["records"]]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run's (step, loss, lr) records, once for the module."""
    d = tmp_path_factory.mktemp("straight")
    return [(r["step"], r["loss"], r["lr"]) for r in run_main_job(FAST, d, env=_env()).summary["records"]]




@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_signal_saves_exits_75_and_rerun_matches_uninterrupted(tmp_path, straight, sig):
    d = tmp_path / "ckpt"
    log = tmp_path / "first.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(_cmd(tmp_path, f"checkpoint.dir={d}"), env=_env(), stdout=f,
                                stderr=subprocess.STDOUT)
        wait_for(proc, lambda: "step    2/" in log.read_text(), "step 2")
        proc.send_signal(sig)
        assert proc.wait(timeout=300) == PREEMPTED_EXIT_CODE
    text = log.read_text()
    stopped = int(open(d / "latest").read().removeprefix("step_"))
    assert 2 <= stopped < STEPS, text[-2000:]
    assert f"stopped early: signal {sig.name}" in text
    assert f"step {stopped + 1:4d}/" not in text  # finished the step it was in, no further
    summary = tmp_path / "resumed.json"
    second = subprocess.run(_cmd(tmp_path, f"checkpoint.dir={d}", f"training.summary_json={summary}"),
                            env=_env(), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stdout.splitlines()[0].startswith(f"resuming from {d}/step_{stopped:08d}")
    assert _records(summary) == straight


@pytest.mark.integration
def test_sigkill_during_save_resumes_from_previous_checkpoint(tmp_path, straight):
    d = tmp_path / "ckpt"
    marker = tmp_path / "hanging"
    env = dict(_env(), FASTPATH_TEST_HANG_AT_STEP="4", FASTPATH_TEST_MARKER=str(marker))
    with open(tmp_path / "first.log", "w") as log:
        # its own process group: SIGKILL reaches the job and the helper processes its save
        # started, as when Slurm kills a job step
        proc = subprocess.Popen(
            _cmd(tmp_path, f"checkpoint.dir={d}", "checkpoint.interval=2",
                 "checkpoint.async_save=false",
                 launcher=Path(__file__).parents[1] / "workers" / "slow_save_launcher.py"),
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(proc, marker.exists, "the save of step 4")
        os.killpg(proc.pid, signal.SIGKILL)  # step 4's files are written, not published
        proc.wait(timeout=60)
    assert (d / ".tmp.step_00000004" / "model" / "metadata.json").exists()  # written, unpublished
    assert open(d / "latest").read() == "step_00000002"
    summary = tmp_path / "resumed.json"
    second = subprocess.run(_cmd(tmp_path, f"checkpoint.dir={d}", "checkpoint.interval=2",
                                 f"training.summary_json={summary}"),
                            env=_env(), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stdout.splitlines()[0] == (
        f"resuming from {d}/step_00000002: 2 of {STEPS} steps done, continuing at step 3")
    assert not any(n.startswith(".tmp.") for n in os.listdir(d))  # the partial one was cleared
    assert _records(summary) == straight


@pytest.mark.parametrize("with_checkpoints", [True, False], ids=["checkpoint-dir", "no-checkpoint-dir"])
def test_signal_during_start_up_exits_with_the_requeue_code(tmp_path, with_checkpoints):
    """SIGTERM to the whole process group while the job starts (right after its first printed
    line, before the model exists): exit 75 (requeue), nothing saved -- not the default 143."""
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}"] if with_checkpoints else []
    proc = subprocess.Popen(_cmd(tmp_path, "training.steps=6", *ckpt), cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    first = line = proc.stdout.readline()
    # a library's import warning is not the job's line (torch's CUDA build without a GPU warns
    # from torch/utils/cpp_extension.py:178 while Megatron is imported)
    while line and re.match(r"W\d{4} |\s*$", line):
        line = proc.stdout.readline()
        first += line
    os.killpg(proc.pid, signal.SIGTERM)
    out = first + proc.stdout.read()
    assert proc.wait(timeout=300) == PREEMPTED_EXIT_CODE, out[-3000:]
    assert "preempted: SIGTERM" in out and "step    1" not in out
    if with_checkpoints:
        assert not [n for n in os.listdir(tmp_path / "ckpt") if n.startswith("step_")]
