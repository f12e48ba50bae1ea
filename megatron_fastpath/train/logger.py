"""What the main job prints and returns: the lagged read-back of device values, one line per step
and the summary (also written as JSON when ``training.summary_json`` is set).

Values that live on the device (the loss) are copied non-blocking into host buffers by
:class:`LaggedReadback` and read one step late, so logging never stalls a step. Each finished
step's :class:`StepRecord` and each evaluation go into the run's
:class:`~megatron_fastpath.train.history.RunHistory` (which a checkpoint saves); the features'
parts of the summary come from their own reports (:mod:`megatron_fastpath.train.report`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Optional

import torch

from megatron_fastpath.train.evaluate import perplexity
from megatron_fastpath.train.history import RunHistory, StepRecord
from megatron_fastpath.train.progress import RATE_WINDOW, ProgressBar, clock, eta_s, peak_memory, window_rate

__all__ = ["LaggedReadback", "StepResult", "StepRecord", "TrainSummary", "StepLogger", "RunHistory"]

SUMMARY_LOSS_STEPS = 3  # the summary's "loss A -> B": mean over the first / last this many steps


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What :func:`~megatron_fastpath.train.step.train_step` returns: host facts of the step and
    the summed loss still on the device (``loss_sum``, read back one step later)."""

    step: int
    loss_sum: torch.Tensor
    lr: float
    tokens: int
    loss_tokens: int
    step_ms: float
    syncs_fwd_bwd: Optional[int]  # None: not counted (training.sync_check)
    syncs_step: Optional[int]
    sync_sites: tuple
    cache_builds: int  # derived-tensor builds (mask, RoPE): one per kind per microbatch
    offload_bytes: int = 0
    offload_mode: str = "off"
    grad_norm: object = None  # device tensor (read back with the loss) or host float
    eval_loss: Optional[float] = None  # held-out loss measured right after this step
    eval_token_accuracy: Optional[float] = None  # share of held-out loss tokens predicted (argmax)
    applied: Optional[torch.Tensor] = None  # sync-free step: False = update skipped (inf/nan)
    # CUDA: (start, end) timing events around the step; its device time is read with its loss
    device_timing: Optional[tuple] = None
    graph_launches: Optional[int] = None  # full-iteration graphs: launches this step (0 = eager)


def step_record(r: StepResult, loss_sum: float, grad_norm=None, applied=None) -> StepRecord:
    """The history's record of step ``r`` once its device values are on the host. ``step_ms``
    (and tok/s) is the step's device time on CUDA -- the events around it, read after its loss,
    so they have completed -- and its host time on a CPU. A GPU step's host time only measures
    how fast work was queued: it overstates throughput whenever nothing inside the step waits
    for the device."""
    step_ms = r.step_ms
    if r.device_timing is not None:
        start, end = r.device_timing
        step_ms = float(start.elapsed_time(end))
    return StepRecord(
        skipped=None if applied is None else not _scalar(applied),
        step=r.step, loss=loss_sum / max(r.loss_tokens, 1), lr=r.lr, tokens=r.tokens,
        step_ms=step_ms, tokens_per_s=r.tokens / (step_ms / 1e3), host_ms=r.step_ms,
        syncs_fwd_bwd=r.syncs_fwd_bwd, syncs_step=r.syncs_step, sync_sites=r.sync_sites,
        cache_builds=r.cache_builds,
        offload_bytes=r.offload_bytes, offload_mode=r.offload_mode,
        grad_norm=None if grad_norm is None else float(_scalar(grad_norm)), eval_loss=r.eval_loss,
        eval_token_accuracy=r.eval_token_accuracy, graph_launches=r.graph_launches,
    )


def _scalar(v):
    """A read-back value: a host number, or the one-element list of a [1] tensor (Megatron
    keeps its norm / flags as [1] tensors)."""
    return v[0] if isinstance(v, (list, tuple)) else v


