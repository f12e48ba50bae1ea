"""The CPU CUDA-graph stand-in (tests/support/fake_cuda_graph.py): replay re-runs the captured
ops on the captured tensors, and it catches what a GPU graph would get wrong or refuse -- a
buffer chosen in Python per call, a reallocated tensor, a host read during capture."""


import pytest
import torch

from tests.support.fake_cuda_graph import MEGATRON_SITES, CaptureError, HostReadDuringCapture, fake_cuda_graphs


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _capture(fn, *static):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*static)
    return g, out


def test_replay_recomputes_captured_ops_on_new_input_data():
    model = _mlp()
    with fake_cuda_graphs(), torch.no_grad():
        static_x = torch.randn(5, 8, device="cuda")
        g, static_y = _capture(model, static_x)
        assert g.num_ops > 0
        for _ in range(3):
            x = torch.randn(5, 8)
            static_x.copy_(x)
            g.replay()
            torch.testing.assert_close(static_y, model(x), rtol=0, atol=0)
        assert g.replays == 3


class _PythonChosenTable(torch.nn.Module):
    """Reads a table chosen in Python per call (like a 'current slot' lookup)."""

    def __init__(self):
        super().__init__()
        self.tables = [torch.full((4,), 1.0), torch.full((4,), 10.0)]
        self.current = 0

    def forward(self, x):
        return x * self.tables[self.current]


def test_buffer_chosen_in_python_per_call_replays_the_stale_buffer():
    m = _PythonChosenTable()
    with fake_cuda_graphs(), torch.no_grad():
        x = torch.ones(4)
        g, y = _capture(m, x)
        m.current = 1  # eager would now read table 1
        g.replay()
        assert torch.equal(y, torch.full((4,), 1.0))  # the graph still reads table 0
        assert not torch.equal(y, m(x))


def test_reallocated_tensor_replays_the_captured_address():
    m = torch.nn.Linear(3, 3)
    with fake_cuda_graphs(), torch.no_grad():
        x = torch.randn(2, 3)
        g, y = _capture(m, x)
        old = y.clone()
        m.bias = torch.nn.Parameter(m.bias + 5.0)  # new storage; the graph keeps the old one
        g.replay()
        assert torch.equal(y, old)
        assert not torch.allclose(y, m(x))
        m.weight.mul_(2.0)  # in place at the captured address: the graph sees it
        g.replay()
        assert not torch.equal(y, old)


@pytest.mark.parametrize("read", [
    lambda t: t.sum().item(),
    lambda t: t.tolist(),
    lambda t: bool(t[0] > 0),
    lambda t: t.nonzero(),
    lambda t: torch.equal(t, t),
])
def test_host_read_during_capture_is_refused(read):
    with fake_cuda_graphs():
        x = torch.randn(4)
        g = torch.cuda.CUDAGraph()
        with pytest.raises(HostReadDuringCapture):
            with torch.cuda.graph(g):
                read(x * 2)
        read(x)  # outside a capture it is allowed


def test_replay_before_capture_and_nested_capture_are_refused():
    with fake_cuda_graphs():
        with pytest.raises(CaptureError):
            torch.cuda.CUDAGraph().replay()
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1):
            with pytest.raises(CaptureError):
                with torch.cuda.graph(g2):
                    pass


def test_backward_capture_with_autograd_grad_matches_eager():
    """Megatron's create_bwd_graph: torch.autograd.grad inside a capture, static grad outputs."""
    model = _mlp()
    params = tuple(model.parameters())
    with fake_cuda_graphs():
        x = torch.zeros(5, 8, requires_grad=True)
        fwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd):
            y = model(x)
        dy = torch.zeros_like(y)
        bwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bwd):
            grads = torch.autograd.grad(y, (x, *params), grad_outputs=dy)
        for _ in range(2):
            new_x, new_dy = torch.randn(5, 8), torch.randn(5, 4)
            with torch.no_grad():
                x.copy_(new_x)
                dy.copy_(new_dy)
            fwd.replay()
            bwd.replay()
            ref_x = new_x.clone().requires_grad_(True)
            ref_y = model(ref_x)
            ref = torch.autograd.grad(ref_y, (ref_x, *params), grad_outputs=new_dy)
            torch.testing.assert_close(y.detach(), ref_y.detach(), rtol=0, atol=0)
            for a, b in zip(grads, ref):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_megatron_sites_still_exist():
    from tests.support.cuda_as_cpu import moved_megatron_sites

    moved = moved_megatron_sites(MEGATRON_SITES)
    assert not moved, "\n".join(moved)


