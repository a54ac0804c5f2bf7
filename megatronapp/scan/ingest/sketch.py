"""Bounded samples: what the streaming detector keeps of each rank, op name,
rank pair and channel, whatever the number of events it is fed.

A ``Reservoir`` keeps every value until it holds ``capacity``, then keeps
every 2nd of them and from then on every 2nd value it is given (then every
4th, ...): a deterministic, evenly spread sample of the whole stream, exact
while the stream is short (so a run that fits keeps every value, and the
detector's answers are those of the whole trace)."""
from __future__ import annotations

from typing import Hashable, Iterator, Mapping, TypeVar

import numpy as np

DEFAULT_CAPACITY = 1024  # values kept per key: medians and 5% quantiles stay stable
K = TypeVar("K", bound=Hashable)


class Reservoir:
    """An evenly thinned sample of a stream of floats, at most ``capacity`` long."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self.stride = 1  # keep one value in ``stride``
        self.seen = 0  # values given so far
        self._parts: list[np.ndarray] = []
        self._kept = 0

    def add(self, values: np.ndarray) -> None:
        values = np.asarray(values, float)
        first = (-self.seen) % self.stride  # index of the next value on the stride
        self.seen += len(values)
        kept = values[first::self.stride]
        self._parts.append(kept)
        self._kept += len(kept)
        while self._kept > self.capacity:
            self._thin()

    def _thin(self) -> None:
        whole = self.values[::2]
        self._parts, self._kept = [whole], len(whole)
        self.stride *= 2

    @property
    def values(self) -> np.ndarray:
        if len(self._parts) != 1:
            self._parts = [np.concatenate(self._parts) if self._parts else np.zeros(0)]
        return self._parts[0]

    def __len__(self) -> int:
        return self._kept


class Reservoirs(Mapping[K, np.ndarray]):
    """key -> ``Reservoir`` of its values, read as key -> values kept."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._by_key: dict[K, Reservoir] = {}

    def add(self, key: K, values: np.ndarray) -> None:
        if key not in self._by_key:
            self._by_key[key] = Reservoir(self.capacity)
        self._by_key[key].add(values)

    def add_all(self, samples: Mapping[K, np.ndarray]) -> None:
        for key, values in samples.items():
            self.add(key, values)

    def __getitem__(self, key: K) -> np.ndarray:
        return self._by_key[key].values

    def __iter__(self) -> Iterator[K]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)

    def seen(self, key: K) -> int:
        """Values given for ``key`` (kept or thinned out; 0 for a key never given)."""
        return self._by_key[key].seen if key in self._by_key else 0

    def entries(self) -> int:
        """Values held over every key (what the state's size is counted in)."""
        return sum(len(r) for r in self._by_key.values())
