"""benchmarks/load_meter.py: the benchmark's own CPU time is not counted as other load, another
process's is (the 1-min load average cannot tell them apart). Every assertion holds on a busy
machine: the arithmetic is checked on given counters, the live counters only with bounds that
other processes' load cannot break (our own and a child's CPU time are lower bounds)."""

import subprocess
import sys
import time

import pytest


import load_meter  # noqa: E402
from load_meter import LoadMeter  # noqa: E402

TICK = 0.05  # /proc/stat counts in clock ticks (1/100 s) per core: slack for two readings


def _burn_cpu(seconds: float) -> None:
    """Use ``seconds`` of this process's CPU time (not wall time: holds on a loaded machine)."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_external_load_is_machine_busy_minus_own_time(monkeypatch):
    """external cores busy = (machine busy seconds - own CPU seconds) / wall seconds."""
    clock, busy, own = iter([100.0, 102.0]), iter([50.0, 53.0]), iter([7.0, 8.5])
    monkeypatch.setattr(load_meter.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(load_meter, "_busy_seconds", lambda: next(busy))
    monkeypatch.setattr(load_meter, "_own_seconds", lambda: next(own))
    monkeypatch.setattr(load_meter.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    with LoadMeter() as m:
        pass
    assert m.external_cores_busy() == pytest.approx((3.0 - 1.5) / 2.0)
    assert m.report()["external_cores_busy"] == 0.75


def test_own_cpu_time_is_counted_as_own_and_not_external():
    with LoadMeter() as m:
        _burn_cpu(0.4)
    own = m.own1 - m.own0
    assert own >= 0.4 - TICK  # our work is in our own time ...
    assert m.busy1 - m.busy0 >= own - TICK  # ... and in the machine's busy time, which holds it
    assert m.report()["noisy"] is (m.report()["load_average_1min_at_start"] / m.cores > 0.5
                                   or m.report()["external_cores_busy"] / m.cores > 0.5)


def test_another_process_is_external_load():
    """A child burns 0.5 s of CPU inside the window and is reaped after it (so os.times() does
    not count it as ours): at least that much shows as external load, whatever else runs."""
    code = ("import sys, time\nend=time.process_time()+0.5\nwhile time.process_time()<end: pass\n"
            "print('done', flush=True)\ntime.sleep(30)")
    with LoadMeter() as m:
        other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert other.stdout.readline().strip() == "done"  # its CPU time is spent, not reaped
    other.kill()
    other.wait()
    assert m.external_cores_busy() * (m.t1 - m.t0) >= 0.5 - TICK


def test_report_names_the_megatron_core_it_ran_against():
    from importlib import metadata

    with LoadMeter() as m:
        pass
    assert m.report()["megatron_core"] == metadata.version("megatron-core")


def test_results_name_keeps_0_16_1_unsuffixed_and_suffixes_other_lines():
    assert load_meter.results_name("packed_seq", "0.16.1") == "packed_seq.json"
    assert load_meter.results_name("packed_seq", "0.19.2") == "packed_seq_mcore0.19.2.json"