def test_host_read_in_a_captured_backward_is_refused():
    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            g.abs().max().item()
            return g * 2

    with fake_cuda_graphs():
        x = torch.randn(4, requires_grad=True)
        y = ReadsInBackward.apply(x)
        g = torch.cuda.CUDAGraph()
        with pytest.raises(HostReadDuringCapture, match="_local_scalar_dense"):
            with torch.cuda.graph(g):
                torch.autograd.grad(y, x, grad_outputs=torch.ones(4))


def test_uninitialised_allocations_are_not_replayed():
    """torch.empty is no kernel on a GPU: replay leaves the captured memory as it is."""
    with fake_cuda_graphs():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            buf = torch.empty(4)
            buf.fill_(3.0)
            out = buf + 1
        buf.fill_(10.0)  # nothing in the graph re-allocates buf; fill_ is replayed
        g.replay()
        assert torch.equal(out, torch.full((4,), 4.0))
        assert g.num_ops == 2  # fill_ and add; empty is not an op to replay


# -- a capture runs no kernel: what existed before capture_begin is unchanged until replay()

def test_captured_in_place_write_waits_for_replay():
    with fake_cuda_graphs():
        x = torch.zeros(3)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x.add_(1)
        assert torch.equal(x, torch.zeros(3))
        for n in (1, 2, 3):
            g.replay()
            assert torch.equal(x, torch.full((3,), float(n)))


def test_written_view_with_offset_is_restored_and_its_base_untouched():
    with fake_cuda_graphs():
        base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
        before = base.clone()
        view = base[1:, 2::2].t()  # storage offset 8, strides (2, 6)
        assert view.storage_offset() == 8 and not view.is_contiguous()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            view.mul_(-1.0)
            torch.add(view, 0.5, out=view)  # an out= write of the same view
        assert torch.equal(base, before)
        g.replay()
        expected = before.clone()
        expected[1:, 2::2] = -before[1:, 2::2] + 0.5
        assert torch.equal(base, expected)  # the other elements of base untouched


def test_tensor_created_inside_the_capture_keeps_working_across_replays():
    with fake_cuda_graphs():
        x = torch.tensor([1.0, 2.0])
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            acc = torch.zeros(2)
            acc.add_(x)
            acc.mul_(3)
            counter = torch.tensor([10.0])  # torch.tensor: a storage the capture created
            counter.add_(1)
        # the capture's values stay in what the capture created
        assert torch.equal(acc, torch.tensor([3.0, 6.0])) and torch.equal(counter, torch.tensor([11.0]))
        for n, new_x in enumerate(([5.0, 7.0], [-1.0, 0.0]), start=1):
            x.copy_(torch.tensor(new_x))
            g.replay()
            assert torch.equal(acc, 3 * torch.tensor(new_x))  # zeros replayed, then add, mul
            assert torch.equal(counter, torch.tensor([11.0 + n]))  # not re-created: counts on


def test_captured_backward_into_an_existing_grad_accumulates_once_per_replay():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    with fake_cuda_graphs():
        x = torch.randn(5, 4)
        for p in lin.parameters():
            p.grad = torch.full_like(p, 0.25)  # accumulating: .grad is not None
        before = [p.grad for p in lin.parameters()]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            lin(x).square().sum().backward()
        for p, b in zip(lin.parameters(), before):
            assert p.grad is b and torch.equal(p.grad, torch.full_like(p, 0.25))
        ref = torch.nn.Linear(4, 3)
        ref.load_state_dict(lin.state_dict())
        ref(x).square().sum().backward()
        for n in (1, 2):
            g.replay()
            for p, r in zip(lin.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, 0.25 + n * r.grad, rtol=1e-6, atol=1e-6)


