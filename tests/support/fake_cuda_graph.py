"""Test-only: a CPU stand-in for CUDA graphs, so Megatron's real ``CudaGraphManager`` code
(``megatron/core/transformer/cuda_graphs.py``) captures and replays on a CPU.

Never imported by the package (``tests/support/test_cuda_as_cpu.py`` asserts so). Use::

    with fake_cuda_graphs():           # includes cuda_as_cpu()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = f(x)                   # runs once, every aten op recorded
        x.copy_(new_x); g.replay()     # y now holds f(new_x)

What a GPU graph does, and so what this does:

* **capture** records every aten op issued inside ``torch.cuda.graph(...)`` (a
  ``TorchDispatchMode``, so the ops autograd issues inside ``torch.autograd.grad`` during a
  backward capture are recorded too) with the exact tensor objects it read and wrote. It has
  to run each op to get Python values flowing, but, as on a GPU where a capture runs no kernel,
  **it leaves every tensor that existed before ``capture_begin`` as it was**: before an op
  writes a storage the capture did not create (a mutable schema argument -- ``Tensor(a!)``,
  ``out=``, ``Tensor(a!)[]`` -- or any tensor argument of a ``c10d`` collective, whose schemas
  do not mark their outputs), the storage's bytes are saved once, and ``capture_end`` writes
  them all back (whole storages, so views at any offset or stride are restored exactly).
  Parameters, ``.grad`` / ``main_grad``, optimizer states, static input buffers and counters
  therefore change only on ``replay()``: a capture followed at once by a replay (Megatron's
  ``FullCudaGraphWrapper``) applies one iteration, not two. Tensors created inside the capture
  keep what the capture computed (on a GPU they hold whatever the pool had; nothing may rely on
  it). ``FakeCUDAGraph.restore_pre_capture_state = False`` keeps the capture's writes instead;
* **replay** re-executes exactly those ops on exactly those tensors and writes each result into
  the tensor captured as its output. Python is not re-run: a buffer chosen in Python per call, a
  tensor reallocated after capture, a Python-side branch -- replay sees what capture saw (the
  captured address), as a GPU graph does;
* ``empty``-family ops are not replayed (on a GPU they are no kernel: the memory keeps what it
  had);
* a **host read** during capture (``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero``, ...:
  the package's ``SyncSentinel`` lists) raises :class:`HostReadDuringCapture`, as
  ``cudaStreamCaptureStatusInvalidated`` aborts a real capture. Reads of tensors that live on
  the host on a real GPU too (Megatron's RNG tracker compares CPU RNG states) are allowed by
  call site: ``HOST_SIDE_FILES``;
* the ops a collective's ``Work.wait()`` issues through the dispatcher are the collective's,
  not the graph's: not recorded (gloo's reduce-scatter reduces into a buffer of its own and
  copies the result into the output in ``wait()`` -- ``aten.split`` + ``aten.copy_``; NCCL's
  kernel writes the output itself). A replayed ``copy_`` from the capture's buffer wrote the
  capture's result over the output (``graph_safe_standins.FakeCUDAGraphReplayingCollectives``
  re-issues and waits for the collective, which makes those copies itself); their writes to
  pre-capture storages are still undone at ``capture_end``;
* replay writes bypass autograd's version counters (``_AutoDispatchBelowADInplaceOrView``), as
  a graph's kernels do.

What it does NOT model: a real graph's private memory pool, where a tensor freed inside one
capture may be handed to the next capture sharing the pool. Here every captured tensor stays
alive, so only reuse that Megatron does explicitly in Python (its ``TensorReusePool``) aliases
buffers between graphs; and tensors created inside a capture hold the capture's values
afterwards, not garbage. Python-side state a capture changes stays changed, as on a GPU (an
attribute set, ``.grad`` assigned when it was ``None``). Writes a capture
makes outside the aten dispatcher (e.g. a storage-level copy) are not seen, so not undone.
Random ops replay with the CPU generator (tests use dropout 0).

``torch.distributed``'s ``Work.wait`` is wrapped to mark the ops it issues (above).
``torch.cuda`` entry points it patches (besides :func:`cuda_as_cpu.cuda_as_cpu`'s):
``CUDAGraph``, ``graph``, ``graph_pool_handle``, ``is_current_stream_capturing``,
``memory_stats``, ``get_device_capability`` (both checking their device argument as torch
2.13 does, see each), ``default_generators`` (``set_stream`` is ``cuda_as_cpu``'s);
``torch.optim``'s ``_get_capturable_supported_devices`` (``cpu`` added, so a ``capturable=True``
optimizer's step can be captured on the stand-in CUDA tensors); and Megatron's
``tensor_parallel.random._lazy_init`` / ``_lazy_call`` (bound at import from ``torch.cuda``) so
its graph-safe RNG tracker runs on fake generators. Megatron's ``FullCudaGraphWrapper``
(``megatron/core/full_cuda_graph.py``) needs nothing more: its ``torch.cuda.Stream`` /
``stream`` / ``synchronize`` / ``current_stream().wait_stream`` are ``cuda_as_cpu``'s.

Megatron-Core sites this covers (file:line in 0.16.1|0.19.2, the installed release's checked by
``tests/graphs/test_fake_cuda_graph.py``):
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from dataclasses import dataclass
from typing import Iterator, Optional
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.support.cuda_as_cpu import cuda_as_cpu, device_capability_standin, sites_doc
from megatron_fastpath.compat import TORCH_RELEASE
from megatron_fastpath.sync.sentinel import DATA_DEPENDENT_OPS, HOST_READ_METHODS

# (file relative to megatron/core, (line in 0.16.1, line in 0.19.2), text expected on that line;
# None: the release makes no such call)
MEGATRON_SITES = (
    ("transformer/cuda_graphs.py", (830, 1187), "self.fwd_graph = torch.cuda.CUDAGraph()"),
    ("transformer/cuda_graphs.py", (948, 1305), "with torch.cuda.graph("),
    ("transformer/cuda_graphs.py", (1064, 1428), "with torch.cuda.graph(self.bwd_graph, pool=self.mempool)"),
    ("transformer/cuda_graphs.py", (939, 1296), "torch.cuda.default_generators[device_idx]"),
    ("transformer/cuda_graphs.py", (373, 567), "torch.cuda.memory_stats()"),
    ("transformer/cuda_graphs.py", (471, 662), "torch.cuda.set_stream(torch.cuda.default_stream())"),
    # CudaGraphManager.__init__'s expandable-segments check on pre-Blackwell GPUs (0.19 drops it)
    ("transformer/cuda_graphs.py", (1413, None), "torch.cuda.get_device_capability()[0] < 10"),
    ("transformer/cuda_graphs.py", (1431, 1838), "torch.cuda.graph_pool_handle()"),
    # 0.19's forward-graph input buffers, allocated into the graph mempool (alloc_tensor_from_graph_mempool)
    ("transformer/cuda_graphs.py", (None, 282), "torch._C._cuda_beginAllocateCurrentThreadToPool("),
    ("transformer/cuda_graphs.py", (None, 289), "torch._C._cuda_endAllocateToPool("),
    ("tensor_parallel/random.py", (12, 14), "from torch.cuda import _lazy_call, _lazy_init"),
    ("tensor_parallel/random.py", (66, 129), "torch.cuda.default_generators[idx]"),
)
__doc__ += sites_doc(MEGATRON_SITES)

# Files whose host reads touch tensors that are on the host on a GPU too.
HOST_SIDE_FILES = ("megatron/core/tensor_parallel/random.py",)

# Factories whose result is uninitialised memory: no kernel on a GPU, nothing to replay.
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class HostReadDuringCapture(RuntimeError):
    """A host read of device data inside a capture (a real capture is invalidated)."""


class CaptureError(RuntimeError):
    """Misuse of the graph API that CUDA refuses too (nested capture, replay before capture)."""


@dataclass
class _Op:
    func: object
    args: tuple
    kwargs: dict
    write_back: tuple  # (index into flat outputs, captured tensor) for fresh outputs
    execute: bool


def _storage(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _written_tensors(func, args, kwargs) -> list:
    """The tensors ``func`` writes: its schema's mutable arguments (``Tensor(a!)``, ``out=``,
    ``Tensor(a!)[]``), or every tensor argument of a ``c10d`` collective (their schemas,
    ``c10d.allreduce_(Tensor[] tensors, ...)``, ``c10d.alltoall_base_(Tensor output, ...)``, do
    not mark the buffers they fill as written)."""
    if func.namespace == "c10d":
        values = [args, kwargs]
    else:
        values = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            if i < len(args) and not a.kwarg_only:
                values.append(args[i])
            elif a.name in kwargs:
                values.append(kwargs[a.name])
    return [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)]


def _bytes_of(storage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (every view of it, any offset or stride)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,))


def _host_side_caller() -> bool:
    f = sys._getframe(2)
    for _ in range(12):
        if f is None:
            return False
        name = f.f_code.co_filename.replace("\\", "/")
        if any(name.endswith(h) for h in HOST_SIDE_FILES):
            return True
        f = f.f_back
    return False


_collective_wait = threading.local()  # .depth: Work.wait() calls under way on this thread


def _in_collective_wait() -> bool:
    return getattr(_collective_wait, "depth", 0) > 0


def _marking_wait(real_wait):
    """``Work.wait`` marking the ops it issues as the collective's own (not recorded)."""

    def wait(self, *args, **kwargs):
        _collective_wait.depth = getattr(_collective_wait, "depth", 0) + 1
        try:
            return real_wait(self, *args, **kwargs)
        finally:
            _collective_wait.depth -= 1

    return wait


