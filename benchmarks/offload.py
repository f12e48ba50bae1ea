"""Activation offload: how much of the copy time double buffering hides over a whole step, and
what it costs.

CPU section (always runs, < 1 min):
  1. A stack of L real Megatron TransformerLayers (CPU core attention) built from the
     ``with_activation_offload`` spec runs warm-up steps and ``--reps`` measured steps per
     variant on a RecordingDevice: the exact schedule (offloads on the offload stream, reloads
     on the reload stream, events, compute regions) is recorded with each call's host issue time
     (the host's own cost, the CPU's inline device work removed) and each compute region's wall
     time. Per-layer forward / backward (recompute + backward) times: minimum over the repeats,
     per layer (non-uniform).
  2. The WHOLE step (forward offloads, backward reloads) is replayed on the timing model
     (``megatron_fastpath.offload.timing``) with those per-layer times and host issue times, and
     with the copy time c of one activation set to c/g = 0.5, 1, 2 (g: median per-layer
     backward time) -- links slower and faster than compute -- plus the CPU's own host->host
     copy ("measured"). ``hidden_fraction`` = 1 - (T_step - T_free) / copy time: the fraction of
     all offload + reload time that did not lengthen the step (T_free: the same step with free
     copies). A prefetch issued late on the host starts late in this model.
  3. Variants: ``single_buffer`` (every layer but the last offloaded in forward order, reload
     just in time), ``double_buffer_all_layers`` (``max_offloaded_layers=None``: every layer
     but the last, prefetch one layer ahead, in the order the manager's planner picks for that
     window -- ``eager_offloads="auto"``, the default) and ``double_buffer`` (the default,
     ``max_offloaded_layers="auto"``: the window and order the manager's own planner,
     ``megatron_fastpath.offload.plan.plan_window``, picks from these per-layer times and c --
     on a GPU it is fed device timings of a calibration step).
     ``offload_window``: the row's ``max_offloaded_layers`` ("None" or "auto");
     ``eager_offloads``: offloads issued as their layers ran, the others held back and issued
     after the window's last layer, latest first (== offloaded_layers: forward order);
     ``forward_order_hidden_fraction`` / ``forward_order_pending_at_fwd_end``: the same window
     with every offload issued in forward order (``eager_offloads=None``) -- in forward order
     the last offloads finish last but are reloaded first (the planner takes an order only if
     it leaves no more offloads running at the end of the forward); ``planned_window`` /
     ``modelled_hidden_fraction``: the planner's choice and its own (host-ahead) figure;
     ``peak_window``: the window below which the planner never goes (it frees, by the end of
     the forward, what the largest window frees); ``hidden_fraction`` is the replay with host
     issue times.
     ``offloaded_layers`` / ``offloaded_bytes_per_step`` say what each row copies;
     ``offloads_pending_at_fwd_end``: offloads still running when the forward ends -- those
     activation sets are still on the device at the activation peak, so offloading them saved
     no peak memory (at c/g = 2 the all-layers row and the planned row leave the same number of
     sets off the device at that point);
     ``extra_device_bytes``: peak bytes of the reload buffers.
     ``host_ahead_*`` (and ``forward_order_host_ahead_*``): the same replay with the host
     infinitely far ahead -- a function of the per-layer times and c alone, so it equals the
     planner's model and its orders compare without the host's run-to-run issue jitter.
     ``single_over_ours``: modelled step time single_buffer / this row
     ("baseline / ours: > 1 means ours is faster").

GPU section (only with CUDA): steps/s and peak allocated memory of the same stack on the GPU
(Megatron's local attention) for no offload (recompute, activations on device), single buffer,
double buffer, and Transformer Engine's ``get_cpu_offload_context`` when TE is installed. Its
``hidden_fraction`` is measured from step times: (T_single - T_double) / (T_single - T_no_offload).

    python benchmarks/offload.py --json benchmarks/results/offload.json   # L=8, s=128, b=2, h=128
    python benchmarks/offload.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_meter import LoadMeter, describe, publish  # noqa: E402
from text_table import text_table  # noqa: E402
from megatron_fastpath.offload import OffloadConfig, RecordingDevice  # noqa: E402
from megatron_fastpath.offload.plan import LayerTimes, plan_window  # noqa: E402
from megatron_fastpath.offload.timing import step_hidden_fraction  # noqa: E402


# -- model ---------------------------------------------------------------------------------
class CpuCausalAttention(torch.nn.Module):
    """core_attention with Megatron's call signature (q/k/v [s, b, np, hn]), torch SDPA causal."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, cp_comm_type=None,
                 softmax_scale=None, pg_collection=None, **_):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        s, b, np_, hn = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)


