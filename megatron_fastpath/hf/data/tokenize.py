"""Records -> tokens: every record of a source validated (:mod:`.records`), rendered with the
chat template (bounded by :mod:`megatron_fastpath.hf.template_guard`) and tokenized into flat
buffers; bad records are collected with their place and reason, never raised one by one."""

from __future__ import annotations

import array
import collections
import json
import sys
from typing import Optional

import numpy as np

from megatron_fastpath.hf.data.arrays import Column, Ragged, TokenizedData, _WheresBuilder
from megatron_fastpath.hf.data.records import (
    _text_chars,
    _too_long,
    _validate,
    line_byte_limit,
    map_columns,
    record_format,
    record_char_limit,
)
from megatron_fastpath.hf.data.sources import _LongLine, _source_records, resolve_source

__all__ = ["tokenize_jsonl"]


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc=desc, unit="rec", file=sys.stderr, disable=None, mininterval=1.0,
                leave=False)



def tokenize_jsonl(path: str, tokenizer, fmt: str = "auto", max_tokens: Optional[int] = None,
                   columns: Optional[dict] = None) -> TokenizedData:
    """Tokenize every record of ``path`` (a JSONL / JSON / Parquet / Arrow file, a directory of
    shards or a save_to_disk directory; no caching here); ``fmt``: data.format; ``max_tokens``:
    data.max_tokens, for the size checks before parsing and tokenizing (None: none); ``columns``:
    data.columns, the keys renamed before each record's format is detected."""
    source = resolve_source(path)
    from megatron_fastpath.hf.template_guard import BoundedRenderer

    lines = None if max_tokens is None else line_byte_limit(max_tokens)
    with BoundedRenderer(tokenizer, source.path) as renderer:  # templates bounded in time and memory
        return _tokenize_records(_source_records(source, lines), tokenizer, renderer, fmt, max_tokens,
                                 columns)


def _tokenize_lines(lines: list, tokenizer, renderer, fmt: str = "auto",
                    max_tokens: Optional[int] = None) -> TokenizedData:
    """``lines``: one JSONL file's raw lines (bytes; str accepted)."""
    return _tokenize_records(((k, f"line {k}", raw) for k, raw in enumerate(lines, start=1)),
                             tokenizer, renderer, fmt, max_tokens)


def _tokenize_records(records, tokenizer, renderer, fmt: str = "auto",
                      max_tokens: Optional[int] = None, columns: Optional[dict] = None) -> TokenizedData:
    """``records``: (number, where, raw) with raw a JSONL line (bytes or str: decoded and parsed
    on its own, so a line of invalid UTF-8 is one bad record, not the file's end), a
    :class:`_LongLine` or a parsed record (a dict from datasets). Bad records are collected as
    (where, reason code, text); with ``max_tokens`` (data.max_tokens), a line or a record's
    text too large to fit it is one ("too_long") before it is parsed or tokenized."""
    from megatron_fastpath.hf.tokenizer import TokenizerError

    # token ids and masks appended to flat buffers (4 + 1 bytes a token), one length, number
    # and where per sample: no Python object per record survives its tokenization
    ids, masks, lengths, nums = array.array("i"), array.array("B"), array.array("q"), array.array("q")
    wheres, malformed = _WheresBuilder(), []
    unknown_keys, formats = collections.Counter(), collections.Counter()
    chat_seen = False
    family = None  # "text" or "conversational": the file's, from its first good record
    bar = _progress(None, "tokenizing")
    for num, where, raw in records:
        if bar is not None:
            bar.update(1)
        if isinstance(raw, _LongLine):
            malformed.append((where, "too_long", _too_long(max_tokens, line_bytes=int(raw))))
            continue
        if isinstance(raw, (bytes, str)):
            if max_tokens is not None and len(raw) > line_byte_limit(max_tokens):
                malformed.append((where, "too_long", _too_long(max_tokens, line_bytes=len(raw))))
                continue
            try:
                line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            except UnicodeDecodeError as exc:
                malformed.append((where, "invalid_utf8", f"invalid UTF-8 at byte {exc.start} of the line"))
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                malformed.append((where, "malformed_json", f"invalid JSON ({exc.msg})"))
                continue
            except RecursionError:  # [[[[... deeper than the parser recurses
                malformed.append((where, "malformed_json", "invalid JSON (nested deeper than "
                                  f"{sys.getrecursionlimit()} levels)"))
                continue
        else:
            rec = raw
        rec = map_columns(rec, columns)
        kind, payload, why = _validate(rec, fmt, family)
        if kind is None:
            malformed.append((where, *why))
            if why[0] == "unknown_format":
                unknown_keys[tuple(str(k) for k in rec)] += 1
            continue
        chars = _text_chars(kind, payload)
        if max_tokens is not None and chars > record_char_limit(max_tokens):
            malformed.append((where, "too_long", _too_long(max_tokens, chars=chars)))
            continue
        if kind == "chat":
            if not chat_seen:
                tokenizer.require_template()
                chat_seen = True
            try:  # one sample, or one per assistant turn (templates rewriting earlier turns)
                samples = renderer.render_samples(payload, num)
            except TokenizerError:
                raise
            except ValueError as exc:  # a template's raise_exception, bad roles, ...
                malformed.append((where, "template_error", f"chat template failed: {exc}"))
                continue
            except RecursionError:  # extra message fields nested too deeply to hand over
                malformed.append((where, "bad_fields", "a message field nested too deeply"))
                continue
            encoded = [tokenizer.tokens_and_mask(text, spans) for text, spans in samples]
        elif kind == "pc":
            encoded = [tokenizer.encode_prompt_completion(*payload)]
        else:  # text: continued pretraining, every token in the loss
            encoded = [tokenizer.encode_prompt_completion("", payload)]
        trained = False
        for i, m in encoded:
            if not any(m[1:]):  # position j predicts token j+1: a loss on token 0 alone trains nothing
                malformed.append((where, "no_loss_token", "no loss token (the template put nothing "
                                  "of the assistant reply inside its generation span)"))
                continue
            family = family or ("text" if kind == "text" else "conversational")
            trained = True
            ids.extend(i)
            masks.extend(m)
            lengths.append(len(i))
            nums.append(num)
            wheres.append(where)
        if trained:
            formats[record_format(rec, fmt)] += 1
    if bar is not None:
        bar.close()
    return _tokenized(_as_array(ids, np.int32), _as_array(masks, np.uint8),
                      _as_array(lengths, np.int64), _as_array(nums, np.int64), malformed, wheres.build(),
                      unknown_keys.most_common(), formats.most_common())


def _as_array(buf: array.array, dtype) -> np.ndarray:
    """An ``array.array`` buffer as a numpy array of ``dtype`` (shares the buffer when the item
    sizes agree)."""
    if not len(buf):
        return np.zeros(0, dtype)
    out = np.frombuffer(buf, dtype=np.dtype(buf.typecode))
    return out if out.dtype == np.dtype(dtype) else out.astype(dtype)


def _tokenized(ids, masks, lengths, lines, malformed, wheres, unknown_keys=(), formats=()) -> TokenizedData:
    ids = Ragged.from_lengths(ids, lengths)
    return TokenizedData(ids, Ragged(masks, ids.starts, ids.ends), Column(lines), malformed, wheres,
                         tuple(unknown_keys), tuple(formats))
