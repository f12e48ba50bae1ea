"""``training.epochs``: the data reshuffled and repacked every epoch, a function of
``(data.seed, epoch)`` (``data.epoch_order``); the steps over epochs as one stream; the data
position a checkpoint keeps (``DataPosition``); ``training.steps`` / ``training.epochs`` at parse."""

import collections
import dataclasses

import pytest
from tests.support.hydra_compose import compose_job

from megatron_fastpath.data import (
    DataConfig,
    EpochOrder,
    StepData,
    SyntheticSFTDataset,
    epoch_order,
    pack_microbatches,
)
from megatron_fastpath.train import parse_job_config
from megatron_fastpath.train.checkpointing import DataPosition, fingerprint_config
from megatron_fastpath.train.config import DEFAULT_STEPS, set_steps

# 11 bins (samples unpadded): a 2-microbatch step straddles epochs
CFG = DataConfig(num_samples=48, max_tokens=256, pad_multiple=1)


def dataset(cfg=CFG):
    return SyntheticSFTDataset(cfg, vocab_size=256)


def order(seed, epoch, cfg=CFG, ds=None):
    ds = ds if ds is not None else dataset(cfg)
    return epoch_order(ds.lengths, cfg.max_tokens, cfg.max_seqs, seed, epoch, cfg.pad_multiple)


def test_every_record_once_per_epoch_and_bins_within_capacity():
    ds = dataset()
    for epoch in range(4):
        bins = order(1234, epoch, ds=ds)
        counts = collections.Counter(i for b in bins for i in b)  # by record id (sample index)
        assert counts == collections.Counter(range(CFG.num_samples))  # each exactly once
        for b in bins:
            assert sum(int(ds.lengths[i]) for i in b) <= CFG.max_tokens and len(b) <= CFG.max_seqs
        assert len(bins) == len(pack_microbatches(ds, CFG))  # first-fit-decreasing: same count


def test_orders_differ_between_epochs_and_repeat_for_the_same_seed():
    ds = dataset()
    epochs = [order(1234, e, ds=ds) for e in range(3)]
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    assert [order(1234, e, ds=ds) for e in range(3)] == epochs  # (seed, epoch) -> the same order
    assert order(99, 0, ds=ds) != epochs[0]  # another seed, another order
    # repacked, not only reordered: some bin of epoch 1 holds another set of samples than any of epoch 0's
    assert {frozenset(b) for b in epochs[0]} != {frozenset(b) for b in epochs[1]}


def step_data(epochs=2, micro_batches=2):
    ds = dataset()
    eo = EpochOrder(ds, CFG, epochs, seed=1234)
    return StepData(eo.bins(0), micro_batches, 0, 1, eo), eo


