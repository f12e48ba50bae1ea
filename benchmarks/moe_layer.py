"""Whole MoE layer: Megatron-Core's own ``MoELayer`` with its dispatchers against the fast path's.

Layers (one process, EP 1: a gloo world of 1 with Megatron's parallel state; the same router and
expert weights, the same input and output gradient):
  megatron_alltoall   ``MoELayer`` as ``get_moe_module_spec(use_te=False, num_experts=E,
                      moe_grouped_gemm=False)`` builds it (the spec the local GPT layer spec
                      uses): Megatron's ``TopKRouter``, ``moe_token_dispatcher_type="alltoall"``
                      and ``SequentialMLP`` experts (``TEGroupedMLP`` needs Transformer Engine)
  megatron_allgather  the same layer with the "allgather" dispatcher; it shares the alltoall
                      layer's router and experts modules (one set of weights)
  ours                ``FastpathMoELayer`` from ``megatron_fastpath.moe.get_moe_mlp_spec(E)``
                      (the module the fast path's layer spec puts in the MLP slot): its router,
                      sort/count dispatcher and grouped-GEMM experts (``torch._grouped_mm``),
                      weights copied from Megatron's (``weight1[e] = fc1.weight.T``, ...)

Routing is Megatron's default: softmax top-k, no capacity factor (dropless), and the same
load-balancing loss on every layer ("aux_loss", coefficient 1e-2), so the router's gradient
includes it. SwiGLU experts, fp32, no bias.

The "flex" dispatcher does not run here: each backend's refusal is recorded in the JSON
(``flex``) as raised by Megatron itself -- on 0.19.2 "deepep" and "ncclep" assert TP x EP > 1
(``transformer/moe/token_dispatcher.py:1770``, ``:1788``) and "hybridep" needs DeepEP's
``HybridEPBuffer`` (``:1047-1051``), a CUDA extension; 0.16.1's flex asserts TP x EP > 1
(``token_dispatcher.py:1346``).

Megatron's layer needs a GPU where a CPU has none: its router moves its weight to
``torch.cuda.current_device()`` (0.19.2 ``router.py:96-98``) and the alltoall dispatcher copies
its counts on a side stream (``token_dispatcher.py:468-469``, ``:920-950``). Every layer, ours
too, runs inside ``tests/support/cuda_as_cpu.py``'s ``cuda_as_cpu()`` (the same per-call mode
cost for all) and with dynamo off (0.19.2 compiles the router's expert-bias update,
``router.py:727``, which dynamo cannot target on the stand-in GPU; the bias is off here).
On 0.16.1 ``router_gating_linear`` reads ``te_general_gemm``, a name its module defines only
when Transformer Engine imports (``moe_utils.py:22-39``, read at ``:1192``): the run sets it to
None first, what the name means without TE (as 0.19.2's module defines it).

Columns: host syncs per layer forward+backward on a GPU (see :data:`HOST_COPY_READS`); host
reads the ``SyncSentinel`` sees on the CPU (every tensor read counts there); aten ops (same
region); fwd / fwd+bwd ms (the MINIMUM over --reps interleaved rounds after --warmup); this /
ours (fwd+bwd); the max abs difference of the output and of every gradient (input, router
weight, expert weights) against Megatron's alltoall layer. The load is recorded as in the other
benchmarks (``load_meter.py``).

    # T = 2048, hidden 512 (4096 x 1024 takes 3 minutes per E = 64 layer on this CPU),
    # (E, k) in {(8, 2), (64, 8)}, expert widths {32, 768}
    python benchmarks/moe_layer.py --json benchmarks/results/moe_layer.json   # 0.16.1
    python benchmarks/moe_layer.py --json benchmarks/results/moe_layer_mcore0.19.2.json
    python benchmarks/moe_layer.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # load_meter, text_table, moe_dispatch
sys.path.insert(1, os.path.dirname(HERE))  # the repo root: tests.support's CUDA-as-CPU mode

from load_meter import LoadMeter, describe, publish  # noqa: E402
from moe_dispatch import ALLOCATOR_ENV, _reexec_with_caching_malloc  # noqa: E402
from text_table import text_table  # noqa: E402

MEGATRON = ("megatron_alltoall", "megatron_allgather")
OURS = "ours"
LAYERS = MEGATRON + (OURS,)
AUX_LOSS_COEFF = 1e-2

# Reads the SyncSentinel counts on the CPU (where every tensor stands for a device one) that on
# a GPU read a value Megatron already holds on the host: (file under megatron/core, line, text on
# that line). Per line of megatron-core. Any other read or value-dependent op counts as a host
# sync, and so does each wait on a CUDA event (the alltoall dispatcher's d2h_event).
HOST_COPY_READS = {
    (0, 16): (
        # sort_chunks_by_idxs' split sizes: num_global_tokens_per_local_expert, copied to the
        # host at the dtoh point (token_dispatcher.py:892-894), and its chunk order, made on
        # permute_idx_device = "cpu" without permute fusion (:404-406)
        ("transformer/moe/moe_utils.py", 505, "split_sizes.tolist()"),
        ("transformer/moe/moe_utils.py", 506, "sorted_idxs.tolist()"),
        ("transformer/moe/moe_utils.py", 508, "split_sizes.tolist()"),
        ("transformer/moe/moe_utils.py", 509, "sorted_idxs.tolist()"),
        # SequentialMLP's split: tokens_per_expert as both dispatchers hand it over, on the host
        # (alltoall: token_dispatcher.py:876; allgather: .cpu() at :295)
        ("transformer/moe/experts.py", 910, "tokens_per_expert.tolist()"),
    ),
    (0, 19): (
        ("transformer/moe/moe_utils.py", 607, "split_sizes.tolist()"),  # dtoh copy :943-945
        ("transformer/moe/moe_utils.py", 608, "sorted_idxs.tolist()"),  # "cpu" index :428-435
        ("transformer/moe/moe_utils.py", 610, "split_sizes.tolist()"),
        ("transformer/moe/moe_utils.py", 611, "sorted_idxs.tolist()"),
        ("transformer/moe/experts.py", 1352, "tokens_per_expert.tolist()"),  # :927 | .cpu() :317
        # the allgather dispatcher's num_out_tokens: the sum of the counts .cpu() copied (:317)
        ("transformer/moe/token_dispatcher.py", 323, "tokens_per_expert.sum().item()"),
    ),
}


def mcore_line() -> tuple:
    from megatron_fastpath import compat

    return compat.mcore_line()


def host_copy_reads() -> set:
    """This megatron-core line's :data:`HOST_COPY_READS` as ``file:line`` strings, each line's
    text checked in the installed source (an upgrade that moved one fails here, not silently)."""
    import megatron.core

    root = os.path.dirname(megatron.core.__file__)
    out = set()
    for rel, line, text in HOST_COPY_READS[mcore_line()]:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            got = f.read().splitlines()[line - 1]
        if text not in got:
            raise RuntimeError(f"megatron/core/{rel}:{line} no longer reads {text!r}: {got.strip()!r}")
        out.add(f"{os.path.join(root, rel)}:{line}")
    return out


# -- layers -------------------------------------------------------------------------------
def transformer_config(H, E, k, F_, dispatcher="alltoall", **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=4 * H,
        moe_ffn_hidden_size=F_, num_moe_experts=E, moe_router_topk=k, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
        moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=AUX_LOSS_COEFF, **kw)


def _build(spec, cfg):
    """A ModuleSpec (0.16.1's ``get_moe_module_spec``, ours) or a builder partial (0.19.2's)."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    pg = get_default_pg_collection()
    if isinstance(spec, ModuleSpec):
        return build_module(spec, config=cfg, pg_collection=pg, layer_number=1)
    return spec(config=cfg, pg_collection=pg, layer_number=1)


