"""compat's one version gate over the two checked megatron-core lines (0.16.x, 0.19.x) and the
shims that branch on the line: each branch runs here for the installed line, and the selection
of the other line's branch is driven with a fake version (compat.MCORE_VERSION patched)."""

import types

import pytest
from packaging.version import Version

from megatron_fastpath import compat
from megatron_fastpath.compat import graphs as graphs_compat
from megatron_fastpath.compat import optim as optim_compat

INSTALLED = compat.mcore_line()
OTHER = {(0, 16): Version("0.19.2"), (0, 19): Version("0.16.1")}[INSTALLED]


@pytest.mark.parametrize("version,line", [("0.16.1", (0, 16)), ("0.16.3", (0, 16)),
                                          ("0.19.0", (0, 19)), ("0.19.2", (0, 19))])
def test_gate_returns_the_checked_line(version, line):
    assert compat._require_checked_mcore("x", "why", version=Version(version)) == line


@pytest.mark.parametrize("version", ["0.15.3", "0.17.0", "0.18.2", "0.20.0", "1.0.0"])
def test_gate_refuses_the_unread_lines(version):
    with pytest.raises(ImportError, match=(
            rf"compat\.x was checked against megatron-core 0\.16\.x, 0\.19\.x only and "
            rf"megatron-core {version} is installed: why\.")):
        compat._require_checked_mcore("x", "why", version=Version(version))


# -- CUDA graphs: forward-graph input buffers ------------------------------------------------

def test_input_buffer_shim_for_the_installed_line():
    from megatron.core.transformer import cuda_graphs as cg

    if INSTALLED == (0, 16):
        graphs_compat.restore_cudagraph_input_recycling()
        assert graphs_compat.keep_cudagraph_input_buffers() is True
        assert type(cg._CudagraphGlobalRecord.tensor_reuse_pool).__name__ == "KeepFwdInputsPool"
        graphs_compat.restore_cudagraph_input_recycling()
        assert type(cg._CudagraphGlobalRecord.tensor_reuse_pool) is cg.TensorReusePool
    else:  # 0.19: no reuse pool; create_fwd_graph allocates and keeps the buffers itself
        assert not hasattr(cg, "TensorReusePool")
        assert graphs_compat.keep_cudagraph_input_buffers() is False
        graphs_compat.restore_cudagraph_input_recycling()  # nothing to undo
        assert not hasattr(cg._CudagraphGlobalRecord, "tensor_reuse_pool")


def test_input_buffer_shim_takes_the_named_lines_branch():
    """The other line's branch checks the other line's source, which the installed one is not:
    the 0.16 branch on 0.19 code misses the recycling, the 0.19 branch on 0.16 code misses the
    mempool allocation; both refuse instead of guessing."""
    match = "no longer contains" if INSTALLED == (0, 19) else "graph mempool"
    with pytest.raises(graphs_compat.CudaGraphShimError, match=match):
        graphs_compat.keep_cudagraph_input_buffers(OTHER)


def test_0_19_branch_checks_the_source_it_relies_on():
    class Runner:
        def create_fwd_graph(self):  # a line that recycles again, or allocates elsewhere
            return None

    with pytest.raises(graphs_compat.CudaGraphShimError, match="graph mempool"):
        graphs_compat._fwd_inputs_kept_upstream(types.SimpleNamespace(_CudaGraphRunner=Runner))


# -- CUDA graphs: capture warm-up ------------------------------------------------------------

def test_capture_warmup_through_megatrons_own_flags(monkeypatch):
    """Warm-up, then capture, then an eager pass, driven by the installed Megatron's own flag
    functions: the warm-up is seen on both lines; after it, 0.19 resets the flag (an eager
    pass is not warm-up) while 0.16.x leaves it set (told apart only during the capture)."""
    from megatron.core.transformer import cuda_graphs as cg

    monkeypatch.setattr(cg, "_IS_GRAPH_WARMUP", False)
    monkeypatch.setattr(cg, "_IS_GRAPH_CAPTURING", False)
    seen = [graphs_compat.in_capture_warmup()]
    cg._set_warmup_start()
    seen.append(graphs_compat.in_capture_warmup())
    cg._set_warmup_end()
    cg._set_capture_start()
    seen.append(graphs_compat.in_capture_warmup())
    cg._set_capture_end()
    seen.append(graphs_compat.in_capture_warmup())
    after = {(0, 16): True, (0, 19): False}[INSTALLED]  # 0.16.x: the flag stays set
    assert seen == [False, True, False, after]


@pytest.mark.parametrize("warmup,capturing,v016,v019", [
    (False, False, False, False), (True, False, True, True),
    (True, True, False, True),  # 0.16.x's stuck flag during a capture: not warm-up there
    (False, True, False, False)])
def test_capture_warmup_selection(monkeypatch, warmup, capturing, v016, v019):
    from megatron.core.transformer import cuda_graphs as cg

    monkeypatch.setattr(cg, "_IS_GRAPH_WARMUP", warmup)
    monkeypatch.setattr(cg, "_IS_GRAPH_CAPTURING", capturing)
    assert graphs_compat.in_capture_warmup(Version("0.16.1")) is v016
    assert graphs_compat.in_capture_warmup(Version("0.19.2")) is v019
    monkeypatch.setattr(compat, "MCORE_VERSION", OTHER)
    assert graphs_compat.in_capture_warmup() is (v016 if INSTALLED == (0, 19) else v019)


