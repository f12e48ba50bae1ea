"""The output layer + cross-entropy of one microbatch, forward and backward: peak memory and time
of ``megatron_fastpath.loss.linear_cross_entropy`` (chunked over tokens, no ``[T, V/TP]`` logits)
vs Megatron's path on the full logits vs transformers' Llama loss.

Sides (the same hidden ``[S=T, B=1, H]``, output weight ``[V/TP, H]``, labels, float32; the
gradient of ``(loss * mask).sum() / mask.sum()`` with a third of the tokens masked, as the train
step's loss; the hidden and the weight both take a gradient, or with ``--frozen`` the hidden
only, as under LoRA):

* ``ours``: ``linear_cross_entropy(hidden, weight, labels, tp_group=...)``, the default chunk rule
  (``chunk_rows``: float32 chunk logits of at most 256 MiB);
* ``megatron``: what GPTModel runs: the output layer's ``copy_to_tensor_model_parallel_region`` +
  ``F.linear`` (``ColumnParallelLinear``'s forward on this path, without its CUDA-only buffers),
  then ``compute_language_model_loss``'s transposes around
  ``tensor_parallel.vocab_parallel_cross_entropy``;
* ``transformers`` (TP 1 only: it has no vocabulary split): ``F.linear`` as ``lm_head``, then
  ``LlamaForCausalLM``'s ``loss_function`` (``transformers.loss.loss_utils.ForCausalLMLoss``: its
  own label shift, masked tokens as ``ignore_index``, mean over the rest).

Measured per side, per shape, in one spawned process per rank (TP 1: one of 2 threads; TP 2: two
processes of one thread, gloo), the sides alternating, ``--repeats`` rounds:

* memory: torch.profiler with ``profile_memory=True`` on the first round; every allocation and
  free torch's CPU allocator reports (``[memory]`` events, in time order) summed: ``peak_bytes``
  is the highest total of bytes allocated inside the region and not yet freed, above what was
  live before it (inputs and weights made before are not counted, the gradients made in it
  are), ``allocated_bytes`` the sum of every allocation in it. This counts tensors, not the
  malloc heap: it is what a caching GPU allocator would have to hold, independent of glibc.
  ``copies`` = ``peak_bytes`` / (T x V/TP x 4), the float32 logits' size;
* time: wall time of forward + backward, the minimum over the rounds (the profiled one too: the
  profiler adds microseconds per op, the ops here take milliseconds);
* where a side's estimated peak (its ``copies`` at the largest shape it ran at this V, else
  ``APRIORI_COPIES``, times T x V/TP x 4, times the ranks) exceeds ``--max-gib`` it is not run:
  the row holds the estimate (``estimated_peak_bytes``) and ``measured: false``.

H is small (``--hidden 64``) so the grid runs on a 2-core CPU: the logits' memory, what this
compares, does not depend on H; the times weigh the elementwise passes over [T, V] more than a
GPU at a Llama H would (there the GEMMs dominate and recomputing the logits in backward costs one
GEMM of four). The CPU times say nothing about a GPU's.

    python benchmarks/linear_cross_entropy.py --publish      # results/linear_cross_entropy[_mcore<v>].json + .txt
    python benchmarks/linear_cross_entropy.py --publish --frozen --tp 1 --tokens 2048 16384 --vocabs 128256
                                                             # results/linear_cross_entropy_frozen[...].json
    python benchmarks/linear_cross_entropy.py --quick --json out.json   # the test's tiny grid
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # load_meter, text_table
from load_meter import LoadMeter, describe, publish, results_name, write_results  # noqa: E402
from text_table import text_table  # noqa: E402

TOKENS = (2048, 8192, 16384, 32768)
VOCABS = (32000, 128256)
QUICK_TOKENS, QUICK_VOCABS, QUICK_HIDDEN = (96, 200), (512, 1024), 16
SIDES = ("ours", "megatron", "transformers")
APRIORI_COPIES = {"ours": 0.5, "megatron": 1.5, "transformers": 3.5}  # before a side has run


def _inputs(T, V, H, tp, rank):
    import torch

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, 1, H, generator=g)
    weight = (torch.randn(V, H, generator=g) * H ** -0.5)[rank * V // tp:(rank + 1) * V // tp].contiguous()
    labels = torch.randint(0, V, (1, T), generator=g)
    mask = (torch.rand(1, T, generator=g) > 0.33).float()
    return hidden, weight, labels, mask


def _run_side(side, hidden, weight, labels, mask, group, frozen=False):
    """Forward + backward of one side; returns the per-token loss (or None: transformers' is
    the mean) and the gradients (the weight's None when ``frozen``)."""
    import torch
    from megatron.core import tensor_parallel

    from megatron_fastpath.loss import linear_cross_entropy

    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(not frozen)
    if side == "ours":
        loss = linear_cross_entropy(h, w, labels, tp_group=group)
        total = (loss * mask).sum() / mask.sum()
    elif side == "megatron":
        h_in = tensor_parallel.copy_to_tensor_model_parallel_region(h, group=group) if group is not None else h
        logits = torch.nn.functional.linear(h_in, w)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
        loss = loss.transpose(0, 1).contiguous()
        del logits
        total = (loss * mask).sum() / mask.sum()
    else:
        from transformers.loss.loss_utils import ForCausalLMLoss

        logits = torch.nn.functional.linear(h.transpose(0, 1), w)  # lm_head: [B, S, V]
        ignored = torch.where(mask > 0, labels, torch.full_like(labels, -100))
        total = ForCausalLMLoss(logits, ignored, vocab_size=w.size(0))
        del logits
        loss = None
    total.backward()
    return (loss.detach() if loss is not None else None), h.grad, w.grad


def _profiled_peak(fn):
    """(peak bytes above the start, bytes allocated) over ``fn()`` from torch.profiler's
    allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = allocated = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
        allocated += max(n, 0)
    return peak, allocated


def run_grid(grid: dict, rank: int, tp: int, group) -> list:
    """Every (T, V) of ``grid`` on this rank, the sides alternating each round."""
    import gc

    import torch

    from megatron_fastpath.loss import chunk_rows

    rows = []
    largest = {}  # (side, V) -> copies at the largest T measured
    sides = [s for s in SIDES if tp == 1 or s != "transformers"]
    for V in grid["vocabs"]:
        for T in grid["tokens"]:
            vp = V // tp
            logits_bytes = T * vp * 4
            hidden, weight, labels, mask = _inputs(T, V, grid["hidden"], tp, rank)
            todo = {}
            for side in sides:
                copies = largest.get((side, V), APRIORI_COPIES[side])
                est = int(copies * logits_bytes + 4 * T * grid["hidden"] * 4)
                todo[side] = (est * tp <= grid["max_gib"] * 2**30, est)
            res = {s: {"ms": []} for s in sides}
            for rnd in range(grid["repeats"]):
                for side in sides:
                    if not todo[side][0]:
                        continue
                    gc.collect()
                    out = {}

                    def once(side=side, out=out):
                        t0 = time.perf_counter()
                        out["r"] = _run_side(side, hidden, weight, labels, mask, group, grid["frozen"])
                        out["ms"] = (time.perf_counter() - t0) * 1e3

                    if rnd == 0:
                        res[side]["peak"], res[side]["allocated"] = _profiled_peak(once)
                        loss = out["r"][0]
                        res[side]["loss"] = loss
                    else:
                        once()
                    res[side]["ms"].append(out["ms"])
                    del out
            ref = res.get("megatron", {}).get("loss")
            for side in sides:
                r = res[side]
                row = dict(tp=tp, tokens=T, vocab=V, vocab_per_rank=vp, hidden=grid["hidden"], side=side,
                           frozen_weight=grid["frozen"], measured=todo[side][0], logits_bytes=logits_bytes)
                if side == "ours":
                    c = chunk_rows(T, vp)
                    row.update(chunk_rows=c, chunks=-(-T // c))
                if todo[side][0]:
                    row.update(peak_bytes=r["peak"], allocated_bytes=r["allocated"],
                               copies=round(r["peak"] / logits_bytes, 3), ms=round(min(r["ms"]), 2),
                               ms_runs=[round(m, 2) for m in r["ms"]])
                    largest[(side, V)] = r["peak"] / logits_bytes
                    if side == "ours" and ref is not None:
                        row["loss_max_abs_diff_vs_megatron"] = float((r["loss"] - ref).abs().max())
                else:
                    row.update(estimated_peak_bytes=todo[side][1])
                rows.append(row)
            del hidden, weight, labels, mask, res
            if rank == 0:
                print(f"TP {tp}: T={T} V={V} done", flush=True)
    return rows


def _rank_main(rank: int, tp: int, port: int, grid: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(tp), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(grid["threads"])
    from megatron.core import parallel_state as ps

    from megatron_fastpath.distributed import destroy_distributed, init_distributed

    init_distributed(backend="gloo", tensor_model_parallel_size=tp)
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    rows = run_grid(grid, rank, tp, group)
    Path(out, f"tp{tp}.rank{rank}.json").write_text(json.dumps(rows))
    destroy_distributed()


def launch(tp: int, grid: dict) -> list:
    """The grid at TP ``tp``: ``tp`` spawned processes (gloo); rank 0's rows, the time the larger
    of the ranks' minima."""
    import torch.multiprocessing as mp

    sys.path.insert(1, REPO)
    from tests.support.subproc import free_port

    with tempfile.TemporaryDirectory(prefix="lce-") as tmp:
        mp.spawn(_rank_main, args=(tp, free_port(), dict(grid, threads=grid["threads"] if tp == 1 else 1), tmp),
                 nprocs=tp, join=True)
        ranks = [json.loads(Path(tmp, f"tp{tp}.rank{r}.json").read_text()) for r in range(tp)]
    rows = ranks[0]
    for i, row in enumerate(rows):
        if row["measured"]:
            row["ms_per_rank"] = [rk[i]["ms"] for rk in ranks]
            row["ms"] = max(row["ms_per_rank"])
            row["peak_bytes_per_rank"] = [rk[i]["peak_bytes"] for rk in ranks]
    return rows


def _mib(n) -> str:
    return f"{n / 2**20:,.1f}"


def table_cells(rows: list) -> tuple:
    cols = ["TP", "T", "V", "side", "peak MiB / rank", "copies of [T, V/TP] f32", "allocated MiB",
            "fwd+bwd ms (min)", "megatron / this: peak", "megatron / this: time"]
    by = {(r["tp"], r["tokens"], r["vocab"], r["side"]): r for r in rows}
    cells = []
    for r in rows:
        m = by.get((r["tp"], r["tokens"], r["vocab"], "megatron"))
        peak = r.get("peak_bytes", r.get("estimated_peak_bytes"))
        mpeak = None if m is None else m.get("peak_bytes", m.get("estimated_peak_bytes"))
        ratio_mem = "" if mpeak is None else f"{mpeak / peak:.2f}" + ("" if r["measured"] and m["measured"] else " (est)")
        ratio_t = f"{m['ms'] / r['ms']:.2f}" if r["measured"] and m is not None and m["measured"] else ""
        cells.append([str(r["tp"]), str(r["tokens"]), str(r["vocab"]), r["side"],
                      _mib(peak) + ("" if r["measured"] else " (est, not run)"),
                      f"{r['copies']:.2f}" if r["measured"] else "",
                      _mib(r["allocated_bytes"]) if r["measured"] else "",
                      f"{r['ms']:.0f}" if r["measured"] else "", ratio_mem, ratio_t])
    return cols, cells


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the test's tiny grid (T 96, 200; V 512, 1024; H 16)")
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--vocabs", type=int, nargs="+", default=None)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--frozen", action="store_true",
                   help="the output weight takes no gradient (LoRA): ours forms the hidden's gradient in forward")
    p.add_argument("--threads", type=int, default=2, help="torch threads at TP 1 (TP 2: one per rank)")
    p.add_argument("--max-gib", type=float, default=9.5,
                   help="run a side only where its estimated peak (all ranks) is at most this")
    p.add_argument("--json", type=Path, default=None, help="write results here (and .txt beside)")
    p.add_argument("--publish", action="store_true",
                   help="write benchmarks/results/<results_name('linear_cross_entropy[_frozen]')> (and .txt)")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.vocabs, args.hidden = args.tokens or list(QUICK_TOKENS), args.vocabs or list(QUICK_VOCABS), QUICK_HIDDEN
    args.tokens, args.vocabs = args.tokens or list(TOKENS), args.vocabs or list(VOCABS)
    if args.publish:
        args.json = Path(HERE, "results", results_name("linear_cross_entropy" + ("_frozen" if args.frozen else "")))
    import torch

    grid = dict(tokens=args.tokens, vocabs=args.vocabs, hidden=args.hidden, repeats=args.repeats,
                max_gib=args.max_gib, threads=args.threads, frozen=args.frozen)
    rows = []
    with LoadMeter() as meter:
        for tp in args.tp:
            rows += launch(tp, grid)
            if tp != args.tp[-1] and args.json:  # an interrupted run keeps the TP sizes it finished
                write_results(args.json, {"environment": {"partial": True}, "results": rows}, "")
    env = dict(torch=torch.__version__, dtype="float32", backend="gloo", **meter.report())
    return _report(args, env, rows)


def _report(args, env: dict, rows: list) -> dict:
    cols, cells = table_cells(rows)
    text = "\n".join([
        text_table(cols, cells), "",
        "peak: the most bytes torch's allocator held at once inside forward + backward above what "
        "was live before (torch.profiler's memory events), per rank; copies: peak / (T x V/TP x 4 B); "
        "(est, not run): over --max-gib, the side's copies at its largest run times the logits' bytes; "
        "ratios megatron / this: > 1 means this side holds less / is faster",
        f"H = {args.hidden}, float32, B = 1, a third of the tokens masked, "
        f"{'the weight frozen' if args.frozen else 'hidden and weight take gradients'}; ms: minimum over "
        f"{args.repeats} rounds, the sides alternating (TP 2: the slower rank); CPU times, nothing about a GPU",
        describe(env)])
    return publish(args, env, rows, text)


if __name__ == "__main__":
    main()
