"""Test-only launcher: the main job inside the GPU stand-ins (``standin_main.py``) with the fake
Transformer Engine (``tests/support/fake_te``) importable, so ``fastpath.linear_impl=te`` and
``fastpath.fp8=true`` build Megatron's TE layers on a CPU::

    torchrun --nproc_per_node=2 -m tests.workers.te_standin_main <overrides>
"""

from tests.support.fake_te.activate import activate

activate()  # before Megatron is imported: its HAVE_TE is decided at import time

from tests.support.graph_safe_standins import gpu_standins  # noqa: E402

if __name__ == "__main__":
    from megatron_fastpath.train import main

    with gpu_standins():
        main()
