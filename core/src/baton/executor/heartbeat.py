"""Heartbeats: each worker process writes the time to its slot; the executor finds the silent ones.

A worker beats from a thread of its own every ``INTERVAL`` seconds, which keeps
running while the main thread is inside a long step or a collective (torch
releases the GIL), so only a stopped or frozen process falls silent. The slots
are a shared-memory array of doubles without a lock: each has one writer.
The same thread exits the worker when its parent (the engine process) is gone.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from baton import processes

#: Seconds between two beats of a worker.
INTERVAL = 0.5


class Heartbeats:
    """One ``time.monotonic()`` slot per worker (0.0: not started yet). Pickles to spawned workers."""

    def __init__(self, num_workers: int) -> None:
        self.slots: Any = processes.context().RawArray("d", num_workers)

    def beat(self, rank: int) -> None:
        self.slots[rank] = time.monotonic()

    def silent(self, now: float, limit: float) -> list[tuple[int, float]]:
        """(rank, seconds since its last beat) of the started workers silent for over ``limit`` s."""
        return [(r, now - t) for r, t in enumerate(self.slots[:]) if t and now - t > limit]

    def start_beating(self, rank: int, parent_pid: int) -> threading.Thread:
        """In worker ``rank``: beat every INTERVAL s; exit the process once ``parent_pid`` is gone."""

        # started by a forkserver, the parent is the forkserver, which exits with its owner
        first_parent = os.getppid()

        def beat() -> None:
            while True:
                self.beat(rank)
                time.sleep(INTERVAL)
                if os.getppid() != first_parent or not processes.alive(parent_pid):
                    os._exit(3)  # re-parented, or the engine process is gone

        thread = threading.Thread(target=beat, name="baton-worker-heartbeat", daemon=True)
        thread.start()
        return thread