def _adamw_pair(foreach):
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.01, fused=False,
                              foreach=foreach, capturable=True) for m in (a, b)]
    for m, opt in zip((a, b), opts):  # one eager step: the states exist before the capture
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.5)
        opt.step()
    return (a, opts[0]), (b, opts[1])


def _adam_state(model, opt):
    return [t.clone() for p in model.parameters()
            for t in (p.detach(), *(opt.state[p][k] for k in ("step", "exp_avg", "exp_avg_sq")))]


@pytest.mark.parametrize("foreach", [False, True])
def test_captured_optimizer_step_applies_nothing_until_replay(foreach):
    with fake_cuda_graphs():  # capturable=True needs the stand-in CUDA device from the start
        (graphed, opt), (eager, ref) = _adamw_pair(foreach)
        g = torch.cuda.CUDAGraph()
        for p, q in zip(graphed.parameters(), eager.parameters()):
            p.grad.copy_(torch.randn_like(p))
            q.grad.copy_(p.grad)
        before = _adam_state(graphed, opt)
        with torch.cuda.graph(g):
            opt.step()
        for a, b in zip(_adam_state(graphed, opt), before):
            assert torch.equal(a, b)  # params, step, exp_avg, exp_avg_sq: as before the capture
        for _ in range(2):
            g.replay()
            ref.step()
            for a, b in zip(_adam_state(graphed, opt), _adam_state(eager, ref)):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def _iteration_flow():
    """A model, its static input buffers, and one training iteration (forward+backward of two
    microbatches into the existing .grad, then an AdamW step) as two graphs' worth of work."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, capturable=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # states initialised (a zero gradient)

    def fwd_bwd(xs, ys):
        losses = []
        for x, y in zip(xs, ys):
            loss = (model(x) - y).square().mean() / len(xs)
            loss.backward()
            losses.append(loss.detach())
        return losses

    return model, opt, fwd_bwd


def _batches(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(3, 4, generator=g) for _ in range(2)], [torch.randn(3, 1, generator=g) for _ in range(2)]


def test_capture_then_immediate_replay_is_one_iteration():
    """FullCudaGraphWrapper's flow: warm-up eagerly, then on the capture iteration capture the
    forward-backward (and the optimizer step as a second graph) and replay at once."""
    with fake_cuda_graphs():
        model, opt, fwd_bwd = _iteration_flow()
        ref_model, ref_opt, ref_fwd_bwd = _iteration_flow()
        static_xs, static_ys = (torch.zeros(3, 4), torch.zeros(3, 4)), (torch.zeros(3, 1), torch.zeros(3, 1))
        fb_graph = opt_graph = None
        for step in range(4):
            xs, ys = _batches(step)
            ref_opt.zero_grad(set_to_none=False)
            ref_losses = ref_fwd_bwd(xs, ys)
            ref_opt.step()
            opt.zero_grad(set_to_none=False)  # outside the graph, as Megatron's zero_grad_buffer
            for buf, new in zip(static_xs + static_ys, xs + ys):
                buf.copy_(new)
            if step == 0:  # warm-up: eager
                losses = fwd_bwd(static_xs, static_ys)
                opt.step()
            else:
                if step == 1:
                    fb_graph, opt_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                    grads_before = [p.grad.clone() for p in model.parameters()]
                    with torch.cuda.graph(fb_graph):
                        losses = fwd_bwd(static_xs, static_ys)
                    for p, b in zip(model.parameters(), grads_before):
                        assert torch.equal(p.grad, b)  # the capture accumulated nothing
                    with torch.cuda.graph(opt_graph):
                        opt.step()
                fb_graph.replay()
                opt_graph.replay()
            for a, b in zip(losses, ref_losses):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            for p, q in zip(model.parameters(), ref_model.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.fixture
def full_cuda_graph_wrapper_state():
    from megatron.core import full_cuda_graph as fcg

    saved = (dict(fcg.FullCudaGraphWrapper.curr_iteration), dict(fcg.FullCudaGraphWrapper.cuda_graph),
             dict(fcg.FullCudaGraphWrapper.result),
             {k: list(v) for k, v in fcg.StaticBufferLoader.static_buffers.items()})
    fcg.FullCudaGraphWrapper.curr_iteration = {"training": 0, "validation": 0}
    fcg.FullCudaGraphWrapper.cuda_graph = {"training": None, "validation": None}
    fcg.FullCudaGraphWrapper.result = {"training": None, "validation": None}
    fcg.StaticBufferLoader.static_buffers = {"training": [], "validation": []}
    yield fcg
    (fcg.FullCudaGraphWrapper.curr_iteration, fcg.FullCudaGraphWrapper.cuda_graph,
     fcg.FullCudaGraphWrapper.result, fcg.StaticBufferLoader.static_buffers) = saved


def test_megatron_full_cuda_graph_wrapper_applies_each_iteration_once(mcore_parallel,
                                                                      full_cuda_graph_wrapper_state):
    """Megatron's real FullCudaGraphWrapper (megatron/core/full_cuda_graph.py): iteration 0
    eager, iteration 1 captures forward_backward_func and replays it at once, then replays.
    Every iteration's gradients and losses equal one eager iteration's."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from tests.support.megatron_graphs import graph_session

    fcg = full_cuda_graph_wrapper_state

    def forward_backward_func(*, model, data_iterator, num_microbatches, seq_length, forward_only,
                              **_):
        it = data_iterator[0]
        losses = []
        for _ in range(num_microbatches):
            mb = next(it)
            loss = (model[0](mb["x"]) - mb["y"]).square().mean() / num_microbatches
            loss.backward()
            losses.append(loss.detach())
        return losses

    with graph_session():
        model_parallel_cuda_manual_seed(1234)
        model, _, _ = _iteration_flow()
        ref_model, _, _ = _iteration_flow()
        wrapper = fcg.FullCudaGraphWrapper(forward_backward_func, cuda_graph_warmup_steps=1)
        for step in range(4):
            xs, ys = _batches(step)
            for m in (model, ref_model):
                for p in m.parameters():
                    p.grad.zero_()
            ref_losses = []
            for x, y in zip(xs, ys):
                loss = (ref_model(x) - y).square().mean() / 2
                loss.backward()
                ref_losses.append(loss.detach())
            losses = wrapper(model=[model], data_iterator=iter([{"x": x, "y": y} for x, y in zip(xs, ys)]),
                             num_microbatches=2, seq_length=3, forward_only=False)
            assert (fcg.FullCudaGraphWrapper.cuda_graph["training"] is None) == (step == 0)
            for a, b in zip(losses, ref_losses):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            for p, q in zip(model.parameters(), ref_model.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
        assert fcg.FullCudaGraphWrapper.cuda_graph["training"].replays == 3


def test_collective_output_written_in_capture_is_restored_then_replayed(mcore_parallel):
    """c10d schemas (alltoall_base_(Tensor output, ...)) do not mark the output written: the
    stand-in treats a collective's tensor arguments as written, so the capture leaves a
    pre-existing output buffer as it was; a replay re-issues the collective (the subclass)."""
    import torch.distributed as dist

    from tests.support.graph_safe_standins import FakeCUDAGraphReplayingCollectives

    with fake_cuda_graphs():
        x, out = torch.arange(4.0), torch.zeros(4)
        g = FakeCUDAGraphReplayingCollectives()
        with torch.cuda.graph(g):
            dist.all_to_all_single(out, x)  # world of one: out = x
        assert torch.equal(out, torch.zeros(4))
        x.add_(10)
        g.replay()
        assert torch.equal(out, torch.arange(4.0) + 10)


@pytest.mark.parametrize("collective", ["reduce_scatter_tensor", "all_gather_into_tensor",
                                        "all_reduce"])
def test_collective_replay_writes_the_replayed_result(mcore_parallel, collective):
    """A replayed collective leaves its output holding the replay's result, as a replayed NCCL
    kernel does. gloo's reduce-scatter reduces into a buffer of its own and copies the result
    into the output inside ``Work.wait()``, through the dispatcher (``aten.split`` +
    ``aten.copy_``): ops of the collective, not of the graph -- recorded, the replay of that
    ``copy_`` wrote the capture's result over the replayed one (TP=2 + sequence parallelism:
    every reduce-scattered row-parallel output stuck at the capture's values)."""
    import torch.distributed as dist

    from tests.support.graph_safe_standins import FakeCUDAGraphReplayingCollectives

    def run(x):
        y = x * 2  # created inside the capture, as a GEMM's output is
        if collective == "all_reduce":
            dist.all_reduce(y)
            return y + 0
        out = torch.empty(4)
        getattr(dist, collective)(out, y)
        return out + 0

    with fake_cuda_graphs():
        x = torch.zeros(4)
        g = FakeCUDAGraphReplayingCollectives()
        with torch.cuda.graph(g):
            z = run(x)
        assert not any(op.func is torch.ops.aten.copy_.default for op in g.ops)
        for step in (1.0, 2.0):
            x.copy_(torch.arange(4.0) + step)
            g.replay()
            assert torch.equal(z, (torch.arange(4.0) + step) * 2), (collective, step, z)


def test_capture_end_leaves_a_collective_output_saved_for_backward_at_its_version(mcore_parallel):
    """``capture_end`` waits for the captured collectives (gloo may still be writing); a second
    ``wait()`` of gloo's reduce-scatter copies its result into the output again. That copy must
    not bump the version counter: autograd saved the output in the capture (LoRA's B saves its
    reduce-scattered input), and a backward capture over it raised "modified by an inplace
    operation" (TP=2 + SP + LoRA + per-layer graphs)."""
    import torch.distributed as dist

    with fake_cuda_graphs():
        x, w = torch.zeros(4), torch.ones(4, requires_grad=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = torch.empty(4)
            dist.reduce_scatter_tensor(out, x * 2)
            loss = (out * w).sum()  # saves out
            version = out._version
        assert out._version == version
        (grad,) = torch.autograd.grad(loss, w)
        assert torch.equal(grad, out)


def test_graph_mempool_allocation_pairs_begin_and_end():
    import torch as _torch

    from tests.support.fake_cuda_graph import _ALLOCATING

    with fake_cuda_graphs():
        pool = _torch.cuda.graph_pool_handle()
        _torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
        _torch._C._cuda_endAllocateToPool(0, pool)
        with pytest.raises(RuntimeError, match="not allocating to"):
            _torch._C._cuda_endAllocateToPool(0, pool)
        with pytest.raises(TypeError, match="incompatible function arguments"):
            _torch._C._cuda_beginAllocateCurrentThreadToPool(0, (0, 1))
        assert _ALLOCATING.pools == []


def test_megatrons_graph_mempool_buffers_on_the_stand_in():
    """0.19's forward-graph input buffers come from the graph mempool (0.19.2
    transformer/cuda_graphs.py:279-290); 0.16.1 has no such allocation (it reuses its
    TensorReusePool's buffers), so there is nothing to run there."""
    from megatron.core.transformer import cuda_graphs as cg

    if not hasattr(cg, "alloc_tensor_from_graph_mempool"):
        pytest.skip("megatron-core 0.16.x has no graph-mempool buffer allocation (TensorReusePool)")
    meta = cg.ArgMetadata(torch.ones(2, 3, requires_grad=True))
    with fake_cuda_graphs():
        cg.CudaGraphManager.global_mempool = torch.cuda.graph_pool_handle()
        try:
            out = cg.alloc_tensor_from_graph_mempool(meta)
        finally:
            cg.CudaGraphManager.global_mempool = None
    assert torch.equal(out, torch.zeros(2, 3)) and out.requires_grad and out.is_from_global_mempool
