"""The GPU stand-in inventory closes the class: every GPU library call the package
makes has an entry in ``tests/support/standin_registry.py`` naming its CPU stand-in (or why
there is none), no entry outlives its call, every stand-in named imports (one kept in a test
module is read from its source instead: tests do not import test modules), and the table in
docs/cuda-graphs.md is the registry's. The scanning rule is in the registry's docstring."""

import ast

import pytest

from tests.support import standin_registry as reg

PLANTED = '''
import torch
import transformer_engine as te
from megatron_fastpath._optional import require

def build(config):
    layer = te.pytorch.SomeNewModule(config.hidden_size)   # a new TE call, no entry
    fa = require("flash_attn", "x")
    out = fa.flash_attn_new_kernel(layer)                    # a new flash-attn call
    torch.cuda.Event()                                       # covered
    s = torch.cuda.ExternalStream(0)                         # a new torch.cuda call
    torch.cuda.is_available()                                # a query: not a GPU call
    buf = torch.empty(4, pin_memory=True)                    # covered
    return out
'''


@pytest.fixture(scope="module")
def found():
    return reg.scan_package()


def test_every_gpu_call_of_the_package_has_an_entry(found):
    uncovered = {n: locs for n, locs in found.items() if reg.covering_entry(n) is None}
    assert uncovered == {}, (
        "GPU library calls without a registry entry (add one to tests/support/"
        f"standin_registry.py: the stand-in covering it, or None and why): {uncovered}")


def test_no_stale_entry(found):
    stale = [e.call for e in reg.REGISTRY if not any(reg.covering_entry(n) is e for n in found)]
    assert stale == [], f"registry entries whose call the package does not make: {stale}"


def test_entries_are_calls_not_modules_and_unique(found):
    """An entry naming a bare module would cover any new call below it."""
    calls = [e.call for e in reg.REGISTRY]
    assert len(calls) == len(set(calls))
    modules = {"transformer_engine", "transformer_engine.pytorch", "flash_attn", "apex",
               "torch", "torch.cuda", "torch.cuda.nvtx", "megatron.core.fp8_utils",
               "megatron.core.extensions.transformer_engine"}
    assert [c for c in calls if c in modules] == []


@pytest.mark.parametrize("entry", reg.REGISTRY + reg.INDIRECT, ids=lambda e: e.call[:60])
def test_entry_names_an_importable_stand_in_or_a_reason(entry):
    if entry.standins is None:
        assert entry.reason.strip() and not entry.contracts, (
            f"{entry.call}: no stand-in needs a reason (and claims no contracts)")
        return
    assert entry.standins and entry.contracts.strip() and not entry.reason
    for path in entry.standins:
        if reg.is_test_module(path.rpartition(".")[0]):
            # read, not imported: tests import helpers, not test modules (test_layering.py)
            assert reg.defined_in_test_module(path), f"{path} is not defined any more"
        else:
            assert reg.import_standin(path) is not None, path


def test_a_missing_stand_in_is_reported():
    assert not reg.defined_in_test_module("tests.moe.test_moe_te_experts.NoSuchStandIn")
    assert reg.defined_in_test_module("tests.moe.test_moe_te_experts.GroupedLinearStandIn")
    with pytest.raises(AttributeError):
        reg.import_standin("tests.support.gpu_standins.NoSuchStandIn")


@pytest.mark.parametrize("entry", reg.INDIRECT, ids=lambda e: e.call[:60])
def test_indirect_entries_still_name_code_that_makes_the_call(entry):
    """The calls the scan cannot see: the function named still uses the names listed."""
    rel, function, names = entry.where
    tree = ast.parse((reg.PACKAGE / rel).read_text(encoding="utf-8"))
    fn = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
          and n.name == function]
    assert fn, f"{rel} has no function {function}"
    used = {n.attr for n in ast.walk(fn[0]) if isinstance(n, ast.Attribute)}
    used |= {n.value for n in ast.walk(fn[0]) if isinstance(n, ast.Constant)}
    assert set(names) <= used, f"{rel}:{function} does not use {set(names) - used}"


def test_every_compat_module_is_classified():
    present = sorted(p.name for p in (reg.PACKAGE / "compat").glob("*.py"))
    assert present == sorted(reg.COMPAT_MODULES)


def test_planted_calls_are_reported_uncovered():
    """The check fails on a violation: a new TE / flash-attn / torch.cuda call has no entry."""
    uses = dict(reg.scan_source(PLANTED))
    uncovered = sorted(n for n in uses if reg.covering_entry(n) is None)
    assert uncovered == ["flash_attn.flash_attn_new_kernel", "torch.cuda.ExternalStream",
                         "transformer_engine.pytorch.SomeNewModule"]
    assert reg.covering_entry("torch.cuda.Event").call == "torch.cuda.Event"
    assert "torch.empty(pin_memory=True)" in uses and "torch.cuda.is_available" not in uses


def test_scan_follows_lazy_imports_returned_modules_and_self_attributes():
    src = '''
from megatron_fastpath._optional import optional_import
import importlib
import torch

def _cls():
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb
    return apply_rotary_pos_emb

class A:
    def __init__(self):
        fp8 = optional_import("transformer_engine.pytorch.fp8")
        manager = getattr(fp8, "FP8GlobalStateManager", None) if fp8 else None
        self.on = manager is not None and manager.is_fp8_enabled()
        self._dist = importlib.import_module("transformer_engine.pytorch.distributed")

    def f(self, t, x: torch.cuda.Event):  # an annotation is not a use
        rope = _cls()
        t.record_stream(None)
        return rope(x), self._dist.activation_recompute_forward()
'''
    names = {n for n, _ in reg.scan_source(src)}
    assert names == {
        "transformer_engine.pytorch.attention.rope.apply_rotary_pos_emb",
        "transformer_engine.pytorch.fp8.FP8GlobalStateManager",
        "transformer_engine.pytorch.fp8.FP8GlobalStateManager.is_fp8_enabled",
        "transformer_engine.pytorch.distributed.activation_recompute_forward",
        "torch.Tensor.record_stream",
    }


def test_docs_table_is_the_registrys(found):
    block = reg.doc_block(reg.DOC.read_text(encoding="utf-8"))
    assert block == reg.render(found), (
        "docs/cuda-graphs.md's stand-in inventory is out of date: run "
        "`python -m tests.support.standin_registry`")
