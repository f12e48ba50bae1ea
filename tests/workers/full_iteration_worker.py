"""Test-only torchrun worker: the main job's GPU step (inside the GPU stand-ins) trained twice
in one process -- eager, then with ``cuda_graphs.scope=full_iteration`` -- on the same data and
seed; each rank writes both runs' per-step (loss, lr, grad norm, launches) and the largest
difference of its final parameter shards to ``<out>.rank<r>.json``::

    torchrun --nproc_per_node=2 -m tests.workers.full_iteration_worker <out> <overrides...>
"""

from __future__ import annotations

import json
import sys

import torch


def _train(overrides):
    from tests.support.hydra_compose import compose_job
    from tests.support.main_job import train_in_standins

    return train_in_standins(compose_job(overrides))


def main(out: str, overrides: list) -> None:
    from tests.support.hydra_compose import features_on

    # each run keeps a feature group's settings only with its switch on (the parse refuses them
    # while it is off)
    eager, job_e = _train(features_on(overrides))
    full, job_f = _train(features_on(overrides + ["fastpath.cuda_graphs=true", "cuda_graphs.scope=full_iteration"]))
    pe = {k: v.detach().float() for k, v in job_e.model.state_dict().items() if torch.is_tensor(v)}
    pf = {k: v.detach().float() for k, v in job_f.model.state_dict().items() if torch.is_tensor(v)}
    assert pe.keys() == pf.keys()
    rel = max(((pf[k] - pe[k]).abs() / pe[k].abs().clamp(min=1e-6)).max().item() for k in pe)
    records = {name: [[r.step, r.loss, r.lr, r.grad_norm, r.graph_launches] for r in s.records]
               for name, s in (("eager", eager), ("full", full))}
    rank = torch.distributed.get_rank()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"records": records, "max_param_rel_diff": rel}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
