"""Offloaded Megatron TransformerLayers on CPU (RecordingDevice): bit-identical gradients against
plain TransformerLayers for every buffer mode and fallback, the recorded schedule, memory bounds,
host-pool stability and host syncs."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_fastpath.offload import (
    ActivationOffloadManager,
    BufferMode,
    OffloadConfig,
    RecordingDevice,
)
from megatron_fastpath.offload.layer import OffloadedTransformerLayer
from megatron_fastpath.offload.spec import get_offload_manager, with_activation_offload
from megatron_fastpath.offload.timing import replay_schedule
from megatron_fastpath.sync import SyncSentinel

from tests.offload.offload_models import LayerStack, build_pair, cpu_layer_spec, make_config, run_step

pytestmark = pytest.mark.usefixtures("mcore_parallel")

S, B, H = 16, 2, 64
ACT_BYTES_FP32 = S * B * H * 4


def _offload_stack(offload_cfg: OffloadConfig, device: RecordingDevice, *, dtype=torch.float32,
                   moe=False, num_layers=4, hidden_dropout=0.1):
    config = make_config(num_layers=num_layers, dtype=dtype, hidden_dropout=hidden_dropout,
                         moe=moe is True)
    spec = cpu_layer_spec(moe=moe)
    ospec = with_activation_offload(spec, offload_cfg, device=device)
    ref, off = build_pair(spec, ospec, config)
    return ref, off, ospec.params["offload_manager"]


def _assert_same(a, b):
    out_a, gx_a, gp_a = a
    out_b, gx_b, gp_b = b
    assert torch.equal(out_a, out_b), "forward output differs"
    assert torch.equal(gx_a, gx_b), "input gradient differs"
    assert gp_a.keys() == gp_b.keys()
    bad = [n for n in gp_a if not torch.equal(gp_a[n], gp_b[n])]
    assert not bad, f"parameter gradients differ: {bad}"


def _step(manager, model, x, seed=7):
    manager.begin_step()
    result = run_step(model, x, seed=seed)
    return result, manager.end_step()


CFG = dict(min_offload_bytes=0, headroom_margin_bytes=0)


# ---------------------------------------------------------------------------------------------
# numerics
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "saved_tensors"])
@pytest.mark.parametrize("moe", [False, True, "tiny"], ids=["dense", "moe", "tiny_moe"])
@pytest.mark.parametrize("eager", [None, 0], ids=["forward_order", "held_back"])
def test_gradients_bit_identical(dtype, recompute, moe, eager):
    dev = RecordingDevice()
    ref, off, mgr = _offload_stack(OffloadConfig(recompute=recompute, eager_offloads=eager, **CFG),
                                   dev, dtype=dtype, moe=moe)
    x = torch.randn(S, B, H, dtype=dtype)
    expected = run_step(ref, x)
    for seed_step in range(2):  # second step reuses pool and buffers
        got, stats = _step(mgr, off, x)
        _assert_same(expected, got)
        assert stats.mode is BufferMode.DOUBLE
        assert stats.layers_offloaded == 3 and stats.prefetched_reloads == 3
        assert stats.bytes_offloaded == stats.bytes_reloaded > 0
        assert stats.just_in_time_reloads == 0 and stats.est_exposed_copy_s == 0.0
        assert stats.eager_offloads == (3 if eager is None else 0)


def _plenty(unit):
    return RecordingDevice(free_bytes=1 << 40)


_UNIT: dict[bool, int] = {}


def _buffer_unit(recompute: bool) -> int:
    """Bytes of one reload buffer (largest group) for the default stack."""
    if recompute not in _UNIT:
        dev = RecordingDevice()
        _, off, mgr = _offload_stack(OffloadConfig(recompute=recompute, **CFG), dev)
        _step(mgr, off, torch.randn(S, B, H))
        _UNIT[recompute] = mgr._buffers.buffer_bytes
    return _UNIT[recompute]


FALLBACKS = {
    # name: (OffloadConfig overrides, device factory(buffer bytes), expected mode,
    #        expect offload, pinned pool)
    "single_low_headroom": (
        dict(headroom_margin_bytes=1000),
        lambda unit: RecordingDevice(free_bytes=unit + 1000 + 10),
        BufferMode.SINGLE, True, True),
    "off_no_headroom": (
        dict(headroom_margin_bytes=1000),
        lambda unit: RecordingDevice(free_bytes=unit + 999),
        BufferMode.OFF, False, True),
    "pinned_fails_pageable": (
        dict(), lambda unit: RecordingDevice(fail_pinned=True), BufferMode.DOUBLE, True, False),
    "host_alloc_fails_kept": (
        dict(), lambda unit: RecordingDevice(fail_host=True), BufferMode.DOUBLE, False, False),
    "double_disallowed": (
        dict(allow_double_buffer=False), _plenty, BufferMode.SINGLE, True, True),
    "disabled": (dict(enabled=False), _plenty, BufferMode.OFF, False, True),
    "below_threshold": (dict(min_offload_bytes=1 << 30), _plenty, None, False, True),
}


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "saved_tensors"])
@pytest.mark.parametrize("name", list(FALLBACKS))
def test_fallbacks_bit_identical(name, recompute, caplog):
    overrides, make_dev, mode, offloads, pinned = FALLBACKS[name]
    cfg = OffloadConfig(recompute=recompute, **{**CFG, **overrides})
    unit = _buffer_unit(recompute)
    dev = make_dev(unit)
    ref, off, mgr = _offload_stack(cfg, dev)
    x = torch.randn(S, B, H)
    expected = run_step(ref, x)
    with caplog.at_level(logging.INFO, logger="megatron_fastpath.offload.manager"):
        for _ in range(3):
            got, stats = _step(mgr, off, x)
            _assert_same(expected, got)
    if mode is not None:
        assert stats.mode is mode, stats
    assert (stats.bytes_offloaded > 0) == offloads, stats
    assert stats.bytes_reloaded == stats.bytes_offloaded
    assert dev.max_live_device_buffers <= (mode.num_buffers if mode else 2)
    assert mgr.host_pinned == (pinned and not dev.fail_pinned)
    if name == "single_low_headroom":
        assert stats.just_in_time_reloads == 3 and stats.prefetched_reloads == 0
        assert stats.est_exposed_copy_s == pytest.approx(stats.bytes_reloaded / 25e9)
        assert "second buffer does not fit" in stats.mode_reason
    if name in ("pinned_fails_pageable", "host_alloc_fails_kept", "single_low_headroom",
                "off_no_headroom"):
        # the reason is logged once, not every step
        msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(msgs) == len(set(msgs)) >= 1, msgs


def test_headroom_rechecked_every_step(caplog):
    """Budget shrinks and recovers between steps: double -> single -> off -> double, numerics
    unchanged, and each transition logged once."""
    margin = 64 * 1024
    dev = RecordingDevice(free_bytes=1 << 30)
    ref, off, mgr = _offload_stack(OffloadConfig(min_offload_bytes=0,
                                                 headroom_margin_bytes=margin), dev)
    x = torch.randn(S, B, H)
    expected = run_step(ref, x)
    modes = []
    budgets = [1 << 30, None, None, 1 << 30, 1 << 30]
    with caplog.at_level(logging.WARNING, logger="megatron_fastpath.offload.manager"):
        for step, budget in enumerate(budgets):
            if step == 1:  # below the margin with both buffers, above it with one released
                dev.free_bytes = margin - 10
            elif step == 2:  # below the margin even with the last buffer released
                dev.free_bytes = margin - mgr.device_buffer_bytes - 10
            elif budget is not None:
                dev.free_bytes = budget
            got, stats = _step(mgr, off, x)
            _assert_same(expected, got)
            modes.append(stats.mode)
            assert mgr.num_device_buffers == stats.mode.num_buffers
    assert modes == [BufferMode.DOUBLE, BufferMode.SINGLE, BufferMode.OFF, BufferMode.DOUBLE,
                     BufferMode.DOUBLE]
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("single buffer mode" in m for m in warnings) == 1
    assert sum("off buffer mode" in m for m in warnings) == 1


# ---------------------------------------------------------------------------------------------
# schedule
# ---------------------------------------------------------------------------------------------
def _index(trace, op, tag, **kw):
    for i, e in enumerate(trace):
        if e.op == op and e.tag == tag and all(getattr(e, k) == v for k, v in kw.items()):
            return i
    raise AssertionError(f"no {op} {tag} {kw} in trace")


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "saved_tensors"])
@pytest.mark.parametrize("eager", [None, 1], ids=["forward_order", "held_back"])
def test_double_buffer_schedule(recompute, eager):
    L = 6
    dev = RecordingDevice()
    _, off, mgr = _offload_stack(OffloadConfig(recompute=recompute, eager_offloads=eager, **CFG),
                                 dev, num_layers=L)
    x = torch.randn(S, B, H)
    _step(mgr, off, x)
    dev.clear_trace()
    _, stats = _step(mgr, off, x)  # steady state (buffers already allocated)
    trace = dev.trace
    keys = [f"L{i}" for i in range(1, L + 1)]
    # forward: every layer but the last is offloaded; the last never is
    for k in keys[:-1]:
        assert _index(trace, "copy", k, direction="d2h") >= 0
    assert not any(e.op == "copy" and e.tag == keys[-1] for e in trace)
    # in order: the eager ones as their layers run; the held ones once the window's last layer
    # (L5) has closed its group -- at its start (recompute) or after its forward -- latest first
    k = L - 1 if eager is None else eager
    d2h = [e.tag for e in trace if e.op == "copy" and e.direction == "d2h"]
    assert [t for j, t in enumerate(d2h) if j == 0 or d2h[j - 1] != t] == [
        keys[i] for i in [*range(k), *reversed(range(k, L - 1))]]
    closed_last = _index(trace, "compute_begin" if recompute else "compute_end", keys[L - 2],
                         phase="fwd")
    for key in keys[k:L - 2]:
        held = _index(trace, "copy", key, direction="d2h")
        assert held > _index(trace, "compute_end", keys[L - 3], phase="fwd")
        assert (held < closed_last) if recompute else (held > closed_last)
    # backward: the reload of layer i-1 is issued before layer i's backward compute, for every
    # layer that has a predecessor (in particular every middle layer)
    for i in range(1, L):
        reload_prev = _index(trace, "copy", keys[i - 1], direction="h2d")
        begin_i = _index(trace, "compute_begin", keys[i], phase="bwd")
        assert reload_prev < begin_i, (keys[i - 1], keys[i])
        if i < L - 1:  # ... and not before layer i+1's backward began (one layer lookahead)
            assert reload_prev > _index(trace, "compute_begin", keys[i + 1], phase="bwd")
    # two fixed buffers, alternating
    bufs = [e.buffer for e in trace if e.op == "copy" and e.direction == "h2d"]
    tags = [e.tag for e in trace if e.op == "copy" and e.direction == "h2d"]
    bufs = [b for j, b in enumerate(bufs) if j == 0 or tags[j] != tags[j - 1]]  # one per group
    assert bufs == [0, 1] * ((L - 1) // 2) + [0] * ((L - 1) % 2)
    assert dev.max_live_device_buffers == 2 and mgr.num_device_buffers == 2
    assert not any(e.op == "alloc_device" for e in trace)  # steady state: no allocation
    # replay with random durations: no buffer hazard whatever the copy/compute speeds
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        f, g, bw = (torch.rand(3, generator=gen) + 0.05).tolist()
        tl = replay_schedule(trace, {"fwd": f * 1e-3, "bwd": g * 1e-3}, bw * 1e7,
                                  prior_events_done=True)
        assert tl.hazards == (), tl.hazards


def test_single_buffer_schedule_serialises():
    L = 5
    dev = RecordingDevice()
    _, off, mgr = _offload_stack(OffloadConfig(allow_double_buffer=False, **CFG), dev,
                                 num_layers=L)
    _, stats = _step(mgr, off, torch.randn(S, B, H))
    trace = dev.trace
    keys = [f"L{i}" for i in range(1, L + 1)]
    for i in range(L - 1):
        reload_i = _index(trace, "copy", keys[i], direction="h2d")
        # just in time: after the next layer's backward, right before its own
        assert _index(trace, "compute_end", keys[i + 1], phase="bwd") < reload_i
        assert reload_i < _index(trace, "compute_begin", keys[i], phase="bwd")
    assert dev.max_live_device_buffers == 1
    assert stats.just_in_time_reloads == L - 1
    # the device schedule's closed form: host issue times (measured, load-dependent) left out
    tl = replay_schedule(trace, {"fwd": 1e-3, "bwd": 1e-3}, ACT_BYTES_FP32 / 1e-3,
                         use_host_times=False)
    assert tl.hazards == ()
    # serial: only the first reload (nothing to wait for) overlaps the last layer's backward
    assert tl.bwd_span == pytest.approx(L * 1e-3 + (L - 2) * 1e-3)


# ---------------------------------------------------------------------------------------------
# memory, host pool, syncs
# ---------------------------------------------------------------------------------------------
def test_memory_bound_and_constant_pool_over_50_steps():
    dev = RecordingDevice()
    _, off, mgr = _offload_stack(OffloadConfig(**CFG), dev, hidden_dropout=0.0)
    x = torch.randn(S, B, H)
    pool, ptrs, host_allocs = [], None, None
    for step in range(50):
        _, stats = _step(mgr, off, x, seed=step)
        pool.append(stats.host_pool_bytes)
        cur = [b.flat_N.data_ptr() for b in mgr._buffers.buffers]
        if step == 0:
            ptrs, host_allocs = cur, dev.host_allocations
        assert cur == ptrs, "reload buffers moved"
    assert len(set(pool)) == 1 and pool[0] == 3 * ACT_BYTES_FP32
    assert dev.host_allocations == host_allocs == 3
    assert mgr.host_pool_reallocs == 0 and mgr.buffer_reallocs == 0
    assert dev.peak_device_bytes <= 2 * ACT_BYTES_FP32
    assert dev.max_live_device_buffers == 2


def test_saved_tensor_groups_memory_bound():
    dev = RecordingDevice()
    _, off, mgr = _offload_stack(OffloadConfig(recompute=False, **CFG), dev)
    x = torch.randn(S, B, H)
    largest = 0
    for step in range(3):
        _, stats = _step(mgr, off, x)
    copies = [e for e in dev.trace if e.op == "copy" and e.direction == "d2h"]
    per_group: dict[str, int] = {}
    for e in copies:
        per_group[e.tag] = per_group.get(e.tag, 0) + e.nbytes
    largest = max(per_group.values())
    # buffers hold the largest group (plus alignment padding of its tensors)
    assert dev.peak_device_bytes <= 2 * (largest + 512 * 32)
    assert mgr.device_buffer_bytes == 2 * mgr._buffers.buffer_bytes


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_no_host_syncs_added(moe):
    x = torch.randn(S, B, H)
    counts = {}
    for enabled in (False, True):
        dev = RecordingDevice()
        _, off, mgr = _offload_stack(OffloadConfig(enabled=enabled, **CFG), dev, moe=moe)
        _step(mgr, off, x)  # warm-up (allocations)
        with SyncSentinel(count_ops=False) as sentinel:
            _, stats = _step(mgr, off, x)
        counts[enabled] = sentinel.num_syncs
        assert stats.bytes_offloaded == (3 * ACT_BYTES_FP32 if enabled else 0)
    assert counts[True] == counts[False] == 0


# ---------------------------------------------------------------------------------------------
# Megatron integration
# ---------------------------------------------------------------------------------------------
def test_accepts_megatron_forward_arguments():
    """Positional hidden_states / attention_mask, rotary_pos_emb, packed_seq_params=None and the
    (hidden_states, context) return value, against plain TransformerLayer."""
    dev = RecordingDevice()
    ref, off, mgr = _offload_stack(OffloadConfig(**CFG), dev, num_layers=3)
    hn = H // 4
    pos = torch.arange(S, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, hn, 2, dtype=torch.float32) / hn))
    freqs = torch.outer(pos, inv)
    rope = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, hn]
    mask = torch.ones(1, 1, S, S, dtype=torch.bool).triu(1)
    x = torch.randn(S, B, H)

    def run(model):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        h = x.clone().requires_grad_(True)
        out = h
        for layer in model.layers:
            out, context = layer(out, mask, rotary_pos_emb=rope, packed_seq_params=None)
            assert context is None
        out.square().sum().backward()
        return out.detach(), h.grad, {n: p.grad for n, p in model.named_parameters()}

    expected = run(ref)
    mgr.begin_step()
    got = run(off)
    stats = mgr.end_step()
    _assert_same(expected, got)
    assert stats.layers_offloaded == 2


def test_eval_and_no_grad_bypass_the_manager():
    dev = RecordingDevice()
    ref, off, mgr = _offload_stack(OffloadConfig(**CFG), dev, num_layers=2)
    x = torch.randn(S, B, H)

    def same():
        torch.manual_seed(1)
        a = ref(x)
        torch.manual_seed(1)
        return torch.equal(a, off(x))

    with torch.no_grad():
        assert same()
    ref.eval(), off.eval()
    assert same()
    assert dev.trace == []


def test_spec_helpers_and_errors():
    spec = cpu_layer_spec()
    ospec = with_activation_offload(spec, OffloadConfig(), device=RecordingDevice())
    assert ospec.module is OffloadedTransformerLayer and spec.module is TransformerLayer
    assert "offload_manager" not in spec.params
    mgr = ospec.params["offload_manager"]
    assert isinstance(mgr, ActivationOffloadManager)
    # block submodules: one manager shared by every layer spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    block = TransformerBlockSubmodules(layer_specs=[spec, spec])
    oblock = with_activation_offload(block, mgr)
    assert [s.params["offload_manager"] for s in oblock.layer_specs] == [mgr, mgr]
    block_spec = ModuleSpec(module=TransformerBlock, submodules=block)
    assert with_activation_offload(block_spec, mgr).submodules.layer_specs[0].module is (
        OffloadedTransformerLayer)
    with pytest.raises(TypeError, match="ActivationOffloadManager or an OffloadConfig"):
        with_activation_offload(spec, {"enabled": True})
    with pytest.raises(TypeError, match="ModuleSpec or TransformerBlockSubmodules"):
        with_activation_offload("layer", OffloadConfig())
    with pytest.raises(TypeError, match="TransformerLayer subclasses"):
        with_activation_offload(ModuleSpec(module=torch.nn.Linear), OffloadConfig())
    with pytest.raises(TypeError, match="needs offload_manager"):
        OffloadedTransformerLayer(make_config(), spec.submodules)
    # a model built from the spec finds its manager; layers registered in order
    model = LayerStack(ospec, make_config(num_layers=3))
    assert get_offload_manager(model) is mgr and mgr.layer_keys == ("L1", "L2", "L3")
    with pytest.raises(ValueError, match="registered twice"):
        LayerStack(ospec, make_config(num_layers=1))


def test_full_recompute_granularity_rejected():
    config = dataclasses.replace(make_config(), recompute_granularity="full",
                                 recompute_method="uniform", recompute_num_layers=1)
    ospec = with_activation_offload(cpu_layer_spec(), OffloadConfig(), device=RecordingDevice())
    with pytest.raises(ValueError, match="recompute_granularity"):
        LayerStack(ospec, config)


def test_gpt_model_end_to_end():
    """The lead's wiring: GPTModel(transformer_layer_spec=with_activation_offload(...))."""
    from megatron.core.models.gpt import GPTModel

    config = make_config(num_layers=3, hidden_dropout=0.0)
    spec = cpu_layer_spec()
    dev = RecordingDevice()
    ospec = with_activation_offload(spec, OffloadConfig(**CFG), device=dev)

    def build(s):
        torch.manual_seed(0)
        return GPTModel(config=config, transformer_layer_spec=s, vocab_size=128,
                        max_sequence_length=S, position_embedding_type="learned_absolute")

    ref, off = build(spec), build(ospec)
    off.load_state_dict(ref.state_dict())
    mgr = get_offload_manager(off)
    tokens = torch.randint(0, 128, (B, S))
    pos = torch.arange(S).expand(B, S)
    labels = torch.randint(0, 128, (B, S))

    def run(model):
        model.zero_grad(set_to_none=True)
        loss = model(tokens, pos, None, labels=labels).sum()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss_ref, g_ref = run(ref)
    for _ in range(2):
        mgr.begin_step()
        loss_off, g_off = run(off)
        stats = mgr.end_step()
        assert torch.equal(loss_ref, loss_off)
        assert all(torch.equal(g_ref[n], g_off[n]) for n in g_ref)
        assert stats.layers_offloaded == 2 and stats.mode is BufferMode.DOUBLE
