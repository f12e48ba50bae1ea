"""NeMo 2's ``llm.finetune`` with ``apply_fastpath`` run on CPU: a NeMo 2 LoRA
recipe (``llm.llama32_1b.finetune_recipe``, packed sequences) with the fast path trains three
steps under the test-only CUDA-as-CPU mode (``tests/support/nemo_on_cpu.py``: what it stands
in for and why) and gives the main job's per-token losses on the same weights and data.

Both sides start from one tiny Llama HF checkpoint built here (``examples/make_tiny_hf_llama.py``):
the main job (``python -m megatron_fastpath.train model=hf``, a child process) loads it directly;
NeMo imports it with ``llm.import_ckpt`` and restores it. The main job's entry
(``tests/support/recipe_compare.py``) dumps its initial LoRA parameters and its step
microbatches; the NeMo child
(``tests/workers/nemo_finetune_worker.py``, whose docstring lists every alignment) trains on
exactly those packs, in that order, from those adapters.

Tolerance: fp32 on both sides, the same Megatron layers, the same fast-path attention and
packed cache, the same optimizer arithmetic (Megatron's CPU Adam is torch AdamW; the main job's
is torch's fused AdamW); what differs is the summation order of the loss reduction and the
optimizer kernels: rtol 1e-6 on per-token losses around 6 (fp32 eps is 1.2e-7). Measured
(2026-11): |relative difference| <= 3e-8 on all three steps.

Megatron-Bridge (Python >= 3.12) has the same test on the primary target:
``test_bridge_finetune_cpu.py``.
"""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.nemo  # CI's legacy target (Python 3.11) runs these: NeMo 2.7 installs there only

pytest.importorskip("nemo.collections.llm", reason="NeMo 2 is not installed (nemo-toolkit[llm] 2.7)")
pytest.importorskip("nemo_run", reason="nemo_run (NeMo-Run recipes) is not installed")
pytest.importorskip("transformers")

from tests.hf.hf_reference import DATA  # noqa: E402
from tests.support.main_job import job_env  # noqa: E402
from tests.support.nemo_on_cpu import moved_sites  # noqa: E402
from tests.support.recipe_compare import run_main_job  # noqa: E402

STEPS = 3
T = 256  # packed microbatch capacity (data.max_tokens = NeMo's packed_sequence_size)

def test_nemo_sites_the_cpu_standins_cover_still_hold():
    """The NeMo / megatron-core lines nemo_on_cpu stands in for (file:line, text) are still
    there in the installed packages: an upgrade shows what moved."""
    assert moved_sites() == []


@pytest.mark.integration
def test_nemo_lora_finetune_with_fastpath_gives_the_main_jobs_losses(tmp_path):
    import make_tiny_hf_llama

    hf = str(tmp_path / "hf")
    make_tiny_hf_llama.main(hf, DATA)
    data = str(tmp_path / "chat.jsonl")
    with open(DATA, "rb") as src, open(data, "wb") as dst:  # the token cache goes beside it
        dst.write(src.read())
    env = job_env(WANDB_MODE="disabled")
    main_losses, dump, main_lengths = run_main_job(tmp_path, hf, data, T, STEPS, env)

    out = str(tmp_path / "nemo.json")
    nemo = subprocess.run([sys.executable, "-m", "tests.workers.nemo_finetune_worker", hf, dump,
                           str(tmp_path / "nemo"), out], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=900)
    assert nemo.returncode == 0, nemo.stdout[-3000:] + nemo.stderr[-5000:]
    report = json.load(open(out))

    # NeMo ran the fast path: the hooked layers, and its data step loaded each step's pack into
    # the packed cache -- the main job's packs, in its order
    assert report["attention"] == ["PackedCoreAttention"] * STEPS
    assert report["lengths"] == main_lengths
    # LoRA on the same modules, the only trainable parameters, started from the main job's
    adapters = report["adapters"]
    assert adapters["nemo"] == adapters["main_job"] and len(adapters["nemo"]) == 8
    assert adapters["trainable"] == adapters["nemo"]

    assert len(report["losses"]) == len(main_losses) == STEPS
    print("main job:", main_losses, "\nNeMo:    ", report["losses"])
    for step, (ours, theirs) in enumerate(zip(report["losses"], main_losses), start=1):
        assert ours == pytest.approx(theirs, rel=1e-6, abs=0), (step, report["losses"], main_losses)
    # the steps trained (the losses are not three evaluations of the initial weights)
    assert len(set(round(x, 4) for x in main_losses)) == STEPS
