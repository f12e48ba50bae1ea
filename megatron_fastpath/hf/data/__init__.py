"""``data=jsonl``: chat / prompt-completion records -> tokenized records -> packed microbatches.

``data.path`` is a JSONL file, a JSON array, Parquet, Arrow, a ``datasets`` ``save_to_disk``
directory or a directory of shards of one type (:func:`resolve_source`). Each JSONL line / row
is one record, either ``{"messages": [{"role": ..., "content": ...}, ...]}`` (rendered with the
checkpoint's chat template, loss on assistant tokens) or ``{"prompt": ..., "completion": ...}``
(loss on completion tokens + EOS), or another format (``data.format``). Bad records and records
longer than ``max_tokens`` are reported with their line or row and counted by reason;
``bad_records=error`` stops before training, ``skip`` drops them (reported, never silently).

One module per step:

* :mod:`.sources`: what ``data.path`` names and its records, read lazily (JSONL line by line,
  the ``datasets`` types row by row from memory-mapped Arrow, imported only then);
* :mod:`.records`: one record's format (detected from its keys or forced), its checks and normal
  form, and the size limits that refuse a record too long for ``max_tokens`` before it is parsed
  (a line) or tokenized (its text, at :data:`CHARS_PER_TOKEN` characters a token);
* :mod:`.tokenize`: records -> token ids and assistant masks in flat arrays (:mod:`.arrays`:
  :class:`Ragged`, :class:`Column`, :class:`Wheres`, :class:`TokenizedData`);
* :mod:`.cache`: the tokens cached in ``data.cache_dir`` (default
  ``$XDG_CACHE_HOME/megatron_fastpath/tokens``), keyed on the data's path and every shard's
  bytes, the settings, the tokenizer and template files;
* :mod:`.splits`: the report of bad records, the deterministic ``eval_fraction`` held out by
  record, the :class:`JsonlDataset` of each split (packed first-fit decreasing into
  ``max_tokens`` by :func:`megatron_fastpath.data.pack_microbatches`);
* :mod:`.prompts`: the held-out prompts of ``data.eval_samples``;
* :mod:`.config`: the ``data`` group, :class:`JsonlDataConfig`.

Memory is bounded by the tokens, not by Python objects per record: each record's ids / mask are
appended to flat buffers, the cache stores those arrays as they are, the split is computed on
the arrays, packing reads the lengths only and each padded microbatch is made when it is read
(:class:`megatron_fastpath.data.PackedBins`).
"""

from megatron_fastpath.hf.data.arrays import Column, Ragged, TokenizedData, Wheres
from megatron_fastpath.hf.data.cache import CACHE_VERSION, load_tokenized
from megatron_fastpath.hf.data.config import JsonlDataConfig
from megatron_fastpath.hf.data.prompts import build_eval_prompts, eval_prompts, stop_token_ids
from megatron_fastpath.hf.data.records import (
    CHARS_PER_TOKEN,
    FORMATS,
    line_byte_limit,
    record_char_limit,
)
from megatron_fastpath.hf.data.sources import DataError, DataSource, resolve_source
from megatron_fastpath.hf.data.splits import JsonlDataset, bad_record_counts, load_jsonl_splits
from megatron_fastpath.hf.data.tokenize import tokenize_jsonl

__all__ = ["JsonlDataConfig", "JsonlDataset", "TokenizedData", "tokenize_jsonl", "load_jsonl_splits",
           "load_tokenized", "DataError", "DataSource", "resolve_source", "bad_record_counts",
           "eval_prompts", "stop_token_ids", "build_eval_prompts", "Ragged", "Column", "Wheres",
           "FORMATS", "CHARS_PER_TOKEN", "CACHE_VERSION", "record_char_limit", "line_byte_limit"]
