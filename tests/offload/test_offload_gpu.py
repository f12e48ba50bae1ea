"""GPU-only offload tests (marked ``gpu``; skipped on CPU machines): real CUDA streams and
events, pinned host pool, fixed-address reload buffers, peak memory, host syncs under CUDA's sync
debug mode, and Transformer Engine FP8 layers (quantized saved tensors split / rebuilt)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_fastpath.offload import BufferMode, CudaOffloadDevice, OffloadConfig
from megatron_fastpath.offload.spec import with_activation_offload
from megatron_fastpath.sync import SyncSentinel

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("mcore_parallel")]

S, B, H, L = 256, 2, 256, 4
CFG = dict(min_offload_bytes=0, headroom_margin_bytes=0)


def _config(**kw):
    from tests.offload.offload_models import make_config

    return dataclasses.replace(make_config(num_layers=L, hidden=H, heads=8,
                                           dtype=torch.bfloat16), **kw)


def _cuda_stack(spec, config):
    from tests.offload.offload_models import LayerStack

    torch.manual_seed(0)
    return LayerStack(spec, config).cuda()


def _pair(offload_cfg, config=None, spec=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = config or _config()
    spec = spec or get_gpt_layer_local_spec()  # Megatron's own CUDA attention
    ospec = with_activation_offload(spec, offload_cfg, device=CudaOffloadDevice())
    ref = _cuda_stack(spec, config)
    off = _cuda_stack(ospec, config)
    off.load_state_dict(ref.state_dict())
    return ref, off, ospec.params["offload_manager"]


def _run(model, x, mgr=None, autocast=None):
    import contextlib

    model.zero_grad(set_to_none=True)
    if mgr is not None:
        mgr.begin_step()
    h = x.detach().clone().requires_grad_(True)
    with autocast() if autocast else contextlib.nullcontext():
        out = model(h)
    (out.float() * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum() \
        .backward()
    stats = mgr.end_step() if mgr is not None else None
    return (out.detach(), h.grad, {n: p.grad.clone() for n, p in model.named_parameters()}), stats


def _same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    bad = [n for n in a[2] if not torch.equal(a[2][n], b[2][n])]
    assert not bad, bad


@pytest.mark.parametrize("double", [True, False], ids=["double", "single"])
def test_cuda_streams_bit_identical_fixed_buffers_pinned_pool(double):
    ref, off, mgr = _pair(OffloadConfig(allow_double_buffer=double, **CFG))
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16)
    expected, _ = _run(ref, x)
    ptrs = None
    for step in range(5):
        got, stats = _run(off, x, mgr)
        _same(expected, got)
        assert stats.mode is (BufferMode.DOUBLE if double else BufferMode.SINGLE)
        cur = [b.flat_N.data_ptr() for b in mgr._buffers.buffers]
        ptrs = ptrs or cur
        assert cur == ptrs, "reload buffers moved"
    assert mgr.host_pinned and all(s.flat_N.is_pinned() for s in mgr._pool.slots.values())
    dev = mgr.device
    streams = {dev.offload_stream(), dev.reload_stream(), torch.cuda.current_stream()}
    assert len(streams) == 3  # offloads and reloads never share an in-order queue
    assert dev.reload_stream().priority <= dev.offload_stream().priority  # lower is higher
    assert stats.layers_offloaded == L - 1


def test_cuda_graph_capture_refused_before_forking():
    """A real capture: the manager raises before issuing anything on a side stream, so the
    capture itself ends cleanly (CUDA would otherwise fail it as unjoined)."""
    _, off, mgr = _pair(OffloadConfig(**CFG))
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _run(off, x.detach(), mgr)  # eager warm-up
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture"):
        with torch.cuda.graph(graph):
            off(x)
    assert not torch.cuda.is_current_stream_capturing()


def test_cuda_peak_memory_bound():
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16)
    act = x.numel() * x.element_size()
    peaks = {}
    for name, cfg in {"off": OffloadConfig(enabled=False, **CFG),
                      "double": OffloadConfig(max_offloaded_layers=None, **CFG)}.items():
        _, model, mgr = _pair(cfg)
        _run(model, x, mgr)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _run(model, x, mgr)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated()
        del model
    # offload keeps L-1 activations on the host; its only device cost is the two buffers
    assert peaks["double"] <= peaks["off"] + 2 * act


def test_cuda_no_host_syncs_added():
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16)
    counts = {}
    for enabled in (False, True):
        _, model, mgr = _pair(OffloadConfig(enabled=enabled, **CFG))
        _run(model, x, mgr)  # warm-up: allocations, pool, buffers
        _run(model, x, mgr)  # the "auto" window's calibration step
        torch.cuda.synchronize()
        with SyncSentinel(count_ops=False, cuda_debug=True) as sentinel:
            _run(model, x, mgr)
        counts[enabled] = sentinel.num_syncs
        if enabled:  # the "auto" window was planned inside the sentinel, from polled events
            assert mgr.window_plan is not None and mgr.history[-1].window_source == "planned"
    assert counts[True] <= counts[False], counts


def test_cuda_auto_window_from_device_timings():
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16)
    _, model, mgr = _pair(OffloadConfig(**CFG))  # window and order "auto"
    _run(model, x, mgr)  # warm-up: not timed
    _run(model, x, mgr)  # calibration step: timed with CUDA events
    assert mgr.history[-1].window_source == "calibrating"
    torch.cuda.synchronize()  # (a test's wait: the manager itself only polls)
    _, stats = _run(model, x, mgr)
    plan = mgr.window_plan
    assert plan is not None and stats.window_source == "planned"
    assert stats.offload_window == plan.window == stats.layers_offloaded
    assert stats.eager_offloads == plan.eager  # and the order planned with it
    assert all(m.free_step_s > 0 for m in plan.candidates)
    dev = mgr.device
    a, b = dev.timestamp(dev.compute_stream(), ("t", "begin", "x")), None
    torch.cuda._sleep(10_000_000)
    b = dev.timestamp(dev.compute_stream(), ("t", "end", "x"))
    assert dev.elapsed_s(a, b) is None  # still running: not waited for
    torch.cuda.synchronize()
    assert dev.elapsed_s(a, b) > 0


def test_cuda_pinned_failure_falls_back_to_pageable(monkeypatch):
    ref, off, mgr = _pair(OffloadConfig(**CFG))
    dev = mgr.device
    real = dev.alloc_host

    def no_pin(nbytes, pinned):
        if pinned:
            raise RuntimeError("simulated cudaHostAlloc failure")
        return real(nbytes, pinned)

    monkeypatch.setattr(dev, "alloc_host", no_pin)
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16)
    expected, _ = _run(ref, x)
    got, stats = _run(off, x, mgr)
    _same(expected, got)
    assert not stats.host_pinned and stats.layers_offloaded == L - 1


# ---------------------------------------------------------------------------------------------
# Transformer Engine FP8
# ---------------------------------------------------------------------------------------------
def _te_fp8():
    te = pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.common.recipe import DelayedScaling, Format

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                            amax_compute_algo="max")
    autocast = getattr(te, "fp8_autocast", None)
    if autocast is not None:
        return lambda: autocast(enabled=True, fp8_recipe=recipe)
    return lambda: te.autocast(enabled=True, recipe=recipe)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "saved_tensors"])
def test_te_fp8_layers(recompute):
    """TE FP8 TransformerLayers: offloaded == not offloaded, bit for bit.

    recompute=False offloads the layers' saved tensors, among them TE's FP8 tensors (split with
    prepare_for_saving, rebuilt with restore_from_saved); recompute=True re-enters TE's FP8
    recompute phase with the forward's recipe."""
    autocast = _te_fp8()
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(123)
    config = _config(fp8="hybrid", fp8_recipe="delayed")
    spec = get_gpt_layer_with_transformer_engine_spec()
    # reference: the same offloaded layers with offload disabled (same recompute path)
    _, ref, ref_mgr = _pair(OffloadConfig(enabled=False, recompute=recompute, **CFG),
                            config=config, spec=spec)
    _, off, mgr = _pair(OffloadConfig(recompute=recompute, **CFG), config=config, spec=spec)
    off.load_state_dict(ref.state_dict())
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # amax history evolves identically
        expected, _ = _run(ref, x, ref_mgr, autocast=autocast)
        got, stats = _run(off, x, mgr, autocast=autocast)
        _same(expected, got)
        assert stats.layers_offloaded == L - 1 and stats.bytes_reloaded == stats.bytes_offloaded
