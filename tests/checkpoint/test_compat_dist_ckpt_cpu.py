"""compat.dist_ckpt.dist_checkpointing_on_cpu: needed (Megatron's save fails on a CPU without it), narrow
(only the two torch.cuda entry points, only while CUDA is unavailable, only inside the block),
and version-gated (another megatron-core minor line is refused loudly)."""

import contextlib
import os
import re
from unittest import mock

import pytest
import torch
from packaging.version import Version

from megatron_fastpath import compat
from megatron_fastpath.compat import dist_ckpt as dist_ckpt_compat


def _mcore_dir():
    import megatron.core

    return os.path.dirname(megatron.core.__file__)


def test_patched_sites_still_exist_in_installed_megatron():
    for rel, text in dist_ckpt_compat.DIST_CKPT_CPU_SITES:
        with open(os.path.join(_mcore_dir(), rel)) as f:
            assert text in f.read(), f"{rel} no longer contains {text!r}: re-check the shim"


def _cuda_init_error() -> Exception:
    """The error torch's CUDA initialisation (torch/cuda/__init__.py _lazy_init; torch 2.13
    :501-529, torch 2.11 :450-478) raises on this GPU-less machine: a CPU build raises
    AssertionError("Torch not compiled with CUDA enabled") (2.13 :522, 2.11 :471); a CUDA build
    raises c10's RuntimeError from torch._C._cuda_init() (2.13 :529, 2.11 :478; c10/cuda/
    CUDAFunctions.cpp device_count_ensure_non_zero: "Found no NVIDIA driver on your system..."
    without a driver, "No CUDA GPUs are available" with a driver and no device)."""
    with pytest.raises((AssertionError, RuntimeError)) as info:
        torch.cuda.init()
    return info.value


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure it fixes exists only without CUDA")
def test_megatron_save_needs_it_on_cpu_and_works_with_it(mcore_parallel, tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3), replica_id=0)}
    kw = dist_ckpt_compat.dist_checkpointing_save_kwargs()  # Megatron's own writer on 0.19
    (tmp_path / "a").mkdir()
    expected = _cuda_init_error()
    with pytest.raises(type(expected), match=f"^{re.escape(str(expected))}$") as info:
        dist_checkpointing.save(sd, str(tmp_path / "a"), **kw)
    assert type(info.value) is type(expected)
    (tmp_path / "b").mkdir()
    with dist_ckpt_compat.dist_checkpointing_on_cpu():
        dist_checkpointing.save(sd, str(tmp_path / "b"), **kw)
        out = dist_checkpointing.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), replica_id=0)},
            str(tmp_path / "b"),
        )
    assert torch.equal(out["w"], torch.arange(6.0).reshape(2, 3))


def test_patch_is_scoped_to_the_block():
    sync, current = torch.cuda.synchronize, torch.cuda.current_device
    with mock.patch.object(torch.cuda, "is_available", lambda: False):
        with dist_ckpt_compat.dist_checkpointing_on_cpu():
            assert torch.cuda.current_device() == torch.device("cpu")
            torch.cuda.synchronize()  # no-op, no error
    assert torch.cuda.synchronize is sync and torch.cuda.current_device is current


def test_inactive_when_cuda_is_available():
    with mock.patch.object(torch.cuda, "is_available", lambda: True):
        ctx = dist_ckpt_compat.dist_checkpointing_on_cpu()
    assert isinstance(ctx, contextlib.nullcontext)


@pytest.mark.parametrize("version,kwargs", [("0.16.1", {}), ("0.19.2", {"async_strategy": "mcore"})])
def test_save_names_megatrons_own_writer_on_0_19(version, kwargs):
    """0.19's save defaults to nvidia-resiliency-ext's writer (serialization.py:359); the shims
    here are for Megatron's own, the only one 0.16.x has."""
    assert dist_ckpt_compat.dist_checkpointing_save_kwargs(Version(version)) == kwargs
    with mock.patch.object(compat, "MCORE_VERSION", Version(version)):
        assert dist_ckpt_compat.dist_checkpointing_save_kwargs() == kwargs
    with pytest.raises(ImportError, match="0.16.x, 0.19.x only.*0.18.0"):
        dist_ckpt_compat.dist_checkpointing_save_kwargs(Version("0.18.0"))