def _work_wait_patches() -> list:
    import torch.distributed as dist

    if not dist.is_available():
        return []
    from torch.distributed.distributed_c10d import Work

    return [mock.patch.object(Work, "wait", _marking_wait(Work.wait))]


class _RecordOps(TorchDispatchMode):
    supports_higher_order_operators = False

    def __init__(self, graph: "FakeCUDAGraph"):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in DATA_DEPENDENT_OPS and not _host_side_caller():
            raise HostReadDuringCapture(
                f"aten.{name} reads device data on the host during CUDA-graph capture "
                "(a GPU capture is invalidated here)"
            )
        self.graph._save_before_write(func, args, kwargs)
        out = func(*args, **kwargs)
        if _in_collective_wait():  # the collective's own copy (gloo), replayed with it
            return out
        if func.namespace == "c10d" and self.graph.restore_pre_capture_state:
            self.graph._works += [w for w in tree_flatten(out)[0]
                                  if hasattr(w, "wait") and not isinstance(w, torch.Tensor)]
        self.graph._record(func, args, kwargs, out)
        return out


class _RefuseHostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READ_METHODS and not _host_side_caller():
            raise HostReadDuringCapture(
                f"Tensor.{HOST_READ_METHODS[func]} reads device data on the host during "
                "CUDA-graph capture (a GPU capture is invalidated here)"
            )
        return func(*args, **(kwargs or {}))


