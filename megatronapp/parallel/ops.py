"""The operation vocabulary that rank programs yield and backends interpret.

A rank program is a generator: it yields one of these frozen dataclasses and is
resumed with the operation's result (a tensor, a handle, an index, or None).
Nothing here does I/O. Each operation class carries its ``kind`` (compute,
p2p or collective) as data; ``trace_args`` is the one definition of what a
backend records with it: ``meta`` (iteration, microbatch, chunk) plus the
kind, bytes, and the peer or group.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Generator, Hashable, Literal, Mapping, Union

Meta = Mapping[str, Any]
OpKind = Literal["compute", "p2p", "collective"]
P2PRole = Literal["send", "recv"]
OP_KINDS: tuple[OpKind, ...] = ("compute", "p2p", "collective")


@dataclass(frozen=True, slots=True, eq=False)
class Compute:
    """Local work of ``cost_s`` simulated seconds; ``run`` does it for real."""

    kind: ClassVar[OpKind] = "compute"

    name: str
    cost_s: float
    run: Callable[[], Any] | None = None
    meta: Meta = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class ISend:
    """Non-blocking send: resumes at once with a handle for Wait/WaitAny."""

    kind: ClassVar[OpKind] = "p2p"
    role: ClassVar[P2PRole] = "send"

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

    kind: ClassVar[OpKind] = "p2p"
    role: ClassVar[P2PRole] = "recv"

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
    issue the same sequence of collectives on a group. ``nbytes`` is the whole
    buffer. With ``async_op`` it resumes at once with a handle for Wait."""

    kind: ClassVar[OpKind] = "collective"

    group: tuple[int, ...]
    nbytes: int
    tensor: Any = None
    name: str = "allreduce"
    meta: Meta = field(default_factory=dict)
    async_op: bool = False


@dataclass(frozen=True, slots=True)
class Report:
    """What a Compute's ``run`` may return to add values to its trace event
    (the optimizer step reports the loss and the gradient norm)."""

    values: Mapping[str, float]


@dataclass(frozen=True, slots=True, eq=False)
class ReduceScatter(AllReduce):
    """Sum over ``group``; member i keeps the i-th of n equal shares of the
    ``nbytes`` buffer (in place: the other shares are left as they were)."""


@dataclass(frozen=True, slots=True, eq=False)
class AllGather(AllReduce):
    """Member i contributes the i-th share of the ``nbytes`` buffer; every
    member ends with all shares (in place)."""


Op = Union[Compute, Send, Recv, ISend, IRecv, Wait, WaitAny, AllReduce, ReduceScatter, AllGather]
RankProgram = Generator[Op, Any, None]


def encode_tag(tag: Hashable) -> int:
    """A process-independent non-negative int for a tag (backends needing ints)."""
    return zlib.crc32(repr(tag).encode()) & 0x7FFFFFFF


def trace_args(op: Compute | ISend | IRecv | AllReduce, nbytes: int | None = None,
               result: Any = None) -> dict[str, Any]:
    """What a backend records with ``op``'s event: its meta, its kind and, for
    communication, bytes (``nbytes`` when the backend knows the real size)
    and the group, or the peer, the role (send | recv) and the encoded tag
    that pairs a send with its receive; a compute adds what its ``result``
    reports (a ``Report``)."""
    args: dict[str, Any] = {**op.meta, "kind": op.kind}
    if isinstance(op, Compute):
        if isinstance(result, Report):
            args.update(result.values)
        return args
    args["bytes"] = op.nbytes if nbytes is None else nbytes
    if isinstance(op, AllReduce):
        args["group"] = list(op.group)
    else:
        args.update(peer=op.dst if isinstance(op, ISend) else op.src, role=op.role,
                    tag=encode_tag(op.tag))
    return args


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
