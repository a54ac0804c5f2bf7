"""Perfetto's native protobuf trace, written from event columns.

The file is a ``perfetto.protos.Trace``: TrackDescriptor packets (a process
per rank, a thread per kind of work) and TrackEvent slice begin/end packets,
nanosecond timestamps, one packet sequence per rank. Perfetto slices on one
track must nest, while a rank's point-to-point operations overlap freely, so
overlapping events of one kind go to extra threads (``p2p #2`` ...). Field
numbers follow perfetto/protos/perfetto/trace/{trace,trace_packet}.proto and
track_event/*.proto; the encoder is the few lines of wire format they need.
"""
from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from .columns import INT_FIELDS, KINDS, ROLES, EventColumns, whole_ranks
from .events import LANES

SLICE_BEGIN, SLICE_END = 1, 2
# field numbers
TRACE_PACKET = 1
PACKET_TIMESTAMP, PACKET_SEQUENCE, PACKET_TRACK_EVENT, PACKET_TRACK_DESCRIPTOR = 8, 10, 11, 60
EVENT_TYPE, EVENT_TRACK, EVENT_NAME, EVENT_ANNOTATIONS = 9, 11, 23, 4
TRACK_UUID, TRACK_PARENT, TRACK_PROCESS, TRACK_THREAD = 1, 5, 3, 4
PROCESS_PID, PROCESS_NAME = 1, 6
THREAD_PID, THREAD_TID, THREAD_NAME = 1, 2, 5
ANNOTATION_NAME, ANNOTATION_INT, ANNOTATION_STRING = 10, 4, 6


# ------------------------------------------------------------- wire format
def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 as two's complement, like protobuf
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _bytes(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _text(field: int, text: str) -> bytes:
    return _bytes(field, text.encode())


def _packet(body: bytes) -> bytes:
    return _bytes(TRACE_PACKET, body)


# ------------------------------------------------------------------ tracks
def _process_uuid(rank: int) -> int:
    return (rank + 1) << 16


def _thread_uuid(rank: int, lane: int, sub: int) -> int:
    return _process_uuid(rank) + 1 + lane * 1024 + sub


def _process_track(rank: int, label: str) -> bytes:
    process = _int(PROCESS_PID, rank) + _text(PROCESS_NAME, label)
    return _packet(_bytes(PACKET_TRACK_DESCRIPTOR, _int(TRACK_UUID, _process_uuid(rank))
                          + _bytes(TRACK_PROCESS, process)))


def _thread_track(rank: int, lane: int, sub: int, name: str) -> bytes:
    thread = (_int(THREAD_PID, rank) + _int(THREAD_TID, rank * 4096 + lane * 1024 + sub)
              + _text(THREAD_NAME, name if sub == 0 else f"{name} #{sub + 1}"))
    return _packet(_bytes(PACKET_TRACK_DESCRIPTOR,
                          _int(TRACK_UUID, _thread_uuid(rank, lane, sub))
                          + _int(TRACK_PARENT, _process_uuid(rank))
                          + _bytes(TRACK_THREAD, thread)))


def _annotations(cols: EventColumns, i: int) -> bytes:
    out = b""
    for name in INT_FIELDS + ("nbytes", "peer", "tag"):
        value = int(getattr(cols, name)[i])
        if value >= 0:
            key = "bytes" if name == "nbytes" else name
            out += _bytes(EVENT_ANNOTATIONS, _text(ANNOTATION_NAME, key)
                          + _int(ANNOTATION_INT, value))
    if cols.role[i] >= 0:
        out += _bytes(EVENT_ANNOTATIONS, _text(ANNOTATION_NAME, "role")
                      + _text(ANNOTATION_STRING, ROLES[cols.role[i]]))
    if cols.group[i] >= 0:
        group = json.dumps(list(cols.groups[cols.group[i]]))
        out += _bytes(EVENT_ANNOTATIONS, _text(ANNOTATION_NAME, "group")
                      + _text(ANNOTATION_STRING, group))
    return out


def _slice(ts_ns: int, sequence: int, track: int, kind: int, name: str = "",
           annotations: bytes = b"") -> tuple[int, bytes]:
    event = _int(EVENT_TYPE, kind) + _int(EVENT_TRACK, track)
    if kind == SLICE_BEGIN:
        event += _text(EVENT_NAME, name) + annotations
    return ts_ns, _packet(_int(PACKET_TIMESTAMP, ts_ns) + _int(PACKET_SEQUENCE, sequence)
                          + _bytes(PACKET_TRACK_EVENT, event))


def _sub_lanes(start: np.ndarray, end: np.ndarray) -> list[int]:
    """Greedy: each event (by start) on the first sub-lane free by its start."""
    free: list[int] = []  # end time of the last slice per sub-lane
    out = []
    for s, e in zip(start.tolist(), end.tolist()):
        lane = next((k for k, busy_until in enumerate(free) if busy_until <= s), len(free))
        if lane == len(free):
            free.append(e)
        else:
            free[lane] = e
        out.append(lane)
    return out


def _rank_packets(cols: EventColumns, rows: np.ndarray, rank: int, label: str) -> Iterator[bytes]:
    """One rank's tracks and its slices, in time order."""
    yield _process_track(rank, label)
    start_ns = np.round(cols.start_s[rows] * 1e9).astype(np.int64)
    end_ns = start_ns + np.round(cols.dur_s[rows] * 1e9).astype(np.int64)
    lanes = [LANES.get(KINDS[k], 0) for k in cols.kind[rows].tolist()]
    per_track: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
    for lane in sorted(set(lanes)):
        mine = np.flatnonzero(np.array(lanes) == lane)
        order = mine[np.lexsort((end_ns[mine], start_ns[mine]))]
        subs = _sub_lanes(start_ns[order], end_ns[order])
        name = next(k for k, v in LANES.items() if v == lane)
        for sub in sorted(set(subs)):
            yield _thread_track(rank, lane, sub, name)
        for j, sub in zip(order.tolist(), subs):
            i = int(rows[j])
            track = _thread_uuid(rank, lane, sub)
            out = per_track.setdefault((lane, sub), [])
            out.append(_slice(int(start_ns[j]), rank + 1, track, SLICE_BEGIN,
                              cols.names[cols.name[i]], _annotations(cols, i)))
            out.append(_slice(int(end_ns[j]), rank + 1, track, SLICE_END))
    for _ts, packet in heapq.merge(*per_track.values(), key=lambda p: p[0]):
        yield packet


def write_perfetto(path: Path, batches: Iterable[EventColumns],
                   label: Callable[[int], str]) -> int:
    """Stream ``batches`` (rows grouped by rank) into a Perfetto trace; returns
    events (callers that replace a file write a temporary one)."""
    count = 0
    with open(path, "wb") as fh:
        for cols in whole_ranks(batches):
            for rank, (lo, hi) in cols.rank_bounds().items():
                for packet in _rank_packets(cols, np.arange(lo, hi), rank, label(rank)):
                    fh.write(packet)
            count += len(cols)
    return count
