"""SyncSentinel: count (and optionally forbid) host-sync points in a region.

A *host sync* is any point where the host must wait for a device value: a Python read of
tensor data (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``.cpu()``, ``.numpy()``, ...)
or an operator whose *output shape* depends on tensor values (``nonzero``, ``masked_select``,
``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, ...). On CUDA each is
a device-to-host synchronisation that stalls the launch queue and aborts CUDA-graph capture.

On the CPU nothing actually stalls, so the sentinel *observes* the same points:

* ``TorchFunctionMode`` sees the Python-level reads (``Tensor.tolist`` and friends);
* ``TorchDispatchMode`` sees every aten op: data-dependent-shape ops are counted as syncs and
  every op is counted as a proxy for kernel launches (``aten_ops``);
  (inside autograd backward only the dispatch level is active: a scalar read there shows up as
  ``aten._local_scalar_dense``);
* on CUDA, ``torch.cuda.set_sync_debug_mode`` is also armed ("warn", or "error" in strict mode),
  so syncs inside C++ kernels that Python never sees are reported too; and there reads of CPU
  tensors (and value-dependent ops on them) are not counted: they wait for no device. On a CPU
  build every tensor stands for a device one, so all are counted.

Example::

    with SyncSentinel() as s:
        loss = model(batch)
    print(s.num_syncs, s.aten_ops, s.summary())

    with SyncSentinel(strict=True):   # raises HostSyncError at the first sync
        ...
"""

from __future__ import annotations

import collections
import dataclasses
import os
import traceback
import warnings
from typing import Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["HostSyncError", "SyncEvent", "SyncSentinel", "HOST_READ_METHODS", "DATA_DEPENDENT_OPS"]


class HostSyncError(RuntimeError):
    """Raised by a strict :class:`SyncSentinel` at the first host-sync point."""


# Python-level reads of tensor values. Each forces a device-to-host copy + wait on CUDA.
HOST_READ_METHODS: dict[Callable, str] = {
    torch.Tensor.tolist: "tolist",
    torch.Tensor.item: "item",
    torch.Tensor.__bool__: "__bool__",
    torch.Tensor.__int__: "__int__",
    torch.Tensor.__float__: "__float__",
    torch.Tensor.__index__: "__index__",
    torch.Tensor.__complex__: "__complex__",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
}

# aten ops (overload packets) whose output shape depends on values, or that read a scalar back.
DATA_DEPENDENT_OPS: frozenset[str] = frozenset(
    {
        "nonzero",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "bincount",
        "_local_scalar_dense",
        "equal",
        "is_nonzero",
    }
)

_TORCH_DIR = os.path.dirname(torch.__file__)
# Files whose frames are instrumentation, not user code (the audit adds itself).
_INTERNAL_FILES = {os.path.abspath(__file__)}


def register_internal_file(path: str) -> None:
    """Frames from ``path`` are skipped when locating the user code behind a sync."""
    _INTERNAL_FILES.add(os.path.abspath(path))


@dataclasses.dataclass(frozen=True)
class SyncEvent:
    """One observed host-sync point.

    kind: "host_read" (Python read of tensor data), "data_dependent_op" (value-dependent output
        shape), "cuda_sync" (reported by torch.cuda sync debug mode).
    op: the method or aten op name, e.g. "tolist", "aten.nonzero".
    location: "file:line in function" of the first frame outside torch (and outside this file).
    region: the sentinel's ``region`` label when it happened (e.g. "layer 3 backward"), if set.
    """

    kind: str
    op: str
    location: str
    region: Optional[str] = None

    def __str__(self) -> str:
        where = f" [{self.region}]" if self.region else ""
        return f"{self.kind}:{self.op} at {self.location}{where}"


