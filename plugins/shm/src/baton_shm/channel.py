"""What both ends of an shm channel share: the recv loop, waiting inside a ring, close().

A reader that finds its rings empty polls them for a while (the adaptive spin),
then arms them ("wake me at the next message"), re-checks, and sleeps in
``poll`` on its FIFOs, the channel's close pipe and the peers' pidfds.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from baton.errors import TransportError
from baton.interfaces import Frame
from baton.transport.closing import release_when_idle
from baton.transport.peer import PeerWatch
from baton_shm.plugin import ShmSettings
from baton_shm.ring import RingReader
from baton_shm.segment import Segment, unlink_files
from baton_shm.sleeper import Sleeper

#: A wait up to this many spin windows counts as short: spinning might have caught it.
_SHORT_WAIT = 2.0
#: Most short waits between two tries of spinning, once tries keep failing.
_MAX_BACKOFF = 1024


def _release(
    rings: list, segments: list[Segment], fds: list[int], watches: dict, names: list[str]
) -> None:
    """Free everything a channel holds; runs once (close(), GC or interpreter exit)."""
    for ring in rings:
        ring.release()
    for seg in segments:
        seg.close()
    for fd in fds:
        os.close(fd)
    for watch in watches.values():
        watch.close()
    for name in names:  # engines that never attached leave their files to us
        unlink_files(name)


class Channel:
    """Both ends: the recv loop, waiting on a ring, peers, close(). Subclasses set the rings up."""

    _what = "shm"
    #: rings recv reads (the client: every output ring; an engine: its input ring)
    _readers: list[RingReader]
    #: key -> why that peer is gone (the client: engine index; an engine: 0, the frontend)
    _gone: dict[int, str]
    _take: Callable[[], list[Frame] | None]

    def _setup(self, settings: ShmSettings, segments: list[Segment], names: list[str]) -> None:
        self._settings = settings
        self._spin_max = settings.spin_us / 1e6
        self._spin = self._spin_max  # adapted: see _recv_wait
        self._backoff = 1  # short waits to sit out before trying to spin again
        self._probe_in = 0
        self._segments = segments
        self._close_r, self._close_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._recv_sleep = Sleeper(self._close_r)
        self._send_sleep = Sleeper(self._close_r)
        self._recv_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._watch_lock = threading.Lock()
        self._closed = False
        self._gone = {}
        self._rings: list[Any] = []
        self._watches: dict[int, PeerWatch] = {}
        fds = [self._close_r, self._close_w]
        self._finalizer = weakref.finalize(
            self, _release, self._rings, segments, fds, self._watches, names
        )

    # ------------------------------------------------------------------ recv

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self._what} channel is closed")

    def recv(self, timeout: float | None = None) -> list[Frame] | None:
        with self._recv_lock:
            self._check_open()
            msg = self._take()
            return msg if msg is not None else self._recv_wait(timeout)

    def _recv_wait(self, timeout: float | None) -> list[Frame] | None:
        """Spin a little, then sleep; see ``_adapt_spin`` for how long."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        spin_end = start + self._spin
        readers = self._readers
        slept = False
        while True:
            # a peer sets its closed flag after its last write: seeing the flag, we read on to the end
            self._note_closed()
            msg = self._take()
            if msg is not None:
                if self._spin_max:
                    self._adapt_spin(slept, time.monotonic() - start)
                return msg
            if self._gone:
                raise TransportError(next(iter(self._gone.values())))
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            if now < spin_end:
                continue
            self._watch_peers(self._recv_sleep)
            for r in readers:
                r.arm()
            # our flags before re-checking; the writer: its counter before reading our flag
            readers[0].fence()
            try:
                if any(r.ready() for r in readers) or self._peer_closed():
                    continue
                slept = True
                _, dead = self._recv_sleep.sleep(
                    None if deadline is None else deadline - now, self._what
                )
            finally:
                for r in readers:
                    r.disarm()
            for key in dead:
                self._peer_died(key)

    def _adapt_spin(self, slept: bool, waited: float) -> None:
        """Spin while spinning pays. A message caught while spinning: keep spinning. One that
        came soon after we gave up and slept: the spin failed, typically because the machine
        is busy and our spinning took the CPU the writer needed: stop, and try again only
        after a backoff (doubling with each failure) of short waits. Long waits (an idle
        link) say nothing either way."""
        if not slept:
            if self._spin:  # caught while spinning
                self._backoff = 1
            return
        if waited > _SHORT_WAIT * self._spin_max:
            return
        if self._spin:
            self._spin = 0.0
            self._backoff = min(2 * self._backoff, _MAX_BACKOFF)
            self._probe_in = self._backoff
        else:
            self._probe_in -= 1
            if self._probe_in <= 0:
                self._spin = self._spin_max

    # ------------------------------------------------------------------ waiting inside a ring

    def _block(self, key: int, sleeper: Sleeper, ring: Any) -> None:
        """A ring must wait (full, or a message half-written): sleep once, or raise if hopeless."""
        self._check_peer(key)
        self._watch_peers(sleeper)
        woken, dead = sleeper.sleep(self._settings.send_timeout, self._what)
        for k in dead:
            self._peer_died(k)
        self._check_peer(key)
        if not woken:
            raise TransportError(
                f"{self._what}: {self._peer_name(key)} made no progress for {self._settings.send_timeout}s "
                "while a ring was full or a message half-written ([transport.shm] send_timeout)"
            )

    # ------------------------------------------------------------------ peers (per side)

    def _note_closed(self) -> None: ...
    def _peer_closed(self) -> bool: ...
    def _watch_peers(self, sleeper: Sleeper) -> None: ...
    def _peer_name(self, key: int) -> str: ...
    def _check_peer(self, key: int) -> None: ...
    def _announce_close(self) -> None: ...

    def _peer_died(self, key: int) -> None:
        watch = self._watches.get(key)
        self._gone.setdefault(
            key, str(watch.error()) if watch else f"{self._peer_name(key)} exited"
        )

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Tell the peer, wake our own blocked threads, free the segments; idempotent, any thread."""
        if self._closed:
            return
        self._closed = True
        self._announce_close()
        with contextlib.suppress(BlockingIOError):
            os.write(self._close_w, b"\0")  # wakes our own blocked threads
        # unmapping while a thread is inside a ring would crash it: wait until none is
        locks = [(self._recv_lock, 5.0), (self._send_lock, self._settings.send_timeout + 5.0)]
        release_when_idle(locks, self._finalizer, self._what)
