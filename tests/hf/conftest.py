"""Fixtures of the Hugging Face tests."""

import pytest


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(family, shard=False) -> (path, transformers model)``: a tiny random
    checkpoint of a ``tests/hf/hf_reference.py`` family (``shard``: in several safetensors
    files), written once per module."""
    from tests.hf.hf_reference import make_checkpoint

    made = {}

    def get(family, shard=False):
        key = (family, shard)
        if key not in made:
            path = str(tmp_path_factory.mktemp(f"{family}{'_sharded' if shard else ''}"))
            made[key] = (path, make_checkpoint(family, path, shard=shard))
        return made[key]

    return get


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama checkpoint (examples/make_tiny_hf_llama.py, tokenizer trained on
    ``hf_reference.DATA``), written once per module."""
    import make_tiny_hf_llama

    from tests.hf.hf_reference import DATA

    path = str(tmp_path_factory.mktemp("tiny") / "ckpt")
    make_tiny_hf_llama.main(path, DATA)
    return path



@pytest.fixture(scope="module")
def tiny_export(tiny, mcore_parallel, tmp_path_factory):
    """``{"adapter": dir, "merged": dir}``: the package's exports (``save_peft_adapter``,
    ``save_merged_checkpoint``) of :func:`tiny` with LoRA on every linear, its B matrices random
    (non-zero: the adapter changes the model's outputs), written once per module."""
    import torch

    from megatron_fastpath.hf.export import save_merged_checkpoint, save_peft_adapter
    from megatron_fastpath.lora import LoRAConfig, LoRALinear
    from tests.hf.hf_reference import build_ours

    cfg = LoRAConfig(rank=4, alpha=8.0, dropout=0.0,
                     targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    model, _, spec = build_ours(tiny, lora=cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, LoRALinear):
                mod.lora_B.copy_(torch.randn(mod.lora_B.shape, generator=gen) * 0.5)
    root = tmp_path_factory.mktemp("export")
    out = {"adapter": str(root / "adapter"), "merged": str(root / "merged")}
    save_peft_adapter(model, spec, cfg, out["adapter"])
    save_merged_checkpoint(model, spec, out["merged"])
    return out
