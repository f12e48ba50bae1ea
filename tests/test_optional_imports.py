"""Optional GPU packages: missing and half-installed (RuntimeError at import) both read as
'missing', and `require` names the package and the alternatives."""

import sys

import pytest

from megatron_fastpath import _optional


@pytest.fixture
def fake_modules(tmp_path, monkeypatch):
    (tmp_path / "half_installed_te.py").write_text(
        "raise RuntimeError('libcudart.so.12: cannot open shared object file')\n"
    )
    (tmp_path / "broken_lib.py").write_text("raise OSError('undefined symbol: cublasLt')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _optional._try_import.cache_clear()
    yield
    _optional._try_import.cache_clear()
    for m in ("half_installed_te", "broken_lib"):
        sys.modules.pop(m, None)


def test_half_installed_package_is_missing_not_a_crash(fake_modules):
    assert _optional.optional_import("half_installed_te") is None
    assert not _optional.have("broken_lib")
    with pytest.raises(_optional.MissingDependencyError, match="RuntimeError: libcudart"):
        _optional.require("half_installed_te", "the 'te' backend", "backend='sdpa'")


def test_require_names_pip_package_extra_and_alternatives():
    with pytest.raises(_optional.MissingDependencyError) as e:
        _optional.require("flash_attn", "the 'flash' attention backend", "backend='sdpa'")
    msg = str(e.value)
    if _optional.have("flash_attn"):
        pytest.skip("flash-attn installed")
    assert "'flash-attn'" in msg and "megatron_fastpath[flash]" in msg and "backend='sdpa'" in msg


def test_present_module_is_returned():
    import json

    assert _optional.require("json", "json") is json
