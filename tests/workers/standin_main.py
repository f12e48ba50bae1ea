"""Test-only launcher: the main job (``python -m megatron_fastpath.train``) inside the GPU
stand-ins (``tests/support/graph_safe_standins.py``), so ``training.device=cuda`` runs on a CPU,
in one process or under ``torchrun``::

    torchrun --nproc_per_node=2 -m tests.workers.standin_main <overrides>

(``tests.support.main_job.run_main_job(..., entry=["-m", "tests.workers.standin_main"])``).
"""

from tests.support.graph_safe_standins import gpu_standins

if __name__ == "__main__":
    from megatron_fastpath.train import main

    with gpu_standins():
        main()
