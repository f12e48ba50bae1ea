"""The GPU check: everything this repository cannot run on a CPU, in one command, one JSON.

    python benchmarks/gpu_check.py [--out gpu_check.json] [--budget-s 600]

On a CUDA machine it runs, within ``--budget-s`` seconds (default 10 minutes) and in this order:

1. ``pytest -m gpu`` -- every ``gpu``-marked test (CUDA paths of the packed cache, attention
   backends, offload streams, sync-free optimizer, TE experts, NeMo finetune), per-test results
   from pytest's JUnit XML;
2. the main job on the GPU for a few steps in the headline configurations (default; LoRA + per-
   layer CUDA graphs, the MLPerf LoRA shape in small; MoE; LoRA and MoE with full-iteration
   graphs), each's summary JSON (tok/s, host syncs per step, losses, graph launches);
3. ``benchmarks/offload.py --quick`` (its GPU section: real streams, pinned memory) and
   ``benchmarks/h2d_staging.py`` (pageable vs pinned-staged microbatch copies, GPU busy).

``benchmarks/packed_seq.py`` and ``benchmarks/moe_dispatch.py`` measure on the CPU only and are
listed as not run. Each item gets a status (passed / failed / timeout / not run, with the
reason), its wall time and the tail of its output; a later item that no longer fits in the
budget is "not run: budget". Exit 0 when every item ran and passed, 1 otherwise; on a machine
without CUDA nothing runs: it says so, writes the JSON with ``status: no_cuda`` and exits 3.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_CUDA_EXIT = 3
JOB = ["training.steps=8", "training.dtype=bfloat16"]
FULL_ITERATION = ["fastpath.cuda_graphs=true", "cuda_graphs.scope=full_iteration",
                  "cuda_graphs.use_te_rng_tracker=false"]
JOBS = {  # headline main-job configurations (name -> overrides)
    "main_job_default": JOB,
    "main_job_lora_cuda_graphs": JOB + ["fastpath.lora=true", "fastpath.cuda_graphs=true"],
    "main_job_moe": JOB + ["model=tiny_moe"],
    # the whole step as two graphs (issue 24): step 1 eager, captured at step 2, replayed after;
    # no dropout, so Megatron's graph-safe RNG tracker (no TE needed). MoE graphs need the bf16
    # grouped_mm sync-free path: sm90 / sm100 (refused at parse elsewhere, with the reason).
    "main_job_lora_full_iteration": JOB + FULL_ITERATION + ["fastpath.lora=true", "lora.dropout=0.0"],
    "main_job_moe_full_iteration": JOB + FULL_ITERATION + ["model=tiny_moe"],
}
CPU_ONLY = {
    "packed_seq_benchmark": "benchmarks/packed_seq.py measures on the CPU only",
    "moe_dispatch_benchmark": "benchmarks/moe_dispatch.py measures on the CPU only",
}


def environment() -> dict:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__,
           "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    for dist in ("megatron-core", "transformer-engine", "transformer_engine", "flash-attn", "apex"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        env["devices"] = [{"name": torch.cuda.get_device_name(i),
                           "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
                          for i in range(torch.cuda.device_count())]
    return env


def run_item(cmd: list, timeout_s: float, cwd: Path) -> dict:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"status": "timeout", "seconds": round(time.perf_counter() - t0, 1),
                "timeout_s": round(timeout_s, 1), "output_tail": out[-2000:]}
    return {"status": "passed" if proc.returncode == 0 else "failed", "returncode": proc.returncode,
            "seconds": round(time.perf_counter() - t0, 1),
            "output_tail": (proc.stdout + proc.stderr)[-2000:]}


def junit_counts(path: Path) -> dict:
    """passed / failed / skipped counts and the failed and skipped tests of a JUnit XML."""
    out = {"passed": 0, "failed": [], "skipped": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out["failed"].append(name)
        elif (skip := case.find("skipped")) is not None:
            out["skipped"].append(f"{name}: {skip.get('message', '')}")
        else:
            out["passed"] += 1
    return out


def plan(tmp: Path) -> list:
    """(name, command, share of the budget, parse(result) -> extra fields)."""
    py = sys.executable
    items = [("gpu_tests", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                            f"--junitxml={tmp / 'gpu.xml'}"], 0.5,
              lambda: junit_counts(tmp / "gpu.xml") if (tmp / "gpu.xml").exists() else {})]
    for name, overrides in JOBS.items():
        summary = tmp / f"{name}.json"
        items.append((name, [py, "-m", "megatron_fastpath.train", *overrides,
                             f"training.summary_json={summary}", f"hydra.run.dir={tmp / name}"], 0.1,
                      lambda s=summary: _job_summary(s)))
    bench = tmp / "offload.json"
    items.append(("offload_benchmark", [py, str(REPO / "benchmarks" / "offload.py"), "--quick",
                                        "--json", str(bench)], 0.2,
                  lambda: {"results": json.loads(bench.read_text())["results"]} if bench.exists() else {}))
    staged = tmp / "h2d_staging.json"
    items.append(("h2d_staging_benchmark", [py, str(REPO / "benchmarks" / "h2d_staging.py"), "--reps", "5",
                                            "--json", str(staged)], 0.05,
                  lambda: {"results": json.loads(staged.read_text())["results"]} if staged.exists() else {}))
    return items


def _job_summary(path: Path) -> dict:
    if not path.exists():
        return {}
    s = json.loads(path.read_text())
    keep = ("steps", "tokens_per_s", "syncs_fwd_bwd_per_step", "syncs_per_step", "first_loss",
            "last_loss", "notes")
    return {"summary": {k: s.get(k) for k in keep}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    p.add_argument("--budget-s", type=float, default=600.0)
    args = p.parse_args(argv)
    env = environment()
    report = {"environment": env, "budget_s": args.budget_s, "items": {}}
    if not env["cuda_available"]:
        report["status"] = "no_cuda"
        args.out.write_text(json.dumps(report, indent=1))
        print(f"gpu_check: no CUDA device on this machine (torch {env['torch']}, "
              f"torch.cuda.is_available() is False): nothing was run. Run it on a machine with a "
              f"GPU; wrote {args.out}", file=sys.stderr)
        return NO_CUDA_EXIT
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp_s:
        tmp = Path(tmp_s)
        for name, cmd, share, parse in plan(tmp):
            left = args.budget_s - (time.perf_counter() - start)
            if left < 30:
                report["items"][name] = {"status": "not run", "reason": "budget"}
                continue
            item = run_item(cmd, min(left, max(share * args.budget_s, 60.0)), REPO)
            item.update(parse())
            report["items"][name] = item
            print(f"gpu_check: {name}: {item['status']} ({item['seconds']} s)", flush=True)
    for name, reason in CPU_ONLY.items():
        report["items"][name] = {"status": "not run", "reason": reason}
    ran = [v for k, v in report["items"].items() if k not in CPU_ONLY]
    report["status"] = "passed" if all(v["status"] == "passed" for v in ran) else "failed"
    report["seconds"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"gpu_check: {report['status']} in {report['seconds']} s; wrote {args.out}")
    return 0 if report["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
