"""Transport ``shm``: per engine, an input ring and an output ring in one shared segment.

The frontend writes engine i's input ring and reads all output rings (``recv``
takes from them in turn); engine i reads its input ring and writes its output
ring. Waiting (an empty or full ring) is in channel.py and ring.py: a side
sleeps on a FIFO that the other side writes to only when it is asleep, so a busy
stream makes no system calls. The files are described in segment.py.

Peer death: each side knows the other's pid from the segment header (an engine
writes its own when it attaches). A peer that exits or closes its channel makes
``recv`` raise TransportError once what it wrote before is read, and ``send``
to it raise. A writer waits on a full ring at most ``send_timeout`` seconds.
"""

from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baton.errors import TransportError
from baton.interfaces import Frame
from baton.transport.peer import PeerWatch
from baton.transport.sweep import sweep_stale
from baton_shm.channel import Channel
from baton_shm.plugin import ShmSettings
from baton_shm.ring import RingReader, RingWriter, signal
from baton_shm.segment import (
    ENGINE_CLOSED,
    ENGINE_PID,
    FRONTEND_CLOSED,
    INPUT,
    OUTPUT,
    PREFIX,
    SHM_DIR,
    Segment,
    segment_name,
    unlink_files,
)
from baton_shm.sleeper import Sleeper


@dataclass(frozen=True)
class ShmAddress:
    """What an engine needs to attach (picklable): segment names in /dev/shm, one per engine."""

    segments: tuple[str, ...]
    frontend_pid: int


class ShmClientChannel(Channel):
    """The frontend's end: writes engine i's input ring, reads every output ring."""

    _what = "shm client"

    def __init__(self, settings: ShmSettings, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.num_engines = num_engines
        sweep_stale(SHM_DIR, PREFIX)
        names = [segment_name(os.getpid(), secrets.token_hex(4), i) for i in range(num_engines)]
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
        self._writers = []
        self._readers = []
        for i, seg in enumerate(segments):
            space = functools.partial(self._block, i, self._send_sleep)
            more = functools.partial(self._block, i, self._recv_sleep)
            self._writers.append(
                RingWriter(*seg.ring_views(INPUT), ss, sc, seg.fifos["in_data"], space)
            )
            self._readers.append(
                RingReader(*seg.ring_views(OUTPUT), ss, sc, seg.fifos["out_space"], more)
            )
            self._recv_sleep.add_fifo(seg.fifos["out_data"])
            self._send_sleep.add_fifo(seg.fifos["in_space"])
        self._rings.extend(self._writers + self._readers)
        self._next = 0
        self._take = self._readers[0].read if num_engines == 1 else self._take_round_robin
        self.address = ShmAddress(tuple(names), os.getpid())

    def send(self, frames: Sequence[Frame], engine_index: int = 0) -> None:
        if not 0 <= engine_index < self.num_engines:
            raise ValueError(
                f"engine_index {engine_index} out of range (num_engines={self.num_engines})"
            )
        with self._send_lock:
            if self._closed or self._gone or self._segments[engine_index].header[ENGINE_CLOSED]:
                self._check_open()
                self._check_peer(engine_index)
            self._writers[engine_index].write(frames)

    def _take_round_robin(self) -> list[Frame] | None:
        readers = self._readers
        n = len(readers)
        for k in range(n):  # one busy engine cannot starve the others
            i = (self._next + k) % n
            msg = readers[i].read()
            if msg is not None:
                self._next = i + 1
                return msg
        return None

    def _watch_peers(self, sleeper: Sleeper) -> None:
        for i, seg in enumerate(self._segments):
            watch = self._watches.get(i)
            if watch is None:
                pid = seg.header[ENGINE_PID]
                if not pid:
                    continue  # not attached yet: nothing to watch
                with self._watch_lock:  # recv and send threads may both get here first
                    watch = self._watches.get(i)
                    if watch is None:
                        watch = self._watches[i] = PeerWatch(pid, f"engine {i}")
            sleeper.add_peer(i, watch)

    def _note_closed(self) -> None:
        for i, seg in enumerate(self._segments):
            if seg.header[ENGINE_CLOSED] and i not in self._gone:
                self._gone[i] = f"engine {i} closed its shm channel"

    def _peer_closed(self) -> bool:
        return any(seg.header[ENGINE_CLOSED] for seg in self._segments)

    def _peer_name(self, key: int) -> str:
        return f"engine {key}"

    def _check_peer(self, key: int) -> None:
        self._note_closed()
        if key in self._gone:
            raise TransportError(self._gone[key])

    def _announce_close(self) -> None:
        for seg in self._segments:
            seg.header[FRONTEND_CLOSED] = 1
        self._writers[0].fence()
        for seg in self._segments:
            signal(seg.fifos["in_data"])
            signal(seg.fifos["out_space"])


class ShmEngineChannel(Channel):
    """An engine's end: reads its input ring, writes its output ring."""

    def __init__(self, settings: ShmSettings, address: ShmAddress, engine_index: int) -> None:
        if not 0 <= engine_index < len(address.segments):
            raise ValueError(
                f"engine_index {engine_index} out of range (num_engines={len(address.segments)})"
            )
        self._what = f"shm engine {engine_index}"
        seg = Segment.attach(address.segments[engine_index], engine_index)
        self._setup(settings, [seg], [])
        self._seg = seg
        # the segment's own geometry: the frontend made it
        ss, sc = seg.slot_size, seg.slot_count
        more = functools.partial(self._block, 0, self._recv_sleep)
        space = functools.partial(self._block, 0, self._send_sleep)
        self._reader = RingReader(*seg.ring_views(INPUT), ss, sc, seg.fifos["in_space"], more)
        self._writer = RingWriter(*seg.ring_views(OUTPUT), ss, sc, seg.fifos["out_data"], space)
        self._readers = [self._reader]
        self._rings.extend([self._reader, self._writer])
        self._take = self._reader.read
        watch = self._watches[0] = PeerWatch(address.frontend_pid, "the frontend")
        self._recv_sleep.add_fifo(seg.fifos["in_data"])
        self._send_sleep.add_fifo(seg.fifos["out_space"])
        for sleeper in (self._recv_sleep, self._send_sleep):
            sleeper.add_peer(0, watch)
        if not watch.alive():
            self._peer_died(0)

    def send(self, frames: Sequence[Frame]) -> None:
        with self._send_lock:
            if self._closed or self._gone or self._seg.header[FRONTEND_CLOSED]:
                self._check_open()
                self._check_peer(0)
            self._writer.write(frames)

    def _watch_peers(self, sleeper: Sleeper) -> None:
        pass  # the frontend is watched from the start

    def _note_closed(self) -> None:
        if self._seg.header[FRONTEND_CLOSED] and not self._gone:
            self._gone[0] = "the frontend closed the shm channel"

    def _peer_closed(self) -> bool:
        return bool(self._seg.header[FRONTEND_CLOSED])

    def _peer_name(self, key: int) -> str:
        return "the frontend"

    def _check_peer(self, key: int) -> None:
        self._note_closed()
        if self._gone:
            raise TransportError(self._gone[0])

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
