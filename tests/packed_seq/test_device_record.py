"""packed_seq.device_record: the boundary record built on the device from the packed lengths
equals the host builder's (metadata.build_host_metadata) entry for entry, and a cache slot built
from lengths inside a (fake) CUDA graph capture serves other packings at replay exactly as a
slot loaded on the host does."""

import numpy as np
import pytest
import torch

from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
from megatron_fastpath.packed_seq.device_record import build_record_from_lengths
from megatron_fastpath.packed_seq.metadata import build_host_metadata, record_size
from megatron_fastpath.packed_seq.rope import RopeConfig


def _random_packing(rng, t, s, m):
    n = int(rng.integers(1, s + 1))
    lengths = rng.integers(1, m + 1, size=n)
    while lengths.sum() > t:
        lengths = lengths[:-1]
    return lengths if lengths.size else np.array([min(m, t)])


@pytest.mark.parametrize("seed", range(4))
def test_device_record_equals_host_record(seed):
    rng = np.random.default_rng(seed)
    for _ in range(250):
        t = int(rng.integers(1, 300))
        s = int(rng.integers(1, min(t, 40) + 1))
        m = int(rng.integers(1, t + 1))
        lengths = _random_packing(rng, t, s, m)
        lengths_S = torch.zeros(s, dtype=torch.int32)
        lengths_S[: lengths.size] = torch.from_numpy(lengths)
        record_R = torch.full((record_size(t, s, m),), 7, dtype=torch.int32)  # stale content
        build_record_from_lengths(lengths_S, record_R, t, s, m)
        want = build_host_metadata(lengths, t, s, m).record_R
        assert np.array_equal(record_R.numpy(), want), (t, s, m, lengths.tolist())


def test_edge_packings():
    t, s, m = 64, 4, 16
    for lengths in ([64 // 4] * 4, [16], [1], [16, 16, 16, 16], [5, 16, 1]):
        lengths_S = torch.zeros(s, dtype=torch.int32)
        lengths_S[: len(lengths)] = torch.tensor(lengths, dtype=torch.int32)
        record_R = torch.zeros(record_size(t, s, m), dtype=torch.int32)
        build_record_from_lengths(lengths_S, record_R, t, s, m)
        assert np.array_equal(record_R.numpy(), build_host_metadata(lengths, t, s, m).record_R)


def test_slot_built_from_lengths_in_a_captured_graph_serves_other_packings():
    """Capture build_slot(0, lengths_S) once; replay it for three other packings: every field
    of the params equals a slot loaded on the host with set_batch (all derived kinds)."""
    from tests.support.fake_cuda_graph import fake_cuda_graphs

    cfg = PackedSeqConfig(max_tokens=64, max_seqs=6, max_seqlen=32, rope=RopeConfig(dim=8),
                          sdpa_layout="mask")
    packings = [[30, 20, 9], [32, 32], [5, 5, 5, 5, 5, 5], [1]]
    with fake_cuda_graphs():
        graphed, ref = PackedSeqCache(cfg, "cuda"), PackedSeqCache(cfg, "cuda")
        for cache in (graphed, ref):
            for kind in ("rope_cos_sin", "rope_freqs", "sdpa_mask", "sdpa_padded", "real_mask"):
                cache.register(kind)
        lengths_S = torch.zeros(cfg.max_seqs, dtype=torch.int32, device="cuda")

        def load(lengths):
            lengths_S.zero_()[: len(lengths)].copy_(torch.tensor(lengths, dtype=torch.int32))
            return graphed.load_slot(0, lengths, copy_record=False)

        pb = load(packings[0])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed.build_slot(0, lengths_S)
        graphed.release(pb)
        for lengths in packings[1:] + packings[:1]:
            pb = load(lengths)
            graph.replay()
            with ref.batch(lengths) as want:
                got, exp = pb.packed_seq_params.tensors(), want.packed_seq_params.tensors()
                assert got.keys() == exp.keys()
                for name in exp:
                    assert torch.equal(got[name], exp[name]), (lengths, name)
                assert torch.equal(pb.padding_mask_1T, want.padding_mask_1T)
            graphed.release(pb)
        assert graph.replays == len(packings)


def test_context_parallel_cache_refuses_lengths():
    cfg = PackedSeqConfig(max_tokens=64, max_seqs=4, context_parallel_size=2, sdpa_layout="mask")
    cache = PackedSeqCache(cfg)
    cache.load_slot(0, [16, 8], copy_record=False)
    with pytest.raises(ValueError, match="CP layout is built on the host"):
        cache.build_slot(0, torch.zeros(4, dtype=torch.int32))
