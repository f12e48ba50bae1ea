"""Deterministic synthetic SFT data and a packing collator (first-fit-decreasing).

Each sample is a short "prompt + response" token sequence: an arithmetic progression modulo
the vocabulary (start and stride drawn per sample), so the continuation is learnable only by
attending to the previous tokens *of the same sequence* -- a packing bug (attention leaking
across boundaries, positions not reset) shows up as a loss that does not fall. The loss is
taken on the response tokens only, as in SFT.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import operator
from typing import Optional

import numpy as np
import torch

from megatron_fastpath.packed_seq.packing import first_fit_decreasing_arrays
from megatron_fastpath.settings import NON_NEGATIVE, POSITIVE, setting

__all__ = ["BATCH_UNITS", "PAD_MULTIPLE", "PAD_MULTIPLE_HELP", "BatchSize", "DataConfig",
           "PackedMicrobatch", "PackedBins", "SyntheticSFTDataset", "pack_microbatches", "StepBatch",
           "StepData", "EpochOrder", "epoch_order", "pack_bins", "resolve_batch", "train_step_data"]


# data.pad_multiple (both data groups): packing counts each sample as its length rounded up to
# it, so the bins -- and the data of every step -- are a function of the data settings alone,
# the same at every context-parallel size whose 2 x CP divides it (the packed cache pads each
# sequence to 2 x CP, the THD + CP contract: Megatron's
# _get_batch_on_this_cp_rank_per_document_balancing, megatron/core/utils.py:2413-2414 at 0.19.2,
# and Transformer Engine's thd_get_partitioned_indices behind it; rules._pad_multiple refuses
# the rest at parse). 8 covers CP 1, 2 and 4; it costs the padding of a sample's length to 8,
# (8 - 1) / 2 = 3.5 tokens a sample on average: the default job packs 111 microbatches (106
# with data.pad_multiple=2, 105 with 1).
PAD_MULTIPLE = 8
PAD_MULTIPLE_HELP = ("each sample counts as its length rounded up to this when packed (the tokens "
                     "stay unpadded): the packing, and so each step's data, is the same at every "
                     "parallel.context_parallel_size whose 2 x CP divides it (8: CP 1, 2, 4)")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The ``data`` group of the synthetic SFT samples (``data=synthetic_sft``)."""

    num_samples: int = setting(2048, "synthetic samples per epoch", POSITIVE)
    min_len: int = setting(8, "shortest sample (lengths uniform in [min_len, max_len])", POSITIVE)
    max_len: int = setting(96, "longest sample", POSITIVE)
    prompt_len: int = setting(3, "tokens of each sample excluded from the loss (its prompt)", NON_NEGATIVE)
    max_tokens: int = setting(512, "packed microbatch capacity in tokens (the cache's static size)", POSITIVE)
    max_seqs: int = setting(32, "most sequences in one packed microbatch (the cache's static size)", POSITIVE)
    pad_multiple: int = setting(PAD_MULTIPLE, PAD_MULTIPLE_HELP, POSITIVE)
    max_strides: int = setting(3, "each sample's token stride drawn from 1..max_strides", POSITIVE)
    seed: int = setting(1234, "seed of the samples and of each epoch's order")


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


def pack_microbatches(dataset: SyntheticSFTDataset, cfg: DataConfig) -> "PackedBins":
    """First-fit-decreasing packing of the whole dataset into bins (every data-parallel rank
    packs the same bins; the main job deals them out), each sample counted as its length
    rounded up to ``cfg.pad_multiple`` (the tokens stay unpadded). The bins are packed from the
    lengths and the data settings alone; each microbatch is made when read (:class:`PackedBins`)."""
    arrays = first_fit_decreasing_arrays(dataset.lengths, cfg.max_tokens, cfg.max_seqs,
                                         cfg.pad_multiple)
    return PackedBins(dataset, cfg, arrays)


