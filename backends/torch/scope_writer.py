"""MegaScope's host side on the torch backend: records leave the training step
through a bounded queue and are written by a background thread.

A *batch* is what one task captured (its records and raw slices). On CPU the
batch's tensors are already host tensors; on GPU ``DeviceBatch.to_host``
starts non-blocking copies into pinned memory behind a CUDA event, and only
the writer thread waits for that event: nothing on the training thread
synchronises with the device. When the writer falls behind, the queue drops
its *oldest* batch and counts the records lost; the capture's manifest and
the run's summary report them.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatronapp.scope.storage import HostRecord, PartWriter, RawSlice, RecordKey, Rows


@dataclass
class DeviceRecord:
    """A record whose partial statistics may still live on the device."""

    key: RecordKey
    rows: Rows
    stats: tuple[str, ...]
    widths: tuple[int, ...]
    partial: torch.Tensor
    shard: int = 0
    nshards: int = 1

    def host(self) -> HostRecord:
        return HostRecord(self.key, self.rows, self.stats, self.widths,
                          self.partial.numpy(), self.shard, self.nshards)


@dataclass
class DeviceRaw:
    """A raw slice (``keep_raw``) with its meaning; ``tensor`` a detached copy."""

    key: RecordKey
    tensor: torch.Tensor
    dims: tuple[str, ...]
    tokens: list[int]
    heads: list[int] | None
    split: str
    shard: int = 0
    nshards: int = 1

    def host(self) -> RawSlice:
        return RawSlice(self.key, self.tensor.numpy(), self.dims, self.tokens, self.heads,
                        self.split, self.shard, self.nshards)


@dataclass
class DeviceBatch:
    records: list[DeviceRecord] = field(default_factory=list)
    raws: list[DeviceRaw] = field(default_factory=list)
    ready: Any = None  # a CUDA event the host copies wait behind; None on CPU

    def to_host(self) -> "DeviceBatch":
        """Start the device-to-host copies (non-blocking, pinned) behind one event."""
        if not any(t.is_cuda for t in self._tensors()):
            return self
        for r in self.records:
            r.partial = _pinned_copy(r.partial)
        for raw in self.raws:
            raw.tensor = _pinned_copy(raw.tensor)
        self.ready = torch.cuda.Event()
        self.ready.record()
        return self

    def _tensors(self) -> list[torch.Tensor]:
        return [r.partial for r in self.records] + [r.tensor for r in self.raws]

    def __len__(self) -> int:
        return len(self.records)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class DropOldestQueue:
    """A bounded queue of batches: a put into a full queue evicts the oldest."""

    def __init__(self, maxsize: int):
        self._items: deque[DeviceBatch] = deque()
        self._maxsize = maxsize
        self._cond = threading.Condition()
        self._closed = False
        self.dropped_records = 0
        self.dropped_batches = 0

    def put(self, batch: DeviceBatch) -> None:
        with self._cond:
            if len(self._items) >= self._maxsize:
                lost = self._items.popleft()
                self.dropped_records += len(lost)
                self.dropped_batches += 1
            self._items.append(batch)
            self._cond.notify()

    def take_all(self) -> list[DeviceBatch] | None:
        """Every queued batch (waiting for one); None once closed and empty."""
        with self._cond:
            while not self._items and not self._closed:
                self._cond.wait()
            if not self._items:
                return None
            items = list(self._items)
            self._items.clear()
            return items

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def write_batches(writer: PartWriter, batches: list[DeviceBatch]) -> None:
    for b in batches:
        if b.ready is not None:
            b.ready.synchronize()  # on the writer thread, never the training thread
    writer.write([r.host() for b in batches for r in b.records],
                 [raw.host() for b in batches for raw in b.raws])


class AsyncWriter:
    """One rank's writer thread behind a ``DropOldestQueue``."""

    def __init__(self, writer: PartWriter, maxsize: int,
                 on_write: Callable[[list[DeviceBatch]], None] | None = None):
        import pyarrow

        pyarrow.set_cpu_count(1)  # the writer is one background thread, not a pool per core
        self.writer = writer
        self.queue = DropOldestQueue(maxsize)
        self.error: BaseException | None = None
        self._on_write = on_write
        self._thread = threading.Thread(target=self._run, name="megascope-writer", daemon=True)
        self._thread.start()

    def submit(self, batch: DeviceBatch) -> None:
        if self.error is not None:
            raise RuntimeError("the MegaScope writer failed") from self.error
        self.queue.put(batch.to_host())

    def _run(self) -> None:
        try:
            while (batches := self.queue.take_all()) is not None:
                write_batches(self.writer, batches)
                if self._on_write is not None:
                    self._on_write(batches)
        except BaseException as err:  # surfaced on the next submit or at close
            self.error = err

    def close(self, injections: list[dict[str, Any]], notes: list[str], **counters: int) -> None:
        self.queue.close()
        self._thread.join()
        if self.error is not None:
            raise RuntimeError("the MegaScope writer failed") from self.error
        self.writer.write_injections(injections)
        self.writer.close(self.queue.dropped_records, notes, **counters)


class SyncWriter:
    """Writes each batch at once (generation: one forward per step, no training
    step to protect) and keeps the last batch for the caller."""

    def __init__(self, writer: PartWriter | None):
        self.writer = writer
        self.last: list[HostRecord] = []
        self.last_raw: list[RawSlice] = []

    def submit(self, batch: DeviceBatch) -> None:
        batch = batch.to_host()
        if batch.ready is not None:
            batch.ready.synchronize()
        self.last = [r.host() for r in batch.records]
        self.last_raw = [r.host() for r in batch.raws]
        if self.writer is not None:
            self.writer.write(self.last, self.last_raw)

    def close(self, injections: list[dict[str, Any]], notes: list[str], **counters: int) -> None:
        if self.writer is not None:
            self.writer.write_injections(injections)
            self.writer.close(0, notes, **counters)

