"""The checkpoints' part of the main job's summary (a ``SummaryReport``, see
:mod:`megatron_fastpath.train.report`): the saves of this run, where it resumed from, why it
stopped early and the best checkpoint (``checkpoint.keep_best``)."""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["CheckpointReport"]


@dataclasses.dataclass(frozen=True)
class CheckpointReport:
    """saves: each save's ``{"step", "bytes", "blocking_ms", "wait_ms", "async"}`` (blocking_ms:
    how long it blocked the step; wait_ms: how long the loop later waited for an async writer);
    stopped: why the run stopped before ``training.steps`` (None: it did not); best_loss: the
    held-out loss at the best checkpoint's step."""

    saves: tuple = ()
    resumed_from: Optional[str] = None
    stopped: Optional[str] = None
    best_checkpoint: Optional[str] = None
    best_loss: Optional[float] = None

    @classmethod
    def of(cls, manager, stopped: Optional[str] = None) -> "CheckpointReport":
        """The report of a :class:`~megatron_fastpath.checkpoint.manager.CheckpointManager`
        whose saves are all published (after ``poll(blocking=True)``)."""
        best = manager.best_checkpoint() if manager.cfg.keep_best else None
        return cls(
            saves=tuple({"step": s.step, "bytes": s.bytes, "blocking_ms": s.blocking_s * 1e3,
                         "wait_ms": s.wait_s * 1e3, "async": s.is_async} for s in manager.saves),
            resumed_from=manager.resumed_path, stopped=stopped, best_checkpoint=best,
            best_loss=manager.eval_loss_of(best) if best else None,
        )

    @property
    def last_bytes(self) -> int:
        return self.saves[-1]["bytes"] if self.saves else 0

    def summary_fields(self) -> dict:
        return dict(best_checkpoint=self.best_checkpoint, resumed_from=self.resumed_from,
                    checkpoint_bytes=self.last_bytes, checkpoint_saves=self.saves)

    def summary_suffix(self) -> str:
        return ""

    def summary_lines(self) -> list[str]:
        lines = []
        if self.saves or self.resumed_from:
            blocked = ", ".join(f"{c['blocking_ms']:.1f}" + (f"+{c['wait_ms']:.0f} wait" if c["wait_ms"] else "")
                                for c in self.saves)
            lines.append(
                f"checkpoints: {len(self.saves)} saved, last {self.last_bytes:,} B, "
                f"ms each save blocked the step [{blocked}]"
                + (f", resumed from {self.resumed_from}" if self.resumed_from else "")
                + (f", stopped early: {self.stopped}" if self.stopped else "")
            )
        if self.best_checkpoint:
            lines.append(f"best checkpoint (lowest held-out loss, {self.best_loss:.4f}): "
                         f"{self.best_checkpoint}")
        return lines
