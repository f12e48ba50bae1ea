"""Mistral's sliding window and YaRN RoPE scaling, against transformers.

* A sliding window W (transformers keeps key kv of query q iff ``kv_idx > q_idx - W``,
  masking_utils ``sliding_window_overlay``): where no sequence is longer than W the layers run
  plain causal attention, and the packed logits equal transformers' per sequence with W = the
  longest sequence, transformers with W one shorter differing on exactly that sequence; a
  bound above W is served by the windowed attention (the standalone loader from the cache's
  max_seqlen, the main job at parse) -- parity on sequences longer than the window:
  tests/hf/test_hf_sliding_window.py.
* YaRN: inverse frequencies and attention factor bitwise transformers'
  ``_compute_yarn_parameters``; packed logits equal transformers' per sequence (Qwen2, Llama with
  every optional key); the merged export and PEFT adapter load in transformers with the same
  rope_scaling and give our logits.
"""

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.hf.hf_reference import (  # noqa: E402
    DATA, LENGTHS, MAX_TOKENS, assert_packed_logits_equal, assert_rel_close, build_ours,
    check_export_round_trip, packed_logits, packed_tokens, per_sequence)

WINDOW = max(LENGTHS)  # mistral_window's sliding_window


def test_mistral_window_at_least_the_longest_sequence_equals_transformers(mcore_parallel, checkpoints):
    import transformers as tf

    path, ref = checkpoints("mistral_window")
    assert json.load(open(os.path.join(path, "config.json")))["sliding_window"] == WINDOW
    model, cache, spec = build_ours(path, max_seqlen=WINDOW)
    assert spec.sliding_window == WINDOW
    tokens = packed_tokens(LENGTHS, MAX_TOKENS)
    # the same weights with a window one token shorter than the longest sequence
    shorter = tf.AutoModelForCausalLM.from_pretrained(path, sliding_window=WINDOW - 1,
                                                      attn_implementation="eager").eval()
    with torch.no_grad():
        ours = packed_logits(model.eval(), cache, tokens)
        for start, seq in per_sequence(tokens):
            mine = ours[:, start : start + seq.shape[1]]
            assert_rel_close(mine, ref(seq).logits, what=f"mistral window @{start}")
            other = shorter(seq).logits
            if seq.shape[1] <= WINDOW - 1:  # no sequence longer than that window: the same
                assert_rel_close(mine, other, what=f"window {WINDOW - 1} @{start}")
            else:  # the reference does apply the window: its last token sees one key fewer
                assert_rel_close(mine[:, :-1], other[:, :-1])
                assert (mine[:, -1] - other[:, -1]).abs().max() > 1e-3


def test_window_shorter_than_the_cache_bound_served_by_the_loader(mcore_parallel, checkpoints):
    """A cache bound above the window (once refused): the layers attend through the window."""
    path, ref = checkpoints("mistral_window")
    model, cache, spec = build_ours(path)  # max_tokens 64, no max_seqlen: a sequence can have 64
    assert spec.max_sequence is None and spec.window_layers == (0, 1)
    assert [layer.self_attention.core_attention.window for layer in model.decoder.layers] == [WINDOW] * 2
    assert_packed_logits_equal(model, cache, ref, "mistral window")


@pytest.mark.parametrize("data", [
    ["data=jsonl", f"data.path={DATA}", "data.max_tokens=64"],
    ["data.max_len=32", "data.max_tokens=64"],
])
def test_job_accepts_data_longer_than_the_window_at_parse(mcore_parallel, checkpoints, data):
    """Data longer than the window (once refused at parse): the job carries the window to the
    layers it applies to."""
    from megatron_fastpath.train.config import parse_job_config
    from tests.support.hydra_compose import compose_job

    path, _ = checkpoints("mistral_window")
    job = parse_job_config(compose_job(["model=hf", f"model.path={path}", *data]))
    source = job.model_source
    assert source.handle.spec.sliding_window == WINDOW
    assert (source.sliding_window, source.window_layers) == (WINDOW, (0, 1))