def _config(args, dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
        num_attention_heads=args.heads, use_cpu_initialization=True, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, apply_rope_fusion=False,
    )


def _layer_spec(cpu_attention: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    if cpu_attention:
        attn = spec.submodules.self_attention
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(
            attn.submodules, core_attention=CpuCausalAttention))
        spec = dataclasses.replace(
            spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))
    return spec


class Stack(torch.nn.Module):
    def __init__(self, spec, config, wrap=None):
        from megatron.core.transformer.spec_utils import build_module

        super().__init__()
        self.layers = torch.nn.ModuleList(
            [build_module(spec, config=config, layer_number=i + 1)
             for i in range(config.num_layers)])
        self.wrap = wrap  # (context, sync_fn) for TE's offload

    def forward(self, x):
        for layer in self.layers:
            if self.wrap is None:
                x, _ = layer(hidden_states=x, attention_mask=None)
            else:
                ctx, sync = self.wrap
                with ctx:
                    x, _ = layer(hidden_states=x, attention_mask=None)
                x = sync(x)
        return x


# -- CPU section ---------------------------------------------------------------------------
RATIOS = (0.5, 1.0, 2.0)
TARGET = 0.9


def _measure_copy_bandwidth(nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times)


def _step(model, mgr, x):
    mgr.begin_step()
    h = x.detach().clone().requires_grad_(True)
    model(h).float().square().mean().backward()
    return mgr.end_step()


def _record(args, config, x, ocfg: OffloadConfig) -> dict:
    """Warm up, then ``args.reps`` steps: the fastest step's trace, per-layer min times."""
    from megatron_fastpath.offload.spec import with_activation_offload

    dev = RecordingDevice()
    torch.manual_seed(0)
    model = Stack(with_activation_offload(_layer_spec(True), ocfg, device=dev), config)
    mgr = model.layers[0].offload_manager
    for _ in range(args.warmup):
        _step(model, mgr, x)
    best, times = None, {}
    for _ in range(args.reps):
        dev.clear_trace()
        t0 = time.perf_counter()
        stats = _step(model, mgr, x)
        wall = time.perf_counter() - t0
        trace = list(dev.trace)
        for e in trace:
            if e.op == "compute_end":
                key = (e.phase, e.tag)
                times[key] = min(times.get(key, float("inf")), e.wall_s)
        if best is None or wall < best[0]:
            best = (wall, trace, stats)
    return dict(trace=best[1], stats=best[2], times=times, extra=dev.peak_device_bytes)


def _pending(step) -> int:
    """Offloads still running when the forward ends."""
    return sum(1 for iv in step.intervals if iv.kind == "d2h" and iv.end > step.fwd_end + 1e-12)


def _row(name, rec, compute_s, bw, act_bytes, g, label, single_step) -> dict:
    frac, step, free = step_hidden_fraction(rec["trace"], compute_s, bw, prior_events_done=True)
    # the same trace with the host ahead of the device: a function of the per-layer times and c
    # alone, the figure the planner's model gives (its orders are compared on this one)
    ahead_frac, ahead, _ = step_hidden_fraction(rec["trace"], compute_s, bw,
                                                prior_events_done=True, use_host_times=False)
    if step.hazards:
        raise RuntimeError(f"schedule hazard in {name}: {step.hazards[:3]}")
    stats = rec["stats"]
    c = act_bytes / bw
    return dict(
        section="cpu_model", variant=name, scenario=label, c_over_g=round(c / g, 4),
        layers=len({t for _, t in compute_s}), offloaded_layers=stats.layers_offloaded,
        eager_offloads=stats.eager_offloads,
        offloaded_bytes_per_step=stats.bytes_offloaded, mode=stats.mode.value,
        hidden_fraction=None if stats.layers_offloaded == 0 else round(frac, 4),
        # offloads still running when the forward ends: those activations are still on the
        # device at the step's memory peak, so they save no peak memory
        offloads_pending_at_fwd_end=_pending(step),
        host_ahead_hidden_fraction=None if stats.layers_offloaded == 0 else round(ahead_frac, 6),
        host_ahead_pending_at_fwd_end=_pending(ahead),
        c_ms=round(c * 1e3, 4), step_ms=round(step.makespan * 1e3, 4),
        free_copy_step_ms=round(free.makespan * 1e3, 4), compute_ms=round(step.compute_busy * 1e3, 4),
        exposed_copy_ms=round((step.makespan - free.makespan) * 1e3, 4),
        copy_ms=round(step.copy_busy * 1e3, 4),
        single_over_ours=None if single_step is None else round(single_step / step.makespan, 4),
        extra_device_bytes=rec["extra"],
        host_issue_ms=round(max(e.host_s for e in rec["trace"]) * 1e3, 4),
    )


