"""benchmarks/gpu_check.py: on this CPU machine it runs nothing, says so and exits 3 with a
JSON; its runner (budget, timeouts, concurrency, JUnit counts, statuses, skips for a missing
package) is checked with quick commands, and every main job it runs is parsed with
``training.device=cuda`` under the GPU stand-ins, with TE and flash-attn reported absent (the lent
machine) and installed (a full GPU machine): a refusal there would stop the check on a GPU."""

import json
import subprocess
import sys

import pytest

from tests.support.gpu_check_jobs import REPO, gpu_check_module, parse_all
from tests.support.main_job import job_env

gpu_check = gpu_check_module()


def test_no_cuda_says_so_and_exits_3(tmp_path):
    out = tmp_path / "g.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == gpu_check.NO_CUDA_EXIT == 3
    assert "no CUDA device on this machine" in proc.stderr and "nothing was run" in proc.stderr
    report = json.loads(out.read_text())
    assert report["status"] == "no_cuda" and report["items"] == {} and report["environment"]["cuda_available"] is False


def test_every_job_parses_on_cuda_without_te_and_flash():
    """The lent machine: no TE, no flash-attn. Each job the check runs parses; the TE and flash
    jobs are listed as skipped, naming the package. The LoRA + per-layer graphs job is among those
    that parse (its capture warm-up default resolves to 0 with LoRA)."""
    got = parse_all(te=False, flash=False)
    assert got["refused"] == {}
    assert got["skipped"] == {"main_job_te_fp8": "transformer_engine",
                              "main_job_te_lora_cuda_graphs": "transformer_engine",
                              "main_job_flash": "flash_attn"}
    assert {"main_job_lora_cuda_graphs", "main_job_lora_full_iteration", "main_job_moe_cuda_graphs",
            "main_job_flex", "main_job_offload", "main_job_moe_full_iteration"} <= set(got["jobs"])


@pytest.mark.integration
def test_every_job_parses_on_cuda_with_te_and_flash():
    """A full GPU machine: TE (the fake TE, a child process: it must be importable before
    Megatron) and flash-attn installed; ``auto`` resolves to TE's attention. The
    full-iteration jobs (``use_te_rng_tracker=false``) are among those that parse."""
    proc = subprocess.run([sys.executable, "-m", "tests.workers.gpu_check_parse_worker"],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=job_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["refused"] == {}
    assert got["skipped"] == {}
    assert set(got["jobs"]) == set(gpu_check.jobs(te=True, flash=True))


def test_runner_statuses_concurrency_and_junit(tmp_path, monkeypatch):
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="a" name="ok"/>'
                   '<testcase classname="a" name="bad"><failure message="x"/></testcase>'
                   '<testcase classname="b" name="sk"><skipped message="no TE"/></testcase>'
                   '</testsuite></testsuites>')
    py = sys.executable
    summary = tmp_path / "s.json"
    summary.write_text(json.dumps({"steps": 8, "syncs_fwd_bwd_per_step": 0, "syncs_per_step": 2}))
    concurrent = [
        ("ok", [py, "-c", "print('megatron_fastpath: 4 layers, hidden 128')"], 30,
         lambda: gpu_check.junit_counts(xml), None),
        ("bad", [py, "-c", "import sys; sys.exit(4)"], 30, dict, None),
        ("slow", [py, "-c", "import time; time.sleep(30)"], 1.0, dict, None),
        ("synced", [py, "-c", "print(1)"], 30, lambda: gpu_check.job_summary(summary), None),
        ("needs_te", [py, "-c", "print(1)"], 30, dict, "transformer_engine"),
    ]
    sequential = [("late", [py, "-c", "print(1)"], 0.1, dict, None)]
    monkeypatch.setattr(gpu_check, "environment", lambda: {
        "cuda_available": True, "torch": "x", "have": {"transformer_engine": False, "flash_attn": False}})
    monkeypatch.setattr(gpu_check, "cold_start", lambda: {"cuda_context_s": 0.0})
    monkeypatch.setattr(gpu_check, "parse_refusals", lambda jobs, extra=(): {})
    monkeypatch.setattr(gpu_check, "plan", lambda tmp, env, budget: (concurrent, sequential))
    out = tmp_path / "g.json"
    assert gpu_check.main(["--out", str(out), "--budget-s", "120", "--parallel", "3"]) == 1
    r = json.loads(out.read_text())
    items = r["items"]
    assert r["status"] == "failed" and r["parallel"] == 3
    assert items["ok"]["status"] == "passed" and items["ok"]["passed"] == 1 and "startup_s" in items["ok"]
    assert items["ok"]["failed"] == ["a::bad"] and items["ok"]["skipped"] == ["b::sk: no TE"]
    assert items["bad"]["status"] == "failed" and items["bad"]["returncode"] == 4
    assert items["slow"]["status"] == "timeout"
    assert items["synced"]["status"] == "failed" and "expected 0" in items["synced"]["failure"]
    assert items["needs_te"]["status"] == "skipped" and items["needs_te"]["missing"] == "transformer_engine"
    assert "Transformer Engine is not installed" in items["needs_te"]["reason"]
    assert items["late"]["status"] == "passed"


def test_a_job_that_does_not_parse_stops_the_check_with_2(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "environment", lambda: {
        "cuda_available": True, "torch": "x", "have": {"transformer_engine": False, "flash_attn": False}})
    monkeypatch.setattr(gpu_check, "cold_start", dict)
    monkeypatch.setattr(gpu_check, "parse_refusals", lambda jobs, extra=(): {"main_job_x": "ValueError: no"})
    out = tmp_path / "g.json"
    assert gpu_check.main(["--out", str(out)]) == gpu_check.PARSE_EXIT == 2
    r = json.loads(out.read_text())
    assert r["status"] == "parse_refused" and r["parse_refusals"] == {"main_job_x": "ValueError: no"}


def test_budget_leaves_later_items_not_run(tmp_path, monkeypatch):
    py = sys.executable
    concurrent = [("first", [py, "-c", "print(1)"], 10, dict, None)]
    sequential = [("second", [py, "-c", "print(2)"], 0.1, dict, None)]
    monkeypatch.setattr(gpu_check, "environment", lambda: {
        "cuda_available": True, "torch": "x", "have": {"transformer_engine": False, "flash_attn": False}})
    monkeypatch.setattr(gpu_check, "cold_start", dict)
    monkeypatch.setattr(gpu_check, "parse_refusals", lambda jobs, extra=(): {})
    monkeypatch.setattr(gpu_check, "plan", lambda tmp, env, budget: (concurrent, sequential))
    out = tmp_path / "g.json"
    assert gpu_check.main(["--out", str(out), "--budget-s", "20"]) == 1  # < 30 s left: nothing runs
    r = json.loads(out.read_text())
    assert r["items"]["first"] == r["items"]["second"] == {"status": "not run", "reason": "budget"}
