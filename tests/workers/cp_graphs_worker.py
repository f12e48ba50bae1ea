"""One rank of ``tests/train/test_context_parallel_graphs.py``'s launches: the main job inside
the GPU stand-ins (``tests/support/graph_safe_standins.py``), then this rank's graph counts --
each layer's captured graphs, the replays (counted at the fake graph's waits) and the step's
packings -- written to ``$CP_GRAPHS_STATS/rank<r>.json``.

    torchrun --nproc_per_node=2 -m tests.workers.cp_graphs_worker <overrides>
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path


def _launch() -> None:
    """One rank: the main job inside the stand-ins; counts written after it returns."""
    from unittest import mock

    import megatron_fastpath.train as train_mod
    from megatron_fastpath.train import loop
    from tests.support import graph_safe_standins
    from tests.support.graph_safe_standins import gpu_standins
    from tests.support.cp_graphs import counting_replays, layer_graphs

    jobs, replayed = [], collections.Counter()
    real_build, real_waited = loop.build_job, graph_safe_standins._waited

    def build_job(cfg):
        jobs.append(real_build(cfg))
        return jobs[-1]

    with mock.patch.object(loop, "build_job", build_job), \
            mock.patch.object(graph_safe_standins, "_waited", counting_replays(real_waited, replayed)), \
            gpu_standins():
        train_mod.main()
    (job,) = jobs
    layers = layer_graphs(job.model)
    steps = job.cfg.training.steps
    packings = [[list(map(int, mb.lengths)) for mb in job.data.batch(s).microbatches]
                for s in range(1, steps + 1)]
    rank = int(os.environ.get("RANK", "0"))
    out = Path(os.environ["CP_GRAPHS_STATS"]) / f"rank{rank}.json"
    out.write_text(json.dumps(dict(layers=layers, replayed=dict(replayed), packings=packings)))


if __name__ == "__main__":
    _launch()
