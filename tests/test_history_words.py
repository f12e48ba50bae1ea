"""Code, tests and docs say what is, not how it came to be: no tracker or issue numbers
("issue 40", "(issue 23 item 2)", "#40", a review's item codes such as "G17:"), no numbered
work sessions, and no "used to" / "previously" about an earlier state of this code. The check
greps the package, the tests, the docs, the benchmarks, the Slurm scripts, the examples and the
README; it fails with every ``file:line`` and the words found. ``CHANGELOG.md`` is the one place
history belongs, and is not read.

A hit that is not history (an upstream pull request cited as the source of a fact, a test of
this very check) is allowed by :data:`ALLOWED`: the file, a piece of its line, and why."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("megatron_fastpath", "tests", "docs", "benchmarks", "slurm", "examples", "README.md")
SUFFIXES = {".py", ".md", ".sh", ".sbatch", ".yaml", ".yml", ".txt", ".ini", ".cfg", ".toml"}

PATTERNS = {
    "issue number": re.compile(r"\bissues? \d+", re.I),
    "tracker number": re.compile(r"(?<![\w/&.-])#\d{2,}\b"),
    "review item": re.compile(r"(?<![\w.-])G\d{1,2}(?=[:),])"),
    "numbered session": re.compile(r"\bsession \d+", re.I),
    "previously": re.compile(r"\bpreviously\b|\bprevious (?:code|version|commit)\b", re.I),
    # "X used to be / keep ..." (an earlier state); "is used to compute" (a purpose) is fine
    "used to": re.compile(r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bbeing )(?<!\bwas )"
                          r"(?<!\bwere )(?<!, )(?<!\bget )(?<!\bgets )\bused to\b", re.I),
}

# (file relative to the repository, a piece of the line, why it is not history)
ALLOWED = [
    ("megatron_fastpath/compat/graphs.py", "NVIDIA/Megatron-LM#", "upstream pull requests: the source of the shim's fact"),
    ("megatron_fastpath/compat/graphs.py", "#5975", "upstream pull request, cited beside Megatron-LM#4433"),
    ("docs/cuda-graphs.md", "NVIDIA/Megatron-LM#4433, then #5975", "upstream pull requests: the source of the fact"),
    ("tests/support/gpu_standins.py", "flash-attention PR #2324", "upstream pull request: the source of the fact"),
    ("tests/support/standin_registry.py", "flash-attention PR #2324", "upstream pull request: the source of the fact"),
    ("tests/test_changelog.py", "Session 1", "the changelog check's own planted heading"),
    ("tests/test_history_words.py", "", "this check's patterns and planted lines"),
]


def text_files():
    for root in ROOTS:
        path = REPO / root
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            if f.suffix in SUFFIXES and "__pycache__" not in f.parts:
                yield f.relative_to(REPO).as_posix(), f


def allowed(rel: str, line: str) -> bool:
    return any(rel == path and piece in line for path, piece, _ in ALLOWED)


def history_hits(rel: str, text: str) -> list[str]:
    """``rel:line: [kind] text`` of every line of ``text`` with a history word."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        kinds = [k for k, pattern in PATTERNS.items() if pattern.search(line)]
        if kinds and not allowed(rel, line):
            hits.append(f"{rel}:{number}: [{', '.join(kinds)}] {line.strip()[:120]}")
    return hits


def test_no_history_words_in_code_tests_and_docs():
    hits = [h for rel, path in text_files()
            for h in history_hits(rel, path.read_text(encoding="utf-8", errors="replace"))]
    assert not hits, "history words (say what is; CHANGELOG.md holds history):\n" + "\n".join(hits)


def test_each_allowed_piece_is_still_there():
    """An allow-list entry outliving its line would hide the next hit in that file."""
    files = dict(text_files())
    stale = [(path, piece) for path, piece, _ in ALLOWED
             if path not in files or piece not in files[path].read_text(encoding="utf-8")]
    assert stale == []


def test_the_check_sees_each_planted_form():
    planted = "\n".join([
        '"""Context parallelism (issue 23): the main job.',
        "Issue 9 point 5: the audit passes.",
        "fixed in #40, see the tracker",
        "    # G17: the mask is the tracker's",
        "## Session 12",
        "It used to be seeded only with graphs on.",
        "the cache previously matched params by identity",
        "On the previous code it failed.",
        "a buffer is used to compute the mask",      # a purpose: fine
        "fused torch AdamW",                         # not "used to"
        "NVIDIA/Megatron-LM#4433 removed it",        # an upstream reference: fine
        "the G-axis, step 40, commit abc1234",
    ])
    assert [h.split(": [")[0] for h in history_hits("x.py", planted)] == [
        "x.py:1", "x.py:2", "x.py:3", "x.py:4", "x.py:5", "x.py:6", "x.py:7", "x.py:8"]
    assert history_hits("x.py", "from issue 23 of the journal")[0].endswith("from issue 23 of the journal")
