"""Activation offload: how much of the reload copy time double buffering hides, and what it costs.

CPU section (always runs, < 1 min):
  1. A stack of L real Megatron TransformerLayers (CPU core attention) built from the
     ``with_activation_offload`` spec runs one warm-up and one measured step per buffer mode on
     a RecordingDevice whose compute markers are wall-clock timed: per-layer backward time g
     (recompute + backward) and forward time f are measured, and the exact schedule is recorded.
  2. Copy bandwidth: a host->host ``copy_`` of one activation (the CPU stand-in for the PCIe /
     C2C link) gives c = activation bytes / bandwidth.
  3. The recorded schedules are replayed on the two-stream timing model
     (``megatron_fastpath.offload.timing``) with the measured f, g (median per layer) and c --
     and with c scaled to c/g = 0.5, 1, 2 to cover links slower and faster than compute. The
     backward is replayed from the end of the forward with the offloads complete (the setting
     of T_double = c + (L-1) max(c, g) + g); ``d2h_backlog_ms`` (from the whole-step replay)
     says how long the forward's offload traffic outlasts the forward. ``hidden_fraction`` is the
     fraction of the ideal saving (L-1)*min(c, g) the schedule achieves against fully serialised
     reloads (target >= 0.9 for double buffering; single buffering is ~0 by construction, apart
     from its first reload overlapping the last layer). ``extra_device_bytes``: peak bytes of the
     reload buffers (<= 2 x one activation).

GPU section (only with CUDA): steps/s and peak allocated memory of the same stack on the GPU
(Megatron's local attention) for no offload (recompute, activations on device), single buffer,
double buffer, and Transformer Engine's ``get_cpu_offload_context`` when TE is installed.
Its ``hidden_fraction`` is measured: (T_single - T_double) / (T_single - T_no_offload).

    python benchmarks/offload.py                      # L=8, s=128, b=2, h=128
    python benchmarks/offload.py --quick --json /tmp/offload.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fastpath.offload import OffloadConfig, RecordingDevice  # noqa: E402
from megatron_fastpath.offload.timing import hidden_fraction, simulate_two_streams  # noqa: E402


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
class TimedRecordingDevice(RecordingDevice):
    """RecordingDevice that also wall-clocks each compute region (CPU runs synchronously)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.durations: dict[tuple[str, str], list[float]] = {}
        self._t0: Optional[float] = None

    def mark(self, kind, tag, **info):
        super().mark(kind, tag, **info)
        if kind == "compute_begin":
            self._t0 = time.perf_counter()
        elif kind == "compute_end" and self._t0 is not None:
            self.durations.setdefault((info.get("phase", ""), tag), []).append(
                time.perf_counter() - self._t0)
            self._t0 = None


