"""Phi-3 / Phi-3.5 (``model_type: phi3``) against transformers.

* Weights: the fused ``qkv_proj`` (rows ``[q; k; v]``) and ``gate_up_proj`` (rows ``[gate; up]``)
  become Megatron's per-group ``linear_qkv`` and ``[gate; up]`` ``linear_fc1``, TP shards included;
  packed logits equal transformers' per sequence (plain, partial rotary dim with a sliding
  window, LongRoPE).
* LongRoPE: inverse frequencies and attention factor bitwise transformers'
  ``_compute_longrope_parameters`` with the short factors; served only where no sequence can be
  longer than ``original_max_position_embeddings`` (transformers switches to the long factors per
  forward by length, a packed batch mixes lengths): a longer bound is refused by the loader and
  by the main job at parse, with what / why / fix.
* Export: the PEFT adapter (one adapter on each fused module) loads in peft onto the
  transformers model and gives our LoRA model's logits; the merged checkpoint too.
"""

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.hf.hf_reference import (  # noqa: E402
    DATA, LENGTHS, PHI3_ORIGINAL, assert_packed_logits_equal, build_ours, check_export_round_trip,
    make_checkpoint)

WINDOW = max(LENGTHS)  # phi3_partial's sliding_window


@pytest.mark.parametrize("family, max_seqlen", [
    ("phi3", None), ("phi3_partial", WINDOW), ("phi3_longrope", PHI3_ORIGINAL)])
def test_phi3_logits_equal_transformers(mcore_parallel, checkpoints, family, max_seqlen):
    path, ref = checkpoints(family)
    model, cache, spec = build_ours(path, max_seqlen=max_seqlen)
    assert spec.family == "phi3"
    if family == "phi3_partial":
        assert spec.rope_config().dim == spec.head_dim // 2 and spec.sliding_window == WINDOW
    if family == "phi3_longrope":
        assert spec.rope_config().cos_sin_scale != 1.0  # the attention factor is exercised
    assert_packed_logits_equal(model, cache, ref, family)


class _Dict:
    def __init__(self, tensors):
        self.tensors = tensors

    def get(self, name, rows=None, cols=None):
        t = self.tensors[name]
        t = t[slice(*rows)] if rows is not None else t
        return t[:, slice(*cols)] if cols is not None else t


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_tensors_shard_as_the_split_ones(tmp_path, tp):
    """Every TP rank's linear_qkv / linear_fc1 / linear_fc2 shard from Phi-3's fused tensors is
    the shard Llama's separate q / k / v, gate / up tensors of the same values give."""
    import dataclasses

    from megatron_fastpath.hf.config import read_hf_config
    from megatron_fastpath.hf.convert import hf_layer_names, plan_layer

    path = str(tmp_path / "phi3")
    make_checkpoint("phi3", path)
    phi = read_hf_config(path)
    llama = dataclasses.replace(phi, family="llama", model_type="llama")
    P, G, D, F = phi.num_attention_heads, phi.num_query_groups, phi.head_dim, phi.ffn_hidden_size
    gen = torch.Generator().manual_seed(0)
    fused = {"qkv": torch.randn((P + 2 * G) * D, phi.hidden_size, generator=gen),
             "gate_up": torch.randn(2 * F, phi.hidden_size, generator=gen),
             "down": torch.randn(phi.hidden_size, F, generator=gen)}
    pn, ln = hf_layer_names(phi, 1), hf_layer_names(llama, 1)
    q, k, v = fused["qkv"].split([P * D, G * D, G * D])
    gate, up = fused["gate_up"].chunk(2)
    phi_ck = _Dict({pn["qkv"]: fused["qkv"], pn["gate_up"]: fused["gate_up"], pn["down"]: fused["down"]})
    llama_ck = _Dict({ln["q"]: q, ln["k"]: k, ln["v"]: v, ln["gate"]: gate, ln["up"]: up,
                      ln["down"]: fused["down"]})
    for r in range(tp):
        mine = {p.target: p for p in plan_layer(phi, 1, r, tp)}
        theirs = {p.target: p for p in plan_layer(llama, 1, r, tp)}
        assert set(mine) == set(theirs)
        for target in ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight",
                       "mlp.linear_fc2.weight"):
            assert torch.equal(mine[target].read(phi_ck), theirs[target].read(llama_ck)), (target, r)


def _phi3_config(tmp_path, **kw):
    import transformers as tf

    cfg = dict(vocab_size=96, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=48, pad_token_id=0)
    cfg.update(kw)
    config = tf.Phi3Config(**cfg)
    config.save_pretrained(tmp_path)
    return config


