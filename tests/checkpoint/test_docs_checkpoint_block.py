"""docs/checkpoints.md's first commands, run in the order printed, print the lines the page
says they print (the second command resumes a run that is not done: it must not print 'all 40
steps already done'). Each command gets the same small-model overrides appended (they change nothing the
first line says)."""

import re
import shlex
from pathlib import Path

from tests.support.main_job import run_main_job

import pytest

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64",
         "data.max_tokens=128", "data.num_samples=128", "metrics.wandb=off", "metrics.plot=false",
         "metrics.tensorboard=false"]


def _block():
    text = (REPO / "docs" / "checkpoints.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    steps, expect = [], {}
    for line in block.splitlines():
        if line.startswith("python -m megatron_fastpath.train"):
            steps.append(shlex.split(line.split("#")[0]))
        elif line.startswith("#   ") and steps:
            expect[len(steps) - 1] = line[4:].strip()
    return steps, expect


def test_the_resume_commands_print_what_the_page_says(tmp_path):
    steps, expect = _block()
    assert len(steps) >= 2 and set(expect) >= {0, 1}
    for i, argv in enumerate(steps[:2]):
        assert argv[:3] == ["python", "-m", "megatron_fastpath.train"]
        out = run_main_job([*argv[3:], *SMALL], tmp_path, name=f"run{i}", timeout=600)
        want = re.escape(expect[i]).replace(re.escape("/…/"), ".*/")
        assert re.fullmatch(want, out.stdout.splitlines()[0]), (expect[i], out.stdout.splitlines()[0])
