"""Transport ``zmq``: ROUTER/DEALER for the frontend's requests, PUSH/PULL for outputs.

The frontend binds a ROUTER (input) and a PULL (output); engine ``i`` connects a
DEALER whose identity is ``i`` and a PUSH. ipc:// sockets live in a fresh
private (0700) temp dir; protocol "tcp" binds 127.0.0.1 on free ports.

Start-up: each engine sends an empty frame on its DEALER (the ROUTER can route
to it once that arrived) and a hello with its pid and machine id on its PUSH (the
frontend then watches that pid when the engine runs on its machine). A client ``send`` to an engine that has not connected yet
waits up to ``connect_timeout``. When every engine has connected, the ipc
socket files are unlinked, so a crash later leaves nothing behind.

Frames of ``copy_threshold`` bytes or more go out and come in without a copy
(pyzmq keeps a sent buffer alive until ZeroMQ is done with it, so a sender must
not change it after ``send``); smaller frames are copied, which is faster.

Peer death: each end watches the other's pid (``baton.transport.peer``) when both
run on one machine (``machine_id``: an engine may run on another host, e.g. as a
Ray actor, where the pid means nothing; its launcher's handle then tells the
frontend of its death), and an engine also sees its DEALER disconnect when the
frontend closes; see channel.py.
"""

from __future__ import annotations

import os
import struct
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from baton.errors import TransportError
from baton.interfaces import Frame
from baton.transport.peer import PeerWatch, machine_id
from baton.transport.sweep import sweep_stale
from baton_zmq.channel import Channel, check_not_empty, recv_frames
from baton_zmq.plugin import ZmqSettings

#: First bytes of the hello an engine sends on its PUSH: then u16 index, u64 pid, and the
#: engine's machine id (utf-8, the rest of the frame).
HELLO = b"\xffbaton-zmq-hello:"
_HELLO_TAIL = struct.Struct("<HQ")
_IDENTITY = struct.Struct("<H")


@dataclass(frozen=True)
class ZmqAddress:
    """What an engine needs to connect (picklable)."""

    input: str
    output: str
    frontend_pid: int
    num_engines: int
    #: ``machine_id()`` of the frontend: an engine elsewhere does not watch ``frontend_pid``
    frontend_machine: str = ""


