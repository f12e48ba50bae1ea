"""Test-only: edit and read what the main job writes to a checkpoint directory and a summary
JSON (``train_state.json`` rewritten with its manifest entry kept true, format 1 as it was
written, the records of a summary)."""

import json
import os
import zlib


def rewrite_train_state(step_dir, edit) -> None:
    """``edit(state) -> state`` on ``train_state.json``, the manifest's entry kept true."""
    path = os.path.join(step_dir, "train_state.json")
    with open(path) as f:
        state = edit(json.load(f))
    with open(path, "w") as f:
        json.dump(state, f, indent=1)
    manifest_path = os.path.join(step_dir, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    data = open(path, "rb").read()
    manifest["train_state.json"] = {"bytes": len(data), "crc32": zlib.crc32(data)
                                    if manifest["train_state.json"]["crc32"] is not None else None}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)


def as_format_1(state: dict) -> dict:
    """What megatron_fastpath wrote as format 1 (checked against a real one): the parts and the
    history's keys side by side in ``extra``."""
    parts = dict(state.pop("parts"))
    history = parts.pop("history", {})
    return {**state, "format_version": 1, "extra": {**parts, **history}}


def records(path) -> list:
    """(step, loss, lr) of every record of a summary JSON."""
    with open(path) as f:
        return [(r["step"], r["loss"], r["lr"]) for r in json.load(f)["records"]]
