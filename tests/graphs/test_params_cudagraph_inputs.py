"""The cache's params as Megatron's CudaGraphManager treats a dataclass kwarg,
with Megatron's own functions: ``tree_map`` rebuilds it field by field with
``dataclasses.replace`` (capture makes graph-pool input buffers this way), ``get_tensors``
lists every tensor field as a graph input (copied at replay), and argument matching accepts the
params of any slot and any batch, so one runner per layer serves every microbatch."""

import dataclasses

import pytest
import torch
from megatron.core.transformer.cuda_graphs import ArgMetadata, _CudaGraphRunner, tree_map

from megatron_fastpath.compat.graphs import cudagraph_arg_tools
from megatron_fastpath.packed_seq import CachedPackedSeqParams, PackedSeqCache, PackedSeqConfig, RopeConfig

KINDS = ("sdpa_mask", "rope_cos_sin", "rope_freqs", "flex_block_mask")


@pytest.fixture
def two_batches():
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=256, max_seqs=8, num_slots=2,
                                           rope=RopeConfig(dim=8)))
    for kind in KINDS:
        cache.register(kind)
    a = cache.set_batch([100, 3, 60])
    b = cache.set_batch([256])
    return cache, a.packed_seq_params, b.packed_seq_params


def test_megatron_tree_map_rebuilds_every_field(two_batches):
    _, pa, _ = two_batches
    fresh = tree_map(lambda x: torch.zeros_like(x) if torch.is_tensor(x) else x, pa)
    assert type(fresh) is CachedPackedSeqParams
    assert fresh.tensors().keys() == pa.tensors().keys()
    assert all(not torch.equal(fresh.tensors()[k], v) or not v.any() for k, v in pa.tensors().items())
    assert (fresh.qkv_format, fresh.max_seqlen_q, fresh.cu_seqlens_q_padded) == ("thd", 256, None)


def test_every_tensor_field_is_a_graph_input(two_batches):
    _, pa, _ = two_batches
    runner = _CudaGraphRunner.__new__(_CudaGraphRunner)  # get_tensors reads no runner state
    inputs = _CudaGraphRunner.get_tensors(runner, (), {"packed_seq_params": pa})
    names = {n for n, t in pa.tensors().items()}
    assert {"cu_seqlens_q", "position_ids_T", "seq_ids_T", "real_token_mask_T", "rope_cos_T1D",
            "rope_sin_T1D", "rope_freqs_T11D", "sdpa_mask_TT", "flex_kv_indices"} <= names
    # one entry per tensor field (cu_seqlens_q and _kv are the same tensor, listed twice)
    assert len(inputs) == len(pa.tensors())
    for field in dataclasses.fields(pa):
        ArgMetadata(getattr(pa, field.name))  # every field type is one CudaGraphManager accepts


def test_one_runner_matches_any_slot_and_batch(two_batches):
    cache, pa, pb = two_batches
    assert pa is not pb and pa.sdpa_mask_TT.data_ptr() != pb.sdpa_mask_TT.data_ptr()
    reference, mismatch_errors = cudagraph_arg_tools()
    ref = reference((), {"packed_seq_params": pa})
    assert mismatch_errors(ref, (), {"packed_seq_params": pb}) == []
    # a params object whose static shape differs would not match (so a runner never misreads)
    other = PackedSeqCache(PackedSeqConfig(max_tokens=128, max_seqs=8, rope=RopeConfig(dim=8)))
    for kind in KINDS:
        other.register(kind)
    errors = mismatch_errors(ref, (), {"packed_seq_params": other.set_batch([5]).packed_seq_params})
    assert any("sdpa_mask_TT" in e for e in errors)


def test_record_fields_are_separate_graph_inputs_that_share_the_record(two_batches):
    """0.19.x shares one capture buffer among the views of one base (0.19.2
    transformer/cuda_graphs.py:109-125, :1229-1243): the record's fields reach the layers as
    separate tensors there, still filled by the record's one copy; 0.16.x keeps them views."""
    from megatron.core.transformer import cuda_graphs as cg

    from megatron_fastpath import compat

    cache, pa, _ = two_batches
    fields = (pa.cu_seqlens_q, pa.position_ids_T, pa.seq_ids_T)
    record = next(s for s in cache.slots if s.params is pa).record_R
    assert all(f.untyped_storage().data_ptr() == record.untyped_storage().data_ptr() for f in fields)
    lengths = [100, 3, 60]
    assert pa.cu_seqlens_q[:4].tolist() == [0, 100, 103, 163]
    assert torch.equal(pa.position_ids_T[:163], torch.cat([torch.arange(n) for n in lengths]).int())
    if compat.mcore_line() == compat.MCORE_0_19:
        assert all(f._base is None for f in fields)
        metas = [cg._apply_cudagraph_buffer_metadata(f) for f in fields]
        assert len({id(m) for m in metas}) == 3
    else:
        assert all(f._base is record for f in fields)