def _user_location() -> str:
    """First stack frame outside torch and this module: where the user code triggered the op."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = os.path.abspath(frame.filename)
        if path in _INTERNAL_FILES or path.startswith(_TORCH_DIR):
            continue
        return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "<unknown>"


def _op_name(func) -> str:
    packet = getattr(func, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(func, "name", lambda: str(func))()


def _is_data_dependent(func, args, kwargs) -> bool:
    if not hasattr(func, "overloadpacket"):
        return False  # higher-order op: its inner aten ops are dispatched (and seen) separately
    name = func.overloadpacket.__name__
    if name in DATA_DEPENDENT_OPS:
        return True
    if name == "repeat_interleave":
        # aten.repeat_interleave.Tensor(repeats, *, output_size=None): without output_size the
        # output length is sum(repeats), read back from the device.
        if func._overloadname == "Tensor":
            out_size = kwargs.get("output_size", args[1] if len(args) > 1 else None)
            return out_size is None
        return False
    if name == "index":
        # Boolean-mask indexing (x[mask]) has a value-dependent output shape.
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(
            torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ())
        )
    return False


def _on_the_host(args) -> bool:
    """Every tensor in ``args`` (there is one at least) is a CPU tensor."""
    tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def _cuda_machine() -> bool:
    """A CUDA build of torch with a GPU: host tensors are then not device tensors (on a CPU
    build, where tests emulate CUDA on CPU tensors, every tensor stands for a device one)."""
    return torch.backends.cuda.is_built() and torch.cuda.is_available()


class _FunctionWatcher(TorchFunctionMode):
    def __init__(self, sentinel: "SyncSentinel"):
        super().__init__()
        self.sentinel = sentinel
        self.depth = 0  # >0 while inside a host read: its inner aten ops are not double-counted

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = HOST_READ_METHODS.get(func)
        if name is not None:
            # On this CPU every tensor is a host tensor, and the one a CUDA run keeps on the
            # device is counted; on a CUDA machine a read of a CPU tensor waits for nothing
            # (Megatron's RNG tracker reads the CPU RNG state): not counted there.
            if not (self.sentinel.host_tensors_free and _on_the_host(args)):
                self.sentinel._record("host_read", name)
            self.depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.depth -= 1
        return func(*args, **kwargs)


class _DispatchWatcher(TorchDispatchMode):
    # Higher-order ops (flex_attention, cond, ...) pass through here too; they are counted as
    # one op each and run unchanged.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let torch.compile run inside the sentinel (torch/utils/_python_dispatch.py: the mode
        is off while dynamo compiles, on again for the compiled artefact). Without it dynamo
        refuses every frame under a non-infra dispatch mode (torch/_dynamo/convert_frame.py),
        and flex_attention, which compiles even eagerly (``fullgraph=True``, backend "eager"),
        raised "found no compiled frames" and then "function marked as skipped" on every later
        call of the process: the `flex` backend's first step, with the default
        ``training.sync_check=first``, died. Cost: ops inside a compiled artefact are not seen
        here; CUDA's sync debug mode (``cuda_debug``) still sees their syncs on a GPU."""
        return True

    def __init__(self, sentinel: "SyncSentinel", function_watcher: _FunctionWatcher):
        super().__init__()
        self.sentinel = sentinel
        self.function_watcher = function_watcher

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.sentinel
        name = _op_name(func)
        if s.count_ops and s._active:
            s.aten_ops += 1
            s.op_counts[name] += 1
        if (self.function_watcher.depth == 0 and _is_data_dependent(func, args, kwargs)
                and not (s.host_tensors_free and _on_the_host((args, kwargs)))):
            s._record("data_dependent_op", f"aten.{name}")
        return func(*args, **kwargs)


