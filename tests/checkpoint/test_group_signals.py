"""What Slurm does to a job, done to the main job: SIGTERM / SIGUSR1 to the whole process group
(preemption, ``scancel --signal``) at a moment after the first checkpoint, with async and sync
saves. Every trial must finish the step it is in, save, exit 75 (requeue) and resume bit-identical
to an uninterrupted run; no process of the job may outlive it. The group signal also reaches the
helper process megatron-core's checkpoint writer starts (its results-queue Manager); the package
keeps that helper serving until the save is done (compat.dist_ckpt), else the save fails and the
job exits 1.

Integration tier (``integration``): 20 trials at seeded random moments, two at once, each
signal with each save mode (trial % 2: SIGTERM / SIGUSR1; trial % 4 < 2: async saves), 5 trials
of each pair. And a SIGKILL of the main process alone: its helpers exit too (a helper left
behind holds about 280 MB)."""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron_fastpath.train import PREEMPTED_EXIT_CODE
from tests.support.main_job import job_env, main_job_cmd

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

STEPS = 40
FAST = [f"training.steps={STEPS}", "data.num_samples=256", "model.num_layers=2",
        "model.hidden_size=64", "model.ffn_hidden_size=160", "data.max_tokens=256",
        "checkpoint.interval=2"]


def _cmd(run_dir: Path, *overrides: str):
    return main_job_cmd([*FAST, f"hydra.run.dir={run_dir}/hydra", *overrides])


def _env():
    return job_env(HYDRA_FULL_ERROR="1")


def _records(path: Path):
    return [(r["step"], r["loss"], r["lr"]) for r in json.loads(path.read_text())["records"]]


def _group(pgid: int) -> list:
    """Processes of process group ``pgid`` still alive (zombies aside): (pid, command)."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append((int(pid), cmd))
    return alive


def _wait_group_gone(pgid: int, timeout_s: float = 20.0) -> list:
    deadline = time.time() + timeout_s
    while _group(pgid) and time.time() < deadline:
        time.sleep(0.1)
    left = _group(pgid)
    for pid, _ in left:  # never leave them behind the test
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _start_and_wait_first_checkpoint(run_dir: Path, *overrides: str):
    log = run_dir / "first.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:  # its own session: the group is the job's, as under srun
        proc = subprocess.Popen(_cmd(run_dir, *overrides), env=_env(), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while "checkpoint step 2" not in log.read_text():  # the writer's helper exists from here
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "no first checkpoint after 300 s"
        time.sleep(0.02)
    return proc, log


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run's (step, loss, lr) records (sync saves every 2 steps: saving does
    not change the math)."""
    d = tmp_path_factory.mktemp("straight")
    subprocess.run(_cmd(d, f"training.summary_json={d}/s.json"), env=_env(), check=True,
                   capture_output=True, timeout=600)
    return _records(d / "s.json")


def _trial(run_dir: Path, straight, sig: signal.Signals, async_save: bool, delay_s: float) -> None:
    ckpt = run_dir / "ckpt"
    mode = f"checkpoint.async_save={str(async_save).lower()}"
    proc, log = _start_and_wait_first_checkpoint(run_dir, f"checkpoint.dir={ckpt}", mode)
    time.sleep(delay_s)
    os.killpg(proc.pid, sig)  # the job and every helper it started, as Slurm does
    rc = proc.wait(timeout=300)
    left = _wait_group_gone(proc.pid)
    text = log.read_text()
    assert rc == PREEMPTED_EXIT_CODE, f"{sig.name} {mode} after {delay_s:.2f} s: exit {rc}\n{text[-3000:]}"
    assert f"stopped early: signal {sig.name}" in text
    assert not left, f"outlived the job: {left}"
    stopped = int((ckpt / "latest").read_text().removeprefix("step_"))
    assert 2 <= stopped < STEPS and f"step {stopped + 1:4d}/" not in text
    # exact resume: two more steps from the saved state equal the uninterrupted run's
    until = min(stopped + 2, STEPS)
    second = subprocess.run(_cmd(run_dir, f"checkpoint.dir={ckpt}", mode, f"training.stop_at_step={until}",
                                 f"training.summary_json={run_dir}/resumed.json"),
                            env=_env(), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stdout.splitlines()[0].startswith(f"resuming from {ckpt}/step_{stopped:08d}")
    assert _records(run_dir / "resumed.json") == straight[:until]


TRIALS = 20


def _random_trial(run_dir: Path, straight, trial: int) -> None:
    rng = random.Random(trial)  # seeded: a failing trial reruns at the same moment
    sig = (signal.SIGTERM, signal.SIGUSR1)[trial % 2]  # trial 0: SIGTERM, async; trial 3: SIGUSR1, sync
    _trial(run_dir, straight, sig, async_save=trial % 4 < 2, delay_s=rng.uniform(0.0, 1.5))


@pytest.mark.integration
@pytest.mark.parametrize("pair", range(TRIALS // 2), ids=lambda k: f"trials{2 * k}-{2 * k + 1}")
def test_group_signal_at_random_moments(tmp_path, straight, pair):
    """Two trials at once (each job is one process; the machine has 2 cores), each checked as
    alone: ``TRIALS`` in all, at seeded random moments. A failing trial is named."""
    import concurrent.futures

    trials = (2 * pair, 2 * pair + 1)
    with concurrent.futures.ThreadPoolExecutor(len(trials)) as pool:
        done = {t: pool.submit(_random_trial, tmp_path / f"trial{t}", straight, t) for t in trials}
    failed = {t: f.exception() for t, f in done.items() if f.exception() is not None}
    assert not failed, "\n\n".join(f"trial {t}: {type(e).__name__}: {e}" for t, e in failed.items())


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_sigkill_of_the_main_process_leaves_no_helper_behind(tmp_path, async_save):
    proc, log = _start_and_wait_first_checkpoint(
        tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}", f"checkpoint.async_save={str(async_save).lower()}")
    helpers = [pid for pid, _ in _group(proc.pid) if pid != proc.pid]
    assert helpers, "expected the checkpoint writer's helper processes"  # what the test is about
    proc.kill()  # the main process only (OOM killer, a node agent): nobody tells the helpers
    proc.wait(timeout=60)
    left = _wait_group_gone(proc.pid)
    assert not left, f"outlived the killed job: {left}"
