"""Per-layer CUDA graphs: the CPU graph-safety audit and the enable_cuda_graph configuration."""

from megatron_fastpath.graphs.audit import (
    AuditFinding,
    AuditReport,
    GraphSafetyAudit,
    GraphSafetyError,
    LayerAudit,
)
from megatron_fastpath.graphs.setup import GraphSetup, prepare_cuda_graphs

__all__ = ["AuditFinding", "AuditReport", "GraphSafetyAudit", "GraphSafetyError", "LayerAudit",
           "GraphSetup", "prepare_cuda_graphs"]
