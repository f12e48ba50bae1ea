"""Test-only: run Megatron's CUDA-bound code (DDP, optimizer, clip_grads, schedules,
dist_checkpointing) on a CPU by keeping every ``device='cuda'`` on the CPU.

Never imported by the package (``tests/support/test_cuda_as_cpu.py`` asserts so). Use::

    with cuda_as_cpu():
        opt = get_megatron_optimizer(...); opt.step()

What it does while active:

* a ``TorchFunctionMode`` rewrites a ``device=`` argument naming CUDA (``'cuda'``, ``'cuda:0'``,
  ``torch.device('cuda')`` or a bare index) to ``cpu``, ``pin_memory=True`` to pageable memory
  (``Tensor.pin_memory()`` returns the tensor), keeps ``Tensor.cuda()`` and
  ``Tensor.to('cuda')`` on the CPU, and answers ``Tensor.type()`` with the CUDA type name
  (``torch.cuda.FloatTensor``) so Megatron's type asserts hold;
* ``torch.cuda.current_device`` / ``synchronize`` / ``current_stream`` / ``is_available`` and a
  few other ``torch.cuda`` entry points are patched for the block's duration, one stand-in GPU
  (index 0); ``Stream`` / ``current_stream`` / ``default_stream`` / ``stream`` / ``set_stream`` /
  ``synchronize`` / ``current_device`` / ``set_device`` take and check their arguments as
  torch 2.13's and 2.11's own code does (a cpu device, an index past the device count, a
  non-stream raise the real error; the torch source line is cited on each stand-in), and
  ``torch.cuda.stream(s)`` selects ``s`` as ``current_stream()`` for the block, as on a GPU;
  ``torch.backends.cuda.is_built()`` answers False on any build, as on the CPU build this
  emulation is written against (the stand-in GPU's tensors are CPU tensors);
* a TorchFunctionMode is not active inside an ``autograd.Function.backward`` (Megatron's
  sequence-parallel linear allocates its reduce-scatter output there on
  ``torch.cuda.current_device()``), so ``torch.empty`` / ``torch.zeros`` are also wrapped to
  rewrite their ``device`` for the block's duration;
* the "CUDA" generator is the CPU one (the mode's CUDA tensors are CPU tensors and draw from
  it): ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` and Megatron's
  ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` (not their
  ``graph_safe`` variants) read and set the CPU generator, so Megatron's
  ``CudaRNGStatesTracker`` (``model_parallel_cuda_manual_seed``, ``fork()``) works and a
  dropout inside ``fork()`` draws from the forked state.

Megatron-Core sites this covers (file:line in 0.16.1|0.19.2, the installed release's line
checked by ``test_cuda_as_cpu.py::test_covered_sites_still_exist``, so an upgrade shows what
moved):
"""

from __future__ import annotations

import collections
import contextlib
import operator
import threading
import time
from typing import Iterator
from unittest import mock

import torch
from torch.cuda._utils import _get_device_index as _real_get_device_index
from torch.overrides import TorchFunctionMode

