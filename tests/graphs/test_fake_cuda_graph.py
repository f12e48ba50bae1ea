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