@pytest.mark.parametrize("kw", [
    # Phi-3-mini-128k's shape of it: 131072 / 4096 positions (attention factor ~1.19)
    dict(max_position_embeddings=131072, original_max_position_embeddings=4096),
    dict(max_position_embeddings=4096, original_max_position_embeddings=4096),  # factor 1
    dict(max_position_embeddings=8192, original_max_position_embeddings=4096, rope_theta=250000.0),
])
def test_longrope_frequencies_and_factor_are_transformers(tmp_path, kw):
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    from megatron_fastpath.hf.config import read_hf_config

    gen = torch.Generator().manual_seed(1)
    config = _phi3_config(tmp_path, **kw, rope_scaling={
        "type": "longrope", "short_factor": (1 + torch.rand(32, generator=gen)).tolist(),
        "long_factor": (2 + 30 * torch.rand(32, generator=gen)).tolist()})
    inv_freq, factor = _compute_longrope_parameters(config, torch.device("cpu"))
    spec = read_hf_config(str(tmp_path))
    rope = spec.rope_config()
    assert rope.longrope is not None and rope.yarn is None and rope.llama3 is None
    assert rope.inv_freq().dtype == inv_freq.dtype and torch.equal(rope.inv_freq(), inv_freq)
    assert rope.cos_sin_scale == factor
    assert spec.max_sequence == kw["original_max_position_embeddings"]
    # the long factors transformers uses past the original context are not served
    long_freq, _ = _compute_longrope_parameters(config, torch.device("cpu"),
                                                seq_len=kw["original_max_position_embeddings"] + 1)
    assert not torch.equal(long_freq, inv_freq)


def test_longrope_beyond_the_original_context_refused_by_the_loader(mcore_parallel, checkpoints):
    from megatron_fastpath.hf.config import UnsupportedCheckpointError

    path, _ = checkpoints("phi3_longrope")
    with pytest.raises(UnsupportedCheckpointError) as e:
        build_ours(path)  # max_tokens 64, no max_seqlen: a sequence can have 64 tokens
    msg = str(e.value)
    assert (f"config.json: rope_scaling longrope with original_max_position_embeddings="
            f"{PHI3_ORIGINAL} (phi3) but a sequence can have 64 tokens" in msg)
    assert "long factors" in msg and "packed batch mixes lengths" in msg
    assert f"PackedSeqConfig(max_seqlen<={PHI3_ORIGINAL})" in msg


def test_longrope_bound_checked_by_the_job_at_parse(mcore_parallel, checkpoints, monkeypatch):
    from megatron_fastpath.hf.checkpoint import SafetensorsCheckpoint
    from megatron_fastpath.hf.config import UnsupportedCheckpointError
    from megatron_fastpath.train.config import parse_job_config
    from tests.support.hydra_compose import compose_job

    path, _ = checkpoints("phi3_longrope")

    def no_reads(self, *a, **k):
        raise AssertionError("a weight was read before the refusal")

    monkeypatch.setattr(SafetensorsCheckpoint, "get", no_reads, raising=False)
    data = ["data=jsonl", f"data.path={DATA}"]
    with pytest.raises(UnsupportedCheckpointError,
                       match=rf"original_max_position_embeddings={PHI3_ORIGINAL} \(phi3\) but a "
                             rf"sequence can have 64 tokens \(data.max_tokens=64\): .* set "
                             rf"data.max_tokens<={PHI3_ORIGINAL} \(data=jsonl refuses longer"):
        parse_job_config(compose_job(["model=hf", f"model.path={path}", *data, "data.max_tokens=64"]))
    job = parse_job_config(compose_job(["model=hf", f"model.path={path}", *data,
                                        f"data.max_tokens={PHI3_ORIGINAL}"]))
    assert job.model_source.rope.longrope is not None


@pytest.mark.parametrize("kw, words", [
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling type 'dynamic' on Phi-3"),
    (dict(partial_rotary_factor=0.5, rope_scaling={"type": "longrope", "short_factor": [1.0] * 16,
                                                   "long_factor": [2.0] * 16}),
     "longrope's attention factor (1.19"),
])
def test_phi3_config_refusals(tmp_path, kw, words):
    from megatron_fastpath.hf.config import UnsupportedCheckpointError, read_hf_config

    cfg = dict(model_type="phi3", vocab_size=96, hidden_size=256, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
               rms_norm_eps=1e-5, max_position_embeddings=131072,
               original_max_position_embeddings=4096, **kw)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError) as e:
        read_hf_config(str(tmp_path))
    assert words in str(e.value) and "Supported:" in str(e.value)


@pytest.mark.parametrize("family, max_seqlen", [("phi3", None), ("phi3_longrope", PHI3_ORIGINAL)])
def test_export_round_trip(mcore_parallel, tmp_path, family, max_seqlen):
    """LoRA-trained: the PEFT adapter (qkv_proj / o_proj / gate_up_proj / down_proj) and the
    merged checkpoint load in transformers and give our logits."""
    check_export_round_trip(tmp_path, family, max_seqlen=max_seqlen)
    adapter = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert adapter["target_modules"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    source = json.load(open(tmp_path / "base" / "config.json"))
    merged = json.load(open(tmp_path / "merged" / "config.json"))
    assert merged["rope_scaling"] == source["rope_scaling"]
    assert os.path.isfile(tmp_path / "merged" / "model.safetensors.index.json")
