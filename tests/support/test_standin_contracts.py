"""The CUDA stand-ins keep torch 2.13's and 2.11's contracts: each of ``torch.cuda.Stream`` /
``current_stream`` / ``stream`` / ``synchronize`` / ``current_device`` / ``set_device`` /
``memory_stats`` / ``get_device_capability`` / ``get_device_name`` / ``nvtx.range_push`` /
``nvtx.range_pop`` raises the real library's error for a call the real one refuses and works
for a valid one. Where the real behaviour is observable without a GPU (pure-Python argument
parsing, signatures, ``Stream``'s Python methods, the documented ``memory_stats`` keys) the
stand-in is compared with the installed torch itself."""

import ast
import collections
import inspect
import itertools
import os
import re

import pytest
import torch

from tests.support import cuda_as_cpu as cac
from tests.support.cuda_as_cpu import cuda_as_cpu
from tests.support.fake_cuda_graph import MEMORY_STATS_KEYS, _memory_stats, fake_cuda_graphs
from tests.support.graph_safe_standins import NvtxRanges, gpu_standins
from tests.support.standin_registry import PACKAGE

# the real functions, taken before any block patches torch.cuda
REAL = {name: getattr(torch.cuda, name) for name in (
    "current_device", "set_device", "synchronize", "current_stream", "default_stream", "stream",
    "set_stream", "memory_stats", "get_device_capability", "get_device_name",
    "is_current_stream_capturing")}
REAL_NVTX = {"range_push": torch.cuda.nvtx.range_push, "range_pop": torch.cuda.nvtx.range_pop}
REAL_STREAM = torch.cuda.Stream

BAD_DEVICES = ["cpu", torch.device("cpu"), "meta"]


def _params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


# ------------------------------------------------------------------ signatures and parsing
@pytest.mark.parametrize("name,standin", [
    ("current_device", cac._current_device), ("set_device", cac._set_device),
    ("synchronize", cac._synchronize), ("current_stream", cac._current_stream),
    ("default_stream", cac._default_stream), ("stream", cac._stream_context),
    ("set_stream", cac._set_stream), ("memory_stats", _memory_stats),
    ("get_device_capability", cac.device_capability_standin()),
    ("get_device_name", cac.device_name_standin()),
    ("is_current_stream_capturing", cac._is_current_stream_capturing)])
def test_signatures_are_torchs(name, standin):
    assert _params(standin) == _params(REAL[name]), name


def test_nvtx_and_stream_signatures_are_torchs():
    ranges = NvtxRanges()
    assert _params(ranges.range_push) == _params(REAL_NVTX["range_push"])
    assert _params(ranges.range_pop) == _params(REAL_NVTX["range_pop"]) == []
    assert _params(cac._FakeStream.__init__)[1:] == _params(REAL_STREAM.__new__)[1:]
    for method in ("wait_event", "wait_stream", "record_event", "query", "synchronize"):
        assert _params(getattr(cac._FakeStream, method)) == _params(getattr(REAL_STREAM, method))


@pytest.mark.parametrize("device", [0, 3, -1, "cuda:1", torch.device("cuda", 2), "cpu",
                                    torch.device("cpu"), "meta", None, "cuda", torch.device("cuda")])
def test_device_parsing_is_torchs(device):
    """Without ``optional`` the stand-in's parsing is torch's own _get_device_index (pure
    Python); with it, only the missing index becomes the stand-in's current device (0)."""
    from torch.cuda._utils import _get_device_index

    def outcome(fn, *a):
        try:
            return fn(*a)
        except ValueError as e:
            return ("ValueError", str(e))

    assert outcome(cac.device_index, device) == outcome(_get_device_index, device)
    real = outcome(_get_device_index, device, False)
    expected = 0 if isinstance(real, tuple) and "specified index" in real[1] else real
    assert outcome(cac.device_index, device, True) == expected


def test_set_device_and_stream_none_agree_with_real_torch_where_it_answers_on_cpu():
    """Real set_device parses its argument before touching CUDA: the same errors here."""
    for bad in ("cpu", None, torch.device("cuda")):
        with pytest.raises(ValueError) as real:
            REAL["set_device"](bad)
        with cuda_as_cpu(), pytest.raises(ValueError) as standin:
            torch.cuda.set_device(bad)
        assert str(real.value) == str(standin.value)
    REAL["set_device"](-1)  # a negative index is a no-op, on both
    with cuda_as_cpu():
        torch.cuda.set_device(-1)
    with REAL["stream"](None):  # None: a no-op context, on both
        pass
    REAL["set_stream"](None)