# (file relative to megatron/core, (line in 0.16.1, line in 0.19.2), text expected on that line)
MEGATRON_SITES = (
    ("optimizer/optimizer.py", (907, 1249), "device='cuda'"),  # FP32Optimizer._scale
    ("optimizer/optimizer.py", (473, 690), "device='cuda'"),  # found_inf
    ("optimizer/clip_grads.py", (90, 96), "device='cuda'"),  # inf norm
    ("optimizer/clip_grads.py", (103, 112), "device='cuda'"),  # L2 norm's overflow buffer
    ("optimizer/clip_grads.py", (115, 108), "device='cuda'"),  # the norm without grads
    ("optimizer/clip_grads.py", (167, 174), "torch.cuda.FloatTensor"),
    ("optimizer/clip_grads.py", (174, 180), "device='cuda'"),  # clip's overflow buffer
    ("optimizer/clip_grads.py", (207, 231), "device='cuda'"),  # zero count
    ("dist_checkpointing/strategies/filesystem_async.py", (230, 248), "torch.cuda.synchronize()"),
    ("dist_checkpointing/strategies/state_dict_saver.py", (252, 252), "torch.cuda.current_device()"),
    # the main job's GPU step path (tests/train/test_gpu_step_path.py, test_pipeline_parallel.py)
    ("pipeline_parallel/schedules.py", (596, 749), 'device="cuda"'),  # no pipelining: token count
    ("pipeline_parallel/schedules.py", (2138, 2292), 'device="cuda"'),  # 1F1B: token count
    ("pipeline_parallel/p2p_communication.py", (313, 334), "device=torch.cuda.current_device()"),  # recv
    ("pipeline_parallel/p2p_communication.py", (398, 419), "torch.cuda.synchronize()"),  # batched p2p
    # sequence parallelism (tests/lora/test_lora_sequence_parallel.py)
    ("tensor_parallel/mappings.py", (141, 145), "device=torch.cuda.current_device()"),  # all-gather
    ("tensor_parallel/layers.py", (552, 647), "device=torch.cuda.current_device()"),  # bwd: in backward
    ("tensor_parallel/random.py", (422, 490), "torch.cuda.manual_seed(data_parallel_seed)"),
    ("tensor_parallel/random.py", (235, 303), "torch.cuda.get_rng_state()"),  # tracker.add
    ("tensor_parallel/random.py", (250, 318), "_get_cuda_rng_state("),  # tracker.fork
    ("tensor_parallel/random.py", (255, 323), "_set_cuda_rng_state("),
)


def sites_doc(sites) -> str:
    """The docstring lines naming each site at both releases' lines ("-": not in that release)."""
    return "\n".join(
        f"    megatron/core/{f}:{n16}|{n19 if n19 is not None else '-'}  {t}"
        for f, (n16, n19), t in sites) + "\n"


__doc__ += sites_doc(MEGATRON_SITES)

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


def _keep_on_cpu(value):
    return torch.device("cpu") if _is_cuda(value) else value


class CudaAsCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _keep_on_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):  # pinned host staging (the packed cache, offload pools)
            kwargs["pin_memory"] = False  # needs a CUDA allocator; plain host memory here
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            t = args[0]
            if t.device.type == "cpu" and t.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[t.dtype]
        if func is torch.Tensor.to:
            args = tuple(_keep_on_cpu(a) for a in args)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Devices, streams and the torch.cuda entry points: each stand-in asserts what torch 2.13's own
# implementation asserts or raises for the arguments it takes (file:line below are torch 2.13's,
# .venv/lib/python3.11/site-packages/torch/...; C++ functions named where the check is there).
# Torch 2.11 runs the same code (read line by line), at: cuda/streams.py and cuda/nvtx.py the
# same lines; cuda/_utils.py 40 lines up (2.13 :557-586 is 2.11 :517-546); _utils.py 22 up
# (:869-913 is :847-891); cuda/__init__.py 51 up from :650 to :858 (device, set_device,
# get_device_*, StreamContext, set_stream: :650-655 is :599-604) and 57 up from :1203 to :1268
# (current_device, synchronize, current_stream, default_stream: :1235-1250 is :1178-1193).
# The stand-in GPU is one device (index 0): torch.cuda.device_count() as patched (1).
# ---------------------------------------------------------------------------------------------
_NO_INDEX = "Expected a torch.device with a specified index or an integer"
CURRENT_DEVICE = 0


def device_index(device, optional: bool = False) -> int:
    """``torch.cuda._utils._get_device_index`` (cuda/_utils.py:557-586 -> _utils.py:869-913), the
    real function, with the current device answered by the stand-in: an int is returned as it
    is (negative too); a str becomes a ``torch.device``; a device that is not ``cuda`` raises
    ``ValueError("Expected a cuda device, but got: cpu")`` (cuda/_utils.py:581-582); ``None``
    or ``torch.device('cuda')`` (no index) is the current device when ``optional``, else
    ``ValueError("Expected a torch.device with a specified index or an integer, but got:...")``
    (_utils.py:898-912); with ``optional`` any other object is the current device too
    (_utils.py:898-908)."""
    try:
        return _real_get_device_index(device, optional=False)
    except ValueError as e:
        if optional and str(e).startswith(_NO_INDEX):
            return _current_device()
        raise


