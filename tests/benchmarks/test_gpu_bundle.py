"""benchmarks/gpu_bundle.py and benchmarks/gpu_run.sh: the wheels a lent GPU machine lacks, and
the one command that installs them there with no network and runs the check.

The install test stands in for the lent machine: a fresh Python 3.12 virtual environment that
sees a torch environment's packages (torch, numpy, PyYAML, ...) but none of what the bundle
brings, installs the bundle with ``--no-index --no-deps`` through ``gpu_run.sh``, runs the check
(no CUDA here: exit 3, its "no CUDA" line) and parses the default job. It needs the bundle built
(``FASTPATH_GPU_BUNDLE``: ``python benchmarks/gpu_bundle.py --out DIR``, which downloads from
PyPI) and a Python 3.12 with torch (``FASTPATH_PY312``); ``.ci/run`` provides both."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.gpu_check_jobs import REPO
from tests.support.main_job import job_env

import gpu_bundle  # benchmarks/ is on pytest's pythonpath (pytest.ini)

# what the bundle brings: hidden from the stand-in machine's base environment
BUNDLED = ("megatron", "hydra", "omegaconf", "antlr4", "__editable__", "_megatron_fastpath")


def _fake_wheels(folder: Path, size: int = 1000) -> None:
    for req, _binary, _why in gpu_bundle.BUNDLE:
        name, version = req.split("==")
        (folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"x" * size)


def test_manifest_lists_each_wheel_with_its_hash_and_the_total(tmp_path):
    _fake_wheels(tmp_path)
    assert gpu_bundle.main(["--out", str(tmp_path)]) == 0  # every wheel there: nothing fetched
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert [w["name"] for w in m["wheels"]] == [r.split("==")[0] for r, _, _ in gpu_bundle.BUNDLE]
    assert m["total_bytes"] == 1000 * len(gpu_bundle.BUNDLE) and m["limit_bytes"] == 16 * 2**20
    import hashlib

    assert {w["sha256"] for w in m["wheels"]} == {hashlib.sha256(b"x" * 1000).hexdigest()}


def test_over_the_limit_exits_2(tmp_path, capsys):
    _fake_wheels(tmp_path, size=gpu_bundle.LIMIT_BYTES // 2)
    assert gpu_bundle.main(["--out", str(tmp_path)]) == 2
    assert "over its 16777216 limit" in capsys.readouterr().err


def test_two_versions_of_a_wheel_are_refused(tmp_path):
    _fake_wheels(tmp_path)
    (tmp_path / "omegaconf-2.2.0-py3-none-any.whl").write_bytes(b"y")
    with pytest.raises(SystemExit, match="expected one wheel of omegaconf"):
        gpu_bundle.manifest(tmp_path)


def test_run_without_a_bundle_says_how_to_build_it(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh"), str(tmp_path / "out"),
                           str(tmp_path / "none")], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 4 and "benchmarks/gpu_bundle.py --out" in proc.stderr


def _base_site(py312: str, into: Path) -> Path:
    """A folder of links to the torch environment's packages, less what the bundle brings."""
    site = Path(subprocess.run([py312, "-c", "import os, torch; print(os.path.dirname(os.path.dirname("
                                "torch.__file__)))"], capture_output=True, text=True, check=True).stdout.strip())
    into.mkdir()
    for entry in site.iterdir():
        if entry.name.lower().startswith(BUNDLED) or entry.suffix == ".pth":
            continue
        (into / entry.name).symlink_to(entry)
    return into


@pytest.mark.integration
@pytest.mark.skipif(not (os.environ.get("FASTPATH_GPU_BUNDLE") and os.environ.get("FASTPATH_PY312")),
                    reason="needs FASTPATH_GPU_BUNDLE (python benchmarks/gpu_bundle.py --out DIR) and "
                           "FASTPATH_PY312 (a Python 3.12 with torch); .ci/run sets both")
def test_bundle_installs_offline_into_a_torch_only_python312(tmp_path):
    bundle = Path(os.environ["FASTPATH_GPU_BUNDLE"])
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["total_bytes"] <= gpu_bundle.LIMIT_BYTES
    assert sum(p.stat().st_size for p in bundle.iterdir()) <= gpu_bundle.LIMIT_BYTES
    venv = tmp_path / "venv"
    subprocess.run([os.environ["FASTPATH_PY312"], "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    ver = subprocess.run([py, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert ver == "(3, 12)"
    base = _base_site(os.environ["FASTPATH_PY312"], tmp_path / "base")
    (venv / "lib" / "python3.12" / "site-packages" / "base.pth").write_text(f"{base}\n")
    site = tmp_path / "site"
    env = {k: v for k, v in job_env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=py, FASTPATH_SITE=str(site), PIP_NO_INDEX="1")
    # nothing of the bundle is importable before it is installed
    before = subprocess.run([py, "-c", "import megatron.core"], capture_output=True, text=True, env=env)
    assert before.returncode != 0 and "No module named 'megatron'" in before.stderr
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "benchmarks/gpu_run.sh", str(out), str(bundle)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no CUDA device on this machine" in (out / "gpu_check.log").read_text()
    assert json.loads((out / "gpu_check.json").read_text())["status"] == "no_cuda"
    installed = sorted(p.name for p in site.iterdir() if p.name.endswith(".dist-info"))
    assert [n.split("-")[0].lower() for n in installed] == sorted(
        r.split("==")[0].replace("-", "_").lower() for r, _, _ in gpu_bundle.BUNDLE)
    parse = ("from hydra import compose, initialize_config_dir\n"
             "from megatron_fastpath.train import config_dir, parse_job_config\n"
             "with initialize_config_dir(config_dir=config_dir(), version_base='1.3'):\n"
             "    cfg = compose(config_name='config')\n"
             "job = parse_job_config(cfg)\n"
             "import megatron.core, torch\n"
             "print('parsed', job.attention_backend, megatron.core.__file__, torch.__version__)\n")
    env["PYTHONPATH"] = f"{site}{os.pathsep}{REPO}"
    proc = subprocess.run([py, "-c", parse], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("parsed sdpa ") and str(site) in line  # megatron-core from the bundle
