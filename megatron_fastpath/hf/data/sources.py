"""What ``data.path`` names and its records, read lazily: a JSONL file line by line (a line
too long for the line limit read past in chunks, never held whole), or a JSON array, Parquet,
Arrow, ``save_to_disk`` directory or directory of shards row by row through the ``datasets``
library (memory-mapped Arrow, imported only then). :mod:`.records` checks
the records and :mod:`.tokenize` tokenizes them.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

from megatron_fastpath.hf.hub import hub_cache, hub_cache_snapshot, looks_like_hub_id

__all__ = ["DataError", "DataSource", "resolve_source", "JSONL_EXTS", "DATASETS_EXTS", "SAVE_TO_DISK_FILES"]


class DataError(ValueError):
    """The JSONL data cannot be used as configured (file, line and reason in the message)."""


# File types read through the ``datasets`` library (memory-mapped Arrow), by extension; JSONL
# (and any other file name) is read line by line here, so one bad line is one bad record.
JSONL_EXTS = (".jsonl", ".ndjson")
DATASETS_EXTS = {".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
SAVE_TO_DISK_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclasses.dataclass(frozen=True)
class DataSource:
    """What ``data.path`` names: ``kind`` jsonl | json | parquet | arrow | save_to_disk, and the
    files read in order (a directory of shards: all its files of one type, sorted by name; a
    ``save_to_disk`` directory: the directory itself). ``digest_files``: every file whose bytes
    the token cache key covers."""

    path: str
    kind: str
    files: tuple
    digest_files: tuple


def _kind_of_file(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext in DATASETS_EXTS:
        if ext == ".json":  # a JSON array, or JSON lines under a .json name
            with open(path, "rb") as f:
                head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
            return "json" if head.startswith(b"[") else "jsonl"
        return DATASETS_EXTS[ext]
    return "jsonl"


_TRAIN_SPLIT = re.compile(r"^train(?:$|[-._0-9])")  # the Hub's split naming: train.jsonl, train-00000-of-00002.parquet, train/


def _hub_dataset(repo_id: str) -> DataSource:
    """A Hugging Face Hub dataset id: its snapshot in the local hub cache, read as the Hub
    names splits -- the data files whose path inside the snapshot has a component named
    ``train`` (``train.jsonl``, ``train-00000-of-00001.parquet``, ``train/...``), else every data
    file; one file type. DataError with the download command when the cache does not hold it."""
    snapshot = hub_cache_snapshot(repo_id, "dataset")
    if snapshot is None:
        raise DataError(
            f"data.path {repo_id!r}: no such file or directory, and as a Hugging Face Hub dataset id "
            f"it is not in the local hub cache ({hub_cache()}): the job reads a local copy only; "
            f"download it first (huggingface-cli download {repo_id} --repo-type dataset) or set "
            "data.path=<a local file or directory>")
    files = sorted(os.path.join(d, n) for d, dirs, names in os.walk(snapshot, followlinks=True)
                   for n in names if not n.startswith(".")
                   and os.path.splitext(n)[1].lower() in JSONL_EXTS + tuple(DATASETS_EXTS))
    train = [f for f in files if any(_TRAIN_SPLIT.match(part)
                                     for part in os.path.relpath(f, snapshot).split(os.sep))]
    chosen = train or files
    if not chosen:
        raise DataError(f"data.path {repo_id!r}: its hub cache snapshot ({snapshot}) holds no data "
                        "files (.jsonl, .ndjson, .json, .parquet, .arrow)")
    kinds = {_kind_of_file(f) for f in chosen}
    if len(kinds) > 1:
        raise DataError(f"data.path {repo_id!r}: its training files must be of one type; found "
                        f"{', '.join(sorted(kinds))} ({', '.join(os.path.relpath(f, snapshot) for f in chosen)})")
    return DataSource(snapshot, kinds.pop(), tuple(chosen), tuple(chosen))


def resolve_source(path: str) -> DataSource:
    """The data source ``path`` names (a file, a directory of shards, a ``save_to_disk``
    directory, or a Hugging Face Hub dataset id in the local hub cache), detected from the path
    alone; DataError naming what is wrong otherwise."""
    if looks_like_hub_id(path):
        return _hub_dataset(path)
    path = os.path.normpath(path)
    if os.path.isfile(path):
        return DataSource(path, _kind_of_file(path), (path,), (path,))
    if not os.path.isdir(path):
        raise DataError(f"data.path {path!r}: no such file or directory")
    names = sorted(n for n in os.listdir(path) if not n.startswith("."))
    if any(n in names for n in SAVE_TO_DISK_FILES):  # written by datasets' save_to_disk
        every = sorted(os.path.join(d, n) for d, _, ns in os.walk(path) for n in ns)
        return DataSource(path, "save_to_disk", (path,), tuple(every))
    shards = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))
              and not n.endswith(".tokens.npz")
              and os.path.splitext(n)[1].lower() in JSONL_EXTS + tuple(DATASETS_EXTS)]
    if not shards:
        raise DataError(f"data.path {path!r}: a directory with no data files (.jsonl, .ndjson, "
                        ".json, .parquet, .arrow) and no datasets save_to_disk files "
                        f"({', '.join(SAVE_TO_DISK_FILES)})")
    kinds = {_kind_of_file(f) for f in shards}
    if len(kinds) > 1:
        raise DataError(f"data.path {path!r}: a directory of shards must hold one file type; "
                        f"found {', '.join(sorted(kinds))} ({', '.join(os.path.basename(f) for f in shards)})")
    return DataSource(path, kinds.pop(), tuple(shards), tuple(shards))


def _require_datasets(source: DataSource):
    """The ``datasets`` module, imported only for Parquet / Arrow / JSON-array / save_to_disk."""
    try:
        import datasets
    except Exception as exc:  # ImportError, or a broken install
        what = {"json": "a JSON array file", "parquet": "Parquet", "arrow": "Arrow",
                "save_to_disk": "a dataset saved with datasets' save_to_disk"}[source.kind]
        raise DataError(
            f"data.path {source.path!r} is {what}, which is read through the 'datasets' library "
            f"(memory-mapped Arrow; this package has no parser of its own for it), and 'datasets' "
            f"could not be imported ({type(exc).__name__}: {exc}). Install it with `pip install "
            "datasets` (or `pip install megatron_fastpath[hf]`), or convert the data to JSONL, "
            "which needs nothing extra") from exc
    datasets.disable_progress_bars()  # the job logs what it read; no bars from datasets' loaders
    return datasets


def _strip_none(x):
    """A row as datasets gives it, without the null fields Arrow's shared schema adds (a
    prompt-completion row of a file that also holds chat rows has messages=None): the record
    as it was written, so format detection sees the keys it had."""
    if isinstance(x, dict):
        return {k: _strip_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_strip_none(v) for v in x]
    return x


def _datasets_tables(source: DataSource):
    """[(name shown in reports, datasets.Dataset)] of a non-JSONL source, one per shard."""
    datasets = _require_datasets(source)
    if source.kind == "save_to_disk":
        ds = datasets.load_from_disk(source.path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" in ds:
                ds = ds["train"]
            elif len(ds) == 1:
                ds = next(iter(ds.values()))
            else:
                raise DataError(f"data.path {source.path!r}: a saved DatasetDict with the splits "
                                f"{sorted(ds)} and no 'train'; save the split to train on")
        return [(source.path, ds)]
    out = []
    for f in source.files:
        if source.kind == "arrow":
            ds = datasets.Dataset.from_file(f)  # memory-mapped, no copy
        else:
            ds = datasets.load_dataset(source.kind, data_files=[f], split="train")
        out.append((f, ds))
    return out


class _LongLine(int):
    """A JSONL line longer than the line limit, in place of its bytes (its length; the line is
    skipped, never held whole)."""


def _lines(fh, max_bytes: Optional[int]):
    """The lines of ``fh`` (binary) with their newlines; a line of more than ``max_bytes``
    bytes is read past in chunks and given as :class:`_LongLine`."""
    if max_bytes is None:
        yield from fh
        return
    while raw := fh.readline(max_bytes + 1):
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            n = len(raw)
            while (chunk := fh.readline(1 << 20)):
                n += len(chunk)
                if chunk.endswith(b"\n"):
                    break
            if not chunk.endswith(b"\n"):  # the file ends inside the long line
                yield _LongLine(n)
                return
            yield _LongLine(n - 1)  # its bytes without the newline
            continue
        yield raw


def _source_records(source: DataSource, max_line_bytes: Optional[int] = None):
    """(record number, where, raw) for every record of the source, in order; raw is the line's
    bytes (JSONL: decoded and parsed per line), a :class:`_LongLine` (a JSONL line of more than
    ``max_line_bytes``) or the row's dict (read through datasets)."""
    n = 0
    single = len(source.files) == 1
    if source.kind == "jsonl":
        for f in source.files:
            with open(f, "rb") as fh:  # line by line: memory independent of the file's size
                lineno, raw = 0, b"\n"
                for raw in _lines(fh, max_line_bytes):
                    lineno += 1
                    n += 1
                    yield ((lineno if single else n), (f"line {lineno}" if single else f"{f} line {lineno}"),
                           raw if isinstance(raw, _LongLine) else raw[:-1] if raw.endswith(b"\n") else raw)
                if isinstance(raw, bytes) and raw.endswith(b"\n"):  # the empty line after the last newline (numbered too)
                    lineno += 1
                    n += 1
                    yield (lineno if single else n), (f"line {lineno}" if single else f"{f} line {lineno}"), b""
        return
    for name, ds in _datasets_tables(source):
        for row, rec in enumerate(ds):
            n += 1
            yield n, f"{name} row {row}", _strip_none(rec)