def _device_count() -> int:
    return torch.cuda.device_count()


def _exchange_device(idx: int) -> None:
    """``torch.cuda.device(idx).__enter__`` -> ``torch._C._cuda_exchangeDevice`` (cuda/__init__.py
    :654-655): a negative index is a no-op; else c10::cuda::ExchangeDevice -> cudaSetDevice,
    which fails on an index past the device count ('CUDA error: invalid device ordinal',
    raised as torch.AcceleratorError, a RuntimeError)."""
    if idx >= _device_count():
        raise torch.AcceleratorError("CUDA error: invalid device ordinal")


def _current_device() -> int:
    """``torch.cuda.current_device()`` (cuda/__init__.py:1203-1206): no argument; the index of
    the selected device (the stand-in GPU's only one, 0)."""
    return CURRENT_DEVICE


def _set_device(device) -> None:
    """``torch.cuda.set_device(device)`` (cuda/__init__.py:677-689): ``_get_device_index(device)``
    WITHOUT ``optional`` -- ``None`` and ``torch.device('cuda')`` (no index) raise ValueError, a
    cpu device raises ValueError; a negative index is a no-op; else
    ``torch._C._cuda_setDevice`` -> c10::cuda::set_device -> cudaSetDevice: an index past the
    device count raises 'CUDA error: invalid device ordinal'. The stand-in GPU stays device 0."""
    idx = device_index(device)
    if idx >= 0:
        _exchange_device(idx)


def _synchronize(device=None) -> None:
    """``torch.cuda.synchronize(device=None)`` (cuda/__init__.py:1209-1219): ``with
    torch.cuda.device(device)`` -- ``_get_device_index(device, optional=True)`` (:651: a cpu
    device raises ValueError), exchange to it (:655: past the device count raises) -- then
    ``_cuda_synchronize``. Counted in :data:`CALLS` (a device-wide wait no sync sentinel
    reports)."""
    _exchange_device(device_index(device, optional=True))
    CALLS["torch.cuda.synchronize"] += 1


