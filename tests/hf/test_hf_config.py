"""Published config.json files (Llama-3.1-8B, Llama-2-70B, Mixtral-8x7B, Qwen3-30B-A3B; shape
keys as on the Hub) parse into the shapes of this repository's real-shape model configs, and
Llama 3.1's rope scaling into the cache's RopeConfig."""

import json
import os

import pytest
import yaml

from megatron_fastpath.hf.config import read_hf_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PUBLISHED = {
    "llama31_8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=False, hidden_act="silu",
        attention_bias=False, mlp_bias=False, head_dim=128, torch_dtype="bfloat16",
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "llama2_70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=32000, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu",
        rope_scaling=None, pretraining_tp=1),
    "mixtral_8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, rms_norm_eps=1e-5, rope_theta=1e6,
        max_position_embeddings=32768, num_local_experts=8, num_experts_per_tok=2,
        output_router_logits=False, router_aux_loss_coef=0.02, sliding_window=None,
        tie_word_embeddings=False, hidden_act="silu"),
    "qwen3_30b_a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        output_router_logits=False, router_aux_loss_coef=0.001, use_sliding_window=False,
        sliding_window=None, tie_word_embeddings=False, hidden_act="silu", attention_bias=False),
}
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
              "ffn_hidden_size", "vocab_size", "rotary_base", "rope_scaling_factor",
              "qk_layernorm", "num_experts", "moe_router_topk", "moe_ffn_hidden_size")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_give_the_repository_shapes(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[name]))
    spec = read_hf_config(str(tmp_path))
    ours = spec.model_config()
    want = yaml.safe_load(open(os.path.join(REPO, "megatron_fastpath", "configs", "model", f"{name}.yaml")))
    for key in SHAPE_KEYS:
        assert getattr(ours, key) == want[key], key
    head = want["kv_channels"] or want["hidden_size"] // want["num_attention_heads"]
    assert spec.head_dim == head == spec.rope_config().dim
    if spec.is_moe:  # HF trains without the aux loss unless output_router_logits
        assert spec.transformer_overrides()["moe_aux_loss_coeff"] == 0.0
        assert spec.transformer_overrides()["moe_router_pre_softmax"] is False  # renormalised top-k


def test_llama31_rope_matches_the_repository_rope():
    from megatron_fastpath.model import ModelConfig, rope_config_for

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(PUBLISHED["llama31_8b"], f)
        spec = read_hf_config(d)
    want = yaml.safe_load(open(os.path.join(REPO, "megatron_fastpath", "configs", "model", "llama31_8b.yaml")))
    ref = rope_config_for(ModelConfig(**want))
    assert spec.rope_config() == ref
    assert spec.rope_config().inv_freq().equal(ref.inv_freq())


BAD_FIELDS = {  # field -> (value, what the message says is allowed)
    "num_hidden_layers": (-2, "must be a whole number >= 1"),
    "hidden_size": (-4096, "must be a whole number >= 1"),
    "num_attention_heads": (0, "must be a whole number >= 1"),
    "num_key_value_heads": (0, "must be a whole number >= 1"),  # ZeroDivisionError before
    "intermediate_size": (14336.5, "must be a whole number >= 1"),
    "vocab_size": ("128256", "must be a whole number >= 1"),
    "rope_theta": (-500000.0, "must be a finite number > 0"),
    "rms_norm_eps": (float("nan"), "must be a finite number > 0"),
    "head_dim": (True, "must be a whole number >= 1"),
}


@pytest.mark.parametrize("field", sorted(BAD_FIELDS))
def test_bad_config_field_names_file_field_and_value(tmp_path, field):
    from megatron_fastpath.hf.config import HFConfigError

    value, allowed = BAD_FIELDS[field]
    cfg = dict(PUBLISHED["llama31_8b"], **{field: value})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFConfigError, match=rf"{tmp_path}/config.json: field '{field}' is .*: {allowed}"):
        read_hf_config(str(tmp_path))


@pytest.mark.parametrize("rope_scaling, match", [
    ({"rope_type": "llama3", "low_freq_factor": 1.0}, r"\(rope_scaling\): required key 'factor' is missing"),
    ({"rope_type": "llama3", "factor": -8.0}, r"\(rope_scaling\): field 'factor' is -8.0: must be a finite"),
    ([8.0], r"field 'rope_scaling' is \[8.0\]: must be an object or null"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     r"\(rope_scaling\): Llama3RopeScaling.low_freq_factor=4.0 is not below high_freq_factor=1.0"),
])
def test_bad_rope_scaling_named(tmp_path, rope_scaling, match):
    cfg = dict(PUBLISHED["llama31_8b"], rope_scaling=rope_scaling)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        read_hf_config(str(tmp_path))


def test_config_that_is_not_an_object_is_refused(tmp_path):
    from megatron_fastpath.hf.config import HFConfigError

    (tmp_path / "config.json").write_text(json.dumps([PUBLISHED["llama31_8b"]]))
    with pytest.raises(HFConfigError, match="config.json holds a JSON list, not an object"):
        read_hf_config(str(tmp_path))


def test_moe_topk_above_experts_refused(tmp_path):
    cfg = dict(PUBLISHED["mixtral_8x7b"], num_experts_per_tok=9)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="field 'num_experts_per_tok' is 9: must be <= the 8 experts"):
        read_hf_config(str(tmp_path))
