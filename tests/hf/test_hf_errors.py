"""Bad checkpoints are refused before anything loads, naming the file / key."""

import json
import os

import pytest

pytest.importorskip("transformers")

from tests.hf.hf_reference import make_checkpoint  # noqa: E402

from megatron_fastpath.hf import CheckpointError, SafetensorsCheckpoint, UnsupportedCheckpointError, read_hf_config  # noqa: E402


def write_config(path, **cfg):
    os.makedirs(path, exist_ok=True)
    base = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=48, vocab_size=96, rms_norm_eps=1e-5)
    base.update(cfg)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(base, f)
    return str(path)


@pytest.mark.parametrize("cfg, words", [
    (dict(model_type="gpt2"), "model_type 'gpt2'"),
    (dict(use_sliding_window=True), "use_sliding_window=true on model_type 'llama'"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "rope_scaling type 'longrope'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope_scaling type 'dynamic'"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5 on model_type 'llama'"),
    # Phi-3 is supported (tests/hf/test_hf_phi3.py); a rope type transformers' Phi3Config rejects is not
    (dict(model_type="phi3", rope_scaling={"type": "dynamic", "factor": 4.0}),
     "rope_scaling type 'dynamic' on Phi-3"),
])
def test_unsupported_config_refused_before_weights(tmp_path, cfg, words):
    path = write_config(tmp_path, **cfg)  # no weight files at all: the config error comes first
    with pytest.raises(UnsupportedCheckpointError) as e:
        read_hf_config(path)
    msg = str(e.value)
    assert words in msg and "config.json" in msg and "Supported:" in msg and "Qwen3-MoE" in msg


def test_missing_config_key_named(tmp_path):
    path = write_config(tmp_path)
    cfg = json.load(open(os.path.join(path, "config.json")))
    del cfg["rms_norm_eps"]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(UnsupportedCheckpointError, match="'rms_norm_eps' is missing"):
        read_hf_config(path)


def test_tp_must_divide_heads(tmp_path):
    spec = read_hf_config(write_config(tmp_path))
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_model_parallel_size=3"):
        spec.check_parallel(3)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tensor_model_parallel_size=4"):
        spec.check_parallel(4)
    spec.check_parallel(2)


def test_missing_shard_named(tmp_path):
    path = str(tmp_path / "m")
    make_checkpoint("llama", path, shard=True)
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(CheckpointError, match=f"{shard}: listed in model.safetensors.index.json but missing"):
        SafetensorsCheckpoint(path)


def test_truncated_file_named(tmp_path):
    path = str(tmp_path / "m")
    make_checkpoint("llama", path)
    f = os.path.join(path, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(CheckpointError, match="model.safetensors: truncated safetensors file"):
        SafetensorsCheckpoint(path)


def test_no_weights_named(tmp_path):
    path = write_config(tmp_path)
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        SafetensorsCheckpoint(path)


def test_config_tensor_shape_mismatch_named(mcore_parallel, tmp_path):
    from megatron_fastpath.hf.model import load_hf_model
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    path = str(tmp_path / "m")
    make_checkpoint("llama", path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["intermediate_size"] = 64  # the checkpoint has 48
    json.dump(cfg, open(cfg_path, "w"))
    spec = read_hf_config(path)
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=16, max_seqs=2, rope=spec.rope_config()))
    with pytest.raises(CheckpointError) as e:
        load_hf_model(path, cache, show_progress=False)
    msg = str(e.value)
    assert "model.safetensors" in msg and "model.layers.0.mlp.gate_proj.weight" in msg
    assert "[48, 64]" in msg and "[64, 64]" in msg


def test_a_config_json_that_is_a_fifo_is_refused_without_opening_it(tmp_path):
    """A FIFO (or any non-regular file) named config.json: one error naming it, at once (an open
    would block until something writes to it)."""
    import signal

    from megatron_fastpath.hf.config import HFConfigError

    os.mkfifo(tmp_path / "config.json")
    signal.alarm(20)  # a hang fails the test instead of the run
    try:
        with pytest.raises(HFConfigError) as e:
            read_hf_config(str(tmp_path))
    finally:
        signal.alarm(0)
    assert str(e.value) == (f"{tmp_path / 'config.json'} is not a regular file (a directory, FIFO or "
                            "device): model.path must be a Hugging Face checkpoint directory")


def test_a_truncated_tokenizer_json_is_one_error_naming_it(tmp_path):
    import make_tiny_hf_llama as tiny

    from megatron_fastpath.hf.tokenizer import ChatTokenizer, TokenizerError
    from tests.hf.hf_reference import DATA

    tiny.build_tokenizer(str(tmp_path), DATA)
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[: tok.stat().st_size // 2])
    with pytest.raises(TokenizerError) as e:
        ChatTokenizer(str(tmp_path))
    msg = str(e.value)
    assert msg.startswith(f"{tok} cannot be read as a tokenizer (") and "\n" not in msg
    assert msg.endswith("truncated or not a tokenizers file; re-download it from the model's repository")