@pytest.mark.parametrize("cfg", [
    dict(model_type="mistral"),  # no key: MistralConfig's default window 4096
    dict(model_type="mistral", sliding_window=None),
    dict(model_type="mistral", sliding_window=4096),
    dict(model_type="qwen2", use_sliding_window=True, sliding_window=64),  # max_window_layers 28
    dict(model_type="qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1),
    dict(model_type="qwen2", use_sliding_window=False, sliding_window=64, max_window_layers=0),
    dict(model_type="qwen3", use_sliding_window=True, sliding_window=64,
         layer_types=["full_attention", "sliding_attention"]),
    dict(model_type="qwen3", use_sliding_window=True, sliding_window=64,
         layer_types=["full_attention", "full_attention"]),
])
def test_sliding_window_read_as_transformers_does(tmp_path, cfg):
    """The window is transformers' on the layers it marks sliding (None: none)."""
    import transformers as tf

    from megatron_fastpath.hf.config import read_hf_config

    full = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, vocab_size=96, rms_norm_eps=1e-5, **cfg)
    (tmp_path / "config.json").write_text(json.dumps(full))
    hf = tf.AutoConfig.from_pretrained(str(tmp_path))
    types = getattr(hf, "layer_types", None)
    want = hf.sliding_window if types is None or "sliding_attention" in types else None
    spec = read_hf_config(str(tmp_path))
    assert spec.sliding_window == want
    # the windowed layers: transformers' sliding_attention ones (Mistral: every layer)
    layers = () if want is None else tuple(
        i for i in range(2) if types is None or types[i] == "sliding_attention")
    assert spec.window_layers == layers


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5
    {"rope_type": "yarn", "factor": 4.0},  # original context from max_position_embeddings
    {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0,
     "beta_slow": 2.0, "truncate": False},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
     "attention_factor": 0.9},
])
def test_yarn_frequencies_and_factor_are_transformers(tmp_path, rope_scaling):
    import transformers as tf
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from megatron_fastpath.hf.config import read_hf_config

    config = tf.Qwen2Config(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                            max_position_embeddings=131072, rope_theta=1000000.0,
                            rope_scaling=dict(rope_scaling))
    config.save_pretrained(tmp_path)
    inv_freq, factor = _compute_yarn_parameters(config, torch.device("cpu"))
    rope = read_hf_config(str(tmp_path)).rope_config()
    assert rope.yarn is not None and rope.llama3 is None
    assert rope.inv_freq().dtype == inv_freq.dtype and torch.equal(rope.inv_freq(), inv_freq)
    assert rope.cos_sin_scale == factor


@pytest.mark.parametrize("family", ["qwen2_yarn", "llama_yarn"])
def test_yarn_logits_equal_transformers(mcore_parallel, checkpoints, family):
    path, ref = checkpoints(family)
    model, cache, spec = build_ours(path)
    assert spec.rope_config().cos_sin_scale != 1.0  # the attention factor is exercised
    assert_packed_logits_equal(model, cache, ref, family)


@pytest.mark.parametrize("family, key, max_seqlen", [("qwen2_yarn", "rope_scaling", None),
                                                     ("mistral_window", "sliding_window", WINDOW)])
def test_export_round_trip(mcore_parallel, tmp_path, family, key, max_seqlen):
    """LoRA-trained: the PEFT adapter and the merged checkpoint load in transformers with the
    source's rope_scaling / sliding_window and give our logits (the round trip of
    tests/hf/test_hf_export.py)."""
    check_export_round_trip(tmp_path, family, max_seqlen=max_seqlen)
    source = json.load(open(tmp_path / "base" / "config.json"))
    merged = json.load(open(tmp_path / "merged" / "config.json"))
    assert merged[key] == source[key] and merged[key] not in (None, {})
