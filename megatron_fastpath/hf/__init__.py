"""Hugging Face checkpoints in, PEFT adapters / merged checkpoints out, chat JSONL data.

Run-time dependencies: safetensors, tokenizers, jinja2 (no transformers). Modules:
``config`` (config.json -> model description), ``checkpoint`` (safetensors reads),
``convert`` (HF <-> Megatron layout), ``model`` (build + load), ``export`` (PEFT / merged),
``tokenizer`` (tokenizer.json + sandboxed chat template), ``data`` (``data=jsonl``),
``provider`` (the main job's ``model=hf`` / ``data=jsonl`` providers, export included).
"""

from megatron_fastpath.hf.checkpoint import CheckpointError, SafetensorsCheckpoint
from megatron_fastpath.hf.config import (
    SUPPORTED,
    HFModelSpec,
    UnsupportedCheckpointError,
    read_hf_config,
)

from megatron_fastpath._lazy import lazy_getattr

_LAZY = {
    "build_hf_model": "megatron_fastpath.hf.model",
    "load_hf_model": "megatron_fastpath.hf.model",
    "load_hf_weights": "megatron_fastpath.hf.model",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = ["CheckpointError", "HFModelSpec", "SUPPORTED", "SafetensorsCheckpoint",
           "UnsupportedCheckpointError", "read_hf_config", *_LAZY]
