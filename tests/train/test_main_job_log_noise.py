"""The main job prints one line naming the absent optional packages instead
of Megatron's per-module TE/Apex fallback warnings, torch's pynvml FutureWarning and one
"Unknown MLP type" per MoE layer -- filtered in the main job only, not for library users."""

import subprocess
import sys

from tests.support.main_job import job_env, run_main_job
from tests.support.subproc import free_port

import pytest

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

NOISE = ("Warning", "WARNING", "warnings.warn", "import pynvml", "Unknown MLP type",
         "Falling back", "multistorageclient", "Megatron-FSDP", "fontManager", "[INFO]")


def _env(tmp_path):
    # a fresh matplotlib cache: its first plot logs "generated new fontManager" (INFO)
    env = job_env(MPLCONFIGDIR=str(tmp_path / "mpl"))
    env.pop("PYTHONWARNINGS", None)  # the job's own filters are under test
    return env


def test_main_job_prints_one_absent_packages_line_and_no_warnings(tmp_path):
    run = run_main_job(["model=tiny_moe", "model.num_layers=3", "training.steps=2",
                        "data.num_samples=128"], tmp_path, env=_env(tmp_path), timeout=600)
    lines = run.output.splitlines()
    noisy = [line for line in lines if any(word in line for word in NOISE)]
    assert noisy == []
    absent = [line for line in lines if "optional packages absent" in line]
    assert len(absent) == 1 and "transformer_engine" in absent[0] and "apex" in absent[0]
    assert sum(line.startswith("step ") for line in lines) == 2


def test_library_users_keep_every_warning(tmp_path):
    """Building a fastpath MoE model as a library (no main job) still shows Megatron's own
    fallback warnings and its Unknown MLP type log; importing the package adds no filter."""
    code = (
        "import warnings, logging\n"
        "import megatron_fastpath, megatron_fastpath.train\n"
        "ours = lambda: [f for f in warnings.filters if f[1] is not None and f[1].pattern.startswith(\n"
        "    ('The pynvml', 'Apex', 'Transformer Engine'))]\n"
        "assert ours() == [], 'importing megatron_fastpath added a filter'\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from megatron_fastpath._noise import main_job_filters\n"
        "with main_job_filters(rank0=False): assert len(ours()) == 3\n"
        "assert ours() == [] and not logging.getLogger('megatron.core.transformer.transformer_layer').filters\n"
        "from megatron_fastpath.model import ModelConfig, build_transformer_config\n"
        "from megatron_fastpath.moe.spec import get_moe_mlp_spec\n"
        "from megatron_fastpath.layer_spec import megatron_base_spec\n"
        "import dataclasses, torch\n"
        "from megatron.core import parallel_state as ps\n"
        "torch.distributed.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1)\n"
        "ps.initialize_model_parallel()\n"
        "cfg = build_transformer_config(ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_experts=2))\n"
        "base = megatron_base_spec('local', num_experts=2)\n"
        "spec = dataclasses.replace(base.submodules, mlp=get_moe_mlp_spec(num_experts=2))\n"
        "from megatron.core.transformer.transformer_layer import TransformerLayer\n"
        "TransformerLayer(cfg, spec)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code.replace("{port}", str(free_port()))],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # torch warns of pynvml where the deprecated pynvml package is installed (megatron-core
    # 0.16.1's environment; 0.19.2's has nvidia-ml-py): whatever a bare `import torch` shows here
    bare = subprocess.run([sys.executable, "-c", "import torch"], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=600).stderr
    assert ("The pynvml package is deprecated" in proc.stderr) == ("The pynvml package is deprecated" in bare)
    assert "Apex is not installed. Falling back" in proc.stderr
    # megatron-core 0.16.1 logs it once per layer of an MLP type it does not list
    # (transformer/transformer_layer.py:368); 0.19 has no such log
    from megatron_fastpath import compat

    assert proc.stderr.count("Unknown MLP type") == (1 if compat.mcore_line() == (0, 16) else 0)