class _PoolHandle:
    _next = 0

    def __init__(self):
        _PoolHandle._next += 1
        self.id = _PoolHandle._next

    def __repr__(self):
        return f"<fake graph pool {self.id}>"


_capturing: list = []


class _PoolAllocation(threading.local):
    pools: list = []


_ALLOCATING = _PoolAllocation()


def _begin_allocate_to_pool(device, pool) -> None:
    """``torch._C._cuda_beginAllocateCurrentThreadToPool(device, mempool_id)`` (torch 2.13's
    binding: ``(int, tuple[int, int]) -> None``, a TypeError for other arguments; megatron-core
    0.19.2 transformer/cuda_graphs.py:282 calls it with ``torch.cuda.current_device()`` and
    ``CudaGraphManager.global_mempool``): this thread's allocations go to the pool until the
    matching end. The stand-in's pool id is a :class:`_PoolHandle` (``graph_pool_handle()``
    here); the allocations are host memory either way, so only the pairing is kept."""
    if not isinstance(device, int) or not isinstance(pool, _PoolHandle):
        raise TypeError("_cuda_beginAllocateCurrentThreadToPool(): incompatible function "
                        f"arguments. Invoked with: {device!r}, {pool!r}")
    _ALLOCATING.pools = _ALLOCATING.pools + [(device, pool)]


def _end_allocate_to_pool(device, pool) -> None:
    """``torch._C._cuda_endAllocateToPool(device, mempool_id)`` (0.19.2 cuda_graphs.py:289): ends
    the allocation to that pool begun on this thread; ending one never begun is an error."""
    if (device, pool) not in _ALLOCATING.pools:
        raise RuntimeError(f"endAllocateToPool: not allocating to {pool!r} on device {device}")
    _ALLOCATING.pools = [p for p in _ALLOCATING.pools if p != (device, pool)]


