"""Transport ``shm``: per engine, an input ring and an output ring in one shared segment.

The frontend writes engine i's input ring and reads all output rings (``recv``
takes from them in turn); engine i reads its input ring and writes its output
ring. A side that finds its ring empty (or full) sets the ring's "waiting" flag
and sleeps in ``poll`` on the matching FIFO, the channel's close pipe and the
peer's pidfd; the other side writes one byte to the FIFO only when that flag is
set, so a busy stream costs no system calls. See ring.py and segment.py.

Peer death: each side knows the other's pid from the segment header (an engine
writes its own when it attaches). A peer that exits or closes its channel makes
``recv`` raise TransportError once what it wrote before is read; ``send`` to it
raises too. Writers wait on a full ring for at most ``send_timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import select
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baton.errors import TransportError
from baton.interfaces import Frame
from baton.transport.peer import POLL_SLICE, PeerWatch

from baton_shm.plugin import ShmSettings
from baton_shm.ring import READER_WAITING, WRITER_WAITING, RingReader, RingWriter, signal
from baton_shm.segment import (
    ENGINE_CLOSED,
    ENGINE_PID,
    FRONTEND_CLOSED,
    INPUT,
    OUTPUT,
    Segment,
    segment_name,
    unlink_files,
)


@dataclass(frozen=True)
class ShmAddress:
    """What an engine needs to attach (picklable): segment names in /dev/shm, one per engine."""

    segments: tuple[str, ...]
    frontend_pid: int


class _Sleeper:
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


def _release(
    rings: list, segments: list[Segment], fds: list[int], watches: list, names: list[str]
) -> None:
    """Free everything a channel holds; runs once (close(), GC or interpreter exit)."""
    for ring in rings:
        ring.release()
    for seg in segments:
        seg.close()
    for fd in fds:
        os.close(fd)
    for watch in watches:
        if watch is not None:
            watch.close()
    for name in names:  # engines that never attached leave their files to us
        unlink_files(name)


class _Channel:
    """What both ends share: locks, the close pipe, waiting on a ring, close()."""

    _what = "shm"

    def _setup(self, settings: ShmSettings, segments: list[Segment], names: list[str]) -> None:
        self._settings = settings
        self._segments = segments
        self._close_r, self._close_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._recv_sleep = _Sleeper(self._close_r)
        self._send_sleep = _Sleeper(self._close_r)
        self._recv_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._watch_lock = threading.Lock()
        self._closed = False
        self._rings: list[Any] = []
        self._watches: list[PeerWatch | None] = []
        self._finalizer = weakref.finalize(
            self,
            _release,
            self._rings,
            segments,
            [self._close_r, self._close_w],
            self._watches,
            names,
        )

    def _wait(self, ring: Any, flag: int, sleeper: _Sleeper, key: int, has_room) -> None:
        """Sleep until ``ring`` may have what we need, raising if the peer is gone or we time out."""
        self._check_peer(key)
        ring.ctl[flag] = 1
        ring.fence()  # the flag before re-checking (the other side: its counter, then our flag)
        try:
            if has_room():
                return
            woken, dead = sleeper.sleep(self._settings.send_timeout, self._what)
        finally:
            ring.ctl[flag] = 0
        for k in dead:
            self._peer_died(k)
        self._check_peer(key)
        if not woken:
            raise TransportError(
                f"{self._what}: the {self._peer_name(key)} made no progress for {self._settings.send_timeout}s "
                "while a ring was full or a message half-written ([transport.shm] send_timeout)"
            )

    def close(self) -> None:
        """Tell the peer, wake our own blocked threads, free the segments; idempotent, any thread."""
        if self._closed:
            return
        self._closed = True
        self._announce_close()
        with contextlib.suppress(BlockingIOError):
            os.write(self._close_w, b"\0")
        got_recv = self._recv_lock.acquire(timeout=5.0)
        got_send = self._send_lock.acquire(timeout=self._settings.send_timeout + 5.0)
        try:
            if got_recv and got_send:  # nobody is inside a ring: safe to unmap
                self._finalizer()
        finally:
            if got_recv:
                self._recv_lock.release()
            if got_send:
                self._send_lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self._what} channel is closed")


class ShmClientChannel(_Channel):
    """The frontend's end: writes engine i's input ring, reads every output ring."""

    _what = "shm client"

    def __init__(self, settings: ShmSettings, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.num_engines = num_engines
        token = secrets.token_hex(4)
        names = [segment_name(os.getpid(), token, i) for i in range(num_engines)]
        segments: list[Segment] = []
        try:
            for i, name in enumerate(names):
                segments.append(Segment.create(name, i, settings.slot_size, settings.slot_count))
        except BaseException:
            for seg in segments:
                seg.close()
            for name in names:
                unlink_files(name)
            raise
        self._setup(settings, segments, names)
        ss, sc = settings.slot_size, settings.slot_count
        self._writers = [
            RingWriter(
                *seg.ring_views(INPUT),
                ss,
                sc,
                seg.fifos["in_data"],
                functools.partial(self._wait_space, i),
            )
            for i, seg in enumerate(segments)
        ]
        self._readers = [
            RingReader(
                *seg.ring_views(OUTPUT),
                ss,
                sc,
                seg.fifos["out_space"],
                functools.partial(self._wait_more, i),
            )
            for i, seg in enumerate(segments)
        ]
        self._rings.extend(self._writers + self._readers)
        self._watches.extend([None] * num_engines)
        for seg in segments:
            self._recv_sleep.add_fifo(seg.fifos["out_data"])
            self._send_sleep.add_fifo(seg.fifos["in_space"])
        self._gone: dict[int, str] = {}
        self._next = 0
        self.address = ShmAddress(tuple(names), os.getpid())

    # ------------------------------------------------------------------ send

    def send(self, frames: Sequence[Frame], engine_index: int = 0) -> None:
        if not 0 <= engine_index < self.num_engines:
            raise ValueError(
                f"engine_index {engine_index} out of range (num_engines={self.num_engines})"
            )
        with self._send_lock:
            self._check_open()
            self._check_peer(engine_index)
            self._writers[engine_index].write(frames)

    def _wait_space(self, i: int, ring: RingWriter) -> None:
        self._watch_engine(i, self._send_sleep)
        self._wait(ring, WRITER_WAITING, self._send_sleep, i, lambda: ring.free_slots() > 0)

    # ------------------------------------------------------------------ recv

    def recv(self, timeout: float | None = None) -> list[Frame] | None:
        with self._recv_lock:
            self._check_open()
            deadline = None if timeout is None else time.monotonic() + timeout
            readers = self._readers
            while True:
                self._note_closed()  # before reading: what a closed engine wrote is read first
                msg = self._take()
                if msg is not None:
                    return msg
                if self._gone:
                    raise TransportError(next(iter(self._gone.values())))
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    return None
                for i in range(self.num_engines):
                    self._watch_engine(i, self._recv_sleep)
                    readers[i].ctl[READER_WAITING] = 1
                readers[0].fence()
                try:
                    if any(r.ready() for r in readers) or self._any_closed():
                        continue
                    _, dead = self._recv_sleep.sleep(wait, self._what)
                finally:
                    for r in readers:
                        r.ctl[READER_WAITING] = 0
                for i in dead:
                    self._peer_died(i)

    def _take(self) -> list[Frame] | None:
        readers = self._readers
        n = len(readers)
        for k in range(n):  # round robin: one busy engine cannot starve the others
            i = (self._next + k) % n
            msg = readers[i].read()
            if msg is not None:
                self._next = i + 1
                return msg
        return None

    def _wait_more(self, i: int, ring: RingReader) -> None:
        self._watch_engine(i, self._recv_sleep)
        self._wait(ring, READER_WAITING, self._recv_sleep, i, ring.ready)

    # ------------------------------------------------------------------ peers

    def _watch_engine(self, i: int, sleeper: _Sleeper) -> None:
        watch = self._watches[i]
        if watch is None:
            pid = self._segments[i].header[ENGINE_PID]
            if not pid:
                return  # not attached yet: nothing to watch
            with self._watch_lock:
                if self._watches[i] is None:
                    self._watches[i] = PeerWatch(pid, f"engine {i}")
                watch = self._watches[i]
        sleeper.add_peer(i, watch)

    def _any_closed(self) -> bool:
        return any(seg.header[ENGINE_CLOSED] for seg in self._segments)

    def _note_closed(self) -> None:
        for i, seg in enumerate(self._segments):
            if seg.header[ENGINE_CLOSED] and i not in self._gone:
                self._gone[i] = f"engine {i} closed its shm channel"

    def _peer_died(self, i: int) -> None:
        watch = self._watches[i]
        self._gone.setdefault(i, str(watch.error()) if watch else f"engine {i} exited")

    def _peer_name(self, i: int) -> str:
        return f"engine {i}"

    def _check_peer(self, i: int) -> None:
        if i in self._gone:
            raise TransportError(self._gone[i])
        if self._segments[i].header[ENGINE_CLOSED]:
            raise TransportError(f"engine {i} closed its shm channel")

    def _announce_close(self) -> None:
        for seg in self._segments:
            seg.header[FRONTEND_CLOSED] = 1
        self._writers[0].fence()
        for seg in self._segments:
            signal(seg.fifos["in_data"])
            signal(seg.fifos["out_space"])


class ShmEngineChannel(_Channel):
    """An engine's end: reads its input ring, writes its output ring."""

    def __init__(self, settings: ShmSettings, address: ShmAddress, engine_index: int) -> None:
        if not 0 <= engine_index < len(address.segments):
            raise ValueError(
                f"engine_index {engine_index} out of range (num_engines={len(address.segments)})"
            )
        self._what = f"shm engine {engine_index}"
        seg = Segment.attach(address.segments[engine_index], engine_index)
        # the segment's own geometry wins: the frontend made it
        self._setup(settings, [seg], [])
        self._seg = seg
        self._reader = RingReader(
            *seg.ring_views(INPUT),
            seg.slot_size,
            seg.slot_count,
            seg.fifos["in_space"],
            self._wait_more,
        )
        self._writer = RingWriter(
            *seg.ring_views(OUTPUT),
            seg.slot_size,
            seg.slot_count,
            seg.fifos["out_data"],
            self._wait_space,
        )
        self._rings.extend([self._reader, self._writer])
        watch = PeerWatch(address.frontend_pid, "the frontend")
        self._watches.append(watch)
        self._recv_sleep.add_fifo(seg.fifos["in_data"])
        self._recv_sleep.add_peer(0, watch)
        self._send_sleep.add_fifo(seg.fifos["out_space"])
        self._send_sleep.add_peer(0, watch)
        self._gone: str | None = None if watch.alive() else str(watch.error())

    def recv(self, timeout: float | None = None) -> list[Frame] | None:
        with self._recv_lock:
            self._check_open()
            deadline = None if timeout is None else time.monotonic() + timeout
            reader, header = self._reader, self._seg.header
            while True:
                if header[FRONTEND_CLOSED] and self._gone is None:
                    self._gone = "the frontend closed the shm channel"
                msg = reader.read()
                if msg is not None:
                    return msg
                if self._gone is not None:
                    raise TransportError(self._gone)
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    return None
                reader.ctl[READER_WAITING] = 1
                reader.fence()
                try:
                    if reader.ready() or header[FRONTEND_CLOSED]:
                        continue
                    _, dead = self._recv_sleep.sleep(wait, self._what)
                finally:
                    reader.ctl[READER_WAITING] = 0
                if dead:
                    self._peer_died(0)

    def send(self, frames: Sequence[Frame]) -> None:
        with self._send_lock:
            self._check_open()
            self._check_peer(0)
            self._writer.write(frames)

    def _wait_space(self, ring: RingWriter) -> None:
        self._wait(ring, WRITER_WAITING, self._send_sleep, 0, lambda: ring.free_slots() > 0)

    def _wait_more(self, ring: RingReader) -> None:
        self._wait(ring, READER_WAITING, self._recv_sleep, 0, ring.ready)

    def _peer_died(self, key: int) -> None:
        if self._gone is None:
            self._gone = str(self._watches[0].error())

    def _peer_name(self, key: int) -> str:
        return "frontend"

    def _check_peer(self, key: int) -> None:
        if self._gone is None and self._seg.header[FRONTEND_CLOSED]:
            self._gone = "the frontend closed the shm channel"
        if self._gone is not None:
            raise TransportError(self._gone)

    def _announce_close(self) -> None:
        self._seg.header[ENGINE_CLOSED] = 1
        self._writer.fence()
        signal(self._seg.fifos["out_data"])
        signal(self._seg.fifos["in_space"])


class ShmTransport:
    """Makes shm channels; picklable (it holds only its settings)."""

    multiprocess = True

    def __init__(self, settings: ShmSettings | None = None) -> None:
        self.settings = settings or ShmSettings()

    def create_client(self, num_engines: int = 1) -> ShmClientChannel:
        return ShmClientChannel(self.settings, num_engines)

    def connect_engine(self, address: Any, engine_index: int = 0) -> ShmEngineChannel:
        if not isinstance(address, ShmAddress):
            raise TransportError(f"shm transport got an address it did not make: {address!r}")
        return ShmEngineChannel(self.settings, address, engine_index)

    def __repr__(self) -> str:
        return f"ShmTransport({self.settings!r})"
