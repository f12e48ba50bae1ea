"""Slurm opens ``#SBATCH --output`` before the script runs and does not
create its directory; a default inside a missing ``logs/`` makes the job fail with no output
anywhere (the README's "Try it without a cluster" block had no ``mkdir -p logs``)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_default_output_needs_no_directory(script):
    outputs = re.findall(r"^#SBATCH\s+--output=(\S+)", script.read_text(), flags=re.M)
    assert outputs, f"{script.name} sets no --output"
    for out in outputs:
        assert "/" not in out, f"{script.name}: --output={out} needs a directory Slurm will not create"


def test_readme_slurm_commands_need_no_mkdir():
    block = (REPO / "docs" / "slurm.md").read_text()  # the README's Slurm section, moved
    assert "mkdir -p logs" not in block  # not needed, so not a step one can miss
    assert "<job name>-<job id>.out` in the submission directory" in block
