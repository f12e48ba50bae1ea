"""``data=jsonl``: chat / prompt-completion records -> tokenized records -> packed microbatches.

``data.path`` is a JSONL file, a JSON array, Parquet, Arrow, a ``datasets`` ``save_to_disk``
directory or a directory of shards of one type (:func:`resolve_source`; all but JSONL read
memory-mapped through the ``datasets`` library, imported only then). Each JSONL line / row is
one record, either ``{"messages": [{"role": ..., "content": ...}, ...]}`` (rendered
with the checkpoint's chat template, loss on assistant tokens) or ``{"prompt": ...,
"completion": ...}`` (loss on completion tokens + EOS), or another format (``format``). Bad
records and records longer than ``max_tokens`` are reported with their line or row and counted
by reason; ``bad_records=error`` stops before training, ``skip`` drops them (reported, never
silently). Tokenized records are cached beside the data (keyed on every shard's bytes, the
tokenizer and template bytes). A deterministic
``eval_fraction`` of the records is held out; both splits are packed first-fit decreasing into
``max_tokens`` with :func:`megatron_fastpath.data.pack_microbatches`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from typing import Optional

import numpy as np

__all__ = ["JsonlDataConfig", "JsonlDataset", "TokenizedData", "tokenize_jsonl", "load_jsonl_splits",
           "DataError", "DataSource", "resolve_source", "bad_record_counts", "eval_prompts",
           "stop_token_ids", "build_eval_prompts"]

CACHE_VERSION = 5  # bump when tokenization, masking or the cache layout changes


class DataError(ValueError):
    """The JSONL data cannot be used as configured (file, line and reason in the message)."""


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


@dataclasses.dataclass(frozen=True)
class TokenizedData:
    """All well-formed records of the data: ids / masks per record (token-aligned assistant
    mask), their numbers (the 1-based line of a single JSONL file, else the 1-based record number
    across shards) and where each is ("line 7", "<shard> line 7", "<file> row 6"), and the
    bad records as (where, reason code, reason): codes invalid_utf8, malformed_json,
    not_an_object, unknown_format, mixed_format, bad_fields, unknown_role, no_assistant,
    template_error, no_loss_token (too_long is counted from the lengths). A conversation whose
    chat template renders earlier turns differently from the last one is one sample per
    assistant turn (``ChatTokenizer.render_samples``): its samples share its number and where."""

    ids: list
    masks: list
    lines: list
    malformed: list
    wheres: list = dataclasses.field(default_factory=list)

    @property
    def split_for_template(self) -> int:
        """Samples beyond one per record: those of conversations split per assistant turn."""
        return len(self.lines) - len(set(self.lines))


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
        return None, f"'{where}' must be a non-empty list"
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


def resolve_source(path: str) -> DataSource:
    """The data source ``path`` names (a file, a directory of shards, or a ``save_to_disk``
    directory), detected from the path alone; DataError naming what is wrong otherwise."""
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


def _source_records(source: DataSource):
    """(record number, where, raw) for every record of the source, in order; raw is the line's
    bytes (JSONL: decoded and parsed per line) or the row's dict (read through datasets)."""
    n = 0
    single = len(source.files) == 1
    if source.kind == "jsonl":
        for f in source.files:
            with open(f, "rb") as fh:
                lines = fh.read().split(b"\n")
            for lineno, raw in enumerate(lines, start=1):
                n += 1
                yield (lineno if single else n), (f"line {lineno}" if single else f"{f} line {lineno}"), raw
        return
    for name, ds in _datasets_tables(source):
        for row, rec in enumerate(ds):
            n += 1
            yield n, f"{name} row {row}", _strip_none(rec)


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


def tokenize_jsonl(path: str, tokenizer, fmt: str = "auto") -> TokenizedData:
    """Tokenize every record of ``path`` (a JSONL / JSON / Parquet / Arrow file, a directory of
    shards or a save_to_disk directory; no caching here); ``fmt``: data.format."""
    source = resolve_source(path)
    from megatron_fastpath.hf.template_guard import BoundedRenderer

    with BoundedRenderer(tokenizer, source.path) as renderer:  # templates bounded in time and memory
        return _tokenize_records(_source_records(source), tokenizer, renderer, fmt)


def _tokenize_lines(lines: list, tokenizer, renderer, fmt: str = "auto") -> TokenizedData:
    """``lines``: one JSONL file's raw lines (bytes; str accepted)."""
    return _tokenize_records(((k, f"line {k}", raw) for k, raw in enumerate(lines, start=1)),
                             tokenizer, renderer, fmt)