def test_static_input_wait_follows_the_installed_loader():
    """The installed StaticBufferLoader's copy path makes its stream wait for the current one
    exactly on the line the gate says it does (so the step path adds its own wait elsewhere)."""
    import inspect

    from megatron.core.full_cuda_graph import StaticBufferLoader

    src = inspect.getsource(StaticBufferLoader.__call__)
    assert ("self.stream.wait_stream(torch.cuda.current_stream())" in src) is \
        graphs_compat.static_inputs_wait_upstream()
    assert graphs_compat.static_inputs_wait_upstream(Version("0.19.2")) is True
    assert graphs_compat.static_inputs_wait_upstream(Version("0.16.1")) is False


def test_graph_inputs_per_microbatch_follows_the_installed_capture():
    """The installed CudaGraphManager attaches its buffer metadata along the ``_base`` chain
    (one buffer for an input several graphs take, its uses asserted consumed before the first
    backward graph) exactly on the line the gate says needs a slot per microbatch."""
    import inspect

    from megatron.core.transformer import cuda_graphs as cg

    src = inspect.getsource(cg)
    assert "assert fwd_buffer_reuse_ref_count == 0" in src  # both lines
    assert ("def _apply_cudagraph_buffer_metadata" in src) is graphs_compat.graph_inputs_per_microbatch()
    assert graphs_compat.graph_inputs_per_microbatch(Version("0.19.2")) is True
    assert graphs_compat.graph_inputs_per_microbatch(Version("0.16.1")) is False


# -- Sync-free optimizer: the gradients of the norm -------------------------------------------

class _Leaf:
    def get_main_grads_for_grad_norm(self):  # 0.16.x's name
        return ["0.16"]

    def get_grads_for_grad_norm(self):  # 0.19.x's name (optimizer/optimizer.py:280)
        return ["0.19"]


def test_grads_for_norm_selection(monkeypatch):
    """The installed line's branch on Megatron's real optimizers: tests/optim/
    test_sync_free_optimizer.py (bit-identical to Megatron's clipped step)."""
    assert optim_compat.leaf_grads_for_grad_norm(_Leaf(), Version("0.16.1")) == ["0.16"]
    assert optim_compat.leaf_grads_for_grad_norm(_Leaf(), Version("0.19.2")) == ["0.19"]
    monkeypatch.setattr(compat, "MCORE_VERSION", OTHER)
    assert optim_compat.leaf_grads_for_grad_norm(_Leaf()) == [".".join(map(str, (OTHER.major, OTHER.minor)))]


# -- Layer specs: the dense-MLP entry ---------------------------------------------------------

class _SubMLP(__import__("megatron.core.transformer.mlp", fromlist=["MLP"]).MLP):
    pass


def _local_mlp_entry():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec().submodules.mlp


def test_dense_mlp_entry_of_the_installed_line():
    """Megatron's own local spec: a ModuleSpec on 0.16.x, a partial of MLP.as_mlp_submodule
    on 0.19.x (models/gpt/gpt_layer_specs.py:547-552); either way the same submodules, and a
    subclass comes back in the form that line's TransformerLayer builds."""
    import functools

    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_fastpath.compat import spec

    mlp = _local_mlp_entry()
    subs = spec.dense_mlp_submodules(mlp)
    assert (subs.linear_fc1, subs.linear_fc2) == (ColumnParallelLinear, RowParallelLinear)
    assert spec.dense_mlp_module(mlp) is MLP
    swapped = spec.replace_dense_mlp(mlp, module=_SubMLP)
    assert spec.dense_mlp_module(swapped) is _SubMLP
    assert spec.dense_mlp_submodules(swapped) == subs
    expected = {(0, 16): ModuleSpec, (0, 19): functools.partial}[INSTALLED]
    assert type(mlp) is expected and type(swapped) is expected
    fc1 = spec.replace_dense_mlp(mlp, submodules=__import__("dataclasses").replace(
        subs, linear_fc1=RowParallelLinear))
    assert spec.dense_mlp_submodules(fc1).linear_fc1 is RowParallelLinear
    assert spec.dense_mlp_module(fc1) is MLP


@pytest.mark.parametrize("version,kind", [("0.16.1", "ModuleSpec"), ("0.19.2", "partial")])
def test_subclassed_module_spec_follows_the_line(monkeypatch, version, kind):
    """A ModuleSpec entry with another MLP class: kept a ModuleSpec for 0.16.x's
    build_module, made a builder for 0.19.x (whose TransformerLayer re-wraps only MLP /
    TEFusedMLP ModuleSpecs, transformer_layer.py:420-425)."""
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_fastpath.compat import spec

    subs = MLPSubmodules(linear_fc1="fc1", linear_fc2="fc2")
    entry = ModuleSpec(module=MLP, submodules=subs)
    monkeypatch.setattr(compat, "MCORE_VERSION", Version(version))
    if kind == "partial" and INSTALLED == (0, 16):  # the builder branch, on 0.16.x's MLP
        with pytest.raises(AttributeError, match="as_mlp_submodule"):
            spec.replace_dense_mlp(entry, module=_SubMLP)
        return
    out = spec.replace_dense_mlp(entry, module=_SubMLP)
    assert type(out).__name__ == kind
    assert spec.dense_mlp_module(out) is _SubMLP and spec.dense_mlp_submodules(out) is subs
    assert type(spec.replace_dense_mlp(entry, submodules=subs)) is ModuleSpec  # same class


def test_an_moe_entry_is_not_a_dense_mlp():
    from megatron_fastpath.compat import spec
    from megatron_fastpath.moe.spec import get_moe_mlp_spec

    moe = get_moe_mlp_spec(num_experts=4)
    assert spec.dense_mlp_submodules(moe) is None
    with pytest.raises(ValueError, match="not a dense MLP spec entry"):
        spec.replace_dense_mlp(moe, module=_SubMLP)
