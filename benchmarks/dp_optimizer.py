"""Data parallelism at DP 2: bytes on the wire, collectives, optimizer state and step time of
the plain data-parallel optimizer vs Megatron's distributed optimizer (ZeRO-1), overlap on / off.

The main job (``python -m megatron_fastpath.train``) under ``torchrun --nproc_per_node=2``
(gloo, CPU) on the GPU step path inside the GPU stand-ins (CUDA-as-CPU: Megatron's real DDP,
optimizer and schedule), as ``tests/train/test_distributed_optimizer_torchrun.py`` runs it, all
variants one after the other in one launch:

* ``plain``: ``parallel.distributed_optimizer=false`` -- DDP all-reduces the fp32 gradient buffer,
  every rank updates every parameter (Adam moments of all parameters on each rank);
* ``dist``: ``parallel.distributed_optimizer=true``, no overlap -- the gradients reduce-scattered,
  each rank updates its half, the parameters all-gathered in the optimizer step;
* ``dist-overlap``: the same with ``parallel.overlap_grad_reduce=true
  parallel.overlap_param_gather=true parallel.bucket_size=BUCKET`` -- several buckets, each
  reduce-scattered from its backward hook, each gathered in the next forward's pre-hook.

Model: a dense tiny GPT (``model=tiny_dense``: 4 layers, hidden 256, FFN 704, vocab 256, fp32),
full fine-tune (every parameter in DDP's buckets), 2 packed microbatches of 128 tokens per rank
per step; the same in bf16 (``training.dtype=bfloat16``: fp32 main parameters in the optimizer,
the gradients reduced in fp32, the bf16 parameters gathered); and the fp32 model with LoRA (only
the adapters in the buckets).

Per variant, measured on each rank:

* the last two steps (steady state) counted with a ``TorchDispatchMode``: every ``c10d`` op the
  step issues (``torch.ops.c10d.allreduce_`` / ``_reduce_scatter_base_`` / ``_allgather_base_``:
  torch.distributed's collectives pass through the dispatcher, so the mode sees gloo's as it
  would NCCL's), by kind: count and payload bytes (all-reduce: the tensor; reduce-scatter: the
  full input; all-gather: the full output). Only ``train_step`` is counted (the loop's logging
  and the end-of-run export are not part of a step);
* ``wire_bytes``: what a ring moves per rank at DP n: all-reduce 2(n-1)/n x payload,
  reduce-scatter and all-gather (n-1)/n x payload each;
* ``expected``: from DDP's buffers -- plain: all-reduce of the grad buffers (4 B x their
  elements), distributed: reduce-scatter of the grad buffers + all-gather of the param buffers;
  the buffers' elements are the trainable parameters plus Megatron's alignment padding
  (``buffer_padding``); the counted bulk bytes must equal these exactly;
* ``optimizer_state_bytes``: the optimizer's state tensors on this rank (Adam's two moments);
  ``main_param_bytes``: main-parameter copies it holds apart from the model's storage (none at
  fp32: the distributed optimizer's shards are views of the parameter buffer);
* ``host_ms_per_step``: wall time of ``train_step``, minimum over the steps between the first two
  and the counted two (uncounted) of ROUNDS runs of each variant (the variants in turn, all in
  the one launch), the larger of the two ranks' minima. CPU time of a stand-in run on this
  machine (2 processes of one thread on 2 cores): nothing about a GPU's step time.

    python benchmarks/dp_optimizer.py --publish   # results/dp_optimizer[_mcore<version>].json
    python benchmarks/dp_optimizer.py --quick     # the test's small run
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # load_meter, text_table
sys.path.insert(1, REPO)  # tests.support: the GPU stand-ins, the main job's launch helpers
from load_meter import LoadMeter, describe, publish, results_name  # noqa: E402
from text_table import text_table  # noqa: E402

DP = 2
STEPS, QUICK_STEPS = 12, 5
BUCKET = 200_000  # elements: several buckets for the overlapped reduce / gather
QUICK_BUCKET = 4096
LORA_BUCKET = 16_384  # the adapters: 81,920 elements
ROUNDS = 2  # every variant run this often, the rounds in turn: min over all their timed steps
MODEL = ["model=tiny_dense", "model.num_layers=4", "model.hidden_size=256",
         "model.ffn_hidden_size=704"]
QUICK_MODEL = ["model=tiny_dense", "model.num_layers=2", "model.hidden_size=64",
               "model.ffn_hidden_size=96"]
COMMON = ["data.num_samples=256", "data.max_tokens=128", "data.max_len=48", "data.max_seqs=8",
          "training.micro_batches=2", "training.device=cuda", "training.skip_memory_check=true",
          "cluster.backend=gloo", "training.sync_check=off", "training.optimizer_step=sync_free",
          "training.warmup_steps=2"]
PLAIN = ["parallel.distributed_optimizer=false", "parallel.overlap_grad_reduce=false",
         "parallel.overlap_param_gather=false"]
DIST = ["parallel.distributed_optimizer=true", "parallel.overlap_grad_reduce=false",
        "parallel.overlap_param_gather=false"]
LORA = ["fastpath.lora=true", "lora.dropout=0.0"]
BF16 = ["training.dtype=bfloat16"]


def _overlap(bucket: int) -> list:
    return ["parallel.distributed_optimizer=true", "parallel.overlap_grad_reduce=true",
            "parallel.overlap_param_gather=true", f"parallel.bucket_size={bucket}"]


def variants(quick: bool) -> dict:
    bucket = QUICK_BUCKET if quick else BUCKET
    out = {("full", "plain"): PLAIN, ("full", "dist"): DIST, ("full", "dist-overlap"): _overlap(bucket),
           ("full-bf16", "plain"): BF16 + PLAIN, ("full-bf16", "dist"): BF16 + DIST}
    if not quick:
        out[("full-bf16", "dist-overlap")] = BF16 + _overlap(BUCKET)
        out.update({("lora", "plain"): LORA + PLAIN, ("lora", "dist"): LORA + DIST,
                    ("lora", "dist-overlap"): LORA + _overlap(LORA_BUCKET)})
    return out


# ---------------------------------------------------------------------------------------------
# the worker (each torchrun rank)

KINDS = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
         "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
         "reduce_scatter_tensor_coalesced_": "reduce_scatter",
         "_allgather_base_": "all_gather", "allgather_": "all_gather",
         "allgather_into_tensor_coalesced_": "all_gather"}
# payloads of at most this many bytes are the step's scalars (gradient norm, loss): not bulk
SCALAR_BYTES = 256


def _nbytes(x) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def _dtype(args) -> str:
    import torch

    from torch.utils._pytree import tree_flatten

    ts = [t for t in tree_flatten(list(args[:2]))[0] if isinstance(t, torch.Tensor)]
    return str(ts[0].dtype).removeprefix("torch.") if ts else "?"


def _group_size(args) -> int | None:
    """The size of the process group a c10d op runs on (its ``ProcessGroup`` argument, boxed)."""
    import torch
    import torch.distributed as dist

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except (RuntimeError, TypeError):  # the reduce op, another boxed object
                continue
    return None


def _site() -> str:
    """The innermost caller in megatron / megatron_fastpath: ``package/file.py:line function``."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        f = frame.filename.replace(os.sep, "/")
        for pkg in ("/megatron_fastpath/", "/megatron/core/"):
            if pkg in f:
                return f"{pkg.strip('/')}/{f.split(pkg, 1)[1]}:{frame.lineno} {frame.name}"
    return "?"


