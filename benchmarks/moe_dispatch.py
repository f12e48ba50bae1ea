"""MoE token dispatch: host syncs, aten ops and time of the ways to route T tokens to E experts.

Variants (same inputs, same expert weights, one process):
  (a) hf_where_loop     HF transformers' eager MoE loop (MixtralSparseMoeBlock): one-hot mask,
                        ``torch.where`` per expert, advanced indexing, ``index_add_``
  (a2) where_loop_index_select  the same loop made cheaper (index_select, no one-hot): a
                        tighter lower bound for per-expert loops; same host syncs
  (b) unsloth_bincount  flatten, stable argsort, ``bincount`` + ``.tolist()``, slice per expert
  (c) megatron_sequential_mlp  Megatron-Core 0.16.1 ``moe_utils.permute`` / ``unpermute``
                        (unfused, dense routing map as Megatron's router emits it), tokens per
                        expert to the host and a per-expert loop (``SequentialMLP``)
  (e) megatron_tegrouped_mlp  the same permute / unpermute, tokens per expert to the host with ONE
                        ``tolist`` (as ``TEGroupedMLP`` hands ``m_splits`` to TE), then the grouped
                        GEMM below on offsets built from that list: Megatron's fast path
  (f) megatron_permute_dispatch_only  Megatron's permute / unpermute with the grouped GEMM below
                        on device offsets (no tolist): isolates Megatron's dispatch
  (d) fastpath_dispatch_only  ours: stable sort + ``scatter_add_`` counts, static buffer, the
                        grouped GEMM below, weighted ``index_add_`` combine (also ours' full layer)

Expert MLP: ``silu(x @ W1[e]) * p @ W2[e]`` (H -> --expert-widths -> H), probabilities applied
to the activation as Megatron's experts do. (c) and the loops use one weight leaf per expert
(SequentialMLP / ModuleList); (d), (e), (f) share ``grouped_expert_mlp``: ``torch._grouped_mm``
on stacked [E, ...] weights, so (d) vs (f) differ ONLY in the dispatch and (d) vs (e) in the
dispatch plus (e)'s host read. At width 32 the time is the routing glue; at width 768
(Qwen3-30B-A3B's expert width) it is mostly expert GEMMs.

Gradient buffers persist across steps and are zeroed in place (as Megatron's DDP keeps
``main_grad``). The grouped GEMM's backward still returns its [E, H, F] weight gradient as a
new tensor (``torch._grouped_mm`` has no ``out=``), accumulated into that buffer: the script
re-executes itself with glibc's mmap / trim thresholds raised so such blocks are reused from
the heap, as the GPU's caching allocator reuses them, instead of page-faulting afresh
(``--system-malloc`` keeps glibc's defaults; the JSON records which).

Columns: host_syncs_per_layer (SyncSentinel, one forward+backward), aten_ops (same region),
fwd_ms / fwd_bwd_ms: the MINIMUM over --reps interleaved rounds after --warmup rounds (medians
are in the JSON too). Ratios: baseline / ours, > 1 means ours is faster. The 1-minute load
average is recorded at start and end, with the cores other processes kept busy during the run
(``load_meter.py``); a run above 0.5 per core by either is marked noisy.

    python benchmarks/moe_dispatch.py --json benchmarks/results/moe_dispatch.json
        # T=4096, H=1024, E in {8,128}, k in {2,8}, expert widths {32,768}; table -> .md beside
    python benchmarks/moe_dispatch.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # load_meter, beside this file

from load_meter import LoadMeter  # noqa: E402
from megatron_fastpath.moe.config import MoEDispatchConfig
from megatron_fastpath.moe.dispatch import (
    build_dispatch_plan,
    combine_tokens,
    permute_probs,
    permute_tokens,
)
from megatron_fastpath.sync import SyncSentinel

OURS = "d_fastpath_dispatch_only"
MEGATRON = ("c_megatron_sequential_mlp", "e_megatron_tegrouped_mlp", "f_megatron_permute_dispatch_only")


# -- variants ------------------------------------------------------------------------------
def grouped_expert_mlp(x_RH, offs_E, probs_R, W1_EHF, W2_EFH) -> torch.Tensor:
    """The expert GEMM shared by (d), (e) and (f): two grouped GEMMs on end offsets."""
    a_RF = F.silu(torch._grouped_mm(x_RH, W1_EHF, offs=offs_E)) * probs_R.unsqueeze(-1)
    return torch._grouped_mm(a_RF, W2_EFH, offs=offs_E)


def hf_where_loop(inp) -> torch.Tensor:
    """HF transformers' eager MoE loop, as written in MixtralSparseMoeBlock.forward: a one-hot
    expert mask, ``torch.where`` per expert (nonzero: one host sync each), advanced indexing
    ``hidden[None, top_x]`` and an in-place ``index_add_``."""
    x, ids, probs, W1, W2 = inp["x"], inp["ids"], inp["probs"], inp["W1_list"], inp["W2_list"]
    out = torch.zeros_like(x)
    expert_mask = F.one_hot(ids, num_classes=len(W1)).permute(2, 1, 0)
    for e in range(len(W1)):
        idx, top_x = torch.where(expert_mask[e])
        current = x[None, top_x].reshape(-1, x.shape[-1])
        y = (F.silu(current @ W1[e]) @ W2[e]) * probs[top_x, idx, None]
        out.index_add_(0, top_x, y)
    return out


def hf_where_loop_index_select(inp) -> torch.Tensor:
    """(a) made cheaper: ``index_select`` instead of advanced indexing (whose backward is an
    accumulating index_put), out-of-place ``index_add``, skip empty experts. Same syncs."""
    x, ids, probs, W1, W2 = inp["x"], inp["ids"], inp["probs"], inp["W1_list"], inp["W2_list"]
    out = torch.zeros_like(x)
    for e in range(len(W1)):
        tok, pos = torch.where(ids == e)  # nonzero: one host sync per expert
        if tok.numel() == 0:
            continue
        y = F.silu(x.index_select(0, tok) @ W1[e]) @ W2[e]
        out = out.index_add(0, tok, y * probs[tok, pos, None])
    return out


def unsloth_bincount(inp) -> torch.Tensor:
    x, ids, probs, W1, W2 = inp["x"], inp["ids"], inp["probs"], inp["W1_list"], inp["W2_list"]
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(W1)).tolist()  # bincount + tolist: 2 syncs
    tok = order // k
    xs = x.index_select(0, tok)
    outs = []
    # torch.split (one SplitBackward) rather than xs[s:e] slices, whose backward allocates a
    # full-size zero tensor per expert
    for e, xe in enumerate(torch.split(xs, counts)):
        if counts[e]:
            outs.append(F.silu(xe @ W1[e]) @ W2[e])
    y = torch.cat(outs) * probs.reshape(-1).index_select(0, order).unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, tok, y)


def _megatron_permute(inp):
    from megatron.core.transformer.moe.moe_utils import permute

    T, k = inp["ids"].shape
    # 0.16.1 returns (permuted, probs, sorted_indices); 0.19.2 appends (pad_offsets,
    # tokens_per_expert) (megatron/core/transformer/moe/moe_utils.py:337, its return at :467)
    out = permute(inp["x"], inp["map_TE"], probs=inp["probs_TE"], num_out_tokens=T * k)
    return out[:3]


def _megatron_unpermute(y, sorted_idx, inp):
    from megatron.core.transformer.moe.moe_utils import unpermute

    return unpermute(y, sorted_idx, restore_shape=inp["x"].shape)


def megatron_sequential_mlp(inp) -> torch.Tensor:
    """(c) permute, counts to the host, SequentialMLP's per-expert loop, unpermute."""
    W1, W2 = inp["W1_list"], inp["W2_list"]
    permuted, permuted_probs, sorted_idx = _megatron_permute(inp)
    splits = inp["map_TE"].sum(0).tolist()  # SequentialMLP needs a host list
    outs = []
    for e, (xe, pe) in enumerate(zip(torch.split(permuted, splits), torch.split(permuted_probs, splits))):
        if xe.shape[0]:
            outs.append((F.silu(xe @ W1[e]) * pe.unsqueeze(-1)) @ W2[e])
    return _megatron_unpermute(torch.cat(outs), sorted_idx, inp)


