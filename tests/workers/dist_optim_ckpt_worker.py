"""Test-only worker: Megatron's DistributedOptimizer (tests/support/dist_optim.py, gloo, inside the
CUDA-as-CPU mode) saved and loaded through the package's checkpoints (``CheckpointManager`` +
``training_parts``, synchronous saves).

    python -m torch.distributed.run --nproc_per_node=N -m tests.workers.dist_optim_ckpt_worker PHASE OUT

PHASE (N), each for both formats FMT of FORMATS (the checkpoints OUT/ckpt-<phase>-FMT):

* ``dp1`` (1): STEPS steps, saved to OUT/ckpt-dp1 at step STEPS; records ``saved`` (the
  optimizer state then; ``saved_lr``), ``next`` (the parameters after step STEPS + 1);
* ``dp2`` (2): the same, saved to OUT/ckpt-dp2; then a model and optimizer drawn from another seed
  load OUT/ckpt-dp2 (``resumed``, ``resumed_next``) and another OUT/ckpt-dp1 (``from_dp1``,
  ``from_dp1_next``);
* ``dp2to1`` (1): a model and optimizer drawn from another seed load OUT/ckpt-dp2 (``from_dp2``,
  ``from_dp2_next``);
* ``ep2`` (2, EP 2): the MoE model (two chained optimizers, ``leaves``) saved after STEPS steps
  (``saved``, ``next``) and resumed (``resumed``, ``resumed_next``).

Each rank writes OUT/PHASE.rank{r}.pt: ``{FMT: those entries}`` (optimizer states as
``dist_optim.optimizer_shards``, ``*_lr`` after each load, ``*_step`` the loaded step).
"""

from __future__ import annotations

import os
import sys

import torch

from tests.support.cuda_as_cpu import cuda_as_cpu
from tests.support.dist_optim import build, optimizer_shards, params, step

STEPS = 3
FORMATS = ("dp_reshardable", "fully_reshardable")


def _manager(path):
    from megatron_fastpath.checkpoint import CheckpointConfig, CheckpointManager

    return CheckpointManager(CheckpointConfig(dir=path, async_save=False), {}, log=lambda s: None)


def _train_and_save(out, path, fmt, seed=0):
    from megatron_fastpath.checkpoint import training_parts

    built = build(seed)
    for i in range(1, STEPS + 1):
        step(built, i)
    _manager(path).save(STEPS, training_parts(built[0], built[2], built[3], optimizer_format=fmt))
    out["saved"] = optimizer_shards(built)
    out["saved_lr"] = [g["lr"] for g in built[2].param_groups]
    step(built, STEPS + 1)
    out["next"] = params(built)


def _load(out, name, path, seed, num_experts=None):
    from megatron_fastpath.checkpoint import training_parts

    built = build(seed, num_experts)
    resumed = _manager(path).load(training_parts(built[0], built[2], built[3]))  # in the saved format
    out[f"{name}_step"] = resumed.step
    out[name] = optimizer_shards(built)
    out[f"{name}_lr"] = [g["lr"] for g in built[2].param_groups]
    step(built, STEPS + 1)
    out[f"{name}_next"] = params(built)


def _ep2(res, root, fmt):
    """EP 2: the MoE model's two chained optimizers (dense parameters over DP 2, experts over
    expert-DP 1), saved after STEPS steps and resumed into a model drawn from another seed."""
    from megatron_fastpath.checkpoint import training_parts

    path = os.path.join(root, f"ckpt-ep2-{fmt}")
    built = build(0, num_experts=4)
    res["leaves"] = len(built[2].chained_optimizers)
    for i in range(1, STEPS + 1):
        step(built, i)
    _manager(path).save(STEPS, training_parts(built[0], built[2], built[3], optimizer_format=fmt))
    res["saved"] = optimizer_shards(built)
    step(built, STEPS + 1)
    res["next"] = params(built)
    _load(res, "resumed", path, seed=7, num_experts=4)


def main() -> None:
    from megatron_fastpath.distributed import destroy_distributed, init_distributed

    phase, root = sys.argv[1], sys.argv[2]
    init_distributed(backend="gloo", expert_model_parallel_size=2 if phase == "ep2" else 1)
    out = {"world": torch.distributed.get_world_size()}
    with cuda_as_cpu():
        for fmt in FORMATS:
            res = out[fmt] = {}
            if phase in ("dp1", "dp2"):
                _train_and_save(res, os.path.join(root, f"ckpt-{phase}-{fmt}"), fmt)
            if phase == "dp2":
                _load(res, "resumed", os.path.join(root, f"ckpt-dp2-{fmt}"), seed=7)
                _load(res, "from_dp1", os.path.join(root, f"ckpt-dp1-{fmt}"), seed=8)
            if phase == "dp2to1":
                _load(res, "from_dp2", os.path.join(root, f"ckpt-dp2-{fmt}"), seed=9)
            if phase == "ep2":
                _ep2(res, root, fmt)
    torch.save(out, os.path.join(root, f"{phase}.rank{torch.distributed.get_rank()}.pt"))
    destroy_distributed()


if __name__ == "__main__":
    main()
