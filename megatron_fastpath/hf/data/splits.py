"""Tokenized records -> the train and held-out datasets: bad and over-long records reported
(counted by reason; ``data.bad_records``), a deterministic ``data.eval_fraction`` held out by
record, each split a :class:`JsonlDataset` that :func:`megatron_fastpath.data.pack_microbatches`
packs."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from megatron_fastpath.hf.data.arrays import Column, Ragged, TokenizedData, _View
from megatron_fastpath.hf.data.cache import load_tokenized
from megatron_fastpath.hf.data.config import JsonlDataConfig
from megatron_fastpath.hf.data.records import ACCEPTED, columns_hint, formats_text, keys_text
from megatron_fastpath.hf.data.sources import DataError, resolve_source

__all__ = ["JsonlDataset", "load_jsonl_splits", "bad_record_counts"]


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


def _refuse_nothing(cfg: JsonlDataConfig, data: TokenizedData, key: str = "data.path") -> None:
    """DataError, in one line, for data that gave no record: it is empty, or none of its records
    is in a format data=jsonl reads (what data.max_tokens or bad_records=skip cannot help)."""
    if not data.malformed:
        source = resolve_source(cfg.path)
        size = sum(os.path.getsize(f) for f in source.digest_files if os.path.isfile(f))
        what = ("0 bytes" if size == 0 else "blank lines only" if source.kind == "jsonl" else "0 rows")
        raise DataError(f"{key} {cfg.path!r} is empty ({what}): there are no records to "
                        f"{'train on' if key == 'data.path' else 'hold out'}; point {key} at the data "
                        "(JSONL: one JSON object a line)")
    if {code for _, code, _ in data.malformed} != {"unknown_format"} or not data.unknown_keys:
        return  # the report names each record and why
    n = len(data.malformed)
    found = "; ".join(f"{keys_text(keys)} ({count} record{'s' if count > 1 else ''})"
                      for keys, count in data.unknown_keys[:3])
    if len(data.unknown_keys) > 3:
        found += f"; ... ({len(data.unknown_keys) - 3} more key sets)"
    example = columns_hint(data.unknown_keys[0][0])
    raise DataError(
        f"{cfg.path}: none of its {n} record{'s' if n > 1 else ''} is in a format data=jsonl "
        f"reads; the keys found: {found}. A record needs {ACCEPTED}: map the keys onto "
        f"these with data.columns, e.g. {example}")


def _overlong_policy(cfg: JsonlDataConfig) -> str:
    """error | skip for the over-long records left (data.overlong, else data.bad_records: those
    truncation cannot keep follow data.bad_records too)."""
    return cfg.overlong if cfg.overlong in ("error", "skip") else cfg.bad_records


def _report(cfg: JsonlDataConfig, data: TokenizedData, too_long: list, log) -> None:
    """Count (by reason) and list bad records; raise under bad_records=error (over-long
    records: data.overlong=error, or bad_records=error with data.overlong unset or truncate)."""
    def fmt(items, k=10):
        shown = ", ".join(f"{where} ({why})" for where, *_, why in items[:k])
        return shown + (f", ... ({len(items) - k} more)" if len(items) > k else "")

    problems = []
    malformed, longest = _split_too_long(data.malformed)
    if malformed:
        problems.append(f"{len(malformed)} malformed record(s): {fmt(malformed)}")
    longer = longest + too_long
    if longer:
        problems.append(f"{len(longer)} record(s) longer than data.max_tokens="
                        f"{cfg.max_tokens}: {fmt(longer)}")
    if not problems:
        return
    counts = ", ".join(f"{k}={v}" for k, v in bad_record_counts(data, too_long).items())
    msg = f"{cfg.path}: " + "; ".join(problems) + f" [by reason: {counts}]"
    bad_error = malformed and cfg.bad_records == "error"
    long_error = longer and _overlong_policy(cfg) == "error"
    if bad_error or long_error:
        fixes = ["raise data.max_tokens"] if longer else []  # only over-long records need it
        if longer and cfg.overlong != "truncate":
            fixes.append("set data.overlong=truncate")
        fixes.append("set data.bad_records=skip" if bad_error or cfg.overlong != "error" else
                     "set data.overlong=skip")
        raise DataError(msg + ". Fix the records, " + ", ".join(fixes[:-1])
                        + (", or " if len(fixes) > 1 else "or ") + fixes[-1])
    log(f"data: skipped {msg}")


def _truncate(cfg: JsonlDataConfig, data: TokenizedData, log) -> tuple:
    """(data, count) with the samples longer than data.max_tokens cut from the right to fit
    (data.overlong=truncate): the prompt stays whole, the last assistant reply / completion is
    cut, and the tokens after the last loss token that is left are dropped. A sample whose
    first loss token falls past data.max_tokens cannot be cut to train anything and stays over-long."""
    lengths = data.lengths
    over = np.flatnonzero(lengths > cfg.max_tokens)
    if cfg.overlong != "truncate" or not len(over):
        return data, 0
    ends = data.ids.ends.copy()
    cut = []
    for k in over:
        m = data.masks[k][:cfg.max_tokens]
        trained = np.flatnonzero(m[1:])  # position j predicts token j + 1: token 0 trains nothing
        if len(trained):
            ends[k] = data.ids.starts[k] + int(trained[-1]) + 2
            cut.append(k)
    if not cut:
        return data, 0
    shown = ", ".join(f"{data.wheres[k]} ({int(lengths[k])} -> {int(ends[k] - data.ids.starts[k])} tokens)"
                      for k in cut[:10]) + (f", ... ({len(cut) - 10} more)" if len(cut) > 10 else "")
    log(f"data: truncated {len(cut)} record(s) of {cfg.path} longer than data.max_tokens="
        f"{cfg.max_tokens} from the right (data.overlong=truncate): {shown}")
    ids, masks = Ragged(data.ids.flat, data.ids.starts, ends), Ragged(data.masks.flat, data.ids.starts, ends)
    return dataclasses.replace(data, ids=ids, masks=masks), len(cut)


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


def _usable(cfg: JsonlDataConfig, data: TokenizedData, log, key: str = "data.path"):
    """(data, indices of the samples that train, over-long records, truncated records) of
    ``data`` read from ``cfg.path`` (over-long samples cut under data.overlong=truncate)
    (``key``: the setting that names it): data that gives nothing refused, bad records reported."""
    if not len(data.ids):
        _refuse_nothing(cfg, data, key)
    records = len(data.ids) - data.split_for_template + len(data.malformed)
    mapped = (" (data.columns: " + ", ".join(f"{k}={v}" for k, v in cfg.columns.items()) + ")"
              if cfg.columns else "")
    log(f"data: {cfg.path}, {records} records, format {formats_text(data.formats)}{mapped}"
        + ("" if key == "data.path" else " (held out: data.eval_path)"))
    data, truncated = _truncate(cfg, data, log)
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
    return data, keep, too_long, truncated


def _hold_out(cfg: JsonlDataConfig, data: TokenizedData, keep: np.ndarray) -> tuple:
    """(train indices, held-out indices) of the kept samples: ``data.eval_fraction`` of the
    records held out by ``data.seed``, the samples of a split conversation kept together."""
    # one group per record, numbered in order of its first sample
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
    return keep[~held_group[group]], keep[held_group[group]]


def _subset(data: TokenizedData, idx) -> JsonlDataset:
    return JsonlDataset(data.ids.take(idx), data.masks.take(idx), Column(data.lines.values[idx]))  # views


def load_jsonl_splits(cfg: JsonlDataConfig, tokenizer_path: str, log=print):
    """(train JsonlDataset, eval JsonlDataset or None, report dict) -- all checks before
    training: file, chat template, malformed lines, over-long records. The held-out split is
    ``data.eval_fraction`` of ``data.path``'s records, or the records of ``data.eval_path``."""
    from megatron_fastpath.hf.tokenizer import ChatTokenizer

    tok_dir = cfg.tokenizer_path or tokenizer_path
    tokenizer = ChatTokenizer(tok_dir)
    data = load_tokenized(cfg, tokenizer, tok_dir, log=log)
    data, keep, too_long, truncated = _usable(cfg, data, log)
    if cfg.eval_path is None:
        train_idx, eval_idx = _hold_out(cfg, data, keep)
        train, held = _subset(data, train_idx), _subset(data, eval_idx)
        extra = dict(eval_records=len(eval_idx))
    else:  # all of data.path trains; the held-out records are data.eval_path's
        ecfg = dataclasses.replace(cfg, path=cfg.eval_path, eval_path=None, eval_fraction=0.0)
        edata = load_tokenized(ecfg, tokenizer, tok_dir, log=log)
        edata, ekeep, etoo_long, etruncated = _usable(ecfg, edata, log, key="data.eval_path")
        train, held = _subset(data, keep), _subset(edata, ekeep)
        emal, elong = _split_too_long(edata.malformed)
        extra = dict(eval_records=len(ekeep), eval_path_records=len(edata.ids) - edata.split_for_template
                     + len(edata.malformed), eval_path_malformed=len(emal),
                     eval_path_too_long=len(elong) + len(etoo_long),
                     eval_path_bad_records=bad_record_counts(edata, etoo_long),
                     eval_path_truncated=etruncated)
    # records: the data's records; train_records / eval_records: the samples of each split
    # (split_for_template more than records when conversations were split per assistant turn)
    split = data.split_for_template
    malformed, longest = _split_too_long(data.malformed)
    report = dict(records=len(data.ids) - split + len(data.malformed), malformed=len(malformed),
                  too_long=len(longest) + len(too_long), bad_records=bad_record_counts(data, too_long),
                  truncated=truncated, split_for_template=split, train_records=len(train), **extra)
    return train, (held if len(held) else None), report
