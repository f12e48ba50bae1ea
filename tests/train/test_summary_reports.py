"""The run summary's feature parts come from the features' own reports (train/report.py): the
logger prints each report's suffix on the summary line and its lines under it, in the job's
order (packed cache, offload, audit, ..., checkpoints last), and puts its fields into the
summary. The run history is its own object, saved and restored as plain JSON."""

import dataclasses
import json
from types import SimpleNamespace

from tests.support.hydra_compose import compose_job

from megatron_fastpath.checkpoint.report import CheckpointReport
from megatron_fastpath.offload.report import OffloadReport
from megatron_fastpath.packed_seq.report import PackedCacheReport
from megatron_fastpath.train.history import RunHistory, StepRecord
from megatron_fastpath.train.report import SummaryReport

SMALL = ["training.steps=3", "data.num_samples=64", "model.num_layers=2", "model.hidden_size=32",
         "model.ffn_hidden_size=64", "data.max_tokens=128", "metrics.wandb=off",
         "metrics.plot=false", "metrics.tensorboard=false"]


class FakeReport:
    def summary_fields(self) -> dict:
        return {"audit": "fake audit", "audit_ok": True}

    def summary_suffix(self) -> str:
        return " | fake suffix"

    def summary_lines(self) -> list[str]:
        return ["fake line 1", "  fake line 2"]


def _record(step: int, **kw) -> StepRecord:
    return StepRecord(step=step, loss=5.0 - step, lr=1e-3, tokens=100, step_ms=10.0,
                      tokens_per_s=1e4, syncs_fwd_bwd=0, syncs_step=None, sync_sites=("a.py:1",),
                      cache_builds=4, **kw)


def test_run_history_round_trips_through_json():
    history = RunHistory()
    history.add_step(_record(1, grad_norm=0.5))
    history.add_eval(1, 4.25, 0.5)
    history.add_step(_record(2, skipped=True))
    back = RunHistory()
    back.load_state_dict(json.loads(json.dumps(history.state_dict())))
    assert back.records == history.records and back.evals == [(1, 4.25)]
    assert back.eval_accuracy == [(1, 0.5)] and back.loss_curve() == [(1, 4.0), (2, 3.0)]
    older = RunHistory()  # a history saved before evaluations were kept
    older.load_state_dict({"records": history.state_dict()["records"]})
    assert older.records == history.records and older.evals == [] == older.eval_accuracy


def test_feature_reports_speak_for_themselves():
    for report in (PackedCacheReport(None), OffloadReport(None), CheckpointReport(), FakeReport()):
        assert isinstance(report, SummaryReport)
    cache = SimpleNamespace(stats=SimpleNamespace(host_to_device_copies=10, bytes_copied=42440))
    assert PackedCacheReport(cache).summary_suffix() == " (10 H2D copies, 42440 bytes)"
    assert OffloadReport(SimpleNamespace(history=[])).summary_lines() == []
    last = SimpleNamespace(summary_line=lambda: "offload: mode double (fits)")
    assert OffloadReport(SimpleNamespace(history=[None, last])).summary_lines() == ["offload: mode double (fits)"]
    assert CheckpointReport().summary_lines() == [] and CheckpointReport().summary_fields()["checkpoint_bytes"] == 0
    saves = ({"step": 2, "bytes": 1000, "blocking_ms": 1.25, "wait_ms": 0.0, "async": False},
             {"step": 4, "bytes": 2000, "blocking_ms": 3.0, "wait_ms": 40.0, "async": True})
    report = CheckpointReport(saves, resumed_from="/c/step_00000001", stopped="signal SIGTERM",
                              best_checkpoint="/c/step_00000002", best_loss=1.5)
    assert report.summary_lines() == [
        "checkpoints: 2 saved, last 2,000 B, ms each save blocked the step [1.2, 3.0+40 wait], "
        "resumed from /c/step_00000001, stopped early: signal SIGTERM",
        "best checkpoint (lowest held-out loss, 1.5000): /c/step_00000002"]
    assert report.summary_fields() == dict(best_checkpoint="/c/step_00000002", resumed_from="/c/step_00000001",
                                           checkpoint_bytes=2000, checkpoint_saves=saves)


def test_logger_prints_the_reports_in_order_and_takes_their_fields(mcore_parallel, tmp_path, capsys):
    from megatron_fastpath.train import StepLogger, build_job, parse_job_config, train
    from megatron_fastpath.train.checkpointing import JobCheckpointer

    cfg = compose_job(SMALL + ["fastpath.offload=true", "offload.min_offload_bytes=0",
                               f"checkpoint.dir={tmp_path}", "training.stop_at_step=2"])
    job = build_job(parse_job_config(cfg))
    job = dataclasses.replace(job, reports=job.reports + (FakeReport(),))
    logger = StepLogger(job)
    ckpt = JobCheckpointer(job, logger)
    summary = train(job, logger, ckpt, ckpt.resume())
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(out) if line.startswith("summary: "))
    stats = job.cache.stats
    assert out[head].endswith(f"| cache builds {summary.cache_builds} ({stats.host_to_device_copies} "
                              f"H2D copies, {stats.bytes_copied} bytes) | fake suffix")
    tail = out[head + 1:]
    assert [line.split(":")[0] for line in tail] == [
        "  offload", "  fake line 1", "    fake line 2", "  checkpoints"]
    assert tail[3].startswith("  checkpoints: 1 saved, last ") and tail[3].endswith(", stopped early: stop_at_step")
    assert summary.audit == "fake audit" and summary.audit_ok is True and summary.stopped == "stop_at_step"
    assert [s["step"] for s in summary.checkpoint_saves] == [2] and summary.checkpoint_bytes > 0