def _tokenize_records(records, tokenizer, renderer, fmt: str = "auto") -> TokenizedData:
    """``records``: (number, where, raw) with raw a JSONL line (bytes or str: decoded and parsed
    on its own, so a line of invalid UTF-8 is one bad record, not the file's end) or a parsed
    record (a dict from datasets). Bad records are collected as (where, reason code, text)."""
    from megatron_fastpath.hf.tokenizer import TokenizerError

    ids, masks, nums, wheres, malformed = [], [], [], [], []
    chat_seen = False
    family = None  # "text" or "conversational": the file's, from its first good record
    bar = _progress(None, "tokenizing")
    for num, where, raw in records:
        if bar is not None:
            bar.update(1)
        if isinstance(raw, (bytes, str)):
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
        else:
            rec = raw
        kind, payload, why = _validate(rec, fmt, family)
        if kind is None:
            malformed.append((where, *why))
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
            ids.append(np.asarray(i, dtype=np.int32))
            masks.append(np.asarray(m, dtype=np.uint8))
            nums.append(num)
            wheres.append(where)
    if bar is not None:
        bar.close()
    return TokenizedData(ids, masks, nums, malformed, wheres)


def _cache_path(cfg: JsonlDataConfig, tok_dir: str) -> str:
    source = resolve_source(cfg.path)
    digest = _digest(source, f"format={cfg.format}", os.path.join(tok_dir, "tokenizer.json"),
                     os.path.join(tok_dir, "tokenizer_config.json"),
                     os.path.join(tok_dir, "chat_template.jinja"))
    return f"{source.path}.{digest}.tokens.npz"  # beside the file or directory


def _save_cache(path: str, data: TokenizedData) -> None:
    lengths = np.asarray([len(x) for x in data.ids], dtype=np.int64)
    bad = np.asarray([f"{where}\t{code}\t{why}" for where, code, why in data.malformed], dtype=str)
    tmp = path + ".tmp.npz"
    np.savez(tmp, ids=np.concatenate(data.ids) if data.ids else np.zeros(0, np.int32),
             masks=np.concatenate(data.masks) if data.masks else np.zeros(0, np.uint8),
             lengths=lengths, lines=np.asarray(data.lines, dtype=np.int64), malformed=bad,
             wheres=np.asarray(data.wheres, dtype=str))
    os.replace(tmp, path)


def _load_cache(path: str) -> TokenizedData:
    """The cached tokens, read without unpickling (``allow_pickle=False``: an object array in a
    planted or damaged cache raises instead of running code) and checked for consistency;
    ValueError when the file is not a cache this module wrote."""
    keys = ("ids", "masks", "lengths", "lines", "malformed", "wheres")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in keys}
    except (OSError, KeyError, ValueError, EOFError) as exc:  # zipfile.BadZipFile is an OSError
        raise ValueError(f"{path} is not a readable token cache ({exc})") from exc
    ids, masks, lengths, lines = (arrays[k] for k in ("ids", "masks", "lengths", "lines"))
    bad = arrays["malformed"].tolist()
    if not (all(a.dtype.kind in "iu" and a.ndim == 1 for a in (ids, masks, lengths, lines))
            and arrays["malformed"].dtype.kind in "U" and arrays["wheres"].dtype.kind == "U"
            and len(ids) == len(masks) and len(arrays["wheres"]) == len(lines)
            and len(lengths) == len(lines) and (lengths >= 0).all() and int(lengths.sum()) == len(ids)
            and all(s.count("\t") >= 2 for s in bad)):
        raise ValueError(f"{path} is not a token cache this version wrote (inconsistent arrays)")
    cuts = np.cumsum(lengths)[:-1]
    malformed = [tuple(s.split("\t", 2)) for s in bad]
    return TokenizedData(list(np.split(ids, cuts)) if len(lengths) else [],
                         list(np.split(masks, cuts)) if len(lengths) else [],
                         lines.tolist(), malformed, arrays["wheres"].tolist())


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
    data = tokenize_jsonl(cfg.path, tokenizer, cfg.format)
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
        counts["too_long"] = len(too_long)
    return dict(sorted(counts.items()))