def megatron_tegrouped_mlp(inp) -> torch.Tensor:
    """(e) TEGroupedMLP-style: permute, ONE tolist of the counts (TE's m_splits), grouped GEMM
    on offsets made from that host list, unpermute."""
    permuted, permuted_probs, sorted_idx = _megatron_permute(inp)
    m_splits = inp["map_TE"].sum(0).tolist()
    ends = torch.tensor(m_splits, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(permuted.device)
    y = grouped_expert_mlp(permuted, ends, permuted_probs, inp["W1"], inp["W2"])
    return _megatron_unpermute(y, sorted_idx, inp)


def megatron_permute_dispatch_only(inp) -> torch.Tensor:
    """(f) Megatron's permute / unpermute around the shared grouped GEMM on device offsets."""
    permuted, permuted_probs, sorted_idx = _megatron_permute(inp)
    ends = inp["map_TE"].sum(0).cumsum(0, dtype=torch.int32)
    y = grouped_expert_mlp(permuted, ends, permuted_probs, inp["W1"], inp["W2"])
    return _megatron_unpermute(y, sorted_idx, inp)


def fastpath_dispatch_only(inp) -> torch.Tensor:
    """(d) ours: sort/count plan, permute, the shared grouped GEMM, unweighted combine."""
    x, plan = inp["x"], build_dispatch_plan(inp["ids"], inp["cfg"])
    ends = torch.cumsum(plan.group_sizes_E, 0, dtype=torch.int32)
    y = grouped_expert_mlp(
        permute_tokens(x, plan), ends, permute_probs(inp["probs"], plan), inp["W1"], inp["W2"]
    )
    return combine_tokens(y, plan, None, out_dtype=x.dtype)


VARIANTS: Dict[str, Callable] = {
    "a_hf_where_loop": hf_where_loop,
    "a2_where_loop_index_select": hf_where_loop_index_select,
    "b_unsloth_bincount": unsloth_bincount,
    "c_megatron_sequential_mlp": megatron_sequential_mlp,
    "e_megatron_tegrouped_mlp": megatron_tegrouped_mlp,
    "f_megatron_permute_dispatch_only": megatron_permute_dispatch_only,
    OURS: fastpath_dispatch_only,
}
PER_EXPERT_LEAVES = {"a_hf_where_loop", "a2_where_loop_index_select", "b_unsloth_bincount",
                     "c_megatron_sequential_mlp"}


# -- harness -------------------------------------------------------------------------------
def make_inputs(T, H, E, k, ffn, names, seed=0, device="cpu", dtype=torch.float32):
    """Inputs built on the CPU from one seed (the same values on every device), then moved to
    ``device`` in ``dtype`` (floating tensors; leaves stay leaves)."""
    inp = _make_cpu_inputs(T, H, E, k, ffn, names, seed)
    if device == "cpu" and dtype == torch.float32:
        return inp

    def move(t):
        if not torch.is_tensor(t):
            return t
        out = t.detach().to(device, dtype if t.is_floating_point() else t.dtype)
        return out.requires_grad_(t.requires_grad)

    return {n: [move(t) for t in v] if isinstance(v, list) else move(v) for n, v in inp.items()}


def _make_cpu_inputs(T, H, E, k, ffn, names, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    top, ids = torch.topk(logits, k, dim=1)
    probs = torch.softmax(top, dim=-1)
    probs_TE = torch.zeros(T, E).scatter(1, ids, probs)
    map_TE = torch.zeros(T, E, dtype=torch.bool).scatter(1, ids, True)
    W1 = torch.randn(E, H, ffn, generator=g) / H**0.5
    W2 = torch.randn(E, ffn, H, generator=g) / ffn**0.5
    # Loops: one leaf per expert (HF ModuleList / Megatron SequentialMLP); indexing a stacked
    # leaf per expert would make each loop's backward allocate E full-size zero tensors.
    lists = bool(PER_EXPERT_LEAVES & set(names))
    return dict(
        x=torch.randn(T, H, generator=g).requires_grad_(),
        ids=ids,
        probs=probs.requires_grad_(),
        probs_TE=probs_TE.requires_grad_(),
        map_TE=map_TE,
        W1=W1.clone().requires_grad_(),
        W2=W2.clone().requires_grad_(),
        W1_list=[W1[e].clone().requires_grad_() for e in range(E)] if lists else [],
        W2_list=[W2[e].clone().requires_grad_() for e in range(E)] if lists else [],
        cfg=MoEDispatchConfig(num_experts=E, topk=k),
        grad_out=torch.randn(T, H, generator=g),
    )


def _leaves(inp):
    return [inp[n] for n in ("x", "probs", "probs_TE", "W1", "W2")] + inp["W1_list"] + inp["W2_list"]


def _zero_grads(inp):
    """Zero persistent gradient buffers in place (allocated once, like DDP's main_grad)."""
    for t in _leaves(inp):
        if t.grad is not None:
            t.grad.zero_()


def run_once(fn, inp, backward: bool, sentinel_name=None):
    """Time one forward (+ backward); gradient zeroing is outside the timed / counted region.
    With ``sentinel_name``: return the SyncSentinel of the run instead of the time."""
    _zero_grads(inp)
    cuda = inp["x"].is_cuda
    if sentinel_name is not None:
        with SyncSentinel(name=sentinel_name) as s:
            out = fn(inp)
            if backward:
                out.backward(inp["grad_out"])
        return s
    if cuda:  # the device's time: wait for what was queued before, and for this run's kernels
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(inp)
    if backward:
        out.backward(inp["grad_out"])
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def measure_config(names, inp, reps, warmup):
    """SyncSentinel pass per variant, then ``warmup`` + ``reps`` rounds in which every variant
    runs once (interleaved, so load from other processes hits all variants alike)."""
    res = {}
    for name in names:
        s = run_once(VARIANTS[name], inp, backward=True, sentinel_name=name)
        res[name] = dict(host_syncs_per_layer=s.num_syncs, aten_ops=s.aten_ops, fwd=[], fwd_bwd=[])
    for i in range(warmup + reps):
        for name in names:
            f = run_once(VARIANTS[name], inp, backward=False)
            fb = run_once(VARIANTS[name], inp, backward=True)
            if i >= warmup:
                res[name]["fwd"].append(f)
                res[name]["fwd_bwd"].append(fb)
    return {
        name: dict(
            host_syncs_per_layer=r["host_syncs_per_layer"], aten_ops=r["aten_ops"],
            fwd_ms=min(r["fwd"]), fwd_bwd_ms=min(r["fwd_bwd"]),
            fwd_ms_median=statistics.median(r["fwd"]),
            fwd_bwd_ms_median=statistics.median(r["fwd_bwd"]), repeats=len(r["fwd_bwd"]),
        )
        for name, r in res.items()
    }


def check_equal(outs, rel: float = 1e-3):
    """Every variant's output against ours (``rel`` of the largest magnitude: 1e-3 in fp32;
    bf16 sums in other orders differ by a few of its 8-bit-mantissa ulps)."""
    ref = outs[OURS]
    for name, out in outs.items():
        err = float((out - ref).abs().max())
        if err > rel * max(1.0, float(ref.abs().max())):
            raise RuntimeError(f"variant {name} disagrees with ours: max abs err {err}")


# glibc hands blocks >= 32 MiB to mmap and returns them on free, so every large temporary of
# every variant page-faults afresh (~10 ms per 32 MiB here): noise that lands on whichever
# variant allocates one more buffer. A GPU's caching allocator reuses blocks; raising the
# thresholds makes glibc do the same, for all variants alike.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 34), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}


def _reexec_with_caching_malloc() -> None:
    if all(os.environ.get(k) == v for k, v in ALLOCATOR_ENV.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 128])
    p.add_argument("--topk", type=int, nargs="+", default=[2, 8])
    p.add_argument("--expert-widths", type=int, nargs="+", default=[32, 768],
                   help="expert MLP widths F (32: glue-bound; 768: Qwen3-30B-A3B)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--quick", action="store_true", help="T=512, H=256, E in {8,128}, widths {32,256}")
    p.add_argument("--json", type=str, default=None, help="write results here (+ table as .md)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: inputs and weights on the GPU (torch._grouped_mm: bf16 on sm90 / sm100)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--system-malloc", action="store_true",
                   help="keep glibc's default mmap thresholds (large blocks not reused)")
    args = p.parse_args(argv)
    if argv is None and not args.system_malloc:
        _reexec_with_caching_malloc()
    if args.quick:
        args.tokens, args.hidden, args.expert_widths, args.reps = 512, 256, [32, 256], 3
    if args.threads:
        torch.set_num_threads(args.threads)
    if OURS not in args.variants:
        args.variants.append(OURS)

    results = []
    with LoadMeter() as meter:
        print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, T={args.tokens}, "
              f"H={args.hidden}, expert widths={args.expert_widths}, reps={args.reps} (min), "
              f"load/core at start {meter.load_start / meter.cores:.2f}", flush=True)
        for width in args.expert_widths:
            for k in args.topk:
                for E in args.experts:
                    if k <= E:
                        results += run_config(args, args.tokens, args.hidden, E, k, width)
    load = meter.report()
    table = format_table(results, meter.line())
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": dict(tokens=args.tokens, hidden=args.hidden,
                                      expert_widths=args.expert_widths, reps=args.reps,
                                      statistic="min over reps",
                                      threads=torch.get_num_threads(), torch=torch.__version__,
                                      device=args.device, dtype=args.dtype,
                                      cores=os.cpu_count(),
                                      allocator={k: os.environ.get(k) for k in ALLOCATOR_ENV}),
                       "ratio_direction": "baseline / ours: > 1 means ours is faster",
                       **load, "results": results}, f, indent=1)
        with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
            f.write(table + "\n")
        print(f"wrote {args.json}")
    return results


