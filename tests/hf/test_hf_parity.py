"""Our GPTModel loaded from a Hugging Face checkpoint equals the transformers model (logits on a
packed batch vs each sequence alone) and our LoRA gradients equal peft LoRA's on it.

Tolerance: max |ours - transformers| / max |transformers| <= 1e-4 (fp32; measured ~1e-6)."""

import os

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.hf.hf_reference import (  # noqa: E402
    FAMILIES, LENGTHS, MAX_TOKENS, VOCAB, assert_packed_logits_equal, assert_rel_close, build_ours,
    lora_targets, make_peft, packed_logits, packed_tokens, peft_grads_as_ours, per_sequence,
    randomize_adapters)



@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(mcore_parallel, checkpoints, family):
    path, ref = checkpoints(family)
    model, cache, spec = build_ours(path)
    model.eval()
    tokens = packed_tokens(LENGTHS, MAX_TOKENS)
    with torch.no_grad():
        ours = packed_logits(model, cache, tokens)
        for start, seq in per_sequence(tokens):
            want = ref(seq).logits
            assert_rel_close(ours[:, start : start + seq.shape[1]], want, what=f"{family} @{start}")


def test_sharded_checkpoint_loads_the_same(mcore_parallel, checkpoints):
    path, ref = checkpoints("qwen2", shard=True)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    model, cache, _ = build_ours(path)
    assert_packed_logits_equal(model, cache, ref, "qwen2 sharded")


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_grads_equal_peft(mcore_parallel, checkpoints, family):
    from megatron_fastpath.lora import LoRAConfig, freeze_base_parameters

    path, ref = checkpoints(family)
    cfg = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=lora_targets(family))
    model, cache, spec = build_ours(path, lora=cfg)
    freeze_base_parameters(model)
    randomize_adapters(model)
    pm = make_peft(ref, spec, model, cfg)

    tokens = packed_tokens(LENGTHS, MAX_TOKENS)
    labels = packed_tokens(LENGTHS, MAX_TOKENS, seed=1)
    mask = torch.zeros(1, MAX_TOKENS)
    mask[0, : sum(LENGTHS)] = 1
    with cache.batch(LENGTHS) as pb:
        per_tok = model(tokens, pb.position_ids_1T, None, labels=labels,
                        packed_seq_params=pb.packed_seq_params)
        ours_loss = (per_tok * mask).sum()
        ours_loss.backward()
    ref_loss = 0.0
    for start, seq in per_sequence(tokens):
        logits = pm(input_ids=seq).logits[0]
        lab = labels[0, start : start + seq.shape[1]]
        loss = torch.nn.functional.cross_entropy(logits.float(), lab, reduction="sum")
        loss.backward()
        ref_loss += loss.item()
    assert abs(ours_loss.item() - ref_loss) <= 1e-4 * abs(ref_loss)

    checked = 0
    for i, layer in enumerate(model.decoder.layers):
        for target in cfg.targets:
            owner = layer.self_attention if target in ("linear_qkv", "linear_proj") else layer.mlp
            mod = getattr(owner, target)
            gA, gB = peft_grads_as_ours(pm, spec, i, target)
            assert_rel_close(mod.lora_A.grad, gA, what=f"{family} layer {i} {target} A")
            assert_rel_close(mod.lora_B.grad, gB, what=f"{family} layer {i} {target} B")
            checked += 2
    assert checked == 2 * spec.num_layers * len(cfg.targets)
    assert VOCAB == spec.vocab_size
