"""Test-only worker: the main job's runs listed in ``spec.json`` trained one after the other in
this process, each as ``python -m megatron_fastpath.train <overrides>`` trains it (Hydra's
composition of the overrides, ``megatron_fastpath.train.run``), started as a fresh process would
(``main_job.fresh_process_state``); under ``torchrun`` for runs of a world of 2::

    torchrun --nproc_per_node=2 -m tests.workers.main_jobs_worker <spec.json>

``spec.json``: ``[[override, ...], ...]``; each run writes its summary where its
``training.summary_json`` says. A run that raises ends the process (in a world of 2 the ranks'
collectives no longer pair up): the runs after it leave no summary, which the test reports.
One process pays the interpreter's start and the imports of torch, Megatron and transformers
once for all its runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(spec: str) -> None:
    from megatron_fastpath.train import run
    from tests.support.hydra_compose import compose_job
    from tests.support.main_job import fresh_process_state

    for overrides in json.loads(Path(spec).read_text()):
        fresh_process_state()
        run(compose_job(overrides))


if __name__ == "__main__":
    main(sys.argv[1])
