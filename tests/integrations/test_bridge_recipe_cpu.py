"""A Megatron-Bridge 0.6 LoRA recipe taken through ``apply_fastpath_to_config`` on the CPU.

The recipe is Bridge's own PEFT template (``megatron.bridge.recipes.common._peft_common``, which
every Bridge Llama PEFT recipe starts from) with the provider those recipes build from a Hugging
Face config (``AutoBridge...to_megatron_provider(load_weights=False)``), from a tiny local
``LlamaConfig``: no download. It runs in a child process
(``tests/workers/bridge_recipe_worker.py``) with the fake Transformer Engine on ``PYTHONPATH``:
Bridge imports TE unconditionally (``megatron/bridge/peft/lora_layers.py:20``).

Skipped, with the reason, where Megatron-Bridge is not installed (it needs Python >= 3.12; the
packages it needs on a CPU machine are setup.py's ``bridge`` extra, docs/integrations.md), and
where the child cannot import Bridge's finetune path (the reason names the import and line).
"""

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_bridge_peft_recipe_takes_the_fast_path(tmp_path):
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("Megatron-Bridge is not installed (pip install -e '.[bridge]' on Python >= 3.12; "
                    "docs/integrations.md)")
    from tests.support.fake_te.activate import te_env

    out = tmp_path / "bridge.json"
    proc = subprocess.run([sys.executable, "-m", "tests.workers.bridge_recipe_worker", str(out)],
                          cwd=str(tmp_path), env=te_env(WANDB_MODE="disabled"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    if report.get("stage") == "import":
        pytest.skip(f"Megatron-Bridge's finetune path does not import here: {report['error']} "
                    f"({report['where']})")
    assert "error" not in report, report
    assert report["stage"] == "done"
    assert report["provider"] == "GPTModelProvider"  # what AutoBridge makes of a LlamaConfig
    assert report["hook"] == {
        "forward_step": "FastpathForwardStep", "layer_spec": True, "position_embedding_type": "none",
        "pad_cu_seqlens": False, "max_tokens": 64, "core_attention": "PackedCoreAttention",
    }
