"""The operation vocabulary that rank programs yield and backends interpret.

A rank program is a generator: it yields one of these frozen dataclasses and is
resumed with the operation's result (a tensor, a handle, an index, or None).
Nothing here does I/O. ``meta`` carries trace arguments (iteration,
microbatch, chunk); the backend adds bytes, peer and group when it records.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Hashable, Mapping, Union

Meta = Mapping[str, Any]


@dataclass(frozen=True, slots=True, eq=False)
class Compute:
    """Local work of ``cost_s`` simulated seconds; ``run`` does it for real."""

    name: str
    cost_s: float
    run: Callable[[], Any] | None = None
    meta: Meta = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class ISend:
    """Non-blocking send: resumes at once with a handle for Wait/WaitAny."""

    dst: int
    tag: Hashable
    nbytes: int
    tensor: Any = None
    name: str = "send"
    meta: Meta = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class Send(ISend):
    """Blocking send: resumes once the data has been delivered."""


@dataclass(frozen=True, slots=True, eq=False)
class IRecv:
    """Non-blocking receive: resumes at once with a handle; Wait gives the tensor."""

    src: int
    tag: Hashable
    nbytes: int
    like: Any = None
    name: str = "recv"
    meta: Meta = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class Recv(IRecv):
    """Blocking receive: resumes with the tensor (a placeholder in simulation)."""


@dataclass(frozen=True, slots=True, eq=False)
class Wait:
    """Block until ``handle`` completes; resumes with its result."""

    handle: Any


@dataclass(frozen=True, slots=True, eq=False)
class WaitAny:
    """Block until one of ``handles`` completes; resumes with its index
    (the lowest index among those already complete)."""

    handles: tuple[Any, ...]


@dataclass(frozen=True, slots=True, eq=False)
class AllReduce:
    """Sum-all-reduce over ``group`` (global ranks, sorted); every member must
    issue the same sequence of collectives on a group."""

    group: tuple[int, ...]
    nbytes: int
    tensor: Any = None
    name: str = "allreduce"
    meta: Meta = field(default_factory=dict)


Op = Union[Compute, Send, Recv, ISend, IRecv, Wait, WaitAny, AllReduce]
RankProgram = Generator[Op, Any, None]
P2P_OPS = (Send, Recv, ISend, IRecv)


def encode_tag(tag: Hashable) -> int:
    """A process-independent non-negative int for a tag (backends needing ints)."""
    return zlib.crc32(repr(tag).encode()) & 0x7FFFFFFF


def describe(op: Op | None) -> str:
    """A one-line description of an operation (deadlock and stall reports)."""
    if op is None:
        return "start"
    name = type(op).__name__
    for attr in ("dst", "src"):
        if hasattr(op, attr):
            return f"{name}({attr}={getattr(op, attr)}, tag={op.tag})"  # type: ignore[union-attr]
    if isinstance(op, AllReduce):
        return f"{name}(group={list(op.group)})"
    return name
