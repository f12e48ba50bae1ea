"""Crafted ``.metadata`` payloads are refused before anything in them runs; real checkpoints load.

Each payload would create a marker file (``touch``) or change a torch object if unpickled; the
test first shows the payload is live (plain ``pickle.loads`` runs it, where it runs at all),
then that ``safe_load_metadata`` / ``check_safe_to_load`` refuse it and the marker never
appears. Hand-written opcodes are used where ``pickle.dumps`` would not emit the attack."""

import copyreg
import json
import os
import pickle

import pytest
import torch

from megatron_fastpath.checkpoint.safety import (
    UnsafeCheckpointError,
    check_safe_to_load,
    safe_load_metadata,
)
from tests.checkpoint.pickle_payloads import (
    META,
    _call,
    _p4,
    _real_metadata,
    _s,
    _stack_global,
    _system,
    payloads,
)

def _run_with_plain_pickle(data: bytes, ext_code: int) -> None:
    copyreg.add_extension("posix", "system", ext_code)
    try:
        pickle.loads(data)
    except Exception:
        pass
    finally:
        copyreg.remove_extension("posix", "system", ext_code)


CASES = sorted(payloads("M")[0])


@pytest.mark.parametrize("case", CASES)
def test_crafted_metadata_is_refused_before_it_runs(tmp_path, case):
    from torch.serialization import _get_layout

    live_marker = tmp_path / "ran-with-plain-pickle"
    table, ext_code = payloads(live_marker)
    data, runs = table[case]
    live_marker.unlink(missing_ok=True)
    if runs:  # the payload is real: plain pickle executes it
        _run_with_plain_pickle(data, ext_code)
        assert live_marker.exists(), f"{case}: the payload does not run with plain pickle"

    marker = tmp_path / "ran"
    data = payloads(marker)[0][case][0]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / ".metadata").write_bytes(data)
    layouts = dict(_get_layout.cache)
    copyreg.add_extension("posix", "system", ext_code)  # EXT payloads resolve if unchecked
    try:
        with pytest.raises(UnsafeCheckpointError, match=r"\.metadata"):
            safe_load_metadata(str(model_dir / ".metadata"))
        with pytest.raises(UnsafeCheckpointError):
            check_safe_to_load(str(model_dir))
    finally:
        copyreg.remove_extension("posix", "system", ext_code)
    assert not marker.exists()
    assert _get_layout.cache == layouts and _get_layout("torch.strided") is torch.strided


def test_the_refusal_names_what_was_asked(tmp_path):
    p = tmp_path / ".metadata"
    p.write_bytes(_p4(_call(_stack_global(META, "os.system"), _s("true"))))
    with pytest.raises(UnsafeCheckpointError, match=r"attribute path torch\.distributed\.checkpoint"
                                                    r"\.metadata\.os\.system"):
        safe_load_metadata(str(p))


@pytest.mark.parametrize("proto", range(2, 6))
def test_metadata_as_torch_writes_it_loads_equal(tmp_path, proto):
    meta, _ = _real_metadata()
    p = tmp_path / ".metadata"
    p.write_bytes(pickle.dumps(meta, protocol=proto))
    assert safe_load_metadata(str(p)) == pickle.loads(p.read_bytes()) == meta


def test_metadata_with_byte_entries_is_refused(tmp_path):
    """The planner reads an entry described as bytes with torch.load(weights_only=False), even
    for a key asked as a tensor, so such a .metadata is refused."""
    meta, Bytes = _real_metadata()
    meta.state_dict_metadata["w"] = Bytes()
    (tmp_path / ".metadata").write_bytes(pickle.dumps(meta))
    assert safe_load_metadata(str(tmp_path / ".metadata")) == meta  # well-formed ...
    with pytest.raises(UnsafeCheckpointError, match=r"\['w'\] as byte objects"):
        check_safe_to_load(str(tmp_path))  # ... but not loadable


def test_not_a_metadata_object_is_refused(tmp_path):
    p = tmp_path / ".metadata"
    p.write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(UnsafeCheckpointError, match="not torch.distributed.checkpoint Metadata"):
        safe_load_metadata(str(p))


def test_truncated_metadata_is_refused(tmp_path):
    meta, _ = _real_metadata()
    p = tmp_path / ".metadata"
    p.write_bytes(pickle.dumps(meta)[:-20])
    with pytest.raises(UnsafeCheckpointError, match="not a readable checkpoint metadata file"):
        safe_load_metadata(str(p))


