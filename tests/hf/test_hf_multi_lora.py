"""K LoRA adapters trained at once on a Hugging Face Llama checkpoint: on one packed batch that
mixes the adapters' sequences, each adapter's slice of the multi-adapter model equals peft's LoRA
on transformers with that adapter's weights, sequence by sequence: logits and the adapter's A / B
gradients (the sum of the cross-entropy over its sequences).

Tolerance: max |ours - peft| / max |peft| <= 1e-4 (fp32), as the single-adapter comparison."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.hf.hf_reference import (  # noqa: E402
    LENGTHS, MAX_TOKENS, assert_rel_close, build_ours, lora_targets, make_peft, packed_tokens,
    peft_grads_as_ours, per_sequence)

ADAPTERS = [1, 0, 1, 0, 1]  # LENGTHS' five sequences, the two adapters interleaved


def build_joint(path, cfg, names):
    """The multi-adapter model of the checkpoint (base weights from the single-adapter load)."""
    from megatron_fastpath.hf.model import hf_transformer_config, window_kwargs
    from megatron_fastpath.lora import freeze_base_parameters
    from megatron_fastpath.model import build_fastpath_gpt
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    single, _, spec = build_ours(path, lora=cfg)
    cache = PackedSeqCache(PackedSeqConfig(
        max_tokens=MAX_TOKENS, max_seqs=8, num_adapters=len(names), rope=spec.rope_config(),
        rope_local=spec.rope_config_local()))
    tcfg = hf_transformer_config(spec, torch.float32, use_cpu_initialization=True)
    joint = build_fastpath_gpt(tcfg, cache, spec.model_config(), backend="sdpa", lora=cfg,
                               lora_adapters=names, tie_embeddings=spec.tie_embeddings,
                               gemma=spec.gemma_options(), **window_kwargs(spec))
    missing, unexpected = joint.load_state_dict(
        {n: v for n, v in single.state_dict().items() if "lora_" not in n}, strict=False)
    assert not unexpected and missing and all("lora_" in n for n in missing)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in joint.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    freeze_base_parameters(joint)
    return joint, cache, single, spec


def test_each_adapter_slice_equals_peft_on_its_sequences(mcore_parallel, checkpoints):
    from megatron_fastpath.lora import LoRAConfig, MultiLoRALinear

    path, ref = checkpoints("llama")
    cfg = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=lora_targets("llama"))
    joint, cache, single, spec = build_joint(path, cfg, ("left", "right"))
    tokens = packed_tokens(LENGTHS, MAX_TOKENS)
    labels = packed_tokens(LENGTHS, MAX_TOKENS, seed=1)
    n = sum(LENGTHS)
    with cache.batch(LENGTHS, adapters=ADAPTERS) as pb:
        logits = joint(tokens, pb.position_ids_1T, None, packed_seq_params=pb.packed_seq_params)
        torch.nn.functional.cross_entropy(logits[0, :n].float(), labels[0, :n],
                                          reduction="sum").backward()
    logits = logits.detach()
    multi = {name: m for name, m in joint.named_modules() if isinstance(m, MultiLoRALinear)}
    assert len(multi) == spec.num_layers * len(cfg.targets)
    for k in range(2):
        with torch.no_grad():  # adapter k's weights into the single-adapter model, then peft
            for name, mod in single.named_modules():
                if name in multi:
                    mod.lora_A.copy_(multi[name].lora_A[k])
                    mod.lora_B.copy_(multi[name].lora_B[k])
        pm = make_peft(ref, spec, single, cfg)
        seqs = [(s, seq) for (s, seq), a in zip(per_sequence(tokens), ADAPTERS) if a == k]
        for start, seq in seqs:
            want = pm(input_ids=seq).logits
            assert_rel_close(logits[:, start : start + seq.shape[1]], want,
                             what=f"adapter {k} logits @{start}")
            torch.nn.functional.cross_entropy(
                want[0].float(), labels[0, start : start + seq.shape[1]], reduction="sum").backward()
        for i, layer in enumerate(joint.decoder.layers):
            for target in cfg.targets:
                owner = layer.self_attention if target in ("linear_qkv", "linear_proj") else layer.mlp
                mod = getattr(owner, target)
                gA, gB = peft_grads_as_ours(pm, spec, i, target)
                assert_rel_close(mod.lora_A.grad[k], gA, what=f"adapter {k} layer {i} {target} A")
                assert_rel_close(mod.lora_B.grad[k], gB, what=f"adapter {k} layer {i} {target} B")
