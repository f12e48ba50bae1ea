"""The main job: Hydra config composition, a short CPU training run whose loss falls with zero
host syncs per step, and config errors raised before any model is built."""

import pytest
from hydra.errors import ConfigCompositionException

from tests.support.hydra_compose import compose_job
from tests.support.main_job import run_main_job


FAST = ["training.steps=12", "data.num_samples=256", "model.num_layers=2", "model.hidden_size=64",
        "model.ffn_hidden_size=160", "data.max_tokens=256", "training.lr=5e-3"]


def cfg(overrides=()):
    return compose_job(list(overrides))


@pytest.mark.integration
@pytest.mark.smoke
def test_training_loss_falls_with_zero_host_syncs(mcore_parallel, capsys):
    from megatron_fastpath.train import run

    summary = run(cfg(FAST))
    out = capsys.readouterr().out
    assert summary.steps == 12 and len(summary.records) == 12
    assert summary.last_loss < summary.first_loss - 0.5, (summary.first_loss, summary.last_loss)
    assert summary.syncs_fwd_bwd_per_step == 0 and summary.syncs_per_step == 0
    # 2 microbatches x 2 layers x 2 derived kinds read per step; 2 kinds built per microbatch
    assert all(r.cache_builds == 4 for r in summary.records)  # mask + RoPE x 2 microbatches
    assert out.count("\nstep ") + out.startswith("step ") == 12 and "summary: 12 steps" in out
    assert "host syncs: fwd+bwd 0, step 0" in out
    # the summary says what its "loss A -> B" averages, and it is that average
    assert f"loss {summary.first_loss:.4f} -> {summary.last_loss:.4f} (mean of the first / last 3 steps)" in out
    assert summary.first_loss == sum(r.loss for r in summary.records[:3]) / 3


@pytest.mark.integration
def test_tiny_moe_training_loss_falls_with_zero_host_syncs(mcore_parallel):
    """The MoE acceptance run: 8 experts top-2, sort/count dispatcher, 0 syncs per step."""
    from megatron_fastpath.train import run

    summary = run(cfg(FAST + ["model=tiny_moe", "model.moe_ffn_hidden_size=64"]))
    assert summary.last_loss < summary.first_loss - 0.3, (summary.first_loss, summary.last_loss)
    assert summary.syncs_fwd_bwd_per_step == 0 and summary.syncs_per_step == 0


def test_misspelled_override_rejected():
    with pytest.raises(ConfigCompositionException, match="trainig"):
        cfg(["trainig.steps=3"])
    with pytest.raises(ConfigCompositionException, match="stepz"):
        cfg(["training.stepz=3"])
    with pytest.raises(ConfigCompositionException, match="packed_cache"):
        cfg(["fastpath.packed_cache=false"])  # attention always reads the cache: no switch


@pytest.mark.parametrize(
    "override, match",
    [
        ("fastpath.attention_backend=flash", "flash-attn"),
        ("training.dtype=float16", "training.dtype must be float32 or bfloat16"),
        ("parallel.pipeline_model_parallel_size=2", "pipeline parallelism needs"),
        ("training.device=tpu", "training.device must be auto, cpu or cuda"),
        ("data.max_len=1000", "max_len=1000 must be <= max_tokens"),
        # the MLPerf preset (TP4 CP2 SP): SP with CP is accepted where SP is (GPU, TE's
        # linears: tests/train/test_llama2_70b_lora_preset.py); a CPU refuses sequence
        # parallelism, with CP or without
        ("parallel=llama2_70b_lora", "parallel.sequence_parallel needs CUDA"),
        ("parallel=llama2_70b_lora parallel.context_parallel_size=1", "parallel.sequence_parallel needs CUDA"),
        ("parallel.expert_model_parallel_size=2", "needs an MoE model"),
        ("cluster.expected_world_size=4", "expects 4 processes but the launcher started 1"),
        ("cluster.backend=nccl", "cluster.backend=nccl needs CUDA"),
        ("cluster.backend=mpi", "cluster.backend must be auto, gloo or nccl"),
    ],
)
def test_bad_config_errors_before_training(mcore_parallel, override, match, capsys):
    from megatron_fastpath.train import run

    with pytest.raises((ValueError, ImportError), match=match):
        run(cfg(FAST + override.split()))
    assert "| loss " not in capsys.readouterr().out  # no step ran