def run_config(args, T, H, E, k, width):
    inp = make_inputs(T, H, E, k, width, args.variants, device=getattr(args, "device", "cpu"),
                      dtype=getattr(torch, getattr(args, "dtype", "float32")))
    with torch.no_grad():
        check_equal({n: VARIANTS[n](inp).float() for n in args.variants},
                    rel=1e-3 if inp["x"].dtype == torch.float32 else 3e-2)
    measured = measure_config(args.variants, inp, args.reps, args.warmup)
    ours = measured[OURS]
    rows = []
    for name in args.variants:
        r = measured[name]
        rows.append(dict(variant=name, experts=E, topk=k, expert_width=width, tokens=T, hidden=H,
                         fwd_bwd_ratio_vs_ours=r["fwd_bwd_ms"] / ours["fwd_bwd_ms"], **r))
        print(f"  F={width:4d} E={E:4d} k={k} {name:34s} syncs={r['host_syncs_per_layer']:4d} "
              f"ops={r['aten_ops']:6d} fwd={r['fwd_ms']:8.1f}ms fwd+bwd={r['fwd_bwd_ms']:8.1f}ms",
              flush=True)
    return rows


def format_table(results, load_line: str) -> str:
    lines = [
        "ratio: baseline / ours (fwd+bwd, min over repeats): > 1 means ours is faster",
        load_line,
        "",
        "| F | E | k | variant | host syncs/layer | aten ops | fwd ms | fwd+bwd ms | baseline / ours |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['expert_width']} | {r['experts']} | {r['topk']} | {r['variant']} | "
            f"{r['host_syncs_per_layer']} | {r['aten_ops']} | {r['fwd_ms']:.1f} | "
            f"{r['fwd_bwd_ms']:.1f} | {r['fwd_bwd_ratio_vs_ours']:.2f} |")
    lines += ["", "Per config: dispatch only (f / ours) and Megatron's best CPU path / ours:"]
    for key in sorted({(r["expert_width"], r["experts"], r["topk"]) for r in results}):
        by = {r["variant"]: r for r in results if (r["expert_width"], r["experts"], r["topk"]) == key}
        megatron = {n: by[n]["fwd_bwd_ms"] for n in MEGATRON if n in by}
        if not megatron:
            continue
        best = min(megatron, key=megatron.get)
        ratio = megatron[best] / by[OURS]["fwd_bwd_ms"]
        disp = by.get("f_megatron_permute_dispatch_only")
        lines.append(
            f"F={key[0]:4d} E={key[1]:4d} k={key[2]}: "
            + (f"dispatch only {disp['fwd_bwd_ratio_vs_ours']:.2f}, " if disp else "")
            + f"best Megatron ({best}) / ours = {ratio:.3f}" + ("" if ratio >= 1 else "  MISS"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
