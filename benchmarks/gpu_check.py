"""The GPU check: everything this repository cannot run on a CPU, in one command, one JSON.

    python benchmarks/gpu_check.py [--out gpu_check.json] [--budget-s 420] [--parallel 4]

On a lent machine with nothing installed but torch, ``bash benchmarks/gpu_run.sh OUT_DIR``
installs the wheel bundle (``benchmarks/gpu_bundle.py``) and runs this (docs/gpu-step.md).

On a CUDA machine it first measures the cold start (CUDA context, cuDNN, NCCL) and parses every
main job it will run (``training.device=cuda``: a refusal there is the check's own bug and is
reported as such), then runs, within ``--budget-s`` seconds:

A. concurrently, ``--parallel`` processes at a time (functional checks, not timings):
   * the main job for 8 steps in each configuration of :func:`jobs` -- what the machine can run
     without Transformer Engine or flash-attn (sdpa and flex attention off the packed cache,
     local linears, bf16 ``_grouped_mm`` MoE, per-layer graphs through Megatron's
     CudaGraphManager, full-iteration graphs, the double-buffered offload on real streams, the
     sync-free optimizer step), plus the TE / flash jobs when those packages import; each job
     must exit 0 and count 0 host syncs per step (``SyncSentinel`` on real CUDA); its start-up
     (launch to the banner line: imports, CUDA context, model and data built) is recorded;
   * ``pytest -m gpu`` (per-test results from pytest's JUnit XML);
B. alone, one after another (timings): ``benchmarks/gpu_step.py`` (one training step of a
   Llama-3-8B-shaped model: stock Megatron vs the fast path, tokens/s, TFLOP/s, MFU, syncs,
   peak memory, graph launches), ``benchmarks/offload.py --quick`` (its GPU section: real
   streams, pinned memory), ``benchmarks/moe_dispatch.py`` on the GPU (E = 64, bf16: the
   sort/count dispatcher vs Megatron's permute / unpermute) and ``benchmarks/h2d_staging.py``.

Every item gets a status -- passed / failed / timeout / skipped (a package it needs is missing:
which, and why) / not run (budget) -- its wall time and the tail of its output. Exit 0 when
every item that ran passed, 1 otherwise, 2 when a job the check runs does not parse; on a
machine without CUDA nothing runs: it says so, writes the JSON with ``status: no_cuda`` and
exits 3.
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
PARSE_EXIT = 2
JOB = ["training.steps=8", "training.dtype=bfloat16"]
FULL_ITERATION = ["fastpath.cuda_graphs=true", "cuda_graphs.scope=full_iteration"]
# per-layer graphs and LoRA dropout: without TE, Megatron's graph-safe tracker and no dropout
NO_TE_GRAPHS = ["cuda_graphs.use_te_rng_tracker=false", "lora.dropout=0.0"]
# a cold start (CUDA context, cuDNN, NCCL, imports) takes tens of seconds: no job gets less
JOB_TIMEOUT_S = 180.0


def jobs(te: bool, flash: bool) -> dict:
    """The main-job configurations the check runs: name -> (overrides, missing package or None).

    ``te`` / ``flash``: whether Transformer Engine / flash-attn import on this machine. A job
    that needs a missing one is listed with that package (skipped, reported)."""
    graphs = [] if te else NO_TE_GRAPHS
    # full-iteration graphs use Megatron's graph-safe tracker (TE asserts its own only in
    # per-layer capture) and no dropout
    full = FULL_ITERATION + ["cuda_graphs.use_te_rng_tracker=false", "lora.dropout=0.0"]
    out = {
        "main_job_default": (JOB, None),
        "main_job_sdpa_local": (JOB + ["fastpath.attention_backend=sdpa", "fastpath.linear_impl=local"], None),
        "main_job_flex": (JOB + ["fastpath.attention_backend=flex", "fastpath.linear_impl=local"], None),
        "main_job_lora_cuda_graphs": (JOB + ["fastpath.lora=true", "fastpath.cuda_graphs=true"] + graphs, None),
        "main_job_moe": (JOB + ["model=tiny_moe"], None),
        "main_job_moe_cuda_graphs": (JOB + ["model=tiny_moe", "fastpath.cuda_graphs=true"] + graphs, None),
        "main_job_offload": (JOB + ["fastpath.offload=true"], None),
        # the whole step as two graphs: step 1 eager, captured at step 2, replayed after
        "main_job_lora_full_iteration": (JOB + full + ["fastpath.lora=true"], None),
        "main_job_moe_full_iteration": (JOB + full + ["model=tiny_moe"], None),
        "main_job_te_fp8": (JOB + ["fastpath.linear_impl=te", "fastpath.fp8=true"],
                            None if te else "transformer_engine"),
        "main_job_te_lora_cuda_graphs": (JOB + ["fastpath.attention_backend=te", "fastpath.lora=true",
                                                "fastpath.cuda_graphs=true"], None if te else "transformer_engine"),
        "main_job_flash": (JOB + ["fastpath.attention_backend=flash", "fastpath.linear_impl=local"],
                           None if flash else "flash_attn"),
    }
    from tests.support.hydra_compose import features_on  # a feature's settings only with its switch

    return {name: (features_on(overrides), missing) for name, (overrides, missing) in out.items()}


MISSING_WHY = {
    "transformer_engine": "Transformer Engine is not installed (no wheel for this machine's CUDA "
                          "13 build of torch can be carried): its linears, FP8 and attention",
    "flash_attn": "flash-attn is not installed (a CUDA build, not carried): its varlen kernels",
}


def environment() -> dict:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__,
           "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    for dist in ("megatron-core", "transformer-engine", "transformer_engine", "flash-attn", "apex",
                 "hydra-core", "omegaconf"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    env["have"] = {m: _importable(m) for m in ("transformer_engine", "flash_attn")}
    if torch.cuda.is_available():
        env["devices"] = [{"name": torch.cuda.get_device_name(i),
                           "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
                          for i in range(torch.cuda.device_count())]
    return env


def _importable(module: str) -> bool:
    from megatron_fastpath._optional import have

    return have(module if module != "transformer_engine" else "transformer_engine.pytorch")


def cold_start() -> dict:
    """Seconds of the first CUDA context, the first cuDNN call and a one-rank NCCL group, in
    this process (each is paid again by every job process: the jobs' start-up says how much)."""
    import torch

    out = {}
    t0 = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    out["cuda_context_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    x = torch.randn(1, 4, 16, 16, device="cuda")
    torch.nn.functional.conv2d(x, torch.randn(4, 4, 3, 3, device="cuda"))
    torch.cuda.synchronize()
    out["cudnn_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    try:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
        t = torch.ones(1, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        dist.destroy_process_group()
        out["nccl_s"] = round(time.perf_counter() - t0, 2)
    except Exception as exc:  # reported, not fatal: the jobs run on one rank
        out["nccl_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_refusals(job_list: dict, extra: tuple = ()) -> dict:
    """name -> the one-line refusal of each runnable job that does not parse on this machine
    with ``training.device=cuda`` (and ``extra`` overrides; empty: all parse), or that the
    preflight's device checks refuse (the GPU's capability for the rules that read it, the
    memory check; not its output directories or environment)."""
    from hydra import compose, initialize_config_dir

    from megatron_fastpath.train import config_dir, parse_job_config
    from megatron_fastpath.train.preflight import check_device

    out = {}
    saved = dict(os.environ)  # kept as it was (the parse and the device checks set nothing)
    try:
        for name, (overrides, missing) in job_list.items():
            if missing:
                continue
            try:
                with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
                    cfg = compose(config_name="config", overrides=[*overrides, "training.device=cuda", *extra])
                check_device(parse_job_config(cfg))
            except (ValueError, ImportError) as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return out


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


def job_summary(path: Path) -> dict:
    """The fields of a main job's summary JSON the check reports, and its verdict on syncs."""
    if not path.exists():
        return {}
    s = json.loads(path.read_text())
    keep = ("steps", "tokens_per_s", "syncs_fwd_bwd_per_step", "syncs_per_step", "first_loss",
            "last_loss", "notes")
    out = {"summary": {k: s.get(k) for k in keep}}
    syncs = [s.get(k) for k in ("syncs_fwd_bwd_per_step", "syncs_per_step") if s.get(k) is not None]
    if any(v != 0 for v in syncs):
        out["failure"] = f"host syncs per step (fwd+bwd, whole step): {syncs}, expected 0"
    return out


def plan(tmp: Path, env: dict, parallel_budget_s: float) -> tuple:
    """(concurrent items, sequential items): each (name, command, timeout share, parse() -> extra
    fields, missing package or None)."""
    py = sys.executable
    have = env.get("have", {})
    concurrent = []
    for name, (overrides, missing) in jobs(have.get("transformer_engine", False),
                                          have.get("flash_attn", False)).items():
        summary = tmp / f"{name}.json"
        concurrent.append((name, [py, "-m", "megatron_fastpath.train", *overrides, "training.device=cuda",
                                  "training.sync_check=every", f"training.summary_json={summary}",
                                  f"hydra.run.dir={tmp / name}"],
                           JOB_TIMEOUT_S, lambda s=summary: job_summary(s), missing))
    concurrent.append(("gpu_tests", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                                     f"--junitxml={tmp / 'gpu.xml'}"], parallel_budget_s,
                       lambda: junit_counts(tmp / "gpu.xml") if (tmp / "gpu.xml").exists() else {}, None))
    sequential = []
    for name, script, args, share in (
            ("gpu_step_benchmark", "gpu_step.py", [], 0.35),
            ("offload_benchmark", "offload.py", ["--quick"], 0.2),
            # E = 64, k = 8, Qwen3-30B-A3B's expert width, bf16: ours vs Megatron's permute /
            # unpermute (its alltoall dispatcher's local token permutation at EP 1), with one
            # tolist of the counts (TEGroupedMLP's m_splits) and on device offsets
            ("moe_dispatch_benchmark", "moe_dispatch.py",
             ["--device", "cuda", "--dtype", "bfloat16", "--tokens", "8192", "--hidden", "2048",
              "--experts", "64", "--topk", "8", "--expert-widths", "768", "--reps", "5",
              "--variants", "e_megatron_tegrouped_mlp", "f_megatron_permute_dispatch_only"], 0.1),
            ("h2d_staging_benchmark", "h2d_staging.py", ["--reps", "5"], 0.1)):
        out = tmp / f"{name}.json"
        sequential.append((name, [py, str(REPO / "benchmarks" / script), *args, "--json", str(out)],
                           share, lambda o=out: _results(o), None))
    return concurrent, sequential


def _results(path: Path) -> dict:
    return {"results": json.loads(path.read_text()).get("results")} if path.exists() else {}


def _child_env() -> dict:
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{path}" if path else str(REPO),
                PYTHONUNBUFFERED="1")


def run_item(cmd: list, timeout_s: float, cwd: Path, log_path: Path) -> dict:
    """Run ``cmd`` to the end or ``timeout_s``: status, wall time and the output's tail."""
    item = start_item(cmd, cwd, log_path)
    while not _poll(item, timeout_s):
        time.sleep(0.2)
    return finish_item(item, timeout_s)


def start_item(cmd: list, cwd: Path, log_path: Path) -> dict:
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env=_child_env())
    return {"proc": proc, "log_path": log_path, "t0": time.perf_counter()}


def _poll(item: dict, timeout_s: float) -> bool:
    """True when the item's process has ended (killed at its timeout)."""
    proc = item["proc"]
    if proc.poll() is not None:
        return True
    if time.perf_counter() - item["t0"] > timeout_s:
        proc.kill()
        proc.wait()
        item["timed_out"] = True
        return True
    return False


def finish_item(item: dict, timeout_s: float) -> dict:
    seconds = round(time.perf_counter() - item["t0"], 1)
    out = Path(item["log_path"]).read_text(errors="replace")
    if item.get("timed_out"):
        res = {"status": "timeout", "seconds": seconds, "timeout_s": round(timeout_s, 1)}
    else:
        rc = item["proc"].returncode
        res = {"status": "passed" if rc == 0 else "failed", "returncode": rc, "seconds": seconds}
    if item.get("banner_s") is not None:
        res["startup_s"] = item["banner_s"]
    res["output_tail"] = out[-2000:]
    return res


def _watch_banner(item: dict) -> None:
    """When the main job printed its banner (``megatron_fastpath: <n> layers, ...``: imports,
    CUDA context, model and data built): its start-up, read from its log."""
    if "banner_s" in item:
        return
    text = Path(item["log_path"]).read_text(errors="replace")
    if "megatron_fastpath: " in text and " layers, " in text:
        item["banner_s"] = round(time.perf_counter() - item["t0"], 1)


def run_concurrent(items: list, parallel: int, deadline: float, report: dict, logs: Path) -> None:
    pending, running = list(items), []
    while pending or running:
        while pending and len(running) < parallel:
            name, cmd, timeout_s, parse, missing = pending.pop(0)
            if missing:
                report[name] = {"status": "skipped", "missing": missing, "reason": MISSING_WHY[missing]}
                continue
            left = deadline - time.perf_counter()
            if left < 30:
                report[name] = {"status": "not run", "reason": "budget"}
                continue
            item = start_item(cmd, REPO, logs / f"{name}.log")
            item.update(name=name, timeout_s=min(timeout_s, left), parse=parse)
            running.append(item)
        for item in list(running):
            _watch_banner(item)
            if _poll(item, item["timeout_s"]):
                running.remove(item)
                res = finish_item(item, item["timeout_s"])
                res.update(item["parse"]())
                if res["status"] == "passed" and res.get("failure"):
                    res["status"] = "failed"
                report[item["name"]] = res
                print(f"gpu_check: {item['name']}: {res['status']} ({res['seconds']} s)", flush=True)
        time.sleep(0.2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--parallel", type=int, default=4, help="processes at once in phase A")
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
    report["cold_start"] = cold_start()
    have = env["have"]
    refused = parse_refusals(jobs(have["transformer_engine"], have["flash_attn"]))
    if refused:
        report["status"] = "parse_refused"
        report["parse_refusals"] = refused
        args.out.write_text(json.dumps(report, indent=1))
        for name, why in refused.items():
            print(f"gpu_check: {name} does not parse on this machine: {why}", file=sys.stderr)
        return PARSE_EXIT
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp_s:
        tmp = Path(tmp_s)
        phase_a = args.budget_s * 0.45
        concurrent, sequential = plan(tmp, env, phase_a)
        report["parallel"] = args.parallel
        run_concurrent(concurrent, args.parallel, start + phase_a, report["items"], tmp)
        for name, cmd, share, parse, _missing in sequential:
            left = args.budget_s - (time.perf_counter() - start)
            if left < 30:
                report["items"][name] = {"status": "not run", "reason": "budget"}
                continue
            item = run_item(cmd, min(left, max(share * args.budget_s, 60.0)), REPO, tmp / f"{name}.log")
            item.update(parse())
            report["items"][name] = item
            print(f"gpu_check: {name}: {item['status']} ({item['seconds']} s)", flush=True)
    ran = [v for v in report["items"].values() if v["status"] not in ("skipped",)]
    report["status"] = "passed" if all(v["status"] == "passed" for v in ran) else "failed"
    report["seconds"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"gpu_check: {report['status']} in {report['seconds']} s; wrote {args.out}")
    return 0 if report["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
