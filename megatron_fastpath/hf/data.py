"""``data=jsonl``: chat / prompt-completion records -> tokenized records -> packed microbatches.

``data.path`` is a JSONL file, a JSON array, Parquet, Arrow, a ``datasets`` ``save_to_disk``
directory or a directory of shards of one type (:func:`resolve_source`, read by
:mod:`megatron_fastpath.hf.data_sources`; all but JSONL read
memory-mapped through the ``datasets`` library, imported only then). Each JSONL line / row is
one record, either ``{"messages": [{"role": ..., "content": ...}, ...]}`` (rendered
with the checkpoint's chat template, loss on assistant tokens) or ``{"prompt": ...,
"completion": ...}`` (loss on completion tokens + EOS), or another format (``format``). Bad
records and records longer than ``max_tokens`` are reported with their line or row and counted
by reason (a record too large to fit ``max_tokens`` at :data:`CHARS_PER_TOKEN` characters a token
is refused before it is tokenized, a JSONL line too large for that before it is parsed); ``bad_records=error`` stops before training, ``skip`` drops them (reported, never
silently). Tokenized records are cached beside the data (keyed on every shard's bytes, the
tokenizer and template bytes). A deterministic
``eval_fraction`` of the records is held out; both splits are packed first-fit decreasing into
``max_tokens`` with :func:`megatron_fastpath.data.pack_microbatches`.

Memory is bounded by the tokens, not by Python objects per record: JSONL is read line by line
(the ``datasets`` types row by row from memory-mapped Arrow), each record's ids / mask are
appended to flat buffers (int32 ids, uint8 masks, one length, number and where per sample:
:class:`Ragged`, :class:`Column`, :class:`Wheres`), the cache stores those arrays as they are,
the split is computed on the arrays, packing reads the lengths only and each padded microbatch
is made when it is read (:class:`megatron_fastpath.data.PackedBins`).
"""

from __future__ import annotations

import array
import collections.abc
import dataclasses
import hashlib
import json
import os
import sys
from typing import Optional

import numpy as np

# DataError, DataSource and resolve_source are this module's API too
from megatron_fastpath.hf.data_sources import (  # noqa: F401
    DataError,
    DataSource,
    _LongLine,
    _source_records,
    resolve_source,
)

__all__ = ["JsonlDataConfig", "JsonlDataset", "TokenizedData", "tokenize_jsonl", "load_jsonl_splits",
           "DataError", "DataSource", "resolve_source", "bad_record_counts", "eval_prompts",
           "stop_token_ids", "build_eval_prompts"]

CACHE_VERSION = 6  # bump when tokenization, masking or the cache layout changes

# A record is refused as too long before it is parsed or tokenized when it cannot fit
# data.max_tokens: its text (the strings of its messages, prompt / completion or text) may hold
# at most CHARS_PER_TOKEN characters per token of data.max_tokens (real tokenizers average 3-5;
# 32 leaves room for long tokens such as runs of spaces), and a JSONL line at most
# LINE_BYTES_PER_CHAR bytes per such character (a \uXXXX surrogate pair is 12 bytes for one
# character) plus LINE_BYTES_SLACK for the record's keys. So one huge record costs a bounded
# read, not a tokenization of all of it.
CHARS_PER_TOKEN = 32
LINE_BYTES_PER_CHAR = 12
LINE_BYTES_SLACK = 1 << 20


def record_char_limit(max_tokens: int) -> int:
    """The most characters a record's text may hold for ``data.max_tokens`` (checked before
    tokenizing)."""
    return max_tokens * CHARS_PER_TOKEN


def line_byte_limit(max_tokens: int) -> int:
    """The most bytes a JSONL line may hold for ``data.max_tokens`` (checked before parsing)."""
    return record_char_limit(max_tokens) * LINE_BYTES_PER_CHAR + LINE_BYTES_SLACK


