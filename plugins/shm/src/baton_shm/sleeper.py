"""Where a waiting thread of an shm channel sleeps: one ``poll`` over everything that can wake it."""

from __future__ import annotations

import contextlib
import os
import select

from baton.errors import TransportError
from baton.transport.peer import POLL_SLICE, PeerWatch


class Sleeper:
    """One thread's poll set: FIFOs to wake on, the channel's close pipe, peers' pidfds."""

    def __init__(self, close_fd: int) -> None:
        self._poll = select.poll()
        self._close_fd = close_fd
        self._poll.register(close_fd, select.POLLIN)
        self._fifos: set[int] = set()
        self._peers: dict[int, tuple[int, PeerWatch]] = {}  # fd -> (peer key, watch)
        self._polled: list[tuple[int, PeerWatch]] = []  # peers without a pidfd
        self._keys: set[int] = set()

    def add_fifo(self, fd: int) -> None:
        self._fifos.add(fd)
        self._poll.register(fd, select.POLLIN)

    def add_peer(self, key: int, watch: PeerWatch) -> None:
        if key in self._keys:
            return
        self._keys.add(key)
        fd = watch.fileno()
        if fd is None:
            self._polled.append((key, watch))
        else:
            self._peers[fd] = (key, watch)
            self._poll.register(fd, select.POLLIN)

    def sleep(self, seconds: float | None, what: str) -> tuple[bool, list[int]]:
        """Block until a FIFO byte, a peer's exit or ``seconds``; -> (woken, keys of dead peers)."""
        if self._polled:
            seconds = POLL_SLICE if seconds is None else min(seconds, POLL_SLICE)
        events = self._poll.poll(None if seconds is None else int(seconds * 1000) + 1)
        dead = [key for key, watch in self._polled if not watch.alive()]
        for fd, _ in events:
            if fd == self._close_fd:
                raise TransportError(f"{what} channel was closed while waiting")
            if fd in self._fifos:
                with contextlib.suppress(BlockingIOError):
                    while len(os.read(fd, 4096)) == 4096:
                        pass
            elif fd in self._peers:
                dead.append(self._peers.pop(fd)[0])
                self._poll.unregister(fd)
        return bool(events) or bool(dead), dead