def _is_current_stream_capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing()`` (cuda/graphs.py: torch 2.13 :57-62, torch
    2.11 :45-50): no argument; False, no capture being under way on the stand-in GPU
    (``fake_cuda_graph.fake_cuda_graphs`` replaces it with one that answers True during its
    capture). Every ``torch.optim`` ``step()`` asks it on torch 2.11:
    ``Optimizer._accelerator_graph_capture_health_check`` (optim/optimizer.py:451-474) calls it
    once ``torch.cuda.is_available()`` answers True, as it does here (the real one raises
    without a GPU). Torch 2.13's check (optimizer.py:448-466) asks ``torch.accelerator``
    instead: no accelerator on a CPU build (``current_accelerator`` is the compile-time one,
    accelerator/__init__.py:102-131), so no check; on a CUDA build it is ``cuda``, available as
    ``torch.cuda.is_available()`` answers, and the check asks
    ``torch.accelerator.current_stream().is_capturing()`` (:func:`_accelerator_current_stream`,
    :meth:`_FakeStream.is_capturing`)."""
    return False


def _check_gpu(idx: int) -> int:
    """c10/cuda/CUDAStream.cpp ``getCurrentCUDAStream`` / ``getDefaultCUDAStream``: -1 is the
    current device; else ``check_gpu``: TORCH_CHECK(0 <= index < num_gpus, "Device index value
    {i} is out of index range [0, {n})") -> RuntimeError."""
    if idx == -1:
        return _current_device()
    n = _device_count()
    if not 0 <= idx < n:
        raise RuntimeError(f"Device index value {idx} is out of index range [0, {n})")
    return idx


_STREAM_KWARGS = ("stream_id", "device_index", "device_type", "stream_ptr")


class _FakeStream:
    """Stand-in for ``torch.cuda.Stream``: work on the CPU is already ordered, so no method
    waits; each takes and checks what the real one does (torch 2.13 cuda/streams.py):

    * ``Stream(device=None, priority=0, **kwargs)`` (streams.py:37-46): ``device`` other than
      None goes through ``with torch.cuda.device(device)`` (a cpu device raises ValueError,
      an index past the device count raises 'invalid device ordinal'; negative / None: the
      current device); ``priority`` and the keywords are parsed by THCPStream_pynew
      (torch/csrc/cuda/Stream.cpp, PyArg_ParseTupleAndKeywords "|iLLLK" over priority,
      stream_id, device_index, device_type, stream_ptr): a non-int priority raises TypeError,
      any other keyword raises TypeError;
    * ``wait_event(event)`` is ``event.wait(self)`` (streams.py:63): an object without ``wait``
      (a Stream, a tensor) raises AttributeError;
    * ``wait_stream(stream)`` is ``self.wait_event(stream.record_event())`` (streams.py:77): an
      Event or anything without ``record_event`` raises AttributeError;
    * ``record_event(event=None)`` (streams.py:89-92): a new Event when None, ``event.record(self)``,
      returns the event;
    * ``query()`` / ``synchronize()`` take no argument (streams.py:94, 102); ``device`` /
      ``device_index`` / ``device_type`` / ``stream_id`` as the base class exposes them;
      a context manager (torch.Stream.__enter__ selects it: :func:`_stream_context`)."""

    _next_id = 0

    def __init__(self, device=None, priority=0, **kwargs):
        bad = [k for k in kwargs if k not in _STREAM_KWARGS]
        if bad:
            raise TypeError(f"{bad[0]!r} is an invalid keyword argument for this function")
        priority = operator.index(priority)  # PyArg "i": TypeError for a float, a str, None
        idx = device_index(device, optional=True) if device is not None else -1
        _exchange_device(idx)
        if "device_index" in kwargs:
            idx = int(kwargs["device_index"])
        self.device_index = idx if idx >= 0 else _current_device()
        self.device = torch.device("cuda", self.device_index)
        self.device_type = 1  # c10::DeviceType::CUDA
        self.priority = priority
        _FakeStream._next_id += 1
        self.stream_id = kwargs.get("stream_id", _FakeStream._next_id)

    def wait_stream(self, stream):
        self.wait_event(stream.record_event())

    def wait_event(self, event):
        event.wait(self)

    def record_event(self, event=None):
        if event is None:
            event = _FakeEvent()
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self):
        return True

    def is_capturing(self):
        """``torch.Stream.is_capturing()`` (torch 2.13; c10 ``cudaStreamIsCapturing`` of this
        stream): no argument; a capture runs on the current stream
        (:func:`_is_current_stream_capturing`, the fake graph's during its capture), so only the
        current stream can be capturing."""
        return self is _CURRENT.stream and torch.cuda.is_current_stream_capturing()

    def __enter__(self):
        ctx = _stream_context(self)
        ctx.__enter__()
        self.__dict__.setdefault("_contexts", []).append(ctx)  # nested ``with s:`` blocks
        return self

    def __exit__(self, *exc):
        self._contexts.pop().__exit__(*exc)
        return False

    def __repr__(self):
        return f"<stand-in torch.cuda.Stream device={self.device} stream_id={self.stream_id}>"


