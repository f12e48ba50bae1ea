"""PinnedStaging: each microbatch's token ids, labels and loss mask reach the
device through a ring of pinned buffers, so no host->device copy of the GPU step is from
pageable memory (a stream sync per copy on CUDA). Under the CUDA-as-CPU mode with the
PageableCopies stand-in, which records what CUDA would synchronise."""

import torch

from tests.support.cuda_as_cpu import PageableCopies, cuda_as_cpu
from megatron_fastpath.data import PackedMicrobatch
from megatron_fastpath.packed_seq.staging import PinnedStaging

T = 16


def _mb(seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (1, T), generator=g)
    return PackedMicrobatch(tokens_1T=tokens, labels_1T=torch.roll(tokens, -1, 1),
                            loss_mask_1T=(torch.rand(1, T, generator=g) > 0.5).float(),
                            lengths=torch.tensor([T]).numpy(), num_loss_tokens=0)


def test_staged_copies_are_from_pinned_buffers_and_never_alias_them():
    mbs = [_mb(i) for i in range(5)]
    with cuda_as_cpu(), PageableCopies() as copies:
        staging = PinnedStaging(T, "cuda", num_buffers=2)
        out = [staging.to_device(mb) for mb in mbs]
        naive = mbs[0].tokens_1T.to("cuda", non_blocking=True)  # what the step did before
    assert copies.pinned == 2 * len(mbs)  # ids + mask per microbatch, from the ring
    assert [bytes_ for _, bytes_ in copies.syncs] == [T * 8]  # only the planted pageable copy
    assert "test_pinned_staging.py:" in copies.syncs[0][0]  # this file, not staging.py
    assert naive.data_ptr() == mbs[0].tokens_1T.data_ptr()  # (the mode keeps it on the CPU)
    buffers = {b.data_ptr() for b in staging.ids_2T + staging.mask_T}
    for mb, (tok, lab, mask) in zip(mbs, out):  # the refilled ring did not change earlier ones
        assert torch.equal(tok, mb.tokens_1T) and torch.equal(lab, mb.labels_1T)
        assert torch.equal(mask, mb.loss_mask_1T) and mask.dtype == torch.float32
        assert not {tok.data_ptr(), mask.data_ptr()} & buffers
    assert (staging.stats.copies, staging.stats.waits) == (5, 0)
    assert staging.stats.bytes == 5 * (2 * T * 8 + T * 4)


def test_cpu_device_uses_the_bins_as_they_are():
    mb = _mb(0)
    staging = PinnedStaging(T, "cpu")
    assert staging.ids_2T == [] and staging.to_device(mb) == (mb.tokens_1T, mb.labels_1T, mb.loss_mask_1T)
    assert staging.stats.copies == 0