def test_other_megatron_line_is_refused():
    with mock.patch.object(torch.cuda, "is_available", lambda: False), \
            mock.patch.object(compat, "MCORE_VERSION", Version("0.17.0")):
        with pytest.raises(ImportError, match="0.16.x.*0.17.0"):
            dist_ckpt_compat.dist_checkpointing_on_cpu()


# ------------------------------------------------------------------ the writer's helper process
def test_results_queue_site_still_exists_in_installed_megatron():
    rel, text = dist_ckpt_compat.RESULTS_QUEUE_SITE
    with open(os.path.join(_mcore_dir(), rel)) as f:
        assert text in f.read(), f"{rel} no longer contains {text!r}: re-check the shim"


@pytest.mark.parametrize("version,name", [("0.16.1", "_get_write_results_queue"),
                                          ("0.19.2", "get_write_results_queue")])
def test_results_queue_getter_is_named_per_line(version, name):
    assert dist_ckpt_compat.results_queue_getter_name(Version(version)) == name
    with pytest.raises(ImportError, match="0.16.x, 0.19.x only.*0.18.0"):
        dist_ckpt_compat.results_queue_getter_name(Version("0.18.0"))


def test_installed_megatron_has_the_getter_named():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert callable(getattr(filesystem_async, dist_ckpt_compat.results_queue_getter_name()))


def test_results_queue_shim_is_version_gated():
    with mock.patch.object(compat, "MCORE_VERSION", Version("0.17.0")):
        with pytest.raises(ImportError, match="0.16.x.*0.17.0"):
            dist_ckpt_compat.preemption_proof_results_queue()


_HELPER_PROBE = r'''
import json, os, signal, time
from multiprocessing import resource_tracker
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron_fastpath.compat import dist_ckpt

def masks(pid):
    with open(f"/proc/{pid}/status") as f:
        rows = dict(line.split(":", 1) for line in f)
    return {k: int(rows[k].strip(), 16) for k in ("SigIgn", "SigBlk")}

mode = os.environ["PROBE"]
megatrons_getter = getattr(filesystem_async, dist_ckpt.results_queue_getter_name())
if mode == "megatron":  # what megatron-core starts by itself
    q = megatrons_getter()
    server = [p for p in __import__("multiprocessing").active_children()][0].pid
else:
    q = dist_ckpt.preemption_proof_results_queue()
    assert megatrons_getter() is q  # Megatron uses the installed one
    server = dist_ckpt.writer_helper_pid()
out = {"server": masks(server), "tracker": masks(resource_tracker._resource_tracker._pid)}
for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    os.kill(server, sig)
time.sleep(0.5)
try:
    q.put("written"); out["after_signals"] = q.get(timeout=5)
except Exception as exc:
    out["after_signals"] = type(exc).__name__
print(json.dumps(out))
os._exit(0)  # like a SIGKILLed job: no finalizer stops the server
'''


def _probe(mode):
    import json
    import subprocess
    import sys

    from tests.support.subproc import child_env

    out = subprocess.run([sys.executable, "-c", _HELPER_PROBE], env=child_env(PROBE=mode),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bit(name):
    import signal

    return 1 << (getattr(signal, name) - 1)


@pytest.mark.integration
def test_megatrons_own_helper_dies_of_a_preemption_signal():
    """The defect the shim fixes, on the installed megatron-core: its queue server takes the
    default action for SIGTERM, so the job's save fails."""
    got = _probe("megatron")
    assert not got["server"]["SigIgn"] & _bit("SIGTERM")
    assert got["after_signals"] != "written"


@pytest.mark.integration
def test_installed_helper_ignores_preemption_signals_and_keeps_serving():
    got = _probe("ours")
    for name in ("SIGINT", "SIGTERM", "SIGUSR1"):
        assert got["server"]["SigIgn"] & _bit(name), name
    # the resource tracker ignores SIGINT / SIGTERM itself; SIGUSR1 is blocked for it
    assert (got["tracker"]["SigIgn"] | got["tracker"]["SigBlk"]) & _bit("SIGUSR1")
    assert got["after_signals"] == "written"