# --------------------------------------------------------------------------------- devices
def test_device_index_rules():
    with cuda_as_cpu():
        assert torch.cuda.current_device() == 0
        with pytest.raises(TypeError):
            torch.cuda.current_device(0)
        torch.cuda.set_device(0)
        torch.cuda.set_device(torch.device("cuda", 0))
        torch.cuda.set_device("cuda:0")
        for bad in BAD_DEVICES:
            with pytest.raises(ValueError, match="Expected a cuda device, but got"):
                torch.cuda.set_device(bad)
        with pytest.raises(ValueError, match="with a specified index"):
            torch.cuda.set_device(torch.device("cuda"))
        with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
            torch.cuda.set_device(1)


def test_synchronize_checks_its_device():
    before = cac.CALLS["torch.cuda.synchronize"]
    with cuda_as_cpu():
        for ok in (None, 0, -1, "cuda", torch.device("cuda"), torch.device("cuda", 0)):
            torch.cuda.synchronize(ok)
        for bad in BAD_DEVICES:
            with pytest.raises(ValueError, match="Expected a cuda device, but got"):
                torch.cuda.synchronize(bad)
        with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
            torch.cuda.synchronize(1)
    assert cac.CALLS["torch.cuda.synchronize"] - before == 6


@pytest.mark.parametrize("fn", ["get_device_capability", "get_device_name"])
def test_device_properties_queries_check_their_device(fn):
    with fake_cuda_graphs():
        query = (torch.cuda.get_device_capability if fn == "get_device_capability"
                 else cac.device_name_standin("stand-in GPU"))
        expected = (9, 0) if fn == "get_device_capability" else "stand-in GPU"
        for ok in (None, 0, "cuda", torch.device("cuda"), "cuda:0"):
            assert query(ok) == expected
        for bad in BAD_DEVICES:
            with pytest.raises(ValueError, match="Expected a cuda device, but got"):
                query(bad)
        for bad in (1, -1, "cuda:1"):  # negative too: get_device_properties asserts
            with pytest.raises(AssertionError, match="Invalid device id"):
                query(bad)
        assert cac.device_capability_standin((10, 0))() == (10, 0)


def test_memory_stats_checks_its_device_and_answers_torchs_keys():
    with fake_cuda_graphs():
        stats = torch.cuda.memory_stats()
        assert isinstance(stats, collections.OrderedDict) and list(stats) == sorted(stats)
        assert stats["allocated_bytes.all.current"] == 0 == stats["reserved_bytes.all.peak"]
        assert torch.cuda.memory_stats(torch.device("cuda", 0)) == stats == torch.cuda.memory_stats(0)
        with pytest.raises(ValueError, match="Expected a cuda device, but got"):
            torch.cuda.memory_stats("cpu")
        for bad in (1, -2):
            with pytest.raises(RuntimeError, match=f"Invalid device argument {bad}: did you call init"):
                torch.cuda.memory_stats(bad)


def test_memory_stats_keys_are_the_ones_torch_documents():
    """Expanded from the installed torch's own docstring (cuda/memory.py: torch 2.13 :239-311,
    torch 2.11 :235-297): ``"stat.{a,b}.{c,d}"``."""
    doc = torch.cuda.memory.memory_stats.__doc__
    keys = set()
    for pattern in re.findall(r'``"([a-z][a-z_.{},]*)"``', doc):
        parts = [p.strip("{}").split(",") for p in pattern.split(".")]
        keys.update(".".join(c) for c in itertools.product(*parts))
    keys.discard("reserved_bytes_by_private_pools")  # a nested dict, only with private pools
    assert keys == set(MEMORY_STATS_KEYS)


def _string_constants(tree):
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_package_and_megatron_read_only_keys_torch_returns():
    """Every memory_stats key the package (offload/device.py memory_info) and Megatron's graph
    builder (transformer/cuda_graphs.py) read is one real torch returns."""
    stat_like = re.compile(r"^[a-z_]+\.(all|large_pool|small_pool)\.(current|peak|allocated|freed)$")
    read = set()
    for path in PACKAGE.rglob("*.py"):
        src = path.read_text(encoding="utf-8")
        if "memory_stats" in src:
            read |= {s for s in _string_constants(ast.parse(src)) if stat_like.match(s)}
    assert {"allocated_bytes.all.current", "reserved_bytes.all.current",
            "allocated_bytes.all.peak"} <= read
    assert read <= MEMORY_STATS_KEYS, read - MEMORY_STATS_KEYS
    import megatron.core.transformer.cuda_graphs as cg

    megatron_read = {s for s in _string_constants(ast.parse(inspect.getsource(cg)))
                     if stat_like.match(s)}
    assert megatron_read and megatron_read <= MEMORY_STATS_KEYS