class SyncSentinel:
    """Context manager that counts host-sync points and aten ops in a region.

    Args:
        strict: raise :class:`HostSyncError` at the first sync (with its location).
        count_ops: also count every aten op (``aten_ops``, ``op_counts``).
        cuda_debug: arm ``torch.cuda.set_sync_debug_mode`` when CUDA is initialised
            (None: automatic; it is never armed on CPU-only machines).
        name: label used in :meth:`summary`.

    Attributes (valid after and during the region):
        events: list of :class:`SyncEvent`, in order.
        num_syncs: ``len(events)``.
        aten_ops: number of aten ops dispatched (a proxy for kernel launches).
        op_counts: ``collections.Counter`` of aten op names.
    """

    def __init__(
        self,
        strict: bool = False,
        count_ops: bool = True,
        cuda_debug: Optional[bool] = None,
        name: str = "region",
    ):
        self.strict = strict
        self.count_ops = count_ops
        self.cuda_debug = cuda_debug
        self.name = name
        self.events: list[SyncEvent] = []
        self.aten_ops = 0
        self.op_counts: collections.Counter = collections.Counter()
        self._fn_mode: Optional[_FunctionWatcher] = None
        self._dispatch_mode: Optional[_DispatchWatcher] = None
        self._prev_cuda_mode: Optional[int] = None
        self._active = False
        # on a CUDA machine reads of (and value-dependent ops on) CPU tensors are no syncs
        self.host_tensors_free = False
        # Optional label of the code region running now; instrumentation (e.g. the graph-safety
        # audit's layer hooks) sets it so each event says which layer/phase it came from.
        self.region: Optional[str] = None

    # -- recording -----------------------------------------------------------------------
    def _record(self, kind: str, op: str) -> None:
        if not self._active:
            return
        event = SyncEvent(kind, op, _user_location(), self.region)
        self.events.append(event)
        if self.strict:
            raise HostSyncError(f"host sync inside strict SyncSentinel '{self.name}': {event}")

    @property
    def num_syncs(self) -> int:
        return len(self.events)

    def by_location(self) -> collections.Counter:
        """Counter of ``"op at location"`` strings."""
        return collections.Counter(f"{e.op} at {e.location}" for e in self.events)

    def summary(self) -> str:
        lines = [f"SyncSentinel[{self.name}]: {self.num_syncs} host syncs, {self.aten_ops} aten ops"]
        for where, n in self.by_location().most_common():
            lines.append(f"  {n:4d} x {where}")
        return "\n".join(lines)

    def reset(self) -> None:
        self.events.clear()
        self.aten_ops = 0
        self.op_counts.clear()

    # -- context manager -----------------------------------------------------------------
    def _cuda_debug_wanted(self) -> bool:
        if self.cuda_debug is not None:
            return self.cuda_debug and torch.cuda.is_available()
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def __enter__(self) -> "SyncSentinel":
        self.host_tensors_free = _cuda_machine()
        self._fn_mode = _FunctionWatcher(self)
        self._dispatch_mode = _DispatchWatcher(self, self._fn_mode)
        self._fn_mode.__enter__()
        self._dispatch_mode.__enter__()
        if self._cuda_debug_wanted():
            # CUDA sync debug mode reports syncs made inside C++ kernels Python never sees:
            # "error" raises at once (strict); "warn" warnings are turned into events at exit.
            self._prev_cuda_mode = torch.cuda.get_sync_debug_mode()
            self._warn_ctx = warnings.catch_warnings(record=True)
            self._cuda_warnings = self._warn_ctx.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("error" if self.strict else "warn")
        self._active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._active = False
        if self._prev_cuda_mode is not None:
            torch.cuda.set_sync_debug_mode(self._prev_cuda_mode)
            self._prev_cuda_mode = None
            self._warn_ctx.__exit__(None, None, None)
            for w in self._cuda_warnings:
                if "synchronizing" in str(w.message):
                    self.events.append(
                        SyncEvent("cuda_sync", str(w.message).split("\n")[0][:80],
                                  f"{w.filename}:{w.lineno}")
                    )
        self._dispatch_mode.__exit__(exc_type, exc, tb)
        self._fn_mode.__exit__(exc_type, exc, tb)

    def pause(self) -> "_Paused":
        """Context manager that stops recording inside a region (e.g. telemetry read-back)."""
        return _Paused(self)


class _Paused:
    def __init__(self, sentinel: SyncSentinel):
        self.sentinel = sentinel
        self.was_active = False

    def __enter__(self):
        self.was_active = self.sentinel._active
        self.sentinel._active = False
        return self

    def __exit__(self, *exc):
        self.sentinel._active = self.was_active
