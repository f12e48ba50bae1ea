"""The step line's elapsed time, ETA (mean step time so far times the steps left), tokens/s over
the last 10 steps and peak memory; the summary's wall time; the progress bar only where stdout
is a terminal."""

import io
import re
import sys

import pytest
from tests.support.hydra_compose import compose_job

from megatron_fastpath.train import run
from megatron_fastpath.train.progress import clock, window_rate

STEPS = 12
TINY = [f"training.steps={STEPS}", "data.num_samples=64", "model.num_layers=1", "model.hidden_size=32",
        "model.ffn_hidden_size=64", "data.max_tokens=128"]
LINE = re.compile(r"^step +(\d+)/12 \| .* tok/s \((\d+)-step (\d+)\) \| (\d:\d\d:\d\d) ETA "
                  r"(\d:\d\d:\d\d) \| peak RSS (\d+\.\d\d) GiB \| host syncs", re.M)


class _Clock:
    """A perf_counter that advances 7 s per call: start_clock, then one call as each step
    returns, so step k ends 7k s after the start."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        self.now += 7.0
        return self.now


def test_clock_format():
    assert (clock(0), clock(59.9), clock(77), clock(3600 * 2 + 61)) == ("0:00:00", "0:00:59", "0:01:17", "2:01:01")


def test_eta_and_window_rate_in_step_lines(mcore_parallel, monkeypatch, capsys):
    import megatron_fastpath.train.logger as logger_mod

    monkeypatch.setattr(logger_mod, "time", _Clock())
    s = run(compose_job(TINY))
    out = capsys.readouterr().out
    lines = LINE.findall(out)
    assert [int(m[0]) for m in lines] == list(range(1, STEPS + 1))
    for step, n, rate, elapsed, eta, rss in lines:
        k = int(step)
        assert elapsed == clock(7 * k)  # step k ends 7k s after the first step's start
        assert eta == clock(7 * k / k * (STEPS - k))  # mean step time 7 s, STEPS - k left
        window = s.records[max(0, k - 10):k]
        assert int(n) == len(window)
        tokens, seconds = sum(r.tokens for r in window), sum(r.step_ms for r in window) / 1e3
        assert rate == f"{tokens / seconds:.0f}"
        assert float(rss) > 0
    assert window_rate(s.records) == pytest.approx(
        sum(r.tokens for r in s.records[-10:]) / (sum(r.step_ms for r in s.records[-10:]) / 1e3), rel=1e-12)
    # summary: the wall time from the start to the last flush (train's after the steps, then
    # finish's: two calls after step 12's)
    assert s.wall_s == 7 * (STEPS + 2)
    assert f"| wall {clock(7 * (STEPS + 2))} |" in out
    assert "\r" not in out and "[=" not in out  # stdout not a terminal: no bar
    # readable: the fields every step line has (then the optional ones: grad norm, offload, eval)
    longest = max((line.split(" | grad norm")[0] for line in out.splitlines() if line.startswith("step ")), key=len)
    assert len(longest) <= 160, longest


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_terminal_gets_a_progress_bar(mcore_parallel, monkeypatch):
    tty = _Tty()
    monkeypatch.setattr(sys, "stdout", tty)
    run(compose_job(TINY))
    out = tty.getvalue()
    assert f"\r[{'=' * 30}] {STEPS}/{STEPS} " in out  # the bar at the last step
    assert re.search(r"\r\[=+> *\] 1/12 \d:\d\d:\d\d ETA \d:\d\d:\d\d", out)
    assert "\r\033[K" in out  # cleared before each line
    # each step line starts on its own line after the bar is cleared
    assert len(re.findall(r"\r\033\[Kstep +\d+/12 \|", out)) == STEPS - 1
