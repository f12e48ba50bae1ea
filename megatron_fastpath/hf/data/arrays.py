"""Per-record values held in flat arrays (a million records cost a few arrays, not a million
Python objects): :class:`Ragged` ids / masks, :class:`Column` numbers, :class:`Wheres` places,
each read like a list; and :class:`TokenizedData`, the tokenized records in those arrays."""

from __future__ import annotations

import array
import collections.abc
import dataclasses

import numpy as np

__all__ = ["Ragged", "Column", "Wheres", "TokenizedData"]


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
    # the key sets of the records of no known format: ((keys as written), count), most common first
    # (tokenizing gives them; a cache, written only for data with usable records, does not)
    unknown_keys: tuple = ()
    # the format of each record that trains, as ((format name, records), ...) most common first
    # (data.format's names: messages, sharegpt, prompt_completion, alpaca, text)
    formats: tuple = ()

    @property
    def lengths(self) -> np.ndarray:
        return self.ids.lengths

    @property
    def split_for_template(self) -> int:
        """Samples beyond one per record: those of conversations split per assistant turn."""
        return len(self.lines) - len(np.unique(self.lines.values))