def cpu_section(args) -> list[dict]:
    config = _config(args, torch.float32)
    x = torch.randn(args.seq, args.batch, args.hidden)
    act_bytes = x.numel() * x.element_size()
    L = args.layers
    base = dict(min_offload_bytes=0, headroom_margin_bytes=0)

    recorded: dict = {}

    def run(window, eager, **kw):  # each configuration recorded once
        ocfg = OffloadConfig(max_offloaded_layers=window, eager_offloads=eager, **kw, **base)
        if ocfg not in recorded:
            recorded[ocfg] = _record(args, config, x, ocfg)
        return recorded[ocfg]

    recs = {"no_offload": run(None, None, enabled=False),
            "single_buffer": run(None, None, allow_double_buffer=False)}
    # per-layer compute times: min over repeats and variants (the compute is the same)
    compute_s: dict = {}
    for rec in [*recs.values(), *(run(n, None) for n in [*range(L - 1), None])]:
        for key, t in rec["times"].items():
            compute_s[key] = min(compute_s.get(key, float("inf")), t)
    g = statistics.median(t for (ph, _), t in compute_s.items() if ph == "bwd")
    f = statistics.median(t for (ph, _), t in compute_s.items() if ph == "fwd")
    keys = sorted({tag for _, tag in compute_s}, key=lambda k: int(k[1:]))
    scenarios = [(f"c/g={r:g}", act_bytes / (r * g)) for r in RATIOS]
    scenarios.append(("measured", _measure_copy_bandwidth(act_bytes, max(5, args.reps * 5))))
    rows = []
    for label, bw in scenarios:
        single = step_hidden_fraction(recs["single_buffer"]["trace"], compute_s, bw,
                                      prior_events_done=True)[1].makespan
        for name, rec in recs.items():
            rows.append(_row(name, rec, compute_s, bw, act_bytes, g, label, single))
            rows[-1]["offload_window"] = "None"  # OffloadConfig.max_offloaded_layers
        c = act_bytes / bw
        times = LayerTimes(tuple(compute_s[("fwd", k)] for k in keys),
                           tuple(compute_s[("bwd", k)] for k in keys), (c,) * L, (c,) * L,
                           offload_at_layer_start=True)
        # what the manager's planner picks: the order for every layer but the last
        # (max_offloaded_layers=None), window and order for "auto"
        for name, window in (("double_buffer_all_layers", None), ("double_buffer", "auto")):
            plan = plan_window(times, TARGET, window=window)
            row = _row(name, run(None if window is None else plan.window, plan.eager),
                       compute_s, bw, act_bytes, g, label, single)
            forward = _row(name, run(None if window is None else plan.window, None),
                           compute_s, bw, act_bytes, g, label, single)
            row.update(offload_window=str(window), planned_window=plan.window,
                       modelled_hidden_fraction=round(plan.chosen.hidden_fraction, 4),
                       peak_window=plan.peak_window,
                       forward_order_hidden_fraction=forward["hidden_fraction"],
                       forward_order_pending_at_fwd_end=forward["offloads_pending_at_fwd_end"],
                       forward_order_host_ahead_hidden_fraction=forward[
                           "host_ahead_hidden_fraction"],
                       forward_order_host_ahead_pending_at_fwd_end=forward[
                           "host_ahead_pending_at_fwd_end"])
            rows.append(row)
    for r in rows:
        r.update(f_ms=round(f * 1e3, 4), g_ms=round(g * 1e3, 4), reps=args.reps,
                 activation_bytes=act_bytes)
    return rows


