"""``training.batch_sequences`` / ``training.batch_tokens``: the batch per step in sequences or
tokens, resolved into whole packed microbatches per data-parallel rank once the data is packed
(``data.resolve_batch``); at most one of them and ``training.micro_batches`` is set."""

from fractions import Fraction

import numpy as np
import pytest

from tests.support.hydra_compose import compose_job
from tests.support.main_job import train_in_process

from megatron_fastpath.data import PackedBins, resolve_batch
from megatron_fastpath.train import parse_job_config
from megatron_fastpath.train.checkpointing import fingerprint_config
from megatron_fastpath.train.config import TrainingConfig
from megatron_fastpath.train.dry_run import dry_run

# 96 samples of 8..40 tokens in bins of <= 128 tokens / 8 sequences: about 30 bins
SMALL = ["data.num_samples=96", "data.max_len=40", "data.max_tokens=128", "data.max_seqs=8",
         "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64",
         "metrics.wandb=off", "metrics.tensorboard=false", "metrics.plot=false"]


class _Lengths:
    """What :class:`PackedBins` reads of a dataset to count its bins' tokens."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths)


# 4 bins of 3, 2, 2 and 1 sequences: 8 sequences, 2 a bin on average; 60 + 150 + 120 + 200 = 530
# tokens, 132.5 a bin on average
BINS = PackedBins(_Lengths([10, 20, 30, 100, 50, 60, 60, 200]), None, [[0, 1, 2], [3, 4], [5, 6], [7]])


@pytest.mark.parametrize("unit, asked, dp, bins, per_step", [
    ("sequences", 5, 1, 3, 6.0),  # 2.5 bins: a tie rounds up
    ("sequences", 4, 1, 2, 4.0),
    ("sequences", 2, 1, 1, 2.0),  # exactly one bin
    ("sequences", 4, 2, 1, 4.0),  # over all ranks: one bin each of 2 ranks
    ("sequences", 6, 2, 2, 8.0),  # 1.5 bins per rank -> 2
    ("tokens", 133, 1, 1, 132.5),
    ("tokens", 331, 1, 2, 265.0),  # 2.498 bins -> 2
    ("tokens", 332, 1, 3, 397.5),  # 2.506 bins -> 3
    ("tokens", 400, 1, 3, 397.5),
])
def test_nearest_whole_number_of_bins_per_rank(unit, asked, dp, bins, per_step):
    batch = resolve_batch(TrainingConfig(**{f"batch_{unit}": asked}), BINS, 128, dp)
    assert (batch.unit, batch.asked, batch.micro_batches, batch.per_step) == (unit, asked, bins, per_step)


@pytest.mark.parametrize("unit, asked, dp, least, mean", [
    ("sequences", 1, 1, 2, "2.0"), ("sequences", 3, 2, 4, "2.0"), ("tokens", 132, 1, 133, "132.5")])
def test_a_batch_under_one_bin_per_rank_is_refused(unit, asked, dp, least, mean):
    ranks = "1 rank" if dp == 1 else f"{dp} ranks"
    with pytest.raises(ValueError) as err:
        resolve_batch(TrainingConfig(**{f"batch_{unit}": asked}), BINS, 128, dp)
    assert str(err.value) == (
        f"training.batch_{unit}={asked} is less than one packed microbatch per data-parallel rank: "
        f"the packed data holds {mean} {unit} per microbatch on average (data.max_tokens=128) x "
        f"{ranks}, and a step trains whole microbatches; set training.batch_{unit} >= {least} (or "
        "lower data.max_tokens)")


def test_neither_key_resolves_nothing():
    assert resolve_batch(TrainingConfig(micro_batches=3), BINS, 128, 1) is None


@pytest.mark.parametrize("overrides, named", [
    (["training.batch_sequences=16", "training.batch_tokens=2048"],
     "training.batch_sequences=16 and training.batch_tokens=2048"),
    (["training.micro_batches=2", "training.batch_sequences=16"],
     "training.micro_batches=2 and training.batch_sequences=16"),
    (["training.micro_batches=4", "training.batch_tokens=2048"],
     "training.micro_batches=4 and training.batch_tokens=2048"),
    (["training.micro_batches=1", "training.batch_sequences=8", "training.batch_tokens=64"],
     "training.micro_batches=1 and training.batch_sequences=8 and training.batch_tokens=64"),
])
def test_more_than_one_batch_key_is_refused_at_parse(overrides, named):
    with pytest.raises(ValueError) as err:
        parse_job_config(compose_job(overrides))
    assert str(err.value) == (
        f"{named} are set together: each sets the batch a step trains (packed microbatches per "
        "rank, or sequences / tokens per step resolved into them from the packed data), so they "
        "can contradict; set one of training.micro_batches, training.batch_sequences, "
        "training.batch_tokens and leave the others null")


def test_parse_without_batch_keys_keeps_two_microbatches_and_the_fingerprint():
    cfg = parse_job_config(compose_job([]))
    t = cfg.training
    assert (t.micro_batches, t.batch_sequences, t.batch_tokens) == (2, None, None)
    assert parse_job_config(compose_job(["training.micro_batches=3"])).training.micro_batches == 3
    training = fingerprint_config(cfg, 1)["training"]
    assert training["global_micro_batches"] == 2
    assert not {"batch_sequences", "batch_tokens", "micro_batches"} & set(training)
    # a batch key is known as what it resolves to: unset until the data is packed
    assert parse_job_config(compose_job(["training.batch_tokens=512"])).training.micro_batches is None
    with pytest.raises(ValueError, match=r"^training.batch_sequences=0: must be > 0"):
        parse_job_config(compose_job(["training.batch_sequences=0"]))


def _nearest(asked: int, total: int, bins: int) -> int:
    """The whole number of bins k >= 1 whose mean content k x total / bins is nearest to
    ``asked`` (the larger k on a tie), by search."""
    mean = Fraction(total, bins)
    return min(range(1, bins + 1), key=lambda k: (abs(k * mean - asked), -k))


@pytest.mark.parametrize("unit, asked", [("sequences", 14), ("tokens", 600)])
def test_main_job_trains_the_bins_the_packing_gives(mcore_parallel, capsys, unit, asked):
    """The resolved count is the nearest whole number of bins the packed data's mean gives,
    counted from the microbatches the job trains on; every step trains that many; the start-up
    line says so; the fingerprint is that of training.micro_batches=<the count>."""
    job, summary = train_in_process(SMALL + ["training.steps=3", f"training.batch_{unit}={asked}"],
                                    header=True)
    out = capsys.readouterr().out
    bins = list(job.data.bins)  # the loader's packed microbatches
    sequences = sum(len(mb.lengths) for mb in bins)
    tokens = sum(int(mb.lengths.sum()) for mb in bins)
    assert sequences == 96  # every sample in one bin
    total = sequences if unit == "sequences" else tokens
    n = _nearest(asked, total, len(bins))
    assert n > 2  # not the default
    assert job.cfg.training.micro_batches == job.data.micro_batches == n
    for step in range(1, 4):
        assert len(job.data.batch(step).microbatches) == n
    assert len(summary.records) == 3
    per_step = n * total / len(bins)
    assert job.data.batch_size.per_step == pytest.approx(per_step, rel=1e-12)
    assert (f"packed microbatches (sequences <= 64 tokens), training.batch_{unit}={asked}: {n} packed "
            f"microbatches per rank per step, {per_step:,.1f} {unit} per step on average, ") in out
    same = parse_job_config(compose_job(SMALL + ["training.steps=3", f"training.micro_batches={n}"]))
    assert fingerprint_config(job.cfg, 1) == fingerprint_config(same, 1)


def test_epochs_count_steps_in_resolved_bins(mcore_parallel):
    job, summary = train_in_process(SMALL + ["training.epochs=1", "training.batch_tokens=600"])
    bins = list(job.data.bins)
    n = _nearest(600, sum(int(mb.lengths.sum()) for mb in bins), len(bins))
    assert job.cfg.training.micro_batches == n and job.cfg.training.steps == len(bins) // n
    assert len(summary.records) == len(bins) // n


def test_dry_run_prints_the_batch_and_refuses_one_under_a_bin():
    lines = []
    plan = dry_run(parse_job_config(compose_job(SMALL + ["training.batch_sequences=14"])), log=lines.append)
    batch = plan["batch"]
    assert plan["microbatches_per_step"] == batch["micro_batches"] > 2
    assert f"  batch: training.batch_sequences=14: {batch['micro_batches']} packed microbatches" in "\n".join(lines)
    assert "batch" not in dry_run(parse_job_config(compose_job(SMALL)), log=lambda s: None)
    with pytest.raises(ValueError, match=r"^training.batch_sequences=1 is less than one packed "
                       r"microbatch per data-parallel rank: .*; set training.batch_sequences >= \d+ "
                       r"\(or lower data.max_tokens\)$"):
        dry_run(parse_job_config(compose_job(SMALL + ["training.batch_sequences=1"])), log=lambda s: None)


def test_a_batch_larger_than_the_data_names_its_key():
    with pytest.raises(ValueError, match=r"^only \d+ packed microbatches for \d+ per step; raise "
                       r"data.num_samples or lower training.batch_tokens$"):
        dry_run(parse_job_config(compose_job(SMALL + ["training.batch_tokens=100000"])), log=lambda s: None)
