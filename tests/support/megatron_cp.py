"""Test-only: Megatron's own context-parallel batch split, called the same way on every
supported megatron-core line."""


def megatron_cp_split(batch: dict) -> dict:
    """This CP rank's load-balanced chunks (r and 2 CP - 1 - r of dim 1) of every tensor in
    ``batch``, by Megatron's ``get_batch_on_this_cp_rank`` on parallel_state's CP group.

    The group is passed on both lines: 0.16.1 falls back to parallel_state's CP group without
    it (megatron/core/utils.py:1994-2019), 0.19.2 to the default (world) group
    (megatron/core/utils.py:2652-2653 -> 2483). megatron-core 0.19 also adds a required
    ``is_hybrid_cp`` (utils.py:2612-2614 in 0.19.2); ``False`` with no ``cu_seqlens`` is the
    per-sequence split 0.16.1 does."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_fastpath import compat

    extra = {"is_hybrid_cp": False} if compat.mcore_line() >= (0, 19) else {}
    return get_batch_on_this_cp_rank(dict(batch), cp_group=parallel_state.get_context_parallel_group(),
                                     **extra)
