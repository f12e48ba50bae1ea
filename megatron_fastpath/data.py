"""Deterministic synthetic SFT data and a packing collator (first-fit-decreasing).

Each sample is a short "prompt + response" token sequence: an arithmetic progression modulo
the vocabulary (start and stride drawn per sample), so the continuation is learnable only by
attending to the previous tokens *of the same sequence* -- a packing bug (attention leaking
across boundaries, positions not reset) shows up as a loss that does not fall. The loss is
taken on the response tokens only, as in SFT.
"""

from __future__ import annotations

import dataclasses
import numpy as np
import torch

from megatron_fastpath.packed_seq.packing import first_fit_decreasing
from megatron_fastpath.settings import NON_NEGATIVE, POSITIVE, bounded

__all__ = ["DataConfig", "PackedMicrobatch", "SyntheticSFTDataset", "pack_microbatches", "StepBatch",
           "StepData"]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """num_samples: samples per epoch; lengths uniform in [min_len, max_len];
    prompt_len: tokens per sample excluded from the loss; max_tokens / max_seqs: bin capacity
    (the packed cache's static capacities); max_strides: strides drawn from 1..max_strides."""

    num_samples: int = bounded(2048, POSITIVE)
    min_len: int = bounded(8, POSITIVE)
    max_len: int = bounded(96, POSITIVE)
    prompt_len: int = bounded(3, NON_NEGATIVE)
    max_tokens: int = bounded(512, POSITIVE)
    max_seqs: int = bounded(32, POSITIVE)
    max_strides: int = bounded(3, POSITIVE)
    seed: int = 1234


@dataclasses.dataclass(frozen=True)
class PackedMicrobatch:
    """One packed bin, padded to max_tokens (T).

    tokens_1T / labels_1T: int64 [1, T]; loss_mask_1T: float32 [1, T] (1 on response tokens);
    lengths: host int64 [N] per-sequence lengths (input of PackedSeqCache.set_batch);
    num_loss_tokens: host int, sum of loss_mask (normaliser known without a device read).
    """

    tokens_1T: torch.Tensor
    labels_1T: torch.Tensor
    loss_mask_1T: torch.Tensor
    lengths: np.ndarray
    num_loss_tokens: int

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


class SyntheticSFTDataset:
    """Deterministic list of samples: (tokens int64 [n], loss_mask float32 [n])."""

    def __init__(self, cfg: DataConfig, vocab_size: int):
        if cfg.min_len <= cfg.prompt_len:
            raise ValueError(f"min_len={cfg.min_len} must exceed prompt_len={cfg.prompt_len}")
        if cfg.max_len > cfg.max_tokens:
            raise ValueError(f"max_len={cfg.max_len} must be <= max_tokens={cfg.max_tokens}")
        rng = np.random.default_rng(cfg.seed)
        self.lengths = rng.integers(cfg.min_len, cfg.max_len + 1, size=cfg.num_samples)
        starts = rng.integers(0, vocab_size, size=cfg.num_samples)
        strides = rng.integers(1, cfg.max_strides + 1, size=cfg.num_samples)
        self.samples = []
        for n, a, d in zip(self.lengths, starts, strides):
            tokens = (a + d * np.arange(n)) % vocab_size
            mask = np.zeros(n, dtype=np.float32)
            mask[cfg.prompt_len - 1 : n - 1] = 1.0  # predict response tokens; last has no label
            self.samples.append((tokens.astype(np.int64), mask))

    def __len__(self) -> int:
        return len(self.samples)


def pack_microbatches(dataset: SyntheticSFTDataset, cfg: DataConfig,
                      pad_multiple: int = 1) -> list[PackedMicrobatch]:
    """First-fit-decreasing packing of the whole dataset into bins (every data-parallel rank
    packs the same bins; the main job deals them out). ``pad_multiple``: each sample counts as
    its length rounded up to it (2 x CP with context parallelism; the tokens stay unpadded)."""
    bins = first_fit_decreasing(dataset.lengths.tolist(), cfg.max_tokens, cfg.max_seqs, pad_multiple)
    out = []
    for b in bins:
        tokens = torch.zeros(1, cfg.max_tokens, dtype=torch.long)
        labels = torch.zeros(1, cfg.max_tokens, dtype=torch.long)
        mask = torch.zeros(1, cfg.max_tokens, dtype=torch.float32)
        pos = 0
        for i in b:
            tok, m = dataset.samples[i]
            n = len(tok)
            tokens[0, pos : pos + n] = torch.from_numpy(tok)
            labels[0, pos : pos + n - 1] = torch.from_numpy(tok[1:])
            mask[0, pos : pos + n] = torch.from_numpy(m)
            pos += n
        lengths = dataset.lengths[b].astype(np.int64)
        out.append(PackedMicrobatch(tokens, labels, mask, lengths, int(mask.sum())))
    return out


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Microbatches of one step: this rank's share, and host counts over the global batch."""

    step: int
    microbatches: tuple
    global_tokens: int
    global_loss_tokens: int


@dataclasses.dataclass(frozen=True)
class StepData:
    """Packed microbatches and which of them each step trains on (same on every rank)."""

    bins: tuple
    micro_batches: int
    dp_rank: int
    dp_world: int

    @property
    def num_microbatches(self) -> int:
        return len(self.bins)

    @property
    def per_step(self) -> int:
        return self.micro_batches * self.dp_world

    def first_microbatch(self, step: int) -> int:
        """Index in ``bins`` of step ``step``'s first global microbatch (the data position)."""
        return ((step - 1) * self.per_step) % (len(self.bins) - self.per_step + 1)

    def global_microbatches(self, step: int) -> tuple:
        first = self.first_microbatch(step)
        return self.bins[first: first + self.per_step]

    def batch(self, step: int) -> StepBatch:
        """Step ``step`` (1-based): the global microbatches and this rank's share of them."""
        global_mbs = self.global_microbatches(step)
        mine = global_mbs[self.dp_rank * self.micro_batches: (self.dp_rank + 1) * self.micro_batches]
        return StepBatch(
            step=step, microbatches=tuple(mine),
            global_tokens=sum(mb.num_tokens for mb in global_mbs),
            global_loss_tokens=sum(mb.num_loss_tokens for mb in global_mbs),  # host ints
        )