def test_minimal_example_runs_sync_free(mcore_parallel, capsys):
    import os
    import runpy

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    runpy.run_path(f"{repo}/examples/packed_gpt_minimal.py", run_name="__main__")
    out = capsys.readouterr().out
    assert "host syncs: 0" in out and "1 host->device copy" in out


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe", "llama2_70b", "llama3_8b",
                                   "llama31_8b", "mixtral_8x7b", "qwen3_30b_a3b"])
@pytest.mark.parametrize("parallel", ["single", "ep2", "tp2_pp2", "llama2_70b_lora"])
@pytest.mark.parametrize("cluster", ["local", "slurm"])
def test_every_shipped_config_composes_into_typed_sections(model, parallel, cluster):
    from megatron_fastpath.data import DataConfig
    from megatron_fastpath.model import ModelConfig, build_transformer_config
    from megatron_fastpath.train import FastpathConfig, ParallelConfig, TrainingConfig, _section

    c = cfg([f"model={model}", f"parallel={parallel}", f"cluster={cluster}"])
    m = _section(c, "model", ModelConfig)
    from megatron_fastpath.train import ClusterConfig

    for name, cls in [("data", DataConfig), ("training", TrainingConfig),
                      ("fastpath", FastpathConfig), ("parallel", ParallelConfig),
                      ("cluster", ClusterConfig)]:
        _section(c, name, cls)
    tc = build_transformer_config(m)  # Megatron validates head/group/expert shapes
    assert tc.num_layers == m.num_layers and tc.num_moe_experts == m.num_experts
    from megatron_fastpath.model import rope_config_for
    from megatron_fastpath.packed_seq import Llama3RopeScaling

    assert rope_config_for(m).llama3 == (Llama3RopeScaling(8.0) if model == "llama31_8b" else None)


def test_real_shape_parameter_counts():
    """The real-shape configs describe the published models (parameter count from shapes)."""
    from megatron_fastpath.model import ModelConfig

    def params(m):
        head = m.kv_channels or m.hidden_size // m.num_attention_heads
        attn = m.hidden_size * head * (m.num_attention_heads * 2 + m.num_query_groups * 2)
        ffn = m.moe_ffn_hidden_size if m.num_experts else m.ffn_hidden_size
        mlp = 3 * m.hidden_size * ffn * (m.num_experts or 1)
        router = m.hidden_size * (m.num_experts or 0)
        return m.num_layers * (attn + mlp + router) + 2 * m.vocab_size * m.hidden_size

    expected_billions = {"llama2_70b": 69.0, "llama3_8b": 8.0, "llama31_8b": 8.0, "mixtral_8x7b": 46.7,
                         "qwen3_30b_a3b": 30.5}
    for name, billions in expected_billions.items():
        from megatron_fastpath.train import _section

        m = _section(cfg([f"model={name}"]), "model", ModelConfig)
        assert abs(params(m) / 1e9 - billions) / billions < 0.03, (name, params(m) / 1e9)