@dataclasses.dataclass(frozen=True)
class JsonlDataConfig:
    """The ``data`` group for ``data=jsonl``.

    path: the data file or directory (:func:`resolve_source`). tokenizer_path: directory with tokenizer.json (default model.path).
    max_tokens / max_seqs: packed bin capacity (the cache's static sizes).
    eval_fraction: held-out share of records (at least one record when > 0).
    eval_every: held-out loss every this many steps (0: only before and after training).
    eval_samples: at each evaluation, the model's greedy completion of the first this many
        held-out prompts, printed and written to the metrics directory (0: none).
    eval_max_new_tokens: the most tokens each completion runs to (it stops earlier at EOS).
    bad_records: error | skip (bad records and records longer than max_tokens; counted by reason).
    cache: cache tokenized records beside the data file.
    format: auto (detected per record from its keys, as TRL does) | messages |
        prompt_completion | alpaca | sharegpt | text (continued pretraining: loss on every token).
    """

    path: str = ""
    tokenizer_path: Optional[str] = None
    max_tokens: int = 512
    max_seqs: int = 32
    eval_fraction: float = 0.1
    eval_every: int = 10
    eval_samples: int = 0
    eval_max_new_tokens: int = 32
    bad_records: str = "error"
    cache: bool = True
    seed: int = 1234
    format: str = "auto"

    def __post_init__(self):
        if not self.path:
            raise DataError("data.path must name the data (data=jsonl data.path=<file.jsonl, .json, "
                            ".parquet, .arrow, or a directory>)")
        if self.format not in FORMATS:
            raise DataError(f"data.format must be one of {', '.join(FORMATS)}; got {self.format!r}")
        if self.bad_records not in ("error", "skip"):
            raise DataError(f"data.bad_records must be 'error' or 'skip'; got {self.bad_records!r}")
        if self.eval_every < 0:
            raise DataError(f"data.eval_every must be >= 0; got {self.eval_every}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise DataError(f"data.eval_fraction must be in [0, 1); got {self.eval_fraction}")
        if self.eval_samples < 0:
            raise DataError(f"data.eval_samples must be >= 0 (0: no samples); got {self.eval_samples}")
        if self.eval_max_new_tokens < 1:
            raise DataError(f"data.eval_max_new_tokens must be >= 1; got {self.eval_max_new_tokens}")
        if self.eval_samples and self.eval_fraction == 0:
            raise DataError(
                f"data.eval_samples={self.eval_samples} completes held-out prompts, but "
                "data.eval_fraction=0 holds out no records: set data.eval_fraction > 0 (e.g. 0.1) "
                "or data.eval_samples=0")


class _View(collections.abc.Sequence):
    """A read-only list-like view (``==`` / ``+`` with lists, slices as lists) of per-record
    values held in flat arrays, so that a million records cost a few arrays, not a million
    Python objects."""

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self._item(j) for j in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(k)
        return self._item(k)

    def __eq__(self, other):
        return isinstance(other, (list, tuple, _View)) and list(self) == list(other)

    __hash__ = None

    def __add__(self, other):
        return list(self) + list(other)

    def __radd__(self, other):
        return list(other) + list(self)

    def __repr__(self):
        return f"{type(self).__name__}({len(self)} items)"


class Ragged(_View):
    """Records of variable length in one flat array: record ``k`` is
    ``flat[starts[k]:ends[k]]`` (a view, no copy). A subset (:meth:`take`) shares the flat
    array: only its starts and ends are new."""

    def __init__(self, flat: np.ndarray, starts: np.ndarray, ends: np.ndarray):
        self.flat, self.starts, self.ends = flat, starts, ends

    @classmethod
    def from_lengths(cls, flat: np.ndarray, lengths) -> "Ragged":
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(flat, offsets[:-1], offsets[1:])

    @classmethod
    def from_list(cls, items, dtype) -> "Ragged":
        items = [np.asarray(x, dtype=dtype) for x in items]
        flat = np.concatenate(items) if items else np.zeros(0, dtype)
        return cls.from_lengths(flat, [len(x) for x in items])

    @property
    def lengths(self) -> np.ndarray:
        return self.ends - self.starts

    def __len__(self):
        return len(self.starts)

    def _item(self, k):
        return self.flat[self.starts[k]: self.ends[k]]

    def take(self, idx) -> "Ragged":
        """The records ``idx`` (in that order), sharing this flat array."""
        return Ragged(self.flat, self.starts[idx], self.ends[idx])

    def reduce(self, ufunc, initial):
        """``ufunc.reduce`` over the tokens of these records (non-overlapping; a token mask of
        one byte a token, not a copy of the tokens, when they are not the whole flat array)."""
        if not len(self.starts):
            return initial
        if self.starts[0] == 0 and self.ends[-1] == len(self.flat) and int(self.lengths.sum()) == len(self.flat):
            return ufunc.reduce(self.flat, initial=initial)
        edges = np.zeros(len(self.flat) + 1, dtype=np.int8)
        np.add.at(edges, self.starts, 1)
        np.add.at(edges, self.ends, -1)
        inside = np.cumsum(edges[:-1], dtype=np.int8).view(bool)
        return ufunc.reduce(self.flat, where=inside, initial=initial)


class Column(_View):
    """Per-record integers in one array (items as Python ints)."""

    def __init__(self, values: np.ndarray):
        self.values = values

    def __len__(self):
        return len(self.values)

    def _item(self, k):
        return int(self.values[k])


class Wheres(_View):
    """Where each record is ("line 7", "<shard> line 7", "<file> row 6"): an interned prefix per
    record and the number after it (-1: the prefix is the whole text)."""

    def __init__(self, prefixes: list, prefix: np.ndarray, num: np.ndarray):
        self.prefixes, self.prefix, self.num = prefixes, prefix, num

    def __len__(self):
        return len(self.num)

    def _item(self, k):
        p, n = self.prefixes[int(self.prefix[k])], int(self.num[k])
        return p if n < 0 else f"{p} {n}"

    def take(self, idx) -> "Wheres":
        return Wheres(self.prefixes, self.prefix[idx], self.num[idx])


class _WheresBuilder:
    def __init__(self):
        self.prefixes, self.ids = [], {}
        self.prefix, self.num = array.array("i"), array.array("q")

    def append(self, where: str) -> None:
        head, _, tail = where.rpartition(" ")
        if head and tail.isdigit() and str(int(tail)) == tail:
            num = int(tail)
        else:
            head, num = where, -1
        k = self.ids.get(head)
        if k is None:
            k = self.ids[head] = len(self.prefixes)
            self.prefixes.append(head)
        self.prefix.append(k)
        self.num.append(num)

    def build(self) -> Wheres:
        return Wheres(self.prefixes, np.frombuffer(self.prefix, dtype=np.int32).copy() if self.prefix
                      else np.zeros(0, np.int32),
                      np.frombuffer(self.num, dtype=np.int64).copy() if self.num else np.zeros(0, np.int64))


@dataclasses.dataclass(frozen=True)
class TokenizedData:
    """All well-formed records of the data: ids / masks per record (token-aligned assistant
    mask), their numbers (the 1-based line of a single JSONL file, else the 1-based record number
    across shards) and where each is ("line 7", "<shard> line 7", "<file> row 6"), and the
    bad records as (where, reason code, reason): codes invalid_utf8, malformed_json,
    not_an_object, unknown_format, mixed_format, bad_fields, unknown_role, no_assistant,
    template_error, no_loss_token, too_long (a line or text too large for data.max_tokens,
    refused before parsing / tokenizing: :func:`record_char_limit`; the other over-long records
    are counted from the lengths). A conversation whose
    chat template renders earlier turns differently from the last one is one sample per
    assistant turn (``ChatTokenizer.render_samples``): its samples share its number and where.

    Held in flat arrays whatever the number of records: ``ids`` / ``masks`` are :class:`Ragged`
    (int32 ids / uint8 masks of all records end to end, and each record's start and end), ``lines`` a
    :class:`Column`, ``wheres`` a :class:`Wheres`; each reads like a list."""

    ids: Ragged
    masks: Ragged
    lines: Column
    malformed: list
    wheres: Wheres

    @property
    def lengths(self) -> np.ndarray:
        return self.ids.lengths

    @property
    def split_for_template(self) -> int:
        """Samples beyond one per record: those of conversations split per assistant turn."""
        return len(self.lines) - len(np.unique(self.lines.values))


# data.format: "auto" detects per record (below); the others force one format for every record.
FORMATS = ("auto", "messages", "prompt_completion", "alpaca", "sharegpt", "text")
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speaker names (from/value), the aliases FastChat / Axolotl / LLaMA-Factory accept
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
                  "bing": "assistant", "model": "assistant", "tool": "tool"}


