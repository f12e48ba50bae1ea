"""What the sync sentinel costs a training step (``training.sync_check``).

The main job's step with and without :class:`~megatron_fastpath.SyncSentinel` (a Python
``TorchFunctionMode`` + ``TorchDispatchMode`` around every op), in one process, alternating
blocks of steps, minimum per-step time over the repeats. Counts beside the times: aten ops per
step (what the modes intercept, counted in a separate untimed step) and host syncs (from a
counted step). ``training.sync_check=first`` (the default) pays the cost on the first steps only.

    python benchmarks/sync_check.py --json benchmarks/results/sync_check.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_meter import LoadMeter, describe, publish  # noqa: E402
from text_table import text_table  # noqa: E402

MODELS = {  # name: main-job overrides
    "default (tiny_dense, 2 x 256 tokens)": [],
    "tiny_moe (8 experts, top-2, 2 x 256 tokens)": ["model=tiny_moe"],
    "small (1 layer, hidden 32, 2 x 128 tokens)": ["model.num_layers=1", "model.hidden_size=32",
                                                   "model.ffn_hidden_size=64", "data.max_tokens=128"],
}


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _job(overrides, steps):
    from hydra import compose, initialize_config_dir

    from megatron_fastpath.train import build_job, config_dir, parse_job_config

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"training.steps={steps}", "data.num_samples=512", "metrics.wandb=off",
            "metrics.tensorboard=false", "metrics.plot=false", *overrides])
    return build_job(parse_job_config(cfg))


def measure(overrides, block: int, reps: int) -> dict:
    from megatron_fastpath.train import train_step

    job = _job(overrides, steps=2 + 1 + 2 * block * reps + 1)
    step = 0

    def run(check: bool):
        nonlocal step
        step += 1
        return train_step(job, job.data.batch(step), check_syncs=check)

    run(True), run(False)  # warm-up (first-step allocations, lazy imports)
    with _OpCount() as ops:
        run(False)
    counted = run(True)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(reps):
        for check in (True, False):
            t0 = time.perf_counter()
            for _ in range(block):
                run(check)
            best[check] = min(best[check], (time.perf_counter() - t0) / block)
    return dict(aten_ops_per_step=ops.n, host_syncs_per_step=counted.syncs_step,
                with_sentinel_ms=round(best[True] * 1e3, 3), without_ms=round(best[False] * 1e3, 3),
                sentinel_cost_ms=round((best[True] - best[False]) * 1e3, 3),
                with_over_without=round(best[True] / best[False], 3),
                cost_per_op_us=round((best[True] - best[False]) * 1e6 / max(ops.n, 1), 2))


def _table(rows: list) -> str:
    cols = ["model", "aten ops/step", "syncs/step", "with sentinel ms", "without ms",
            "cost ms", "with/without", "cost per op us"]
    keys = ["model", "aten_ops_per_step", "host_syncs_per_step", "with_sentinel_ms", "without_ms",
            "sentinel_cost_ms", "with_over_without", "cost_per_op_us"]
    cells = [[str(r[k]) for k in keys] for r in rows]
    return text_table(cols, cells)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block", type=int, default=5, help="steps per timed block")
    p.add_argument("--reps", type=int, default=5, help="blocks per mode (minimum taken)")
    p.add_argument("--quick", action="store_true", help="the small model only, 2 x 2 blocks")
    p.add_argument("--json", type=Path, default=None, help="write results here (and .txt beside)")
    args = p.parse_args(argv)
    models = dict(list(MODELS.items())[-1:]) if args.quick else MODELS
    if args.quick:
        args.block, args.reps = 2, 2

    from megatron_fastpath.distributed import init_distributed

    torch.manual_seed(0)
    with LoadMeter() as meter:
        init_distributed(backend="gloo")
        rows = [dict(model=name, **measure(ov, args.block, args.reps)) for name, ov in models.items()]
    env = dict(torch=torch.__version__, **meter.report())
    text = "\n".join([
        _table(rows), "",
        "ratio: with_over_without = step time with the sentinel / without it "
        "(> 1: what counting costs; training.sync_check=first pays it on the first 3 steps only)",
        describe(env)])
    return publish(args, env, rows, text)


if __name__ == "__main__":
    main()
