"""Gemma 2 (``model_type: gemma2``) against transformers.

* Packed logits equal transformers' (eager) per sequence on a packed batch: the (1 + weight)
  float32 norms (four per layer: the attention / MLP outputs normed before the residual add),
  GeGLU with the tanh GELU, the embeddings times sqrt(hidden), ``query_pre_attn_scalar``'s
  softmax scale, attention and final logit soft-capping (caps low enough that they change the
  logits), alternating sliding-window layers -- on the sdpa backend (mask layout and padded
  view), flex (forward) and flash (the stand-in honouring flash-attn's ``softcap``).
* Export: the PEFT adapter loads in peft onto the transformers model with our logits; the
  merged checkpoint too.
* Gemma 3 text (``gemma3_text``): the same layer plus per-head (1 + weight) q / k norms, its
  sliding layers rotating with ``rope_local_base_freq`` (the cache's second RoPE table,
  ``PackedSeqConfig.rope_local``) and the global ones with ``rope_theta`` (``linear`` scaling
  too); logits, export round trip.
* Refusals: soft-capping with the te backend (TE 2.9-2.11 has none), TE linears, the second
  RoPE on te, Gemma 3's multimodal config, bidirectional attention.
"""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.hf.hf_reference import (  # noqa: E402
    GEMMA2, LENGTHS, MAX_TOKENS, assert_packed_logits_equal, check_export_round_trip,
    packed_tokens)


def _build(path, backend="sdpa", sdpa_layout=None, max_seqlen=None, **kw_model):
    from megatron_fastpath.hf.config import read_hf_config
    from megatron_fastpath.hf.model import load_hf_model
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    spec = read_hf_config(path)
    kw = {} if sdpa_layout is None else dict(sdpa_layout=sdpa_layout)
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=MAX_TOKENS, max_seqs=8, max_seqlen=max_seqlen,
                                           rope=spec.rope_config(),
                                           rope_local=spec.rope_config_local(), **kw))
    model, _, spec = load_hf_model(path, cache, backend=backend, show_progress=False, **kw_model)
    return model, cache, spec


def test_spec_reads_gemma2(checkpoints):
    path, ref = checkpoints("gemma2")
    from megatron_fastpath.hf.config import read_hf_config

    spec = read_hf_config(path)
    assert spec.family == "gemma2" and spec.tie_embeddings
    assert spec.attn_softcap == GEMMA2["attn_logit_softcapping"]
    assert spec.final_softcap == GEMMA2["final_logit_softcapping"]
    assert spec.softmax_scale == ref.model.layers[0].self_attn.scaling
    assert spec.sliding_window == GEMMA2["sliding_window"]
    # transformers' layer types: sliding on even layers
    assert spec.window_layers == tuple(i for i, t in enumerate(ref.config.layer_types)
                                       if t == "sliding_attention") == (0,)


def test_caps_matter(checkpoints, tmp_path):
    """The same weights without either cap give other logits: the test below sees the caps."""
    import transformers as tf

    _, ref = checkpoints("gemma2")
    nocap = tf.AutoModelForCausalLM.from_config(
        tf.Gemma2Config(**{**ref.config.to_dict(), "attn_logit_softcapping": None,
                           "final_logit_softcapping": None}), attn_implementation="eager")
    nocap.load_state_dict(ref.state_dict())
    seq = packed_tokens(LENGTHS, MAX_TOKENS)[:, : LENGTHS[2]]
    with torch.no_grad():
        assert (ref(seq).logits - nocap.eval()(seq).logits).abs().max() > 0.1
        assert ref(seq).logits.abs().max() <= GEMMA2["final_logit_softcapping"]


@pytest.mark.parametrize("backend, layout", [("sdpa", "mask"), ("sdpa", "padded"), ("flex", None)])
def test_gemma2_logits_equal_transformers(mcore_parallel, checkpoints, backend, layout):
    path, ref = checkpoints("gemma2")
    model, cache, spec = _build(path, backend, layout, max_seqlen=max(LENGTHS))
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert [c.softcap for c in cores] == [GEMMA2["attn_logit_softcapping"]] * 2
    assert [c.window for c in cores] == [GEMMA2["sliding_window"], None]
    assert_packed_logits_equal(model, cache, ref, f"gemma2 {backend} {layout}")


