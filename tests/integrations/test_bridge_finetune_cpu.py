"""Megatron-Bridge 0.6's ``finetune`` run on the CPU, with and without ``apply_fastpath_to_config``:
Bridge's LLM LoRA recipe (``megatron.bridge.recipes.common._peft_common``, the template of its
Llama PEFT recipes; packed sequences) trains three steps under the test-only stand-ins of
``tests/support/bridge_on_cpu.py`` (what each stands in for and why), on the main job's weights
and data, and gives the same per-token losses three ways: Bridge's own forward step and layer
spec, the hook's, and the main job's.

All start from one tiny Llama HF checkpoint built here (``examples/make_tiny_hf_llama.py``): the
main job (``python -m megatron_fastpath.train model=hf``) loads it directly, Bridge imports it
with ``AutoBridge`` into a Megatron checkpoint and fine-tunes from it
(``checkpoint.pretrained_checkpoint``). The main job's entry dumps its initial LoRA parameters
and its step microbatches; the Bridge child (``tests/workers/bridge_finetune_worker.py``, whose
docstring lists every alignment) trains on exactly those packs, in that order, from those
adapters, once with Bridge's ``gpt_step.forward_step`` and its Transformer Engine layer spec
(THD attention through ``TEDotProductAttention``, Megatron's unfused THD RoPE), once with the
hook's forward step and layer spec (the packed cache, ``PackedCoreAttention``, the cache's RoPE).

Tolerance: fp32 everywhere, the same Megatron linear layers and LoRA adapters, the same
optimizer arithmetic (Megatron's Adam without TE / Apex is torch AdamW; the main job's is
torch's fused AdamW); what differs is the attention and RoPE kernels (Bridge's path: the TE
stand-in's per-sequence softmax and Megatron's per-sequence RoPE; the hook and the main job:
the package's packed attention and cached RoPE) and the summation order of the loss
reduction: rtol 1e-6 on per-token losses around 6 (fp32 eps is 1.2e-7). Measured (2026-11):
|relative difference| <= 1.6e-7 on all three steps, every pair.

Runs where Megatron-Bridge is installed (Python >= 3.12: setup.py's ``bridge`` extra, CI's
``.venv-bridge``; docs/integrations.md); skipped, with the reason, elsewhere.
"""

import importlib.util
import json
import subprocess
import sys

import pytest

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("Megatron-Bridge is not installed (setup.py's 'bridge' extra, Python >= 3.12; "
                "docs/integrations.md)", allow_module_level=True)

STEPS = 3
T = 256  # packed microbatch capacity (data.max_tokens = Bridge's packed_sequence_size)


def test_bridge_sites_the_cpu_standins_cover_still_hold():
    """The Bridge / megatron-core lines bridge_on_cpu stands in for (file:line, text) are still
    there in the installed packages: an upgrade shows what moved."""
    from tests.support.bridge_on_cpu import moved_sites

    assert moved_sites() == []


@pytest.mark.integration
def test_bridge_lora_finetune_with_and_without_the_hook_gives_the_main_jobs_losses(tmp_path):
    import make_tiny_hf_llama

    from tests.hf.hf_reference import DATA
    from tests.support.fake_te.activate import te_env
    from tests.support.main_job import job_env
    from tests.support.recipe_compare import run_main_job

    hf = str(tmp_path / "hf")
    make_tiny_hf_llama.main(hf, DATA)
    data = str(tmp_path / "chat.jsonl")
    with open(DATA, "rb") as src, open(data, "wb") as dst:  # the token cache goes beside it
        dst.write(src.read())
    main_losses, dump, main_lengths = run_main_job(tmp_path, hf, data, T, STEPS, job_env(WANDB_MODE="disabled"))

    env = te_env(WANDB_MODE="disabled")  # Bridge imports TE unconditionally (peft/lora_layers.py:20)
    reports = {}
    for mode in ("import", "stock", "fastpath"):
        out = str(tmp_path / f"{mode}.json")
        proc = subprocess.run([sys.executable, "-m", "tests.workers.bridge_finetune_worker", mode, hf, dump,
                               str(tmp_path / "bridge"), out], cwd=str(tmp_path), env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (mode, proc.stdout[-3000:] + proc.stderr[-5000:])
        if mode != "import":
            reports[mode] = json.load(open(out))
    stock, fast = reports["stock"], reports["fastpath"]

    # the recipe's model is what AutoBridge makes of a Llama config; the hook moved RoPE into
    # the cache (position_embedding_type "none"), Bridge's own run keeps Megatron's
    assert stock["provider"] == fast["provider"] == "GPTModelProvider"
    assert (stock["rope"], fast["rope"]) == ("rope", "none")
    # Bridge's own run: TE's THD attention (the stand-in); the hooked run: the fast path's
    # layers, and its forward step loaded each step's pack into the packed cache -- the main
    # job's packs, in its order (plus the padding sequence Bridge's collate appends up to T)
    assert stock["attention"] == ["TEDotProductAttentionStandIn"] * STEPS
    assert fast["attention"] == ["PackedCoreAttention"] * STEPS
    assert fast["lengths"] == [m + ([T - sum(m)] if sum(m) < T else []) for m in main_lengths]
    # LoRA on the same modules, the only trainable parameters, started from the main job's
    for report in (stock, fast):
        adapters = report["adapters"]
        assert adapters["bridge"] == adapters["main_job"] and len(adapters["bridge"]) == 8
        assert adapters["trainable"] == adapters["bridge"]

    print("main job:       ", main_losses, "\nBridge:         ", stock["losses"],
          "\nBridge + hook:  ", fast["losses"])
    assert len(stock["losses"]) == len(fast["losses"]) == len(main_losses) == STEPS
    for step in range(STEPS):
        assert fast["losses"][step] == pytest.approx(stock["losses"][step], rel=1e-6, abs=0), (step, reports)
        assert fast["losses"][step] == pytest.approx(main_losses[step], rel=1e-6, abs=0), (step, fast, main_losses)
        assert stock["losses"][step] == pytest.approx(main_losses[step], rel=1e-6, abs=0), (step, stock, main_losses)
    # the steps trained (the losses are not three evaluations of the initial weights)
    assert len(set(round(x, 4) for x in main_losses)) == STEPS
