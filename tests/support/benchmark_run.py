"""Run a benchmark script as a user does (``python benchmarks/<name>.py ... --json out``) in a
child process and return the JSON it wrote: the one helper of the benchmark tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.subproc import child_env

REPO = Path(__file__).resolve().parents[2]


def run_benchmark(name: str, out: Path, *args: str, timeout: float = 600, one_thread: bool = True) -> dict:
    """``benchmarks/<name>.py *args --json out``; fails the test with the script's stderr when it
    exits non-zero. ``one_thread``: OMP_NUM_THREADS=1 (one core per process on this machine)."""
    extra = dict(PYTHONPATH=str(REPO), **({"OMP_NUM_THREADS": "1"} if one_thread else {}))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=timeout, env=child_env(**extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())
