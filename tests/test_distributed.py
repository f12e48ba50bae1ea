"""megatron_fastpath.distributed.init_distributed on 2 CPU processes (gloo)."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.subproc import free_port


def _relayout(rank, world, port, out):
    """One rank: init at CP=2, again with every size 1, again at CP=2; the CP size seen."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from megatron_fastpath.distributed import destroy_distributed, init_distributed

    seen = []
    for cp in (2, 1, 1, 2):
        init_distributed(backend="gloo", context_parallel_size=cp)
        seen.append(ps.get_context_parallel_world_size())
    destroy_distributed()
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(seen, f)


@pytest.mark.integration
def test_init_distributed_follows_a_change_of_the_context_parallel_size(tmp_path):
    """A second init_distributed in one process with another CP size (the other sizes equal)
    re-initialises Megatron's parallel state; with the same sizes it keeps it. Every size is compared: a CP=2
    state kept for a CP=1 job would give it the wrong context-parallel group."""
    out = str(tmp_path / "seen")
    mp.spawn(_relayout, args=(2, free_port(), out), nprocs=2, join=True)
    for rank in range(2):
        with open(f"{out}.rank{rank}") as f:
            assert json.load(f) == [2, 1, 1, 2]