class _FakeEvent:
    """Stand-in for ``torch.cuda.Event``. ``elapsed_time`` keeps the real contract (torch
    ``cuda/streams.py`` -> ``cudaEventElapsedTime``): both events created with
    ``enable_timing=True`` and both recorded, else it raises as CUDA does; the time is the
    host's between the two ``record`` calls (on the CPU the work ran in between). ``record`` /
    ``wait`` take a stream or None (the current stream, streams.py:206-207, 220-221)."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        self.enable_timing = enable_timing
        self.recorded_at = None

    def record(self, stream=None):
        self.recorded_at = time.perf_counter()

    def elapsed_time(self, end_event) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.recorded_at is None or end_event.recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event.recorded_at - self.recorded_at) * 1e3

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


_STREAM = _FakeStream.__new__(_FakeStream)  # the default stream of the stand-in GPU
_STREAM.device_index, _STREAM.device, _STREAM.device_type = 0, torch.device("cuda", 0), 1
_STREAM.priority, _STREAM.stream_id = 0, 0


class _CurrentStream(threading.local):
    stream = _STREAM


_CURRENT = _CurrentStream()


def _current_stream(device=None):
    """``torch.cuda.current_stream(device=None)`` (cuda/__init__.py:1235-1250):
    ``_get_device_index(device, optional=True)`` (a cpu device raises ValueError), then
    ``_cuda_getCurrentStream`` -> c10 ``getCurrentCUDAStream``: -1 is the current device, an
    index outside [0, device_count) raises "Device index value ... is out of index range". The
    stream selected by ``torch.cuda.stream`` / ``set_stream`` on this thread, else the default
    stream."""
    _check_gpu(device_index(device, optional=True))
    return _CURRENT.stream


def _default_stream(device=None):
    """``torch.cuda.default_stream(device=None)`` (cuda/__init__.py:1253-1268): as
    ``current_stream``'s device rules; the one default stream."""
    _check_gpu(device_index(device, optional=True))
    return _STREAM


def _set_stream(stream) -> None:
    """``torch.cuda.set_stream(stream)`` (cuda/__init__.py:842-858): None is a no-op (:851);
    else it reads ``stream.stream_id`` / ``device_index`` / ``device_type`` (:854-857:
    AttributeError for anything that is not a stream) and selects it."""
    if stream is None:
        return
    stream.stream_id, stream.device_index, stream.device_type  # noqa: B018 (what set_stream reads)
    _CURRENT.stream = stream


class _stream_context:
    """``torch.cuda.stream(stream)`` -> ``StreamContext`` (cuda/__init__.py:756-824): None is a
    no-op context (:789-790); else on entry the current stream is kept and ``set_stream(stream)``
    selects it (:791-798: a stream of another device is selected on that device inside
    ``torch.cuda.device(stream.device)`` -- with one stand-in device no such stream can be
    made, Stream(device=1) raises), restored on exit (:800-811). A non-stream raises
    AttributeError at entry, as ``set_stream`` reads its ``stream_id``."""

    def __init__(self, stream):
        self.stream = stream
        self.prev = None

    def __enter__(self):
        if self.stream is None:
            return None
        self.prev = _current_stream(None)
        if self.prev.device != self.stream.device:
            _exchange_device(device_index(self.stream.device, optional=True))
        _set_stream(self.stream)
        return None

    def __exit__(self, *exc):
        if self.stream is not None:
            _set_stream(self.prev)
        return False


