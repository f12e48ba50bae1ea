"""The graph-safety audit's part of the main job's summary (a ``SummaryReport``, see
:mod:`megatron_fastpath.train.report`): its table (:meth:`AuditReport.summary
<megatron_fastpath.graphs.audit.AuditReport.summary>`) and the summary's ``audit`` /
``audit_ok`` fields."""

from __future__ import annotations

__all__ = ["GraphAuditReport"]


class GraphAuditReport:
    """Reads ``audit.report()`` (:class:`~megatron_fastpath.graphs.audit.GraphSafetyAudit`) when
    asked: the steps audited so far."""

    def __init__(self, audit):
        self.audit = audit

    def summary_fields(self) -> dict:
        report = self.audit.report()
        return {"audit": report.summary(), "audit_ok": report.ok}

    def summary_suffix(self) -> str:
        return ""

    def summary_lines(self) -> list[str]:
        return self.audit.report().summary().splitlines()