@dataclasses.dataclass(frozen=True)
class TrainSummary:
    """first_loss / last_loss: mean loss of the first / last ``SUMMARY_LOSS_STEPS`` steps.
    tokens_per_s: the tokens of the steps this process ran over the wall time from the start of
    its first step to the end of its last (evaluations and checkpoint saves included: what the
    run took); mean_tokens_per_s: the mean of the per-step rates over all steps but the first
    (warm-up), which overstates throughput when steps differ in length."""

    steps: int
    world_size: int
    device: str
    first_loss: float
    last_loss: float
    tokens_per_s: float
    mean_tokens_per_s: float
    syncs_fwd_bwd_per_step: Optional[float]  # over the checked steps (None: none checked)
    syncs_per_step: Optional[float]
    cache_builds: int  # derived-tensor builds (mask, RoPE): one per kind per microbatch
    records: tuple
    trainable_params: int = 0
    total_params: int = 0
    audit: Optional[str] = None
    audit_ok: Optional[bool] = None
    notes: tuple = ()
    evals: tuple = ()  # (step, held-out loss); step 0 = before training
    eval_loss: Optional[float] = None  # held-out loss at the end (data=jsonl)
    eval_perplexity: Optional[float] = None  # exp(eval_loss)
    eval_token_accuracy: Optional[float] = None  # at the end: loss tokens predicted by argmax
    eval_accuracy: tuple = ()  # (step, token accuracy) beside evals
    data: Optional[dict] = None  # data=jsonl record counts
    artifacts: Optional[dict] = None  # exported adapter / merged checkpoint / metrics files
    # checkpoints: where this run resumed from, why it stopped before training.steps (None: it
    # did not), bytes of the last checkpoint, and each save's step / bytes / blocking ms / async
    resumed_from: Optional[str] = None
    stopped: Optional[str] = None
    checkpoint_bytes: int = 0
    checkpoint_saves: tuple = ()
    best_checkpoint: Optional[str] = None  # checkpoint.keep_best: lowest held-out loss
    sync_checked_steps: int = 0  # steps counted by the sync sentinel (training.sync_check)
    wall_s: float = 0.0  # this process's first step's start to its last step's end

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["records"] = [dataclasses.asdict(r) for r in self.records]
        return d


def _eval_extras(loss: float, accuracy: Optional[float], lead: str = "") -> str:
    """' (perplexity P, token accuracy A%)' of an evaluation."""
    acc = "" if accuracy is None else f", token accuracy {100 * accuracy:.1f}%"
    return f" ({lead}perplexity {perplexity(loss):.4g}{acc})"


SAMPLE_PROMPT_CHARS = 80  # a sample line shows the prompt's last this many characters
SAMPLE_COMPLETION_CHARS = 160  # and the completion's first this many


def _clip(text: str, n: int, tail: bool = False) -> str:
    """``text`` as a quoted literal (newlines escaped), cut to ``n`` characters with "..."
    (its end kept when ``tail``)."""
    if len(text) > n:
        text = ("..." + text[-n:]) if tail else (text[:n] + "...")
    return repr(text)


def sample_line(sample) -> str:
    """``sample i: prompt -> completion`` of an :class:`~megatron_fastpath.train.evaluate.EvalSample`
    (the prompt's end: the question and the template's generation prompt)."""
    why = "" if sample.stop == "eos" else f" [stopped: {sample.stop}]"
    return (f"sample {sample.index}: {_clip(sample.prompt, SAMPLE_PROMPT_CHARS, tail=True)} -> "
            f"{_clip(sample.completion, SAMPLE_COMPLETION_CHARS)}{why}")


def _mean(values: list) -> Optional[float]:
    return sum(values) / len(values) if values else None


