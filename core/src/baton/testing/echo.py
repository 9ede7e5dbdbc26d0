"""An engine-side echo server over any transport, for transport tests and benchmarks.

``EchoEngine(transport, address, index)`` runs ``serve`` at the engine end of a
link: in a child process started with the "spawn" method when the transport is
multiprocess (as baton starts engine cores), else on a thread. The server
connects with ``transport.connect_engine(address, index)``, sends one
``READY`` frame (``READY`` + u16 index + u64 pid), then answers every message
with the same frames (prefixed by a frame holding its index when ``tag``) until
``STOP``. ``echo_engines(transport, client, n)`` starts ``n`` of them and waits
for their READY. Control messages are single frames starting with ``CONTROL``; build
them with ``emit(...)`` / ``emit_tensors(...)`` or use ``STOP`` / ``DIE``.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal
import struct
import threading
from collections.abc import Iterator
from typing import Any

from baton.errors import TransportError
from baton.serial import MsgpackEncoder

READY = b"READY"
_READY_TAIL = struct.Struct("<HQ")
CONTROL = b"\xffbaton-echo:"
STOP = CONTROL + b"stop"
#: End without closing the channel, as a crash would (for thread engines, which cannot be killed).
DIE = CONTROL + b"die"
_EMIT = CONTROL + b"emit"
_TENSORS = CONTROL + b"tens"
_COUNTS = struct.Struct("<QQ")


def emit(count: int, size: int) -> bytes:
    """Control message: send ``count`` one-frame messages of ``size`` bytes, unprompted."""
    return _EMIT + _COUNTS.pack(count, size)


def emit_tensors(count: int, nbytes: int) -> bytes:
    """Control message: send ``count`` messages of one float32 torch tensor of ``nbytes``, through the codec."""
    return _TENSORS + _COUNTS.pack(count, nbytes)


def parse_ready(frame: Any) -> tuple[int, int] | None:
    """(engine index, pid) if ``frame`` is an echo server's READY, else None."""
    frame = bytes(frame)
    if not frame.startswith(READY) or len(frame) != len(READY) + _READY_TAIL.size:
        return None
    return _READY_TAIL.unpack(frame[len(READY) :])


def serve(
    transport: Any,
    address: Any,
    engine_index: int = 0,
    tag: bool = False,
    idle_timeout: float = 120.0,
) -> None:
    """The echo loop; returns on STOP, DIE, ``idle_timeout`` seconds of silence, or a lost frontend."""
    chan = transport.connect_engine(address, engine_index)
    crash = False
    tag_frame = b"%d" % engine_index
    try:
        chan.send([READY + _READY_TAIL.pack(engine_index, os.getpid())])
        while True:
            msg = chan.recv(timeout=idle_timeout)
            if msg is None:
                return
            head = msg[0]
            if len(msg) == 1 and bytes(head[: len(CONTROL)]) == CONTROL:
                command = bytes(head)
                if command == STOP:
                    return
                if command == DIE:
                    crash = True
                    return
                _run_emit(chan, command)
                continue
            chan.send([tag_frame, *msg] if tag else msg)
    except TransportError:
        return  # the frontend went away: nothing to answer
    finally:
        if not crash:
            chan.close()


def _run_emit(chan: Any, command: bytes) -> None:
    count, size = _COUNTS.unpack(command[len(_EMIT) :])
    if command.startswith(_EMIT):
        payload = b"\x01" * size
        for _ in range(count):
            chan.send([payload])
    elif command.startswith(_TENSORS):
        encoder = MsgpackEncoder()
        tensor = _tensor(size)
        for _ in range(count):
            chan.send(encoder.encode((tensor,)))
    else:
        raise TransportError(f"echo server: unknown control message {command!r}")


@functools.cache
def _tensor(nbytes: int) -> Any:
    """One tensor per size, made once: a benchmark then times the transport, not torch.arange."""
    import torch

    return torch.arange(nbytes // 4, dtype=torch.float32)


def _child_main(
    transport: Any, address: Any, engine_index: int, tag: bool, idle_timeout: float
) -> None:
    serve(transport, address, engine_index, tag, idle_timeout)


class EchoEngine:
    """An echo server at the engine end: a spawned process, or a thread for in-process transports."""

    def __init__(
        self,
        transport: Any,
        address: Any,
        engine_index: int = 0,
        tag: bool = False,
        idle_timeout: float = 120.0,
    ) -> None:
        self.engine_index = engine_index
        args = (transport, address, engine_index, tag, idle_timeout)
        self._proc: Any = None
        self._thread: threading.Thread | None = None
        if transport.multiprocess:
            ctx = multiprocessing.get_context("spawn")
            self._proc = ctx.Process(
                target=_child_main, args=args, name=f"baton-echo-{engine_index}", daemon=True
            )
            self._proc.start()
        else:
            self._thread = threading.Thread(
                target=serve, args=args, name=f"baton-echo-{engine_index}", daemon=True
            )
            self._thread.start()

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else os.getpid()

    def is_alive(self) -> bool:
        return (self._proc or self._thread).is_alive()

    def kill(self) -> None:
        """SIGKILL the server process (processes only: a thread is ended with ``DIE``)."""
        if self._proc is None:
            raise TypeError("a thread engine cannot be killed; send echo.DIE instead")
        os.kill(self._proc.pid, signal.SIGKILL)
        self._proc.join(10)

    def join(self, timeout: float) -> bool:
        """Wait for the server to end; True if it did."""
        (self._proc or self._thread).join(timeout)
        return not self.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """Make sure the server is gone (the frontend should have sent STOP first); kill if needed."""
        if self._proc is not None:
            if not self.join(timeout):
                self.kill()
            self._proc.close()
        elif self._thread is not None and not self.join(timeout):
            raise TransportError(
                f"echo engine thread {self._thread.name} did not end within {timeout}s"
            )

    def __enter__(self) -> EchoEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def echo_engines(
    transport: Any, client: Any, n: int = 1, tag: bool = False, ready_timeout: float = 60.0
) -> Iterator[list[EchoEngine]]:
    """Start ``n`` echo engines for ``client``, wait for each one's READY; STOP them at the end."""
    engines: list[EchoEngine] = []
    try:
        for i in range(n):
            engines.append(EchoEngine(transport, client.address, i, tag=tag))
        pids: dict[int, int] = {}
        while len(pids) < n:
            msg = client.recv(timeout=ready_timeout)
            ready = parse_ready(msg[0]) if msg is not None and len(msg) == 1 else None
            if ready is None:
                raise TransportError(f"expected READY from the echo engines, got {msg!r:.200}")
            pids[ready[0]] = ready[1]
        if any(pids[e.engine_index] != e.pid for e in engines):
            raise TransportError(f"READY from the wrong processes: {pids}")
        yield engines
    finally:
        for e in engines:
            if e.is_alive():
                with contextlib.suppress(TransportError, ValueError):
                    client.send([STOP], e.engine_index)
        for e in engines:
            e.stop()
