"""Child-process worker: every main job ``benchmarks/gpu_check.py`` runs, parsed with
``training.device=cuda`` as the check parses them on a GPU, inside the GPU stand-ins with the fake
Transformer Engine importable (TE and flash-attn reported installed); prints the refusals as JSON.

    python -m tests.workers.gpu_check_parse_worker
"""

from tests.support.fake_te.activate import activate

activate()  # before Megatron is imported

import json  # noqa: E402

if __name__ == "__main__":
    from tests.support.gpu_check_jobs import parse_all

    print(json.dumps(parse_all(te=True, flash=True)))