class CollectiveCount:
    """The c10d ops one step issues: ``kinds[kind] = [count, bytes]`` over groups of more than
    one rank, ``bulk`` (payloads over SCALAR_BYTES) and ``scalars`` likewise,
    ``group_of_one`` (ops on a one-rank group: no bytes move), ``other`` ops by name."""

    def __init__(self):
        self.kinds = collections.defaultdict(lambda: [0, 0])
        self.bulk = collections.defaultdict(lambda: [0, 0])
        self.scalars = collections.defaultdict(lambda: [0, 0])
        self.other = collections.Counter()
        self.sites = collections.Counter()  # (kind, payload bytes, dtype, calling site, group size)
        self.group_of_one = collections.defaultdict(lambda: [0, 0])

    def add(self, name: str, args) -> None:
        kind = KINDS.get(name)
        if kind is None:
            self.other[name] += 1
            return
        # all-reduce: the tensor(s); reduce-scatter: the full input; all-gather: the full output
        payload = _nbytes(args[0]) if kind == "all_reduce" else max(_nbytes(args[0]), _nbytes(args[1]))
        size = _group_size(args)
        self.sites[(kind, payload, _dtype(args), _site(), size)] += 1
        if size == 1:  # a group of one rank (e.g. the TP group at TP 1): nothing moves
            self.group_of_one[kind][0] += 1
            self.group_of_one[kind][1] += payload
            return
        for into in (self.kinds, self.bulk if payload > SCALAR_BYTES else self.scalars):
            into[kind][0] += 1
            into[kind][1] += payload

    def as_dict(self) -> dict:
        return {"by_kind": {k: {"count": c, "bytes": b} for k, (c, b) in sorted(self.kinds.items())},
                "bulk": {k: {"count": c, "bytes": b} for k, (c, b) in sorted(self.bulk.items())},
                "scalars": {k: {"count": c, "bytes": b} for k, (c, b) in sorted(self.scalars.items())},
                "group_of_one": {k: {"count": c, "bytes": b}
                                 for k, (c, b) in sorted(self.group_of_one.items())},
                "other_ops": dict(self.other),
                "sites": [dict(kind=k, bytes=b, dtype=d, site=s, group_size=g, count=n)
                          for (k, b, d, s, g), n in sorted(self.sites.items())]}


