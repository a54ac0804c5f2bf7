"""Dependency reconstruction: which events on different ranks are one sync op.

Collectives are matched by group and by sequence number within that group (the
n-th call a rank makes on a group is the n-th call of every member, as in
NCCL). Point-to-point transfers are matched per (sender, receiver, stream) in
(iteration, microbatch) order, falling back to issue order; the stream is the
recorded tag (``kinds.p2p_side``). Every linked event gets ``related_sync_op``
(the op's id) in its args.
"""
from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal

from megatronapp.trace.kinds import Stream, event_kind, p2p_side
from megatronapp.trace.events import Event

from megatronapp.scan.ingest.load import RankEvents

Member = tuple[int, int]  # (rank, index into that rank's event list)


@dataclass(frozen=True)
class SyncOp:
    """One synchronous communication; p2p members are (sender, receiver)."""

    op_id: str
    kind: Literal["collective", "p2p"]
    name: str
    members: tuple[Member, ...]
    nbytes: float

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.members)


def _group_of(e: Event) -> tuple[int, ...] | None:
    group = e.args.get("group")
    if (event_kind(e.name, e.args) == "collective" and isinstance(group, (list, tuple))
            and len(group) > 0):
        return tuple(sorted(int(g) for g in group))
    return None


def _collectives(events: RankEvents) -> list[SyncOp]:
    instances: dict[tuple[tuple[int, ...], int], list[Member]] = defaultdict(list)
    names: dict[tuple[tuple[int, ...], int], tuple[str, float]] = {}
    for rank in sorted(events):
        seq: dict[tuple[int, ...], int] = defaultdict(int)
        for index, e in enumerate(events[rank]):
            group = _group_of(e)
            if group is None:
                continue
            key = (group, seq[group])
            seq[group] += 1
            instances[key].append((rank, index))
            names.setdefault(key, (e.name, float(e.args.get("bytes", 0) or 0)))
    ops = []
    for (group, n), members in instances.items():
        name, nbytes = names[(group, n)]
        gid = ",".join(map(str, group)) if len(group) <= 8 else (
            f"{group[0]}..{group[-1]}/{len(group)}:{zlib.crc32(repr(group).encode()):08x}")
        ops.append(SyncOp(f"coll[{gid}]#{n}", "collective", name, tuple(members), nbytes))
    return ops


def _p2p_sort_key(e: Event, issue: int) -> tuple[Any, ...]:
    it, mb = e.args.get("iteration"), e.args.get("microbatch")
    return (it if isinstance(it, int) else -1, mb if isinstance(mb, int) else -1, issue)


def _p2p(events: RankEvents) -> list[SyncOp]:
    sides: dict[tuple[str, int, int, Stream], list[tuple[tuple[Any, ...], Member]]] = (
        defaultdict(list))
    for rank, rank_events in events.items():
        for index, e in enumerate(rank_events):
            side = p2p_side(e.name, e.args)
            if side is None:
                continue
            role, stream = side
            peer = int(e.args["peer"])
            src, dst = (rank, peer) if role == "send" else (peer, rank)
            sides[(role, src, dst, stream)].append((_p2p_sort_key(e, index), (rank, index)))
    ops = []
    for (kind, src, dst, stream), sends in sides.items():
        if kind != "send":
            continue
        recvs = sorted(sides.get(("recv", src, dst, stream), []))
        for n, ((_, send), (_, recv)) in enumerate(zip(sorted(sends), recvs)):
            e = events[send[0]][send[1]]
            ops.append(SyncOp(f"p2p[{src}->{dst}:{stream[1]}]#{n}", "p2p", e.name,
                              (send, recv), float(e.args.get("bytes", 0) or 0)))
    return ops


def reconstruct(events: RankEvents) -> list[SyncOp]:
    """All collective and point-to-point sync ops found in the trace."""
    return _collectives(events) + _p2p(events)


def annotate(events: RankEvents, ops: list[SyncOp]) -> RankEvents:
    """A copy of ``events`` with ``related_sync_op`` in each linked event's args."""
    op_of: dict[Member, str] = {m: op.op_id for op in ops for m in op.members}
    out: RankEvents = {}
    for rank, rank_events in events.items():
        out[rank] = [Event(e.name, e.start_s, e.dur_s, {**e.args, "related_sync_op": op_of[(rank, i)]})
                     if (rank, i) in op_of else e for i, e in enumerate(rank_events)]
    return out
