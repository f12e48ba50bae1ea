"""The sdpa backend's packed-to-padded view (issue 25 item 2): S rows of M tokens, one sequence
per row, plain causal attention per row, no [T, T] mask. Against torch's own causal SDPA on
each sequence alone (the reference nobody here wrote) and against the [T, T] mask layout; the
index buffers built on the device from the slot's ids; the rule that picks the layout."""

import pytest
import torch
import torch.nn.functional as F

from megatron_fastpath.attention.core_attention import PackedCoreAttention
from megatron_fastpath.model import ModelConfig, build_transformer_config
from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
from megatron_fastpath.sync import SyncSentinel

HEADS, GROUPS, D = 4, 2, 16
T, S, M = 64, 6, 32
SHAPE = ModelConfig(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS,
                    num_query_groups=GROUPS)


def attention(layout, max_seqlen=M, dropout=0.0):
    cfg = build_transformer_config(SHAPE, attention_dropout=dropout)
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=S, max_seqlen=max_seqlen,
                                           sdpa_layout=layout))
    return PackedCoreAttention(cfg, layer_number=1, cache=cache, backend="sdpa", apply_rope=False), cache


def qkv(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, D, generator=g, requires_grad=True) for h in (HEADS, GROUPS, GROUPS)]


def run(layout, lengths, seed=1):
    attn, cache = attention(layout)
    q, k, v = qkv(seed)
    with cache.batch(lengths) as pb:
        out = attn(q, k, v, None, packed_seq_params=pb.packed_seq_params)
        n = sum(lengths)
        (out[:n] * torch.linspace(-1, 1, n).view(n, 1, 1)).sum().backward()
    return attn, out.detach(), [x.grad for x in (q, k, v)]


@pytest.mark.parametrize("lengths", [[10, 22, 5, 3], [32, 32], [1] * S, [7]],
                         ids=["mixed", "two_full_rows", "max_seqs_singletons", "one"])
def test_padded_view_equals_causal_sdpa_per_sequence(lengths):
    attn, out, grads = run("padded", lengths)
    assert attn.sdpa_padded
    q, k, v = qkv()
    start = 0
    for n in lengths:  # torch's causal SDPA on each sequence alone, GQA by repeat_interleave
        sl = slice(start, start + n)
        rep = HEADS // GROUPS
        ref = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].repeat_interleave(rep, 1).transpose(0, 1),
            v[sl].repeat_interleave(rep, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[sl], ref.detach().reshape(n, -1), rtol=1e-5, atol=1e-6)
        start += n
    assert torch.count_nonzero(out[sum(lengths):]) == 0  # padding tokens: zeros
    for g in grads:  # nothing flows to the padding tail
        assert torch.count_nonzero(g[sum(lengths):]) == 0


def test_padded_view_equals_the_mask_layout_with_gradients():
    lengths = [10, 22, 5, 3]
    n = sum(lengths)
    _, out_p, grads_p = run("padded", lengths)
    attn_m, out_m, grads_m = run("mask", lengths)
    assert not attn_m.sdpa_padded
    torch.testing.assert_close(out_p[:n], out_m[:n], rtol=1e-5, atol=1e-6)
    for gp, gm in zip(grads_p, grads_m):
        torch.testing.assert_close(gp[:n], gm[:n], rtol=1e-5, atol=1e-6)


def test_index_buffers_built_on_the_device_without_host_reads():
    attn, cache = attention("padded")
    with SyncSentinel() as s, cache.batch([3, 2]) as pb:
        gather, scatter = pb.packed_seq_params.pad_gather_SM, pb.packed_seq_params.pad_scatter_T
    assert s.num_syncs == 0, s.summary()
    assert gather.shape == (S, M) and scatter.shape == (T,)
    assert gather[0, :3].tolist() == [0, 1, 2] and gather[1, :2].tolist() == [3, 4]
    assert (gather[0, 3:] == T).all() and (gather[2:] == T).all()  # empty cells: the zero row
    assert scatter[:5].tolist() == [0, 1, 2, M, M + 1] and (scatter[5:] == S * M).all()
    assert cache.stats.per_kind == {"sdpa_padded": 1}  # no [T, T] mask built
    assert pb.packed_seq_params.sdpa_mask_TT is None


@pytest.mark.parametrize("layout, max_seqs, max_seqlen, padded", [
    ("auto", 3, 16, True),      # 4 * 3 * 16^2 < 64^2: over 4x fewer scores
    ("auto", 4, 16, False),     # 4 * 4 * 16^2 == 64^2: only 4x fewer
    ("auto", 6, None, False),   # M = T: one row costs T^2 already
    ("mask", 3, 16, False), ("padded", 1, None, True),
])
def test_layout_rule(layout, max_seqs, max_seqlen, padded):
    cfg = PackedSeqConfig(max_tokens=T, max_seqs=max_seqs, max_seqlen=max_seqlen, sdpa_layout=layout)
    assert cfg.sdpa_padded is padded


def test_padded_view_lifts_the_mask_size_limit():
    cfg = build_transformer_config(SHAPE)
    big = PackedSeqCache(PackedSeqConfig(max_tokens=40000, max_seqs=8, max_seqlen=256))
    attn = PackedCoreAttention(cfg, layer_number=1, cache=big, backend="auto", apply_rope=False)
    assert attn.backend == "sdpa" and attn.sdpa_padded  # the mask would be refused at 40000
    with pytest.raises(ValueError, match="sdpa_layout must be one of"):
        PackedSeqConfig(max_tokens=T, max_seqs=S, sdpa_layout="dense")


def test_padded_view_saves_no_t_by_t_tensor_for_backward():
    """Issue 25: the padded-view path keeps nothing of T x T elements for backward (the mask
    layout saves its [T, T] mask), checked with autograd's saved-tensor hooks."""
    saved = {}
    for layout in ("padded", "mask"):
        attn, cache = attention(layout)
        q, k, v = qkv()
        shapes = []
        with cache.batch([10, 22, 5, 3]) as pb:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t, lambda t: t):
                attn(q, k, v, None, packed_seq_params=pb.packed_seq_params)
        saved[layout] = [s for s in shapes if tuple(s[-2:]) == (T, T)]
    assert saved["padded"] == [] and saved["mask"]
