"""The main job's parse is pure and the preflight does the rest: ``parse_job_config`` gathers
the run's facts once, calls the rules once and touches nothing -- no file or directory, no
environment variable, no CUDA query -- and ``preflight(job_config)`` (run by ``build_job``
before any device work) creates and probes ``checkpoint.dir``, sets the plan's environment,
asks the GPU's capability for the rules that read it and runs the memory check."""

import os
import types

import pytest
import torch

from megatron_fastpath import rules
from megatron_fastpath.checkpoint import CheckpointDirError
from megatron_fastpath.train import parse_job_config, preflight
from tests.support.cuda_as_cpu import device_capability_standin, device_name_standin
from tests.support.hydra_compose import compose_job

SMALL = ["training.steps=4", "training.micro_batches=1", "data.num_samples=96",
         "data.max_tokens=128", "data.max_len=48", "data.max_seqs=8", "model.num_layers=2",
         "model.hidden_size=64", "model.ffn_hidden_size=96", "model.moe_ffn_hidden_size=32"]
# a captured MoE job on a GPU: its plan sets environment variables and a rule reads the
# GPU's capability (torch._grouped_mm's sync-free path)
GPU_MOE_GRAPHS = ["model=tiny_moe", "training.device=cuda", "training.dtype=bfloat16",
                  "fastpath.cuda_graphs=true", "cuda_graphs.use_te_rng_tracker=false",
                  "fastpath.attention_backend=sdpa", "cluster.backend=gloo"]
PLAN_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "NCCL_GRAPH_REGISTER", "CUDA_DEVICE_MAX_CONNECTIONS",
            "TORCH_NCCL_AVOID_RECORD_STREAMS")


@pytest.fixture
def stand_in_gpu(monkeypatch):
    """An sm90 stand-in CUDA device that counts the queries that initialise CUDA; the rules
    counted (every call, with its facts)."""
    for var in PLAN_ENV:
        monkeypatch.delenv(var, raising=False)  # restored after the test
    asked = {"capability": 0, "properties": 0}
    capability = device_capability_standin((9, 0))

    def get_device_capability(device=None):
        asked["capability"] += 1
        return capability(device)

    def get_device_properties(device=None):
        asked["properties"] += 1
        return types.SimpleNamespace(total_memory=80 * 2**30)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
    monkeypatch.setattr(torch.cuda, "get_device_name", device_name_standin("stand-in GPU"))
    calls = []
    real = rules.refusals

    def counted(facts):
        calls.append(facts)
        return real(facts)

    monkeypatch.setattr(rules, "refusals", counted)
    return types.SimpleNamespace(asked=asked, rule_calls=calls)


def tree(root):
    """Every path under ``root`` with its kind, mode and modification time."""
    out = {}
    for d, ds, fs in os.walk(root):
        for n in ds + fs:
            st = os.lstat(os.path.join(d, n))
            out[os.path.relpath(os.path.join(d, n), root)] = (st.st_mode, st.st_mtime_ns)
    return out


def test_the_parse_touches_nothing_and_calls_the_rules_once(tmp_path, stand_in_gpu):
    ro = tmp_path / "ro"
    ro.mkdir()
    ckpt = ro / "ckpt"
    os.chmod(ro, 0o555)  # read-only (for a user other than root)
    try:
        disk, env = tree(tmp_path), dict(os.environ)
        job = parse_job_config(compose_job(SMALL + GPU_MOE_GRAPHS + [f"checkpoint.dir={ckpt}"]))
        assert tree(tmp_path) == disk and not ckpt.exists()
    finally:
        os.chmod(ro, 0o755)
    assert dict(os.environ) == env  # the plan's environment is not applied
    assert job.plan.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert stand_in_gpu.asked == {"capability": 0, "properties": 0}  # no CUDA query
    assert stand_in_gpu.rule_calls == [job.facts]  # the rules once, with every fact
    assert job.facts.capability is None and job.facts.attention_backend == "sdpa"
    assert job.facts.is_moe and job.facts.graphs_captured
    assert job.training.steps == 4 and job.checkpoint.dir == str(ckpt)


def test_the_preflight_prepares_the_machine(tmp_path, stand_in_gpu):
    ckpt = tmp_path / "a" / "ckpt"
    job = parse_job_config(compose_job(SMALL + GPU_MOE_GRAPHS + [f"checkpoint.dir={ckpt}"]))
    preflight(job)
    assert os.listdir(ckpt) == []  # created; the probe file written and removed
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert stand_in_gpu.asked == {"capability": 1, "properties": 1}  # the rules', the memory check's
    # the same rules again, with the capability added to the parse's facts
    assert [f.capability for f in stand_in_gpu.rule_calls] == [None, (9, 0)]
    assert stand_in_gpu.rule_calls[1] == job.facts.__class__(**{**vars(job.facts), "capability": (9, 0)})


def test_the_preflight_refuses_what_the_machine_cannot_run(tmp_path, stand_in_gpu):
    (tmp_path / "f").write_text("x")
    job = parse_job_config(compose_job(SMALL + GPU_MOE_GRAPHS + [f"checkpoint.dir={tmp_path / 'f' / 'ckpt'}"]))
    with pytest.raises(CheckpointDirError, match=r"^checkpoint.dir='.*/f/ckpt' cannot be created "):
        preflight(job)
    assert os.listdir(tmp_path) == ["f"] and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    # fp32 on sm90: the grouped GEMMs' fallback syncs inside a captured layer
    job = parse_job_config(compose_job(SMALL + GPU_MOE_GRAPHS + ["training.dtype=float32"]))
    with pytest.raises(ValueError, match=r"this run is float32 on sm90.*training.dtype=bfloat16"):
        preflight(job)


def test_the_attention_backend_is_resolved_once(mcore_parallel, monkeypatch):
    """At parse; the layer spec and each layer's core attention take the JobConfig's backend
    as it is (counted at the dtype check every resolution runs)."""
    from megatron_fastpath.attention import backend as attention_backend
    from megatron_fastpath.attention import core_attention
    from megatron_fastpath.train.job import build_cache, build_model, build_transformer

    checked = []
    real = attention_backend.check_backend_dtype

    def counted(backend, *args, **kwargs):
        checked.append(backend)
        return real(backend, *args, **kwargs)

    monkeypatch.setattr(attention_backend, "check_backend_dtype", counted)
    job = parse_job_config(compose_job(SMALL + ["model=tiny_dense", "training.device=cpu"]))
    assert checked == ["sdpa"] and job.attention_backend == "sdpa"
    model, _, _ = build_model(job, build_transformer(job), build_cache(job))
    layers = [m for m in model.modules() if isinstance(m, core_attention.PackedCoreAttention)]
    assert [m.backend for m in layers] == ["sdpa", "sdpa"]
    assert checked == ["sdpa"]  # not resolved again by the spec or the layers


@pytest.mark.integration
def test_the_main_job_reports_a_preflight_refusal_in_one_line_with_exit_2(tmp_path):
    from tests.support.main_job import run_main_job

    (tmp_path / "f").write_text("x")
    ckpt = tmp_path / "f" / "ckpt"
    job = run_main_job(SMALL + ["model=tiny_dense", f"checkpoint.dir={ckpt}"], tmp_path,
                       check=False, timeout=300)
    assert job.returncode == 2, job.stdout[-3000:] + job.stderr[-3000:]
    lines = [line for line in job.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint.dir={str(ckpt)!r} cannot be created ")
    assert "step    1" not in job.stdout and (tmp_path / "f").read_text() == "x"
