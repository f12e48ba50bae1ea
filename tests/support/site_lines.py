"""Test-only: the cited upstream lines a stand-in relies on, checked against the installed
packages (``moved_sites``), so an upgrade shows which site moved instead of a stand-in quietly
covering nothing."""

from __future__ import annotations

import os


def moved_sites(root: str, sites) -> list:
    """``sites``: (file under ``root``, 1-based line, text expected on that line); the ones whose
    line no longer holds the text, one message each."""
    moved = []
    for rel, line_no, text in sites:
        lines = open(os.path.join(root, rel), encoding="utf-8").read().splitlines()
        if line_no > len(lines) or text not in lines[line_no - 1]:
            moved.append(f"{rel}:{line_no} no longer contains {text!r}")
    return moved