class ZmqClientChannel(Channel):
    """The frontend's end: a ROUTER to the engines, a PULL from all of them."""

    _what = "zmq client"

    def __init__(self, settings: ZmqSettings, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        ipc = settings.protocol == "ipc"
        if ipc:
            sweep_stale(tempfile.gettempdir(), "baton_zmq_")
        super().__init__(
            settings, tempfile.mkdtemp(prefix=f"baton_zmq_{os.getpid()}_") if ipc else None
        )
        self.num_engines = num_engines
        self._routable: set[int] = set()
        self._hellos: set[int] = set()
        self._engine_keys: dict[int, int] = {}  # engine index -> its watch's key
        self._forgotten: set[int] = set()  # engines forget_engine dropped
        self._identities = [_IDENTITY.pack(i) for i in range(num_engines)]
        self._in = self._socket(zmq.ROUTER)
        # an unroutable send raises instead of vanishing
        self._in.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._out = self._socket(zmq.PULL)
        self._poller.register(self._out, zmq.POLLIN)
        if ipc:
            endpoints = [f"ipc://{self._tmpdir}/in", f"ipc://{self._tmpdir}/out"]
        else:
            endpoints = [f"tcp://{settings.host}:*"] * 2
        try:
            for sock, endpoint in zip((self._in, self._out), endpoints, strict=True):
                sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._finalizer()
            raise TransportError(f"zmq client could not bind {endpoints}: {e}") from e
        self.address = ZmqAddress(
            input=self._in.getsockopt_string(zmq.LAST_ENDPOINT),
            output=self._out.getsockopt_string(zmq.LAST_ENDPOINT),
            frontend_pid=os.getpid(),
            num_engines=num_engines,
            frontend_machine=machine_id(),
        )

    def send(self, frames: Sequence[Frame], engine_index: int = 0) -> None:
        check_not_empty(frames)  # before waiting for the engine to connect
        if not 0 <= engine_index < self.num_engines:
            raise ValueError(
                f"engine_index {engine_index} out of range (num_engines={self.num_engines})"
            )
        with self._send_lock:
            if self._closed:
                raise TransportError("zmq client channel is closed")
            if engine_index in self._forgotten:
                raise TransportError(
                    f"engine {engine_index} exited (the frontend went on without it)"
                )
            if engine_index not in self._routable:
                self._await_engine(engine_index)
            self._send(self._in, frames, f"engine {engine_index}", self._identities[engine_index])

    def forget_engine(self, engine_index: int) -> None:
        """The frontend goes on without engine ``engine_index`` (it died): its exit no longer
        makes ``recv`` raise, and sends to it raise TransportError. What it sent before it died
        may still arrive."""
        with self._recv_lock, self._send_lock:
            self._forgotten.add(engine_index)
            key = self._engine_keys.pop(engine_index, None)
            if key is not None:
                self._unwatch(key)

    def _await_engine(self, engine_index: int) -> None:
        """Read DEALER hellos on the ROUTER until ``engine_index`` can be routed to."""
        deadline = time.monotonic() + self._settings.connect_timeout
        while engine_index not in self._routable:
            if self._closed:
                raise TransportError("zmq client channel is closed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(
                    f"engine {engine_index} did not connect within {self._settings.connect_timeout}s "
                    "([transport.zmq] connect_timeout); did its process start?"
                )
            if self._in.poll(int(min(remaining, 0.1) * 1000) + 1):
                identity, *_ = self._in.recv_multipart()
                self._routable.add(_IDENTITY.unpack(identity)[0])
        if len(self._routable) == self.num_engines:
            self._unlink("in")

    def recv(self, timeout: float | None = None) -> list[Frame] | None:
        with self._recv_lock:
            return self._recv(timeout)

    def _take(self) -> list[Frame] | None:
        while True:
            try:
                frames = recv_frames(self._out, self._threshold)
            except zmq.Again:
                return None
            if len(frames) == 1 and frames[0][: len(HELLO)] == HELLO:
                self._on_hello(frames[0])
                continue
            return frames

    def _on_hello(self, hello: bytes) -> None:
        tail = len(HELLO) + _HELLO_TAIL.size
        index, pid = _HELLO_TAIL.unpack(hello[len(HELLO) : tail])
        if index in self._hellos:
            return
        self._hellos.add(index)
        if bytes(hello[tail:]).decode(errors="replace") == machine_id():
            watch = PeerWatch(pid, f"engine {index}")
            self._watch(watch)
            self._engine_keys[index] = next(k for k, w in self._watches.items() if w is watch)
        # else the engine runs on another host: its pid is not ours to watch (its launcher's
        # handle, polled by the client, tells of its death)
        if len(self._hellos) == self.num_engines:
            self._unlink("out")

    def _unlink(self, name: str) -> None:
        # every engine is connected: the socket file is no longer needed, and a crash leaves none behind
        if self._tmpdir is None:
            return
        try:
            os.unlink(os.path.join(self._tmpdir, name))
            os.rmdir(self._tmpdir)
        except OSError:
            pass  # the other socket file is still there: whoever unlinks it last removes the dir


class ZmqEngineChannel(Channel):
    """An engine's end: a DEALER (identity = engine index) in, a PUSH out."""

    _what = "zmq engine"

    def __init__(self, settings: ZmqSettings, address: ZmqAddress, engine_index: int) -> None:
        if not 0 <= engine_index < address.num_engines:
            raise ValueError(
                f"engine_index {engine_index} out of range (num_engines={address.num_engines})"
            )
        super().__init__(settings)
        self._what = f"zmq engine {engine_index}"
        self._in = self._socket(zmq.DEALER)
        self._in.setsockopt(zmq.IDENTITY, _IDENTITY.pack(engine_index))
        self._out = self._socket(zmq.PUSH)
        self._poller.register(self._in, zmq.POLLIN)
        try:
            self._in.connect(address.input)
            self._out.connect(address.output)
            self._in.send(b"")  # lets the ROUTER route to us
            self._out.send(
                HELLO + _HELLO_TAIL.pack(engine_index, os.getpid()) + machine_id().encode()
            )
        except zmq.ZMQError as e:
            self._finalizer()
            raise TransportError(
                f"zmq engine {engine_index} could not connect to {address}: {e}"
            ) from e
        if address.frontend_machine == machine_id():
            self._watch(PeerWatch(address.frontend_pid, "the frontend"))
        # else the frontend is on another host: its closing disconnects the DEALER (below)
        # the frontend closing its sockets (without exiting) disconnects the DEALER
        self._monitor = self._in.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sockets.append(self._monitor)
        self._poller.register(self._monitor, zmq.POLLIN)

    def recv(self, timeout: float | None = None) -> list[Frame] | None:
        with self._recv_lock:
            return self._recv(timeout)

    def _take(self) -> list[Frame] | None:
        try:
            return recv_frames(self._in, self._threshold)
        except zmq.Again:
            return None

    def send(self, frames: Sequence[Frame]) -> None:
        with self._send_lock:
            if self._closed:
                raise TransportError(f"{self._what} channel is closed")
            if self._gone is not None:
                raise TransportError(self._gone)
            self._send(self._out, frames, "the frontend")


class ZmqTransport:
    """Makes zmq channels; picklable (it holds only its settings)."""

    multiprocess = True

    def __init__(self, settings: ZmqSettings | None = None) -> None:
        self.settings = settings or ZmqSettings()

    def create_client(self, num_engines: int = 1) -> ZmqClientChannel:
        return ZmqClientChannel(self.settings, num_engines)

    def connect_engine(self, address: Any, engine_index: int = 0) -> ZmqEngineChannel:
        if not isinstance(address, ZmqAddress):
            raise TransportError(f"zmq transport got an address it did not make: {address!r}")
        return ZmqEngineChannel(self.settings, address, engine_index)

    def __repr__(self) -> str:
        return f"ZmqTransport({self.settings!r})"
