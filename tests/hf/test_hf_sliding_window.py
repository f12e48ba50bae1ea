"""Sliding-window attention on sequences longer than the window, against
transformers 4.57, whose windowed layers keep key kv of query q iff ``kv_idx > q_idx - W`` on
top of causal (``masking_utils.sliding_window_overlay``).

* Mistral (every layer windowed) with W = 6, shorter than four of the five packed sequences:
  the packed logits equal transformers' per sequence for the sdpa backend in both layouts (the
  cache's windowed [T, T] mask; the padded view's banded causal mask), flex (forward only: no
  CPU backward), and flash / te over their CPU stand-ins, which take ``window_size`` per the
  real libraries' contract (tests/support/gpu_standins.py); the window matters: transformers
  without it differs on exactly the sequences longer than W.
* Qwen2 windowing only the layers from ``max_window_layers`` on: the same parity, and only
  those layers get the window.
* Backward (sdpa, both layouts): the gradients of the summed next-token loss are finite and
  equal transformers' (embedding, final norm, LM head: every layer's backward reaches them).
* TE with context parallelism refuses a window no sequence bound keeps within (at build).
"""

import pytest
import torch

pytest.importorskip("transformers")

from megatron_fastpath.attention import core_attention  # noqa: E402
from tests.hf.hf_reference import (  # noqa: E402
    LENGTHS, MAX_TOKENS, VOCAB, assert_rel_close, packed_logits, packed_tokens, per_sequence,
    randomize)

W = 6  # shorter than 13, 7, 20 and 9 of LENGTHS
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=48, rms_norm_eps=1e-5,
              max_position_embeddings=256, rope_theta=1000.0, tie_word_embeddings=False)


def _config(family, window=W):
    import transformers as tf

    if family == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=window, head_dim=16)
    if family == "qwen2":  # layer 0 full attention, layer 1 windowed
        return tf.Qwen2Config(**COMMON, use_sliding_window=window is not None,
                              sliding_window=window, max_window_layers=1)
    raise KeyError(family)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import transformers as tf

    made = {}

    def get(family):
        if family not in made:
            path = str(tmp_path_factory.mktemp(family))
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")
            randomize(model, 0)
            model.eval().save_pretrained(path, safe_serialization=True)
            made[family] = (path, model)
        return made[family]

    return get


def build(path, backend="sdpa", layout="mask", max_seqlen=None):
    from megatron_fastpath.hf.model import load_hf_model
    from megatron_fastpath.hf.config import read_hf_config
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    spec = read_hf_config(path)
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=MAX_TOKENS, max_seqs=8, max_seqlen=max_seqlen,
                                           rope=spec.rope_config(), sdpa_layout=layout))
    model, _, spec = load_hf_model(path, cache, backend=backend, linear_impl="local",
                                   show_progress=False)
    return model, cache, spec


def windows_of(model):
    return [layer.self_attention.core_attention.window for layer in model.decoder.layers]


def assert_parity(model, cache, ref, family):
    import transformers as tf

    tokens = packed_tokens(LENGTHS, MAX_TOKENS)
    plain = tf.AutoModelForCausalLM.from_config(_config(family, window=None),
                                                attn_implementation="eager").eval()
    plain.load_state_dict(ref.state_dict())
    with torch.no_grad():
        ours = packed_logits(model.eval(), cache, tokens)
        for start, seq in per_sequence(tokens):
            mine = ours[:, start : start + seq.shape[1]]
            assert_rel_close(mine, ref(seq).logits, what=f"{family} window {W} @{start}")
            # the window matters: without it the logits differ exactly past W tokens
            other = plain(seq).logits
            assert_rel_close(mine[:, :W], other[:, :W], what=f"first {W} tokens @{start}")
            if seq.shape[1] > W:
                assert (mine[:, W:] - other[:, W:]).abs().max() > 1e-3


