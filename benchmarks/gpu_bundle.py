"""The wheels a lent GPU machine lacks, for CPython 3.12 manylinux x86_64, in one folder.

    python benchmarks/gpu_bundle.py [--out .whl]

The lent machine (docs/gpu-step.md) has Python 3.12, torch, numpy, PyYAML, packaging, jinja2,
safetensors, tokenizers, transformers, peft and pytest, and no network. What this package imports
beyond those is :data:`BUNDLE`: megatron-core and the main job's Hydra config stack (hydra-core,
omegaconf and the ANTLR runtime they parse with, which PyPI has as a source archive only: it is
built here into a pure-Python wheel). They are downloaded with ``--no-deps`` for the target, so
nothing else (a torch above all) comes along. The folder gets ``manifest.json`` (name, version,
file, bytes, sha256, why) and must stay within :data:`LIMIT_BYTES` (the lent machine takes 64 MiB
with the working tree). ``benchmarks/gpu_run.sh`` installs it there with ``--no-index``.

Exit 0 with the folder written; 2 when a download fails (the error says which) or the folder is
over the limit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

LIMIT_BYTES = 16 * 2**20
# (requirement, binary wheel for the target or None: built here from its source archive, why)
BUNDLE = (
    ("megatron-core==0.16.1", True, "the model, its layers and schedules (compat-gated 0.16.x)"),
    ("hydra-core==1.3.2", True, "the main job's config (setup.py: hydra-core>=1.3.2,<1.4)"),
    ("omegaconf==2.3.0", True, "hydra-core's config objects"),
    ("antlr4-python3-runtime==4.9.3", False, "omegaconf's interpolation grammar (hydra pins 4.9.*)"),
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def fetch(requirement: str, binary: bool, out: Path) -> None:
    pip = [sys.executable, "-m", "pip"]
    if binary:
        cmd = pip + ["download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                     "--implementation", "cp", "-d", str(out), requirement]
        for plat in PLATFORMS:
            cmd[-1:-1] = ["--platform", plat]
    else:
        cmd = pip + ["wheel", "-q", "--no-deps", "--no-binary=:all:", "-w", str(out), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.splitlines() if "ERROR" in ln][-2:] or proc.stderr.splitlines()[-2:]
        raise SystemExit(f"error: {requirement} could not be fetched for CPython 3.12 "
                         f"manylinux ({'; '.join(tail)}); pip needs PyPI here to build the bundle")


def manifest(out: Path) -> dict:
    wheels = []
    for req, _binary, why in BUNDLE:
        name = req.split("==")[0]
        stem = name.replace("-", "_").lower()
        found = [w for w in out.glob("*.whl") if w.name.lower().startswith(stem + "-")]
        if len(found) != 1:
            raise SystemExit(f"error: expected one wheel of {name} in {out}, found "
                             f"{[w.name for w in found]}: remove the folder and build it again")
        w = found[0]
        wheels.append({"name": name, "version": req.split("==")[1], "file": w.name,
                       "bytes": w.stat().st_size, "sha256": hashlib.sha256(w.read_bytes()).hexdigest(),
                       "why": why})
    total = sum(w["bytes"] for w in wheels)
    return {"python": "cp312", "platform": "manylinux x86_64", "wheels": wheels,
            "total_bytes": total, "limit_bytes": LIMIT_BYTES,
            "install": "python3 -m pip install --no-index --no-deps --target SITE <folder>/*.whl"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(".whl"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for req, binary, _why in BUNDLE:
        stem = req.split("==")[0].replace("-", "_").lower()
        if not any(w.name.lower().startswith(f"{stem}-{req.split('==')[1]}-") for w in args.out.glob("*.whl")):
            fetch(req, binary, args.out)
    m = manifest(args.out)
    (args.out / "manifest.json").write_text(json.dumps(m, indent=1))
    for w in m["wheels"]:
        print(f"  {w['file']}  {w['bytes'] / 2**20:.2f} MiB  ({w['why']})")
    print(f"gpu_bundle: {len(m['wheels'])} wheels, {m['total_bytes'] / 2**20:.2f} MiB of "
          f"{LIMIT_BYTES / 2**20:.0f} MiB in {args.out}")
    if m["total_bytes"] > LIMIT_BYTES:
        print(f"error: the bundle is {m['total_bytes']} bytes, over its {LIMIT_BYTES} limit", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
