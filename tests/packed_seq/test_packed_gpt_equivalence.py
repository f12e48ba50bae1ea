"""A GPTModel on the fastpath spec, fed a packed batch, equals running every sequence unpacked
through an independent reference (loss and gradients, fp32 tolerance)."""

import numpy as np
import pytest
import torch

from megatron_fastpath.sync import SyncSentinel
from tests.support.packed_reference import packed_inputs


def packed_loss(model, cache, lengths, tokens, labels, loss_mask):
    with cache.batch(lengths) as pb:
        per_tok = model(tokens, pb.position_ids_1T, None, labels=labels,
                        packed_seq_params=pb.packed_seq_params)
        loss = (per_tok * loss_mask).sum()
        loss.backward()
    return per_tok.detach(), loss.detach()


def reference_loss(model, lengths, tokens, labels):
    per_seq, total = [], 0.0
    start = 0
    for n in lengths:
        t = tokens[:, start:start + n]
        lab = labels[:, start:start + n]
        pos = torch.arange(n).unsqueeze(0)
        per_tok = model(t, pos, None, labels=lab)
        per_tok.sum().backward()
        per_seq.append(per_tok.detach())
        total += per_tok.sum().item()
        start += n
    return torch.cat(per_seq, dim=1), total


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(a, b):
    assert a.keys() == b.keys() and len(a) > 0
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-4, atol=1e-5, msg=n)


