"""What both ends of a zmq channel share: sockets, the poll loop, peer watching, close().

``recv`` polls the channel's input socket together with a wake pipe (``close()``
from another thread writes to it) and the peers' pidfds. When a peer exits, what
it sent before is still delivered, waiting up to ``_DEATH_GRACE`` for bytes in
flight; then recv raises TransportError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import time
import weakref
from collections.abc import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from baton.errors import TransportError
from baton.interfaces import Frame
from baton.transport.closing import release_when_idle
from baton.transport.peer import POLL_SLICE, PeerWatch
from baton_zmq.plugin import ZmqSettings

#: After a peer exits, how long recv still waits for messages it sent just before.
_DEATH_GRACE = 0.25


def _nbytes(frame: Frame) -> int:
    return frame.nbytes if type(frame) is memoryview else len(frame)


def send_frames(sock: zmq.Socket, frames: Sequence[Frame], threshold: int) -> None:
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        # copy=False below the threshold would be copied by pyzmq anyway, only slower
        sock.send(frame, zmq.SNDMORE if i < last else 0, copy=_nbytes(frame) < threshold)


def check_not_empty(frames: Sequence[Frame]) -> None:
    if not frames:
        raise TransportError("cannot send an empty message: a message needs at least one frame")


def recv_frames(sock: zmq.Socket, threshold: int) -> list[Frame]:
    frames: list[Frame] = [sock.recv(zmq.NOBLOCK)]
    while sock.getsockopt(zmq.RCVMORE):
        part = sock.recv(copy=False)
        frames.append(part.bytes if len(part) < threshold else part.buffer)
    return frames


def _release(
    ctx: zmq.Context, sockets: list[zmq.Socket], fds: list[int], watches: dict, tmpdir: str | None
) -> None:
    """Close everything a channel owns; runs once (close(), GC or interpreter exit)."""
    for sock in sockets:
        sock.close()  # LINGER (set at creation) bounds how long queued messages are kept
    ctx.term()
    for fd in fds:
        os.close(fd)
    for watch in list(watches.values()):
        watch.close()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


class Channel:
    """What both ends share: a context, a wake pipe, locks, peer watches, close()."""

    def __init__(self, settings: ZmqSettings, tmpdir: str | None = None) -> None:
        self._settings = settings
        self._threshold = settings.copy_threshold
        self._ctx = zmq.Context(io_threads=1)
        self._sockets: list[zmq.Socket] = []
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        # pidfd (or a negative key where there are no pidfds) -> watch
        self._watches: dict[int, PeerWatch] = {}
        self._gone: str | None = None  # why recv must raise once nothing is pending
        self._exited: dict[int, str] = {}  # watch key -> its peer's exit, for every exited peer
        self._grace_until = 0.0
        self._recv_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed = False
        self._tmpdir = tmpdir
        self._monitor: zmq.Socket | None = None  # tells the engine its frontend disconnected
        self._finalizer = weakref.finalize(
            self,
            _release,
            self._ctx,
            self._sockets,
            [self._wake_r, self._wake_w],
            self._watches,
            tmpdir,
        )

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, int(self._settings.linger * 1000))
        sock.setsockopt(zmq.SNDHWM, self._settings.hwm)
        sock.setsockopt(zmq.RCVHWM, self._settings.hwm)
        sock.setsockopt(
            zmq.SNDTIMEO, int(self._settings.send_timeout * 1000) if self._settings.hwm else -1
        )
        if (
            self._settings.socket_buffer
        ):  # fewer, larger kernel transfers; capped by net.core.*mem_max
            sock.setsockopt(zmq.SNDBUF, self._settings.socket_buffer)
            sock.setsockopt(zmq.RCVBUF, self._settings.socket_buffer)
        self._sockets.append(sock)
        return sock

    def _watch(self, watch: PeerWatch) -> None:
        fd = watch.fileno()
        key = fd if fd is not None else -1 - len(self._watches)
        self._watches[key] = watch
        if fd is not None:
            self._poller.register(fd, zmq.POLLIN)

    def _peer_exited(self, key: int) -> None:
        watch = self._watches[key]
        if key >= 0:
            self._poller.unregister(key)
        self._exited[key] = str(watch.error())
        if self._gone is None:
            self._gone = self._exited[key]
            self._grace_until = time.monotonic() + _DEATH_GRACE

    def _unwatch(self, key: int) -> None:
        """Stop watching one peer: its exit no longer makes recv raise."""
        watch = self._watches.pop(key, None)
        if watch is None:
            return
        if key >= 0 and key not in self._exited:
            self._poller.unregister(key)
        watch.close()
        self._exited.pop(key, None)
        self._gone = next(iter(self._exited.values()), None)

    def _recv(self, timeout: float | None) -> list[Frame] | None:
        """Wait on the input socket, the wake pipe and the peers' pidfds; the caller holds the recv lock."""
        if self._closed:
            raise TransportError(f"{self._what} channel is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = self._take()
            if msg is not None:
                return msg
            now = time.monotonic()
            if self._gone is not None:  # deliver what the peer sent before it died, then raise
                if now >= self._grace_until:
                    raise TransportError(self._gone)
                wait: float | None = self._grace_until - now
            elif deadline is None:
                wait = None
            else:
                wait = deadline - now
                if wait <= 0:
                    return None
            if any(key < 0 for key in self._watches):  # no pidfds: re-check the peers now and then
                wait = POLL_SLICE if wait is None else min(wait, POLL_SLICE)
                for key, watch in list(self._watches.items()):
                    if key < 0 and not watch.alive():
                        self._peer_exited(key)
            for item, _ in self._poller.poll(None if wait is None else int(wait * 1000) + 1):
                if item == self._wake_r:
                    raise TransportError(f"{self._what} channel was closed while receiving")
                if type(item) is int and item in self._watches:
                    self._peer_exited(item)
                elif item is self._monitor:
                    self._on_monitor_event()

    def _on_monitor_event(self) -> None:
        assert self._monitor is not None
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED and self._gone is None:
                self._gone = "the frontend closed the zmq channel"
                self._grace_until = time.monotonic() + _DEATH_GRACE

    def _take(self) -> list[Frame] | None:
        raise NotImplementedError

    def _send(
        self, sock: zmq.Socket, frames: Sequence[Frame], peer: str, identity: bytes | None = None
    ) -> None:
        """Send one message (after ``identity``, for a ROUTER); ZeroMQ errors become TransportError."""
        check_not_empty(frames)
        try:
            if identity is not None:
                sock.send(identity, zmq.SNDMORE)
            send_frames(sock, frames, self._threshold)
        except zmq.Again:
            raise TransportError(
                f"{peer} took no message for {self._settings.send_timeout}s (hwm "
                f"{self._settings.hwm} reached): raise [transport.zmq] hwm or send_timeout"
            ) from None
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:  # ROUTER_MANDATORY: nobody with that identity
                raise TransportError(f"{peer} is not connected (it exited or closed)") from e
            raise TransportError(f"{self._what}: send to {peer} failed: {e}") from e

    def close(self) -> None:
        """Release sockets and files; idempotent, safe from any thread and after the peer died."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")  # wakes a recv blocked in another thread
        locks = [(self._recv_lock, 5.0), (self._send_lock, self._settings.send_timeout + 5.0)]
        release_when_idle(locks, self._finalizer, self._what)
