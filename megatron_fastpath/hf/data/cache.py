"""The token cache: ``<cache dir>/<name of data.path>.<digest>.tokens.npz`` in ``data.cache_dir``
(default ``$XDG_CACHE_HOME/megatron_fastpath/tokens``, ``~/.cache/...`` without it; never beside
the user's data), keyed on the data's path and every shard's bytes, the settings that change
tokens and the tokenizer and template files; the flat arrays stored as they are and read back
without unpickling."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from megatron_fastpath.hf.data.arrays import TokenizedData, Wheres
from megatron_fastpath.hf.data.config import JsonlDataConfig
from megatron_fastpath.hf.data.sources import DataSource, resolve_source
from megatron_fastpath.hf.data.tokenize import _tokenized, tokenize_jsonl

__all__ = ["CACHE_VERSION", "load_tokenized", "cache_dir"]

CACHE_VERSION = 8  # bump when tokenization, masking or the cache layout changes


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



def cache_dir(cfg: JsonlDataConfig) -> str:
    """Where the token caches go: data.cache_dir, else $XDG_CACHE_HOME/megatron_fastpath/tokens
    (~/.cache/megatron_fastpath/tokens when XDG_CACHE_HOME is unset or empty)."""
    if cfg.cache_dir:
        return os.path.abspath(os.path.expanduser(cfg.cache_dir))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "megatron_fastpath", "tokens")


def _cache_path(cfg: JsonlDataConfig, tok_dir: str) -> str:
    source = resolve_source(cfg.path)
    # the data's absolute path is in the key: reports name a shard's or row's file by its path
    digest = _digest(source, f"path={os.path.abspath(source.path)}", f"format={cfg.format}", f"max_tokens={cfg.max_tokens}",
                     f"columns={sorted((cfg.columns or {}).items())}", os.path.join(tok_dir, "tokenizer.json"),
                     os.path.join(tok_dir, "tokenizer_config.json"),
                     os.path.join(tok_dir, "chat_template.jinja"))
    return os.path.join(cache_dir(cfg), f"{os.path.basename(os.path.abspath(source.path))}.{digest}.tokens.npz")


def _save_cache(path: str, data: TokenizedData) -> None:
    """The flat arrays as they are (no per-record objects, no concatenation)."""
    bad = np.asarray([f"{where}\t{code}\t{why}" for where, code, why in data.malformed], dtype=str)
    w = data.wheres
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(tmp, ids=data.ids.flat, masks=data.masks.flat, lengths=data.lengths,
             lines=data.lines.values, malformed=bad,
             where_prefixes=np.asarray(w.prefixes, dtype=str), where_prefix=w.prefix, where_num=w.num,
             format_names=np.asarray([f for f, _ in data.formats], dtype=str),
             format_counts=np.asarray([n for _, n in data.formats], dtype=np.int64))
    os.replace(tmp, path)


def _load_cache(path: str) -> TokenizedData:
    """The cached tokens, read without unpickling (``allow_pickle=False``: an object array in a
    planted or damaged cache raises instead of running code) and checked for consistency;
    ValueError when the file is not a cache this module wrote."""
    keys = ("ids", "masks", "lengths", "lines", "malformed", "where_prefixes", "where_prefix", "where_num",
            "format_names", "format_counts")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in keys}
    except (OSError, KeyError, ValueError, EOFError) as exc:  # zipfile.BadZipFile is an OSError
        raise ValueError(f"{path} is not a readable token cache ({exc})") from exc
    ids, masks, lengths, lines = (arrays[k] for k in ("ids", "masks", "lengths", "lines"))
    prefixes, prefix, num = (arrays[k] for k in ("where_prefixes", "where_prefix", "where_num"))
    bad = arrays["malformed"].tolist()
    names, counts = arrays["format_names"], arrays["format_counts"]
    if not (all(a.dtype.kind in "iu" and a.ndim == 1 for a in (ids, masks, lengths, lines, prefix, num, counts))
            and arrays["malformed"].dtype.kind in "U" and prefixes.dtype.kind in "U"
            and names.dtype.kind in "U" and names.shape == counts.shape
            and len(ids) == len(masks) and len(prefix) == len(num) == len(lines)
            and len(lengths) == len(lines) and (lengths >= 0).all() and int(lengths.sum()) == len(ids)
            and (not len(prefix) or (prefix.min() >= 0 and prefix.max() < len(prefixes)))
            and all(s.count("\t") >= 2 for s in bad)):
        raise ValueError(f"{path} is not a token cache this version wrote (inconsistent arrays)")
    malformed = [tuple(s.split("\t", 2)) for s in bad]
    return _tokenized(ids.astype(np.int32, copy=False), masks.astype(np.uint8, copy=False),
                      lengths.astype(np.int64, copy=False), lines.astype(np.int64, copy=False),
                      malformed, Wheres(prefixes.tolist(), prefix, num),
                      formats=tuple(zip(names.tolist(), (int(n) for n in counts))))


def load_tokenized(cfg: JsonlDataConfig, tokenizer, tok_dir: str, log=print) -> TokenizedData:
    """Tokenized records from the token cache (:func:`cache_dir`), or tokenize (and cache) them."""
    resolve_source(cfg.path)  # no such file, empty directory, mixed shards: before any work
    cache = _cache_path(cfg, tok_dir) if cfg.cache else None
    if cache and os.path.isfile(cache):
        try:
            data = _load_cache(cache)
            log(f"data: tokenized records from cache {cache}")
            return data
        except ValueError as exc:
            log(f"data: {exc}; tokenizing again")
    data = tokenize_jsonl(cfg.path, tokenizer, cfg.format, cfg.max_tokens, cfg.columns)
    if cache and len(data.ids):  # data that gave nothing is refused: no cache of it
        try:
            _save_cache(cache, data)
            log(f"data: tokenized {len(data.ids)} records, cached in {cache}")
        except OSError as exc:
            log(f"data: could not write the token cache in {os.path.dirname(cache)} ({exc}); continuing "
                "(set data.cache_dir to a writable directory, or data.cache=false)")
    return data