def _detect(rec) -> Optional[str]:
    """The record's format from its keys, as TRL detects a dataset's: messages,
    conversations (ShareGPT), prompt + completion, instruction + output (Alpaca), text."""
    if "messages" in rec:
        return "messages"
    if "conversations" in rec:
        return "sharegpt"
    if "prompt" in rec and "completion" in rec:
        return "prompt_completion"
    if "instruction" in rec and "output" in rec:
        return "alpaca"
    if "text" in rec:
        return "text"
    return None


def _checked_messages(msgs, where: str):
    if not isinstance(msgs, list) or not msgs:
        return None, ("bad_fields", f"'{where}' must be a non-empty list of messages")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None, ("bad_fields", f"{where}[{j}] needs string 'role' and 'content'")
        if m["role"] not in ROLES:
            return None, ("unknown_role", f"{where}[{j}] has the unknown role {m['role']!r} (roles: "
                          f"{', '.join(ROLES)}); a misspelled role would train as context")
    return msgs, None


def _normalise(rec, fmt: str):
    """(kind, payload, None) of a well-formed record of format ``fmt``, else (None, None, reason).
    kind "chat": payload = the messages (loss on assistant turns); "pc": (prompt, completion)
    strings (loss on the completion + EOS); "text": the text (loss on every token)."""
    if fmt == "messages":
        msgs, why = _checked_messages(rec.get("messages"), "messages")
    elif fmt == "sharegpt":
        conv = rec.get("conversations")
        if not isinstance(conv, list) or not conv:
            return None, None, ("bad_fields", "'conversations' must be a non-empty list")
        msgs = []
        for j, turn in enumerate(conv):
            if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
                return None, None, ("bad_fields", f"conversations[{j}] needs string 'from' and 'value'")
            role = SHAREGPT_ROLES.get(turn["from"].lower())
            if role is None:
                return None, None, ("unknown_role", f"conversations[{j}] has the unknown speaker "
                                    f"{turn['from']!r} (known: {', '.join(sorted(SHAREGPT_ROLES))})")
            msgs.append({"role": role, "content": turn["value"]})
        why = None
    elif fmt == "alpaca":
        inst, out = rec.get("instruction"), rec.get("output")
        extra = "" if rec.get("input") is None else rec["input"]  # absent or null: no input
        if not all(isinstance(x, str) for x in (inst, extra, out)):
            return None, None, ("bad_fields", "alpaca records need string 'instruction' and 'output' "
                                "(and 'input' if given)")
        user = inst if not extra else f"{inst}\n\n{extra}"
        msgs, why = [{"role": "user", "content": user}, {"role": "assistant", "content": out}], None
    elif fmt == "prompt_completion":
        prompt, completion = rec.get("prompt"), rec.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            return "pc", (prompt, completion), None
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            return None, None, ("bad_fields", "'prompt' and 'completion' must both be strings or both "
                                "message lists")
        p, why = _checked_messages(prompt, "prompt")
        if why is None:
            c, why = _checked_messages(completion, "completion")
        if why is None and any(m["role"] == "assistant" for m in p):
            why = ("bad_fields", "prompt-completion message lists with assistant turns in the prompt: "
                   "only the completion may be trained; put the conversation in 'messages' instead")
        if why is None and any(m["role"] != "assistant" for m in c):
            why = ("bad_fields", "the completion message list must hold assistant turns only")
        msgs = None if why else p + c
    elif fmt == "text":
        text = rec.get("text")
        if not isinstance(text, str) or not text:
            return None, None, ("bad_fields", "'text' must be a non-empty string")
        return "text", text, None
    else:  # pragma: no cover - FORMATS is checked at parse
        raise ValueError(fmt)
    if why is not None:
        return None, None, why
    if not any(m["role"] == "assistant" for m in msgs):
        return None, None, ("no_assistant", "no assistant message (nothing to learn)")
    return "chat", msgs, None