class FakeCUDAGraph:
    """``torch.cuda.CUDAGraph`` with the methods Megatron 0.16.1 calls."""

    # Restore, at capture_end, every storage that existed before capture_begin and that an op
    # of the capture wrote: a GPU capture runs no kernel. False: the capture's writes stay (the
    # behaviour before; nothing in the test suite needs it).
    restore_pre_capture_state = True

    def __init__(self, keep_graph: bool = False):
        self.ops: list[_Op] = []
        self._created: set = set()  # data_ptr of the storages the capture's ops created
        self._saved: dict = {}  # data_ptr -> (uint8 view of the storage, its pre-capture bytes)
        self._works: list = []  # the Works of the collectives issued in the capture
        self._aborted = False
        self.captured = False
        self.replays = 0
        self._pool: Optional[_PoolHandle] = None
        self._modes: tuple = ()
        self.generators: list = []

    # -- capture
    def capture_begin(self, pool=None, capture_error_mode="global", **_):
        if _capturing:
            raise CaptureError("a CUDA-graph capture is already under way (nested capture)")
        if self.captured:
            raise CaptureError("this CUDAGraph was already captured; reset() it first")
        self._pool = pool if pool is not None else _PoolHandle()
        self._created, self._saved, self._works, self._aborted = set(), {}, [], False
        self._modes = (_RefuseHostReads(), _RecordOps(self))
        for m in self._modes:
            m.__enter__()
        _capturing.append(self)

    def capture_end(self):
        for m in reversed(self._modes):
            m.__exit__(None, None, None)
        self._modes = ()
        _capturing.remove(self)
        self.captured = True
        self._restore_pre_capture_state()

    def _save_before_write(self, func, args, kwargs):
        """Before ``func`` writes a storage that existed before ``capture_begin``, keep a copy of
        its bytes (the first time only, so the copy is the pre-capture content)."""
        if not self.restore_pre_capture_state:
            return
        for t in _written_tensors(func, args, kwargs):
            try:
                storage = t.untyped_storage()
                key = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # no storage (sparse, subclass wrappers)
                continue
            if storage.nbytes() == 0 or key in self._created or key in self._saved:
                continue
            view = _bytes_of(storage)
            self._saved[key] = (view, view.clone())

    def _restore_pre_capture_state(self):
        """Write back every saved pre-capture content: after a capture, tensors that existed
        before it hold what they held, as on a GPU, where only replay() runs the kernels.
        Tensors created inside the capture keep what the capture computed."""
        saved, self._saved, self._created = self._saved, {}, set()
        works, self._works = self._works, []
        with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
            # a collective (gloo) may still be writing its output. A second wait re-runs what
            # gloo does in wait() (its reduce-scatter copies its result into the output again):
            # below autograd, so that copy leaves the version counter of an output autograd
            # saved in the capture as it was (a LoRA B's reduce-scattered input: "modified by an
            # inplace operation" in the backward capture)
            if not self._aborted:
                for work in works:
                    work.wait()
            for view, content in saved.values():
                view.copy_(content)

    def _record(self, func, args, kwargs, out):
        flat_in, _ = tree_flatten((args, kwargs))
        in_storages = {_storage(t) for t in flat_in if isinstance(t, torch.Tensor)}
        flat_out, _ = tree_flatten(out)
        write_back = tuple(
            (i, t) for i, t in enumerate(flat_out)
            if isinstance(t, torch.Tensor) and _storage(t) not in in_storages
        )
        name = func.overloadpacket.__name__
        self._created.update(_storage(t) for _, t in write_back)
        if name == "lift_fresh":  # torch.tensor(data) inside the capture: a new storage
            self._created.update(_storage(t) for t in flat_out if isinstance(t, torch.Tensor))
        mutates = func._schema.is_mutable
        execute = mutates or (bool(write_back) and name not in _UNINITIALISED)
        self.ops.append(_Op(func, args, kwargs, write_back, execute))

    # -- replay
    def replay(self):
        if not self.captured:
            raise CaptureError("replay() before capture")
        with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
            for op in self.ops:
                if not op.execute:
                    continue
                out = op.func(*op.args, **op.kwargs)
                if op.write_back:
                    flat_out, _ = tree_flatten(out)
                    for i, captured in op.write_back:
                        captured.copy_(flat_out[i])
        self.replays += 1

    # -- bookkeeping Megatron calls
    def register_generator_state(self, generator):
        self.generators.append(generator)

    def pool(self):
        return self._pool

    def reset(self):
        self.ops, self.captured = [], False
        self._created, self._saved = set(), {}

    def enable_debug_mode(self):
        pass

    def debug_dump(self, path):
        pass

    @property
    def num_ops(self) -> int:
        return sum(op.execute for op in self.ops)