def test_gemma2_flash_standin(mcore_parallel, checkpoints, fake_flash):
    path, ref = checkpoints("gemma2")
    model, cache, _ = _build(path, "flash")
    assert_packed_logits_equal(model, cache, ref, "gemma2 flash")


def test_flash_standin_softcap_contract():
    """The stand-ins' softcap is flash-attn's: cap * tanh(q.k * scale / cap) before the causal
    mask; 0.0 is off (gpu_standins and the graph-safe one)."""
    from tests.support.gpu_standins import flash_attn_varlen_func

    gen = torch.Generator().manual_seed(0)
    q, k, v = (3 * torch.randn(6, 2, 8, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    scale, cap = 0.3, 1.0
    out = flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, softmax_scale=scale, causal=True, softcap=cap)
    scores = torch.tanh(torch.einsum("qhd,khd->hqk", q, k) * scale / cap) * cap
    scores = scores.masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    torch.testing.assert_close(out, want)
    plain = flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, softmax_scale=scale, causal=True)
    assert (plain - out).abs().max() > 1e-2
    from tests.support import graph_safe_standins

    graph_safe = graph_safe_standins.flash_attn_varlen_func(
        q, k, v, cu, cu, 6, 6, softmax_scale=scale, causal=True, softcap=cap)
    torch.testing.assert_close(graph_safe, want)


def test_sdpa_softcap_backward(mcore_parallel, checkpoints):
    """The explicit soft-capped attention trains: grads equal transformers' on one sequence."""
    path, ref = checkpoints("gemma2")
    model, cache, spec = _build(path)
    tokens = packed_tokens(LENGTHS, MAX_TOKENS)
    with cache.batch(LENGTHS) as pb:
        logits = model(tokens, pb.position_ids_1T, None, packed_seq_params=pb.packed_seq_params)
        logits[:, : LENGTHS[0]].square().sum().backward()
    ref.zero_grad()
    ref(tokens[:, : LENGTHS[0]]).logits.square().sum().backward()
    ours = model.decoder.layers[0].self_attention.linear_qkv.weight.grad
    theirs_q = ref.model.layers[0].self_attn.q_proj.weight.grad
    from megatron_fastpath.hf.convert import split_qkv

    q, _, _ = split_qkv(ours, spec.num_attention_heads, spec.num_query_groups, spec.head_dim)
    rel = (q - theirs_q).abs().max() / theirs_q.abs().max()
    assert rel < 1e-4, rel
    ref.zero_grad()


