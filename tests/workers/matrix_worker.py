"""Test-only worker of the feature matrix (tests/train/feature_matrix/): trains many
combinations one after the other in this process, each straight and across a checkpoint
(tests/support/matrix_runs.py ``straight_vs_resumed``), under ``torchrun`` for the combinations
that need a world of 2::

    torchrun --nproc_per_node=2 -m tests.workers.matrix_worker <spec.json> <out> <tmp dir> [--te]

``--te``: the Transformer Engine world -- the fake TE (tests/support/fake_te) is made importable
before Megatron is (``activate``; the launcher passes ``te_env()``).

``spec.json``: ``[{"label", "tree", "feature"}]`` (the config tree the matrix classified, and
what ``straight_vs_resumed`` checks of it). After every combination each rank rewrites
``<out>.rank<r>.json``: ``[{"label", "ok", "what"}]`` or, for a combination that raised,
``{"label", "ok": false, "stage", "error_type", "error"}`` -- a failure is recorded and the next
combination runs (in a world of 2 the launch stops there: the ranks' collectives no longer pair
up). Megatron's model-parallel state is re-initialised by the job whenever the
layout changes (``init_distributed``); the job resets the rest it keeps per process.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def main(spec: str, out: str, tmp: str) -> None:
    from tests.support.matrix_runs import frozen_heap, straight_vs_resumed

    items = json.loads(Path(spec).read_text())
    results = []
    rank = os.environ.get("RANK", "0")  # torchrun's
    with frozen_heap() as settle:
        for i, item in enumerate(items):
            stage = []
            try:
                what = straight_vs_resumed(item["tree"], Path(tmp) / f"c{i}", item["feature"], stage)
                results.append({"label": item["label"], "ok": True, "what": what})
            except Exception as exc:  # noqa: BLE001 -- recorded; the test lists it and fails
                results.append({"label": item["label"], "ok": False, "stage": stage[-1] if stage else "",
                                "error_type": type(exc).__name__, "error": str(exc)[:2000],
                                "traceback": traceback.format_exc()[-3000:]})
            Path(f"{out}.rank{rank}.json").write_text(json.dumps(results, indent=1))
            if not results[-1]["ok"] and int(os.environ.get("WORLD_SIZE", "1")) > 1:
                # in a world of 2 the ranks' collectives no longer pair up after one rank's
                # failure: the next combination would wait on the other rank until the gloo
                # timeout. Stop: this rank's exit fails the other's pending collective, and the
                # test lists the combinations left without a result.
                break
            settle()


if __name__ == "__main__":
    if "--te" in sys.argv[4:]:
        from tests.support.fake_te.activate import activate

        activate()  # before Megatron is imported: its HAVE_TE is decided at import time
    main(*sys.argv[1:4])
