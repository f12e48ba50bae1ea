"""Graph-safety audit: can each TransformerLayer be captured by Megatron's CudaGraphManager?

Runs on CPU over ordinary training steps (no capture) and checks, per layer, what per-layer
CUDA graphs (``cuda_graph_impl="local"``, ``enable_cuda_graph=True``) rely on:

(a) **no host sync** inside the layer's forward or backward (a sync aborts capture);
(b) **static buffers**: every tensor the layer reads that is not one of its inputs (weights,
    LoRA adapters, packed-cache buffers, offload buffers) lives at an address the layer already
    read at the reference step -- a graph replays the addresses it captured. The first
    ``warmup_steps`` steps may allocate lazily (Megatron captures after warmup too); the step
    after them is the reference;
(c) **argument matching**: the arguments each layer receives satisfy CudaGraphManager's rules
    (tensors keep shape/dtype/device, non-tensors keep their value, dataclasses field by field)
    -- checked with Megatron's own ``ArgMetadata`` and ``_CudaGraphRunner.get_mismatch_errors``;
(d) **no Python branch on tensor values** (``if tensor:`` inside a layer): the captured graph
    would freeze one branch;
(e) **one runner, many microbatches**: with PP=1 Megatron builds ONE runner per layer and
    replays its graph for every later microbatch of every step; at replay it copies only the
    flattened arguments (dataclass fields included). So every non-parameter tensor a layer
    reads outside its arguments (and does not write itself) must, in every call, be the same
    tensor as in the runner's first call -- the one a capture records -- (check "runner":
    else the graph reads the buffer the captured microbatch read, e.g. a cache slot chosen in
    Python) with the same content (check "content": per-microbatch data such as the current
    batch's RoPE tables or masks must be graph inputs -- PackedSeqParams fields -- not side
    reads). This is what Megatron's own CudaGraphManager shows when replayed over the test-only
    CPU stand-in for CUDA graphs. It is stricter than a GPU in one case: data rewritten outside
    every graph before each replay at a fixed address would replay correctly, but is still
    reported (the package's contract is that per-batch tensors travel as arguments). With
    PP>1 Megatron keeps a runner per in-flight microbatch: the comparison is then per
    (layer, call index) across steps.

Usage::

    audit = GraphSafetyAudit(model, strict=False)
    with audit:
        for step in range(3):
            with audit.step():
                train_step()
    print(audit.report().summary())    # per-layer table; report().ok

``strict=True`` raises :class:`GraphSafetyError` at the first violation, naming the layer, the
phase and the source location.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_fastpath._autograd import call_in_backward
from megatron_fastpath.sync.sentinel import (
    SyncSentinel,
    _op_name,
    _user_location,
    register_internal_file,
)

register_internal_file(__file__)

__all__ = ["GraphSafetyAudit", "GraphSafetyError", "AuditFinding", "LayerAudit", "AuditReport"]

_BRANCH_OPS = {"__bool__", "aten.is_nonzero"}


class GraphSafetyError(RuntimeError):
    """A layer would not survive CUDA-graph capture (strict audit)."""


@dataclasses.dataclass(frozen=True)
class AuditFinding:
    """One violation. check: "sync" | "branch" | "buffer" | "args" | "runner" | "content"."""

    layer: int
    phase: str
    step: int
    check: str
    message: str
    location: str = ""

    def __str__(self) -> str:
        at = f" at {self.location}" if self.location else ""
        return f"layer {self.layer} {self.phase} (step {self.step}) [{self.check}] {self.message}{at}"


@dataclasses.dataclass
class LayerAudit:
    layer: int
    forward_calls: int = 0
    syncs_forward: int = 0
    syncs_backward: int = 0
    value_branches: int = 0
    external_reads: int = 0
    moved_buffers: int = 0
    arg_mismatches: int = 0
    per_microbatch_reads: int = 0  # check (e): side reads that differ between microbatches

    @property
    def ok(self) -> bool:
        return not (self.syncs_forward or self.syncs_backward or self.value_branches
                    or self.moved_buffers or self.arg_mismatches or self.per_microbatch_reads)


@dataclasses.dataclass(frozen=True)
class AuditReport:
    steps: int
    layers: tuple
    findings: tuple

    @property
    def ok(self) -> bool:
        return all(layer.ok for layer in self.layers) and not self.findings

    def summary(self) -> str:
        head = (f"graph-safety audit over {self.steps} steps: "
                f"{'PASS' if self.ok else 'FAIL'} ({len(self.findings)} findings)")
        rows = [head, "  layer  fwd-calls  syncs(fwd/bwd)  branches  static-reads  moved  arg-mismatch"
                      "  per-mb-reads"]
        for l in self.layers:
            rows.append(
                f"  {l.layer:5d}  {l.forward_calls:9d}  {l.syncs_forward:6d}/{l.syncs_backward:<6d}  "
                f"{l.value_branches:8d}  {l.external_reads:12d}  {l.moved_buffers:5d}  "
                f"{l.arg_mismatches:12d}  {l.per_microbatch_reads:12d}"
            )
        rows += [f"  - {f}" for f in self.findings[:20]]
        return "\n".join(rows)


def _storage_ptr(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class _ExternalReads(TorchDispatchMode):
    """Records every tensor an op reads that was neither produced inside the region nor one of
    the region's inputs (weights, adapters, cache and offload buffers), and reports a read
    whose storage is not among the reference step's external storages."""

    supports_higher_order_operators = True

    def __init__(self, input_ptrs: set, reference: Optional[set], on_moved, param_ptrs=frozenset()):
        super().__init__()
        self.inputs = input_ptrs
        self.produced: set = set()
        self.reads: set = set()
        self.reference = reference
        self.on_moved = on_moved
        self.params = param_ptrs
        self.written: set = set()
        # check (e): (storage, offset, shape) -> (fingerprint, op) of non-parameter side reads
        self.side_reads: dict = {}

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, t in enumerate(tree_leaves((args, kwargs))):
            if isinstance(t, torch.Tensor):
                p = _storage_ptr(t)
                if p is None or p in self.produced or p in self.inputs or p in self.written:
                    continue
                if p not in self.params:
                    key = (p, t.storage_offset(), tuple(t.shape))
                    if key not in self.side_reads:
                        self.side_reads[key] = (_fingerprint(t), _op_name(func))
                if p in self.reads:
                    continue
                self.reads.add(p)
                if self.reference is not None and p not in self.reference:
                    self.on_moved(_op_name(func), i, p, tuple(t.shape))
        self.written |= _written_storages(func, args, kwargs)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                p = _storage_ptr(t)
                if p is not None:
                    self.produced.add(p)
        return out


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Three float64 sums of a tensor's content, computed on its device (no host read) and
    invisible to the dispatch modes (the sentinel's op counts stay those of the step)."""
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        flat = torch.nan_to_num(t.detach().reshape(-1).to(torch.float64))
        weight = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 89 + 1
        return torch.stack([flat.sum(), (flat * weight).sum(), flat.abs().sum()])


def _written_storages(func, args, kwargs) -> set:
    """Storages an op writes in place (schema arguments marked ``(a!)``)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return set()
    out = set()
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                out.add(_storage_ptr(t))
    return out


def _one_runner_per_layer() -> bool:
    """Megatron reuses one runner per layer for all microbatches when PP == 1."""
    try:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_world_size() == 1
    except (AssertionError, RuntimeError, AttributeError):  # parallel state not initialised
        return True


def _in_autograd_backward() -> bool:
    """True while the autograd engine executes a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class _AuditSentinel(SyncSentinel):
    def __init__(self, audit: "GraphSafetyAudit"):
        super().__init__(name="graph-safety audit")
        self.audit = audit

    def _record(self, kind, op):
        region = self.region
        super()._record(kind, op)
        if region is not None and self._active:
            self.audit._on_sync(self.events[-1])


class GraphSafetyAudit:
    """Per-layer graph-safety checks over real training steps (see module docstring).

    Args:
        model: module containing the layers (e.g. a GPTModel).
        strict: raise GraphSafetyError at the first violation.
        layer_types: which submodules are audited (default: Megatron ``TransformerLayer``).
        warmup_steps: steps before the reference step for check (b) (lazy allocation allowed).
        one_runner_per_layer: check (e) compares the microbatches of a step (Megatron's PP=1
            runner reuse); default: read from Megatron's parallel state.
    """

    def __init__(self, model: torch.nn.Module, strict: bool = False, layer_types=None,
                 warmup_steps: int = 1, one_runner_per_layer: Optional[bool] = None):
        if layer_types is None:
            from megatron.core.transformer.transformer_layer import TransformerLayer

            layer_types = (TransformerLayer,)
        self.model = model
        self.strict = strict
        self.warmup_steps = warmup_steps
        self.layers = [m for m in model.modules() if isinstance(m, layer_types)]
        if not self.layers:
            raise ValueError(f"no {layer_types} found in the model to audit")
        self.index = {id(m): i + 1 for i, m in enumerate(self.layers)}
        self.stats = {i + 1: LayerAudit(i + 1) for i in range(len(self.layers))}
        self.findings: list[AuditFinding] = []
        self.steps = 0
        self._handles: list = []
        self._sentinel: Optional[_AuditSentinel] = None
        self._ref_reads: dict = {}
        self._ref_args: dict = {}
        self._calls: dict = {}
        self._tracker: Optional[_ExternalReads] = None
        self._current: tuple = (None, "")
        self.one_runner_per_layer = (_one_runner_per_layer() if one_runner_per_layer is None
                                     else one_runner_per_layer)
        self._param_ptrs = frozenset(_storage_ptr(p) for p in model.parameters())
        self._side_reads: dict = {}  # runner key -> [(step, call, {key: (fingerprint, op)})]
        self._moved: set = set()  # (layer, storage) already reported by check (b) this step

    # ------------------------------------------------------------------ hooks
    def __enter__(self) -> "GraphSafetyAudit":
        for layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._post_hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def step(self):
        """Audit one training step (forward + backward of all its microbatches)."""
        self.steps += 1
        self._calls = {}
        self._moved = set()
        self._param_ptrs = frozenset(_storage_ptr(p) for p in self.model.parameters())
        self._sentinel = _AuditSentinel(self)
        try:
            with self._sentinel:
                try:
                    yield self
                finally:
                    # A layer that raised (e.g. strict mode) never reached its forward hook:
                    # pop its read tracker before the sentinel pops its own modes.
                    if self._tracker is not None:
                        self._tracker.__exit__(None, None, None)
                        self._tracker = None
        finally:
            self._sentinel = None
        self._check_runner_reads()

    def _finding(self, layer: int, phase: str, check: str, message: str, location: str = "") -> None:
        f = AuditFinding(layer, phase, self.steps, check, message, location)
        self.findings.append(f)
        if self.strict:
            raise GraphSafetyError(str(f))

    def _on_sync(self, event) -> None:
        layer, phase = self._current
        s = self.stats[layer]
        if event.op in _BRANCH_OPS:
            s.value_branches += 1
            self._finding(layer, phase, "branch", f"Python branch on a tensor value ({event.op})", event.location)
            return
        if phase == "forward":
            s.syncs_forward += 1
        else:
            s.syncs_backward += 1
        self._finding(layer, phase, "sync", f"host sync {event.kind}:{event.op}", event.location)

    def _set_region(self, layer: Optional[int], phase: str = "") -> None:
        self._current = (layer, phase)
        if self._sentinel is not None:
            self._sentinel.region = None if layer is None else f"layer {layer} {phase}"

    def _pre_hook(self, module, args, kwargs):
        if self._sentinel is None:
            return None
        i = self.index[id(module)]
        recompute = _in_autograd_backward()  # activation recompute runs inside backward
        self._set_region(i, "recompute" if recompute else "forward")
        hidden = args[0] if args else kwargs.get("hidden_states")
        if recompute:
            return None
        s = self.stats[i]
        s.forward_calls += 1
        call = self._calls[i] = self._calls.get(i, 0) + 1
        key = (i, call)
        self._check_args(i, key, args, kwargs)

        input_ptrs = {_storage_ptr(t) for t in tree_leaves((args, self._tensors_of(kwargs)))
                      if isinstance(t, torch.Tensor)}

        ref_step = self.warmup_steps + 1

        def moved(name, idx, ptr, shape):
            s.moved_buffers += 1
            self._moved.add((i, ptr))
            self._finding(i, "forward", "buffer",
                          f"{name} arg {idx} read a tensor at {ptr:#x} (shape {shape}) that the "
                          f"layer did not read at step {ref_step}: a buffer was reallocated "
                          "between steps (a captured graph would read the old address)",
                          _user_location())

        reference = self._ref_reads.get(key) if self.steps > ref_step else None
        self._tracker = _ExternalReads(input_ptrs, reference, moved, self._param_ptrs)
        self._tracker.__enter__()
        self._tracker_key = key
        # Mark the end of this layer's backward: gradient reaching its input.
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            marked = call_in_backward(hidden, lambda: self._leave_backward(i))
            if args:
                return (marked, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": marked}
        return None

    def _post_hook(self, module, args, kwargs, output):
        if self._sentinel is None:
            return None
        i = self.index[id(module)]
        if _in_autograd_backward():  # recompute inside backward
            self._set_region(i, "backward")
            return None
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
            key = self._tracker_key
            self.stats[i].external_reads = len(tracker.reads)
            if self.steps == self.warmup_steps + 1:
                self._ref_reads[key] = tracker.reads
            runner = (i,) if self.one_runner_per_layer else key
            side = {k: v for k, v in tracker.side_reads.items() if k[0] not in tracker.written}
            self._side_reads.setdefault(runner, []).append((self.steps, key[1], side))
        self._set_region(None)
        first = output[0] if isinstance(output, tuple) else output
        if isinstance(first, torch.Tensor) and first.requires_grad:
            marked = call_in_backward(first, lambda: self._enter_backward(i))
            return (marked, *output[1:]) if isinstance(output, tuple) else marked
        return None

    def _enter_backward(self, i: int) -> None:
        self._set_region(i, "backward")

    def _leave_backward(self, i: int) -> None:
        self._set_region(None)

    @staticmethod
    def _tensors_of(kwargs):
        out = []
        for v in kwargs.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif dataclasses.is_dataclass(v) and not isinstance(v, type):
                out += [getattr(v, f.name) for f in dataclasses.fields(v)
                        if isinstance(getattr(v, f.name), torch.Tensor)]
        return out

    # (c) Megatron's own argument matching
    def _check_args(self, i: int, key, args, kwargs) -> None:
        from megatron_fastpath.compat.graphs import cudagraph_arg_tools

        reference, mismatch_errors = cudagraph_arg_tools()
        try:
            if key not in self._ref_args:
                self._ref_args[key] = reference(args, kwargs)
                # validate types against CudaGraphManager's supported set on the first step
                mismatch_errors(self._ref_args[key], args, kwargs)
                return
            errors = mismatch_errors(self._ref_args[key], args, kwargs)
        except AssertionError as exc:  # _check_supported_type: e.g. a ProcessGroup argument
            errors = [f"unsupported argument type for CUDA graphs: {exc}"]
        if errors:
            self.stats[i].arg_mismatches += len(errors)
            self._finding(i, "forward", "args",
                          "CudaGraphManager would not replay: " + "; ".join(e.strip() for e in errors))

    # (e) what one replayed runner would read
    def _check_runner_reads(self) -> None:
        """Compare this step's calls of every runner with the runner's first recorded call
        (the one a capture would record), then keep only that reference."""
        for runner, calls in self._side_reads.items():
            (step0, call0, first), later = calls[0], calls[1:]
            self._side_reads[runner] = calls[:1]
            for step, call, side in later:
                moved = [k for k in side if k not in first and (runner[0], k[0]) not in self._moved]
                changed = [k for k in side if k in first
                           and not torch.equal(side[k][0], first[k][0])]
                where = f"call {call} of step {step} vs call {call0} of step {step0}"
                for check, keys, what in (
                    ("runner", moved, "that the reference call did not read: the one CUDA-graph "
                     "runner serving both replays the tensors it captured"),
                    ("content", changed, "whose content differs from the reference call's: "
                     "per-microbatch data must be a graph input (a PackedSeqParams field), not "
                     "a side read"),
                ):
                    if keys:
                        self.stats[runner[0]].per_microbatch_reads += len(keys)
                        ops = sorted({side[k][1] for k in keys})
                        shapes = sorted({k[2] for k in keys})
                        self._finding(runner[0], "forward", check,
                                      f"{where}: read {len(keys)} tensor(s) outside its arguments "
                                      f"(ops {ops}, shapes {shapes}) {what}")

    # ------------------------------------------------------------------ results
    def report(self) -> AuditReport:
        return AuditReport(self.steps, tuple(self.stats[i] for i in sorted(self.stats)),
                           tuple(self.findings))
