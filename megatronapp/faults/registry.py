"""The fault kinds by name: one registration per kind module, and the parsing
of a scenario's ``faults:`` list through them (one line naming the field)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, get_args

from pydantic import ValidationError

from ..io.schema import ScenarioError, validation_error
from ..io.suggest import hint
from .protocol import FaultSpec

__all__ = ["KINDS", "kind_names", "parse_fault", "parse_faults", "register", "registered"]

KINDS: dict[str, type[FaultSpec]] = {}


def _kind_of(cls: type[FaultSpec]) -> str:
    names = get_args(cls.model_fields["kind"].annotation)
    if len(names) != 1 or not isinstance(names[0], str):
        raise TypeError(f"{cls.__name__}.kind must be Literal['<one name>']")
    return names[0]


def register(cls: type[FaultSpec]) -> type[FaultSpec]:
    """Make ``cls`` the schema (and everything else) of its kind."""
    KINDS[_kind_of(cls)] = cls
    return cls


@contextmanager
def registered(cls: type[FaultSpec]) -> Iterator[type[FaultSpec]]:
    """``cls`` registered for the duration (a kind tried out, then gone)."""
    kind = _kind_of(cls)
    before = KINDS.get(kind)
    register(cls)
    try:
        yield cls
    finally:
        if before is None:
            KINDS.pop(kind, None)
        else:
            KINDS[kind] = before


def kind_names() -> tuple[str, ...]:
    return tuple(KINDS)


def parse_fault(item: Any, where: str) -> FaultSpec:
    """One entry of ``faults:`` as its kind's model."""
    if isinstance(item, FaultSpec):
        return item
    if not isinstance(item, dict):
        raise ScenarioError(where, f"must be a mapping with a kind (kinds: {', '.join(KINDS)})")
    kind = item.get("kind")
    if kind not in KINDS:
        what = "missing" if kind is None else f"unknown fault kind {kind!r}"
        raise ScenarioError(f"{where}.kind", f"{what}; {hint(str(kind), KINDS, 'kinds')}")
    cls = KINDS[kind]
    try:
        return cls.model_validate(item)
    except ValidationError as err:
        raise validation_error(err, cls, prefix=where) from None


def parse_faults(value: Any) -> Any:
    """The ``faults:`` list, each entry validated by its kind (anything but a
    list is left for the schema to refuse)."""
    if not isinstance(value, (list, tuple)):
        return value
    return tuple(parse_fault(item, f"faults[{i}]") for i, item in enumerate(value))
