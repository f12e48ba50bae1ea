"""``data=jsonl``: chat / prompt-completion JSONL -> tokenized records -> packed microbatches.

Each line is one record, either ``{"messages": [{"role": ..., "content": ...}, ...]}`` (rendered
with the checkpoint's chat template, loss on assistant tokens) or ``{"prompt": ...,
"completion": ...}`` (loss on completion tokens + EOS). Malformed lines and records longer than
``max_tokens`` are counted and reported with their line numbers; ``bad_records=error`` stops
before training, ``skip`` drops them (reported, never silently). Tokenized records are cached
beside the data file (keyed on the data, tokenizer and template bytes). A deterministic
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
           "DataError"]

CACHE_VERSION = 2  # bump when tokenization or masking changes


class DataError(ValueError):
    """The JSONL data cannot be used as configured (file, line and reason in the message)."""


@dataclasses.dataclass(frozen=True)
class JsonlDataConfig:
    """The ``data`` group for ``data=jsonl``.

    path: the JSONL file. tokenizer_path: directory with tokenizer.json (default model.path).
    max_tokens / max_seqs: packed bin capacity (the cache's static sizes).
    eval_fraction: held-out share of records (at least one record when > 0).
    eval_every: held-out loss every this many steps (0: only before and after training).
    bad_records: error | skip (malformed lines and records longer than max_tokens).
    cache: cache tokenized records beside the data file.
    """

    path: str = ""
    tokenizer_path: Optional[str] = None
    max_tokens: int = 512
    max_seqs: int = 32
    eval_fraction: float = 0.1
    eval_every: int = 10
    bad_records: str = "error"
    cache: bool = True
    seed: int = 1234

    def __post_init__(self):
        if not self.path:
            raise DataError("data.path must name a JSONL file (data=jsonl data.path=<file.jsonl>)")
        if self.bad_records not in ("error", "skip"):
            raise DataError(f"data.bad_records must be 'error' or 'skip'; got {self.bad_records!r}")
        if self.eval_every < 0:
            raise DataError(f"data.eval_every must be >= 0; got {self.eval_every}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise DataError(f"data.eval_fraction must be in [0, 1); got {self.eval_fraction}")


@dataclasses.dataclass(frozen=True)
class TokenizedData:
    """All well-formed records of a file: ids / masks per record (token-aligned assistant mask),
    their 1-based line numbers, and the malformed lines as (line, reason)."""

    ids: list
    masks: list
    lines: list
    malformed: list


def _validate(rec):
    """'chat' or 'pc' for a well-formed record, else a reason string (raises nothing)."""
    if not isinstance(rec, dict):
        return None, "not a JSON object"
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            return None, "'messages' must be a non-empty list"
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return None, f"messages[{j}] needs string 'role' and 'content'"
        if not any(m["role"] == "assistant" for m in msgs):
            return None, "no assistant message (nothing to learn)"
        return "chat", None
    if isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str):
        return "pc", None
    return None, "no 'messages' key (nor string 'prompt' and 'completion')"


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc=desc, unit="rec", file=sys.stderr, disable=None, mininterval=1.0,
                leave=False)


def _file_digest(*paths: str) -> str:
    h = hashlib.sha256(f"v{CACHE_VERSION}".encode())
    for p in paths:
        h.update(p.encode() if not os.path.isfile(p) else b"")
        if os.path.isfile(p):
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def tokenize_jsonl(path: str, tokenizer) -> TokenizedData:
    """Tokenize every line of ``path`` (no caching here)."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    from megatron_fastpath.hf.template_guard import BoundedRenderer

    with BoundedRenderer(tokenizer, path) as renderer:  # chat templates bounded in time and memory
        return _tokenize_lines(lines, tokenizer, renderer)


def _tokenize_lines(lines: list, tokenizer, renderer) -> TokenizedData:
    from megatron_fastpath.hf.tokenizer import TokenizerError

    ids, masks, nums, malformed = [], [], [], []
    chat_seen = False
    bar = _progress(len(lines), "tokenizing")
    for lineno, line in enumerate(lines, start=1):
        if bar is not None:
            bar.update(1)
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            malformed.append((lineno, f"invalid JSON ({exc.msg})"))
            continue
        kind, why = _validate(rec)
        if kind is None:
            malformed.append((lineno, why))
            continue
        if kind == "chat":
            if not chat_seen:
                tokenizer.require_template()
                chat_seen = True
            try:
                text, spans = renderer.render_chat(rec["messages"], lineno)
            except TokenizerError:
                raise
            except ValueError as exc:  # a template's raise_exception, bad roles, ...
                malformed.append((lineno, f"chat template failed: {exc}"))
                continue
            i, m = tokenizer.tokens_and_mask(text, spans)
        else:
            i, m = tokenizer.encode_prompt_completion(rec["prompt"], rec["completion"])
        ids.append(np.asarray(i, dtype=np.int32))
        masks.append(np.asarray(m, dtype=np.uint8))
        nums.append(lineno)
    if bar is not None:
        bar.close()
    return TokenizedData(ids, masks, nums, malformed)


def _cache_path(cfg: JsonlDataConfig, tok_dir: str) -> str:
    digest = _file_digest(cfg.path, os.path.join(tok_dir, "tokenizer.json"),
                          os.path.join(tok_dir, "tokenizer_config.json"),
                          os.path.join(tok_dir, "chat_template.jinja"))
    return f"{cfg.path}.{digest}.tokens.npz"


def _save_cache(path: str, data: TokenizedData) -> None:
    lengths = np.asarray([len(x) for x in data.ids], dtype=np.int64)
    bad = np.asarray([f"{ln}\t{why}" for ln, why in data.malformed], dtype=str)
    tmp = path + ".tmp.npz"
    np.savez(tmp, ids=np.concatenate(data.ids) if data.ids else np.zeros(0, np.int32),
             masks=np.concatenate(data.masks) if data.masks else np.zeros(0, np.uint8),
             lengths=lengths, lines=np.asarray(data.lines, dtype=np.int64), malformed=bad)
    os.replace(tmp, path)


def _load_cache(path: str) -> TokenizedData:
    """The cached tokens, read without unpickling (``allow_pickle=False``: an object array in a
    planted or damaged cache raises instead of running code) and checked for consistency;
    ValueError when the file is not a cache this module wrote."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("ids", "masks", "lengths", "lines", "malformed")}
    except (OSError, KeyError, ValueError, EOFError) as exc:  # zipfile.BadZipFile is an OSError
        raise ValueError(f"{path} is not a readable token cache ({exc})") from exc
    ids, masks, lengths, lines = (arrays[k] for k in ("ids", "masks", "lengths", "lines"))
    if not (all(a.dtype.kind in "iu" and a.ndim == 1 for a in (ids, masks, lengths, lines))
            and arrays["malformed"].dtype.kind == "U" and len(ids) == len(masks)
            and len(lengths) == len(lines) and (lengths >= 0).all() and int(lengths.sum()) == len(ids)):
        raise ValueError(f"{path} is not a token cache this version wrote (inconsistent arrays)")
    cuts = np.cumsum(lengths)[:-1]
    malformed = [(int(s.split("\t", 1)[0]), s.split("\t", 1)[1]) for s in arrays["malformed"].tolist()]
    return TokenizedData(list(np.split(ids, cuts)) if len(lengths) else [],
                         list(np.split(masks, cuts)) if len(lengths) else [],
                         lines.tolist(), malformed)


def load_tokenized(cfg: JsonlDataConfig, tokenizer, tok_dir: str, log=print) -> TokenizedData:
    """Tokenized records from the cache beside the data, or tokenize (and cache) now."""
    if not os.path.isfile(cfg.path):
        raise DataError(f"data.path {cfg.path!r}: no such file")
    cache = _cache_path(cfg, tok_dir) if cfg.cache else None
    if cache and os.path.isfile(cache):
        try:
            data = _load_cache(cache)
            log(f"data: tokenized records from cache {cache}")
            return data
        except ValueError as exc:
            log(f"data: {exc}; tokenizing again")
    data = tokenize_jsonl(cfg.path, tokenizer)
    if cache:
        try:
            _save_cache(cache, data)
            log(f"data: tokenized {len(data.ids)} records, cached in {cache}")
        except OSError as exc:
            log(f"data: could not write the token cache beside the data ({exc}); continuing")
    return data


def _report(cfg: JsonlDataConfig, data: TokenizedData, too_long: list, log) -> None:
    """Count and list bad records; raise under bad_records=error."""
    def fmt(items, k=10):
        shown = ", ".join(f"line {ln} ({why})" for ln, why in items[:k])
        return shown + (f", ... ({len(items) - k} more)" if len(items) > k else "")

    problems = []
    if data.malformed:
        problems.append(f"{len(data.malformed)} malformed line(s): {fmt(data.malformed)}")
    if too_long:
        problems.append(f"{len(too_long)} record(s) longer than data.max_tokens={cfg.max_tokens}: "
                        f"{fmt(too_long)}")
    if not problems:
        return
    msg = f"{cfg.path}: " + "; ".join(problems)
    if cfg.bad_records == "error":
        raise DataError(msg + ". Fix the lines, raise data.max_tokens, or set data.bad_records=skip")
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
    too_long = [(ln, f"{len(i)} tokens") for i, ln in zip(data.ids, data.lines) if len(i) > cfg.max_tokens]
    _report(cfg, data, too_long, log)
    keep = [k for k, i in enumerate(data.ids) if len(i) <= cfg.max_tokens and data.masks[k][1:].any()]
    if not keep:
        raise DataError(f"{cfg.path}: no usable records (with loss tokens, <= max_tokens)")
    order = np.random.default_rng(cfg.seed).permutation(len(keep))
    n_eval = 0 if cfg.eval_fraction == 0 else max(1, int(round(cfg.eval_fraction * len(keep))))
    if n_eval >= len(keep):
        raise DataError(f"{cfg.path}: {len(keep)} records cannot give a held-out split of "
                        f"{cfg.eval_fraction}; lower data.eval_fraction")
    eval_idx = sorted(keep[j] for j in order[:n_eval])
    train_idx = sorted(keep[j] for j in order[n_eval:])

    def subset(idx):
        return JsonlDataset([data.ids[k] for k in idx], [data.masks[k] for k in idx],
                            [data.lines[k] for k in idx])

    report = dict(records=len(data.ids) + len(data.malformed), malformed=len(data.malformed),
                  too_long=len(too_long), train_records=len(train_idx), eval_records=len(eval_idx))
    return subset(train_idx), (subset(eval_idx) if eval_idx else None), report
