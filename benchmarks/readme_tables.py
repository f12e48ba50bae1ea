"""Print the README's benchmark tables from the JSON the benchmarks wrote (no figure is typed
by hand): ``python benchmarks/readme_tables.py [results dir]``.

Ratios are baseline / ours: > 1 means ours is faster."""

from __future__ import annotations

import json
import os
import sys


def _load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _load_line(d) -> str:
    return (f"load average {d['load_average_1min_at_start']:.2f} -> "
            f"{d['load_average_1min_at_end']:.2f} (the run's own threads included) on "
            f"{d['cores']} cores; other processes kept {d['external_cores_busy']} cores busy "
            f"on average; noisy: {d['noisy']}")


def packed_seq(d) -> str:
    rows = {(r["variant"], r["layers"]): r for r in d["results"]}
    out = [_load_line(d), "",
           "| L | variant | host syncs / step | metadata ops / step | mask tensors saved / step "
           "| cache KiB | fwd ms (min) | fwd+bwd ms (min) | baseline / ours fwd+bwd |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (variant, layers), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0] != "cache")):
        ours = rows[("cache", layers)]
        ratio = r["fwd_bwd_ms"] / ours["fwd_bwd_ms"]
        out.append(f"| {layers} | {variant} | {r['host_syncs_per_step']} | "
                   f"{r['metadata_ops_per_step']} | {r['mask_tensors_saved_per_step']} | "
                   f"{r['cache_bytes'] / 1024:.0f} | {r['fwd_ms']:.0f} | {r['fwd_bwd_ms']:.0f} | "
                   f"{ratio:.3f} |")
    return "\n".join(out)


def moe_dispatch(d) -> str:
    out = [_load_line(d) + f"; config {d['config']}", "",
           "| E | k | width | variant | host syncs / layer | aten ops | fwd+bwd ms (min) "
           "| baseline / ours |", "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    key = lambda r: (r["experts"], r["topk"], r["expert_width"], r["variant"])
    for r in sorted(d["results"], key=key):
        out.append(f"| {r['experts']} | {r['topk']} | {r['expert_width']} | {r['variant']} | "
                   f"{r['host_syncs_per_layer']} | {r['aten_ops']} | {r['fwd_bwd_ms']:.1f} | "
                   f"{r['fwd_bwd_ratio_vs_ours']:.2f} |")
    return "\n".join(out)


def offload(d) -> str:
    out = [_load_line(d["environment"]), "",
           "| c/g | variant | hidden_fraction | layers offloaded | offloads pending at forward end "
           "| single / this row (step time) |", "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in d["results"]:
        if r.get("hidden_fraction") is None:
            continue
        out.append(f"| {r['c_over_g']} | {r['variant']} | {r['hidden_fraction']:.2f} | "
                   f"{r['offloaded_layers']} | {r['offloads_pending_at_fwd_end']} | "
                   f"{r['single_over_ours']:.2f} |")
    return "\n".join(out)


def main(results_dir: str) -> None:
    for name, fmt in (("packed_seq", packed_seq), ("moe_dispatch", moe_dispatch),
                      ("offload", offload)):
        path = os.path.join(results_dir, f"{name}.json")
        if os.path.exists(path):
            print(f"### {name} ({path})\n\n{fmt(_load(path))}\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results"))
