"""The main job: Hydra config composition, a short CPU training run whose loss falls with zero
host syncs per step, and config errors raised before any model is built."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from tests.paths import CONFIG_DIR

FAST = ["training.steps=12", "data.num_samples=256", "model.num_layers=2", "model.hidden_size=64",
        "model.ffn_hidden_size=160", "data.max_tokens=256", "training.lr=5e-3"]


def cfg(overrides=()):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_training_loss_falls_with_zero_host_syncs(mcore_parallel, capsys):
    from megatron_fastpath.train import run

    summary = run(cfg(FAST))
    out = capsys.readouterr().out
    assert summary.steps == 12 and len(summary.records) == 12
    assert summary.last_loss < summary.first_loss - 0.5, (summary.first_loss, summary.last_loss)
    assert summary.syncs_fwd_bwd_per_step == 0 and summary.syncs_per_step == 0
    # 2 microbatches x 2 layers x 2 derived kinds read per step; 2 kinds built per microbatch
    assert all(r.cache_hits == 8 and r.cache_misses == 4 for r in summary.records)
    assert out.count("\nstep ") + out.startswith("step ") == 12 and "summary: 12 steps" in out
    assert "host syncs: fwd+bwd 0, step 0" in out


def test_misspelled_override_rejected():
    with pytest.raises(ConfigCompositionException, match="trainig"):
        cfg(["trainig.steps=3"])
    with pytest.raises(ConfigCompositionException, match="stepz"):
        cfg(["training.stepz=3"])


@pytest.mark.parametrize(
    "override, match",
    [
        ("fastpath.attention_backend=flash", "flash-attn"),
        ("training.dtype=float16", "training.dtype must be float32 or bfloat16"),
        ("parallel.pipeline_model_parallel_size=2", "pipeline parallelism needs"),
        ("training.device=tpu", "training.device must be auto, cpu or cuda"),
        ("data.max_len=1000", "max_len=1000 must be <= max_tokens"),
    ],
)
def test_bad_config_errors_before_training(mcore_parallel, override, match, capsys):
    from megatron_fastpath.train import run

    with pytest.raises((ValueError, ImportError), match=match):
        run(cfg(FAST + [override]))
    assert "| loss " not in capsys.readouterr().out  # no step ran


def test_minimal_example_runs_sync_free(mcore_parallel, capsys):
    import runpy

    from tests.paths import REPO

    runpy.run_path(f"{REPO}/examples/packed_gpt_minimal.py", run_name="__main__")
    out = capsys.readouterr().out
    assert "host syncs: 0" in out and "1 host->device copy" in out