def test_payload_bytes_are_parsed_by_the_same_opcodes_as_torch():
    """The checker runs pickle's pure-Python unpickler; torch.distributed.checkpoint runs the C
    one. Both read the same opcode stream: a real metadata round-trips identically through
    each (shown above); here the pure-Python class is the one pickle ships."""
    from megatron_fastpath.checkpoint import safety

    assert issubclass(safety._MetadataUnpickler, pickle._Unpickler)
    # the checked opcodes are really replaced in the checker's table, not in pickle's
    for op in (pickle.REDUCE, pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.BUILD, pickle.EXT1):
        assert safety._MetadataUnpickler.dispatch[op[0]] is not pickle._Unpickler.dispatch[op[0]]


@pytest.mark.integration
def test_main_job_resume_refuses_the_reported_exploit(mcore_parallel, tmp_path):
    """The report: stop the main job at step 2, replace .metadata with the dotted-name payload,
    rewrite the manifest (whoever writes the checkpoint writes it), rerun: nothing runs, the
    resume is refused naming the file; the untouched checkpoint of a second run still resumes."""
    from tests.support.hydra_compose import compose_job

    from megatron_fastpath.checkpoint.files import _crc32
    from megatron_fastpath.train import run

    def cfg(*extra):
        return compose_job([
            "training.steps=3", "data.num_samples=64", "model.num_layers=1", "model.hidden_size=32",
            "model.ffn_hidden_size=64", "data.max_tokens=128", *extra])

    good, bad = tmp_path / "good", tmp_path / "bad"
    for d in (good, bad):
        assert run(cfg(f"checkpoint.dir={d}", "training.stop_at_step=2")).steps == 2
    ckpt = bad / "step_00000002"
    marker = tmp_path / "ran"
    (ckpt / "model" / ".metadata").write_bytes(_p4(_call(_stack_global(META, "os.system"), _system(marker))))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["model/.metadata"] = {"bytes": (ckpt / "model" / ".metadata").stat().st_size,
                                   "crc32": _crc32(str(ckpt / "model" / ".metadata"))}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UnsafeCheckpointError, match=r"step_00000002/model/\.metadata would look up "
                                                    r"the attribute path .*\.os\.system"):
        run(cfg(f"checkpoint.dir={bad}"))
    assert not marker.exists()
    assert run(cfg(f"checkpoint.dir={good}")).steps == 3


def unsafe_loads(source: str, filename: str) -> list[str]:
    """Calls in ``source`` that can run code from a file: pickle-family loads (outside the
    checked unpickler), torch.load without weights_only=True, np.load without
    allow_pickle=False, yaml.load, eval/exec, marshal/shelve/dill/joblib, trust_remote_code."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        base = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        kw = {k.arg: k.value for k in node.keywords}
        const = lambda key: kw[key].value if isinstance(kw.get(key), ast.Constant) else None  # noqa: E731
        where = f"{filename}:{node.lineno}"
        if base in ("pickle", "cPickle", "dill", "marshal", "shelve", "joblib") and name in (
                "load", "loads", "Unpickler", "open"):
            found.append(f"{where} {base}.{name}")
        elif base == "torch" and name == "load" and const("weights_only") is not True:
            found.append(f"{where} torch.load without weights_only=True")
        elif base in ("np", "numpy") and name == "load" and const("allow_pickle") is not False:
            found.append(f"{where} np.load without allow_pickle=False")
        elif base == "yaml" and name in ("load", "unsafe_load", "full_load"):
            found.append(f"{where} yaml.{name}")
        elif isinstance(f, ast.Name) and name in ("eval", "exec"):
            found.append(f"{where} {name}")
        elif const("trust_remote_code") is True:
            found.append(f"{where} trust_remote_code=True")
    return found


def test_no_loader_in_the_package_can_run_code_from_a_file():
    """Every loader of user files: the checkpoint's .metadata goes through the checked
    unpickler (safety.py, the one place allowed to subclass pickle's), tensors and FP8 state
    through safetensors / weights_only, the token cache with allow_pickle=False, tokenizer files
    through the tokenizers library (JSON) and a sandboxed Jinja environment, HF weights through
    safetensors (.bin refused)."""
    import megatron_fastpath

    root = os.path.dirname(megatron_fastpath.__file__)
    found = []
    for dirpath, _, files in os.walk(root):
        for fn in files:
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                found += unsafe_loads(open(path, encoding="utf-8").read(), os.path.relpath(path, root))
    assert found == []


def test_the_loader_audit_sees_each_unsafe_form():
    planted = ("import pickle, torch, numpy as np, yaml\n"
               "pickle.load(f)\ntorch.load(p)\ntorch.load(p, weights_only=False)\nnp.load(p)\n"
               "yaml.load(s)\neval(s)\nAutoModel.from_pretrained(d, trust_remote_code=True)\n"
               "torch.load(p, weights_only=True)\nnp.load(p, allow_pickle=False)\n")
    assert [x.split(" ", 1)[0] for x in unsafe_loads(planted, "x.py")] == [
        "x.py:2", "x.py:3", "x.py:4", "x.py:5", "x.py:6", "x.py:7", "x.py:8"]
