"""The summary's tok/s is the tokens of the steps this process ran over their wall time (not the
mean of per-step rates, which overstates it when steps differ in length)."""

import pytest
from tests.support.hydra_compose import compose_job

from megatron_fastpath.train import run


class _Clock:
    """A perf_counter that advances 1 s per call: the wall time is the number of calls between
    the first step's start and the last flush."""

    def __init__(self):
        self.now = 1000.0
        self.calls = []

    def perf_counter(self):
        self.now += 1.0
        self.calls.append(self.now)
        return self.now


def test_summary_tokens_per_s_is_tokens_over_wall_time(mcore_parallel, monkeypatch):
    import megatron_fastpath.train.logger as logger_mod

    clock = _Clock()
    monkeypatch.setattr(logger_mod, "time", clock)
    cfg = compose_job([
        "training.steps=4", "data.num_samples=64", "model.num_layers=1", "model.hidden_size=32",
        "model.ffn_hidden_size=64", "data.max_tokens=128"])
    s = run(cfg)
    start, end = clock.calls[0], clock.calls[-1]  # start_clock, then the last flush
    tokens = sum(r.tokens for r in s.records)
    assert s.tokens_per_s == pytest.approx(tokens / (end - start), rel=1e-12)
    per_step = [r.tokens_per_s for r in s.records]
    assert s.mean_tokens_per_s == pytest.approx(sum(per_step[1:]) / 3, rel=1e-12)
