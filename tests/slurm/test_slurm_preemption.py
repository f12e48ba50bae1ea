"""slurm/train.sbatch under preemption.

Without Slurm (fake srun / scontrol): the script is submitted with --requeue and
--signal=B:USR1@120, forwards SIGUSR1 (SIGTERM to a torchrun launcher) to the training step,
waits for it, and requeues the job only when the tasks exit with PREEMPTED_EXIT_CODE.

On the local two-node Slurm cluster (installed only with CI=true or FASTPATH_SLURM_INSTALL=1):
a job sent USR1 mid-run saves, requeues, resumes and ends with the same final loss as an
uninterrupted job; a job whose save is SIGKILLed resumes from the previous checkpoint.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.slurm_cluster import clean_submit_env

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "train.sbatch"
PREEMPTED_EXIT_CODE = 75


def test_sbatch_header_requeues_and_asks_for_a_warning_signal():
    text = SBATCH.read_text()
    assert "#SBATCH --requeue\n" in text
    assert "#SBATCH --signal=B:USR1@120\n" in text
    assert "#SBATCH --open-mode=append\n" in text  # a requeued job keeps its first part
    lora = (REPO / "slurm" / "train_cuda_graphs_lora.sbatch").read_text()
    assert "#SBATCH --requeue\n" in lora and "#SBATCH --signal=B:USR1@120\n" in lora
    from megatron_fastpath.train import PREEMPTED_EXIT_CODE as code

    assert code == PREEMPTED_EXIT_CODE and f"PREEMPTED_EXIT_CODE={code}" in text


def _fake_bin(tmp_path: Path, exit_code_on_signal: int) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    (d / "scontrol").write_text(
        "#!/usr/bin/env bash\n"
        'if [[ $1 == show && $2 == hostnames ]]; then printf "n1\\n"; exit 0; fi\n'
        'if [[ $1 == show && $2 == node ]]; then echo "   NodeAddr=127.0.0.1 X=1"; exit 0; fi\n'
        f'echo "$*" >> {tmp_path}/scontrol.calls\n'
    )
    # srun stand-in: a training step that saves and exits with the preempted code on a signal
    (d / "srun").write_text(
        "#!/usr/bin/env bash\n"
        f'trap \'echo USR1 >> {tmp_path}/srun.signals; exit {exit_code_on_signal}\' USR1\n'
        f'trap \'echo TERM >> {tmp_path}/srun.signals; exit {exit_code_on_signal}\' TERM\n'
        f"touch {tmp_path}/srun.started\n"
        "for _ in $(seq 300); do sleep 0.1; done\n"
    )
    for f in ("scontrol", "srun"):
        (d / f).chmod(0o755)
    return d


def _start(tmp_path: Path, **env_extra: str) -> subprocess.Popen:
    env = clean_submit_env(
        SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="n1", SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_NAME="fastpath-train", LOG_DIR=str(tmp_path / "logs"), PYTHON="python3",
        **env_extra,
    )
    env["PATH"] = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
    proc = subprocess.Popen(["bash", str(SBATCH), "training.steps=3"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not (tmp_path / "srun.started").exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("launcher, sent, forwarded", [
    ("srun", signal.SIGUSR1, "USR1"),
    ("srun", signal.SIGTERM, "TERM"),
    ("torchrun", signal.SIGUSR1, "TERM"),  # torchrun's agent would die on USR1
])
def test_signal_is_forwarded_and_the_job_requeued(tmp_path, launcher, sent, forwarded):
    _fake_bin(tmp_path, PREEMPTED_EXIT_CODE)
    proc = _start(tmp_path, LAUNCHER=launcher, NPROC_PER_NODE="2", DEVICE="cpu")
    proc.send_signal(sent)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (tmp_path / "srun.signals").read_text().split() == [forwarded]
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "4242"]
    assert "requeueing it" in out


def test_tasks_failing_after_a_signal_are_not_requeued(tmp_path):
    _fake_bin(tmp_path, 1)  # the tasks crashed instead of saving: the job fails, no requeue
    proc = _start(tmp_path, DEVICE="cpu")
    proc.send_signal(signal.SIGUSR1)
    proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert not (tmp_path / "scontrol.calls").exists()


# ------------------------------------------------------------------------------------------------
# The real thing: the local two-node Slurm cluster (2 nodes x 1 task: DP=2 over gloo)
# ------------------------------------------------------------------------------------------------
STEPS = 40
FAST = [f"training.steps={STEPS}", "model.num_layers=2", "data.num_samples=256",
        "model.hidden_size=64", "model.ffn_hidden_size=160", "data.max_tokens=256"]
LAUNCHER = REPO / "tests" / "workers" / "slow_save_launcher.py"


def _submit(cluster, work: Path, *overrides: str, **env_extra: str) -> int:
    (work / "logs").mkdir(parents=True, exist_ok=True)
    env = clean_submit_env(**{
        "PYTHON": sys.executable, "DEVICE": "cpu", "FASTPATH_HOME": str(REPO),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **env_extra,
    })
    return cluster.sbatch([f"--chdir={work}", "--nodes=2", "--ntasks-per-node=1",
                           "--gpus-per-node=0", "--time=00:10:00", str(SBATCH), *FAST, *overrides],
                          env=env)


def _out(work: Path, job_id: int) -> str:
    f = work / f"fastpath-train-{job_id}.out"  # the script's default --output (appended on requeue)
    return f.read_text() if f.exists() else ""


def _records(path: Path):
    import json

    return [(r["step"], r["loss"], r["lr"]) for r in json.loads(path.read_text())["records"]]


def _wait_text(cluster, work, job_id, text, timeout_s=300):
    deadline = time.time() + timeout_s
    while text not in _out(work, job_id):
        fields = cluster.job(job_id) or {}
        assert fields.get("JobState") not in ("FAILED", "CANCELLED", "COMPLETED"), _out(work, job_id)
        assert time.time() < deadline, f"no {text!r} after {timeout_s} s:\n{_out(work, job_id)[-3000:]}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def reference(local_slurm, tmp_path_factory):
    """The uninterrupted job's records (shared by the tests below: saving changes no number)."""
    d = tmp_path_factory.mktemp("ref")
    ref = _submit(local_slurm, d, f"training.summary_json={d}/ref.json")
    assert local_slurm.wait(ref, timeout_s=600).ok, _out(d, ref)[-3000:]
    return _records(d / "ref.json")


