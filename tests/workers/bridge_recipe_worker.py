"""Child process of ``tests/integrations/test_bridge_recipe_cpu.py``: a Megatron-Bridge 0.6 LoRA
recipe (``megatron.bridge.recipes.common._peft_common``, the template of Bridge's Llama PEFT
recipes) with a tiny Llama model, taken through ``apply_fastpath_to_config`` on the CPU.

    python -m tests.workers.bridge_recipe_worker OUT_JSON

Runs with the fake Transformer Engine first on ``PYTHONPATH`` (``tests.support.fake_te``):
Bridge imports TE unconditionally (``megatron/bridge/peft/lora_layers.py:20``, ``import
transformer_engine.pytorch as te``, reached from ``import megatron.bridge`` through its model
registry), so no Bridge module imports without a ``transformer_engine``.

The model is the provider Bridge's Llama recipes build (``AutoBridge.from_hf_pretrained(path)
.to_megatron_provider(load_weights=False)``), made here from a local ``LlamaConfig``
(``AutoBridge.from_hf_config``): no download. Writes ``OUT_JSON``: the stages reached and what
each found, or the first failure (type, message, the Bridge / Megatron frame it came from).
"""

from __future__ import annotations

import json
import sys
import traceback

T = 64  # packed_sequence_size


def _where(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "site-packages" in f.filename]
    f = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    return f"{f.filename.split('site-packages/')[-1]}:{f.lineno}: {f.line}"


def run(report: dict) -> None:
    report["stage"] = "import"
    import megatron.bridge  # noqa: F401  (the package __init__: model registry, TE)
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.recipes.common import _peft_common
    from megatron.bridge.training.finetune import finetune  # noqa: F401  (the finetune path)
    from megatron.bridge.training.gpt_step import forward_step  # noqa: F401
    from transformers import LlamaConfig

    from megatron_fastpath.integrations.bridge import FastpathForwardStep, apply_fastpath_to_config
    from megatron_fastpath.integrations._runtime import FastpathLayerSpec

    report["stage"] = "recipe"
    hf = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                     rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf.architectures = ["LlamaForCausalLM"]
    cfg = _peft_common()
    cfg.model = AutoBridge.from_hf_config(hf).to_megatron_provider(load_weights=False)
    cfg.model.seq_length = cfg.dataset.seq_length = T
    cfg.dataset.offline_packing_specs.packed_sequence_size = T
    cfg.peft.target_modules = ["linear_qkv", "linear_proj"]
    report["provider"] = type(cfg.model).__name__

    report["stage"] = "hook"
    cfg, step = apply_fastpath_to_config(cfg, max_seqs=8)
    report["hook"] = {
        "forward_step": type(step).__name__ if isinstance(step, FastpathForwardStep) else None,
        "layer_spec": isinstance(cfg.model.transformer_layer_spec, FastpathLayerSpec),
        "position_embedding_type": cfg.model.position_embedding_type,
        "pad_cu_seqlens": cfg.dataset.offline_packing_specs.pad_cu_seqlens,
        "max_tokens": step.settings.max_tokens,
    }
    spec = cfg.model.transformer_layer_spec(cfg.model)
    report["hook"]["core_attention"] = spec.submodules.self_attention.submodules.core_attention.module.__name__
    report["stage"] = "done"


def main(out: str) -> None:
    from tests.support.fake_te.activate import activate

    activate()
    report: dict = {}
    try:
        run(report)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
        report["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
        report["where"] = _where(exc)
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