class PackedBins(collections.abc.Sequence):
    """The packed microbatches of ``bins`` (lists of sample indices of ``dataset``, or the
    ``(members, starts)`` arrays of :func:`first_fit_decreasing_arrays`), in that order, each
    padded to ``max_tokens`` when read (:func:`pack_bins`); the ``KEEP`` most recently read are
    kept, so reading one again gives the same object. Memory: the bins' sample indices (8 bytes
    a sample), not every padded microbatch (20 bytes x max_tokens a bin). Slices are tuples."""

    KEEP = 256

    def __init__(self, dataset, cfg, bins):
        if isinstance(bins, tuple) and len(bins) == 2 and isinstance(bins[0], np.ndarray):
            members, starts = bins
        else:
            sizes = [len(b) for b in bins]
            members = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=sum(sizes))
            starts = np.zeros(len(sizes) + 1, dtype=np.int64)
            np.cumsum(sizes, out=starts[1:])
        self.dataset, self.cfg, self.members, self.starts = dataset, cfg, members, starts
        self._kept: dict = {}

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def sizes(self) -> np.ndarray:
        """Samples per bin."""
        return np.diff(self.starts)

    @property
    def num_sequences(self) -> int:
        """Samples in all the bins."""
        return len(self.members)

    @property
    def num_tokens(self) -> int:
        """Tokens (unpadded) in all the bins."""
        return int(np.asarray(self.dataset.lengths)[self.members].sum())

    @property
    def longest(self) -> int:
        """The longest sample of any bin (0: no bins)."""
        return int(np.asarray(self.dataset.lengths)[self.members].max()) if len(self.members) else 0

    def indices(self, k: int) -> list:
        return self.members[self.starts[k]: self.starts[k + 1]].tolist()

    def every(self, start: int, step: int) -> "PackedBins":
        """Bins ``start``, ``start + step``, ... (a data-parallel rank's share), unpacked."""
        picked = range(start, len(self), step)
        return PackedBins(self.dataset, self.cfg, [self.indices(k) for k in picked])

    def __getitem__(self, k):
        if isinstance(k, slice):
            return tuple(self[j] for j in range(*k.indices(len(self))))
        k = operator.index(k)
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(f"bin {k} of {len(self)}")
        mb = self._kept.pop(k, None)
        if mb is None:
            (mb,) = pack_bins(self.dataset, self.cfg, [self.indices(k)])
        self._kept[k] = mb  # most recent last
        if len(self._kept) > self.KEEP:
            del self._kept[next(iter(self._kept))]
        return mb


def pack_bins(dataset, cfg, bins) -> list[PackedMicrobatch]:
    """The microbatches of ``bins`` (lists of sample indices of ``dataset``), in that order."""
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
        lengths = dataset.lengths[list(b)].astype(np.int64)
        out.append(PackedMicrobatch(tokens, labels, mask, lengths, int(mask.sum())))
    return out


def epoch_order(lengths, max_tokens: int, max_seqs: int, seed: int, epoch: int,
                pad_multiple: int = 1) -> list[list[int]]:
    """Epoch ``epoch``'s packed order (0-based), a function of ``(seed, epoch)`` only: the
    samples shuffled by ``numpy.random.default_rng([seed, epoch])``, packed first-fit-decreasing
    in that order (equal lengths land in bins in the shuffled order, so bins change their
    samples), then the bins shuffled by the same generator. Bins as lists of sample indices;
    every sample is in exactly one bin. The number of bins is the same every epoch:
    first-fit-decreasing depends on the lengths only, not on which of equal-length samples goes
    where."""
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(len(lengths))
    members, starts = first_fit_decreasing_arrays(np.asarray(lengths)[perm], max_tokens, max_seqs,
                                                  pad_multiple)
    members = perm[members]
    return [members[starts[k]: starts[k + 1]].tolist() for k in rng.permutation(len(starts) - 1)]


