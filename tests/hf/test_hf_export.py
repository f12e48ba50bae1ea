"""Round trip: import a checkpoint, train LoRA a few steps, export. PEFT loads the adapter with
no missing / unexpected keys and gives our logits; the merged checkpoint loaded by
AutoModelForCausalLM gives them too. Plus the TP / EP shard layout (no process group needed)."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.hf.hf_reference import check_export_round_trip, make_checkpoint  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_export_round_trip(mcore_parallel, tmp_path, family):
    check_export_round_trip(tmp_path, family)


def test_tp_ep_shards_concatenate_to_the_full_layout(tmp_path):
    """Each TP rank's QKV / FC1 / proj shard and each EP rank's experts, read from disk, are the
    matching blocks of the single-rank (full) tensors."""
    from megatron_fastpath.hf.checkpoint import SafetensorsCheckpoint
    from megatron_fastpath.hf.config import read_hf_config
    from megatron_fastpath.hf.convert import plan_layer, split_qkv

    src = str(tmp_path / "m")
    make_checkpoint("qwen3_moe", src)
    spec, ck = read_hf_config(src), SafetensorsCheckpoint(src)
    full = {p.target: p.read(ck) for p in plan_layer(spec, 1)}
    for tp in (2,):
        shards = [{p.target: p.read(ck) for p in plan_layer(spec, 1, r, tp)} for r in range(tp)]
        qkv = torch.cat([s["self_attention.linear_qkv.weight"] for s in shards], 0)
        assert torch.equal(qkv, full["self_attention.linear_qkv.weight"])
        # each TP shard is whole query groups: it splits into its own heads
        G, P, D = spec.num_query_groups // tp, spec.num_attention_heads // tp, spec.head_dim
        q0, _, _ = split_qkv(shards[0]["self_attention.linear_qkv.weight"], P, G, D)
        assert torch.equal(q0, ck.get("model.layers.1.self_attn.q_proj.weight")[: P * D])
        proj = torch.cat([s["self_attention.linear_proj.weight"] for s in shards], 1)
        assert torch.equal(proj, full["self_attention.linear_proj.weight"])
    for ep in (2, 4):
        shards = [{p.target: p.read(ck) for p in plan_layer(spec, 1, ep_rank=s, ep=ep)} for s in range(ep)]
        for name in ("mlp.experts.weight1", "mlp.experts.weight2"):
            assert torch.equal(torch.cat([s[name] for s in shards], 0), full[name])
    dense = str(tmp_path / "d")
    make_checkpoint("llama", dense)
    spec, ck = read_hf_config(dense), SafetensorsCheckpoint(dense)
    full = {p.target: p.read(ck) for p in plan_layer(spec, 0)}
    shards = [{p.target: p.read(ck) for p in plan_layer(spec, 0, r, 2)} for r in range(2)]
    F = spec.ffn_hidden_size
    gate = torch.cat([s["mlp.linear_fc1.weight"][: F // 2] for s in shards], 0)
    up = torch.cat([s["mlp.linear_fc1.weight"][F // 2 :] for s in shards], 0)
    assert torch.equal(torch.cat([gate, up], 0), full["mlp.linear_fc1.weight"])
    assert torch.equal(torch.cat([s["mlp.linear_fc2.weight"] for s in shards], 1), full["mlp.linear_fc2.weight"])


def test_norms_fused_into_te_linears_are_found():
    """With Transformer Engine linears Megatron fuses the layer norms into linear_qkv / fc1
    (``layer_norm_weight``; input_layernorm is an IdentityOp): the loader targets those."""
    from megatron_fastpath.hf.convert import resolve_param

    class Identity(torch.nn.Module):
        pass

    class TELinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 4))
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(4))

    layer = torch.nn.Module()
    layer.input_layernorm, layer.pre_mlp_layernorm = Identity(), Identity()
    layer.self_attention, layer.mlp = torch.nn.Module(), torch.nn.Module()
    layer.self_attention.linear_qkv, layer.mlp.linear_fc1 = TELinear(), TELinear()
    root = torch.nn.Module()
    root.decoder = torch.nn.Module()
    root.decoder.layers = torch.nn.ModuleList([layer])
    assert resolve_param(root, "decoder.layers.0.input_layernorm.weight") is layer.self_attention.linear_qkv.layer_norm_weight
    assert resolve_param(layer, "pre_mlp_layernorm.weight") is layer.mlp.linear_fc1.layer_norm_weight
    assert resolve_param(root, "decoder.layers.0.self_attention.linear_qkv.weight") is layer.self_attention.linear_qkv.weight
    assert resolve_param(root, "decoder.layers.0.mlp.router.weight") is None
