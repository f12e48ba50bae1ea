"""Hostile and unlucky ``.metadata`` files are refused in one line, quickly and in bounded memory.

Each file is checked in a child process (``tests/workers/metadata_probe.py``): a payload that crashes the
interpreter, hangs in C code or exhausts memory then fails the test instead of ending it. The
child limits its address space to its baseline + 256 MB and kills itself after 10 s per file."""

import json
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

from megatron_fastpath.checkpoint.safety import UnsafeCheckpointError, safe_load_metadata
from tests.checkpoint import metadata_payloads as mp
from tests.checkpoint.pickle_payloads import payloads

PROBE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers", "metadata_probe.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe(tmp_path, cases: dict, batches: int = 1) -> dict:
    """Write each case to ``tmp_path/<i>/.metadata``, check them in ``batches`` children;
    name -> the child's record (``outcome``, ``msg``, ``seconds``, ``peak_mb``, ``dir``)."""
    dirs = {}
    for i, (name, data) in enumerate(cases.items()):
        d = tmp_path / f"case{i:03d}"
        d.mkdir()
        (d / ".metadata").write_bytes(data)
        dirs[name] = str(d)
    names = list(cases)
    records: dict = {}
    for b in range(batches):
        part = names[b::batches]
        spec, out = tmp_path / f"batch{b}.json", tmp_path / f"batch{b}.out"
        spec.write_text(json.dumps([[n, dirs[n]] for n in part]))
        env = dict(os.environ, PYTHONPATH=REPO)
        proc = subprocess.run([sys.executable, PROBE, str(spec), str(out)], env=env,
                              capture_output=True, text=True, timeout=60 + 10 * len(part))
        lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        for rec in lines:
            records.setdefault(rec["name"], {}).update(rec, dir=dirs[rec["name"]])
        last = lines[-1] if lines else {"name": "(before the first case)"}
        assert proc.returncode == 0, (
            f"the checker's process ended with {proc.returncode} on {last['name']!r}: "
            f"{proc.stderr[-2000:]}")
    return records


def _assert_refused_in_one_line(rec: dict) -> None:
    name, path = rec["name"], os.path.join(rec["dir"], ".metadata")
    assert rec["outcome"] == "refused", f"{name}: {rec['outcome']} {rec['msg'][:300]}"
    msg = rec["msg"]
    assert "\n" not in msg and len(msg) < 700, f"{name}: {msg[:800]!r}"
    assert re.match(re.escape(path) + r" (would|is not a readable|holds|describes) ", msg), f"{name}: {msg}"
    assert "MemoryError" not in msg and "RecursionError" not in msg, f"{name}: {msg}"
    assert rec["seconds"] < 10, f"{name}: {rec['seconds']:.1f} s"
    assert rec["peak_mb"] < 256, f"{name}: {rec['peak_mb']:.0f} MB"


BULLETS = {
    # hashing a 10**6-deep tuple recurses in C: the process died with SIGSEGV
    "deep-tuple-as-key": (mp.deep_tuple_key, r"would nest containers deeper than 100 levels"),
    # 2**80 leaves in 1 KB: hashing it, or printing it in the refusal, never finished
    "dag-as-key": (mp.dag_key, r"would hold a structure that expands to more than \d+ objects"),
    "dag-as-reduce-callable": (mp.dag_callable, r"would hold a structure that expands to more than \d+ objects"),
    # 105 KB of frozenset(S) repeated: gigabytes before the refusal
    "frozenset-copies": (mp.frozenset_copies, r"would build more than \d+ objects and references "
                                              r"\(the bound for a file of 104999 bytes\)"),
    # a real metadata with one LONG_BINPUT 2**26: accepted, then torch's C unpickler sized its
    # memo to 2**26 entries (1 GiB)
    "long-binput-2**26": (lambda: mp.metadata_with_long_binput(1 << 26),
                          r"would store memo slot 67108864 after 0 slots \(LONG_BINPUT"),
}


@pytest.mark.parametrize("case", sorted(BULLETS))
def test_resource_payload_is_refused_within_bounds(tmp_path, case):
    build, reason = BULLETS[case]
    rec = _probe(tmp_path, {case: build()})[case]
    _assert_refused_in_one_line(rec)
    assert re.search(reason, rec["msg"]), rec["msg"]


def test_every_payload_in_the_table_is_refused_in_one_line_quickly_in_bounded_memory(tmp_path):
    """Code execution and attribute traversal (the payloads of test_unpickling_safety),
    resources (depth, expansion, copies, memo indices, hash floods) and malformed files
    (truncated, unknown opcodes, protocols, declared lengths far past the file's end)."""
    canary = tmp_path / "canary"
    table, _ = payloads(canary)
    cases = {name: data for name, (data, _) in table.items()}
    cases.update(mp.resource_payloads())
    cases.update(mp.malformed_payloads())
    assert len(cases) >= 40
    records = _probe(tmp_path, cases, batches=2)
    assert sorted(records) == sorted(cases)
    for name in cases:
        _assert_refused_in_one_line(records[name])
    assert not canary.exists()


def test_a_large_real_metadata_stays_within_the_bounds(tmp_path):
    """2,000 tensors of 4 chunks each, one shared TensorProperties, sets, a frozenset and a
    slice (protocol 2 names them as Python 2 builtins), as torch writes them (protocols 2 and
    5): loaded equal, so the bounds leave real files alone."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    props = TensorProperties(dtype=torch.bfloat16)
    sdm, storage = {}, {}
    for t in range(2000):
        fqn = f"decoder.layers.{t}.mlp.linear_fc1.weight"
        chunks = [ChunkStorageMetadata(offsets=torch.Size([c * 8, 0]), sizes=torch.Size([8, 16]))
                  for c in range(4)]
        sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size([32, 16]), chunks=chunks)
        for c in range(4):
            storage[MetadataIndex(fqn, torch.Size([c * 8, 0]), c)] = _StorageInfo(f"__{c}_0.distcp", t * 512, 512)
    planner = {k: tuple(k.split(".")) for k in sdm}
    planner.update(ids=set(range(3000)), frozen=frozenset(sdm), window=slice(0, 8, 2))
    meta = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage)
    for proto in (2, 5):
        p = tmp_path / f"meta{proto}"
        p.write_bytes(pickle.dumps(meta, protocol=proto))
        assert safe_load_metadata(str(p)) == meta


def test_a_refusal_never_prints_the_objects_it_refuses(tmp_path):
    """A 19-level DAG (2**19 leaves, under the expansion bound for its size) passed to REDUCE
    as the callable: the refusal names its type and size only."""
    p = tmp_path / ".metadata"
    p.write_bytes(mp.dag_callable(19))
    with pytest.raises(UnsafeCheckpointError) as exc:
        safe_load_metadata(str(p))
    assert str(exc.value).startswith(f"{p} would call a tuple of 2 items (REDUCE): refusing")
