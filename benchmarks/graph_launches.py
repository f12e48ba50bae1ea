"""Launches per training step: no graphs, per-layer CUDA graphs, full-iteration graphs.

The main job's GPU step (``training.device=cuda``) run in this process on the CPU inside the GPU
stand-ins (``tests/support/graph_safe_standins.py::gpu_standins``: CUDA-as-CPU mode and the fake
CUDA graph, whose ``replay()`` re-executes the captured aten ops), exactly as
``tests/train/test_full_iteration_graphs.py`` runs it, for L = 4, 16, 32 layers and three variants:

* ``eager``: no graphs (the eager GPU step);
* ``layers``: ``fastpath.cuda_graphs=true cuda_graphs.scope=layers`` -- Megatron's per-layer
  ``CudaGraphManager`` (``cuda_graphs.warmup_steps=0``: LoRA's rule);
* ``full_iteration``: ``cuda_graphs.scope=full_iteration`` -- the whole GPU step as two graphs.

The model: dense tiny GPT with LoRA (``fastpath.lora=true``, the MLPerf use case), fp32, hidden
64, 3 packed microbatches per step, 8 steps. The LAST step (steady state: every graph captured
long before) is counted with a ``TorchDispatchMode`` (+ a ``TorchFunctionMode`` to tell host
tensors from device ones, which the CUDA-as-CPU mode puts on the same CPU) entered around
``train_step`` for that step only:

* ``eager_ops_per_step``: aten ops that would each be a kernel launch on a GPU, issued outside
  any graph replay: ops reading or writing a device tensor. NOT counted: ops run inside
  ``FakeCUDAGraph.replay`` (one graph launch each replay instead), ops touching only host
  tensors (the host's packing: numpy-built boundary records, the pinned host buffers being
  filled -- CPU work on a GPU machine too), ops that launch no kernel on a GPU (``empty``-family
  allocations, views, ``_unsafe_view``, ``detach``, ``alias``, ``resize_``, ``set_``,
  ``lift_fresh``) and the host->device copies (counted apart: a DMA, not a kernel). Counted as
  device ops: device-to-device copies (Megatron's per-layer static-buffer copies), the
  collectives (gloo here, NCCL kernels on a GPU; DP = 1) and scalar factories in the backward;
* ``graph_launches_per_step``: ``FakeCUDAGraph.replay`` calls (each one ``cudaGraphLaunch``);
* ``launch_proxy = eager_ops + graph_launches``: the work items the host hands the GPU one by
  one -- the proxy for GPU launch overhead;
* ``h2d_copies_per_step``: host->device copies (``copy_`` from a host tensor into a device
  one, ``Tensor.to(cuda)`` / ``.cuda()`` of a host tensor);
* ``h2d_bytes_per_step``: the bytes of those host->device copies;
* ``d2d_copy_bytes_per_step``: bytes written by device-to-device ``copy_`` ops outside any
  replay (counted among the eager ops too): with per-layer graphs mostly Megatron's copies of
  each layer's inputs into the graph's static input buffers before a replay (0.19.2 skips the
  copy of an input whose buffer it may keep, ``can_skip_replay_copy``); with full-iteration
  graphs none (the inputs arrive by host->device copies into the static buffers);
* ``host_ms_per_step``: CPU wall time of ``train_step``, minimum over the steps after the last
  capture (steps 3..7, uncounted). It is CPU time of this stand-in run (which executes the
  graphs' ops on the CPU as well): it says nothing about a GPU's step time.

Host vs device: a tensor is a host tensor when it is a pinned host buffer of the step (the
cache slots' record staging, ``FullIterationStep.host``, ``PinnedStaging``), one of the data
loader's microbatch tensors, the output of a factory called without a CUDA device
(``torch.from_numpy``, ``torch.tensor(list)``, ``torch.zeros(n)``) or of an op whose tensor
inputs are all host tensors; everything else is a device tensor (what the job put on ``cuda``).

    python benchmarks/graph_launches.py --json benchmarks/results/graph_launches.json
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # load_meter
sys.path.insert(1, os.path.dirname(HERE))  # the repo root: tests.support's GPU stand-ins
from load_meter import LoadMeter, describe, publish  # noqa: E402
from text_table import text_table  # noqa: E402

LAYERS = (4, 16, 32)
MICRO_BATCHES = 3
STEPS = 8
TIMED = range(3, STEPS)  # steps after the last capture (full_iteration captures at step 2)
BASE = ["training.device=cuda", f"training.steps={STEPS}", f"training.micro_batches={MICRO_BATCHES}",
        "data.num_samples=160", "data.max_tokens=128", "data.max_len=48", "data.max_seqs=8",
        "model.hidden_size=64", "model.ffn_hidden_size=96", "training.warmup_steps=2",
        "training.sync_check=off",
        "training.skip_memory_check=true", "cluster.backend=gloo", "fastpath.linear_impl=local",
        "fastpath.lora=true", "lora.dropout=0.0"]
VARIANTS = {
    "eager": ["fastpath.cuda_graphs=false"],
    "layers": ["fastpath.cuda_graphs=true", "cuda_graphs.scope=layers", "cuda_graphs.warmup_steps=0",
               "cuda_graphs.use_te_rng_tracker=false"],
    "full_iteration": ["fastpath.cuda_graphs=true", "cuda_graphs.scope=full_iteration",
                       "cuda_graphs.use_te_rng_tracker=false"],
}
# aten ops that launch no kernel on a GPU (allocation, metadata, wrapping)
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
             "alias", "_unsafe_view", "_reshape_alias", "lift_fresh", "resize_", "set_"}


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare CUDA index


def _key(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _tensors(tree) -> list:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class LaunchCount:
    """What one step hands the device: eager kernel-launching ops outside graph replays, graph
    launches, host->device copies (see the module docstring for the rules)."""

    def __init__(self, host_tensors=()):
        self.keep = list(host_tensors)  # alive during the step: no storage address reused
        self.host = {_key(t) for t in self.keep} - {None}
        self.ops = collections.Counter()  # eager device ops by aten name
        self.host_ops = 0
        self.graph_launches = 0
        self.h2d = 0
        self.d2h = 0
        self.h2d_bytes = 0
        self.d2d_copy_bytes = 0  # device-to-device copy_ outside replays: graphs' static inputs
        self.in_replay = False
        self.context: list = []  # the function-level call being run: "host" / "device" / "h2d"

    @property
    def eager_ops(self) -> int:
        return sum(self.ops.values())

    def tag_host(self, tensors) -> None:
        for t in tensors:
            k = _key(t)
            if k is not None:
                self.host.add(k)
                self.keep.append(t)

    def is_host(self, t) -> bool:
        return _key(t) in self.host


class _Functions(TorchFunctionMode):
    """Seen before the CUDA-as-CPU mode rewrites ``device``: the target of factories and of
    ``.to`` / ``.cuda`` / ``.cpu``."""

    def __init__(self, count: LaunchCount):
        super().__init__()
        self.c = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if c.in_replay:
            return func(*args, **kwargs)
        ctx = None
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu) and isinstance(args[0], torch.Tensor):
            to_cuda = func is torch.Tensor.cuda or any(
                _is_cuda(a) for a in [*args[1:], kwargs.get("device")]
                if not isinstance(a, (torch.dtype, torch.Tensor)))
            src_host = c.is_host(args[0])
            if to_cuda and src_host:
                ctx = "h2d"
                c.h2d += 1
                c.h2d_bytes += _nbytes(args[0])
            elif (func is torch.Tensor.cpu or any(isinstance(a, (str, torch.device)) and not _is_cuda(a)
                                                  for a in [*args[1:], kwargs.get("device")])) and not src_host:
                ctx = "d2h"
                c.d2h += 1
        elif not _tensors((args, kwargs)):  # a factory: on the device only when told so
            device = kwargs.get("device")
            ctx = "device" if device is not None and _is_cuda(device) else "host"
        if ctx is None:
            return func(*args, **kwargs)
        c.context.append(ctx)
        try:
            out = func(*args, **kwargs)
        finally:
            c.context.pop()
        if ctx in ("host", "d2h"):
            c.tag_host(_tensors(out))
        elif ctx == "h2d":
            for t in _tensors(out):
                if t is not args[0]:
                    c.host.discard(_key(t))
        return out


class _Ops(TorchDispatchMode):
    def __init__(self, count: LaunchCount):
        super().__init__()
        self.c = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.c
        if c.in_replay:
            return out
        ctx = c.context[-1] if c.context else None
        name = func.overloadpacket.__name__
        if ctx in ("h2d", "d2h"):  # the copy itself, counted at the function level
            return out
        ins = _tensors((args, kwargs))
        if not ins:
            if ctx == "host":
                c.tag_host(_tensors(out))
                c.host_ops += 1
                return out
        else:
            host_in = [c.is_host(t) for t in ins]
            if all(host_in):
                c.tag_host(_tensors(out))
                c.host_ops += 1
                return out
            if name == "copy_" and not c.is_host(args[0]) and c.is_host(args[1]):
                c.h2d += 1
                c.h2d_bytes += _nbytes(args[0])
                return out
            if name == "copy_" and c.is_host(args[0]):
                c.d2h += 1
                return out
        if func.is_view or name in NO_KERNEL:
            return out
        if name == "copy_":
            c.d2d_copy_bytes += _nbytes(args[0])
        c.ops[name] += 1
        return out


def _counting_replay(real, state):
    def replay(graph):
        c = state.get("count")
        if c is None:
            return real(graph)
        c.graph_launches += 1
        c.in_replay = True
        try:
            return real(graph)
        finally:
            c.in_replay = False

    return replay


def _host_tensors(job, batch) -> list:
    """The step's host tensors that exist before it: the loader's microbatch tensors and the
    pinned host buffers (the cache slots' record staging; the microbatch staging of the eager /
    per-layer step, the full-iteration step's input sets)."""
    out = []
    for mb in batch.microbatches:
        out += [v for v in vars(mb).values() if isinstance(v, torch.Tensor)]
    staging = getattr(job.step, "staging", None)
    if staging is not None:
        out += _tensors([getattr(staging, k, None) for k in vars(staging)])
    out += [slot.staging_R for slot in job.cache.slots]  # each slot's pinned boundary record
    graphs = getattr(job.step, "graphs", None)
    if graphs is not None:
        for h in graphs.host:
            out += [h.ids_N2T, h.mask_NT, h.scale_N, h.lengths_NS]
    return out


def measure(layers: int, variant: str, steps: int = STEPS, timed=TIMED) -> dict:
    """One main-job run of ``steps`` steps; its last step counted, ``timed`` steps timed."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    import megatron_fastpath.train as train_mod
    from megatron_fastpath.train import loop as train_loop
    from tests.support.fake_cuda_graph import FakeCUDAGraph
    from tests.support.graph_safe_standins import gpu_standins
    from tests.support.hydra_compose import compose_job

    real_step, real_from_numpy = train_loop.train_step, torch.from_numpy
    state: dict = {}
    times: dict = {}

    def train_step(job, batch, **kwargs):
        if batch.step != steps:
            t0 = time.perf_counter()
            result = real_step(job, batch, **kwargs)
            times[batch.step] = time.perf_counter() - t0
            return result
        count = LaunchCount(_host_tensors(job, batch))
        state["count"] = count

        def from_numpy(array):  # not a torch function a TorchFunctionMode sees
            t = real_from_numpy(array)
            count.tag_host([t])
            return t

        try:
            with _Functions(count), _Ops(count), mock.patch.object(torch, "from_numpy", from_numpy):
                return real_step(job, batch, **kwargs)
        finally:
            state.pop("count")
            state["last"] = count

    overrides = BASE + [f"training.steps={steps}", f"model.num_layers={layers}"] + VARIANTS[variant]
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # as a fresh process
    get_cuda_rng_tracker().reset()
    t0 = time.perf_counter()
    with gpu_standins(), \
            mock.patch.object(train_loop, "train_step", train_step), \
            mock.patch.object(FakeCUDAGraph, "replay", _counting_replay(FakeCUDAGraph.replay, state)):
        summary = train_mod.run(compose_job(overrides), announce=False)
    wall = time.perf_counter() - t0
    c = state["last"]
    assert len(summary.records) == steps
    return dict(
        layers=layers, variant=variant, micro_batches=MICRO_BATCHES,
        eager_ops_per_step=c.eager_ops, graph_launches_per_step=c.graph_launches,
        launch_proxy=c.eager_ops + c.graph_launches, h2d_copies_per_step=c.h2d,
        d2h_copies_per_step=c.d2h, h2d_bytes_per_step=c.h2d_bytes,
        d2d_copy_bytes_per_step=c.d2d_copy_bytes, host_only_ops_per_step=c.host_ops,
        host_ms_per_step=round(min(times[s] for s in timed) * 1e3, 2),
        recorded_graph_launches=summary.records[-1].graph_launches,
        last_loss=summary.records[-1].loss,
        eager_ops_by_name=dict(c.ops.most_common()),
        run_seconds=round(wall, 1),
    )


def _table(rows: list) -> str:
    cols = ["L", "variant", "eager ops", "graph launches", "eager+launches", "h2d copies",
            "host ms (min)", "layers/this", "eager/this"]
    by = {(r["layers"], r["variant"]): r for r in rows}
    cells = []
    for r in rows:
        lay, eag = by[(r["layers"], "layers")], by[(r["layers"], "eager")]
        cells.append([str(r["layers"]), r["variant"], str(r["eager_ops_per_step"]),
                      str(r["graph_launches_per_step"]), str(r["launch_proxy"]),
                      str(r["h2d_copies_per_step"]), f"{r['host_ms_per_step']:.1f}",
                      f"{lay['launch_proxy'] / r['launch_proxy']:.2f}",
                      f"{eag['launch_proxy'] / r['launch_proxy']:.2f}"])
    return text_table(cols, cells)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=list(LAYERS))
    p.add_argument("--json", type=Path, default=None, help="write results here (and .txt beside)")
    args = p.parse_args(argv)

    from megatron_fastpath.distributed import init_distributed

    torch.manual_seed(0)
    with LoadMeter() as meter:
        init_distributed(backend="gloo")
        rows = [measure(L, v) for L in args.layers for v in VARIANTS]
    for L in args.layers:
        by = {r["variant"]: r for r in rows if r["layers"] == L}
        ratio = by["layers"]["launch_proxy"] / by["full_iteration"]["launch_proxy"]
        for r in by.values():
            r["layers_over_this"] = round(by["layers"]["launch_proxy"] / r["launch_proxy"], 3)
            r["eager_over_this"] = round(by["eager"]["launch_proxy"] / r["launch_proxy"], 3)
        by["full_iteration"]["layers_over_full_iteration"] = round(ratio, 3)
    env = dict(torch=torch.__version__, torch_threads=torch.get_num_threads(), **meter.report())
    text = "\n".join([
        _table(rows), "",
        "counted: the last (steady-state) step; eager ops = aten ops touching a device tensor that "
        "launch a kernel on a GPU, outside graph replays; each replay = 1 graph launch",
        "ratio: layers/this = (eager ops + graph launches) of scope=layers / this row's "
        "(> 1 on the full_iteration rows: full-iteration graphs launch fewer)",
        "host ms: CPU time of a step in this stand-in run (graphs' ops run on the CPU too): "
        "nothing about a GPU",
        describe(env)])
    return publish(args, env, rows, text)


if __name__ == "__main__":
    main()