@pytest.mark.parametrize("backend, layout", [("sdpa", "mask"), ("sdpa", "padded"), ("flex", "mask")])
def test_mistral_window_shorter_than_sequences_equals_transformers(mcore_parallel, checkpoints,
                                                                   backend, layout):
    path, ref = checkpoints("mistral")
    model, cache, spec = build(path, backend, layout, max_seqlen=32 if layout == "padded" else None)
    assert spec.sliding_window == W and spec.window_layers == (0, 1) and spec.max_sequence is None
    assert windows_of(model) == [W, W]
    assert cache.config.sdpa_padded == (layout == "padded")
    assert_parity(model, cache, ref, "mistral")


def test_mistral_window_flash_standin_equals_transformers(mcore_parallel, checkpoints, fake_flash):
    path, ref = checkpoints("mistral")
    model, cache, _ = build(path, "flash")
    assert_parity(model, cache, ref, "mistral")


def test_mistral_window_te_standin_equals_transformers(mcore_parallel, checkpoints, fake_te):
    path, ref = checkpoints("mistral")
    model, cache, _ = build(path, "te")
    te = [layer.self_attention.core_attention.te_attention for layer in model.decoder.layers]
    assert [m.window_size for m in te] == [(W - 1, 0)] * 2
    assert_parity(model, cache, ref, "mistral")


@pytest.mark.parametrize("backend, layout", [("sdpa", "mask"), ("sdpa", "padded"), ("flex", "mask")])
def test_qwen2_max_window_layers_equals_transformers(mcore_parallel, checkpoints, backend, layout):
    path, ref = checkpoints("qwen2")
    assert ref.config.layer_types == ["full_attention", "sliding_attention"]
    model, cache, spec = build(path, backend, layout, max_seqlen=32 if layout == "padded" else None)
    assert spec.sliding_window == W and spec.window_layers == (1,)
    assert windows_of(model) == [None, W]
    assert_parity(model, cache, ref, "qwen2")


def test_window_no_sequence_can_exceed_runs_plain_causal(mcore_parallel, checkpoints):
    """A cache bound within the window: the layers keep plain causal attention (no windowed
    mask is built)."""
    path, _ = checkpoints("mistral")
    model, cache, _ = build(path, max_seqlen=W)
    assert windows_of(model) == [None, None] and cache.window is None


@pytest.mark.parametrize("layout", ["mask", "padded"])
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_window_gradients_equal_transformers(mcore_parallel, checkpoints, family, layout):
    path, ref_saved = checkpoints(family)
    import transformers as tf

    ref = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").train()
    model, cache, _ = build(path, "sdpa", layout, max_seqlen=32 if layout == "padded" else None)
    model.train()
    tokens = packed_tokens(LENGTHS, MAX_TOKENS, seed=4)
    with cache.batch(LENGTHS) as pb:
        logits = model(tokens, pb.position_ids_1T, None, packed_seq_params=pb.packed_seq_params)
        loss = 0.0
        for start, seq in per_sequence(tokens):
            n = seq.shape[1]
            if n > 1:
                loss = loss + torch.nn.functional.cross_entropy(
                    logits[0, start : start + n - 1], seq[0, 1:], reduction="sum")
        loss.backward()
    ref_loss = 0.0
    for _, seq in per_sequence(tokens):
        if seq.shape[1] > 1:
            out = ref(input_ids=seq).logits[0, :-1]
            ref_loss = ref_loss + torch.nn.functional.cross_entropy(out, seq[0, 1:], reduction="sum")
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item())
    pairs = {"embedding.word_embeddings.weight": ref.model.embed_tokens.weight,
             "decoder.final_layernorm.weight": ref.model.norm.weight,
             "output_layer.weight": ref.lm_head.weight}
    params = dict(model.named_parameters())
    for name, theirs in pairs.items():
        mine = params[name].grad
        assert mine is not None and torch.isfinite(mine).all(), name
        assert_rel_close(mine, theirs.grad, tol=1e-4, what=f"grad {name}")
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_graph_safe_flash_standin_window_equals_the_reference():
    """The capturable flash stand-in applies window_size as the looping one does."""
    from tests.support import graph_safe_standins, gpu_standins

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, h, 8, generator=gen) for h in (4, 2, 2))
    cu = torch.tensor([0, 10, 13, 20, 24], dtype=torch.int32)
    for window in [(-1, -1), (0, 0), (3, 0), (W - 1, 0)]:
        a = gpu_standins.flash_attn_varlen_func(q, k, v, cu, cu, 16, 16, causal=True,
                                                window_size=window)
        b = graph_safe_standins.flash_attn_varlen_func(q, k, v, cu, cu, 16, 16, causal=True,
                                                       window_size=window)
        torch.testing.assert_close(a, b)