def test_export_round_trip(mcore_parallel, tmp_path):
    """LoRA-trained: the PEFT adapter and the merged checkpoint (the four norms back under their
    names) load in transformers and give our logits."""
    check_export_round_trip(tmp_path, "gemma2", max_seqlen=max(LENGTHS))
    adapter = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert adapter["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                         "up_proj", "v_proj"]
    index = json.load(open(tmp_path / "merged" / "model.safetensors.index.json"))["weight_map"]
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        assert f"model.layers.1.{norm}.weight" in index
    assert "lm_head.weight" not in index  # tied


def test_te_backend_with_softcap_refused_before_weights(mcore_parallel, checkpoints, fake_te,
                                                        monkeypatch):
    from megatron_fastpath.hf.checkpoint import SafetensorsCheckpoint

    def no_reads(self, *a, **k):
        raise AssertionError("a weight was read before the refusal")

    monkeypatch.setattr(SafetensorsCheckpoint, "get", no_reads, raising=False)
    path, _ = checkpoints("gemma2")
    with pytest.raises(ValueError, match=r"soft-capping .*'te' attention backend: Transformer "
                                         r"Engine 2.9-2.11's DotProductAttention has no logit"):
        _build(path, "te")


def test_te_linears_refused():
    from megatron_fastpath.gemma import GemmaOptions
    from megatron_fastpath.layer_spec import _check_gemma

    with pytest.raises(ValueError, match="linear_impl='te'.*use linear_impl='local'"):
        _check_gemma(GemmaOptions(), "flash", "te", None)


@pytest.mark.parametrize("cfg, words", [
    (dict(model_type="gemma2", hidden_activation="gelu"), "hidden_activation 'gelu' on Gemma 2"),
    (dict(model_type="gemma2", attention_bias=True), "attention_bias on Gemma 2"),
    (dict(model_type="gemma3"), "multimodal Gemma3ForConditionalGeneration"),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(model_type="gemma3_text", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_scaling type 'dynamic'"),
])
def test_gemma_config_refusals(tmp_path, cfg, words):
    from megatron_fastpath.hf.config import UnsupportedCheckpointError, read_hf_config

    base = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=48, rms_norm_eps=1e-6, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps({**base, **cfg}))
    with pytest.raises(UnsupportedCheckpointError) as e:
        read_hf_config(str(tmp_path))
    assert words in str(e.value) and "Supported:" in str(e.value)


def test_gemma2_config_defaults(tmp_path):
    """Gemma2Config's defaults when config.json leaves them out: tied embeddings, caps 50 / 30,
    query_pre_attn_scalar 256, window 4096 on every other layer from the first."""
    from megatron_fastpath.hf.config import read_hf_config

    cfg = dict(model_type="gemma2", vocab_size=96, hidden_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
               rms_norm_eps=1e-6, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = read_hf_config(str(tmp_path))
    assert spec.tie_embeddings and (spec.attn_softcap, spec.final_softcap) == (50.0, 30.0)
    assert spec.softmax_scale == 256 ** -0.5
    assert (spec.sliding_window, spec.window_layers) == (4096, (0, 2))



# --- Gemma 3 text ----------------------------------------------------------------------------
@pytest.mark.parametrize("family, backend, layout", [
    ("gemma3", "sdpa", "mask"), ("gemma3", "sdpa", "padded"), ("gemma3", "flex", None),
    ("gemma3_linear", "sdpa", "mask")])
def test_gemma3_logits_equal_transformers(mcore_parallel, checkpoints, family, backend, layout):
    path, ref = checkpoints(family)
    model, cache, spec = _build(path, backend, layout, max_seqlen=max(LENGTHS))
    assert spec.family == "gemma3" and spec.qk_norm and spec.attn_softcap is None
    assert spec.rope_local_theta == ref.config.rope_local_base_freq != spec.rope_theta
    assert spec.local_rope_layers == (0,) and spec.window_layers == (0,)
    if family == "gemma3_linear":
        assert spec.rope_config().seq_len_interpolation_factor == 4.0
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert [c.rope_local for c in cores] == [True, False]
    assert_packed_logits_equal(model, cache, ref, f"{family} {backend} {layout}")


def test_gemma3_flash_standin(mcore_parallel, checkpoints, fake_flash):
    path, ref = checkpoints("gemma3")
    model, cache, _ = _build(path, "flash")
    assert_packed_logits_equal(model, cache, ref, "gemma3 flash")


def test_gemma3_one_rope_base_differs(checkpoints):
    """With the global base on every layer transformers gives other logits: the test above sees
    the second RoPE table."""
    import transformers as tf

    _, ref = checkpoints("gemma3")
    one = tf.AutoModelForCausalLM.from_config(
        tf.Gemma3TextConfig(**{**ref.config.to_dict(), "rope_local_base_freq": ref.config.rope_theta}),
        attn_implementation="eager")
    one.load_state_dict(ref.state_dict())
    seq = packed_tokens(LENGTHS, MAX_TOKENS)[:, : LENGTHS[2]]
    with torch.no_grad():
        assert (ref(seq).logits - one.eval()(seq).logits).abs().max() > 1e-2


def test_gemma3_export_round_trip(mcore_parallel, tmp_path):
    check_export_round_trip(tmp_path, "gemma3", max_seqlen=max(LENGTHS))
    index = json.load(open(tmp_path / "merged" / "model.safetensors.index.json"))["weight_map"]
    assert "model.layers.0.self_attn.q_norm.weight" in index
    assert "model.layers.0.post_feedforward_layernorm.weight" in index


def test_gemma3_second_rope_refused_on_te(mcore_parallel, checkpoints, fake_te):
    path, _ = checkpoints("gemma3")
    with pytest.raises(ValueError, match=r"second RoPE base .*'te' backend takes one RoPE table"):
        _build(path, "te", linear_impl="local")
    with pytest.raises(ValueError, match=r"Gemma's layer with linear_impl='te'"):
        _build(path, "te")
