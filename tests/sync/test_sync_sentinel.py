"""SyncSentinel catches every listed kind of host sync, names the location, and reports zero
for a clean region."""

import pytest
import torch

from megatron_fastpath import HostSyncError, SyncSentinel

X = torch.arange(12, dtype=torch.float32)
I = torch.tensor([3, 0, 2])

HOST_READS = {
    "tolist": lambda: X.tolist(),
    "item": lambda: X[0].item(),
    "__bool__": lambda: bool(X[1]),
    "__int__": lambda: int(X[2]),
    "__float__": lambda: float(X[3]),
    "__index__": lambda: [0, 1, 2, 3][I[0]],
    "cpu": lambda: X.cpu(),
    "numpy": lambda: X.numpy(),
}

DATA_DEPENDENT = {
    "aten.nonzero": lambda: torch.nonzero(X > 3),
    "aten.masked_select": lambda: torch.masked_select(X, X > 3),
    "aten._unique2": lambda: torch.unique(I),
    "aten.bincount": lambda: torch.bincount(I),
    "aten.repeat_interleave": lambda: torch.repeat_interleave(I),
    "aten.index": lambda: X[X > 3],
    "aten._local_scalar_dense": lambda: torch.ops.aten._local_scalar_dense(X[0]),
}


@pytest.mark.parametrize("name", sorted(HOST_READS))
def test_each_host_read_is_counted_once_with_location(name):
    with SyncSentinel() as s:
        HOST_READS[name]()
    assert s.num_syncs == 1, s.summary()
    (event,) = s.events
    assert (event.kind, event.op) == ("host_read", name)
    assert event.location.startswith(__file__), event.location


@pytest.mark.parametrize("op", sorted(DATA_DEPENDENT))
def test_each_data_dependent_op_is_counted(op):
    with SyncSentinel() as s:
        DATA_DEPENDENT[op]()
    assert [e.op for e in s.events] == [op], s.summary()
    assert s.events[0].kind == "data_dependent_op"


def test_repeat_interleave_with_output_size_is_not_a_sync():
    with SyncSentinel() as s:
        torch.repeat_interleave(I, output_size=5)
        torch.repeat_interleave(X, 2)
    assert s.num_syncs == 0, s.summary()


def test_clean_region_reports_zero_and_counts_aten_ops():
    with SyncSentinel() as s:
        y = torch.cumsum(X * 2, 0)
        z = torch.sort(y, stable=True).indices
        torch.zeros(4).scatter_add_(0, I % 4, torch.ones(3))
    assert s.num_syncs == 0
    assert s.op_counts["mul"] == 1 and s.op_counts["cumsum"] == 1 and s.op_counts["sort"] == 1
    assert s.aten_ops == sum(s.op_counts.values()) >= 5
    assert z.shape == (12,)


def test_strict_raises_at_first_sync_naming_it():
    with pytest.raises(HostSyncError, match=r"host_read:item at .*test_sync_sentinel.py"):
        with SyncSentinel(strict=True, name="layer0"):
            X.sum().item()


def test_item_is_not_double_counted_by_dispatch_level():
    with SyncSentinel() as s:
        X[0].item()
        X.tolist()
    assert [e.op for e in s.events] == ["item", "tolist"]


def test_nested_sentinels_both_count_and_pause_stops_recording():
    with SyncSentinel() as outer:
        X[0].item()
        with SyncSentinel() as inner:
            X[1].item()
        with outer.pause():
            X[2].item()
    assert inner.num_syncs == 1
    assert outer.num_syncs == 2


def test_sync_inside_autograd_backward_is_seen():
    class ItemInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            if g.sum() > 0:  # __bool__ on a tensor: a sync in backward
                return g * 2
            return g * 2

    x = torch.ones(3, requires_grad=True)
    with SyncSentinel() as s:
        ItemInBackward.apply(x).sum().backward()
    # The autograd engine does not carry TorchFunctionMode into backward; the dispatch-level
    # watcher still sees the scalar read (aten._local_scalar_dense), exactly once.
    assert len(s.events) == 1, s.summary()
    assert s.events[0].op in ("__bool__", "aten._local_scalar_dense")


@pytest.mark.gpu
def test_cuda_sync_debug_mode_reports_kernel_level_sync():
    x = torch.arange(8, device="cuda")
    with SyncSentinel() as s:
        torch.nonzero(x)  # syncs inside the CUDA kernel launch
    assert any(e.kind in ("cuda_sync", "data_dependent_op") for e in s.events)
    with pytest.raises((HostSyncError, RuntimeError)):
        with SyncSentinel(strict=True):
            x.sum().item()


def test_flex_attention_runs_inside_the_sentinel_and_after_it():
    """flex_attention compiles even eagerly (fullgraph=True); under a dispatch mode dynamo
    refused, the call raised and poisoned every later flex call of the process (the `flex`
    backend's first step died with the default training.sync_check=first). Dynamo's state is
    reset first: this test is about a fresh process's flex. In the one-process suite flex reused
    a graph Dynamo cached for tests/hf's flex calls, whose forward holds an ``.item()`` the
    strict sentinel stops; and a flex call that failed under another dispatch mode leaves flex
    broken for every later call."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    t = 128
    mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, t, t, device="cpu")
    q_1HTd, k_1HTd, v_1HTd = torch.randn(3, 1, 4, t, 16).unbind(0)
    with SyncSentinel(strict=True) as s:
        inside = flex_attention(q_1HTd, k_1HTd, v_1HTd, block_mask=mask)
    after = flex_attention(q_1HTd, k_1HTd, v_1HTd, block_mask=mask)
    assert s.num_syncs == 0
    assert torch.equal(inside, after)
    dense = torch.nn.functional.scaled_dot_product_attention(q_1HTd, k_1HTd, v_1HTd, is_causal=True)
    torch.testing.assert_close(inside, dense, rtol=1e-5, atol=1e-5)


def test_on_a_cuda_machine_host_tensors_are_no_syncs(monkeypatch):
    """On a CUDA build with a GPU a read of a CPU tensor (Megatron's RNG tracker compares the CPU
    RNG state with ``.item()`` at every fork) and a value-dependent op on CPU tensors wait for
    no device: not counted. This CPU build stands a CPU tensor in for every device one, so here
    they are (the tests above)."""
    from megatron_fastpath.sync import sentinel

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with SyncSentinel() as s:
        for read in HOST_READS.values():
            read()
        for op in DATA_DEPENDENT.values():
            op()
        assert torch.all(torch.get_rng_state() == torch.get_rng_state()).item()  # the fork's
    assert s.num_syncs == 0, s.summary()
    assert s.aten_ops > 0  # still watching
    # what decides it: every tensor of the call on the host (a device one among them counts)
    assert sentinel._on_the_host((X, [I]))
    assert not sentinel._on_the_host((X, torch.empty(1, device="meta")))
    assert not sentinel._on_the_host((1, "a"))  # no tensor
