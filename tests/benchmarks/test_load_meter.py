"""benchmarks/load_meter.py: the benchmark's own CPU time is not counted as other load, another
process's is (the 1-min load average cannot tell them apart)."""

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from load_meter import LoadMeter  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_own_cpu_time_is_not_external_load():
    with LoadMeter() as m:
        _spin(1.0)
    assert m.external_cores_busy() < 0.4  # one core of our own work: ~0 from others
    assert m.report()["noisy"] is (m.report()["load_average_1min_at_start"] / m.cores > 0.5)


def test_another_process_is_external_load():
    with LoadMeter() as m:
        other = subprocess.Popen([sys.executable, "-c",
                                  "import time\nend=time.monotonic()+1.2\nwhile time.monotonic()<end: pass"])
        _spin(1.2)
        other_done = other.poll() is not None
    other.wait()  # reaped after the meter stopped: its CPU time is not in our own os.times()
    assert 0.5 < m.external_cores_busy() < 1.6, (m.external_cores_busy(), other_done)
    report = m.report()
    assert report["external_cores_busy"] == round(m.external_cores_busy(), 3)
    assert report["noisy"] is (report["load_average_1min_at_start"] / m.cores > 0.5
                               or report["external_cores_busy"] / m.cores > 0.5)