def _validate(rec, forced: str = "auto", family: Optional[str] = None):
    """(kind, payload, None) or (None, None, reason) for one parsed record (raises nothing).
    ``forced``: data.format; under "auto" the format is detected per record, and ``family``
    ("text" or "conversational", set by the file's first good record) keeps plain-text and
    conversational records from mixing silently."""
    if not isinstance(rec, dict):
        return None, None, ("not_an_object", "not a JSON object")
    fmt = forced if forced != "auto" else _detect(rec)
    if fmt is None:
        return None, None, ("unknown_format", "no 'messages' key (nor 'conversations', string or "
                            "message-list 'prompt' and 'completion', 'instruction' and 'output', or 'text')")
    if forced == "auto" and family is not None and (fmt == "text") != (family == "text"):
        return None, None, ("mixed_format", f"a {fmt} record in a {family} file (the format of its "
                            "first record); set data.format to train one format")
    return _normalise(rec, fmt)


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc=desc, unit="rec", file=sys.stderr, disable=None, mininterval=1.0,
                leave=False)


def _digest(source: DataSource, *settings: str) -> str:
    h = hashlib.sha256(f"v{CACHE_VERSION}".encode())
    for p in source.digest_files:  # every shard's name (its order) and bytes
        h.update(os.path.relpath(p, source.path).encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    for s in settings:
        h.update(s.encode() if not os.path.isfile(s) else b"")
        if os.path.isfile(s):
            with open(s, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def tokenize_jsonl(path: str, tokenizer, fmt: str = "auto", max_tokens: Optional[int] = None) -> TokenizedData:
    """Tokenize every record of ``path`` (a JSONL / JSON / Parquet / Arrow file, a directory of
    shards or a save_to_disk directory; no caching here); ``fmt``: data.format; ``max_tokens``:
    data.max_tokens, for the size checks before parsing and tokenizing (None: none)."""
    source = resolve_source(path)
    from megatron_fastpath.hf.template_guard import BoundedRenderer

    lines = None if max_tokens is None else line_byte_limit(max_tokens)
    with BoundedRenderer(tokenizer, source.path) as renderer:  # templates bounded in time and memory
        return _tokenize_records(_source_records(source, lines), tokenizer, renderer, fmt, max_tokens)


def _tokenize_lines(lines: list, tokenizer, renderer, fmt: str = "auto",
                    max_tokens: Optional[int] = None) -> TokenizedData:
    """``lines``: one JSONL file's raw lines (bytes; str accepted)."""
    return _tokenize_records(((k, f"line {k}", raw) for k, raw in enumerate(lines, start=1)),
                             tokenizer, renderer, fmt, max_tokens)


def _text_chars(kind: str, payload) -> int:
    """The characters of a validated record's text (what the tokenizer would read)."""
    if kind == "chat":
        return sum(len(m["content"]) for m in payload)
    if kind == "pc":
        return len(payload[0]) + len(payload[1])
    return len(payload)


def _too_long(max_tokens: int, chars: Optional[int] = None, line_bytes: Optional[int] = None) -> str:
    if line_bytes is not None:
        return (f"a line of {line_bytes} bytes, more than data.max_tokens={max_tokens} tokens can "
                f"hold (at most {line_byte_limit(max_tokens)} bytes a line; not parsed)")
    return (f"{chars} characters, more than data.max_tokens={max_tokens} tokens can hold (at most "
            f"{record_char_limit(max_tokens)} characters, {CHARS_PER_TOKEN} a token; not tokenized)")


def _tokenize_records(records, tokenizer, renderer, fmt: str = "auto",
                      max_tokens: Optional[int] = None) -> TokenizedData:
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
        kind, payload, why = _validate(rec, fmt, family)
        if kind is None:
            malformed.append((where, *why))
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
        for i, m in encoded:
            if not any(m[1:]):  # position j predicts token j+1: a loss on token 0 alone trains nothing
                malformed.append((where, "no_loss_token", "no loss token (the template put nothing "
                                  "of the assistant reply inside its generation span)"))
                continue
            family = family or ("text" if kind == "text" else "conversational")
            ids.extend(i)
            masks.extend(m)
            lengths.append(len(i))
            nums.append(num)
            wheres.append(where)
    if bar is not None:
        bar.close()
    return _tokenized(_as_array(ids, np.int32), _as_array(masks, np.uint8),
                      _as_array(lengths, np.int64), _as_array(nums, np.int64), malformed, wheres.build())


def _as_array(buf: array.array, dtype) -> np.ndarray:
    """An ``array.array`` buffer as a numpy array of ``dtype`` (shares the buffer when the item
    sizes agree)."""
    if not len(buf):
        return np.zeros(0, dtype)
    out = np.frombuffer(buf, dtype=np.dtype(buf.typecode))
    return out if out.dtype == np.dtype(dtype) else out.astype(dtype)


def _tokenized(ids, masks, lengths, lines, malformed, wheres) -> TokenizedData:
    ids = Ragged.from_lengths(ids, lengths)
    return TokenizedData(ids, Ragged(masks, ids.starts, ids.ends), Column(lines), malformed, wheres)


def _cache_path(cfg: JsonlDataConfig, tok_dir: str) -> str:
    source = resolve_source(cfg.path)
    digest = _digest(source, f"format={cfg.format}", f"max_tokens={cfg.max_tokens}", os.path.join(tok_dir, "tokenizer.json"),
                     os.path.join(tok_dir, "tokenizer_config.json"),
                     os.path.join(tok_dir, "chat_template.jinja"))
    return f"{source.path}.{digest}.tokens.npz"  # beside the file or directory


def _save_cache(path: str, data: TokenizedData) -> None:
    """The flat arrays as they are (no per-record objects, no concatenation)."""
    bad = np.asarray([f"{where}\t{code}\t{why}" for where, code, why in data.malformed], dtype=str)
    w = data.wheres
    tmp = path + ".tmp.npz"
    np.savez(tmp, ids=data.ids.flat, masks=data.masks.flat, lengths=data.lengths,
             lines=data.lines.values, malformed=bad,
             where_prefixes=np.asarray(w.prefixes, dtype=str), where_prefix=w.prefix, where_num=w.num)
    os.replace(tmp, path)


def _load_cache(path: str) -> TokenizedData:
    """The cached tokens, read without unpickling (``allow_pickle=False``: an object array in a
    planted or damaged cache raises instead of running code) and checked for consistency;
    ValueError when the file is not a cache this module wrote."""
    keys = ("ids", "masks", "lengths", "lines", "malformed", "where_prefixes", "where_prefix", "where_num")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in keys}
    except (OSError, KeyError, ValueError, EOFError) as exc:  # zipfile.BadZipFile is an OSError
        raise ValueError(f"{path} is not a readable token cache ({exc})") from exc
    ids, masks, lengths, lines = (arrays[k] for k in ("ids", "masks", "lengths", "lines"))
    prefixes, prefix, num = (arrays[k] for k in ("where_prefixes", "where_prefix", "where_num"))
    bad = arrays["malformed"].tolist()
    if not (all(a.dtype.kind in "iu" and a.ndim == 1 for a in (ids, masks, lengths, lines, prefix, num))
            and arrays["malformed"].dtype.kind in "U" and prefixes.dtype.kind in "U"
            and len(ids) == len(masks) and len(prefix) == len(num) == len(lines)
            and len(lengths) == len(lines) and (lengths >= 0).all() and int(lengths.sum()) == len(ids)
            and (not len(prefix) or (prefix.min() >= 0 and prefix.max() < len(prefixes)))
            and all(s.count("\t") >= 2 for s in bad)):
        raise ValueError(f"{path} is not a token cache this version wrote (inconsistent arrays)")
    malformed = [tuple(s.split("\t", 2)) for s in bad]
    return _tokenized(ids.astype(np.int32, copy=False), masks.astype(np.uint8, copy=False),
                      lengths.astype(np.int64, copy=False), lines.astype(np.int64, copy=False),
                      malformed, Wheres(prefixes.tolist(), prefix, num))


def load_tokenized(cfg: JsonlDataConfig, tokenizer, tok_dir: str, log=print) -> TokenizedData:
    """Tokenized records from the cache beside the data, or tokenize (and cache) now."""
    resolve_source(cfg.path)  # no such file, empty directory, mixed shards: before any work
    cache = _cache_path(cfg, tok_dir) if cfg.cache else None
    if cache and os.path.isfile(cache):
        try:
            data = _load_cache(cache)
            log(f"data: tokenized records from cache {cache}")
            return data
        except ValueError as exc:
            log(f"data: {exc}; tokenizing again")
    data = tokenize_jsonl(cfg.path, tokenizer, cfg.format, cfg.max_tokens)
    if cache:
        try:
            _save_cache(cache, data)
            log(f"data: tokenized {len(data.ids)} records, cached in {cache}")
        except OSError as exc:
            log(f"data: could not write the token cache beside the data ({exc}); continuing")
    return data


def bad_record_counts(data: TokenizedData, too_long: list) -> dict:
    """{reason code: count} of every refused or dropped record (sorted by reason)."""
    counts: dict = {}
    for _, code, _ in data.malformed:
        counts[code] = counts.get(code, 0) + 1
    if too_long:
        counts["too_long"] = counts.get("too_long", 0) + len(too_long)
    return dict(sorted(counts.items()))


def _split_too_long(malformed: list) -> tuple:
    """(malformed records, records refused as too long before tokenizing) of ``malformed``."""
    return ([m for m in malformed if m[1] != "too_long"], [m for m in malformed if m[1] == "too_long"])


def _report(cfg: JsonlDataConfig, data: TokenizedData, too_long: list, log) -> None:
    """Count (by reason) and list bad records; raise under bad_records=error."""
    def fmt(items, k=10):
        shown = ", ".join(f"{where} ({why})" for where, *_, why in items[:k])
        return shown + (f", ... ({len(items) - k} more)" if len(items) > k else "")

    problems = []
    malformed, longest = _split_too_long(data.malformed)
    if malformed:
        problems.append(f"{len(malformed)} malformed record(s): {fmt(malformed)}")
    if longest or too_long:
        problems.append(f"{len(longest) + len(too_long)} record(s) longer than data.max_tokens="
                        f"{cfg.max_tokens}: {fmt(longest + too_long)}")
    if not problems:
        return
    counts = ", ".join(f"{k}={v}" for k, v in bad_record_counts(data, too_long).items())
    msg = f"{cfg.path}: " + "; ".join(problems) + f" [by reason: {counts}]"
    if cfg.bad_records == "error":
        raise DataError(msg + ". Fix the records, raise data.max_tokens, or set data.bad_records=skip")
    log(f"data: skipped {msg}")


class _Samples(_View):
    """``samples[k]`` = (tokens int64 [n], loss mask float32 [n]), made when asked for."""

    def __init__(self, ids: Ragged, masks: Ragged):
        self.ids, self.masks = ids, masks

    def __len__(self):
        return len(self.ids)

    def _item(self, k):
        tok, am = self.ids[k], self.masks[k]
        loss = np.zeros(len(tok), dtype=np.float32)
        loss[:-1] = am[1:]
        return tok.astype(np.int64), loss


class JsonlDataset:
    """``samples`` = [(tokens int64 [n], loss mask float32 [n])], ``lengths`` int64 [N] -- the
    interface :func:`megatron_fastpath.data.pack_microbatches` packs. The loss mask is the
    assistant mask shifted by one: position j predicts token j+1. Held as flat arrays (int32
    ids and uint8 assistant masks of all samples, :class:`Ragged`); a sample's arrays are made
    when it is read (``samples`` reads like a list)."""

    def __init__(self, ids, masks, lines):
        ids = ids if isinstance(ids, Ragged) else Ragged.from_list(ids, np.int32)
        masks = masks if isinstance(masks, Ragged) else Ragged.from_list(masks, np.uint8)
        self.ids, self.masks = ids, masks
        self.lines = lines if isinstance(lines, Column) else Column(np.asarray(list(lines), dtype=np.int64))
        self.samples = _Samples(ids, masks)
        self.lengths = ids.lengths

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_loss_tokens(self) -> int:
        """Assistant-mask tokens but each sample's first (no position predicts it)."""
        m = self.masks
        firsts = m.flat[m.starts[self.lengths > 0]]
        return int(m.reduce(np.add, 0)) - int(firsts.sum(dtype=np.int64))

    @property
    def max_token_id(self) -> int:
        return int(self.ids.reduce(np.maximum, -1))


def load_jsonl_splits(cfg: JsonlDataConfig, tokenizer_path: str, log=print):
    """(train JsonlDataset, eval JsonlDataset or None, report dict) -- all checks before
    training: file, chat template, malformed lines, over-long records."""
    from megatron_fastpath.hf.tokenizer import ChatTokenizer

    tok_dir = cfg.tokenizer_path or tokenizer_path
    tokenizer = ChatTokenizer(tok_dir)
    data = load_tokenized(cfg, tokenizer, tok_dir, log=log)
    lengths = data.lengths
    too_long = [(data.wheres[k], "too_long", f"{int(lengths[k])} tokens")
                for k in np.flatnonzero(lengths > cfg.max_tokens)]
    _report(cfg, data, too_long, log)
    split = data.split_for_template
    if split:
        log(f"data: {len(data.ids)} samples from {len(data.ids) - split} records: the chat template "
            "renders earlier turns differently from the last one (e.g. drops their reasoning), so "
            f"conversations with several assistant turns train as one sample per turn, each turn "
            f"rendered as the last (+{split} samples, split_for_template={split})")
    keep = np.flatnonzero(lengths <= cfg.max_tokens)
    if not len(keep):
        raise DataError(f"{cfg.path}: no usable records (with loss tokens, <= max_tokens)")
    # held out by record: the samples of a split conversation stay together (one group each,
    # groups numbered in order of their first sample)
    _, first, inverse = np.unique(data.lines.values[keep], return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    group = rank[inverse.reshape(-1)]  # kept sample -> its group
    n_groups = len(first)
    order = np.random.default_rng(cfg.seed).permutation(n_groups)
    n_eval = 0 if cfg.eval_fraction == 0 else max(1, int(round(cfg.eval_fraction * n_groups)))
    if n_eval >= n_groups:
        raise DataError(f"{cfg.path}: {n_groups} records cannot give a held-out split of "
                        f"{cfg.eval_fraction}; lower data.eval_fraction")
    held_group = np.zeros(n_groups, dtype=bool)
    held_group[order[:n_eval]] = True
    eval_idx = keep[held_group[group]]
    train_idx = keep[~held_group[group]]

    def subset(idx):
        return JsonlDataset(data.ids.take(idx), data.masks.take(idx), Column(data.lines.values[idx]))  # views

    # records: the data's records; train_records / eval_records: the samples of each split
    # (split_for_template more than records when conversations were split per assistant turn)
    malformed, longest = _split_too_long(data.malformed)
    report = dict(records=len(data.ids) - split + len(data.malformed), malformed=len(malformed),
                  too_long=len(longest) + len(too_long), bad_records=bad_record_counts(data, too_long),
                  split_for_template=split, train_records=len(train_idx), eval_records=len(eval_idx))
    return subset(train_idx), (subset(eval_idx) if len(eval_idx) else None), report


def _checkpoint_eos_ids(model_dir: Optional[str]) -> set:
    """``eos_token_id`` (an id or a list) of the checkpoint's generation_config.json, else of
    its config.json: where transformers' ``generate`` reads its stop tokens."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name) if model_dir else None
        if not path or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return {int(e) for e in (eos if isinstance(eos, list) else [eos])}
    return set()


def stop_token_ids(tokenizer, model_dir: Optional[str] = None) -> frozenset:
    """The tokens a sampled completion stops at: the tokenizer's EOS (the end-of-turn token of
    a chat tokenizer, e.g. <|eot_id|>) and the checkpoint's ``eos_token_id``(s)."""
    ids = _checkpoint_eos_ids(model_dir)
    if tokenizer.eos_id is not None:
        ids.add(tokenizer.eos_id)
    return frozenset(ids)


def eval_prompts(held: JsonlDataset, n: int) -> tuple:
    """(prompt ids, reference ids) of the first ``n`` held-out records (record order): the
    prompt is every token before the first loss token (a chat record: what the template renders
    before the assistant reply, generation prompt included; prompt / completion: the prompt),
    the reference the reply's tokens up to the end of that first trained span."""
    out = []
    for tok, loss in held.samples[:n]:
        trained = np.flatnonzero(loss[:-1] > 0)  # loss[j]: position j predicts token j + 1
        if not len(trained):  # pragma: no cover - refused when tokenized (no_loss_token)
            continue
        start = int(trained[0]) + 1
        end = start
        while end < len(tok) and loss[end - 1] > 0:
            end += 1
        out.append((tuple(int(t) for t in tok[:start]), tuple(int(t) for t in tok[start:end])))
    return tuple(out)


def build_eval_prompts(cfg: JsonlDataConfig, held: Optional[JsonlDataset], tokenizer_path: str,
                       model_dir: Optional[str] = None):
    """The ``providers.EvalPrompts`` of ``data.eval_samples`` (None when it is 0 or nothing is
    held out): the first held-out prompts, the stop tokens, and the tokenizer's decoding."""
    if not cfg.eval_samples or held is None:
        return None
    from megatron_fastpath.hf.tokenizer import ChatTokenizer
    from megatron_fastpath.providers import EvalPrompts

    tok = ChatTokenizer(cfg.tokenizer_path or tokenizer_path)
    return EvalPrompts(
        prompts=eval_prompts(held, cfg.eval_samples),
        stop_ids=stop_token_ids(tok, model_dir),
        max_new_tokens=cfg.eval_max_new_tokens,
        decode=lambda ids: tok.tokenizer.decode(ids, skip_special_tokens=False),
        decode_reply=lambda ids: tok.tokenizer.decode(ids, skip_special_tokens=True))
