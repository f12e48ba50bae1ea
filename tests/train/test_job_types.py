"""The built job's fields carry their real types: every field annotation of ``Job`` (and of the
parts it holds: ``StepParts``, the config ``JobConfig``, the data provider's ``DataParts``)
resolves -- the names imported under ``TYPE_CHECKING`` included -- to a type that is neither
``typing.Any`` nor ``object``; and the classes between the phases are frozen."""

import ast
import dataclasses
import inspect
import sys
import typing

import pytest

from megatron_fastpath.providers import DataParts
from megatron_fastpath.train.config import JobConfig
from megatron_fastpath.train.job import Job
from megatron_fastpath.train.step import StepParts

BUILT = (Job, StepParts, JobConfig, DataParts)


def type_checking_namespace(cls) -> dict:
    """The globals of ``cls``'s module plus what its ``if TYPE_CHECKING:`` blocks import."""
    module = sys.modules[cls.__module__]
    ns = dict(vars(module))
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            exec(compile(ast.Module(body=node.body, type_ignores=[]), module.__file__, "exec"), ns)
    return ns


def loose_parts(tp) -> list:
    """``Any`` / ``object`` anywhere in the resolved annotation ``tp`` (inside Optional, Union,
    tuple[...], Callable[...] too)."""
    if tp is typing.Any or tp is object:
        return [tp]
    return [p for arg in typing.get_args(tp) if not isinstance(arg, list) for p in loose_parts(arg)] + \
        [p for arg in typing.get_args(tp) if isinstance(arg, list) for a in arg for p in loose_parts(a)]


def loose_fields(cls) -> list[str]:
    hints = typing.get_type_hints(cls, globalns=type_checking_namespace(cls))
    return [f"{cls.__name__}.{f.name}: {hints[f.name]}" for f in dataclasses.fields(cls)
            if loose_parts(hints[f.name])]


@pytest.mark.parametrize("cls", BUILT, ids=lambda c: c.__name__)
def test_no_field_of_the_built_job_is_typed_any(cls):
    assert loose_fields(cls) == []


@pytest.mark.parametrize("cls", BUILT, ids=lambda c: c.__name__)
def test_the_classes_between_phases_are_frozen(cls):
    assert cls.__dataclass_params__.frozen


def test_the_check_sees_any_and_object_wherever_they_sit():
    @dataclasses.dataclass(frozen=True)
    class Loose:
        a: typing.Any
        b: typing.Optional[object]
        c: tuple[typing.Any, ...]
        d: typing.Callable[[typing.Any], int]
        e: typing.Optional[int] = None

    assert [f.split(":")[0] for f in loose_fields(Loose)] == ["Loose.a", "Loose.b", "Loose.c", "Loose.d"]


def test_the_resolved_types_are_the_job_s_pieces():
    from megatron.core.transformer import TransformerConfig

    from megatron_fastpath.packed_seq import PackedSeqCache
    from megatron_fastpath.train.evaluate import Evaluator

    hints = typing.get_type_hints(Job, globalns=type_checking_namespace(Job))
    assert hints["tcfg"] is TransformerConfig
    assert hints["cache"] is PackedSeqCache
    assert hints["evaluator"] == typing.Optional[Evaluator]
