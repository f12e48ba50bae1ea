"""A non-editable install (the built wheel) carries the main job's configs and runs it:
the wheel is built from this checkout, installed with --target outside the
repository, and the main job runs from a directory that is not the repository."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _can_build_wheels() -> bool:
    """setuptools >= 70.1 builds wheels itself; older ones need the ``wheel`` package."""
    import importlib.util

    import setuptools
    from packaging.version import Version

    return Version(setuptools.__version__) >= Version("70.1") or importlib.util.find_spec("wheel") is not None


@pytest.mark.integration
@pytest.mark.skipif(not _can_build_wheels(), reason="this venv's setuptools cannot build wheels "
                    "(needs setuptools >= 70.1 or the wheel package)")
def test_wheel_ships_configs_and_runs_the_main_job(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(wheels), str(REPO)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("megatron_fastpath-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "megatron_fastpath/configs/config.yaml" in names
    assert "megatron_fastpath/configs/model/tiny_dense.yaml" in names
    site = tmp_path / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stderr[-3000:]
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    code = ("import sys, megatron_fastpath; assert megatron_fastpath.__file__.startswith(sys.argv[1]), "
            "megatron_fastpath.__file__; sys.argv = ['train'] + sys.argv[2:]; "
            "from megatron_fastpath.train import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, str(site), "training.steps=2", "model.num_layers=1",
                           "data.num_samples=64", "metrics.wandb=off", f"hydra.run.dir={run_dir}/run"],
                          cwd=run_dir, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "summary: 2 steps" in proc.stdout
