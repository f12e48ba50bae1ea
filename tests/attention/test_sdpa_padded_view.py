"""The sdpa backend's packed-to-padded view: S rows of M tokens, one sequence
per row, plain causal attention per row, no [T, T] mask. Against torch's own causal SDPA on
each sequence alone (the reference nobody here wrote) and against the [T, T] mask layout; the
index buffers built on the device from the slot's ids; the rule that picks the layout."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

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
    # empty cells read token 0 and padding tokens cell 0: no index past the tensor it indexes
    assert (gather[0, 3:] == 0).all() and (gather[1, 2:] == 0).all() and (gather[2:] == 0).all()
    assert scatter[:5].tolist() == [0, 1, 2, M, M + 1] and (scatter[5:] == 0).all()
    assert cache.stats.per_kind == {"sdpa_padded": 1}  # no [T, T] mask built
    assert pb.packed_seq_params.sdpa_mask_TT is None


@pytest.mark.parametrize("layout, max_seqs, max_seqlen, padded", [
    ("auto", 3, 16, True),      # 3 * 3 * 16^2 < 64^2: over 3x fewer scores
    ("auto", 5, 16, True),      # 3 * 5 * 16^2 < 64^2: 3.2x fewer
    ("auto", 6, 16, False),     # 3 * 6 * 16^2 > 64^2: 2.7x fewer only
    ("auto", 6, None, False),   # M = T: one row costs T^2 already
    ("mask", 3, 16, False), ("padded", 1, None, True),
])
def test_layout_rule(layout, max_seqs, max_seqlen, padded):
    cfg = PackedSeqConfig(max_tokens=T, max_seqs=max_seqs, max_seqlen=max_seqlen, sdpa_layout=layout)
    assert cfg.sdpa_padded is padded


def test_auto_layout_takes_the_padded_view_above_the_mask_limit():
    """Over ``sdpa_mask_max_tokens`` the mask is refused, so ``auto`` takes the
    padded view even without its 3x saving (M = T here) and the sdpa backend has no token limit
    (``sdpa_max_tokens``: the rule resolve_backend's auto reads); the mask layout keeps it."""
    from megatron_fastpath.packed_seq.config import sdpa_max_tokens

    over = PackedSeqConfig(max_tokens=T, max_seqs=S, sdpa_mask_max_tokens=T // 2)
    assert over.sdpa_padded and over.sdpa_max_tokens is None
    under = PackedSeqConfig(max_tokens=T, max_seqs=S, sdpa_mask_max_tokens=T)
    assert not under.sdpa_padded and under.sdpa_max_tokens is None  # auto: can still go padded
    mask = PackedSeqConfig(max_tokens=T, max_seqs=S, sdpa_mask_max_tokens=T // 2, sdpa_layout="mask")
    assert not mask.sdpa_padded and mask.sdpa_max_tokens == T // 2
    cp = PackedSeqConfig(max_tokens=T, max_seqs=S, context_parallel_size=2, sdpa_mask_max_tokens=T // 2)
    assert not cp.sdpa_padded and cp.sdpa_max_tokens == T // 2  # CP attends through the mask
    assert [sdpa_max_tokens(layout, 100) for layout in ("auto", "padded", "mask")] == [None, None, 100]
    cache = PackedSeqCache(mask)
    with pytest.raises(ValueError, match=r"mask layout needs a 64x64 mask.*limit sdpa_mask_max_tokens=32"
                                         r".*'flex', 'flash' or 'te' backend.*sdpa_layout='padded' or 'auto'"):
        cache.register("sdpa_mask")


def test_padded_view_lifts_the_mask_size_limit():
    cfg = build_transformer_config(SHAPE)
    big = PackedSeqCache(PackedSeqConfig(max_tokens=40000, max_seqs=8, max_seqlen=256))
    attn = PackedCoreAttention(cfg, layer_number=1, cache=big, backend="auto", apply_rope=False)
    assert attn.backend == "sdpa" and attn.sdpa_padded  # the mask would be refused at 40000
    with pytest.raises(ValueError, match="sdpa_layout must be one of"):
        PackedSeqConfig(max_tokens=T, max_seqs=S, sdpa_layout="dense")


def test_padded_view_saves_no_t_by_t_tensor_for_backward():
    """The padded-view path keeps nothing of T x T elements for backward (the mask
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


class _AtenOps(TorchDispatchMode):
    """Every aten op run while active, with the shapes of the tensors it returns."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((func.overloadpacket, [tuple(o.shape) for o in leaves if isinstance(o, torch.Tensor)]))
        return out


def test_padded_view_appends_no_zero_row():
    """The padded view's indices never point past the tensors they index, so it appends no
    zero row to q, k, v or the output (a ``torch.cat`` per tensor and layer: four [T + 1, h, d]
    / [S M + 1, h, d] copies): in one forward + backward no aten op concatenates (the exact
    count: 0) and none makes a tensor of T + 1 or S M + 1 rows."""
    attn, cache = attention("padded")
    q, k, v = qkv()
    mode = _AtenOps()
    with cache.batch([10, 22, 5, 3]) as pb:
        with mode:
            out = attn(q, k, v, None, packed_seq_params=pb.packed_seq_params)
            out.sum().backward()
    aten = torch.ops.aten
    assert [shapes for op, shapes in mode.ops if op is aten.cat] == []
    extended = [(op, shapes) for op, shapes in mode.ops for shape in shapes if shape[:1] in ((T + 1,), (S * M + 1,))]
    assert extended == []
    # the gathers: q, k, v into [S, M, h, d] and the output back to [T, h, d] -- no more
    assert sorted(shapes[0] for op, shapes in mode.ops if op is aten.index) == sorted(
        [(S, M, HEADS, D), (S, M, GROUPS, D), (S, M, GROUPS, D), (T, HEADS, D)])


def _padded_with_a_zero_row(attn, q, k, v, params):
    """The padded view with a zero row appended to q, k, v and the output, from the same
    params: empty cells read row T, padding tokens cell S * M."""
    gather_SM = params.pad_gather_SM.clone()
    gather_SM[gather_SM == 0] = T
    gather_SM[0, 0] = 0  # token 0 is sequence 0's first
    scatter_T = torch.where(params.real_token_mask_T, params.pad_scatter_T, S * M)

    def padded(x_THd):
        return torch.cat([x_THd, x_THd.new_zeros((1,) + x_THd.shape[1:])])[gather_SM].transpose(1, 2)

    out_ShMd = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True,
                                              scale=attn.softmax_scale, enable_gqa=True)
    out_flat = out_ShMd.transpose(1, 2).reshape(S * M, HEADS, D)
    return torch.cat([out_flat, out_flat.new_zeros((1, HEADS, D))])[scatter_T].reshape(T, -1)


@pytest.mark.parametrize("lengths", [[10, 22, 5, 3], [32, 32], [1] * S, [7]],
                         ids=["mixed", "two_full_rows", "max_seqs_singletons", "one"])
def test_padded_view_without_the_zero_row_is_bit_identical(lengths):
    """Same outputs and gradients as the zero-row version, bit for bit: what an empty cell
    holds reaches no real query (causality, right padding) and its gradient is exactly 0."""
    attn, cache = attention("padded")
    results = []
    for forward in (attn, lambda *a, packed_seq_params: _padded_with_a_zero_row(attn, *a[:3], packed_seq_params)):
        q, k, v = qkv()
        with cache.batch(lengths) as pb:
            out = forward(q, k, v, None, packed_seq_params=pb.packed_seq_params)
            (out * torch.linspace(-1, 1, T).view(T, 1)).sum().backward()
        results.append([out.detach()] + [x.grad for x in (q, k, v)])
    for new, old in zip(*results):
        assert torch.equal(new, old)
