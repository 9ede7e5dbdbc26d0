"""The RAM tier's bookkeeping: an LRU map counted in bytes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUBytes(Generic[K, V]):
    """Entries with a size in bytes, least recently used first; never holds more than
    ``capacity_bytes``. The scheduler half keeps one without values (what the workers' RAM
    holds), each worker half one with the block payloads; both see the same operations in the
    same order, so both hold the same keys."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes}: must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(self._entries)

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` can be held at all."""
        return nbytes <= self.capacity_bytes

    def evictions_for(self, nbytes: int) -> list[K]:
        """The keys ``put`` of a new ``nbytes`` entry would evict (least recently used first)."""
        room = self.capacity_bytes - self.used_bytes
        out: list[K] = []
        for key, (_, size) in self._entries.items():
            if room >= nbytes:
                break
            out.append(key)
            room += size
        return out

    def put(self, key: K, value: V, nbytes: int) -> list[tuple[K, V]]:
        """Hold ``value`` as the most recently used entry, evicting the least recently used
        until it fits; returns what was evicted. An entry larger than the capacity is not held
        (returned as if evicted at once)."""
        if not self.fits(nbytes):
            return [(key, value)]
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= old[1]
        evicted = [(k, self.pop(k)) for k in self.evictions_for(nbytes)]
        self._entries[key] = (value, nbytes)
        self.used_bytes += nbytes
        return evicted  # type: ignore[return-value]  # keys in evictions_for are present

    def get(self, key: K) -> V | None:
        """The value (None: absent), now the most recently used."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def touch(self, key: K) -> bool:
        """Make ``key`` the most recently used; whether it is held."""
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def pop(self, key: K) -> V | None:
        """Drop ``key``; its value (None: absent)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.used_bytes -= entry[1]
        return entry[0]

    def clear(self) -> None:
        self._entries.clear()
        self.used_bytes = 0
