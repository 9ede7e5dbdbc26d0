"""Transport ``inproc``: the engine runs on a thread of the frontend's process.

Each link is a pair of queues: one input queue per engine, one output queue
shared by all engines. Frames pass by reference (no copy, no serialisation of
the frames themselves), so a sender must not change a buffer after sending it.
``address`` is a key into a process-local table, which is why the engine end
can only connect from the same process.

An engine counts as gone when it closes its channel or when the thread that
connected it ends; the client then delivers what that engine sent before and
raises TransportError. A closed client makes the engines' ``recv`` raise.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from baton.errors import TransportError
from baton.interfaces import Frame
from baton.plugins.hookspecs import hookimpl

#: How often a blocked client recv checks that the engine threads still run.
_LIVENESS_SLICE = 0.25


@dataclass(frozen=True)
class _Gone:
    """Queued after an engine's last message: that engine closed its end."""

    engine_index: int


_CLIENT_CLOSED = object()


@dataclass
class _Link:
    inputs: list[queue.SimpleQueue]
    outputs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    engine_threads: dict[int, threading.Thread] = field(default_factory=dict)
    client_closed: bool = False


_links: dict[str, _Link] = {}
_links_lock = threading.Lock()
_counter = itertools.count()


def _forget(address: str) -> None:
    with _links_lock:
        _links.pop(address, None)


def _check_frames(frames: Sequence[Frame]) -> list[Frame]:
    if not frames:
        raise TransportError("cannot send an empty message: a message needs at least one frame")
    return list(frames)  # the caller may reuse its list; the buffers themselves are shared


class InprocClientChannel:
    """The frontend's end: a queue per engine in, one queue out."""

    def __init__(self, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.num_engines = num_engines
        self.address = f"inproc-{os.getpid()}-{next(_counter)}"
        self._link = _Link(inputs=[queue.SimpleQueue() for _ in range(num_engines)])
        self._gone: dict[int, str] = {}
        self._closed = False
        with _links_lock:
            _links[self.address] = self._link
        # a client dropped without close() must not keep its queues in the table
        weakref.finalize(self, _forget, self.address)

    def send(self, frames: Sequence[Frame], engine_index: int = 0) -> None:
        if self._closed:
            raise TransportError("inproc client channel is closed")
        if not 0 <= engine_index < self.num_engines:
            raise ValueError(
                f"engine_index {engine_index} out of range (num_engines={self.num_engines})"
            )
        if engine_index in self._gone:
            raise TransportError(self._gone[engine_index])
        self._link.inputs[engine_index].put(_check_frames(frames))

    def recv(self, timeout: float | None = None) -> list[Frame] | None:
        if self._closed:
            raise TransportError("inproc client channel is closed")
        outputs = self._link.outputs
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._gone:  # deliver what is pending, then report the lost engine
                try:
                    item = outputs.get_nowait()
                except queue.Empty:
                    raise TransportError(next(iter(self._gone.values()))) from None
            else:
                wait = (
                    _LIVENESS_SLICE
                    if deadline is None
                    else min(_LIVENESS_SLICE, deadline - time.monotonic())
                )
                try:
                    item = outputs.get(timeout=max(wait, 0.0))
                except queue.Empty:
                    self._check_engine_threads()
                    if deadline is not None and time.monotonic() >= deadline and not self._gone:
                        return None
                    continue
            if item is _CLIENT_CLOSED:
                raise TransportError("inproc client channel was closed while receiving")
            if type(item) is _Gone:
                self._gone.setdefault(
                    item.engine_index, f"engine {item.engine_index} closed its inproc channel"
                )
                continue
            return item

    def _check_engine_threads(self) -> None:
        for index, thread in list(self._link.engine_threads.items()):
            if not thread.is_alive() and index not in self._gone:
                # everything it sent is already queued: puts are synchronous
                self._gone[index] = (
                    f"engine {index}'s thread {thread.name!r} ended without closing its channel"
                )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._link.client_closed = True
        for q in (*self._link.inputs, self._link.outputs):  # wakes every blocked recv, ours too
            q.put(_CLIENT_CLOSED)
        _forget(self.address)


class InprocEngineChannel:
    """An engine's end: its own input queue, the shared output queue."""

    def __init__(self, link: _Link, engine_index: int) -> None:
        self._link = link
        self._index = engine_index
        self._input = link.inputs[engine_index]
        self._closed = False
        self._client_gone = False

    def recv(self, timeout: float | None = None) -> list[Frame] | None:
        if self._closed:
            raise TransportError(f"inproc engine {self._index} channel is closed")
        if self._client_gone:
            raise TransportError("the frontend closed the inproc channel")
        try:
            item = self._input.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _CLIENT_CLOSED:
            self._client_gone = True
            raise TransportError("the frontend closed the inproc channel")
        return item

    def send(self, frames: Sequence[Frame]) -> None:
        if self._closed:
            raise TransportError(f"inproc engine {self._index} channel is closed")
        if self._link.client_closed:
            raise TransportError("the frontend closed the inproc channel")
        self._link.outputs.put(_check_frames(frames))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._link.outputs.put(_Gone(self._index))


class InprocTransport:
    """Queues within one process; the engine runs on a thread."""

    multiprocess = False

    def create_client(self, num_engines: int = 1) -> InprocClientChannel:
        return InprocClientChannel(num_engines)

    def connect_engine(self, address: Any, engine_index: int = 0) -> InprocEngineChannel:
        with _links_lock:
            link = _links.get(address)
        if link is None:
            raise TransportError(
                f"inproc address {address!r} is unknown in process {os.getpid()}: the inproc transport "
                "only links a frontend and engines on threads of one process (and the client must be open); "
                "use a multiprocess transport (zmq, shm) for an engine in another process"
            )
        if not 0 <= engine_index < len(link.inputs):
            raise ValueError(
                f"engine_index {engine_index} out of range (num_engines={len(link.inputs)})"
            )
        if engine_index in link.engine_threads:
            raise TransportError(
                f"inproc engine {engine_index} of {address!r} is already connected"
            )
        # the connecting thread is the engine: when it ends, the client stops waiting for it
        link.engine_threads[engine_index] = threading.current_thread()
        return InprocEngineChannel(link, engine_index)

    def __repr__(self) -> str:
        return "InprocTransport()"


def create_transport(config: Any = None, settings: Any = None) -> InprocTransport:
    """The registered factory: ``factory(config, settings)``; inproc has no settings."""
    return InprocTransport()


@hookimpl
def register_transports(register: Any) -> None:
    register("inproc", create_transport)
