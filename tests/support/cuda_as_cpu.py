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
  few other ``torch.cuda`` entry points are patched for the block's duration;
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

Megatron-Core 0.16.1 sites this covers (file:line, checked against the installed package by
``test_cuda_as_cpu.py::test_covered_sites_still_exist``, so an upgrade shows what moved):
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Iterator
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

# (file relative to megatron/core, line, text expected on that line)
MEGATRON_SITES = (
    ("optimizer/optimizer.py", 907, "device='cuda'"),
    ("optimizer/optimizer.py", 473, "device='cuda'"),
    ("optimizer/clip_grads.py", 90, "device='cuda'"),
    ("optimizer/clip_grads.py", 103, "device='cuda'"),
    ("optimizer/clip_grads.py", 115, "device='cuda'"),
    ("optimizer/clip_grads.py", 167, "torch.cuda.FloatTensor"),
    ("optimizer/clip_grads.py", 174, "device='cuda'"),
    ("optimizer/clip_grads.py", 207, "device='cuda'"),
    ("dist_checkpointing/strategies/filesystem_async.py", 230, "torch.cuda.synchronize()"),
    ("dist_checkpointing/strategies/state_dict_saver.py", 252, "torch.cuda.current_device()"),
    # the main job's GPU step path (tests/train/test_gpu_step_path.py, test_pipeline_parallel.py)
    ("pipeline_parallel/schedules.py", 596, 'device="cuda"'),  # no pipelining: token count
    ("pipeline_parallel/schedules.py", 2138, 'device="cuda"'),  # 1F1B: token count
    ("pipeline_parallel/p2p_communication.py", 313, "device=torch.cuda.current_device()"),  # recv
    ("pipeline_parallel/p2p_communication.py", 398, "torch.cuda.synchronize()"),  # batched p2p
    # sequence parallelism (tests/lora/test_lora_sequence_parallel.py)
    ("tensor_parallel/mappings.py", 141, "device=torch.cuda.current_device()"),  # all-gather
    ("tensor_parallel/layers.py", 552, "device=torch.cuda.current_device()"),  # bwd: in backward
    ("tensor_parallel/random.py", 422, "torch.cuda.manual_seed(data_parallel_seed)"),
    ("tensor_parallel/random.py", 235, "torch.cuda.get_rng_state()"),  # tracker.add
    ("tensor_parallel/random.py", 250, "_get_cuda_rng_state("),  # tracker.fork
    ("tensor_parallel/random.py", 255, "_set_cuda_rng_state("),
)
__doc__ += "\n".join(f"    megatron/core/{f}:{n}  {t}" for f, n, t in MEGATRON_SITES) + "\n"

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


class _FakeStream:
    """Stand-in for ``torch.cuda.Stream``: work on the CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _FakeEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeEvent:
    """Stand-in for ``torch.cuda.Event``. ``elapsed_time`` keeps the real contract (torch
    ``cuda/streams.py`` -> ``cudaEventElapsedTime``): both events created with
    ``enable_timing=True`` and both recorded, else it raises as CUDA does; the time is the
    host's between the two ``record`` calls (on the CPU the work ran in between)."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
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


_STREAM = _FakeStream()

# Explicit device-wide waits the code under test asked for (a host sync on a GPU that neither
# SyncSentinel nor CUDA's sync debug mode reports): counted here while the mode is active.
CALLS: collections.Counter = collections.Counter()


def _synchronize(*args, **kwargs):
    CALLS["torch.cuda.synchronize"] += 1


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
        mock.patch("torch.cuda.current_device", lambda: 0),
        mock.patch("torch.cuda.device_count", lambda: 1),
        mock.patch("torch.cuda.synchronize", _synchronize),
        mock.patch("torch.cuda.current_stream", lambda *a, **k: _STREAM),
        mock.patch("torch.cuda.default_stream", lambda *a, **k: _STREAM),
        mock.patch("torch.cuda.set_device", lambda *a, **k: None),
        mock.patch("torch.cuda.empty_cache", lambda: None),
        mock.patch("torch.cuda.Stream", _FakeStream),
        mock.patch("torch.cuda.Event", _FakeEvent),
        mock.patch("torch.cuda.stream", lambda s=None: contextlib.nullcontext()),
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
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(CudaAsCpuMode())
        yield


def moved_megatron_sites(sites) -> list:
    """The (file under megatron/core, line, text) sites whose line no longer contains the text
    in the installed megatron-core: what an upgrade moved (empty when every site still holds)."""
    import os

    import megatron.core

    root = os.path.dirname(megatron.core.__file__)
    moved = []
    for rel, line_no, text in sites:
        lines = open(os.path.join(root, rel), encoding="utf-8").read().splitlines()
        if line_no > len(lines) or text not in lines[line_no - 1]:
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
