"""MoE token dispatch: host syncs, aten ops and time of four ways to route T tokens to E experts.

Variants (same inputs, same experts, one process):
  (a) hf_where_loop     HF transformers' eager MoE loop (MixtralSparseMoeBlock): one-hot mask,
                        ``torch.where`` per expert, advanced indexing, ``index_add_``
  (a2) where_loop_index_select  the same loop made cheaper (index_select, no one-hot): a
                        tighter lower bound for per-expert loops; same host syncs
  (b) unsloth_bincount  flatten, stable argsort, ``bincount`` + ``.tolist()``, slice per expert
  (c) megatron_permute  Megatron-Core 0.16.1 ``moe_utils.permute`` / ``unpermute`` (unfused, dense
                        routing map as Megatron's router emits it), tokens-per-expert to the host
                        and a per-expert loop (SequentialMLP-style); probs applied in the expert
                        like Megatron's experts
  (d) fastpath_sortcount ours: stable sort + ``scatter_add_`` counts, static buffer, grouped GEMMs
                        on device offsets (``torch._grouped_mm``), weighted ``index_add_`` combine

Each expert is a small MLP ``silu(x @ W1[e]) @ W2[e]`` (H -> --expert-ffn -> H), so the time is
dominated by the routing glue (gather/scatter of T*k rows of H, bookkeeping, per-expert launch
overhead) rather than by expert FLOPs. Routing (top-k ids, probs) is precomputed and shared; the
probs and tokens require grad, so fwd+bwd covers the gradients to tokens, probs and weights.

Columns: host_syncs_per_layer (SyncSentinel, one forward+backward), aten_ops (same region),
fwd_ms (forward with autograd recording) and fwd_bwd_ms (forward + backward): medians over
--reps interleaved rounds after --warmup rounds (fwd_bwd_ms_min is also written to the JSON).

    python benchmarks/moe_dispatch.py                 # T=4096, H=1024, E in {8,64,128,256}, k in {2,8}
    python benchmarks/moe_dispatch.py --quick --json /tmp/moe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict

import torch
import torch.nn.functional as F

from megatron_fastpath.moe.config import MoEDispatchConfig
from megatron_fastpath.moe.dispatch import (
    build_dispatch_plan,
    combine_tokens,
    permute_probs,
    permute_tokens,
)
from megatron_fastpath.sync import SyncSentinel


# -- variants ------------------------------------------------------------------------------
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


def megatron_permute(inp) -> torch.Tensor:
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    x, probs_TE, map_TE = inp["x"], inp["probs_TE"], inp["map_TE"]
    W1, W2 = inp["W1_list"], inp["W2_list"]
    T, k = inp["ids"].shape
    permuted, permuted_probs, sorted_idx = permute(
        x, map_TE, probs=probs_TE, num_out_tokens=T * k
    )
    splits = map_TE.sum(0).tolist()  # tokens per expert to the host (SequentialMLP needs a list)
    outs = []
    for e, (xe, pe) in enumerate(zip(torch.split(permuted, splits), torch.split(permuted_probs, splits))):
        if xe.shape[0]:
            outs.append((F.silu(xe @ W1[e]) * pe.unsqueeze(-1)) @ W2[e])
    return unpermute(torch.cat(outs), sorted_idx, restore_shape=x.shape)


def fastpath_sortcount(inp) -> torch.Tensor:
    x, ids, probs, W1, W2 = inp["x"], inp["ids"], inp["probs"], inp["W1"], inp["W2"]
    plan = build_dispatch_plan(ids, inp["cfg"])
    h = torch._grouped_mm(permute_tokens(x, plan), W1, offs=plan.offsets_E)
    # probs scale the F-wide activation (Megatron's convention, FastpathMoELayer's default),
    # not the H-wide output: the same product, 1/ (H/F) of the multiply traffic
    a = F.silu(h) * permute_probs(probs, plan).unsqueeze(-1)
    y = torch._grouped_mm(a, W2, offs=plan.offsets_E)
    return combine_tokens(y, plan, None, out_dtype=x.dtype)


VARIANTS: Dict[str, Callable] = {
    "a_hf_where_loop": hf_where_loop,
    "a2_where_loop_index_select": hf_where_loop_index_select,
    "b_unsloth_bincount": unsloth_bincount,
    "c_megatron_permute": megatron_permute,
    "d_fastpath_sortcount": fastpath_sortcount,
}


# -- harness -------------------------------------------------------------------------------
def make_inputs(T, H, E, k, ffn, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    top, ids = torch.topk(logits, k, dim=1)
    probs = torch.softmax(top, dim=-1)
    probs_TE = torch.zeros(T, E).scatter(1, ids, probs)
    map_TE = torch.zeros(T, E, dtype=torch.bool).scatter(1, ids, True)
    W1 = torch.randn(E, H, ffn, generator=g) / H**0.5
    W2 = torch.randn(E, ffn, H, generator=g) / ffn**0.5
    return dict(
        x=torch.randn(T, H, generator=g).requires_grad_(),
        ids=ids,
        probs=probs.requires_grad_(),
        probs_TE=probs_TE.requires_grad_(),
        map_TE=map_TE,
        # ours: stacked [E, ...] weights; loops: one leaf per expert (HF ModuleList / Megatron
        # SequentialMLP). Indexing a stacked leaf per expert would make each loop's backward
        # allocate E full-size zero tensors (select backward) and unfairly slow the baselines.
        W1=W1.clone().requires_grad_(),
        W2=W2.clone().requires_grad_(),
        W1_list=[W1[e].clone().requires_grad_() for e in range(E)],
        W2_list=[W2[e].clone().requires_grad_() for e in range(E)],
        cfg=MoEDispatchConfig(num_experts=E, topk=k),
        grad_out=torch.randn(T, H, generator=g),
    )


def _leaves(inp):
    return [inp[n] for n in ("x", "probs", "probs_TE", "W1", "W2")] + inp["W1_list"] + inp["W2_list"]


def _zero_grads(inp):
    for t in _leaves(inp):
        t.grad = None


def run_once(fn, inp, backward: bool) -> float:
    _zero_grads(inp)
    t0 = time.perf_counter()
    out = fn(inp)
    if backward:
        out.backward(inp["grad_out"])
    return (time.perf_counter() - t0) * 1e3


def measure_config(names, inp, reps, warmup):
    """SyncSentinel pass per variant, then ``warmup`` + ``reps`` rounds in which every variant
    runs once (interleaved, so load from other processes hits all variants alike); medians."""
    res = {}
    for name in names:
        with SyncSentinel(name=name) as s:
            run_once(VARIANTS[name], inp, backward=True)
        res[name] = dict(host_syncs_per_layer=s.num_syncs, aten_ops=s.aten_ops, fwd=[], fwd_bwd=[])
    for i in range(warmup + reps):
        for name in names:
            f = run_once(VARIANTS[name], inp, backward=False)
            fb = run_once(VARIANTS[name], inp, backward=True)
            if i >= warmup:
                res[name]["fwd"].append(f)
                res[name]["fwd_bwd"].append(fb)
    out = {}
    for name, r in res.items():
        out[name] = dict(
            host_syncs_per_layer=r["host_syncs_per_layer"], aten_ops=r["aten_ops"],
            fwd_ms=statistics.median(r["fwd"]), fwd_bwd_ms=statistics.median(r["fwd_bwd"]),
            fwd_bwd_ms_min=min(r["fwd_bwd"]),
        )
    return out


def check_equal(inp, outs):
    ref = outs["d_fastpath_sortcount"]
    for name, out in outs.items():
        err = float((out - ref).abs().max())
        if err > 1e-3 * max(1.0, float(ref.abs().max())):
            raise RuntimeError(f"variant {name} disagrees with ours: max abs err {err}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64, 128, 256])
    p.add_argument("--topk", type=int, nargs="+", default=[2, 8])
    p.add_argument("--expert-ffn", type=int, default=32, help="expert MLP width (small: glue-bound)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--quick", action="store_true", help="T=1024, H=256, E in {8,64,128}, k in {2,8}")
    p.add_argument("--json", type=str, default=None, help="write results to this path")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.experts = 1024, 256, [8, 64, 128]
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, T={args.tokens}, "
          f"H={args.hidden}, expert ffn={args.expert_ffn}, reps={args.reps}", flush=True)
    results = []
    for k in args.topk:
        for E in args.experts:
            if k > E:
                continue
            inp = make_inputs(args.tokens, args.hidden, E, k, args.expert_ffn)
            with torch.no_grad():
                check_equal(inp, {n: VARIANTS[n](inp) for n in args.variants})
            measured = measure_config(args.variants, inp, args.reps, args.warmup)
            for name in args.variants:
                r = measured[name]
                results.append(dict(variant=name, experts=E, topk=k, **r))
                print(f"  E={E:4d} k={k} {name:22s} syncs={r['host_syncs_per_layer']:4d} "
                      f"ops={r['aten_ops']:6d} fwd={r['fwd_ms']:8.1f}ms "
                      f"fwd+bwd={r['fwd_bwd_ms']:8.1f}ms", flush=True)
            del inp

    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": dict(tokens=args.tokens, hidden=args.hidden,
                                      expert_ffn=args.expert_ffn, reps=args.reps,
                                      threads=torch.get_num_threads(), torch=torch.__version__),
                       "results": results}, f, indent=1)
        print(f"wrote {args.json}")
    return results


def print_table(results):
    by = {(r["experts"], r["topk"], r["variant"]): r for r in results}
    print("\n| E | k | variant | host syncs/layer | aten ops | fwd ms | fwd+bwd ms | fwd+bwd vs ours |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        ours = by.get((r["experts"], r["topk"], "d_fastpath_sortcount"))
        ratio = f"{r['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.2f}x" if ours else "-"
        print(f"| {r['experts']} | {r['topk']} | {r['variant']} | {r['host_syncs_per_layer']} | "
              f"{r['aten_ops']} | {r['fwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f} | {ratio} |")
    print("\n(last column: variant time / ours; > 1 means ours is faster)")
    for (E, k) in sorted({(r["experts"], r["topk"]) for r in results}):
        d = by.get((E, k, "d_fastpath_sortcount"))
        a = by.get((E, k, "a_hf_where_loop"))
        c = by.get((E, k, "c_megatron_permute"))
        if d and a and c:
            print(f"E={E:4d} k={k}: (a)/ours fwd+bwd = {a['fwd_bwd_ms'] / d['fwd_bwd_ms']:.2f}x  "
                  f"ours/(c) fwd+bwd = {d['fwd_bwd_ms'] / c['fwd_bwd_ms']:.2f}")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