def _counting_mode(count: CollectiveCount):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                count.add(func.overloadpacket.__name__, args)
            return func(*args, **(kwargs or {}))

    return Collectives()


def _ddps(job) -> list:
    """Megatron's DDP around the model: the owner of the ``no_sync_func`` the step wires into
    the model's config (train/step.py megatron_ddp_and_optimizer)."""
    return [job.model.config.no_sync_func.__self__]


def _buffers(job) -> list:
    out = []
    for ddp in _ddps(job):
        out += list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))
    return out


def optimizer_state(job) -> dict:
    """Bytes the optimizer holds on this rank: its state tensors (Adam's moments) and main
    parameters that are not views of the model's storage."""
    import torch

    opt = job.step.optimizer
    leaves = getattr(opt, "leaves", None) or [opt]
    model_storages = {p.untyped_storage().data_ptr() for p in job.model.parameters()}
    for buf in _buffers(job):
        for t in (buf.param_data, buf.grad_data):
            if t is not None:
                model_storages.add(t.untyped_storage().data_ptr())
    state = main = updated = 0
    for leaf in leaves:
        inner = leaf.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                updated += p.numel()
                if p.untyped_storage().data_ptr() not in model_storages:
                    main += p.numel() * p.element_size()
                for v in inner.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and v.numel() > 1:
                        state += v.numel() * v.element_size()
    return {"optimizer_state_bytes": state, "main_param_bytes": main,
            "updated_elements": updated, "leaves": [type(leaf).__name__ for leaf in leaves]}


def expected(job, distributed: bool) -> dict:
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in _buffers(job))
    params = sum(b.param_data.numel() * b.param_data.element_size()
                 for b in _buffers(job) if b.param_data is not None)
    return ({"reduce_scatter": grads, "all_gather": params} if distributed
            else {"all_reduce": grads})


