"""``training.batch_sequences`` / ``training.batch_tokens`` on a chat data file (data=jsonl):
the number of packed microbatches a step trains is the whole number nearest to the asked batch
over the mean content of the bins the loader yields (``data.resolve_batch``)."""

import os
from fractions import Fraction

import pytest

pytest.importorskip("transformers")

from tests.support.main_job import TINY_CHECKPOINT_OPTIMIZER, train_in_process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "examples", "data", "arith_chat.jsonl")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(open(DATA).readlines()[:120]))
    return str(path)


@pytest.mark.parametrize("unit, asked", [("sequences", 40), ("tokens", 1500)])
def test_resolved_microbatches_match_the_file_s_packing(mcore_parallel, tiny, data_file, capsys,
                                                         unit, asked):
    job, summary = train_in_process(
        ["model=hf", f"model.path={tiny}", "data=jsonl", f"data.path={data_file}",
         "data.cache=false", "data.eval_fraction=0", "training.steps=2", "metrics.wandb=off",
         "metrics.tensorboard=false", "metrics.plot=false", f"training.batch_{unit}={asked}",
         *TINY_CHECKPOINT_OPTIMIZER], header=True)
    out = capsys.readouterr().out
    bins = list(job.data.bins)  # the packed microbatches the loader yields
    sequences = sum(len(mb.lengths) for mb in bins)
    assert sequences == job.data_report["train_records"] == 120
    total = sequences if unit == "sequences" else sum(int(mb.lengths.sum()) for mb in bins)
    mean = Fraction(total, len(bins))
    # by hand: the whole number of bins whose mean content is nearest the asked batch (ties: more)
    n = min(range(1, len(bins) + 1), key=lambda k: (abs(k * mean - asked), -k))
    assert n >= 3
    assert job.cfg.training.micro_batches == job.data.micro_batches == n
    assert [len(job.data.batch(s).microbatches) for s in (1, 2)] == [n, n]
    assert len(summary.records) == 2
    assert (f"training.batch_{unit}={asked}: {n} packed microbatches per rank per step, "
            f"{float(n * mean):,.1f} {unit} per step on average") in out
