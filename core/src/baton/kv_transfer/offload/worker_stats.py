"""A worker half's transfer figures, added to from the step's thread and the background ones."""

from __future__ import annotations

import threading

from baton.kv_transfer.types import KVTransferStats


class WorkerStats:
    """Thread-safe deltas since ``take``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVTransferStats()

    def add_load(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._stats.load_bytes += nbytes
            self._stats.load_seconds += seconds

    def add_save(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._stats.save_bytes += nbytes
            self._stats.save_seconds += seconds

    def add_failed_load(self) -> None:
        with self._lock:
            self._stats.failed_loads += 1

    def take(self, tier_bytes: dict[str, int], tier_capacity: dict[str, int]) -> KVTransferStats:
        """The deltas since last taken, with the tiers' levels now."""
        with self._lock:
            out, self._stats = self._stats, KVTransferStats()
        out.tier_bytes = tier_bytes
        out.tier_capacity_bytes = tier_capacity
        return out