class fake_graph:
    """``torch.cuda.graph(cuda_graph, pool=None, stream=None, capture_error_mode=...)``."""

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", **_):
        self.cuda_graph, self.pool, self.mode = cuda_graph, pool, capture_error_mode

    def __enter__(self):
        self.cuda_graph.capture_begin(self.pool, capture_error_mode=self.mode)

    def __exit__(self, *exc):
        self.cuda_graph._aborted = exc[0] is not None
        self.cuda_graph.capture_end()
        return False


class FakeCudaGenerator(torch.Generator):
    """A CUDA generator's graph-safe API (``clone_state``, ``graphsafe_get_state`` /
    ``graphsafe_set_state``) over a CPU state -- an instance of ``torch.Generator``, as a real
    CUDA generator and every state Megatron's graph-safe RNG tracker clones from it are (the
    package's checkpoint RNG capture, ``checkpoint/rng.py``, relies on it). One class for
    :func:`fake_cuda_graphs` (seeded 0) and ``graph_safe_standins.gpu_standins``.

    As torch 2.13's ``CUDAGeneratorImpl`` (aten/src/ATen/cuda/CUDAGeneratorImpl.cpp), a
    generator points at a state object (``state_``) that several generators may share:

    * ``graphsafe_get_state()`` returns a *new* generator pointing at the current state
      (``make_intrusive<CUDAGeneratorImpl>(device().index(), state_)``): a handle, not a copy --
      what later advances the generator advances the handle's state too;
    * ``graphsafe_set_state(gen)`` makes this generator point at ``gen``'s state (``state_ =
      cuda_gen->state_``; anything but a CUDA generator: "Expected a CUDA Generator") -- no copy:
      Megatron's graph-safe ``fork()`` switches the default generator to the tracker's named
      state and back this way, and the named state advances meanwhile;
    * ``clone_state()`` returns a generator with a copy of the state;
    * ``get_state`` / ``set_state`` / ``manual_seed`` / ``seed`` / ``initial_seed`` act on the
      state the generator points at (so a handle's ``set_state`` is seen by every generator
      pointing at that state: the checkpoint restore sets the tracker's states in place).

    Not modelled: drawing (``torch.rand(generator=...)`` uses the object's own CPU state): in
    the CUDA-as-CPU mode the "CUDA" ops draw from the CPU generator, not from this one."""

    def __new__(cls, state: "torch.Generator | None" = None):
        return super().__new__(cls)  # torch.Generator.__new__ takes a device, not a state

    def __init__(self, state: "torch.Generator | None" = None):
        super().__init__()
        self._state = torch.Generator() if state is None else state  # the shared state object

    def get_state(self):
        return self._state.get_state()

    def set_state(self, new_state):
        self._state.set_state(new_state)
        return self

    def manual_seed(self, seed):
        self._state.manual_seed(seed)
        return self

    def seed(self):
        return self._state.seed()

    def initial_seed(self):
        return self._state.initial_seed()

    def clone_state(self):
        copy = torch.Generator()
        copy.set_state(self._state.get_state())
        return FakeCudaGenerator(copy)

    def graphsafe_get_state(self):
        return FakeCudaGenerator(self._state)

    def graphsafe_set_state(self, other):
        if not isinstance(other, FakeCudaGenerator):
            raise RuntimeError("Expected a CUDA Generator")
        self._state = other._state


def _capturable_devices_with_cpu(real):
    """``torch.optim``'s ``_get_capturable_supported_devices`` with ``cpu`` added: here CPU
    tensors stand in for CUDA ones, and a ``capturable=True`` optimizer asserts its params are
    on a capturable device (a non-capturable one reads ``step.item()``: no step in a capture)."""

    def devices(*args, **kwargs):
        return [*real(*args, **kwargs), "cpu"]

    return devices


def _optimizer_device_patches() -> list:
    # every torch.optim module binding the function by name (``import torch`` imports them)
    return [mock.patch.object(mod, "_get_capturable_supported_devices",
                              _capturable_devices_with_cpu(mod._get_capturable_supported_devices))
            for name, mod in sorted(sys.modules.items())
            if name.startswith("torch.optim.") and hasattr(mod, "_get_capturable_supported_devices")]


# The keys of torch.cuda.memory_stats() as the installed torch documents them (cuda/memory.py:
# torch 2.13 :239-311, torch 2.11 :235-297): the core statistics per pool and metric, the event
# counters, the oversize and requested-bytes statistics (2.13's
# ``reserved_bytes_by_private_pools.*`` appears only with private pools: left out).
# ``num_oom_rejections`` is 2.13's only (:284-285, the throw_on_cudamalloc_oom policy's counter);
# torch 2.11 neither documents nor counts it.
_CORE_STATS = ("allocated", "allocated_bytes", "segment", "reserved_bytes", "active", "active_bytes",
               "inactive_split", "inactive_split_bytes", "requested_bytes")