class EpochOrder:
    """``training.epochs``: the data reshuffled and repacked every epoch (:func:`epoch_order`).
    The global microbatches form one stream, epoch 0's bins then epoch 1's ...; step ``s`` takes
    stream positions ``(s-1)*per_step`` to ``s*per_step - 1`` (a step may straddle two epochs).
    Holds the packed microbatches of the two most recent epochs asked for."""

    def __init__(self, dataset, cfg, epochs: int, seed: int):
        self.dataset, self.cfg, self.epochs, self.seed = dataset, cfg, epochs, seed
        self._orders: dict = {}
        self._bins: dict = {}
        self.num_bins = len(self.order(0))  # every epoch's (first-fit-decreasing: the lengths')

    def order(self, epoch: int) -> list[list[int]]:
        if epoch not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k >= epoch - 1}
            self._orders[epoch] = epoch_order(self.dataset.lengths, self.cfg.max_tokens,
                                              self.cfg.max_seqs, self.seed, epoch, self.cfg.pad_multiple)
        return self._orders[epoch]

    def bins(self, epoch: int) -> tuple:
        if epoch not in self._bins:
            self._bins = {k: v for k, v in self._bins.items() if k >= epoch - 1}
            self._bins[epoch] = PackedBins(self.dataset, self.cfg, self.order(epoch))
            if len(self._bins[epoch]) != self.num_bins:  # the steps assume it (see epoch_order)
                raise RuntimeError(f"epoch {epoch} packs into {len(self._bins[epoch])} bins, "
                                   f"epoch 0 into {self.num_bins}")
        return self._bins[epoch]

    def steps(self, per_step: int) -> int:
        """Steps of ``epochs`` epochs: every whole step of the stream (the last epoch's final
        ``< per_step`` microbatches, if any, are not trained)."""
        return self.epochs * self.num_bins // per_step

    def samples_before(self, epoch: int, index: int) -> int:
        """Samples in the stream before position ``index`` of epoch ``epoch``."""
        return epoch * len(self.dataset.lengths) + sum(len(b) for b in self.order(epoch)[:index])


# training.batch_sequences / training.batch_tokens: the batch a step trains, in these units
BATCH_UNITS = ("sequences", "tokens")


@dataclasses.dataclass(frozen=True)
class BatchSize:
    """``training.batch_<unit>=asked`` resolved on the packed data (:func:`resolve_batch`):
    ``micro_batches`` packed microbatches per data-parallel rank a step; ``per_step`` the
    ``unit`` a step trains on average over all ranks."""

    unit: str  # one of BATCH_UNITS
    asked: int
    micro_batches: int
    per_step: float

    @property
    def key(self) -> str:
        return f"training.batch_{self.unit}"

    def describe(self) -> str:
        return (f"{self.key}={self.asked}: {self.micro_batches} packed microbatches per rank per "
                f"step, {self.per_step:,.1f} {self.unit} per step on average")


def resolve_batch(training, bins, max_tokens: int, dp_world: int) -> Optional[BatchSize]:
    """``training.batch_sequences`` / ``training.batch_tokens`` (None: neither set) as a whole
    number of packed microbatches per data-parallel rank: the number nearest to ``asked /
    (dp_world x mean)`` (a tie rounds up), ``mean`` the sequences (or unpadded tokens) of
    ``bins`` over their count -- exact integer arithmetic, so every rank and every rerun resolve
    the same. With ``training.epochs``, ``bins`` is epoch 0's packing: every epoch packs the same
    samples into as many bins, so the mean is every epoch's. A batch under one microbatch per
    rank is refused (a step trains whole bins: static shapes)."""
    unit = next((u for u in BATCH_UNITS if getattr(training, f"batch_{u}", None) is not None), None)
    if unit is None:
        return None
    asked, num_bins = getattr(training, f"batch_{unit}"), len(bins)
    if isinstance(bins, PackedBins):
        total = bins.num_sequences if unit == "sequences" else bins.num_tokens
    else:  # a sequence of PackedMicrobatch
        total = sum(len(mb.lengths) if unit == "sequences" else mb.num_tokens for mb in bins)
    if asked * num_bins < dp_world * total:
        raise ValueError(
            f"training.batch_{unit}={asked} is less than one packed microbatch per data-parallel "
            f"rank: the packed data holds {total / num_bins:,.1f} {unit} per microbatch on average "
            f"(data.max_tokens={max_tokens}) x {dp_world} rank{'s' if dp_world > 1 else ''}, and a "
            f"step trains whole microbatches; set training.batch_{unit} >= "
            f"{-(-dp_world * total // num_bins)} (or lower data.max_tokens)")
    n = (2 * asked * num_bins + dp_world * total) // (2 * dp_world * total)  # nearest, ties up
    return BatchSize(unit, asked, n, n * dp_world * total / num_bins)


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Microbatches of one step: this rank's share, and host counts over the global batch."""

    step: int
    microbatches: tuple
    global_tokens: int
    global_loss_tokens: int