def test_steps_stream_epochs_straddling_the_boundary():
    data, eo = step_data()
    n = len(data.bins)
    assert n == 11 and eo.steps(data.per_step) == 11  # 22 microbatches, 2 per step
    assert data.position(1) == (0, 0) and data.position(5) == (0, 8)
    assert data.position(6) == (0, 10) and data.position(7) == (1, 1)
    straddling = data.global_microbatches(6)  # epoch 0's last bin, then epoch 1's first
    assert straddling[0] is eo.bins(0)[10] and straddling[1] is eo.bins(1)[0]
    trained = collections.Counter()
    for step in range(1, 12):
        for g in range((step - 1) * 2, step * 2):
            idx = eo.order(g // n)[g % n]
            mb = data.global_microbatches(step)[g - (step - 1) * 2]
            assert list(mb.lengths) == [int(eo.dataset.lengths[i]) for i in idx]
            trained.update(idx)
    assert trained == collections.Counter({i: 2 for i in range(CFG.num_samples)})  # 2 epochs
    assert data.consumed_samples(11) == 2 * CFG.num_samples
    assert data.consumed_samples(6) == CFG.num_samples + len(eo.order(1)[0])


def test_without_epochs_one_packed_order_is_cycled_as_before():
    bins = tuple(pack_microbatches(dataset(), CFG))
    data = StepData(bins, 2, 0, 1)
    assert [data.first_microbatch(s) for s in range(1, 8)] == [0, 2, 4, 6, 8, 0, 2]
    assert data.position(3) == (None, 4) and data.global_microbatches(6) == bins[0:2]


def test_data_position_keeps_the_epoch_and_checks_it():
    data, _ = step_data()
    pos = DataPosition(data, steps=11)
    pos.step = 8
    state = pos.state_dict()
    assert state["epoch"] == 1 and state["next_first_microbatch"] == 5 and state["next_step"] == 9
    assert state["consumed_samples"] == data.consumed_samples(8)
    again = DataPosition(data, steps=11)
    again.load_state_dict(state)
    assert again.step == 8
    with pytest.raises(RuntimeError, match=r"does not match this run's \(epoch 1, microbatch 5\)"):
        DataPosition(data, steps=11).load_state_dict({**state, "epoch": 0})
    pos.step = 11
    assert pos.state_dict()["epoch"] is None and pos.state_dict()["next_first_microbatch"] is None


def test_data_part_without_epoch_loads_in_a_run_without_epochs():
    """A data part written before epochs existed (no ``epoch`` key)."""
    data = StepData(tuple(pack_microbatches(dataset(), CFG)), 2, 0, 1)
    pos = DataPosition(data, steps=6)
    pos.step = 3
    state = pos.state_dict()
    assert state["epoch"] is None
    old = {k: v for k, v in state.items() if k != "epoch"}
    fresh = DataPosition(data, steps=6)
    fresh.load_state_dict(old)
    assert fresh.step == 3
    with pytest.raises(RuntimeError, match="does not match"):
        DataPosition(data, steps=6).load_state_dict({**old, "next_first_microbatch": 2})


def test_steps_and_epochs_at_parse():
    # training.steps is set in one place, once the data is built (set_steps): the parse keeps
    # the setting (None when unset) and checks stop_at_step against DEFAULT_STEPS
    assert parse_job_config(compose_job([])).training.steps is None
    assert parse_job_config(compose_job(["training.steps=7"])).training.steps == 7
    with pytest.raises(ValueError, match=r"stop_at_step=41 must be in \[1, training.steps=40\]"):
        parse_job_config(compose_job(["training.stop_at_step=41"]))
    cfg = parse_job_config(compose_job(["training.epochs=2"]))
    assert cfg.training.epochs == 2 and cfg.training.steps is None  # set once the data is packed
    with pytest.raises(ValueError, match=(
            r"training.steps=10 and training.epochs=2 are both set: epochs sets the number of "
            r"steps .* set one of them \(training.steps=null with training.epochs\)")):
        parse_job_config(compose_job(["training.steps=10", "training.epochs=2"]))


def test_set_steps_sets_the_steps_and_checks_stop_at_step():
    data, _ = step_data()
    cfg = parse_job_config(compose_job(["training.epochs=2", "training.stop_at_step=8"]))
    assert set_steps(cfg, data).training.steps == 11
    late = parse_job_config(compose_job(["training.epochs=2", "training.stop_at_step=12"]))
    with pytest.raises(ValueError, match=r"stop_at_step=12 must be in \[1, training.steps=11\]"):
        set_steps(late, data)
    plain = parse_job_config(compose_job(["training.steps=5"]))
    assert set_steps(plain, data) is plain
    assert set_steps(parse_job_config(compose_job([])), data).training.steps == DEFAULT_STEPS == 40


def test_fingerprint_has_epochs_only_when_set():
    """A run without epochs fingerprints as checkpoints written before epochs existed."""
    plain = parse_job_config(compose_job(["training.steps=6"]))
    assert "epochs" not in fingerprint_config(plain, 1)["training"]
    cfg = parse_job_config(compose_job(["training.epochs=2"]))
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, steps=11))
    assert fingerprint_config(cfg, 1)["training"]["epochs"] == 2