# -- GPU section ---------------------------------------------------------------------------
def gpu_section(args) -> list[dict]:
    from megatron_fastpath._optional import optional_import
    from megatron_fastpath.offload import CudaOffloadDevice
    from megatron_fastpath.offload.spec import with_activation_offload

    dtype = torch.bfloat16
    config = _config(args, dtype)
    dev = torch.device("cuda")
    x = torch.randn(args.seq, args.batch, args.hidden, dtype=dtype, device=dev)
    variants = {
        "no_offload": OffloadConfig(enabled=False, headroom_margin_bytes=0),
        "single_buffer": OffloadConfig(allow_double_buffer=False, headroom_margin_bytes=0),
        "double_buffer": OffloadConfig(headroom_margin_bytes=0),  # window "auto"
    }
    rows, times = [], {}
    for name, ocfg in list(variants.items()) + [("te_cpu_offload", None)]:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        mgr = None
        try:
            torch.manual_seed(0)
            if ocfg is not None:
                spec = with_activation_offload(_layer_spec(False), ocfg,
                                               device=CudaOffloadDevice())
                model = Stack(spec, config).cuda()
                mgr = model.layers[0].offload_manager
            else:
                te_offload = optional_import("transformer_engine.pytorch.cpu_offload")
                if te_offload is None:
                    rows.append(dict(section="gpu", variant=name, layers=args.layers,
                                     hidden_fraction=None, extra_device_bytes=None,
                                     note="Transformer Engine not installed"))
                    continue
                ctx, sync = te_offload.get_cpu_offload_context(
                    enabled=True, num_layers=args.layers - 1, model_layers=args.layers,
                    offload_activations=True, offload_weights=False)
                model = Stack(_layer_spec(False), config, wrap=(ctx, sync)).cuda()
        except Exception as exc:  # report, keep going
            rows.append(dict(section="gpu", variant=name, layers=args.layers,
                             hidden_fraction=None, extra_device_bytes=None,
                             note=f"unavailable: {type(exc).__name__}: {exc}"))
            continue

        def step():
            if mgr is not None:
                mgr.begin_step()
            h = x.detach().clone().requires_grad_(True)
            model(h).float().square().mean().backward()
            if mgr is not None:
                mgr.end_step()

        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.gpu_steps):
            step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.gpu_steps
        times[name] = dt
        rows.append(dict(
            section="gpu", variant=name, layers=args.layers, hidden_fraction=None,
            c_over_g=None,  # not measured on the GPU: the figure below is from step times
            extra_device_bytes=None if mgr is None else mgr.device_buffer_bytes,
            steps_per_s=round(1.0 / dt, 3), peak_mb=round(torch.cuda.max_memory_allocated() / 2**20, 1),
            peak_over_model_mb=round((torch.cuda.max_memory_allocated() - base) / 2**20, 1),
            mode=None if mgr is None else mgr.history[-1].mode.value,
        ))
        model = mgr = None  # free the stack before the next variant
    if {"no_offload", "single_buffer", "double_buffer"} <= times.keys():
        denom = times["single_buffer"] - times["no_offload"]
        for r in rows:
            if r["variant"] == "double_buffer" and denom > 0:
                r["hidden_fraction"] = round(
                    (times["single_buffer"] - times["double_buffer"]) / denom, 4)
    return rows


# -- main ----------------------------------------------------------------------------------
def _table(rows: list[dict]) -> str:
    cols = ["section", "variant", "scenario", "c_over_g", "offloaded_layers", "eager_offloads",
            "mode", "c_ms",
            "compute_ms", "step_ms", "free_copy_step_ms", "exposed_copy_ms", "copy_ms", "hidden_fraction",
            "offloads_pending_at_fwd_end", "forward_order_hidden_fraction", "planned_window",
            "peak_window", "modelled_hidden_fraction",
            "single_over_ours", "extra_device_bytes", "steps_per_s", "peak_mb", "note"]
    cols = [c for c in cols if any(c in r for r in rows)]
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in cols] for r in rows]
    return text_table(cols, cells)


def _environment(meter: LoadMeter) -> dict:
    return dict(torch=torch.__version__, **meter.report())


def _summary(rows: list[dict], env: dict) -> str:
    lines = [
        "ratio: single_over_ours = modelled step time single_buffer / this row "
        "(baseline / ours: > 1 means ours is faster)",
        describe(env),
    ]
    for r in rows:
        if r["section"] == "cpu_model" and "double" in r["variant"]:
            lines.append(
                f"{r['variant']} at c/g={r['c_over_g']:g}: whole-step hidden fraction "
                f"{r['hidden_fraction']} with {r['offloaded_layers']} of {r['layers'] - 1} "
                f"layers offloaded, {r['eager_offloads']} in forward order (window "
                f"{r['offload_window']!r}; all in forward order: "
                f"{r['forward_order_hidden_fraction']}; target >= {TARGET})")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--gpu-steps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="smaller shapes, fewer reps")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU section")
    p.add_argument("--json", type=Path, default=None,
                   help="write results here (and the table next to it, .txt)")
    args = p.parse_args(argv)
    if args.layers < 3:
        p.error("--layers must be >= 3 (the last layer is never offloaded)")
    if args.quick:
        args.layers, args.seq, args.hidden, args.heads = min(args.layers, 6), 64, 128, 4
        args.warmup, args.reps, args.gpu_steps = 1, 2, 5

    from megatron_fastpath.distributed import init_distributed

    with LoadMeter() as meter:
        init_distributed(backend="nccl" if torch.cuda.is_available() else "gloo")
        t0 = time.perf_counter()
        rows = cpu_section(args)
        if torch.cuda.is_available() and not args.no_gpu:
            rows += gpu_section(args)
    env = _environment(meter)
    text = _table(rows) + "\n\n" + _summary(rows, env) + (
        f"\nwall time {time.perf_counter() - t0:.1f}s")
    return publish(args, env, rows, text)


if __name__ == "__main__":
    main()
