"""The plain-text table the benchmarks print and write beside their JSON (``.txt``): columns
left-aligned to the widest cell, a rule under the header."""

from __future__ import annotations


def text_table(cols: list, cells: list) -> str:
    """``cols``: header strings; ``cells``: rows of strings, one per column."""
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    header = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [header, "-" * len(header)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)