_METRICS = ("current", "peak", "allocated", "freed")
MEMORY_STATS_KEYS = frozenset(
    [f"{s}.{pool}.{m}" for s in _CORE_STATS for pool in ("all", "large_pool", "small_pool")
     for m in _METRICS]
    + [f"{s}.{m}" for s in ("oversize_allocations", "oversize_segments") for m in _METRICS]
    + ["num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
       "num_device_free", "max_split_size"]
    + (["num_oom_rejections"] if TORCH_RELEASE >= (2, 13) else []))


def _memory_stats(device=None):
    """``torch.cuda.memory_stats(device=None)`` (cuda/memory.py:231-349; torch 2.11 :227-329,
    the lines below 20 up): the device through
    ``_get_device_index(device, optional=True)`` (memory.py:356: a cpu device raises ValueError),
    then ``torch._C._cuda_memoryStats`` -> CUDACachingAllocator ``getDeviceStats``, whose
    device check raises RuntimeError("Invalid device argument {i}: did you call init?") for an
    index outside [0, device_count); the flattened stats as a ``collections.OrderedDict``
    sorted by key (memory.py:346-349), every documented key (:data:`MEMORY_STATS_KEYS`) 0. CUDA
    counts as initialised here (memory.py:354-355 returns ``{}`` before any of this when it is
    not)."""
    from tests.support.cuda_as_cpu import device_index

    idx = device_index(device, optional=True)
    if not 0 <= idx < torch.cuda.device_count():
        raise RuntimeError(f"Invalid device argument {idx}: did you call init?")
    return collections.OrderedDict((k, 0) for k in sorted(MEMORY_STATS_KEYS))


@contextlib.contextmanager
def fake_cuda_graphs() -> Iterator[None]:
    """``cuda_as_cpu()`` plus the CUDA-graph stand-in, for the block's duration."""
    import megatron.core.tensor_parallel.random as mrandom

    gens = (FakeCudaGenerator().manual_seed(0),)
    patches = [
        mock.patch("torch.cuda.CUDAGraph", FakeCUDAGraph),
        mock.patch("torch.cuda.graph", fake_graph),
        mock.patch("torch.cuda.graph_pool_handle", _PoolHandle),
        mock.patch("torch._C._cuda_beginAllocateCurrentThreadToPool", _begin_allocate_to_pool, create=True),
        mock.patch("torch._C._cuda_endAllocateToPool", _end_allocate_to_pool, create=True),
        mock.patch("torch.cuda.is_current_stream_capturing", lambda: bool(_capturing)),
        mock.patch("torch.cuda.memory_stats", _memory_stats),
        mock.patch("torch.cuda.get_device_capability", device_capability_standin((9, 0))),
        mock.patch("torch.cuda.default_generators", gens),
        mock.patch.object(mrandom, "_lazy_init", lambda: None),
        mock.patch.object(mrandom, "_lazy_call", lambda cb, **k: cb()),
        *_optimizer_device_patches(),
        *_work_wait_patches(),
    ]
    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_as_cpu())
        for p in patches:
            stack.enter_context(p)
        try:
            yield
        finally:
            _capturing.clear()
            _ALLOCATING.pools = []


def reset_megatron_cuda_graphs() -> None:
    """Forget every runner, graph and pooled buffer Megatron's CudaGraphManager keeps in
    class/module globals, so one test's graphs never leak into the next."""
    from megatron.core.transformer import cuda_graphs as cg

    cg._CudagraphGlobalRecord.cudagraph_created = False
    cg._CudagraphGlobalRecord.cudagraph_record = []
    cg._CudagraphGlobalRecord.cudagraph_inference_record = []
    if hasattr(cg, "TensorReusePool"):  # 0.16.x; 0.19.x allocates from the graph mempool
        cg.TensorReusePool.tensor_strong_refs = []
        cg.TensorReusePool.tensor_strong_refs_dataptrs = set()
        cg.TensorReusePool.pool = []
    if hasattr(cg._CudagraphGlobalRecord, "_saved_tensors_observer"):  # 0.19.x
        cg._CudagraphGlobalRecord._saved_tensors_observer = None
    cg.CudaGraphManager.global_mempool = None
    cg.fwd_buffer_reuse_ref_count = 0
    cg.bwd_buffer_reuse_ref_count = 0
    cg._set_capture_end()