def run_variant(overrides: list, steps: int) -> dict:
    """One main-job run of ``steps`` steps on this rank: its last two steps counted, the steps
    from 3 to ``steps - 2`` timed."""
    from megatron_fastpath.train import loop as train_loop
    from tests.support.hydra_compose import compose_job
    from tests.support.main_job import train_in_standins

    real_step = train_loop.train_step
    counted = (steps - 1, steps)
    times, counts = {}, {}

    def train_step(job, batch, **kwargs):
        if batch.step in counted:
            count = CollectiveCount()
            with _counting_mode(count):
                result = real_step(job, batch, **kwargs)
            counts[batch.step] = count.as_dict()
            return result
        t0 = time.perf_counter()
        result = real_step(job, batch, **kwargs)
        times[batch.step] = time.perf_counter() - t0
        return result

    summary, job = train_in_standins(compose_job(overrides + [f"training.steps={steps}"]),
                                     patches=[mock.patch.object(train_loop, "train_step", train_step)])
    assert len(summary.records) == steps
    ddp = _ddps(job)[0]
    cfg = ddp.ddp_config
    trainable = sum(p.numel() for p in job.model.parameters() if p.requires_grad)
    buffer_elements = sum(b.grad_data.numel() for b in _buffers(job))
    out = dict(
        trainable_params=trainable, buffer_elements=buffer_elements,
        buffer_padding=buffer_elements - trainable,
        buckets=sum(len(d.bucket_groups) for d in _ddps(job)),
        distributed_optimizer=cfg.use_distributed_optimizer,
        overlap_grad_reduce=cfg.overlap_grad_reduce, overlap_param_gather=cfg.overlap_param_gather,
        bucket_size=cfg.bucket_size,
        collectives=[counts[s] for s in counted],
        expected=expected(job, cfg.use_distributed_optimizer),
        step_ms=[round(times[s] * 1e3, 2) for s in sorted(times)],
        last_loss=summary.records[-1].loss,
        **optimizer_state(job))
    del job
    return out


def worker(spec: str, out: str) -> None:
    from tests.support.matrix_runs import frozen_heap

    rank = int(os.environ.get("RANK", "0"))
    items = json.loads(Path(spec).read_text())
    rows = []
    with frozen_heap() as settle:
        for item in items["runs"]:
            rows.append({"model": item["model"], "variant": item["variant"],
                         **run_variant(items["common"] + item["overrides"], items["steps"])})
            settle()
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))


# ---------------------------------------------------------------------------------------------
# the launcher


def _summarise(runs0: list, runs1: list, timed: int) -> dict:
    """One row from the two ranks' runs of a variant (one per round): the counts (equal on both
    ranks, in both counted steps and in every round: checked), the larger of the two ranks'
    minimum step times over all rounds."""
    r0, r1 = runs0[0], runs1[0]
    for run in runs0 + runs1:
        assert run["collectives"] == r0["collectives"], (r0["variant"], run["collectives"], r0["collectives"])
    first, second = r0["collectives"]
    assert first == second, (r0["variant"], "the two counted steps differ", first, second)
    ms0 = [t for run in runs0 for t in run["step_ms"]]
    ms1 = [t for run in runs1 for t in run["step_ms"]]
    bulk = {k: v["bytes"] for k, v in first["bulk"].items()}
    wire = sum(v["bytes"] * (2 if k == "all_reduce" else 1) * (DP - 1) / DP
               for k, v in first["by_kind"].items())
    row = {k: r0[k] for k in ("model", "variant", "trainable_params", "buffer_elements",
                              "buffer_padding", "buckets", "distributed_optimizer",
                              "overlap_grad_reduce", "overlap_param_gather", "bucket_size",
                              "expected", "leaves", "last_loss")}
    row.update(
        collectives_per_step=first,
        count_per_step={k: v["count"] for k, v in first["by_kind"].items()},
        bytes_per_step={k: v["bytes"] for k, v in first["by_kind"].items()},
        bulk_bytes_per_step=bulk, bulk_equals_expected=bulk == r0["expected"],
        payload_bytes_per_step=sum(v["bytes"] for v in first["by_kind"].values()),
        wire_bytes_per_step=int(wire),
        four_bytes_times_params=4 * r0["trainable_params"],
        optimizer_state_bytes=[r0["optimizer_state_bytes"], r1["optimizer_state_bytes"]],
        main_param_bytes=[r0["main_param_bytes"], r1["main_param_bytes"]],
        updated_elements=[r0["updated_elements"], r1["updated_elements"]],
        host_ms_per_step=max(min(ms0), min(ms1)), host_ms_per_rank=[min(ms0), min(ms1)],
        host_ms_median_per_rank=[statistics.median(ms0), statistics.median(ms1)],
        rounds=len(runs0), timed_steps_per_round=timed,
        last_loss_per_round=[run["last_loss"] for run in runs0])
    return row


