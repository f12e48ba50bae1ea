"""Print the benchmark tables of docs/benchmarks.md from the JSON the benchmarks wrote (no
figure is typed by hand): ``python benchmarks/readme_tables.py [results dir]``. Each table is
printed exactly as the page holds it; ``tests/benchmarks/test_readme_tables.py`` checks it.

Ratios are baseline / ours: > 1 means ours is faster."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # load_meter, beside this file
from load_meter import BASELINE_MCORE, describe, results_name  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PACKED_NAMES = {"cache": "ours (cache)", "rebuild_per_layer": "(a) rebuild per layer",
                "megatron_thd_rope": "(b) Megatron THD RoPE"}
MOE_OURS, MOE_MEGATRON = "d_fastpath_dispatch_only", (
    "f_megatron_permute_dispatch_only", "e_megatron_tegrouped_mlp", "c_megatron_sequential_mlp")


def _load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def packed_seq(d) -> str:
    rows = {(r["variant"], r["layers"]): r for r in d["results"]}
    out = ["| L | variant | host syncs / step | metadata ops / step | mask tensors saved / step "
           "| fwd+bwd ms (min) | baseline / ours (fwd+bwd) |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for layers in sorted({L for _, L in rows}):
        ours = rows[("cache", layers)]
        for variant, label in PACKED_NAMES.items():
            r = rows[(variant, layers)]
            out.append(f"| {layers} | {label} | {r['host_syncs_per_step']} | "
                       f"{r['metadata_ops_per_step']} | {r['mask_tensors_saved_per_step']} | "
                       f"{r['fwd_bwd_ms']:.0f} | {r['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.3f} |")
    return "\n".join(out)


def _both(new, old, fmt="{}") -> str:
    """``new`` alone where the two megatron-core lines agree, else ``new (old)``."""
    a, b = fmt.format(new), fmt.format(old)
    return a if a == b else f"{a} ({b})"


def packed_seq_versions(d, base) -> str:
    """The packed-sequence rows on a later megatron-core (``d``) with the 0.16.1 run's figure
    (``base``) in brackets where it differs. Times are not compared across the two files (two
    processes, two machine states): each ratio is inside its own run."""
    rows = {(r["variant"], r["layers"]): r for r in d["results"]}
    old = {(r["variant"], r["layers"]): r for r in base["results"]}
    v = d.get("megatron_core", "?")
    out = [f"| L | variant | host syncs / step, {v} ({BASELINE_MCORE}) "
           f"| metadata ops / step, {v} ({BASELINE_MCORE}) | aten ops / step, {v} "
           f"| fwd+bwd ms (min), {v} | baseline / ours (fwd+bwd), {v} ({BASELINE_MCORE}) |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for layers in sorted({L for _, L in rows}):
        ours, ours_old = rows[("cache", layers)], old.get(("cache", layers))
        for variant, label in PACKED_NAMES.items():
            r, o = rows[(variant, layers)], old.get((variant, layers))
            ratio = r["fwd_bwd_ms"] / ours["fwd_bwd_ms"]
            syncs, meta = r["host_syncs_per_step"], r["metadata_ops_per_step"]
            if o is None:
                cells = [str(syncs), str(meta), f"{ratio:.3f}"]
            else:
                cells = [_both(syncs, o["host_syncs_per_step"]),
                         _both(meta, o["metadata_ops_per_step"]),
                         _both(ratio, o["fwd_bwd_ms"] / ours_old["fwd_bwd_ms"], "{:.3f}")]
            out.append(f"| {layers} | {label} | {cells[0]} | {cells[1]} | "
                       f"{r['aten_ops_per_step']} | {r['fwd_bwd_ms']:.0f} | {cells[2]} |")
    return "\n".join(out)


def moe_dispatch(d) -> str:
    by = {(r["expert_width"], r["experts"], r["topk"], r["variant"]): r for r in d["results"]}
    out = ["| width | E | k | ours (d) | (f) dispatch only | (e) `TEGroupedMLP`-style "
           "| (c) `SequentialMLP` | Megatron's best / ours |",
           "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for w, E, k in sorted({key[:3] for key in by}):
        ours = by[(w, E, k, MOE_OURS)]["fwd_bwd_ms"]
        cells = [f"{by[(w, E, k, v)]['fwd_bwd_ms']:.1f} ({by[(w, E, k, v)]['fwd_bwd_ms'] / ours:.2f})"
                 for v in MOE_MEGATRON]
        best = min(by[(w, E, k, v)]["fwd_bwd_ms"] for v in MOE_MEGATRON) / ours
        verdict = f"{best:.3f}" if best >= 1 else f"**{best:.3f} (miss)**"
        out.append(f"| {w} | {E} | {k} | {ours:.1f} | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(out)


def offload(d) -> str:
    out = ["| c/g | variant | `max_offloaded_layers` | hidden_fraction | layers offloaded "
           "| of them in forward order | offloads pending at forward end "
           "| all in forward order: hidden / pending | single / this row (step time) |",
           "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["results"]:
        if r.get("hidden_fraction") is None or r["scenario"] == "measured":
            continue
        frac = f"{r['hidden_fraction']:.2f}"
        if r["c_over_g"] == 1.0 and "double" in r["variant"]:
            frac = f"**{frac}**"  # the issue's target (>= 0.9 at c/g = 1), met or not
        window = r["offload_window"] if r["offload_window"] != "None" else "None (all)"
        forward = ("" if r.get("forward_order_hidden_fraction") is None else
                   f"{r['forward_order_hidden_fraction']:.2f} / "
                   f"{r['forward_order_pending_at_fwd_end']}")
        out.append(f"| {r['c_over_g']} | {r['variant']} | `{window}` | {frac} | "
                   f"{r['offloaded_layers']} | {r['eager_offloads']} | "
                   f"{r['offloads_pending_at_fwd_end']} | {forward} | "
                   f"{r['single_over_ours']:.2f} |")
    return "\n".join(out)


def sync_check(d) -> str:
    out = ["| model | aten ops / step | host syncs / step | step ms with the sentinel (min) "
           "| step ms without (min) | with / without | cost per aten op (us) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["results"]:
        out.append(f"| {r['model']} | {r['aten_ops_per_step']} | {r['host_syncs_per_step']} | "
                   f"{r['with_sentinel_ms']:.1f} | {r['without_ms']:.1f} | "
                   f"{r['with_over_without']:.2f} | {r['cost_per_op_us']:.0f} |")
    return "\n".join(out)


def end_to_end(d) -> str:
    names = {"megatron_packed": "Megatron packed", "megatron_padded": "Megatron padded",
             "hf_padded": "HF padded"}
    out = ["| T | lengths | sequences (longest) | ours (sdpa layout) ms | Megatron packed ms "
           "| Megatron padded ms | HF padded ms | fastest peer / ours | verdict "
           "| scores: ours / [T, T] / padded batch |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in d["results"]:
        ms = [f"{r[k]:.0f}" if r[k] is not None else "not run" for k in
              ("megatron_packed_ms", "megatron_padded_ms", "hf_padded_ms")]
        out.append(f"| {r['tokens']} | {r['mix']} | {r['sequences']} ({r['longest']}) | "
                   f"{r['ours_ms']:.0f} ({r['ours_layout']}) | {' | '.join(ms)} | "
                   f"{r['fastest_peer_over_ours']:.2f} ({names[r['fastest_peer']]}) | {r['verdict']} | "
                   f"{r['scores_ours'] / 1e6:.2f}M / {r['scores_packed_mask'] / 1e6:.2f}M / "
                   f"{r['scores_padded'] / 1e6:.2f}M |")
    return "\n".join(out)


def end_to_end_versions(d, base) -> str:
    """The whole-step rows on a later megatron-core (``d``): its own times and ratio, 0.16.1's
    ratio in brackets where it differs (times of the two runs are not compared)."""
    old = {(r["tokens"], r["mix"]): r for r in base["results"]}
    names = {"megatron_packed": "Megatron packed", "megatron_padded": "Megatron padded",
             "hf_padded": "HF padded"}
    v = d["environment"].get("megatron_core", "?")
    out = [f"| T | lengths | sequences (longest) | ours (sdpa layout) ms, {v} | Megatron packed ms, {v} "
           f"| Megatron padded ms, {v} | HF padded ms, {v} "
           f"| fastest peer / ours, {v} ({BASELINE_MCORE}) | verdict, {v} |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in d["results"]:
        o = old.get((r["tokens"], r["mix"]))
        ms = [f"{r[k]:.0f}" if r[k] is not None else "not run" for k in
              ("megatron_packed_ms", "megatron_padded_ms", "hf_padded_ms")]
        ratio = f"{r['fastest_peer_over_ours']:.2f} ({names[r['fastest_peer']]})"
        if o is not None:
            ratio = _both(ratio, f"{o['fastest_peer_over_ours']:.2f} ({names[o['fastest_peer']]})")
        out.append(f"| {r['tokens']} | {r['mix']} | {r['sequences']} ({r['longest']}) | "
                   f"{r['ours_ms']:.0f} ({r['ours_layout']}) | {' | '.join(ms)} | {ratio} | "
                   f"{r['verdict']} |")
    return "\n".join(out)


GRAPH_VARIANTS = {"eager": "no graphs", "layers": "`scope=layers`",
                  "full_iteration": "`scope=full_iteration`"}


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f}"


def graph_launches(d) -> str:
    by = {(r["layers"], r["variant"]): r for r in d["results"]}
    out = ["| L | variant | eager ops / step | graph launches / step | eager ops + launches "
           "| host->device copies / step | device->device copies, MiB / step "
           "| host ms / step (min, CPU) | layers / this (ops + launches) |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["results"]:
        layers = by[(r["layers"], "layers")]["launch_proxy"]
        out.append(f"| {r['layers']} | {GRAPH_VARIANTS[r['variant']]} | {r['eager_ops_per_step']} | "
                   f"{r['graph_launches_per_step']} | {r['launch_proxy']} | "
                   f"{r['h2d_copies_per_step']} | {_mib(r.get('d2d_copy_bytes_per_step'))} | "
                   f"{r['host_ms_per_step']:.1f} | {layers / r['launch_proxy']:.2f} |")
    return "\n".join(out)


def graph_launches_versions(d, base) -> str:
    """The launch counts on a later megatron-core (``d``), 0.16.1's in brackets where they
    differ; host ms is ``d``'s own run (CPU time of the stand-in, nothing about a GPU)."""
    old = {(r["layers"], r["variant"]): r for r in base["results"]}
    by = {(r["layers"], r["variant"]): r for r in d["results"]}
    v = d["environment"].get("megatron_core", "?")
    out = [f"| L | variant | eager ops / step, {v} ({BASELINE_MCORE}) | graph launches / step "
           f"| eager ops + launches, {v} ({BASELINE_MCORE}) | host->device copies / step "
           f"| device->device copies, MiB / step, {v} ({BASELINE_MCORE}) "
           f"| host ms / step (min, CPU), {v} | layers / this (ops + launches), {v} ({BASELINE_MCORE}) |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["results"]:
        key = (r["layers"], r["variant"])
        o = old.get(key, r)
        layers, layers_old = by[(key[0], "layers")], old.get((key[0], "layers"), by[(key[0], "layers")])
        out.append(f"| {r['layers']} | {GRAPH_VARIANTS[r['variant']]} | "
                   f"{_both(r['eager_ops_per_step'], o['eager_ops_per_step'])} | "
                   f"{_both(r['graph_launches_per_step'], o['graph_launches_per_step'])} | "
                   f"{_both(r['launch_proxy'], o['launch_proxy'])} | "
                   f"{_both(r['h2d_copies_per_step'], o['h2d_copies_per_step'])} | "
                   f"{_both(_mib(r.get('d2d_copy_bytes_per_step')), _mib(o.get('d2d_copy_bytes_per_step')))} | "
                   f"{r['host_ms_per_step']:.1f} | "
                   f"{_both(layers['launch_proxy'] / r['launch_proxy'], layers_old['launch_proxy'] / o['launch_proxy'], '{:.2f}')} |")
    return "\n".join(out)


def data_stream(d) -> str:
    impl = {"new": "streaming", "old": "before (0607857)"}
    gen = {g["records"]: g for g in d["generation"]}
    out = ["| records | JSONL MiB (generated in, s) | implementation | phase | s (min) | records/s "
           "| tokens/s | tokens | refused | train + eval bins | all bins read, s | peak RSS MiB "
           "| RSS after imports MiB |",
           "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["results"]:
        g = gen[r["size"]]
        out.append(f"| {r['records']:,} | {g['bytes'] / 2**20:.0f} ({g['seconds']:.1f}) | "
                   f"{impl[r['impl']]} | {r['phase']} | {r['build_s']:.1f} | {r['records_per_s']:,} | "
                   f"{r['tokens_per_s']:,} | {r['tokens']:,} | {r['refused']} | "
                   f"{r['train_bins']:,} + {r['eval_bins']:,} | {r['read_bins_s']:.1f} | "
                   f"{r['peak_rss_mib']:,.0f} | {r['rss_after_imports_mib']:,.0f} |")
    return "\n".join(out)


MOE_LAYER_LABELS = {"megatron_alltoall": "Megatron `MoELayer`, `alltoall`",
                    "megatron_allgather": "Megatron `MoELayer`, `allgather`",
                    "ours": "ours, `FastpathMoELayer`"}


def _moe_layer_rows(d):
    by = {(r["expert_width"], r["experts"], r["topk"], r["layer"]): r for r in d["results"]}
    for w, E, k in sorted({key[:3] for key in by}):
        for layer, label in MOE_LAYER_LABELS.items():
            yield (w, E, k, layer), label, by[(w, E, k, layer)]


def moe_layer(d) -> str:
    out = ["| width | E | k | layer | host syncs / layer (GPU) | host reads (CPU) | aten ops "
           "| fwd ms (min) | fwd+bwd ms (min) | this / ours (fwd+bwd) | max abs diff: output, gradients |",
           "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for (w, E, k, _), label, r in _moe_layer_rows(d):
        out.append(f"| {w} | {E} | {k} | {label} | {r['host_syncs_per_layer']} | "
                   f"{r['host_reads_cpu']} | {r['aten_ops']} | {r['fwd_ms']:.1f} | "
                   f"{r['fwd_bwd_ms']:.1f} | {r['fwd_bwd_ratio_vs_ours']:.2f} | "
                   f"{r['out_max_abs_diff']:.1e}, {r['grad_max_abs_diff']:.1e} |")
    return "\n".join(out)


def dp_optimizer(d) -> str:
    """DP 2: the collectives per step over groups of more than one rank (count / payload
    bytes), a ring's wire bytes per rank beside 4 B x the trainable parameters, the optimizer's
    state per rank (Adam's moments + fp32 main parameters), the step time of this CPU stand-in
    run."""
    out = ["| model | variant | buckets | all-reduce / step: n, bytes | reduce-scatter / step: n, bytes "
           "| all-gather / step: n, bytes | wire bytes / step / rank | 4 B x params "
           "| optimizer state / rank, MiB (rank 0, 1) | host ms / step (min, CPU) |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["results"]:
        by = r["collectives_per_step"]["by_kind"]
        kinds = [f"{by[k]['count']}, {by[k]['bytes']:,}" if k in by else "0"
                 for k in ("all_reduce", "reduce_scatter", "all_gather")]
        state = ", ".join(f"{(a + b) / 2**20:.2f}"
                          for a, b in zip(r["optimizer_state_bytes"], r["main_param_bytes"]))
        out.append(f"| {r['model']} | {r['variant']} | {r['buckets']} | {' | '.join(kinds)} | "
                   f"{r['wire_bytes_per_step']:,} | {r['four_bytes_times_params']:,} | {state} | "
                   f"{r['host_ms_per_step']:.1f} |")
    return "\n".join(out)


def linear_cross_entropy(d) -> str:
    """The output layer + cross-entropy, forward and backward, per rank: peak bytes (the
    profiler's allocator events; a side over the run's memory limit not run, its estimate
    marked), as copies of the float32 logits [T, V/TP], and the CPU time; the ratios
    Megatron's / the row's (> 1: the row holds less, runs faster)."""
    out = ["| TP | T | V | side | peak MiB / rank | copies of [T, V/TP] fp32 | fwd+bwd ms (min, CPU) "
           "| Megatron / this: peak | Megatron / this: time |",
           "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    rows = d["results"]
    by = {(r["tp"], r["tokens"], r["vocab"], r["side"]): r for r in rows}
    for r in rows:
        m = by[(r["tp"], r["tokens"], r["vocab"], "megatron")]
        peak = r["peak_bytes"] if r["measured"] else r["estimated_peak_bytes"]
        mpeak = m["peak_bytes"] if m["measured"] else m["estimated_peak_bytes"]
        both = r["measured"] and m["measured"]
        cells = [f"{peak / 2**20:,.1f}" if r["measured"] else f"~{peak / 2**20:,.0f} (estimate, not run)",
                 f"{r['copies']:.2f}" if r["measured"] else "",
                 f"{r['ms']:,.0f}" if r["measured"] else "",
                 f"{mpeak / peak:.2f}" + ("" if both else " (estimate)"),
                 f"{m['ms'] / r['ms']:.2f}" if both else ""]
        out.append(f"| {r['tp']} | {r['tokens']:,} | {r['vocab']:,} | {r['side']} | {' | '.join(cells)} |")
    return "\n".join(out)


def multi_lora(d) -> str:
    """K adapters in one joint step vs K sequential single-adapter steps: each figure joint, then
    sequential, then joint / sequential (tokens/s: > 1 = joint faster; ops, peak: < 1 = fewer)."""
    out = ["| model | K | tokens / step | tokens/s joint, seq | joint / seq (tokens/s) "
           "| aten ops / step joint, seq | joint / seq (ops) | peak MiB joint, seq "
           "| joint / seq (peak) | max rel diff of a loss |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["results"]:
        out.append(f"| {r['model']} ({r['layers']} x {r['hidden']}) | {r['adapters']} | "
                   f"{r['tokens_per_step']} | {r['joint_tokens_per_s']:.0f}, "
                   f"{r['seq_tokens_per_s']:.0f} | {r['tokens_per_s_ratio']:.2f} | "
                   f"{r['joint_aten_ops']}, {r['seq_aten_ops']} | {r['aten_ops_ratio']:.3f} | "
                   f"{r['joint_peak_bytes'] / 2**20:.2f}, {r['seq_peak_bytes'] / 2**20:.2f} | "
                   f"{r['peak_ratio']:.2f} | {r['loss_max_rel_diff']:.1e} |")
    return "\n".join(out)


TABLES = (("packed_seq", packed_seq), ("moe_dispatch", moe_dispatch), ("offload", offload),
          ("sync_check", sync_check), ("end_to_end", end_to_end), ("graph_launches", graph_launches),
          ("data_stream", data_stream), ("moe_layer", moe_layer), ("dp_optimizer", dp_optimizer),
          ("linear_cross_entropy", linear_cross_entropy),
          ("linear_cross_entropy_frozen", linear_cross_entropy), ("multi_lora", multi_lora))


MOE_LABELS = {"c_megatron_sequential_mlp": "(c) Megatron `permute`/`unpermute` + `SequentialMLP`",
              "e_megatron_tegrouped_mlp": "(e) Megatron `permute`/`unpermute` + one `tolist` + grouped GEMM",
              "f_megatron_permute_dispatch_only": "(f) Megatron `permute`/`unpermute`, dispatch only",
              MOE_OURS: "(d) ours, dispatch only"}


def moe_dispatch_versions(d, base) -> str:
    """Megatron's MoE rows on a later megatron-core (``d``), 0.16.1's counts in brackets where
    they differ; times and ratios are ``d``'s own run."""
    old = {(r["expert_width"], r["experts"], r["topk"], r["variant"]): r for r in base["results"]}
    v = d.get("megatron_core", "?")
    out = [f"| width | E | k | variant | host syncs / layer, {v} ({BASELINE_MCORE}) "
           f"| aten ops, {v} ({BASELINE_MCORE}) | fwd+bwd ms (min), {v} | this / ours, {v} |",
           "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    by = {(r["expert_width"], r["experts"], r["topk"], r["variant"]): r for r in d["results"]}
    for w, E, k in sorted({key[:3] for key in by}):
        ours = by[(w, E, k, MOE_OURS)]["fwd_bwd_ms"]
        for variant, label in MOE_LABELS.items():
            r, o = by.get((w, E, k, variant)), old.get((w, E, k, variant), {})
            if r is None:
                continue
            out.append(f"| {w} | {E} | {k} | {label} | "
                       f"{_both(r['host_syncs_per_layer'], o.get('host_syncs_per_layer', r['host_syncs_per_layer']))} | "
                       f"{_both(r['aten_ops'], o.get('aten_ops', r['aten_ops']))} | "
                       f"{r['fwd_bwd_ms']:.1f} | {r['fwd_bwd_ms'] / ours:.2f} |")
    return "\n".join(out)


def moe_layer_versions(d, base) -> str:
    """The whole-layer rows on a later megatron-core (``d``), 0.16.1's counts in brackets where
    they differ; times, ratios and differences are ``d``'s own run."""
    old = {(r["expert_width"], r["experts"], r["topk"], r["layer"]): r for r in base["results"]}
    v = d["environment"].get("megatron_core", "?")
    out = [f"| width | E | k | layer | host syncs / layer (GPU), {v} ({BASELINE_MCORE}) "
           f"| host reads (CPU), {v} ({BASELINE_MCORE}) | aten ops, {v} ({BASELINE_MCORE}) "
           f"| fwd+bwd ms (min), {v} | this / ours, {v} | max abs diff: output, gradients, {v} |",
           "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for key, label, r in _moe_layer_rows(d):
        o = old.get(key, r)
        cells = [_both(r[n], o[n]) for n in ("host_syncs_per_layer", "host_reads_cpu", "aten_ops")]
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {label} | {' | '.join(cells)} | "
                   f"{r['fwd_bwd_ms']:.1f} | {r['fwd_bwd_ratio_vs_ours']:.2f} | "
                   f"{r['out_max_abs_diff']:.1e}, {r['grad_max_abs_diff']:.1e} |")
    return "\n".join(out)


# tables of a later megatron-core's run beside the 0.16.1 one: (name, version, formatter(d, base))
VERSIONED = (("packed_seq", "0.19.2", packed_seq_versions),
             ("moe_dispatch", "0.19.2", moe_dispatch_versions),
             ("graph_launches", "0.19.2", graph_launches_versions),
             ("moe_layer", "0.19.2", moe_layer_versions),
             ("end_to_end", "0.19.2", end_to_end_versions),
             # each line's own run (counts and times side by side would mix two processes)
             ("dp_optimizer", "0.19.2", lambda d, base: dp_optimizer(d)))


def tables(results_dir: str = RESULTS) -> dict:
    """name -> (load line, table) for every results JSON present; a later megatron-core's
    run as ``name_mcore<version>`` (its JSON beside the 0.16.1 one)."""
    out = {}
    for name, fmt in TABLES:
        path = os.path.join(results_dir, f"{name}.json")
        if os.path.exists(path):
            d = _load(path)
            out[name] = (describe(d.get("environment", d)), fmt(d))
    for name, version, fmt in VERSIONED:
        path = os.path.join(results_dir, results_name(name, version))
        base = os.path.join(results_dir, f"{name}.json")
        if os.path.exists(path) and os.path.exists(base):
            d = _load(path)
            out[os.path.basename(path)[:-5]] = (describe(d.get("environment", d)),
                                                fmt(d, _load(base)))
    return out


def main(results_dir: str) -> None:
    for name, (line, table) in tables(results_dir).items():
        print(f"### {name} ({os.path.join(results_dir, name + '.json')})\n\n{line}\n\n{table}\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else RESULTS)
