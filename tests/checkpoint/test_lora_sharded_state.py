"""LoRA in Megatron's distributed checkpoints (torch_dist, real save/load round trips on CPU):
adapters are saved under stable keys, base weights keep the keys of a model without LoRA, a
base checkpoint loads into a LoRA model and a LoRA checkpoint's base into a plain model."""

import torch

from megatron_fastpath.compat.dist_ckpt import dist_checkpointing_on_cpu, dist_checkpointing_save_kwargs
from megatron_fastpath.lora import LoRAConfig, lora_modules
from tests.support.tiny_gpt import SHAPE
from tests.support.tiny_gpt import build_tiny_gpt as build

LORA = LoRAConfig(rank=4, alpha=8, dropout=0.0,
                  targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))


def perturb_adapters(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g))


def save(sd, path):
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True, exist_ok=True)
    with dist_checkpointing_on_cpu():
        dist_checkpointing.save(sd, str(path), **dist_checkpointing_save_kwargs())


def load(sd, path):
    from megatron.core import dist_checkpointing

    with dist_checkpointing_on_cpu():
        return dist_checkpointing.load(sd, str(path))


def checkpoint_keys(path):
    from megatron.core import dist_checkpointing

    return set(dist_checkpointing.load_tensors_metadata(str(path)))


def tensors(model):
    return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}


def test_lora_checkpoint_round_trip_keeps_adapters(mcore_parallel, tmp_path):
    src, _ = build(LORA, seed=0)
    perturb_adapters(src, seed=1)
    save(src.sharded_state_dict(), tmp_path)
    dst, _ = build(LORA, seed=7)  # different base and A init
    perturb_adapters(dst, seed=2)
    result = dst.load_state_dict(load(dst.sharded_state_dict(), tmp_path), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    a, b = tensors(src), tensors(dst)
    assert a.keys() == b.keys()
    adapter_keys = [k for k in a if "lora_" in k]
    assert len(adapter_keys) == 2 * 4 * SHAPE.num_layers  # A and B, 4 targets, every layer
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_checkpoint_keys_base_as_plain_model_adapters_stable(mcore_parallel, tmp_path):
    lora_model, _ = build(LORA)
    plain, _ = build()
    save(lora_model.sharded_state_dict(), tmp_path / "lora")
    save(plain.sharded_state_dict(), tmp_path / "plain")
    lora_keys, plain_keys = checkpoint_keys(tmp_path / "lora"), checkpoint_keys(tmp_path / "plain")
    assert not any(".base." in k for k in lora_keys)
    assert plain_keys <= lora_keys
    extra = lora_keys - plain_keys
    targets = {"self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
               "mlp.linear_fc2"}
    assert extra == {f"decoder.layers.{t}.lora_{ab}" for t in targets for ab in "AB"}


def test_base_checkpoint_loads_into_lora_model(mcore_parallel, tmp_path):
    plain, _ = build(seed=3)
    save(plain.sharded_state_dict(), tmp_path)
    lora_model, _ = build(LORA, seed=9)
    a_before = {k: v.clone() for k, v in tensors(lora_model).items() if "lora_" in k}
    wanted = {k: v for k, v in lora_model.sharded_state_dict().items() if "lora_" not in k}
    result = lora_model.load_state_dict(load(wanted, tmp_path), strict=False)
    assert sorted(result.missing_keys) == sorted(a_before)  # only the adapters stay as built
    lora_sd = tensors(lora_model)
    for k, v in tensors(plain).items():
        assert torch.equal(lora_sd[k.replace("linear_qkv.", "linear_qkv.base.")
                                   .replace("linear_proj.", "linear_proj.base.")
                                   .replace("linear_fc1.", "linear_fc1.base.")
                                   .replace("linear_fc2.", "linear_fc2.base.")], v), k


def test_lora_checkpoint_base_loads_into_plain_model(mcore_parallel, tmp_path):
    lora_model, _ = build(LORA, seed=4)
    save(lora_model.sharded_state_dict(), tmp_path)
    plain, _ = build(seed=11)
    plain.load_state_dict(load(plain.sharded_state_dict(), tmp_path), strict=True)
    lora_sd = tensors(lora_model)
    for k, v in tensors(plain).items():
        base_k = next(c for c in (k, *(k.replace(f"{t}.", f"{t}.base.") for t in
                                       ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")))
                      if c in lora_sd)
        assert torch.equal(lora_sd[base_k], v), k


def test_adapter_sharding_follows_the_base_layer(mcore_parallel):
    model, _ = build(LORA)
    sd = model.sharded_state_dict()
    qkv_a = sd["decoder.layers.0.self_attention.linear_qkv.lora_A"]
    proj_a = sd["decoder.layers.1.self_attention.linear_proj.lora_A"]
    assert qkv_a.key == "decoder.layers.self_attention.linear_qkv.lora_A"
    # the layer index is a prepended axis, as for the base weight
    assert qkv_a.global_offset[0] == 0 and proj_a.global_offset[0] == 1
    assert qkv_a.global_shape[0] == SHAPE.num_layers
    assert sd["decoder.layers.1.self_attention.linear_proj.base.weight"].key == (
        "decoder.layers.self_attention.linear_proj.weight")