def _te_general_gemm_without_te() -> None:
    """0.16.1's ``moe_utils`` binds ``te_general_gemm`` only when TE imports (moe_utils.py:22-39)
    and ``RouterGatingLinearFunction`` reads it (:1192): without TE that is a NameError. None is
    what the name means without TE (0.19.2's module binds it so)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@contextlib.contextmanager
def on_stand_in_gpu():
    """Megatron's MoE code on the CPU: the CUDA-as-CPU mode, dynamo off."""
    from tests.support.cuda_as_cpu import cuda_as_cpu

    with cuda_as_cpu(), torch._dynamo.config.patch(disable=True):
        yield


def build_layers(H, E, k, F_, seed=0) -> dict:
    """name -> layer, all on one set of weights (Megatron's init from ``seed``)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_fastpath.moe import get_moe_mlp_spec

    _te_general_gemm_without_te()
    torch.manual_seed(seed)
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    with on_stand_in_gpu():
        a2a = _build(spec, transformer_config(H, E, k, F_, "alltoall"))
        ag = _build(spec, transformer_config(H, E, k, F_, "allgather"))
    ag.router, ag.experts = a2a.router, a2a.experts  # one set of weights for both dispatchers
    ours = _build(get_moe_mlp_spec(E), transformer_config(H, E, k, F_))
    with torch.no_grad():
        ours.router.weight.copy_(a2a.router.weight)
        for e, mlp in enumerate(a2a.experts.local_experts):
            ours.experts.weight1[e].copy_(mlp.linear_fc1.weight.t())  # [2F, H]: gate | up rows
            ours.experts.weight2[e].copy_(mlp.linear_fc2.weight.t())
    return {"megatron_alltoall": a2a, "megatron_allgather": ag, OURS: ours}


def flex_refusals(H=64, E=8, k=2, F_=32) -> dict:
    """The "flex" dispatcher at EP 1 per backend this line has: Megatron's own error, or "runs"."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    backends = {(0, 16): [None], (0, 19): ["deepep", "hybridep", "ncclep"]}[mcore_line()]
    out = {}
    for backend in backends:
        kw = {} if backend is None else {"moe_flex_dispatcher_backend": backend}
        try:
            with on_stand_in_gpu():
                spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
                _build(spec, transformer_config(H, E, k, F_, "flex", **kw))
            out[backend or "flex"] = "runs"
        except Exception as exc:  # noqa: BLE001 -- Megatron's refusal, recorded as raised
            out[backend or "flex"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return out


# -- measuring ----------------------------------------------------------------------------
def make_inputs(T, H, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(T, 1, H, generator=g).requires_grad_(),
                grad_out=torch.randn(T, 1, H, generator=g))


def _zero_grads(layer, inp):
    for t in [inp["x"], *layer.parameters()]:
        if t.grad is not None:
            t.grad.zero_()


def run_once(layer, inp, backward: bool) -> float:
    """One forward (+ backward) on the stand-in GPU, in ms; gradients zeroed outside the clock."""
    _zero_grads(layer, inp)
    with on_stand_in_gpu():
        t0 = time.perf_counter()
        out, _ = layer(inp["x"])
        if backward:
            out.backward(inp["grad_out"])
        return (time.perf_counter() - t0) * 1e3


def count(layer, inp, name="layer") -> dict:
    """One forward+backward under the SyncSentinel, with the waits on CUDA events counted."""
    from megatron_fastpath.sync import SyncSentinel
    from megatron_fastpath.sync.sentinel import register_internal_file
    from tests.support import cuda_as_cpu as cac

    register_internal_file(cac.__file__)  # sync locations name Megatron's line, not the mode's
    waits = []
    _zero_grads(layer, inp)
    with on_stand_in_gpu(), mock.patch.object(cac._FakeEvent, "synchronize",
                                              lambda self: waits.append(1)):
        with SyncSentinel(name=name) as s:
            out, _ = layer(inp["x"])
            out.backward(inp["grad_out"])
    host = host_copy_reads()
    device = [e for e in s.events if e.location.split(" in ")[0] not in host]
    return dict(host_syncs_per_layer=len(device) + len(waits), host_reads_cpu=s.num_syncs,
                event_waits=len(waits), aten_ops=s.aten_ops,
                syncs=sorted(str(e) for e in device), host_copy_reads=s.num_syncs - len(device))


def gradients(name, layer, inp) -> dict:
    """Output and gradients in one layout: expert weights as ours' [E, H, 2F] / [E, F, H]."""
    _zero_grads(layer, inp)
    with on_stand_in_gpu():
        out, _ = layer(inp["x"])
        out.backward(inp["grad_out"])
    if name == OURS:
        w1, w2 = layer.experts.weight1.grad, layer.experts.weight2.grad
    else:
        experts = layer.experts.local_experts
        w1 = torch.stack([m.linear_fc1.weight.grad.t() for m in experts])
        w2 = torch.stack([m.linear_fc2.weight.grad.t() for m in experts])
    return dict(out=out.detach(), x=inp["x"].grad.clone(), router=layer.router.weight.grad.clone(),
                w1=w1.clone(), w2=w2.clone())


def max_diffs(got: dict, ref: dict) -> dict:
    out = float((got["out"] - ref["out"]).abs().max())
    grad = max(float((got[n] - ref[n]).abs().max()) for n in ("x", "router", "w1", "w2"))
    return dict(out_max_abs_diff=out, grad_max_abs_diff=grad)


def measure_config(T, H, E, k, F_, reps=3, warmup=1) -> list:
    layers = build_layers(H, E, k, F_)
    inp = make_inputs(T, H)
    grads = {n: gradients(n, L, inp) for n, L in layers.items()}
    rows = {n: dict(layer=n, tokens=T, hidden=H, experts=E, topk=k, expert_width=F_,
                    **count(L, inp, n), **max_diffs(grads[n], grads["megatron_alltoall"]),
                    fwd=[], fwd_bwd=[])
            for n, L in layers.items()}
    for i in range(warmup + reps):  # interleaved: load from other processes hits all alike
        for n, L in layers.items():
            f, fb = run_once(L, inp, backward=False), run_once(L, inp, backward=True)
            if i >= warmup:
                rows[n]["fwd"].append(f)
                rows[n]["fwd_bwd"].append(fb)
    for r in rows.values():
        fwd, fb = r.pop("fwd"), r.pop("fwd_bwd")
        r.update(fwd_ms=min(fwd), fwd_bwd_ms=min(fb), fwd_ms_median=statistics.median(fwd),
                 fwd_bwd_ms_median=statistics.median(fb), repeats=len(fb))
    for r in rows.values():
        r["fwd_bwd_ratio_vs_ours"] = r["fwd_bwd_ms"] / rows[OURS]["fwd_bwd_ms"]
    return list(rows.values())


def format_table(rows) -> str:
    cols = ["F", "E", "k", "layer", "host syncs/layer (GPU)", "host reads (CPU)", "aten ops",
            "fwd ms", "fwd+bwd ms", "this/ours", "max|d out|", "max|d grad|"]
    cells = [[str(r["expert_width"]), str(r["experts"]), str(r["topk"]), r["layer"],
              str(r["host_syncs_per_layer"]), str(r["host_reads_cpu"]), str(r["aten_ops"]),
              f"{r['fwd_ms']:.1f}", f"{r['fwd_bwd_ms']:.1f}", f"{r['fwd_bwd_ratio_vs_ours']:.2f}",
              f"{r['out_max_abs_diff']:.1e}", f"{r['grad_max_abs_diff']:.1e}"] for r in rows]
    return text_table(cols, cells)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--configs", nargs="+", default=["8:2", "64:8"], help="experts:topk pairs")
    p.add_argument("--expert-widths", type=int, nargs="+", default=[32, 768])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed rounds (the counted and the compared pass run first anyway)")
    p.add_argument("--quick", action="store_true", help="T=256, H=64, E 8, k 2, width 32, 1 rep")
    p.add_argument("--json", type=Path, default=None, help="write results here (and .txt beside)")
    args = p.parse_args(argv)
    if argv is None:
        _reexec_with_caching_malloc()  # large blocks reused, as moe_dispatch.py runs
    if args.quick:
        args.tokens, args.hidden, args.configs = 256, 64, ["8:2"]
        args.expert_widths, args.reps, args.warmup = [32], 1, 0
    pairs = [tuple(int(v) for v in c.split(":")) for c in args.configs]
    bad = [c for c, (E, k) in zip(args.configs, pairs) if not 1 <= k <= E]
    if bad:
        p.error(f"--configs {bad[0]}: top-k must be between 1 and the number of experts")

    from megatron_fastpath.distributed import init_distributed

    rows = []
    with LoadMeter() as meter:
        init_distributed(backend="gloo")
        flex = flex_refusals()
        for F_ in args.expert_widths:
            for E, k in pairs:
                rows += measure_config(args.tokens, args.hidden, E, k, F_, args.reps, args.warmup)
                for r in rows[-len(LAYERS):]:
                    print(f"  F={F_} E={E} k={k} {r['layer']:20s} "
                          f"syncs={r['host_syncs_per_layer']} ops={r['aten_ops']} "
                          f"fwd+bwd={r['fwd_bwd_ms']:.1f}ms", flush=True)
    env = dict(torch=torch.__version__, torch_threads=torch.get_num_threads(),
               allocator={k: os.environ.get(k) for k in ALLOCATOR_ENV}, **meter.report())
    text = "\n".join([
        format_table(rows), "",
        "host syncs/layer (GPU): waits a GPU run makes per forward+backward (value-dependent ops "
        "and reads of device values, waits on CUDA events); host reads (CPU): what the "
        "SyncSentinel sees on this CPU, reads of host copies included",
        "this/ours: fwd+bwd min over repeats, > 1 means ours is faster; max|d ...|: against "
        "megatron_alltoall (output; gradients of input, router and expert weights)",
        "flex: " + "; ".join(f"{b}: {why}" for b, why in flex.items()),
        describe(env)])
    env["flex"] = flex
    return publish(args, env, rows, text)


if __name__ == "__main__":
    main()
