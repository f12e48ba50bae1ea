"""Test-only: what the two feature matrices share (tests/train/feature_matrix/ for the
main job, tests/integrations/hook_feature_matrix/ for the hooks): the value of an axis
that does not apply, and a combination -- a value per axis, in its matrix's axis order."""

import dataclasses
import functools

NA = "-"  # the value of an axis that does not apply to a combination


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
