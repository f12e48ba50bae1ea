"""The cache's derived kinds are data (packed_seq.derived.DERIVED_KINDS): each registry entry
allocates and builds its fields; an unknown kind is refused naming the known ones."""

import pytest
import torch

from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig, RopeConfig
from megatron_fastpath.packed_seq.derived import DERIVED_KINDS, derived_kind


def test_unknown_derived_kind_is_refused_naming_the_known_kinds():
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=16, max_seqs=4, rope=RopeConfig(dim=4)))
    known = (r"\['real_mask', 'rope_cos_sin', 'rope_freqs', 'rope_cos_sin_local', 'sdpa_mask', "
             r"'sdpa_padded', 'flex_block_mask', 'sdpa_mask_window', 'flex_block_mask_window'\]")
    with pytest.raises(ValueError, match=rf"unknown derived kind 'sdpa_masks'.*known kinds {known}"):
        cache.register("sdpa_masks")
    with pytest.raises(ValueError, match="unknown derived kind 'nope'"):
        derived_kind("nope")
    assert cache.stats.per_kind == {} and not cache._kinds


@pytest.mark.parametrize("kind", list(DERIVED_KINDS))
def test_every_registered_kind_allocates_and_builds_through_its_registry_entry(kind):
    """Each kind of the registry allocates its fields (in the compute dtype when it takes one)
    and is built once per batch; kinds needing RoPE are refused without it, windowed kinds
    without a window (and the others with one)."""
    spec = DERIVED_KINDS[kind]
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=16, max_seqs=4, rope=RopeConfig(dim=4),
                                           rope_local=RopeConfig(dim=4, base=100.0)))
    before = set(cache.slots[0].params.tensors())
    window = 3 if spec.windowed else None
    with pytest.raises(ValueError, match="needs a sliding window" if spec.windowed else "takes no window"):
        cache.register(kind, torch.bfloat16, window=None if spec.windowed else 3)
    cache.register(kind, torch.bfloat16, window=window)
    assert cache.window == window
    added = {n: t for n, t in cache.slots[0].params.tensors().items() if n not in before}
    assert bool(added) == (kind != "real_mask")
    if spec.compute_dtype:
        assert {t.dtype for t in added.values()} == {torch.bfloat16}
    with cache.batch([5, 3]):
        pass
    assert cache.stats.per_kind == {kind: 1}
    if spec.needs_rope:
        with pytest.raises(ValueError, match="PackedSeqConfig.rope is None"):
            PackedSeqCache(PackedSeqConfig(max_tokens=16, max_seqs=4)).register(kind)
    if spec.needs_rope_local:  # the second RoPE (Gemma 3's local base)
        with pytest.raises(ValueError, match="PackedSeqConfig.rope_local is None"):
            PackedSeqCache(PackedSeqConfig(max_tokens=16, max_seqs=4,
                                           rope=RopeConfig(dim=4))).register(kind)
