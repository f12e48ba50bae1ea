"""lora.targets as users write them: a list or a comma-separated string of Megatron names,
Hugging Face names, or PEFT's ``all-linear``. ``lora.targets=all-linear`` is one target, not a
string split into characters (``unknown LoRA target(s) ['-', 'a', 'e', ...]``), and HF names
are accepted. The reference for what the HF names and ``all-linear`` cover is
peft itself, applied to a transformers Llama."""

import pytest
from tests.support.hydra_compose import compose_job

from megatron_fastpath.lora.config import HF_TARGETS, LoRAConfig

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _peft_targeted(target_modules) -> set:
    """The module names peft puts an adapter on in a tiny Llama (layer 0)."""
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                                peft.LoraConfig(r=2, target_modules=target_modules))
    return {name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
            if isinstance(mod, peft.tuners.lora.LoraLayer)}


def _hf_names(megatron_targets) -> set:
    return {h for t in megatron_targets for h in HF_TARGETS[t]}


@pytest.mark.parametrize("given", [
    "all-linear",
    ["q_proj", "k_proj", "v_proj", "o_proj"],
    "q_proj,k_proj,v_proj,gate_proj,up_proj,down_proj",
])
def test_targets_cover_what_peft_covers(given):
    ours = LoRAConfig(targets=given).targets
    # peft reads a string other than all-linear as one pattern: hand it the list
    as_peft = given.split(",") if isinstance(given, str) and given != "all-linear" else given
    assert _hf_names(ours) == _peft_targeted(as_peft)


def test_megatron_names_keep_their_order_and_strings_are_split_on_commas():
    assert LoRAConfig(targets="linear_proj, linear_qkv").targets == ("linear_proj", "linear_qkv")
    assert LoRAConfig(targets=["linear_qkv", "q_proj", "k_proj", "v_proj"]).targets == ("linear_qkv",)


@pytest.mark.parametrize("given,match", [
    (["q_proj", "v_proj"], r"Megatron holds q_proj, k_proj, v_proj in one linear \(linear_qkv\)"),
    (["gate_proj"], r"target all of \['gate_proj', 'up_proj'\]"),
    ("all-linear,o_proj", "already names every linear"),
    ("qproj", r"unknown LoRA target\(s\) \['qproj'\].*'all-linear'"),
    ("", "unknown LoRA target"),
])
def test_partial_fused_and_unknown_targets_are_refused(given, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(targets=given)


def test_all_linear_through_the_main_job_override():
    from megatron_fastpath.train import parse_job_config

    cfg = compose_job(["fastpath.lora=true", "lora.targets=all-linear"])
    assert parse_job_config(cfg).lora.targets == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def test_phi3_fused_hf_names():
    """Phi-3's checkpoint fuses q/k/v and gate/up too: its PEFT names (what peft adapts on a
    transformers Phi3) map one to one onto Megatron's linears."""
    cfg = transformers.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                  pad_token_id=0)
    names = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    model = peft.get_peft_model(transformers.Phi3ForCausalLM(cfg), peft.LoraConfig(r=2, target_modules=names))
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert adapted == set(names)
    assert LoRAConfig(targets=names).targets == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert LoRAConfig(targets="gate_up_proj").targets == ("linear_fc1",)
