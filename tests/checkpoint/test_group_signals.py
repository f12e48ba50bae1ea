"""What Slurm does to a job, done to the main job: SIGTERM / SIGUSR1 to the whole process group
(preemption, ``scancel --signal``) at a moment after the first checkpoint, with async and sync
saves. Every trial must finish the step it is in, save, exit 75 (requeue) and resume bit-identical
to an uninterrupted run; no process of the job may outlive it. The group signal also reaches the
helper process megatron-core's checkpoint writer starts (its results-queue Manager); the package
keeps that helper serving until the save is done (compat.dist_ckpt), else the save fails and the
job exits 1.

Integration tier (``integration``): four trials at designed moments, each waited for on an
event the job shows (a log line, a checkpoint's temporary directory), two at once; together they
cover each phase a signal can land in and each signal with each save mode (:data:`MOMENTS`). And
a SIGKILL of the main process alone: its helpers exit too (a helper left behind holds about
280 MB)."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron_fastpath.train import PREEMPTED_EXIT_CODE
from tests.support.main_job import job_env, main_job_cmd, wait_for

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


def _start_and_wait(run_dir: Path, moment, *overrides: str):
    """Start the main job; return once ``moment(log text, run_dir)`` holds (polled every 5 ms)."""
    log = run_dir / "first.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:  # its own session: the group is the job's, as under srun
        proc = subprocess.Popen(_cmd(run_dir, *overrides), env=_env(), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(proc, lambda: moment(log.read_text(), run_dir), "the awaited moment", poll_s=0.005,
             detail=lambda: log.read_text()[-3000:])
    return proc, log


def _first_checkpoint(text: str, run_dir: Path) -> bool:
    return "checkpoint step 2" in text  # the writer's helper exists from here


def _start_and_wait_first_checkpoint(run_dir: Path, *overrides: str):
    return _start_and_wait(run_dir, _first_checkpoint, *overrides)


def _sync_save_writing(text: str, run_dir: Path) -> bool:
    """A sync save after the first is being written: its ``.tmp.step_N`` directory exists (it is
    renamed to ``step_N`` when complete; each save blocks the step 0.6-8 s on a loaded machine)."""
    return any(int(p.name.rsplit("_", 1)[1]) >= 4 for p in (run_dir / "ckpt").glob(".tmp.step_*"))


# (signal, async saves, the moment the signal is sent, the phase it lands in)
MOMENTS = {
    "async-save-in-flight": (
        signal.SIGTERM, True, lambda text, _: "checkpoint step 2: async save blocked" in text,
        "the first async save is staged and written in the background (its writer starts with it: "
        "about 1.5 s): the group signal reaches the writer's helper mid-write, the stop save "
        "waits for it"),
    "mid-step-between-saves": (
        signal.SIGUSR1, False, lambda text, _: "checkpoint step 2 ->" in text,
        "the sync save of step 2 is published, step 3 runs: the stop save is off the interval"),
    "during-a-sync-save": (
        signal.SIGTERM, False, _sync_save_writing,
        "a periodic sync save is being written (the checkpoint boundary): the step's save is "
        "finished, the next step runs and saves as the stop"),
    "final-steps": (
        signal.SIGUSR1, True, lambda text, _: "step   30/40" in text,
        "the last quarter of the run, async saves every 2 steps in flight; the resumed run "
        "reaches the last step and its final save"),
}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run's (step, loss, lr) records (sync saves every 2 steps: saving does
    not change the math)."""
    d = tmp_path_factory.mktemp("straight")
    subprocess.run(_cmd(d, f"training.summary_json={d}/s.json"), env=_env(), check=True,
                   capture_output=True, timeout=600)
    return _records(d / "s.json")


def _trial(run_dir: Path, straight, name: str) -> None:
    sig, async_save, moment, phase = MOMENTS[name]
    ckpt = run_dir / "ckpt"
    mode = f"checkpoint.async_save={str(async_save).lower()}"
    proc, log = _start_and_wait(run_dir, moment, f"checkpoint.dir={ckpt}", mode)
    os.killpg(proc.pid, sig)  # the job and every helper it started, as Slurm does
    rc = proc.wait(timeout=300)
    left = _wait_group_gone(proc.pid)
    text = log.read_text()
    assert rc == PREEMPTED_EXIT_CODE, f"{sig.name} {mode} at {name} ({phase}): exit {rc}\n{text[-3000:]}"
    assert f"stopped early: signal {sig.name}" in text
    assert not left, f"outlived the job: {left}"
    stopped = int((ckpt / "latest").read_text().removeprefix("step_"))
    assert 2 <= stopped < STEPS and f"step {stopped + 1:4d}/" not in text
    # exact resume: the rest of the run from the saved state equals the uninterrupted run
    second = subprocess.run(_cmd(run_dir, f"checkpoint.dir={ckpt}", mode,
                                 f"training.summary_json={run_dir}/resumed.json"),
                            env=_env(), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stdout.splitlines()[0].startswith(f"resuming from {ckpt}/step_{stopped:08d}")
    assert _records(run_dir / "resumed.json") == straight


PAIRS = (("async-save-in-flight", "mid-step-between-saves"), ("during-a-sync-save", "final-steps"))


@pytest.mark.integration
@pytest.mark.parametrize("pair", PAIRS, ids="+".join)
def test_group_signal_at_each_phase(tmp_path, straight, pair):
    """Two trials at once (each job is one process; the machine has 2 cores), each checked as
    alone. A failing trial is named."""
    import concurrent.futures

    assert {t for p in PAIRS for t in p} == set(MOMENTS)  # every designed moment runs
    with concurrent.futures.ThreadPoolExecutor(len(pair)) as pool:
        done = {t: pool.submit(_trial, tmp_path / t, straight, t) for t in pair}
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