def _report(cfg: JsonlDataConfig, data: TokenizedData, too_long: list, log) -> None:
    """Count (by reason) and list bad records; raise under bad_records=error."""
    def fmt(items, k=10):
        shown = ", ".join(f"{where} ({why})" for where, *_, why in items[:k])
        return shown + (f", ... ({len(items) - k} more)" if len(items) > k else "")

    problems = []
    if data.malformed:
        problems.append(f"{len(data.malformed)} malformed record(s): {fmt(data.malformed)}")
    if too_long:
        problems.append(f"{len(too_long)} record(s) longer than data.max_tokens={cfg.max_tokens}: "
                        f"{fmt(too_long)}")
    if not problems:
        return
    counts = ", ".join(f"{k}={v}" for k, v in bad_record_counts(data, too_long).items())
    msg = f"{cfg.path}: " + "; ".join(problems) + f" [by reason: {counts}]"
    if cfg.bad_records == "error":
        raise DataError(msg + ". Fix the records, raise data.max_tokens, or set data.bad_records=skip")
    log(f"data: skipped {msg}")


class JsonlDataset:
    """``samples`` = [(tokens int64 [n], loss mask float32 [n])], ``lengths`` int64 [N] -- the
    interface :func:`megatron_fastpath.data.pack_microbatches` packs. The loss mask is the
    assistant mask shifted by one: position j predicts token j+1."""

    def __init__(self, ids: list, masks: list, lines: list):
        self.lines = list(lines)
        self.samples = []
        for tok, am in zip(ids, masks):
            loss = np.zeros(len(tok), dtype=np.float32)
            loss[:-1] = am[1:]
            self.samples.append((np.asarray(tok, dtype=np.int64), loss))
        self.lengths = np.asarray([len(t) for t in ids], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(m.sum() for _, m in self.samples))


def load_jsonl_splits(cfg: JsonlDataConfig, tokenizer_path: str, log=print):
    """(train JsonlDataset, eval JsonlDataset or None, report dict) -- all checks before
    training: file, chat template, malformed lines, over-long records."""
    from megatron_fastpath.hf.tokenizer import ChatTokenizer

    tok_dir = cfg.tokenizer_path or tokenizer_path
    tokenizer = ChatTokenizer(tok_dir)
    data = load_tokenized(cfg, tokenizer, tok_dir, log=log)
    too_long = [(where, "too_long", f"{len(i)} tokens")
                for i, where in zip(data.ids, data.wheres) if len(i) > cfg.max_tokens]
    _report(cfg, data, too_long, log)
    split = data.split_for_template
    if split:
        log(f"data: {len(data.ids)} samples from {len(data.ids) - split} records: the chat template "
            "renders earlier turns differently from the last one (e.g. drops their reasoning), so "
            f"conversations with several assistant turns train as one sample per turn, each turn "
            f"rendered as the last (+{split} samples, split_for_template={split})")
    keep = [k for k, i in enumerate(data.ids) if len(i) <= cfg.max_tokens]
    if not keep:
        raise DataError(f"{cfg.path}: no usable records (with loss tokens, <= max_tokens)")
    # held out by record: the samples of a split conversation stay together (one group each)
    groups: dict = {}
    for k in keep:
        groups.setdefault(data.lines[k], []).append(k)
    groups = list(groups.values())
    order = np.random.default_rng(cfg.seed).permutation(len(groups))
    n_eval = 0 if cfg.eval_fraction == 0 else max(1, int(round(cfg.eval_fraction * len(groups))))
    if n_eval >= len(groups):
        raise DataError(f"{cfg.path}: {len(groups)} records cannot give a held-out split of "
                        f"{cfg.eval_fraction}; lower data.eval_fraction")
    eval_idx = sorted(k for j in order[:n_eval] for k in groups[j])
    train_idx = sorted(k for j in order[n_eval:] for k in groups[j])

    def subset(idx):
        return JsonlDataset([data.ids[k] for k in idx], [data.masks[k] for k in idx],
                            [data.lines[k] for k in idx])

    # records: the data's records; train_records / eval_records: the samples of each split
    # (split_for_template more than records when conversations were split per assistant turn)
    report = dict(records=len(data.ids) - split + len(data.malformed), malformed=len(data.malformed),
                  too_long=len(too_long), bad_records=bad_record_counts(data, too_long),
                  split_for_template=split, train_records=len(train_idx), eval_records=len(eval_idx))
    return subset(train_idx), (subset(eval_idx) if eval_idx else None), report


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
