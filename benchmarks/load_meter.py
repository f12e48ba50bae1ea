"""How busy the machine was with OTHER work while a benchmark ran.

The 1-minute load average counts the benchmark's own threads: a run using both cores of a
2-core machine ends at a load of ~2 (1.0 per core) on an otherwise idle machine, and a
busy machine can start at 0.2. So each benchmark records both:

* ``load_average_1min_at_start`` / ``_at_end`` (``os.getloadavg``, as asked), and
* ``external_cores_busy``: CPU time the whole machine spent busy (``/proc/stat``) minus the
  CPU time of this process and its children (``os.times``), divided by the wall time -- the
  mean number of cores other processes kept busy during the run.

A run is ``noisy`` when the load average at the start, or the other processes' mean use over
the run, exceeds 0.5 per core (``NOISY_PER_CORE``).
"""

from __future__ import annotations

import os
import time

NOISY_PER_CORE = 0.5
BASELINE_MCORE = "0.16.1"  # the megatron-core of the results JSON without a version suffix


def megatron_core_version() -> str | None:
    """The installed megatron-core's version (the Megatron side of every comparison), or None."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def results_name(name: str, version: str | None = None) -> str:
    """A results JSON's file name: ``name.json`` for megatron-core 0.16.1 (the first runs),
    ``name_mcore<version>.json`` for any other line (one JSON per version: the two cannot be
    imported in one process)."""
    version = megatron_core_version() if version is None else version
    return f"{name}.json" if version in (None, BASELINE_MCORE) else f"{name}_mcore{version}.json"


def _busy_seconds() -> float | None:
    """Machine-wide busy CPU seconds (all fields of /proc/stat's cpu line but idle, iowait)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class LoadMeter:
    """``with LoadMeter() as m: ...`` then ``m.report()`` (a dict for the benchmark's JSON)."""

    def __enter__(self) -> "LoadMeter":
        self.cores = os.cpu_count() or 1
        self.load_start = os.getloadavg()[0]
        self.t0, self.busy0, self.own0 = time.monotonic(), _busy_seconds(), _own_seconds()
        return self

    def __exit__(self, *exc) -> None:
        self.load_end = os.getloadavg()[0]
        self.t1, self.busy1, self.own1 = time.monotonic(), _busy_seconds(), _own_seconds()

    def external_cores_busy(self) -> float | None:
        if self.busy0 is None or self.busy1 is None:
            return None
        wall = max(self.t1 - self.t0, 1e-9)
        other = (self.busy1 - self.busy0) - (self.own1 - self.own0)
        return max(other, 0.0) / wall

    def report(self) -> dict:
        ext = self.external_cores_busy()
        noisy = self.load_start / self.cores > NOISY_PER_CORE or (
            ext is not None and ext / self.cores > NOISY_PER_CORE)
        return dict(
            megatron_core=megatron_core_version(),
            cores=self.cores,
            load_average_1min_at_start=round(self.load_start, 3),
            load_average_1min_at_end=round(self.load_end, 3),
            external_cores_busy=None if ext is None else round(ext, 3),
            noisy=bool(noisy),
            noisy_rule=f"load average at start or other processes' mean CPU use over the run "
                       f"> {NOISY_PER_CORE} per core (the end load average includes this run)",
        )

    def line(self) -> str:
        return describe(self.report())


def describe(report: dict) -> str:
    """One line for a :meth:`LoadMeter.report` (also as read back from a results JSON)."""
    ext = report["external_cores_busy"]
    ext = "n/a" if ext is None else f"{ext:.2f}"
    return (f"load average {report['load_average_1min_at_start']:.2f} -> "
            f"{report['load_average_1min_at_end']:.2f} (this run included) on {report['cores']} "
            f"cores; other processes kept {ext} cores busy" + ("  [NOISY]" if report["noisy"] else ""))


def write_results(path, result: dict, text: str) -> None:
    """A benchmark's JSON at ``path`` and its printed table beside it (``.txt``)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    path.with_suffix(".txt").write_text(text + "\n")
    print(f"wrote {path} and {path.with_suffix('.txt')}")


def publish(args, env: dict, rows: list, text: str) -> dict:
    """Print a benchmark's table, and write it with its JSON when ``args.json`` is set; returns
    the result dict (environment, the run's options except ``json``, the rows)."""
    print(text)
    result = {"environment": env, "config": {k: v for k, v in vars(args).items() if k != "json"},
              "results": rows}
    if args.json:
        write_results(args.json, result, text)
    return result