def _measure_copy_bandwidth(nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def _step(model, mgr, x):
    mgr.begin_step()
    h = x.detach().clone().requires_grad_(True)
    model(h).float().square().mean().backward()
    return mgr.end_step()


def cpu_section(args) -> list[dict]:
    from megatron_fastpath.offload.spec import with_activation_offload

    dtype = torch.float32
    config = _config(args, dtype)
    x = torch.randn(args.seq, args.batch, args.hidden, dtype=dtype)
    act_bytes = x.numel() * x.element_size()
    L = args.layers
    modes = {
        "no_offload": OffloadConfig(enabled=False, min_offload_bytes=0, headroom_margin_bytes=0),
        "single_buffer": OffloadConfig(allow_double_buffer=False, min_offload_bytes=0,
                                       headroom_margin_bytes=0),
        "double_buffer": OffloadConfig(min_offload_bytes=0, headroom_margin_bytes=0),
    }
    traces, devs, stats, durations = {}, {}, {}, {}
    for name, ocfg in modes.items():
        dev = TimedRecordingDevice()
        torch.manual_seed(0)
        model = Stack(with_activation_offload(_layer_spec(True), ocfg, device=dev), config)
        mgr = model.layers[0].offload_manager
        for _ in range(args.warmup):
            _step(model, mgr, x)
        dev.clear_trace()
        dev.durations.clear()
        for _ in range(args.reps):
            start = len(dev.trace)
            stats[name] = _step(model, mgr, x)
        traces[name] = dev.trace[start:]  # the last step: one forward + backward
        devs[name] = dev
        durations[name] = {k: statistics.median(v) for k, v in dev.durations.items()}
    # measured per-layer times (median over modes and reps: the compute is the same)
    per_layer = {}
    for key in durations["double_buffer"]:
        per_layer[key] = statistics.median(d[key] for d in durations.values() if key in d)
    g = statistics.median(v for (phase, _), v in per_layer.items() if phase == "bwd")
    f = statistics.median(v for (phase, _), v in per_layer.items() if phase == "fwd")
    bw = _measure_copy_bandwidth(act_bytes, max(5, args.reps * 5))
    c = act_bytes / bw

    rows = []
    scenarios = [("measured", bw)] + [
        (f"c/g={r:g}", act_bytes / (r * g)) for r in (0.5, 1.0, 2.0)]
    uniform = {"fwd": f, "bwd": g}
    for label, scen_bw in scenarios:
        c_s = act_bytes / scen_bw
        for name in modes:
            trace = traces[name]
            # whole step: does the forward's offload traffic finish before backward needs it?
            full = simulate_two_streams(trace, uniform, scen_bw, prior_events_done=True)
            # backward only (the setting of T_double = c + (L-1) max(c, g) + g): from the first
            # call after the last forward compute region, offloads assumed complete
            last_fwd = max(i for i, e in enumerate(trace)
                           if e.op == "compute_end" and e.phase == "fwd")
            tl = simulate_two_streams(trace[last_fwd + 1:], uniform, scen_bw,
                                      prior_events_done=True)
            if tl.hazards or full.hazards:
                raise RuntimeError(f"schedule hazard in {name}: {(tl.hazards + full.hazards)[:3]}")
            d2h_end = max([iv.end for iv in full.intervals if iv.kind == "d2h"], default=0.0)
            hf = hidden_fraction(tl, L, c_s, g) if name != "no_offload" else None
            rows.append(dict(
                section="cpu_model", variant=name, scenario=label, layers=L,
                hidden_fraction=None if hf is None else round(hf, 4),
                extra_device_bytes=devs[name].peak_device_bytes,
                activation_bytes=act_bytes, c_ms=round(c_s * 1e3, 4), g_ms=round(g * 1e3, 4),
                f_ms=round(f * 1e3, 4), bwd_ms=round(tl.bwd_span * 1e3, 4),
                exposed_copy_ms=round(tl.stall * 1e3, 4),
                d2h_backlog_ms=round(max(0.0, d2h_end - full.fwd_end) * 1e3, 4),
                ideal_saving_ms=round((L - 1) * min(c_s, g) * 1e3, 4),
                mode=stats[name].mode.value,
            ))
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
        "double_buffer": OffloadConfig(headroom_margin_bytes=0),
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
            extra_device_bytes=None if mgr is None else mgr.device_buffer_bytes,
            steps_per_s=round(1.0 / dt, 3), peak_mb=round(torch.cuda.max_memory_allocated() / 2**20, 1),
            peak_over_model_mb=round((torch.cuda.max_memory_allocated() - base) / 2**20, 1),
            mode=None if mgr is None else mgr.history[-1].mode.value,
        ))
        del model
    if {"no_offload", "single_buffer", "double_buffer"} <= times.keys():
        denom = times["single_buffer"] - times["no_offload"]
        for r in rows:
            if r["variant"] == "double_buffer" and denom > 0:
                r["hidden_fraction"] = round(
                    (times["single_buffer"] - times["double_buffer"]) / denom, 4)
    return rows


# -- main ----------------------------------------------------------------------------------
def _table(rows: list[dict]) -> str:
    cols = ["section", "variant", "scenario", "layers", "mode", "c_ms", "f_ms", "g_ms", "bwd_ms",
            "exposed_copy_ms", "ideal_saving_ms", "hidden_fraction", "extra_device_bytes",
            "d2h_backlog_ms",
            "steps_per_s", "peak_mb", "note"]
    cols = [c for c in cols if any(c in r for r in rows)]
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


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
    p.add_argument("--json", type=str, default=None, help="write results to this path")
    args = p.parse_args(argv)
    if args.layers < 2:
        p.error("--layers must be >= 2 (the last layer is never offloaded)")
    if args.quick:
        args.layers, args.seq, args.hidden, args.heads = min(args.layers, 6), 64, 128, 4
        args.warmup, args.reps, args.gpu_steps = 1, 1, 5

    from megatron_fastpath.distributed import init_distributed

    init_distributed(backend="nccl" if torch.cuda.is_available() else "gloo")
    t0 = time.perf_counter()
    rows = cpu_section(args)
    if torch.cuda.is_available() and not args.no_gpu:
        rows += gpu_section(args)
    print(_table(rows))
    double = [r["hidden_fraction"] for r in rows
              if r["section"] == "cpu_model" and r["variant"] == "double_buffer"]
    print(f"\ndouble buffer hidden fraction (timing model): min {min(double):.3f} "
          f"(target >= 0.9); wall time {time.perf_counter() - t0:.1f}s")
    result = {"results": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