def launch(quick: bool) -> list:
    from tests.support.main_job import job_env, main_job_cmd

    steps = QUICK_STEPS if quick else STEPS
    rounds = 1 if quick else ROUNDS
    runs = [{"model": m, "variant": v, "overrides": (QUICK_MODEL if quick else MODEL) + o}
            for _ in range(rounds) for (m, v), o in variants(quick).items()]
    with tempfile.TemporaryDirectory(prefix="dp_optimizer-") as tmp:
        spec = Path(tmp, "spec.json")
        spec.write_text(json.dumps({"runs": runs, "common": COMMON, "steps": steps}))
        cmd = main_job_cmd([], nproc=DP, entry=[os.path.abspath(__file__), "--worker", str(spec), tmp])
        proc = subprocess.run(cmd, cwd=tmp, env=job_env(), capture_output=True, text=True,
                              timeout=3000)
        if proc.returncode != 0:
            raise RuntimeError(f"the DP {DP} launch failed:\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(DP)]
    by = collections.defaultdict(lambda: ([], []))
    for rank, rows in enumerate(ranks):
        for row in rows:
            by[(row["model"], row["variant"])][rank].append(row)
    return [_summarise(*by[key], steps - 4) for key in variants(quick)]


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table_cells(rows: list) -> tuple:
    cols = ["model", "variant", "buckets", "all-reduce n / MiB", "reduce-scatter n / MiB",
            "all-gather n / MiB", "wire MiB / rank", "= expected", "optimizer state MiB / rank",
            "host ms / step (min)"]
    cells = []
    for r in rows:
        by = r["collectives_per_step"]["by_kind"]
        kinds = [f"{by[k]['count']} / {_mb(by[k]['bytes'])}" if k in by else "0"
                 for k in ("all_reduce", "reduce_scatter", "all_gather")]
        cells.append([r["model"], r["variant"], str(r["buckets"]), *kinds,
                      _mb(r["wire_bytes_per_step"]), "yes" if r["bulk_equals_expected"] else "NO",
                      " / ".join(_mb(a + b) for a, b in zip(r["optimizer_state_bytes"],
                                                             r["main_param_bytes"])),
                      f"{r['host_ms_per_step']:.1f}"])
    return cols, cells


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="the small model, 5 steps, one round, no LoRA or bf16 overlap rows")
    p.add_argument("--json", type=Path, default=None, help="write results here (and .txt beside)")
    p.add_argument("--publish", action="store_true",
                   help="write benchmarks/results/<results_name('dp_optimizer')> (and .txt)")
    args = p.parse_args(argv)
    if args.publish:
        args.json = Path(HERE, "results", results_name("dp_optimizer"))
    import torch

    with LoadMeter() as meter:
        rows = launch(args.quick)
    env = dict(torch=torch.__version__, dp=DP, backend="gloo", processes_threads=1, **meter.report())
    cols, cells = table_cells(rows)
    text = "\n".join([
        text_table(cols, cells), "",
        "counted: the c10d ops of the last two steps (equal), per rank; n / MiB = collectives "
        "per step / their payload; wire = a ring's bytes per rank (all-reduce 2(n-1)/n, "
        "reduce-scatter and all-gather (n-1)/n of the payload); = expected: the bulk collectives "
        "equal DDP's grad (and param) buffers' bytes",
        "optimizer state: Adam's moments + the fp32 main parameters apart from the model's "
        "storage (bf16 rows), rank 0 / rank 1",
        "host ms: CPU wall time of a step of this stand-in run (2 processes, 1 thread each, gloo): "
        "nothing about a GPU", describe(env)])
    return publish(args, env, rows, text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
