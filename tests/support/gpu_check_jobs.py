"""The jobs of ``benchmarks/gpu_check.py`` parsed as the check parses them on a GPU, here inside
the GPU stand-ins (CUDA-as-CPU): ``te`` / ``flash`` say whether Transformer Engine and flash-attn
are reported installed (TE through the fake TE, which must be importable before Megatron:
``gpu_check_parse_worker``; flash through the stand-ins' graph-safe varlen module)."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the stand-ins have no device memory to ask about, and one process is its own world
STANDIN_OVERRIDES = ("training.skip_memory_check=true", "cluster.backend=gloo")


def gpu_check_module():
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["gpu_check"] = module
    return sys.modules["gpu_check"]


def parse_all(te: bool, flash: bool) -> dict:
    """{"jobs": the names parsed, "refused": name -> refusal, "skipped": name -> package}."""
    from megatron_fastpath import _optional
    from tests.support.graph_safe_standins import gpu_standins

    gpu_check = gpu_check_module()
    jobs = gpu_check.jobs(te=te, flash=flash)
    with gpu_standins():
        if not flash:  # the stand-ins install flash-attn: report it absent, as on the lent machine
            sys.modules["flash_attn"] = None
            _optional._try_import.cache_clear()
        assert _optional.have("flash_attn") is flash
        assert _optional.have("transformer_engine.pytorch") is te
        refused = gpu_check.parse_refusals(jobs, STANDIN_OVERRIDES)
    return {"jobs": sorted(n for n, (_, missing) in jobs.items() if missing is None),
            "refused": refused,
            "skipped": {n: missing for n, (_, missing) in jobs.items() if missing is not None}}
