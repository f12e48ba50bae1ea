"""The ``data`` group of ``data=jsonl``: :class:`JsonlDataConfig`, checked when it is built."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_fastpath.hf.data.records import COLUMNS, FORMATS
from megatron_fastpath.hf.data.sources import DataError

__all__ = ["JsonlDataConfig"]


@dataclasses.dataclass(frozen=True)
class JsonlDataConfig:
    """The ``data`` group for ``data=jsonl``.

    path: the data file or directory (:func:`resolve_source`). tokenizer_path: directory with tokenizer.json (default model.path).
    max_tokens / max_seqs: packed bin capacity (the cache's static sizes).
    eval_fraction: held-out share of the records of ``path`` (at least one record when > 0; None:
        0.1, or 0 with ``eval_path``).
    eval_path: a separate held-out file or directory (the formats of ``path``): the held-out
        split comes from it and all of ``path`` trains; refused with ``eval_fraction`` set.
    eval_every: held-out loss every this many steps (0: only before and after training).
    eval_samples: at each evaluation, the model's greedy completion of the first this many
        held-out prompts, printed and written to the metrics directory (0: none).
    eval_max_new_tokens: the most tokens each completion runs to (it stops earlier at EOS).
    bad_records: error | skip (bad records and records longer than max_tokens; counted by reason).
    overlong: None (records longer than max_tokens follow bad_records) | error | skip | truncate
        (cut from the right to max_tokens: the prompt whole, the last assistant reply or the
        completion cut; counted as ``truncated``).
    cache: cache tokenized records (in ``cache_dir``).
    cache_dir: the token caches' directory (None: $XDG_CACHE_HOME/megatron_fastpath/tokens, or
        ~/.cache/megatron_fastpath/tokens).
    format: auto (detected per record from its keys, as TRL does) | messages |
        prompt_completion | alpaca | sharegpt | text (continued pretraining: loss on every token).
    columns: {key data=jsonl reads (:data:`COLUMNS`): the records' own key}, applied to every
        record before its format is detected (``data.columns.prompt=question``); unset keys
        (null) are not mapped.
    """

    path: str = ""
    tokenizer_path: Optional[str] = None
    max_tokens: int = 512
    max_seqs: int = 32
    eval_fraction: Optional[float] = None
    eval_path: Optional[str] = None
    eval_every: int = 10
    eval_samples: int = 0
    eval_max_new_tokens: int = 32
    bad_records: str = "error"
    overlong: Optional[str] = None
    cache: bool = True
    cache_dir: Optional[str] = None
    seed: int = 1234
    format: str = "auto"
    columns: Optional[dict] = None

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
