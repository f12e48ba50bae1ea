"""The run's history: one :class:`StepRecord` per finished step and the held-out evaluations.

:class:`RunHistory` is written by the logger (as each step's values reach the host) and saved by
the checkpoint as its own part (``state_dict`` / ``load_state_dict``, plain JSON values), so a
resumed run's summary, records and loss curves cover the whole run.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["StepRecord", "RunHistory"]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One logged step (host values only); ``loss`` is per loss token over the global batch."""

    step: int
    loss: float
    lr: float
    tokens: int
    step_ms: float
    tokens_per_s: float
    syncs_fwd_bwd: Optional[int]  # None: not counted (training.sync_check)
    syncs_step: Optional[int]
    sync_sites: tuple
    cache_builds: int  # derived-tensor builds (mask, RoPE): one per kind per microbatch
    offload_bytes: int = 0
    offload_mode: str = "off"
    grad_norm: Optional[float] = None
    eval_loss: Optional[float] = None
    eval_token_accuracy: Optional[float] = None
    skipped: Optional[bool] = None  # the sync-free step skipped the update (inf/nan gradients)
    host_ms: Optional[float] = None  # time the host spent issuing the step (== step_ms on CPU)
    graph_launches: Optional[int] = None  # full-iteration graphs: launches of the step (0 = eager)


class RunHistory:
    """records: the finished steps, in order; evals / eval_accuracy: ``(step, held-out loss)`` /
    ``(step, token accuracy)`` of each evaluation (step 0: before training)."""

    def __init__(self):
        self.records: list[StepRecord] = []
        self.evals: list[tuple] = []
        self.eval_accuracy: list[tuple] = []

    def add_step(self, record: StepRecord) -> None:
        self.records.append(record)

    def add_eval(self, step: int, loss: float, token_accuracy: Optional[float]) -> None:
        self.evals.append((step, loss))
        self.eval_accuracy.append((step, token_accuracy))

    def loss_curve(self) -> list[tuple]:
        """``(step, loss)`` of every recorded step."""
        return [(r.step, r.loss) for r in self.records]

    def state_dict(self) -> dict:
        """The history as JSON values (what a checkpoint saves)."""
        return {"records": [dataclasses.asdict(r) for r in self.records],
                "evals": [list(e) for e in self.evals],
                "eval_accuracy": [list(e) for e in self.eval_accuracy]}

    def load_state_dict(self, state: dict) -> None:
        """Replace the history with a saved one (a checkpoint saved before evaluations were kept
        has none)."""
        self.records = [StepRecord(**{**r, "sync_sites": tuple(r["sync_sites"])})
                        for r in state["records"]]
        self.evals = [tuple(e) for e in state.get("evals", [])]
        self.eval_accuracy = [tuple(e) for e in state.get("eval_accuracy", [])]