@pytest.mark.gpu
def test_gpu_main_job_runs_megatron_schedule_with_pipeline_parallel(tmp_path):
    """On >= 2 GPUs: the same entry point drives Megatron's get_forward_backward_func with PP=2
    and equals the PP=1 run's losses."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")

    losses = {}
    for pp, nproc in ((1, 1), (2, 2)):
        run = run_main_job(["training.device=cuda", "training.steps=6",
                            f"parallel.pipeline_model_parallel_size={pp}"], tmp_path, nproc=nproc,
                           name=f"pp{pp}")
        losses[pp] = [r["loss"] for r in run.summary["records"]]
    assert losses[2][-1] < losses[2][0]
    for a, b in zip(losses[1], losses[2]):
        assert abs(a - b) < 1e-3 * abs(a)


def test_moe_with_tensor_parallelism_refused_at_parse():
    """MoE + TP > 1 is refused at parse, not when building the model (the dispatcher refuses
    expert tensor parallelism, which Megatron defaults to the TP size; megatron-core's MoE
    layer refuses TP without sequence parallelism in training)."""
    from megatron_fastpath.train import parse_job_config

    for model in ("tiny_moe", "mixtral_8x7b"):
        with pytest.raises(ValueError, match="an MoE model with parallel.tensor_model_parallel_size=2"):
            parse_job_config(cfg(FAST + [f"model={model}", "parallel=tp2_pp2", "training.device=cpu",
                                         "parallel.pipeline_model_parallel_size=1"]))


@pytest.mark.parametrize("overrides, named", [
    (["fastpath.attention_backend=te"], "fastpath.attention_backend=te with fastpath.linear_impl=te"),
    (["fastpath.attention_backend=flash"], "fastpath.attention_backend=flash on"),
    (["fastpath.linear_impl=te"], "fastpath.linear_impl=te on"),
    (["fastpath.linear_impl=te", "fastpath.fp8=true"], "fastpath.linear_impl=te with fastpath.fp8=true on"),
    (["fastpath.fp8=true"], "fastpath.fp8=true on"),
])
def test_cuda_only_packages_on_a_cpu_refused_at_parse(monkeypatch, overrides, named):
    """With Transformer Engine / flash-attn installed, a job on training.device=cpu using them
    is refused at parse, not at its first forward (TE: 'TransformerEngine needs CUDA.', as the
    main job shows on the fake Transformer Engine, tests/te_standin)."""
    from megatron_fastpath import _optional
    from megatron_fastpath.attention import backend as attention_backend
    from megatron_fastpath.train import parse_job_config
    from tests.support.hydra_compose import compose_job

    monkeypatch.setattr(_optional, "have", lambda name: True)  # TE and flash-attn installed
    monkeypatch.setattr(_optional, "require", lambda *a, **k: None)
    monkeypatch.setattr(attention_backend, "require", lambda *a, **k: None)
    with pytest.raises(ValueError, match="run on CUDA only") as err:
        parse_job_config(compose_job(["training.device=cpu", "training.dtype=bfloat16", *overrides]))
    assert str(err.value).startswith(named)
    assert "fastpath.attention_backend=sdpa" in str(err.value)


def _shape(line: str) -> str:
    """A printed line with what depends on the machine (rates, times, memory) masked."""
    import re

    line = re.sub(r"\d+ tok/s \(\d+-step \d+\)", "R tok/s (N-step R)", line)
    line = re.sub(r"\| \d+ tok/s \|", "| R tok/s |", line)
    line = re.sub(r"\d+:\d\d:\d\d", "T", line)
    return re.sub(r"peak (RSS|mem) [\d.]+ GiB", r"peak \1 M GiB", line)


@pytest.mark.integration
def test_readme_shows_what_the_default_job_prints(mcore_parallel, capsys):
    """The README's printed block is the default job's output (the README's first command):
    the header, the first and last step lines and the summary, machine-dependent figures masked."""
    import pathlib

    from megatron_fastpath.train import run

    run(cfg([]))
    out = [_shape(line) for line in capsys.readouterr().out.splitlines()]
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("What a run prints", 1)[1].split("```", 2)[1].splitlines()
    shown = [_shape(line) for line in block
             if line.startswith(("megatron_fastpath: 4 layers", "step    1/", "step   40/", "summary:"))]
    assert len(shown) == 4
    missing = [line for line in shown if line not in out]
    assert missing == [], "README.md's block differs from what the default job prints:\n" + "\n".join(missing)
