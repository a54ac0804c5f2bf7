"""The base of every validated input section: strict pydantic models, sane
numeric bounds and the one-line error naming the field.

Everything that parses a part of a scenario (the scenario itself, each fault
kind's own schema) builds on these, so that a mistyped key, a YAML true/false
given for a number or an absurd value reads the same wherever it occurs.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Iterable, Union, get_args, get_origin

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError,
                      model_serializer, model_validator)

from ..errors import Recreatable
from .suggest import did_you_mean, hint, quoted_names

__all__ = ["MAX_COUNT", "MAX_DRIFT_PPM", "MAX_FACTOR", "MAX_OFFSET_US", "MAX_RATE", "MAX_SECONDS",
           "Factor", "NotANumber", "OmitsUnset", "PositiveInt", "Rank", "Rate", "ScenarioError",
           "Seconds",
           "StrictModel", "keys_at", "unbool", "validation_error"]


class ScenarioError(Recreatable, ValueError):
    """Bad scenario input, naming the offending field."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


# Sanity bounds: far beyond any real job, small enough that sums and products
# of them stay finite floats (what fits this machine is limits.py's business).
MAX_COUNT = 2**31 - 1  # ranks, microbatches, layers, sizes
MAX_SECONDS = 1e9  # durations and times (about 32 years)
MAX_RATE = 1e9  # TFLOPS, GB, Gbit/s
MAX_FACTOR = 1e6  # slowdowns and speedups (1/MAX_FACTOR), also combined
MAX_OFFSET_US = 1e12  # clock offset (about 11 days)
MAX_DRIFT_PPM = 1e5  # clock drift (10%)


def _mentions_bool(annotation: Any) -> bool:
    return annotation is bool or any(_mentions_bool(a) for a in get_args(annotation))


class NotANumber:
    """Stands in for a YAML true/false given where a number is expected, so that
    validation fails at that field (``iterations: true`` is a mistake, not 1)."""

    def __init__(self, value: bool):
        self.value = value

    def __repr__(self) -> str:
        return str(self.value).lower()


def unbool(value: Any) -> Any:
    if isinstance(value, bool):
        return NotANumber(value)
    if isinstance(value, list):
        return [NotANumber(v) if isinstance(v, bool) else v for v in value]
    return value


class StrictModel(BaseModel):
    """Unknown keys refused, values frozen, NaN and infinities refused, and no
    true/false where the field is not a flag."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v if k not in fields or _mentions_bool(fields[k].annotation) else unbool(v)
                for k, v in data.items()}


class OmitsUnset(StrictModel):
    """A section whose newer optional keys are left out of its dump while unset,
    so that a run's summary of a scenario without them stays as it was."""

    OMIT_WHEN_UNSET: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        for key in set(self.OMIT_WHEN_UNSET) - self._kept_when_unset():
            if isinstance(data, dict) and data.get(key) == type(self).model_fields[key].default:
                data.pop(key, None)
        return data

    def _kept_when_unset(self) -> set[str]:
        """Keys dumped even at their default (a named device would fill them again)."""
        return set()


PositiveInt = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Rank = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
Rate = Annotated[float, Field(ge=1 / MAX_RATE, le=MAX_RATE)]
Factor = Annotated[float, Field(ge=1 / MAX_FACTOR, le=MAX_FACTOR)]


# ------------------------------------------------------- one-line errors
def _step(node: Any, part: Any) -> Any:
    """The type one step down a location from ``node`` (a model, a container or
    a tagged union), or None where the path leaves what is modelled."""
    while get_origin(node) is Annotated:
        node = get_args(node)[0]
    if isinstance(node, type) and issubclass(node, BaseModel):
        field = node.model_fields.get(part) if isinstance(part, str) else None
        return field.annotation if field is not None else None
    members = [m for m in get_args(node) if m is not type(None)]
    if isinstance(part, int):  # tuple[X, ...], list[X]: the element type
        return members[0] if members else None
    for member in members:  # a tagged union: the member whose kind is ``part``
        kind = getattr(member, "model_fields", {}).get("kind")
        if kind is not None and part in get_args(kind.annotation):
            return member
    return _step(members[0], part) if len(members) == 1 else None


def keys_at(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys ``root`` accepts at ``loc`` (by the names a file uses)."""
    node: Any = root
    for part in loc:
        node = _step(node, part)
        if node is None:
            return []
    while get_origin(node) is Annotated or (get_origin(node) is Union and len(
            [m for m in get_args(node) if m is not type(None)]) == 1):
        node = [m for m in get_args(node) if m is not type(None)][0]
    if not (isinstance(node, type) and issubclass(node, BaseModel)):
        return []
    return [name for name, f in node.model_fields.items() if name != "kind"]


def _loc_text(loc: tuple[Any, ...], tags: Iterable[str]) -> str:
    skip = set(tags)
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in skip:  # a discriminator tag pydantic puts in the path
            out += ("." if out else "") + str(part)
    return out


def validation_error(err: ValidationError, root: type[BaseModel], prefix: str = "",
                     tags: Iterable[str] = (), what: str = "") -> ScenarioError:
    """The first problem of ``err`` (validating ``root`` at ``prefix``) as one
    line naming the field; a mistyped key usually causes the other errors (its
    field is then missing), so it is reported first. ``tags``: discriminator
    values of the tagged unions below ``root`` (``what`` they are kinds of)."""
    errors = err.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    ctx_error = first.get("ctx", {}).get("error")
    if isinstance(ctx_error, ScenarioError):
        return ctx_error
    loc = tuple(first["loc"])
    field = prefix + ("." if prefix and loc and not isinstance(loc[0], int) else "") + \
        _loc_text(loc, tags)
    field = field or "scenario"
    reason = first["msg"].removeprefix("Value error, ")
    if isinstance(first.get("input"), NotANumber):
        reason = f"true/false is not allowed here (got {first['input']!r})"
    if first["type"] == "extra_forbidden":
        keys = keys_at(root, loc[:-1])
        reason = f"unknown key; {hint(str(loc[-1]), keys, 'keys')}" if keys else "unknown key"
    elif first["type"] == "union_tag_invalid":
        tag = str(first.get("ctx", {}).get("tag", ""))
        kinds = quoted_names(str(first.get("ctx", {}).get("expected_tags", "")))
        reason = f"unknown {what} kind {tag!r}; {hint(tag, kinds, 'kinds')}"
        field = field + ".kind" if not field.endswith("kind") else field
    elif first["type"] == "literal_error" and isinstance(first.get("input"), str):
        reason += did_you_mean(first["input"], quoted_names(str(first["ctx"]["expected"])))
    return ScenarioError(field, reason)