# --------------------------------------------------------------------------------- streams
def test_stream_construction_rules():
    with cuda_as_cpu():
        for ok in ({}, {"device": 0}, {"device": torch.device("cuda")}, {"device": "cuda:0"},
                   {"device": -1}, {"priority": -1}, {"device": torch.device("cuda", 0), "priority": -1}):
            s = torch.cuda.Stream(**ok)
            assert s.device == torch.device("cuda", 0) and s.query() is True
        with pytest.raises(ValueError, match="Expected a cuda device, but got: cpu"):
            torch.cuda.Stream(device="cpu")
        with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
            torch.cuda.Stream(device=1)
        with pytest.raises(TypeError):
            torch.cuda.Stream(priority=0.5)
        with pytest.raises(TypeError, match="invalid keyword argument"):
            torch.cuda.Stream(high_priority=True)


def test_stream_methods_take_events_and_streams():
    with cuda_as_cpu():
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        ev = a.record_event()
        assert isinstance(ev, torch.cuda.Event) and ev.recorded_at is not None
        given = torch.cuda.Event()
        assert a.record_event(given) is given and given.recorded_at is not None
        a.wait_event(ev)
        a.wait_stream(b)
        a.wait_stream(torch.cuda.current_stream())
        with pytest.raises(AttributeError):
            a.wait_event(b)  # a stream is not an event
        with pytest.raises(AttributeError):
            a.wait_stream(ev)  # an event is not a stream
        with pytest.raises(AttributeError):
            a.wait_event(torch.zeros(1))
        with pytest.raises(TypeError):
            a.synchronize(0)


def test_stream_methods_match_real_torchs_python_methods():
    """torch.cuda.Stream's wait_event / wait_stream / record_event are Python
    (cuda/streams.py:48-91): called on a stand-in stream they fail and succeed as the stand-in's."""
    with cuda_as_cpu():
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        ev = torch.cuda.Event()
        assert REAL_STREAM.record_event(a, ev) is ev
        REAL_STREAM.wait_event(a, ev)
        for method, arg in (("wait_event", b), ("wait_stream", ev), ("wait_event", 3)):
            with pytest.raises(AttributeError) as real:
                getattr(REAL_STREAM, method)(a, arg)
            with pytest.raises(AttributeError) as standin:
                getattr(a, method)(arg)
            assert str(real.value) == str(standin.value)


def test_current_stream_and_stream_context():
    with cuda_as_cpu():
        default = torch.cuda.current_stream()
        assert default is torch.cuda.default_stream() is torch.cuda.current_stream(0)
        assert torch.cuda.current_stream(torch.device("cuda")) is default
        assert torch.cuda.current_stream(-1) is default  # -1: the current device (c10)
        with pytest.raises(ValueError, match="Expected a cuda device, but got: cpu"):
            torch.cuda.current_stream("cpu")
        for bad in (1, -2):
            with pytest.raises(RuntimeError,
                               match=rf"Device index value {bad} is out of index range \[0, 1\)"):
                torch.cuda.current_stream(bad)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            assert torch.cuda.current_stream() is s
            with torch.cuda.stream(None):  # a no-op
                assert torch.cuda.current_stream() is s
        assert torch.cuda.current_stream() is default
        with s:  # torch.Stream's own context manager
            assert torch.cuda.current_stream() is s
            with torch.cuda.stream(default), s:
                assert torch.cuda.current_stream() is s
            assert torch.cuda.current_stream() is s
        assert torch.cuda.current_stream() is default
        with pytest.raises(AttributeError):
            with torch.cuda.stream(torch.cuda.Event()):
                pass
        assert torch.cuda.current_stream() is default
        torch.cuda.set_stream(s)
        assert torch.cuda.current_stream() is s
        torch.cuda.set_stream(None)
        assert torch.cuda.current_stream() is s
    assert cac._CURRENT.stream is cac._STREAM  # the block restores the default stream


