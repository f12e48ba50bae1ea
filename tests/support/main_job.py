"""The main job (``python -m megatron_fastpath.train``) as tests run it: the one helper.

``train_in_process(overrides)`` composes the config with Hydra, builds the job and trains it in
this process (world size 1; the caller's ``mcore_parallel`` fixture has initialised
torch.distributed); ``train_in_standins(cfg)`` runs it on the GPU path inside the GPU stand-ins,
as a fresh process would start it. ``run_main_job(overrides, cwd)`` runs it as a user does, in a child process,
under ``torchrun`` when ``nproc > 1``, and returns what it printed and its summary JSON.
``main_job_cmd`` / ``job_env`` give the command and environment to tests that drive the child
themselves (signals, Slurm, a launcher script).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from tests.support.hydra_compose import compose_job
from tests.support.subproc import child_env, free_port

REPO = str(Path(__file__).resolve().parents[2])


# model=hf's optimizer defaults are a real checkpoint's fine-tune (train/defaults.py: LoRA lr 3e-4,
# full 2e-5, 100 warm-up steps); the tests' tiny random checkpoints learn in a few steps only with
# the synthetic tiny models' values, set explicitly
TINY_CHECKPOINT_OPTIMIZER = ("training.lr=3e-3", "training.min_lr=3e-4", "training.warmup_steps=4")

def train_in_process(overrides: Sequence[str] = (), *, header: bool = False):
    """(job, summary) of the main job composed from ``overrides``, trained in this process."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_fastpath.train import StepLogger, build_job, parse_job_config, train

    # Megatron keeps the aux-loss scale in a class attribute; each run starts from none, as a
    # fresh process would (a CPU step's lazy 0-dim scale and a schedule's [1] one cannot share it)
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    job = build_job(parse_job_config(compose_job(list(overrides))))
    logger = StepLogger(job)
    if header:
        logger.header()
    return job, train(job, logger)


def fresh_process_state() -> None:
    """Reset what Megatron (the MoE aux-loss scale, the CUDA RNG tracker) and Transformer Engine
    (the FP8 delayed-scaling buffers, when the fake TE is importable) keep per process, as a
    fresh process starts: for tests that run the main job more than once in one process."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    get_cuda_rng_tracker().reset()
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # no TE in this process
        pass
    else:
        FP8GlobalStateManager.reset()


def train_in_standins(cfg, patches: Sequence = ()):
    """(summary, job) of the main job on ``cfg`` (a config tree or a composed DictConfig; a copy
    is run) in this process, inside ``patches`` (context managers, entered first) and the GPU
    stand-ins (tests/support/graph_safe_standins.py), started as a fresh process would
    (:func:`fresh_process_state`)."""
    import contextlib
    import copy

    from megatron_fastpath.train import run
    from tests.support.graph_safe_standins import gpu_standins

    fresh_process_state()
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(gpu_standins())
        return run(copy.deepcopy(cfg), return_job=True, announce=False)


def job_env(**extra: str) -> dict:
    """The child's environment: no inherited rendezvous variables, one thread per process (2-core
    machine), the repository importable (tests.*), plus ``extra``."""
    return child_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO, **extra)


def main_job_cmd(overrides: Sequence[str] = (), *, nproc: int = 1,
                 entry: Optional[Sequence[str]] = None) -> list[str]:
    """``python -m megatron_fastpath.train overrides`` (``entry`` replaces ``-m
    megatron_fastpath.train``, e.g. a launcher script), under torchrun when ``nproc > 1``."""
    head = list(entry) if entry is not None else ["-m", "megatron_fastpath.train"]
    if nproc > 1:
        head = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--master_port={free_port()}", *head]
    return [sys.executable, *head, *overrides]


@dataclasses.dataclass(frozen=True)
class JobRun:
    returncode: int
    stdout: str
    stderr: str
    summary: Optional[dict]  # training.summary_json, when the run wrote it

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_main_job(overrides: Sequence[str], cwd, *, nproc: int = 1, name: str = "job",
                 env: Optional[dict] = None, timeout: float = 900, check: bool = True,
                 entry: Optional[Sequence[str]] = None) -> JobRun:
    """Run the main job in a child process in ``cwd``; its summary JSON is ``cwd/<name>.json``
    and its Hydra run directory ``cwd/hydra-<name>`` unless ``overrides`` name them. ``check``:
    assert it exited 0 (the message carries the tails of its output)."""
    cwd = Path(cwd)
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    summary = cwd / f"{name}.json"
    args = list(overrides)
    if "training.summary_json" in given:
        summary = Path(next(o for o in overrides if o.startswith("training.summary_json=")).split("=", 1)[1])
    else:
        args.append(f"training.summary_json={summary}")
    if "hydra.run.dir" not in given:
        args.append(f"hydra.run.dir={cwd}/hydra-{name}")
    proc = subprocess.run(main_job_cmd(args, nproc=nproc, entry=entry), cwd=cwd,
                          env=job_env() if env is None else env, capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads(summary.read_text()) if summary.exists() else None
    return JobRun(proc.returncode, proc.stdout, proc.stderr, data)


class SharedRuns:
    """Main-job runs shared by a module's tests (the ``main_job_runs`` fixture): ``runs(name,
    overrides, nproc)`` runs the job once per name in ``root/<name>`` and returns the same
    :class:`JobRun` to every later caller. ``{root}`` in an override is replaced by ``root``
    (checkpoint directories several runs share)."""

    def __init__(self, root: Path, common: Sequence[str] = ()):
        self.root, self.common, self._done = Path(root), list(common), {}

    def __call__(self, name: str, overrides: Sequence[str], nproc: int = 1) -> JobRun:
        if name not in self._done:
            cwd = self.root / name
            cwd.mkdir(exist_ok=True)  # a failed run is run again by the next test asking
            args = [o.format(root=self.root) for o in [*self.common, *overrides]]
            self._done[name] = run_main_job(args, cwd, nproc=nproc, name=name)
        return self._done[name]


__all__ = ["JobRun", "REPO", "SharedRuns", "job_env", "main_job_cmd", "run_main_job",
           "train_in_process"]


def wait_for(proc: subprocess.Popen, pred, what: str, timeout_s: float = 300, poll_s: float = 0.02,
             detail=None) -> None:
    """Poll ``pred()`` every ``poll_s`` until it holds; fail naming ``what`` (and ``detail()``,
    by default the job's output) if ``proc`` ends first or ``timeout_s`` passes."""
    deadline = time.time() + timeout_s
    while not pred():
        assert proc.poll() is None, f"job ended before {what}: {detail() if detail else proc.communicate()}"
        assert time.time() < deadline, f"timed out waiting for {what} ({timeout_s:.0f} s)"
        time.sleep(poll_s)