class LaggedReadback:
    """Device scalars -> host, without a sync: ``push`` copies them non-blocking into pinned host
    buffers (recording an event); ``pop`` returns the *previous* push's values once its event
    has completed (a whole step later, so the wait is free)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pending: Optional[tuple[dict, Optional[torch.cuda.Event], object]] = None

    def push(self, values: dict[str, torch.Tensor], extra) -> Optional[tuple[dict, object]]:
        prev = self.pop()
        pin = self.device.type == "cuda"
        host = {}
        for k, v in values.items():
            buf = torch.empty(v.shape, dtype=v.dtype, pin_memory=pin)
            buf.copy_(v.detach(), non_blocking=True)
            host[k] = buf
        event = None
        if pin:
            event = torch.cuda.Event()
            event.record()
        self.pending = (host, event, extra)
        return prev

    def pop(self) -> Optional[tuple[dict, object]]:
        if self.pending is None:
            return None
        host, event, extra = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        return {k: v.tolist() for k, v in host.items()}, extra


class StepLogger:
    """Owns the lagged read-back, the step lines and the summary of one job.

    ``log(result)`` after each step prints the *previous* step (its loss is on the host by
    then) and adds its record to ``history``; ``finish(stopped, reports)`` prints the last step
    and the summary (each report's part after the logger's own lines) and returns the
    :class:`TrainSummary`. Metrics writers (TensorBoard, W&B, JSONL) belong in ``_emit``: it is
    the one place a finished :class:`StepRecord` appears.
    """

    def __init__(self, job):
        self.job = job
        self.readback = LaggedReadback(job.cfg.device)
        self.history = RunHistory()  # a checkpoint saves and restores it
        self.show = job.rank == 0 or job.cfg.training.log_all_ranks
        self.prefix = f"[rank {job.rank}] " if job.cfg.training.log_all_ranks else ""
        self.artifacts: dict = {}
        self.metrics = getattr(job, "metrics", None)
        self.first_step: Optional[int] = None  # the first step this process ran
        self.wall: list = [None, None]  # perf_counter at its start and after its last step
        self._samples: dict = {}  # step -> EvalSamples printed after that step's line
        self._step_end: dict = {}  # step -> perf_counter when it returned (its line is lagged)
        self._times: Optional[tuple] = None  # the last line's elapsed, ETA and last step
        self.bar = ProgressBar(enabled=None if job.rank == 0 else False)  # rank 0 on a terminal

    def print(self, text: str) -> None:
        if self.show:
            self.bar.clear()
            text = "\n".join(f"{self.prefix}{line}" for line in text.splitlines())
            print(text, flush=True)
            if self.metrics is not None:
                self.metrics.text(text)

    def start_clock(self, step: int) -> None:
        """The run's first step starts now (the summary's tok/s counts from here)."""
        self.first_step, self.wall[0], self._times = step, time.perf_counter(), None

    def header(self) -> None:
        j, c = self.job, self.job.cfg
        m = c.model
        experts = f", {m.num_experts} experts top-{m.moe_router_topk}" if c.is_moe else ""
        p = c.parallel
        model_parallel = "".join(f", {name} {size}" for name, size in (
            ("tp", p.tensor_model_parallel_size), ("pp", p.pipeline_model_parallel_size)) if size > 1)
        sp = ", sequence parallel" if p.sequence_parallel else ""
        layout = ""
        if c.attention_backend == "sdpa":  # packed_seq/cache.py PackedSeqConfig.sdpa_layout
            layout = " (padded view)" if j.cache.config.sdpa_padded else " ([T, T] mask)"
        resolved = getattr(j.data, "batch_size", None)  # training.batch_sequences / batch_tokens
        batch = f", {resolved.describe()}" if resolved is not None else ""
        self.print(
            f"megatron_fastpath: {m.num_layers} layers, hidden {m.hidden_size}{experts}, "
            f"{j.total_params:,} params ({j.trainable_params:,} trainable) on {c.device} (world "
            f"{j.world}, dp {j.dp_world}, ep {p.expert_model_parallel_size}{model_parallel}{sp}), "
            f"{j.data.num_microbatches} packed microbatches (sequences <= "
            f"{j.cache.config.max_seqlen_bound} tokens){batch}, attention {c.attention_backend}{layout}, "
            f"features: {', '.join(c.features) or 'none'}"
            + (", chunked loss (no [T, V] logits)" if c.linear_cross_entropy == "chunked" else "")
        )
        if p.distributed_optimizer or p.overlap_grad_reduce:
            from megatron_fastpath.train.parallel import data_parallel_size

            self.print("  data parallel: " + ", ".join(what for what, on in (
                (f"distributed optimizer (optimizer state sharded over "  # DP x CP, as Megatron
                 f"{data_parallel_size(p, j.world)} ranks)",
                 p.distributed_optimizer),
                ("gradient reduce overlapped with the backward", p.overlap_grad_reduce),
                ("parameter gather overlapped with the forward", p.overlap_param_gather),
                (f"buckets of {p.bucket_size} elements", p.bucket_size is not None)) if on))
        for note in c.plan.notes:
            self.print(f"  {note}")
        if j.env_set:
            self.print(f"  environment: {j.env_set}")

    def log(self, result: StepResult, evaluation=None) -> None:
        """``evaluation``: the :class:`~megatron_fastpath.train.evaluate.EvalResult` measured
        right after this step (None: none)."""
        self._step_end[result.step] = time.perf_counter()
        values = {"loss_sum": result.loss_sum}
        if isinstance(result.grad_norm, torch.Tensor):
            values["grad_norm"] = result.grad_norm
        if isinstance(result.applied, torch.Tensor):
            values["applied"] = result.applied
        if evaluation is not None:
            result = dataclasses.replace(result, eval_loss=evaluation.loss,
                                         eval_token_accuracy=evaluation.token_accuracy)
            self._record_eval(result.step, evaluation)
            if evaluation.samples:  # printed after the step's line (read back one step late)
                self._samples[result.step] = evaluation.samples
        self._emit(self.readback.push(values, result))

    def log_eval(self, step: int, evaluation) -> None:
        """An evaluation outside a step line (step 0: before training)."""
        self._record_eval(step, evaluation)
        self.print(f"eval {'before training' if step == 0 else f'at step {step}'}: held-out loss "
                   f"{evaluation.loss:.4f}{_eval_extras(evaluation.loss, evaluation.token_accuracy)}")
        self._print_samples(getattr(evaluation, "samples", ()))

    def _print_samples(self, samples: tuple) -> None:
        for sample in samples:
            self.print(f"  {sample_line(sample)}")

    def _record_eval(self, step: int, evaluation) -> None:
        self.history.add_eval(step, evaluation.loss, evaluation.token_accuracy)
        if self.metrics is not None:
            self.metrics.eval(step, evaluation.loss, evaluation.token_accuracy)
            if getattr(evaluation, "samples", ()):
                self.metrics.samples(step, evaluation.samples)

    def _emit(self, prev) -> None:
        if prev is None:
            return
        values, result = prev
        grad_norm = values.get("grad_norm", result.grad_norm)
        rec = step_record(result, values["loss_sum"], grad_norm, values.get("applied"))
        self.history.add_step(rec)
        if self.metrics is not None:
            self.metrics.step(rec)
        off = (f" | offload {rec.offload_mode} {rec.offload_bytes / 2**20:.1f} MiB"
               if self.job.offload is not None else "")
        if rec.grad_norm is not None:
            off += f" | grad norm {rec.grad_norm:.3f}{' (skipped: inf/nan)' if rec.skipped else ''}"
        if rec.graph_launches is not None:
            off += (f" | full-iteration graphs: {rec.graph_launches} launches" if rec.graph_launches
                    else " | full-iteration graphs: eager (captured at step 2)")
        if rec.eval_loss is not None:
            off += f" | eval loss {rec.eval_loss:.4f}{_eval_extras(rec.eval_loss, rec.eval_token_accuracy)}"
        self.print(
            f"step {rec.step:4d}/{self.job.cfg.training.steps}{self._epoch(rec.step)} | loss {rec.loss:.4f} | lr "
            f"{rec.lr:.2e} | {rec.tokens_per_s:.0f} tok/s{self._progress(rec.step)} | host syncs: "
            + (f"fwd+bwd {rec.syncs_fwd_bwd}, step {rec.syncs_step}" if rec.syncs_step is not None
               else "not counted")
            + f" | cache builds {rec.cache_builds}"
            f"{off}"
        )
        self._print_samples(self._samples.pop(rec.step, ()))
        if self._times is not None:
            self.bar.draw(rec.step, self._times[2], *self._times[:2])

    def _progress(self, step: int) -> str:
        """`` (N-step rate) | elapsed ETA eta | peak memory`` of ``step`` (sets ``_times``:
        elapsed, ETA and the last step, for the bar)."""
        records, end, self._times = self.history.records, self._step_end.pop(step, None), None
        n = min(len(records), RATE_WINDOW)
        out = f" ({n}-step {window_rate(records, n):.0f})"
        if end is not None and self.first_step is not None:
            t = self.job.cfg.training
            last = t.stop_at_step or t.steps
            elapsed = end - self.wall[0]
            eta = eta_s(elapsed, step - self.first_step + 1, last - step)
            self._times = (elapsed, eta, last)
            out += f" | {clock(elapsed)} ETA {clock(eta)}"
        return out + f" | {peak_memory(self.job.cfg.device)}"

    def _epoch(self, step: int) -> str:
        """`` (epoch e/E)`` with ``training.epochs``: the epoch of the step's first microbatch."""
        epochs = self.job.cfg.training.epochs
        if epochs is None or not hasattr(self.job.data, "position"):
            return ""
        return f" (epoch {self.job.data.position(step)[0] + 1}/{epochs})"

    def flush(self) -> None:
        """Print the pending (last) step now (its loss is read back: call after the steps)."""
        self._emit(self.readback.pop())
        if self.wall[0] is not None:
            self.wall[1] = time.perf_counter()

    def finish(self, stopped: Optional[str] = None, reports: tuple = ()) -> TrainSummary:
        """Print the last step and the summary. ``stopped``: why the run stopped before
        ``training.steps`` (None: it did not); ``reports``: the features'
        :class:`~megatron_fastpath.train.report.SummaryReport` s, in the order they print (their
        fields go into the summary)."""
        self.flush()
        if self.metrics is not None:  # the loss curves of the whole run, not of this process
            self.artifacts.update(self.metrics.close(self.history.loss_curve(), list(self.history.evals)))
            for note in self.metrics.notes:
                self.print(f"  {note}")
        fields = {k: v for r in reports for k, v in r.summary_fields().items()}
        summary = dataclasses.replace(self.summarize(), stopped=stopped, **fields)
        self._print_summary(summary, reports)
        if self.metrics is not None:
            self.metrics.close_log()
        if self.job.cfg.training.summary_json and self.job.rank == 0:
            with open(self.job.cfg.training.summary_json, "w") as f:
                json.dump(summary.to_json(), f, indent=1)
        return summary

    def summarize(self) -> TrainSummary:
        records, job = self.history.records, self.job
        evals, accuracy = self.history.evals, self.history.eval_accuracy
        if not records:
            raise RuntimeError("no step ran and no checkpoint held any: nothing to summarise")
        k = min(SUMMARY_LOSS_STEPS, len(records))
        checked = [r for r in records if r.syncs_step is not None]
        return TrainSummary(
            steps=len(records),
            world_size=job.world,
            device=str(job.cfg.device),
            first_loss=sum(r.loss for r in records[:k]) / k,
            last_loss=sum(r.loss for r in records[-k:]) / k,
            tokens_per_s=self._tokens_per_s(),
            wall_s=self._wall_s(),
            mean_tokens_per_s=sum(r.tokens_per_s for r in records[1:] or records) / max(len(records) - 1, 1),
            syncs_fwd_bwd_per_step=_mean([r.syncs_fwd_bwd for r in checked]),
            syncs_per_step=_mean([r.syncs_step for r in checked]),
            sync_checked_steps=len(checked),
            cache_builds=sum(r.cache_builds for r in records),
            records=tuple(records),
            trainable_params=job.trainable_params,
            total_params=job.total_params,
            notes=job.cfg.plan.notes,
            evals=tuple(evals),
            eval_loss=evals[-1][1] if evals else None,
            eval_perplexity=perplexity(evals[-1][1]) if evals else None,
            eval_token_accuracy=accuracy[-1][1] if accuracy else None,
            eval_accuracy=tuple(accuracy),
            data=getattr(job, "data_report", None),
            artifacts=dict(self.artifacts) or None,
        )

    def _wall_s(self) -> float:
        start, end = self.wall
        return end - start if start is not None and end is not None else 0.0

    def _tokens_per_s(self) -> float:
        """Tokens of the steps this process ran / their wall time (0.0: it ran none)."""
        start, end = self.wall
        if self.first_step is None or end is None or end <= start:
            return 0.0
        return sum(r.tokens for r in self.history.records if r.step >= self.first_step) / (end - start)

    def _print_summary(self, s: TrainSummary, reports: tuple = ()) -> None:
        k = min(SUMMARY_LOSS_STEPS, s.steps)
        self.print(
            f"summary: {s.steps} steps | loss {s.first_loss:.4f} -> {s.last_loss:.4f} (mean of "
            f"the first / last {k} steps) | {s.tokens_per_s:.0f} tok/s | wall {clock(s.wall_s)} | "
            + (f"host syncs per step: fwd+bwd {s.syncs_fwd_bwd_per_step:g}, whole step "
               f"{s.syncs_per_step:g} ({s.sync_checked_steps} of {s.steps} steps counted)"
               if s.sync_checked_steps else "host syncs not counted (training.sync_check=off)")
            + f" | cache builds {s.cache_builds}"
            + "".join(r.summary_suffix() for r in reports)
        )
        if s.evals:
            self.print(f"  held-out loss {s.evals[0][1]:.4f} -> {s.eval_loss:.4f} (step "
                       f"{s.evals[0][0]} -> {s.evals[-1][0]}, {len(s.evals)} evaluations)"
                       f"{_eval_extras(s.eval_loss, s.eval_token_accuracy, 'at the end: ')}")
        for kind, path in (s.artifacts or {}).items():
            self.print(f"  {kind}: {path}")
        for site in sorted({x for r in s.records for x in r.sync_sites}):
            self.print(f"  sync site: {site}")
        for report in reports:
            for line in report.summary_lines():
                self.print(f"  {line}")