# ------------------------------------------------------------------------------------ nvtx
def test_nvtx_push_pop_depths_and_types():
    r = NvtxRanges()
    assert r.range_push("a") == 0 and r.range_push("b") == 1
    assert r.range_pop() == 1 and r.range_pop() == 0
    r.assert_balanced()
    with pytest.raises(TypeError, match="rangePushA"):
        r.range_push(3)
    with pytest.raises(TypeError):
        r.range_pop("a")
    assert r.range_pop() < 0 and r.underflows == 1
    with pytest.raises(AssertionError, match="1 pop"):
        r.assert_balanced()
    if torch.version.cuda is None:
        # a CPU build has no torch._C._nvtx: cuda/nvtx.py:7-21 (_NVTXStub._fail, torch 2.11 and
        # 2.13 alike) raises from both
        with pytest.raises(RuntimeError, match="NVTX functions not installed"):
            REAL_NVTX["range_push"]("a")
        with pytest.raises(RuntimeError, match="NVTX functions not installed"):
            REAL_NVTX["range_pop"]()
    else:
        # a CUDA build, GPU or not: the real rangePushA refuses a non-str as the stand-in does,
        # and with no NVTX tool injected (NVTX_INJECTION64_PATH) push and pop return -2
        # (NVTX_NO_PUSH_POP_TRACKING), the depth the stand-in reports as a tool would
        with pytest.raises(TypeError, match="rangePushA"):
            REAL_NVTX["range_push"](3)
        if not os.environ.get("NVTX_INJECTION64_PATH"):
            assert REAL_NVTX["range_push"]("a") == -2 and REAL_NVTX["range_pop"]() == -2


def test_gpu_standins_fail_on_unbalanced_nvtx_ranges():
    with gpu_standins():
        assert torch.cuda.nvtx.range_push("step") == 0
        assert torch.cuda.nvtx.range_pop() == 0
    with pytest.raises(AssertionError, match="unbalanced torch.cuda.nvtx ranges: 1 pushed"):
        with gpu_standins():
            torch.cuda.nvtx.range_push("never popped")


# ------------------------------------------------------------- the package's own calls
def test_cuda_offload_device_calls_keep_the_contracts():
    """offload/device.py's CudaOffloadDevice, the package's stream / event / nvtx user, under
    the stand-ins: its calls are valid ones (a violation raises the real error here)."""
    from megatron_fastpath.offload.device import CudaOffloadDevice

    with gpu_standins():
        dev = CudaOffloadDevice()
        assert dev.device == torch.device("cuda", 0)
        compute, off, rel = dev.compute_stream(), dev.offload_stream(), dev.reload_stream()
        assert compute is torch.cuda.current_stream() and off is not rel
        ev = dev.new_event()
        dev.record_event(ev, off)
        dev.wait_event(compute, ev)
        src, dst = torch.arange(4.0), torch.empty(4)
        dev.copy(dst, src, off, tag="t", direction="d2h")
        assert torch.equal(dst, src) and torch.cuda.current_stream() is compute
        dev.mark("compute_begin", "layer0", phase="fwd")
        dev.mark("compute_end", "layer0")
        start, end = dev.timestamp(off, ("a",)), dev.timestamp(off, ("b",))
        assert dev.elapsed_s(start, end) >= 0


# ------------------------------------------------------------- graph-safe CUDA generators
@pytest.mark.parametrize("session", ["gpu_standins", "fake_cuda_graphs"])
def test_graph_safe_generators_share_states_as_torch_does(session):
    """The fake CUDA generators share states as torch 2.13's ``CUDAGeneratorImpl`` does
    (``graphsafe_get_state``: a new generator on the same state; ``graphsafe_set_state``: point
    at another's state, no copy), through Megatron's own graph-safe tracker: inside ``fork`` the
    default generator is the named state (what advances it advances the named state), after it
    the default generator is back on its own state, unchanged. (Before, ``graphsafe_get_state``
    returned the generator itself and ``graphsafe_set_state`` copied: after the first fork the
    tracker's named state *was* the default generator.)"""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    with (gpu_standins() if session == "gpu_standins" else fake_cuda_graphs()):
        default = torch.cuda.default_generators[0]
        default.manual_seed(11)
        before = default.get_state()
        tracker = CudaRNGStatesTracker(use_cudagraphable_rng=True)
        tracker.add("model-parallel-rng", 123)
        named = tracker.get_states()["model-parallel-rng"]
        assert named is not default and named.initial_seed() == 123
        assert torch.equal(default.get_state(), before)  # add() clones; the default is untouched
        for step in range(2):
            with tracker.fork("model-parallel-rng"):
                assert default.initial_seed() == 123 + step  # the generator is on the named state
                default.manual_seed(124 + step)  # an advance of the named state
            assert torch.equal(default.get_state(), before), step  # back on its own state
            state = tracker.get_states()["model-parallel-rng"]
            assert state is not default and state.initial_seed() == 124 + step
        handle = default.graphsafe_get_state()  # a handle on the default's state, not a copy
        handle.manual_seed(5)
        assert default.initial_seed() == 5
        clone = default.clone_state()  # a copy
        clone.manual_seed(6)
        assert default.initial_seed() == 5
        with pytest.raises(RuntimeError, match="Expected a CUDA Generator"):
            default.graphsafe_set_state(torch.Generator())
