"""Test-only: what the two feature matrices share (tests/train/feature_matrix/ for the
main job, tests/integrations/hook_feature_matrix/ for the hooks): the value of an axis
that does not apply, a combination -- a value per axis, in its matrix's axis order -- and the
pairwise cover the CI runs of a matrix's runnable combinations where the whole product is the
by-hand full tier."""

import dataclasses
import functools

NA = "-"  # the value of an axis that does not apply to a combination

# set (to a directory for the main job's records), both matrices' run tests train every job /
# distinct build, not the CI's pairwise covers: the by-hand full tier
FULL_ENV = "FASTPATH_FULL_MATRIX"


@dataclasses.dataclass(frozen=True)
class Combination:
    """One combination: ``values`` in the order of the subclass's :meth:`axes` (``NA`` where an
    axis does not apply)."""

    values: tuple

    @classmethod
    def axes(cls) -> tuple:
        raise NotImplementedError("a matrix's combination class names its axes")

    @classmethod
    def index(cls) -> dict:
        """{axis name: position in ``values``}."""
        return _index(cls)

    def __getitem__(self, name: str):
        return self.values[self.index()[name]]

    def items(self):
        return zip((a.name for a in self.axes()), self.values)


@functools.lru_cache(maxsize=None)
def _index(cls) -> dict:
    return {a.name: i for i, a in enumerate(cls.axes())}


def cell(text) -> str:
    """``text`` as one Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def axes_table(axes) -> list:
    """The generated listing's "Axes (read from the code)" section: a row per axis."""
    lines = ["## Axes (read from the code)", "", "| axis | values | from |", "| --- | --- | --- |"]
    return lines + [f"| {a.name} | {', '.join(map(str, a.values))} | {cell(a.source)} |" for a in axes]


def value_pairs(combo) -> set:
    """Every pair of ``(axis, value)`` items of ``combo``, in axis order."""
    items = list(combo.items())
    return {(a, b) for k, a in enumerate(items) for b in items[k + 1:]}


def pairwise_cover(combos: list) -> list:
    """A subset of ``combos`` (greedy, deterministic, none redundant) in which every pair of
    axis values that occurs together in some combination of ``combos`` occurs together in one
    of the subset."""
    pairs = value_pairs
    todo = set().union(*(pairs(c) for c in combos)) if combos else set()
    chosen, left = [], list(combos)
    while todo:
        best = max(left, key=lambda c: len(pairs(c) & todo))  # the first of the best: deterministic
        chosen.append(best)
        left.remove(best)
        todo -= pairs(best)
    # greedy picks can be made redundant by later ones: drop each (latest first) whose pairs
    # the others cover
    for c in list(reversed(chosen)):
        rest = [o for o in chosen if o is not c]
        if pairs(c) <= set().union(*map(pairs, rest)):
            chosen = rest
    return sorted(chosen, key=combos.index)