CASES = {
    "mixed_with_singletons": [7, 1, 12, 1, 5],
    "filled_to_capacity": [10, 6, 16],
    "single_sequence": [20],
    "all_length_one": [1] * 8,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_equals_unpacked(build_pair, case):
    lengths = CASES[case]
    packed, ref, cache = build_pair(max_tokens=32, max_seqs=8)
    gen = torch.Generator().manual_seed(3)
    tokens, labels, loss_mask = packed_inputs(lengths, 32, 97, gen)
    per_tok_p, loss_p = packed_loss(packed, cache, lengths, tokens, labels, loss_mask)
    per_tok_r, loss_r = reference_loss(ref, lengths, tokens, labels)
    n = sum(lengths)
    torch.testing.assert_close(per_tok_p[:, :n], per_tok_r, rtol=1e-5, atol=1e-5)
    assert abs(loss_p.item() - loss_r) < 1e-3
    assert_grads_close(grads(packed), grads(ref))


def test_random_packings_equal_unpacked(build_pair):
    rng = np.random.default_rng(7)
    packed, ref, cache = build_pair(max_tokens=48, max_seqs=10)
    for trial in range(4):
        packed.zero_grad(), ref.zero_grad()
        for p in list(packed.parameters()) + list(ref.parameters()):
            p.grad = None
        lengths = []
        while True:
            n = int(rng.integers(1, 14))
            if sum(lengths) + n > 48 or len(lengths) == 10:
                break
            lengths.append(n)
        gen = torch.Generator().manual_seed(trial)
        tokens, labels, loss_mask = packed_inputs(lengths, 48, 97, gen)
        per_tok_p, _ = packed_loss(packed, cache, lengths, tokens, labels, loss_mask)
        per_tok_r, _ = reference_loss(ref, lengths, tokens, labels)
        torch.testing.assert_close(per_tok_p[:, : sum(lengths)], per_tok_r, rtol=1e-5, atol=1e-5)
        assert_grads_close(grads(packed), grads(ref))


def test_gqa_and_mha_and_partial_rotary(build_pair):
    from tests.support.packed_reference import TINY
    import dataclasses

    for cfg in (dataclasses.replace(TINY, num_query_groups=4),
                dataclasses.replace(TINY, num_query_groups=1)):
        packed, ref, cache = build_pair(model_cfg=cfg, max_tokens=24, max_seqs=4)
        lengths = [9, 3, 11]
        tokens, labels, loss_mask = packed_inputs(lengths, 24, 97, torch.Generator().manual_seed(1))
        per_tok_p, _ = packed_loss(packed, cache, lengths, tokens, labels, loss_mask)
        per_tok_r, _ = reference_loss(ref, lengths, tokens, labels)
        torch.testing.assert_close(per_tok_p[:, :23], per_tok_r, rtol=1e-5, atol=1e-5)
        assert_grads_close(grads(packed), grads(ref))


def test_two_microbatches_interleaved_1f1b_equal_one_at_a_time(build_pair):
    """Forward of microbatch 1 runs before backward of microbatch 0 (1F1B); each keeps its own
    cache slot, and the accumulated gradients equal running them one at a time."""
    lens = ([9, 4, 1, 10], [2, 2, 15, 3])
    inputs = [packed_inputs(l, 24, 97, torch.Generator().manual_seed(i)) for i, l in enumerate(lens)]

    seq, _, cache1 = build_pair(max_tokens=24, max_seqs=6, num_slots=1)
    for l, (t, lab, m) in zip(lens, inputs):
        packed_loss(seq, cache1, l, t, lab, m)
    expected = grads(seq)

    inter, _, cache2 = build_pair(max_tokens=24, max_seqs=6, num_slots=2)
    handles, losses = [], []
    for l, (t, lab, m) in zip(lens, inputs):  # F0, F1
        pb = cache2.set_batch(l)
        out = inter(t, pb.position_ids_1T, None, labels=lab, packed_seq_params=pb.packed_seq_params)
        handles.append(pb)
        losses.append((out * m).sum())
    assert handles[0].packed_seq_params.cu_seqlens_q.data_ptr() != handles[1].packed_seq_params.cu_seqlens_q.data_ptr()
    for pb, loss in zip(handles, losses):  # B0, B1
        loss.backward()
        cache2.release(pb)
    assert_grads_close(grads(inter), expected)


def test_slot_exhaustion_is_an_error_not_an_overwrite(build_pair):
    _, _, cache = build_pair(max_tokens=16, max_seqs=4, num_slots=2)
    a = cache.set_batch([3, 4])
    cache.set_batch([5])
    with pytest.raises(RuntimeError, match="slots hold microbatches still in flight"):
        cache.set_batch([6])
    assert a.num_tokens == 7 and cache.slots[a.slot].host.num_tokens == 7
    cache.release(a)
    with pytest.raises(RuntimeError, match="already released"):
        cache.release(a)


def test_zero_host_syncs_static_buffers_and_l_independent_metadata(build_pair):
    """10 steps: 0 host syncs per step, buffers never move, metadata work independent of L."""
    from tests.support.packed_reference import TINY
    import dataclasses

    results = {}
    for layers in (2, 4):
        packed, _, cache = build_pair(model_cfg=dataclasses.replace(TINY, num_layers=layers),
                                      max_tokens=32, max_seqs=8)
        rng = np.random.default_rng(0)
        ptrs = None
        for step in range(10):
            lengths = rng.integers(1, 8, size=int(rng.integers(1, 5))).tolist()
            tokens, labels, mask = packed_inputs(lengths, 32, 97, torch.Generator().manual_seed(step))
            before = cache.stats.snapshot()
            with SyncSentinel(name=f"step{step}") as meta:
                pb = cache.set_batch(lengths)
            with SyncSentinel(strict=True, name=f"step{step}") as s:
                out = packed(tokens, pb.position_ids_1T, None, labels=labels,
                             packed_seq_params=pb.packed_seq_params)
                (out * mask).sum().backward()
            cache.release(pb)
            assert s.num_syncs == 0 and meta.num_syncs == 0
            slot = cache.slots[0]
            now = [slot.record_R.data_ptr()] + [
                t.data_ptr() for t in pb.packed_seq_params.tensors().values()]
            ptrs = ptrs or now
            assert now == ptrs, f"buffers moved at step {step}"
            assert pb.packed_seq_params.max_seqlen_q == 32
            d = cache.stats.since(before)
            # per batch: one H2D copy, each derived kind (mask, RoPE) built once for all layers
            assert d.host_to_device_copies == 1 and d.builds == 2
        results[layers] = meta.aten_ops
    assert results[2] == results[4], results  # metadata ops per step do not grow with L


def test_no_params_is_refused_not_read_from_a_current_batch(build_pair):
    """A "current batch" fallback would read whatever batch is current when a recompute runs
    in backward. Without params there is nothing to read: refused."""
    packed, _, cache = build_pair(max_tokens=16, max_seqs=4)
    lengths = [5, 11]
    tokens, labels, mask = packed_inputs(lengths, 16, 97, torch.Generator().manual_seed(0))
    with cache.batch(lengths) as pb:
        with pytest.raises(ValueError, match="needs the batch's packed_seq_params"):
            packed(tokens, pb.position_ids_1T, None, labels=labels)


def test_stale_boundaries_impossible_after_in_place_update(build_pair):
    """A cache keyed on the identity of the caller's lengths would return stale boundaries
    after the array is updated in place; set_batch re-derives them from the values."""
    packed, ref, cache = build_pair(max_tokens=16, max_seqs=4)
    lengths = np.array([8, 8])
    with cache.batch(lengths) as pb:
        first = pb.packed_seq_params.cu_seqlens_q.tolist()
    lengths[:] = [3, 13]  # same object, new values
    with cache.batch(lengths) as pb:
        second = pb.packed_seq_params.cu_seqlens_q.tolist()
        mask = pb.packed_seq_params.sdpa_mask_TT
    assert first[:3] == [0, 8, 16] and second[:3] == [0, 3, 16]
    assert mask[3, 2] == float("-inf") and mask[2, 0] == 0  # token 3 starts a new sequence


def test_foreign_packed_seq_params_refused(build_pair):
    from megatron.core.packed_seq_params import PackedSeqParams

    packed, _, cache = build_pair(max_tokens=16, max_seqs=4)
    tokens, labels, _ = packed_inputs([16], 16, 97, torch.Generator().manual_seed(0))
    foreign = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 16], dtype=torch.int32),
                              cu_seqlens_kv=torch.tensor([0, 16], dtype=torch.int32),
                              max_seqlen_q=16, max_seqlen_kv=16)
    with cache.batch([16]):
        with pytest.raises(ValueError, match="not produced by a PackedSeqCache"):
            packed(tokens, None, None, labels=labels, packed_seq_params=foreign)


def test_unpadded_input_refused(build_pair):
    packed, _, cache = build_pair(max_tokens=16, max_seqs=4)
    with cache.batch([4, 4]) as pb:
        with pytest.raises(ValueError, match="pad the packed batch to max_tokens"):
            packed(torch.zeros(1, 8, dtype=torch.long), None, None,
                   packed_seq_params=pb.packed_seq_params)
