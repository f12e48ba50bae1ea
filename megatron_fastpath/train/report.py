"""What the run's summary says about each feature: the feature says it itself.

A :class:`SummaryReport` is any object with the three methods below (a structural protocol: a
feature provides one without importing the main job, which sits on top of the features). The
job collects them -- :attr:`~megatron_fastpath.train.job.Job.reports` (packed cache, activation
offload, graph-safety audit) and the checkpointer's report -- and the logger prints them in that
order, after the lines it owns (held-out loss, artefacts, sync sites); it reads nothing else of
the features. The reports of this package:

* packed cache: :class:`megatron_fastpath.packed_seq.report.PackedCacheReport`
* activation offload: :class:`megatron_fastpath.offload.report.OffloadReport`
* graph-safety audit: :class:`megatron_fastpath.graphs.report.GraphAuditReport`
* checkpoints: :class:`megatron_fastpath.checkpoint.report.CheckpointReport`
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["SummaryReport"]


@runtime_checkable
class SummaryReport(Protocol):
    """One feature's part of the run summary, read when the run ends (so it reports the final
    state: the last step's offload figures, the audit over its steps, the saves made)."""

    def summary_fields(self) -> dict:
        """The :class:`~megatron_fastpath.train.logger.TrainSummary` fields it fills (JSON
        values; {} for none)."""

    def summary_suffix(self) -> str:
        """Text the summary line ends with ('' for none)."""

    def summary_lines(self) -> list[str]:
        """Lines under the summary line, unindented (the logger indents them); [] for none."""