# torch.accelerator (torch 2.13 accelerator/__init__.py, accelerator/_utils.py): on a CPU build
# ``current_accelerator()`` is None and nothing below is reached; on a CUDA build (torch 2.13's
# cu130 wheel, GPU or not) it is ``cuda`` and these go to torch._C, which initialises CUDA and
# raises without a driver. Torch 2.11's optimizer does not call them (see
# :func:`_is_current_stream_capturing`).
def _accelerator_device_index(device) -> int:
    """``torch.accelerator._utils._get_device_index(device, optional=True)`` (_utils.py:5-26): an
    int is returned as it is; a str becomes a ``torch.device``; a device of another type than
    the accelerator's raises ``ValueError("{type} doesn't match the current accelerator
    cuda.")`` (:15-18); no index: the current device index (:20-25)."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"{device.type} doesn't match the current accelerator cuda.")
        if device.index is not None:
            return device.index
    return _current_device()


def _accelerator_current_stream(device=None, /):
    """``torch.accelerator.current_stream(device=None)`` (accelerator/__init__.py:220-232):
    :func:`_accelerator_device_index`, then ``_accelerator_getStream`` -> c10
    ``getCurrentCUDAStream`` (the index checked as :func:`_check_gpu` does); the stream
    ``torch.cuda.current_stream()`` answers."""
    _check_gpu(_accelerator_device_index(device))
    return _CURRENT.stream


def _accelerator_synchronize(device=None, /) -> None:
    """``torch.accelerator.synchronize(device=None)`` (accelerator/__init__.py:246-270):
    :func:`_accelerator_device_index`, then a device-wide wait, as ``torch.cuda.synchronize``
    (:func:`_synchronize`, counted there)."""
    _synchronize(_accelerator_device_index(device))


def _device_properties_index(device) -> int:
    """``torch.cuda.get_device_properties(device)`` (cuda/__init__.py:725-741), which
    ``get_device_capability`` (:707-722) and ``get_device_name`` (:692-705) call:
    ``_get_device_index(device, optional=True)`` (a cpu device raises ValueError), then
    ``AssertionError("Invalid device id")`` for an index < 0 or >= device_count() -- whatever
    their docstrings say of negative indices being a no-op."""
    idx = device_index(device, optional=True)
    if idx < 0 or idx >= _device_count():
        raise AssertionError("Invalid device id")
    return idx


def device_capability_standin(capability=(9, 0)):
    """A ``torch.cuda.get_device_capability(device=None)`` answering ``capability`` (a
    ``(major, minor)`` tuple of ints, as ``prop.major, prop.minor``) after checking ``device`` as
    :func:`_device_properties_index` does."""
    major, minor = capability
    assert isinstance(major, int) and isinstance(minor, int), capability

    def get_device_capability(device=None):
        _device_properties_index(device)
        return (major, minor)

    return get_device_capability


def device_name_standin(name="stand-in GPU"):
    """A ``torch.cuda.get_device_name(device=None)`` answering ``name`` (a str, as
    ``get_device_properties(device).name``) after checking ``device`` as
    :func:`_device_properties_index` does."""

    def get_device_name(device=None):
        _device_properties_index(device)
        return name

    return get_device_name


# Explicit device-wide waits the code under test asked for (a host sync on a GPU that neither
# SyncSentinel nor CUDA's sync debug mode reports): counted here while the mode is active.
CALLS: collections.Counter = collections.Counter()


def _on_cpu(factory):
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _keep_on_cpu(kwargs["device"])
        return factory(*args, **kwargs)

    return wrapped


def _cpu_unless_graph_safe(megatron_fn, cpu_fn):
    """Megatron's tracker state accessor on the CPU generator; its graph-safe variant (the
    graph-safe tracker's generator objects, see fake_cuda_graph.py) is left as it is."""

    def wrapped(*args, graph_safe=False, **kwargs):
        if graph_safe:
            return megatron_fn(*args, graph_safe=True, **kwargs)
        state = [a for a in args if torch.is_tensor(a)]  # _set_cuda_rng_state(new_state, ...)
        return cpu_fn(*state)

    return wrapped


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """Activate the mode and the ``torch.cuda`` patches for the block's duration."""
    from megatron.core.tensor_parallel import random as random_mod

    patches = [
        mock.patch("torch.cuda.is_available", lambda: True),
        # the stand-in GPU's tensors are CPU tensors, as on the CPU build the emulation is
        # written against (torch._C._has_cuda False): on a CUDA build (torch 2.11's wheel, GPU
        # or not) code telling a CUDA machine's host tensors from its device ones -- the sync
        # sentinel's _cuda_machine -- must see them as one, as it does on a CPU build
        mock.patch("torch.backends.cuda.is_built", lambda: False),
        mock.patch("torch.cuda.current_device", _current_device),
        mock.patch("torch.cuda.device_count", lambda: 1),
        mock.patch("torch.cuda.synchronize", _synchronize),
        mock.patch("torch.cuda.current_stream", _current_stream),
        mock.patch("torch.cuda.default_stream", _default_stream),
        mock.patch("torch.cuda.set_stream", _set_stream),
        mock.patch("torch.cuda.set_device", _set_device),
        mock.patch("torch.cuda.empty_cache", lambda: None),
        mock.patch("torch.cuda.is_current_stream_capturing", _is_current_stream_capturing),
        # torch.accelerator on a CUDA build (see _accelerator_device_index): the stand-in GPU's
        mock.patch("torch.accelerator.current_device_index", _current_device),
        mock.patch("torch.accelerator.current_stream", _accelerator_current_stream),
        mock.patch("torch.accelerator.synchronize", _accelerator_synchronize),
        mock.patch("torch.cuda.Stream", _FakeStream),
        mock.patch("torch.cuda.Event", _FakeEvent),
        mock.patch("torch.cuda.stream", _stream_context),
        mock.patch("torch.empty", _on_cpu(torch.empty)),
        mock.patch("torch.zeros", _on_cpu(torch.zeros)),
        mock.patch("torch.cuda.get_rng_state", lambda device="cuda": torch.get_rng_state()),
        mock.patch("torch.cuda.set_rng_state", lambda state, device="cuda": torch.set_rng_state(state)),
        mock.patch("torch.cuda.manual_seed", torch.manual_seed),
        mock.patch("megatron.core.tensor_parallel.random._get_cuda_rng_state",
                   _cpu_unless_graph_safe(random_mod._get_cuda_rng_state, torch.get_rng_state)),
        mock.patch("megatron.core.tensor_parallel.random._set_cuda_rng_state",
                   _cpu_unless_graph_safe(random_mod._set_cuda_rng_state, torch.set_rng_state)),
    ]
    prev_stream = _CURRENT.stream
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, _CURRENT, "stream", prev_stream)
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(CudaAsCpuMode())
        yield


