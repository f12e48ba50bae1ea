"""benchmarks/gpu_check.py: on this CPU machine it runs nothing, says so and exits 3 with a
JSON; its runner (budget, timeouts, JUnit counts, statuses) is checked with quick commands."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_no_cuda_says_so_and_exits_3(tmp_path):
    out = tmp_path / "g.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == gpu_check.NO_CUDA_EXIT == 3
    assert "no CUDA device on this machine" in proc.stderr and "nothing was run" in proc.stderr
    report = json.loads(out.read_text())
    assert report["status"] == "no_cuda" and report["items"] == {} and report["environment"]["cuda_available"] is False


def test_runner_statuses_budget_and_junit(tmp_path, monkeypatch):
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="a" name="ok"/>'
                   '<testcase classname="a" name="bad"><failure message="x"/></testcase>'
                   '<testcase classname="b" name="sk"><skipped message="no TE"/></testcase>'
                   '</testsuite></testsuites>')
    py = sys.executable
    items = [("ok", [py, "-c", "print('hi')"], 0.1, lambda: gpu_check.junit_counts(xml)),
             ("bad", [py, "-c", "import sys; sys.exit(4)"], 0.1, dict),
             ("slow", [py, "-c", "import time; time.sleep(30)"], 0.0, dict),
             ("late", [py, "-c", "print(1)"], 0.1, dict)]
    monkeypatch.setattr(gpu_check, "environment", lambda: {"cuda_available": True, "torch": "x"})
    monkeypatch.setattr(gpu_check, "plan", lambda tmp: items)
    monkeypatch.setattr(gpu_check, "run_item", _with_timeout(gpu_check.run_item, slow_timeout=1.0))
    out = tmp_path / "g.json"
    assert gpu_check.main(["--out", str(out), "--budget-s", "40"]) == 1
    r = json.loads(out.read_text())
    assert r["status"] == "failed"
    assert r["items"]["ok"]["status"] == "passed" and r["items"]["ok"]["passed"] == 1
    assert r["items"]["ok"]["failed"] == ["a::bad"] and r["items"]["ok"]["skipped"] == ["b::sk: no TE"]
    assert r["items"]["bad"]["status"] == "failed" and r["items"]["bad"]["returncode"] == 4
    assert r["items"]["slow"]["status"] == "timeout"
    assert r["items"]["late"]["status"] == "passed"  # ~38 s of the 40 left after the timeout
    assert r["items"]["packed_seq_benchmark"]["status"] == "not run"


def _with_timeout(run_item, slow_timeout):
    def run(cmd, timeout_s, cwd):
        return run_item(cmd, slow_timeout if "sleep" in cmd[-1] else timeout_s, cwd)
    return run


def test_budget_leaves_later_items_not_run(tmp_path, monkeypatch):
    py = sys.executable
    items = [("first", [py, "-c", "print(1)"], 0.1, dict), ("second", [py, "-c", "print(2)"], 0.1, dict)]
    monkeypatch.setattr(gpu_check, "environment", lambda: {"cuda_available": True, "torch": "x"})
    monkeypatch.setattr(gpu_check, "plan", lambda tmp: items)
    out = tmp_path / "g.json"
    assert gpu_check.main(["--out", str(out), "--budget-s", "20"]) == 1  # < 30 s left: nothing runs
    r = json.loads(out.read_text())
    assert r["items"]["first"] == r["items"]["second"] == {"status": "not run", "reason": "budget"}


@pytest.mark.parametrize("name", sorted(gpu_check.JOBS))
def test_headline_jobs_parse(name):
    """Each headline configuration is one the main job accepts (checked here without a GPU:
    parse only, the memory check skipped)."""
    from tests.support.hydra_compose import compose_job

    from megatron_fastpath.train import parse_job_config

    overrides = gpu_check.JOBS[name]
    if "cuda_graphs.scope=full_iteration" in overrides:  # a GPU step: parsed in the stand-ins
        from tests.support.graph_safe_standins import gpu_standins

        cfg = compose_job(overrides + ["training.device=cuda", "training.skip_memory_check=true",
                                       "cluster.backend=gloo"])
        with gpu_standins():
            assert parse_job_config(cfg).plan.full_iteration
        return
    cfg = compose_job(overrides)
    assert parse_job_config(cfg).training.steps == 8
