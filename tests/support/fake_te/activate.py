"""Make this process import the fake Transformer Engine (``tests/support/fake_te``).

The fake is importable only through ``PYTHONPATH`` (the suite never edits ``sys.path``,
tests/test_layering.py): :func:`te_env` is a child's environment with it, and :func:`activate`,
called first by an entry point (``tests/workers/te_standin_main.py``, the ``tests/te_standin``
workers), re-executes the same command line with it on ``PYTHONPATH`` when it is not (so
``python -m tests.workers.te_standin_main ...`` and torchrun work as typed), then checks that
``transformer_engine`` is the fake. Megatron decides ``HAVE_TE`` when first imported: the fake
must be importable before that, and never in the pytest process (other tests assume TE is
absent).
"""

import os
import sys
from pathlib import Path

FAKE_TE_ROOT = str(Path(__file__).resolve().parent)


def with_fake_te(pythonpath: str = "") -> str:
    """``pythonpath`` with the fake TE's root first."""
    rest = [p for p in pythonpath.split(os.pathsep) if p and p != FAKE_TE_ROOT]
    return os.pathsep.join([FAKE_TE_ROOT, *rest])


def te_env(**extra: str) -> dict:
    """``tests.support.main_job.job_env`` with the fake TE importable."""
    from tests.support.main_job import REPO, job_env

    env = job_env(**extra)
    env["PYTHONPATH"] = with_fake_te(os.pathsep.join([env.get("PYTHONPATH", ""), REPO]))
    return env


def activate() -> None:
    """Re-exec with the fake on PYTHONPATH unless it is there; then import and check it."""
    if FAKE_TE_ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if "megatron.core" in sys.modules or "transformer_engine" in sys.modules:
            raise RuntimeError("the fake transformer_engine must be importable before Megatron is "
                               "imported: start the process with tests.support.fake_te.activate.te_env()")
        env = dict(os.environ, PYTHONPATH=with_fake_te(os.environ.get("PYTHONPATH", "")))
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    import transformer_engine

    if not transformer_engine.__file__.startswith(FAKE_TE_ROOT):
        raise RuntimeError(f"transformer_engine resolves to {transformer_engine.__file__}, not "
                           f"the fake under {FAKE_TE_ROOT}")


def run_check_worker(module: str, timeout: float = 600) -> dict:
    """``python -m module`` with the fake TE importable (a ``tests/te_standin`` check worker):
    its ``{check name: "ok" | the failure}``, the JSON of its last output line."""
    import json
    import subprocess

    from tests.support.main_job import REPO

    proc = subprocess.run([sys.executable, "-m", module], cwd=REPO, env=te_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
