"""The activation offload's part of the main job's summary (a ``SummaryReport``, see
:mod:`megatron_fastpath.train.report`): the last step's figures, one line
(:meth:`~megatron_fastpath.offload.config.OffloadStepStats.summary_line`)."""

from __future__ import annotations

__all__ = ["OffloadReport"]


class OffloadReport:
    """Reads the manager's public ``history`` (one ``OffloadStepStats`` per step) when asked."""

    def __init__(self, manager):
        self.manager = manager

    def summary_fields(self) -> dict:
        return {}

    def summary_suffix(self) -> str:
        return ""

    def summary_lines(self) -> list[str]:
        history = self.manager.history
        return [history[-1].summary_line()] if history else []