@pytest.mark.integration
def test_usr1_mid_run_saves_requeues_resumes_with_the_same_final_loss(local_slurm, reference, tmp_path):
    work = tmp_path / "pre"
    job = _submit(local_slurm, work, f"training.summary_json={tmp_path}/pre.json")
    _wait_text(local_slurm, work, job, "step    3/")
    # what --signal=B:USR1@<s> does near the time limit: USR1 to the batch script
    local_slurm._run(["scancel", "--batch", "--signal=USR1", str(job)])
    result = local_slurm.wait(job, timeout_s=900)
    out = _out(work, job)
    assert result.ok, out[-4000:]
    assert result.fields.get("Restarts") == "1", result.fields
    assert "got SIGUSR1, forwarding SIGUSR1" in out and "requeueing it" in out
    assert "stopped early: signal SIGUSR1" in out
    assert re.search(r"^resuming from \S+/checkpoints/step_\d{8}: \d+ of 40 steps done", out, re.M), out
    assert _records(tmp_path / "pre.json") == reference


@pytest.mark.integration
def test_scancel_term_to_the_steps_after_checkpoints_requeues_and_resumes_exactly(
        local_slurm, reference, tmp_path):
    """Preemption as Slurm does it to a running job: SIGTERM to every process of the job's
    steps (``scancel --signal=TERM``, no --batch), after checkpoints have been written
    (``interval=2``: the checkpoint writer's helper processes exist and get the signal too).
    Each task saves and exits 75, srun returns 75, the script requeues, the rerun resumes."""
    work = tmp_path / "pre"
    job = _submit(local_slurm, work, "checkpoint.interval=2", f"training.summary_json={tmp_path}/pre.json")
    _wait_text(local_slurm, work, job, "step    5/")  # the saves of steps 2 and 4 have started
    local_slurm._run(["scancel", "--signal=TERM", str(job)])
    result = local_slurm.wait(job, timeout_s=900)
    out = _out(work, job)
    assert result.ok, out[-4000:]
    assert result.fields.get("Restarts") == "1", (result.fields, out[-4000:])
    assert "stopped early: signal SIGTERM" in out
    assert "saved a checkpoint after a signal to its tasks; requeueing it" in out
    assert re.search(r"^resuming from \S+/checkpoints/step_\d{8}: \d+ of 40 steps done", out, re.M), out
    assert _records(tmp_path / "pre.json") == reference


@pytest.mark.integration
def test_sigkilled_save_resumes_from_the_previous_checkpoint(local_slurm, reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    marker = tmp_path / "hanging"
    wrapper = tmp_path / "python-slow-save"  # `$PYTHON -m megatron_fastpath.train ARGS` -> launcher
    wrapper.write_text(f'#!/usr/bin/env bash\nshift 2\nexec {sys.executable} {LAUNCHER} "$@"\n')
    wrapper.chmod(0o755)
    work = tmp_path / "killed"
    job = _submit(local_slurm, work, "checkpoint.interval=2", "checkpoint.async_save=false",
                  CHECKPOINT_DIR=str(ckpt), PYTHON=str(wrapper), FASTPATH_TEST_HANG_AT_STEP="4",
                  FASTPATH_TEST_MARKER=str(marker))
    deadline = time.time() + 300
    while not marker.exists():
        assert time.time() < deadline, _out(work, job)[-3000:]
        time.sleep(0.2)
    local_slurm._run(["scancel", "--signal=KILL", str(job)])  # SIGKILL the tasks mid-save
    local_slurm.wait(job, timeout_s=300)
    assert (ckpt / "latest").read_text() == "step_00000002"
    again = _submit(local_slurm, tmp_path / "again", f"training.summary_json={tmp_path}/again.json",
                    CHECKPOINT_DIR=str(ckpt))
    result = local_slurm.wait(again, timeout_s=600)
    out = _out(tmp_path / "again", again)
    assert result.ok, out[-4000:]
    assert f"resuming from {ckpt}/step_00000002: 2 of {STEPS} steps done" in out
    assert _records(tmp_path / "again.json") == reference
