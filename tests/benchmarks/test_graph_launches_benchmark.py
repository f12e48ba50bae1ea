"""benchmarks/graph_launches.py's measurement at L = 2 (the main job in this process, inside the
GPU stand-ins, dense + LoRA, 3 microbatches per step): the counted steady-state step's launch
structure per variant, exactly (integration tier); and the counting rules on a toy step (unit
tier). No time is asserted (the machine may be busy)."""

import pytest

L = 2


@pytest.fixture(scope="module")
def rows(mcore_parallel):
    import graph_launches

    return {v: graph_launches.measure(L, v) for v in graph_launches.VARIANTS}


# the integration tier: runs the main job
@pytest.mark.integration
def test_graph_launches_per_step(rows):
    import graph_launches

    n = graph_launches.MICRO_BATCHES
    assert rows["eager"]["graph_launches_per_step"] == 0
    # Megatron's CudaGraphManager: one forward and one backward graph per layer per microbatch,
    # each replayed once per microbatch
    assert rows["layers"]["graph_launches_per_step"] == 2 * L * n
    # the forward+backward of every microbatch, then the optimizer step + LR schedule
    assert rows["full_iteration"]["graph_launches_per_step"] == 2
    assert rows["full_iteration"]["recorded_graph_launches"] == 2  # the job's own count agrees


# the integration tier: runs the main job
@pytest.mark.integration
def test_eager_ops_fall_with_the_graphs_scope(rows):
    eager, layers, full = (rows[v]["eager_ops_per_step"] for v in ("eager", "layers", "full_iteration"))
    assert full == 0  # the whole GPU step is in the two graphs: only copies and launches remain
    assert full < layers < eager
    # per-layer graphs leave the embedding, loss, optimizer and Megatron's static-buffer copies
    # eager: still more than the 2 L N launches they save on
    assert layers > rows["layers"]["graph_launches_per_step"]
    for r in rows.values():
        assert r["launch_proxy"] == r["eager_ops_per_step"] + r["graph_launches_per_step"]
        assert r["d2h_copies_per_step"] == 0


# the integration tier: runs the main job
@pytest.mark.integration
def test_host_to_device_copies_and_the_same_training(rows):
    import graph_launches

    n = graph_launches.MICRO_BATCHES
    # per microbatch: the cache slot's boundary record, token ids + labels, loss mask ...
    assert rows["eager"]["h2d_copies_per_step"] == rows["layers"]["h2d_copies_per_step"] == 3 * n
    # ... and the full-iteration step's loss scale, into the wrapper's static buffers
    assert rows["full_iteration"]["h2d_copies_per_step"] == 4 * n
    # the same inputs arrive the same way without graphs and with per-layer graphs
    assert rows["eager"]["h2d_bytes_per_step"] == rows["layers"]["h2d_bytes_per_step"] > 0
    # per-layer graphs copy at least each layer's input hidden states [T, 1, H] (fp32) into the
    # forward graph's static buffer per microbatch; the full-iteration step copies nothing on
    # the device outside its two graphs
    T, H = 128, 64  # graph_launches.BASE: data.max_tokens, model.hidden_size
    assert rows["layers"]["d2d_copy_bytes_per_step"] >= L * n * T * H * 4
    assert rows["full_iteration"]["d2d_copy_bytes_per_step"] == 0
    losses = {v: r["last_loss"] for v, r in rows.items()}
    assert losses["layers"] == pytest.approx(losses["eager"], rel=1e-6)
    assert losses["full_iteration"] == pytest.approx(losses["eager"], rel=1e-6)


@pytest.mark.parametrize("in_graph", [False, True])
def test_counting_rules_on_a_toy_step(in_graph):
    """The classifier alone (unit tier's stand-ins: CUDA-as-CPU and the fake CUDA graph): a host
    factory and host-only ops are not device work, a copy from a host tensor into a device one is
    one host->device copy, views and ``empty`` launch nothing, a device op is one eager op, and
    the ops a graph replay runs count as one launch."""
    from unittest import mock

    import torch

    import graph_launches as gl
    from tests.support.fake_cuda_graph import FakeCUDAGraph, fake_cuda_graphs

    with fake_cuda_graphs():
        dev = torch.zeros(4, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dev.mul_(2).add_(1)
        count, state = gl.LaunchCount(), {}
        state["count"] = count
        with mock.patch.object(FakeCUDAGraph, "replay", gl._counting_replay(FakeCUDAGraph.replay, state)), \
                gl._Functions(count), gl._Ops(count):
            host = torch.zeros(4)  # a host factory: host work
            host.add_(3)  # host only
            dev.copy_(host, non_blocking=True)  # host -> device
            ids = torch.arange(4).to("cuda")  # host factory, then a host -> device copy
            dev.view(2, 2)  # a view: no kernel
            torch.empty(4, device="cuda")  # an allocation: no kernel
            if in_graph:
                graph.replay()
            else:
                dev.mul_(2).add_(1)
            (dev * ids).sum()  # two device kernels
    assert count.h2d == 2 and count.d2h == 0
    assert count.graph_launches == (1 if in_graph else 0)
    assert dict(count.ops) == ({"mul": 1, "sum": 1} if in_graph else
                               {"mul_": 1, "add_": 1, "mul": 1, "sum": 1})
    assert torch.equal(dev, torch.full((4,), 7.0))
