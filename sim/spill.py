"""Arrays kept in a file rather than in the process's memory.

The compiled loop records a start and an end for every event it simulates:
16 B an event, 0.75 GB at 12,288 GPUs with nothing reduced, held from the
loop's start until the trace and the summary have been written. Those arrays
live in an unlinked temporary file mapped shared: the loop and the writers use
them as ordinary arrays, and ``release`` hands the pages they touched back to
the kernel (``MADV_DONTNEED``), which keeps them in its page cache or on disk.
A page touched again is read back from the file, so no value is lost, and what
the process holds at once is the pages touched since the last release.

Linux maps up to 16 pages around one that a *read* brings back (fault-around),
and only that page on a write. So the loop keeps an event's start and end side
by side (one page holds both) and writes one before it reads the other: a
compute's start before its priced duration, a delivered receive's end before
its start (``sim.kernel``). Otherwise every release would be followed by most
of the file mapped again.

The file is made under ``tempfile.gettempdir()`` (``TMPDIR``): on a disk there
the pages can leave memory; on a RAM file system (tmpfs) they stay in memory,
only no longer counted as the process's own.
"""
from __future__ import annotations

import mmap
import tempfile
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spilled:
    """Float64 zeros backed by a mapped file; ``values`` is writable."""

    values: np.ndarray
    _map: mmap.mmap

    def release(self) -> None:
        """Hand the resident pages back (their values stay in the file)."""
        self._map.madvise(mmap.MADV_DONTNEED)


def spilled_zeros(count: int) -> Spilled:
    """``count`` float64 zeros in an unlinked temporary file (gone with the mapping)."""
    size = max(count, 1) * 8
    with tempfile.TemporaryFile() as handle:  # the mapping outlives the handle
        handle.truncate(size)
        mapped = mmap.mmap(handle.fileno(), size)  # shared: writes reach the file
    mapped.madvise(mmap.MADV_RANDOM)  # no read-ahead of neighbours into memory
    return Spilled(np.frombuffer(mapped, np.float64, count), mapped)
