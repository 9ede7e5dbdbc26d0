"""Receive buffers for big frames, reused once nothing holds them any more.

A fresh 16 MiB buffer per message costs page faults and the kernel zeroing its
pages, about half a copy again. So a reader takes its buffers from here: it
hands out ``memoryview(view)`` where ``view`` is a new ndarray over a pooled
buffer, and a weakref callback on ``view`` puts the buffer back when the last
thing built on it (the memoryview, a numpy array or torch tensor over it) is
gone. Nothing can reach a buffer then, so reusing it is safe.
"""

from __future__ import annotations

import functools
import threading
import weakref

import numpy as np

#: Free buffers kept per pool, in bytes; more are released to the allocator.
MAX_FREE_BYTES = 64 << 20


class BufferPool:
    def __init__(self, max_free_bytes: int = MAX_FREE_BYTES) -> None:
        self._max_free = max_free_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._free_bytes = 0
        # a weakref must live until its callback ran (keyed by id: an ndarray's ref is unhashable)
        self._pending: dict[int, weakref.ref] = {}
        self._lock = threading.RLock()  # callbacks run wherever the last reference drops

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes``: hand out ``memoryview(result)``."""
        with self._lock:
            free = self._free.get(nbytes)
            buf = free.pop() if free else None
            if buf is not None:
                self._free_bytes -= nbytes
        if buf is None:
            buf = np.empty(nbytes, np.uint8)
        view = buf[:]
        ref = weakref.ref(view, functools.partial(self._give_back, buf))
        self._pending[id(ref)] = ref
        return view

    def _give_back(self, buf: np.ndarray, ref: weakref.ref) -> None:
        with self._lock:
            self._pending.pop(id(ref), None)
            if self._free_bytes + buf.nbytes <= self._max_free:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._free_bytes += buf.nbytes

    def free_bytes(self) -> int:
        return self._free_bytes
