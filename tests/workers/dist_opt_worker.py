"""Test-only worker of tests/train/test_distributed_optimizer_torchrun.py: trains the main job's
runs listed in ``spec.json`` one after the other in this process, on the GPU step path inside
the GPU stand-ins (CUDA-as-CPU), under ``torchrun``::

    torchrun --nproc_per_node=2 -m tests.workers.dist_opt_worker <spec.json> <out dir>

``spec.json``: ``[{"name", "overrides"}]``. After each run every rank writes
``<out>/<name>.rank<r>.pt``: the step records (step, loss, lr, grad norm, host syncs counted in
the forward-backward and in the whole step), this rank's final parameters (read with the
parameters gathered: ``StepParts.params_current``; the names of those the gather changed) and
what the optimizer is: the leaves'
classes, the elements of the shards they update, DDP's settings and bucket count. A run that
raises writes ``{"error": ...}`` and the launch stops (the ranks' collectives no longer pair up).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch


def describe_optimizer(job) -> dict:
    opt = job.step.optimizer
    leaves = getattr(opt, "leaves", None) or [opt]
    out = {"leaves": [type(leaf).__name__ for leaf in leaves],
           "shard_numel": [sum(p.numel() for p in leaf.get_parameters()) for leaf in leaves]}
    chunks = getattr(leaves[0], "model_chunks", None)
    if chunks:
        ddp = chunks[0]
        cfg = ddp.ddp_config
        out.update(overlap_grad_reduce=cfg.overlap_grad_reduce,
                   overlap_param_gather=cfg.overlap_param_gather, bucket_size=cfg.bucket_size,
                   buckets=len(ddp.bucket_groups), forward_hooks=len(ddp.remove_forward_pre_hook_handles))
    return out


def main(spec: str, out: str) -> None:
    from tests.support.hydra_compose import compose_job
    from tests.support.main_job import train_in_standins
    from tests.support.matrix_runs import frozen_heap

    rank = int(os.environ.get("RANK", "0"))
    with frozen_heap() as settle:
        for item in json.loads(Path(spec).read_text()):
            path = Path(out) / f"{item['name']}.rank{rank}.pt"
            try:
                summary, job = train_in_standins(compose_job(item["overrides"]))
                before = {k: p.detach().clone() for k, p in job.model.named_parameters()}
                with job.step.params_current():
                    params = {k: p.detach().clone() for k, p in job.model.named_parameters()}
                result = {
                    "records": [dict(step=r.step, loss=r.loss, lr=r.lr, grad_norm=r.grad_norm,
                                     syncs_fwd_bwd=r.syncs_fwd_bwd, syncs_step=r.syncs_step,
                                     sync_sites=r.sync_sites, graph_launches=r.graph_launches)
                                for r in summary.records],
                    "syncs_per_step": summary.syncs_per_step,
                    "sync_checked_steps": summary.sync_checked_steps,
                    "params": params, "optimizer": describe_optimizer(job),
                    # parameters the gather of params_current changed (stale before it)
                    "stale": sorted(k for k in params if not torch.equal(before[k], params[k])),
                    "trainable": sum(p.numel() for p in job.model.parameters() if p.requires_grad),
                }
                del job
            except Exception as exc:  # noqa: BLE001 -- recorded; the test shows it
                torch.save({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}, path)
                break
            torch.save(result, path)
            settle()


if __name__ == "__main__":
    main(*sys.argv[1:3])
