"""Activation offload vs CUDA graph capture and the offload layer's compat shims.

CUDA's stream-capture rule: a stream that waits on an event recorded on the capturing stream
joins the capture (it is "forked"), and every forked stream must be joined back -- the capture
stream waits on an event recorded on it after its last captured work -- before the capture
ends, or ``cudaStreamEndCapture`` fails (cudaErrorStreamCaptureUnjoined). ``CaptureRecorder``
is a RecordingDevice that enforces exactly that; the offload manager must refuse a capture
before it forks anything."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

from megatron_fastpath import compat
from megatron_fastpath.compat import offload as offload_compat
from megatron_fastpath.offload import OffloadConfig, RecordingDevice
from megatron_fastpath.offload.spec import with_activation_offload

from tests.offload.offload_models import LayerStack, cpu_layer_spec, make_config

S, B, H = 16, 2, 64
CFG = dict(min_offload_bytes=0, headroom_margin_bytes=0)


class CaptureRecorder(RecordingDevice):
    """RecordingDevice whose compute stream can be "captured"; ``end_capture`` raises like
    cudaStreamEndCapture when a stream forked from the capture is not joined back."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.capturing = False
        self._last_op: dict[str, int] = {}
        self._event_covers: dict[int, tuple[str, int]] = {}
        self._forked: set[str] = set()
        self._joined: dict[str, int] = {}
        self._seq = 0

    def is_capturing(self) -> bool:
        return self.capturing

    def begin_capture(self) -> None:
        self.capturing, self._forked, self._joined = True, set(), {}

    def end_capture(self) -> None:
        self.capturing = False
        unjoined = sorted(s for s in self._forked
                          if self._joined.get(s, -1) < self._last_op.get(s, 0))
        if unjoined:
            raise AssertionError(f"cudaErrorStreamCaptureUnjoined: streams {unjoined} forked from "
                                 "the capture stream were not joined before capture ended")

    def _touch(self, stream) -> None:
        self._seq += 1
        self._last_op[stream] = self._seq

    def record_event(self, event, stream) -> None:
        super().record_event(event, stream)
        self._event_covers[event.id] = (stream, self._last_op.get(stream, 0))

    def wait_event(self, stream, event) -> None:
        super().wait_event(stream, event)
        self._touch(stream)
        src, upto = self._event_covers[event.id]
        if not self.capturing:
            return
        if stream != "compute" and (src == "compute" or src in self._forked):
            self._forked.add(stream)
        if stream == "compute" and src in self._forked:
            self._joined[src] = max(self._joined.get(src, -1), upto)

    def copy(self, dst, src, stream, **kw) -> None:
        super().copy(dst, src, stream, **kw)
        self._touch(stream)


# -- the stand-in catches what CUDA refuses ------------------------------------------------------
def test_capture_recorder_refuses_an_unjoined_fork_and_accepts_a_joined_one():
    dev = CaptureRecorder()
    a, b = torch.zeros(4), torch.ones(4)
    for join in (False, True):
        dev.begin_capture()
        ev = dev.new_event()
        dev.record_event(ev, "compute")
        dev.wait_event("offload", ev)  # fork
        dev.copy(a, b, "offload", tag="x", direction="d2h")
        if join:
            back = dev.new_event()
            dev.record_event(back, "offload")
            dev.wait_event("compute", back)
            dev.end_capture()
        else:
            with pytest.raises(AssertionError, match="Unjoined.*offload"):
                dev.end_capture()


# -- the manager refuses a capture before forking ------------------------------------------------
@pytest.mark.usefixtures("mcore_parallel")
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "saved_tensors"])
def test_offload_refuses_graph_capture_before_forking(recompute):
    dev = CaptureRecorder()
    spec = with_activation_offload(cpu_layer_spec(), OffloadConfig(recompute=recompute, **CFG),
                                   device=dev)
    model = LayerStack(spec, make_config(num_layers=3))
    x = torch.randn(S, B, H, requires_grad=True)
    model(x).sum().backward()  # eager: fine
    dev.begin_capture()
    with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture"):
        model(x)
    dev.end_capture()  # nothing was forked from the capture stream


@pytest.mark.usefixtures("mcore_parallel")
@pytest.mark.parametrize("attr,value", [("cuda_graph_impl", "local"),
                                        ("cuda_graph_impl", "transformer_engine"),
                                        ("enable_cuda_graph", True)])
def test_offload_with_cuda_graphs_refused_before_building(attr, value):
    config = make_config(num_layers=2)
    setattr(config, attr, value)
    dev = RecordingDevice()
    spec = with_activation_offload(cpu_layer_spec(), OffloadConfig(**CFG), device=dev)
    with pytest.raises(ValueError, match="cannot be combined with CUDA graphs"):
        LayerStack(spec, config)
    assert dev.trace == []  # no device work


# -- compat shims ---------------------------------------------------------------------------------
def test_rng_state_shim_is_megatrons_own_and_roundtrips():
    from megatron.core.tensor_parallel import random as mcore_random

    get_all, set_all = offload_compat.all_rng_state_tools()
    assert get_all is mcore_random._get_all_rng_states
    assert set_all is mcore_random._set_all_rng_states


def test_forward_params_shim_reads_forward_attention():
    import inspect

    from megatron.core.transformer.transformer_layer import TransformerLayer

    names = [p.name for p in offload_compat.transformer_layer_forward_params()]
    expected = [n for n in inspect.signature(TransformerLayer._forward_attention).parameters
                if n != "self"]
    assert names == expected and names[:2] == ["hidden_states", "attention_mask"]
    assert "packed_seq_params" in names


@pytest.mark.parametrize("version", ["0.15.3", "0.17.0", "1.0.0"])
@pytest.mark.parametrize("shim", ["all_rng_state_tools", "transformer_layer_forward_params"])
def test_offload_shims_fail_loudly_on_unchecked_mcore(monkeypatch, shim, version):
    monkeypatch.setattr(compat, "MCORE_VERSION", Version(version))
    with pytest.raises(ImportError, match=f"checked against megatron-core 0.16.x, 0.19.x only.*{version}"):
        getattr(offload_compat, shim)()