@dataclasses.dataclass(frozen=True)
class StepData:
    """Packed microbatches and which of them each step trains on (same on every rank).

    Without ``epochs`` (``training.epochs`` unset) the steps cycle through one packed order,
    ``bins`` (a :class:`PackedBins` or a tuple of microbatches). With it, the order is
    reshuffled and repacked every epoch (:class:`EpochOrder`; ``bins`` is epoch 0's).
    ``batch_size``: ``training.batch_sequences`` / ``batch_tokens`` as resolved into
    ``micro_batches`` (:func:`resolve_batch`; None when ``training.micro_batches`` sets it)."""

    bins: tuple
    micro_batches: int
    dp_rank: int
    dp_world: int
    epochs: Optional[EpochOrder] = None
    batch_size: Optional[BatchSize] = None

    @property
    def batch_key(self) -> str:
        """The setting that sets ``micro_batches`` (for messages)."""
        return self.batch_size.key if self.batch_size is not None else "training.micro_batches"

    @property
    def num_microbatches(self) -> int:
        return len(self.bins)

    @property
    def per_step(self) -> int:
        return self.micro_batches * self.dp_world

    def position(self, step: int) -> tuple:
        """``(epoch, index)`` of step ``step``'s first global microbatch: the data position
        (epoch None without ``training.epochs``: ``index`` is then in ``bins``)."""
        if self.epochs is None:
            return None, ((step - 1) * self.per_step) % (len(self.bins) - self.per_step + 1)
        return divmod((step - 1) * self.per_step, len(self.bins))

    def first_microbatch(self, step: int) -> int:
        """Index of step ``step``'s first global microbatch in its epoch's order (in ``bins``
        without ``training.epochs``)."""
        return self.position(step)[1]

    def global_microbatches(self, step: int) -> tuple:
        epoch, first = self.position(step)
        if epoch is None:
            return self.bins[first: first + self.per_step]
        out, n = [], len(self.bins)
        for g in range((step - 1) * self.per_step, step * self.per_step):
            out.append(self.epochs.bins(g // n)[g % n])
        return tuple(out)

    def consumed_samples(self, step: int) -> int:
        """Samples trained on in steps 1..``step``."""
        if self.epochs is None:  # from the samples per bin (no microbatch is packed for it)
            sizes = (self.bins.sizes if isinstance(self.bins, PackedBins)
                     else np.asarray([len(mb.lengths) for mb in self.bins], dtype=np.int64))
            csum = np.concatenate([[0], np.cumsum(sizes)])
            firsts = np.asarray([self.first_microbatch(s) for s in range(1, step + 1)], dtype=np.int64)
            return int((csum[firsts + self.per_step] - csum[firsts]).sum())
        return self.epochs.samples_before(*divmod(step * self.per_step, len(self.bins)))

    def batch(self, step: int) -> StepBatch:
        """Step ``step`` (1-based): the global microbatches and this rank's share of them."""
        global_mbs = self.global_microbatches(step)
        mine = global_mbs[self.dp_rank * self.micro_batches: (self.dp_rank + 1) * self.micro_batches]
        return StepBatch(
            step=step, microbatches=tuple(mine),
            global_tokens=sum(mb.num_tokens for mb in global_mbs),
            global_loss_tokens=sum(mb.num_loss_tokens for mb in global_mbs),  # host ints
        )


def train_step_data(dataset, cfg, dp_rank: int, dp_world: int) -> StepData:
    """The job's train order of ``dataset`` (``cfg``: the job config): one first-fit-decreasing
    packing cycled through, or with ``training.epochs`` a reshuffle + repack per epoch seeded by
    ``data.seed``; ``training.micro_batches`` each step per rank, or the number
    ``training.batch_sequences`` / ``batch_tokens`` resolves to on the packing
    (:func:`resolve_batch`). The caller refuses fewer packed microbatches than one step takes."""
    epochs = cfg.training.epochs
    order = None
    if epochs is None:
        bins = pack_microbatches(dataset, cfg.data)
    else:
        order = EpochOrder(dataset, cfg.data, epochs, cfg.data.seed)
        bins = order.bins(0)
    batch = resolve_batch(cfg.training, bins, cfg.data.max_tokens, dp_world)
    micro_batches = batch.micro_batches if batch is not None else cfg.training.micro_batches
    return StepData(bins, micro_batches, dp_rank, dp_world, order, batch)
