"""The step line's progress fields and the terminal's progress bar.

* elapsed and ETA: wall time from the first step this process ran to the end of the step; the
  ETA is the mean step time so far times the steps left (to ``training.stop_at_step`` or
  ``training.steps``);
* the tokens/s over the last :data:`RATE_WINDOW` steps (their tokens over their summed step
  times): one step's rate jumps with whatever else the machine runs;
* peak memory: CUDA's ``max_memory_allocated`` on a GPU, the process's peak resident set
  (``getrusage`` ``ru_maxrss``, labelled RSS) on a CPU;
* :class:`ProgressBar`: where stdout is a terminal, a bar redrawn under the step lines (``\\r``,
  no new line); elsewhere (a log file, a pipe) only the plain lines.
"""

from __future__ import annotations

import sys
from typing import Optional

__all__ = ["RATE_WINDOW", "window_rate", "eta_s", "clock", "peak_memory", "ProgressBar"]

RATE_WINDOW = 10  # steps the step line's tokens/s is smoothed over
BAR_WIDTH = 30


def window_rate(records: list, window: int = RATE_WINDOW) -> float:
    """Tokens per second of the last ``window`` records: their tokens over their step times."""
    last = records[-window:]
    seconds = sum(r.step_ms for r in last) / 1e3
    return sum(r.tokens for r in last) / seconds if seconds > 0 else 0.0


def eta_s(elapsed_s: float, done: int, left: int) -> float:
    """Seconds left: the mean time of the ``done`` steps so far times the ``left`` ones."""
    return elapsed_s / done * left if done > 0 else 0.0


def clock(seconds: float) -> str:
    """``h:mm:ss`` of ``seconds`` (rounded down)."""
    m, s = divmod(int(max(seconds, 0.0)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


def peak_memory(device) -> str:
    """``peak mem X GiB`` (CUDA's max_memory_allocated) or ``peak RSS X GiB`` (this process's
    peak resident set on a CPU: Linux reports ru_maxrss in KiB)."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return f"peak mem {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform != "darwin" else 1 / 1024  # macOS: bytes
    return f"peak RSS {kib * scale / 2**20:.2f} GiB"


class ProgressBar:
    """``[=====>    ] 12/40 0:00:12 ETA 0:00:28`` redrawn in place on ``stream`` when it is a
    terminal (``isatty``); inactive otherwise. :meth:`clear` before printing a line keeps the
    bar under the lines."""

    def __init__(self, stream=None, enabled: Optional[bool] = None):
        self.stream = stream if stream is not None else sys.stdout
        isatty = getattr(self.stream, "isatty", None)
        self.active = bool(isatty and isatty()) if enabled is None else enabled
        self.shown = False

    def draw(self, step: int, total: int, elapsed_s: float, eta: float) -> None:
        if not self.active:
            return
        filled = BAR_WIDTH * min(step, total) // max(total, 1)
        bar = "=" * filled + (">" if filled < BAR_WIDTH else "") + " " * (BAR_WIDTH - filled - 1)
        self.stream.write(f"\r[{bar}] {step}/{total} {clock(elapsed_s)} ETA {clock(eta)}")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False
