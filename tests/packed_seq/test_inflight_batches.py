"""InFlightBatches + slots_for_1f1b: the packed cache's slots under Megatron's 1F1B order
(simulated here; tests/train/test_gpu_step_path.py runs Megatron's real schedule with PP=2)."""

import pytest
import torch

from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
from megatron_fastpath.packed_seq.inflight import InFlightBatches, slots_for_1f1b


def _order_1f1b(n, pp, rank):
    """Megatron's non-interleaved 1F1B order on one stage: ('F', i) / ('B', i)."""
    warmup = min(pp - rank - 1, n)
    order = [("F", i) for i in range(warmup)]
    for i in range(n - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(n - warmup, n)]


def _run(order, num_slots):
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=32, max_seqs=4, num_slots=num_slots))
    inflight = InFlightBatches(cache)
    w = torch.ones(1, requires_grad=True)
    outputs = {}
    for kind, i in order:
        if kind == "F":
            pb = inflight.acquire([8, 4 + i])
            outputs[i] = inflight.mark(w * (i + 1), pb)
        else:
            outputs.pop(i).sum().backward()
    inflight.release_all()
    return inflight, w


def test_slots_for_1f1b():
    assert [slots_for_1f1b(4, 2, r) for r in (0, 1)] == [2, 1]
    assert [slots_for_1f1b(8, 4, r) for r in range(4)] == [4, 3, 2, 1]
    assert slots_for_1f1b(1, 4, 0) == 1 and slots_for_1f1b(4, 1, 0) == 1


@pytest.mark.parametrize("pp, rank, n", [(2, 0, 4), (2, 1, 4), (4, 0, 8), (4, 2, 3), (1, 0, 3)])
def test_1f1b_order_fits_the_slots(pp, rank, n):
    inflight, w = _run(_order_1f1b(n, pp, rank), slots_for_1f1b(n, pp, rank))
    assert inflight.max_in_flight == slots_for_1f1b(n, pp, rank)
    assert inflight.backward_checks == n
    assert w.grad.item() == sum(range(1, n + 1))


def test_too_few_slots_run_out():
    with pytest.raises(RuntimeError, match="all 1 PackedSeqCache slots"):
        _run(_order_1f1b(4, 2, 0), 1)


def test_refilled_slot_detected_in_backward():
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=32, max_seqs=4, num_slots=1))
    inflight = InFlightBatches(cache)
    w = torch.ones(1, requires_grad=True)
    pb = inflight.acquire([8, 8])
    out = inflight.mark(w * 2, pb)
    cache.release(pb)  # a wrong early release ...
    cache.set_batch([4, 4])  # ... and the slot is refilled before the backward
    with pytest.raises(RuntimeError, match="refilled"):
        out.sum().backward()
