"""The ``data`` group of ``data=jsonl``: :class:`JsonlDataConfig`, checked when it is built."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_fastpath.data import PAD_MULTIPLE, PAD_MULTIPLE_HELP
from megatron_fastpath.hf.data.records import COLUMNS, FORMATS
from megatron_fastpath.hf.data.sources import DataError
from megatron_fastpath.settings import POSITIVE, setting

__all__ = ["JsonlDataConfig"]


@dataclasses.dataclass(frozen=True)
class JsonlDataConfig:
    """The ``data`` group for ``data=jsonl``: records read from ``path``
    (:func:`resolve_source`), tokenized, split into train and held-out records and packed."""

    path: str = setting("", "the data: a JSONL file, a JSON array (.json), Parquet, Arrow, a datasets "
                        "save_to_disk directory, or a directory of shards of one type (name order)")
    tokenizer_path: Optional[str] = setting(None, "directory with tokenizer.json; null: model.path")
    max_tokens: int = setting(512, "packed microbatch capacity in tokens (longer records are bad records)")
    max_seqs: int = setting(32, "most sequences in one packed microbatch (the cache's static size)")
    pad_multiple: int = setting(PAD_MULTIPLE, PAD_MULTIPLE_HELP, POSITIVE)
    eval_fraction: Optional[float] = setting(
        None, "held-out share of path's records (at least one record when > 0); null: 0.1, or 0 "
        "with eval_path")
    eval_path: Optional[str] = setting(
        None, "a separate held-out file or directory (path's formats); all of path trains; not "
        "with eval_fraction")
    eval_every: int = setting(10, "held-out loss every N steps (0: only before and after training)")
    eval_samples: int = setting(
        0, "greedy completions of the first N held-out prompts at each evaluation, printed and "
        "written to the metrics directory")
    eval_max_new_tokens: int = setting(32, "the longest completion (it stops earlier at EOS / end of turn)")
    bad_records: str = setting(
        "error", "error | skip: bad records (and over-long ones, unless overlong says otherwise); "
        "always reported, counted by reason")
    overlong: Optional[str] = setting(
        None, "records longer than max_tokens: null (as bad_records) | error | skip | truncate "
        "(cut from the right, the prompt kept whole)")
    cache: bool = setting(True, "cache the tokenized records (keyed on the data's bytes, tokenizer, settings)")
    cache_dir: Optional[str] = setting(
        None, "the token caches' directory; null: $XDG_CACHE_HOME/megatron_fastpath/tokens "
        "(~/.cache/megatron_fastpath/tokens)")
    seed: int = setting(1234, "seed of the held-out split and of each epoch's order")
    format: str = setting(
        "auto", "auto (detected per record from its keys) | messages | prompt_completion | alpaca | "
        "sharegpt | text (continued pretraining: loss on every token)")
    columns: Optional[dict] = setting(
        None, f"map the records' own keys onto the columns data=jsonl reads ({', '.join(COLUMNS)}), "
        "before the format is detected (data.columns.prompt=question); null: not mapped")

    def __post_init__(self):
        if not self.path:
            raise DataError("data.path must name the data (data=jsonl data.path=<file.jsonl, .json, "
                            ".parquet, .arrow, or a directory>)")
        if self.format not in FORMATS:
            raise DataError(f"data.format must be one of {', '.join(FORMATS)}; got {self.format!r}")
        columns = {k: v for k, v in (self.columns or {}).items() if v is not None}
        unknown = sorted(k for k in columns if k not in COLUMNS)
        if unknown:
            raise DataError(f"data.columns.{unknown[0]}: no such column; data.columns maps a record's "
                            f"keys onto {', '.join(COLUMNS)} (e.g. data.columns.prompt=question)")
        for k, v in columns.items():
            if not isinstance(v, str) or not v:
                raise DataError(f"data.columns.{k}={v!r}: must name a key of the records (a string)")
        if len(set(columns.values())) < len(columns):
            raise DataError(f"data.columns maps one key onto several columns ({columns}); map each "
                            "key of the records once")
        object.__setattr__(self, "columns", dict(sorted(columns.items())))
        if self.bad_records not in ("error", "skip"):
            raise DataError(f"data.bad_records must be 'error' or 'skip'; got {self.bad_records!r}")
        if self.eval_path is not None and self.eval_fraction is not None:
            raise DataError(f"data.eval_path={self.eval_path!r} and data.eval_fraction={self.eval_fraction} "
                            "both set: the held-out records come either from a separate file or from "
                            "a share of data.path; drop one of them")
        if self.eval_path is not None and not self.eval_path:
            raise DataError("data.eval_path='' names no data: set it to the held-out file or null")
        if self.eval_fraction is None:
            object.__setattr__(self, "eval_fraction", 0.0 if self.eval_path else 0.1)
        if self.overlong not in (None, "error", "skip", "truncate"):
            raise DataError(f"data.overlong must be null (as data.bad_records), 'error', 'skip' or "
                            f"'truncate'; got {self.overlong!r}")
        if self.eval_every < 0:
            raise DataError(f"data.eval_every must be >= 0; got {self.eval_every}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise DataError(f"data.eval_fraction must be in [0, 1); got {self.eval_fraction}")
        if self.eval_samples < 0:
            raise DataError(f"data.eval_samples must be >= 0 (0: no samples); got {self.eval_samples}")
        if self.eval_max_new_tokens < 1:
            raise DataError(f"data.eval_max_new_tokens must be >= 1; got {self.eval_max_new_tokens}")
        if self.eval_samples and not self.evaluates:
            raise DataError(
                f"data.eval_samples={self.eval_samples} completes held-out prompts, but "
                "data.eval_fraction=0 holds out no records: set data.eval_fraction > 0 (e.g. 0.1) "
                "or data.eval_path, or data.eval_samples=0")

    @property
    def evaluates(self) -> bool:
        """Whether the job has held-out records (a share of data.path or data.eval_path)."""
        return bool(self.eval_path) or self.eval_fraction > 0