def test_te_with_context_parallelism_refuses_a_window(fake_te):
    from megatron_fastpath.model import ModelConfig, build_transformer_config
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    cfg = build_transformer_config(ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                               num_query_groups=2, ffn_hidden_size=48))
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=32, max_seqs=4, context_parallel_size=2))
    # (before TE ran CP at all, the package refused te with CP whatever the window)
    with pytest.raises(ValueError, match=r"sliding_window=6 \(layer 1\) with the 'te' backend and "
                                         r"context parallelism: .* use attention_backend=sdpa"
                                         r"|the 'te' attention backend \(only 'sdpa' runs CP"):
        core_attention.PackedCoreAttention(cfg, 1, cache=cache, backend="te", apply_rope=False,
                                           sliding_window=W)


@pytest.mark.parametrize("layout", ["mask", "padded"])
def test_windowed_layers_are_graph_safe(mcore_parallel, checkpoints, layout):
    """No host sync in the windowed layers' forward / backward nor in building the windowed
    masks (static-shape device ops), the windowed fields keep their addresses from batch to
    batch, and one CUDA-graph runner's argument matching accepts the params of any batch."""
    from megatron_fastpath.compat.graphs import cudagraph_arg_tools
    from megatron_fastpath.sync import SyncSentinel

    path, _ = checkpoints("qwen2")
    model, cache, _ = build(path, "sdpa", layout, max_seqlen=32 if layout == "padded" else None)
    field = "pad_gather_SM" if layout == "padded" else "sdpa_mask_window_TT"
    tokens = packed_tokens(LENGTHS, MAX_TOKENS)
    seen = []
    for lengths in (LENGTHS, [30, 2, 25]):
        with SyncSentinel() as sentinel:
            pb = cache.set_batch(lengths)
            out = model(tokens, pb.position_ids_1T, None, packed_seq_params=pb.packed_seq_params)
            out[:, : sum(lengths)].sum().backward()
        assert sentinel.num_syncs == 0, sentinel.events
        params = pb.packed_seq_params
        seen.append((getattr(params, field).data_ptr(), params))
        cache.release(pb)
    assert seen[0][0] == seen[1][0]
    reference, mismatch_errors = cudagraph_arg_tools()
    ref = reference((), {"packed_seq_params": seen[0][1]})
    assert mismatch_errors(ref, (), {"packed_seq_params": seen[1][1]}) == []


def test_windowed_masks_are_transformers(mcore_parallel):
    """The cache's windowed sdpa mask and flex BlockMask against transformers' rule written out
    (same sequence, 0 <= pos(q) - pos(kv) < W; a padding token attends itself)."""
    from torch.nn.attention.flex_attention import create_mask

    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
    from megatron_fastpath.packed_seq.params import block_mask_from

    cache = PackedSeqCache(PackedSeqConfig(max_tokens=MAX_TOKENS, max_seqs=8))
    cache.register("sdpa_mask_window", window=W)
    cache.register("flex_block_mask_window", window=W)
    with pytest.raises(ValueError, match="one cache serves one window"):
        cache.register("sdpa_mask_window", window=W + 1)
    p = cache.set_batch(LENGTHS).packed_seq_params
    sid, pos = p.seq_ids_T.long(), p.position_ids_T.long()
    back = pos[:, None] - pos[None, :]
    want = (sid[:, None] == sid[None, :]) & (sid[:, None] >= 0) & (back >= 0) & (back < W)
    want |= torch.eye(MAX_TOKENS, dtype=torch.bool)
    assert torch.equal(p.sdpa_mask_window_TT == 0, want)
    flex = block_mask_from(p, W)
    dense = create_mask(flex.mask_mod, None, None, MAX_TOKENS, MAX_TOKENS, device="cpu")
    assert torch.equal(dense[0, 0], want)
    assert torch.equal(flex.to_dense()[0, 0].bool(), torch.ones(1, 1, dtype=torch.bool))
