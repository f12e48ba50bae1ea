"""The packing is a function of the data settings alone (``data.pad_multiple``), not of the
context-parallel size: the default job packs the same microbatches, and each step takes the
same ones, at CP 1 and CP 2 -- so a run at CP 2 trains on CP 1's data and a checkpoint resumes
at another CP size (its fingerprint is the same). The plans only, no training; the runs
themselves: tests/train/test_context_parallel_torchrun.py."""

import os
import types

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "examples", "data", "arith_chat.jsonl")


def _default_job(cp: int):
    from megatron_fastpath.train.config import parse_job_config
    from tests.support.hydra_compose import compose_job

    return parse_job_config(compose_job([f"parallel.context_parallel_size={cp}",
                                         "training.skip_memory_check=true"]))


def _plan(cfg):
    """(members, starts) of the packed bins and, per step, its first global microbatch."""
    from megatron_fastpath.providers import data_provider
    from megatron_fastpath.train.config import DEFAULT_STEPS

    data = data_provider(cfg.data_provider).build(cfg, 0, 1).train  # DP 1 at CP 1 and CP 2
    steps = [data.first_microbatch(s) for s in range(1, DEFAULT_STEPS + 1)]
    return data.bins.members, data.bins.starts, data.per_step, steps


def test_default_job_packs_the_same_microbatches_at_cp1_and_cp2():
    from megatron_fastpath.train.checkpointing import fingerprint_config

    one, two = _default_job(1), _default_job(2)
    m1, s1, per1, steps1 = _plan(one)
    m2, s2, per2, steps2 = _plan(two)
    assert len(s1) - 1 == 111 and one.data.pad_multiple == 8  # docs/configuration.md's figure
    assert np.array_equal(m1, m2) and np.array_equal(s1, s2)
    assert (per1, steps1) == (per2, steps2) and len(steps1) == 40
    # a checkpoint of one resumes at the other: the fingerprint holds no CP
    assert fingerprint_config(one, 1) == fingerprint_config(two, 1)


def test_a_pad_per_cp_size_packs_other_microbatches_from_step_3():
    """What a packing padded to 2 x CP would train: 106 bins at CP 1 (pad 2), 108 at CP 2
    (pad 4), the first two steps alike, the third already other samples."""
    from megatron_fastpath.data import DataConfig, SyntheticSFTDataset, pack_microbatches

    packed = {}
    for pad in (2, 4):
        cfg = DataConfig(num_samples=1024, pad_multiple=pad)  # the default job's data
        packed[pad] = pack_microbatches(SyntheticSFTDataset(cfg, vocab_size=256), cfg)
    assert (len(packed[2]), len(packed[4])) == (106, 108)
    per_step = 2  # training.micro_batches
    first = [[packed[p].indices(k) for k in range(3 * per_step)] for p in (2, 4)]
    assert first[0][:2 * per_step] == first[1][:2 * per_step]
    assert first[0][2 * per_step:] != first[1][2 * per_step:]


def test_jsonl_packs_with_data_pad_multiple_at_every_cp(tmp_path):
    """data=jsonl's train and held-out bins: data.pad_multiple's packing, the same at CP 1 and 2."""
    pytest.importorskip("tokenizers")
    import make_tiny_hf_llama  # examples/ (pytest.ini's pythonpath)

    from megatron_fastpath.hf.data import JsonlDataConfig
    from megatron_fastpath.hf.provider import JsonlData
    from megatron_fastpath.packed_seq.packing import first_fit_decreasing_arrays
    from megatron_fastpath.providers import ModelSource

    tok = str(tmp_path / "tok")
    make_tiny_hf_llama.build_tokenizer(tok, DATA)
    ns = types.SimpleNamespace
    data = JsonlDataConfig(path=DATA, max_tokens=128, max_seqs=8, cache=False)
    built = [JsonlData().build(ns(data=data, model_source=ModelSource("hf", None, None, tokenizer_path=tok),
                                  model=ns(vocab_size=1 << 16), parallel=ns(context_parallel_size=cp),
                                  training=ns(micro_batches=1, epochs=None)), 0, 1, log=lambda m: None)
             for cp in (1, 2)]
    for parts in built:
        bins = parts.train.bins
        want = first_fit_decreasing_arrays(bins.dataset.lengths, 128, 8, 8)
        assert np.array_equal(bins.members, want[0]) and np.array_equal(bins.starts, want[1])
    assert np.array_equal(built[0].train.bins.members, built[1].train.bins.members)
    assert ([mb.lengths.tolist() for mb in built[0].eval_bins]
            == [mb.lengths.tolist() for mb in built[1].eval_bins])
