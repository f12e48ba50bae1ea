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

from slurm_cluster import clean_submit_env

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "train.sbatch"
PREEMPTED_EXIT_CODE = 75


def test_sbatch_header_requeues_and_asks_for_a_warning_signal():
    text = SBATCH.read_text()
    assert "#SBATCH --requeue\n" in text
    assert "#SBATCH --signal=B:USR1@120\n" in text
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