def moved_megatron_sites(sites) -> list:
    """The ``(file under megatron/core, (line in 0.16.1, line in 0.19.2), text)`` sites that do
    not hold in the installed megatron-core: its line (by ``compat.mcore_line()``) no longer
    contains the text, or -- where that release's line is ``None``, the call being absent from
    it -- the text is in the file after all. Empty when every site holds."""
    import os

    import megatron.core

    from megatron_fastpath import compat

    release = compat.CHECKED_MCORE_LINES.index(compat.mcore_line())
    root = os.path.dirname(megatron.core.__file__)
    moved = []
    for rel, line_nos, text in sites:
        line_no = line_nos[release]
        lines = open(os.path.join(root, rel), encoding="utf-8").read().splitlines()
        if line_no is None:
            if any(text in line for line in lines):
                moved.append(f"megatron/core/{rel} contains {text!r}, listed as absent")
        elif line_no > len(lines) or text not in lines[line_no - 1]:
            moved.append(f"megatron/core/{rel}:{line_no} no longer contains {text!r}")
    return moved


class PageableCopies(TorchFunctionMode):
    """Stand-in for CUDA's contract on host->device copies, entered inside :func:`cuda_as_cpu`:
    a copy to CUDA from pageable host memory is synchronous -- "for transfers from pageable
    host memory to device memory, a stream sync is performed before the copy is initiated"
    (CUDA Runtime API, *API synchronization behavior*) -- so every ``Tensor.to(cuda)`` /
    ``.cuda()`` whose source was not allocated pinned (``pin_memory=True`` or
    ``Tensor.pin_memory()``) is recorded as ``(location, bytes)`` in ``syncs``; ``pinned``
    counts the copies from pinned memory. Entered inside ``cuda_as_cpu`` it sees the calls
    before the CUDA-as-CPU mode rewrites them."""

    def __init__(self):
        super().__init__()
        self.pinned_ptrs: set = set()
        self.syncs: list = []
        self.pinned = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if kwargs.get("pin_memory") and isinstance(out, torch.Tensor):
            self.pinned_ptrs.add(out.data_ptr())
        elif func is torch.Tensor.pin_memory:
            self.pinned_ptrs.add(out.data_ptr())
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and isinstance(args[0], torch.Tensor):
            to_cuda = func is torch.Tensor.cuda or any(
                _is_cuda(a) for a in list(args[1:]) + [kwargs.get("device")] if not isinstance(a, torch.dtype))
            if to_cuda and args[0].device.type == "cpu":
                src = args[0]
                base = src._base if src._base is not None else src
                if base.data_ptr() in self.pinned_ptrs:
                    self.pinned += 1
                else:
                    import traceback

                    frame = traceback.extract_stack(limit=2)[0]  # the caller
                    self.syncs.append((f"{frame.filename}:{frame.lineno}", src.numel() * src.element_size()))
        return out
