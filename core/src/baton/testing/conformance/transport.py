"""Conformance suite for transport plugins: subclass ``TransportConformance``.

    from baton.testing.conformance.transport import TransportConformance

    class TestMyTransport(TransportConformance):
        name = "mine"                      # checked against the plugin registry

        @pytest.fixture
        def transport(self):
            return MyTransport()

Multiprocess transports get a real engine end: ``baton.testing.echo.EchoEngine``
in a child started with "spawn", so the transport object and its client's
``address`` must pickle. In-process transports run the echo server on a
thread. After every test no child process may be left, and no file named
``baton_<pid>_...`` or ``baton_<kind>_<pid>_...`` in /dev/shm or the temp dir
(name your segments and socket files that way so leaks are seen).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from baton.config import BatonConfig
from baton.errors import TransportError
from baton.interfaces import ClientChannel, Transport
from baton.plugins.registry import get_registry
from baton.serial import MsgpackDecoder, MsgpackEncoder
from baton.testing import echo
from baton.testing.echo import echo_engines
from baton.testing.leaks import leftover_files, open_fds

#: Generous bounds: the machine may be slow and shared; they only catch hangs.
RECV_TIMEOUT = 20.0
DEATH_NOTICE = 5.0


def recv_ok(client: Any, timeout: float = RECV_TIMEOUT) -> list[Any]:
    msg = client.recv(timeout=timeout)
    assert msg is not None, f"no message within {timeout}s"
    return msg


def as_bytes(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


def exchange(
    client: Any, messages: list[list[bytes]], engine_index: int | list[int] = 0
) -> list[list[Any]]:
    """Send ``messages`` (to one engine, or message i to ``engine_index[i]``) while a second
    thread collects as many replies, as a real frontend does.

    Sending and receiving on one thread could deadlock on a transport with bounded
    buffers: both directions full, each side waiting for the other to read.
    """
    replies: list[list[Any]] = []
    failure: list[BaseException] = []

    def receive() -> None:
        try:
            while len(replies) < len(messages):
                replies.append(recv_ok(client))
        except BaseException as e:  # reported by the caller's thread
            failure.append(e)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    targets = [engine_index] * len(messages) if isinstance(engine_index, int) else engine_index
    for message, target in zip(messages, targets, strict=True):
        client.send(message, target)
    thread.join(RECV_TIMEOUT * 2)
    assert not thread.is_alive(), f"only {len(replies)} of {len(messages)} echoes arrived"
    if failure:
        raise failure[0]
    return replies


class TransportConformance:
    """Behaviour every transport must show. Provide a ``transport`` fixture."""

    pytestmark = [pytest.mark.timeout(120)]

    #: The registered name, checked against the registry (None: skip that check).
    name: str | None = None
    #: recv raises TransportError when the peer dies (False: returning None on timeout is enough).
    detects_peer_death = True

    @pytest.fixture
    def transport(self) -> Transport:
        raise NotImplementedError("subclass TransportConformance and provide a `transport` fixture")

    @pytest.fixture
    def client(self, transport: Transport) -> Iterator[ClientChannel]:
        chan = transport.create_client(1)
        yield chan
        chan.close()

    @pytest.fixture(autouse=True)
    def _no_leaks(self) -> Iterator[None]:
        files = set(leftover_files(os.getpid()))
        children = {p.pid for p in multiprocessing.active_children()}
        yield
        gc.collect()
        left = [p for p in multiprocessing.active_children() if p.pid not in children]
        for child in left:
            child.kill()
        assert not left, f"child processes left running: {left}"
        assert set(leftover_files(os.getpid())) <= files, "transport files left behind"

    # ------------------------------------------------------------------ the contract

    def test_protocols(self, transport: Transport, client: ClientChannel) -> None:
        assert isinstance(transport, Transport)
        assert isinstance(client, ClientChannel)
        assert isinstance(transport.multiprocess, bool)
        if transport.multiprocess:  # both travel to a spawned engine process
            pickle.loads(pickle.dumps(transport))
            assert pickle.loads(pickle.dumps(client.address)) == client.address

    def test_registered(self, transport: Transport) -> None:
        if self.name is None:
            pytest.skip("no registered name given")
        entry = get_registry().get("transport", self.name)
        config = BatonConfig.load()
        made = entry.create(config, entry.settings(config))
        assert isinstance(made, Transport)
        assert made.multiprocess == transport.multiprocess

    def test_echo_ready_and_order(self, transport: Transport, client: ClientChannel) -> None:
        with echo_engines(transport, client):
            messages = [[b"\x00", b"msg %d" % i] for i in range(300)]
            assert [as_bytes(r) for r in exchange(client, messages)] == messages
            assert client.recv(timeout=0.05) is None  # nothing extra

    def test_frame_kinds_and_garbage(self, transport: Transport, client: ClientChannel) -> None:
        """Every buffer kind goes as its bytes; transports never decode (garbage arrives as sent)."""
        rng = np.random.default_rng(0)
        ints = np.arange(1000, dtype=np.int64)
        message = [
            b"\x02",
            b"",
            bytearray(b"bytearray"),
            memoryview(ints),  # a non-byte format
            memoryview(ints.reshape(10, 100)),  # two dimensions
            b"\xc1\xff not msgpack",
            rng.bytes(70_000),
            b"",
        ]
        with echo_engines(transport, client):
            client.send(message, 0)
            reply = recv_ok(client)
        assert len(reply) == len(message)
        for got, sent in zip(reply, message, strict=True):
            assert bytes(got) == (sent.tobytes() if isinstance(sent, memoryview) else bytes(sent))

    def test_large_tensors_bit_exact(self, transport: Transport, client: ClientChannel) -> None:
        import torch

        gen = torch.Generator().manual_seed(0)
        tensor = torch.randn(4 * 1024 * 1024, generator=gen)  # 16 MiB of float32
        array = np.random.default_rng(1).integers(0, 2**62, size=300_000, dtype=np.int64)
        bf16 = torch.randn(1000, 77, generator=gen).to(torch.bfloat16)
        frames = MsgpackEncoder().encode({"t": tensor, "a": array, "b": bf16, "note": "big"})
        with echo_engines(transport, client):
            for _ in range(2):
                client.send([b"\x00", *frames], 0)
                reply = recv_ok(client)
                got = MsgpackDecoder().decode(reply[1:])
                assert got["note"] == "big"
                assert got["t"].dtype == torch.float32 and torch.equal(got["t"], tensor)
                assert got["a"].dtype == array.dtype and np.array_equal(got["a"], array)
                assert got["b"].dtype == torch.bfloat16 and torch.equal(got["b"], bf16)

    def test_many_small_messages(self, transport: Transport, client: ClientChannel) -> None:
        messages = [[b"\x00", i.to_bytes(4, "little") * 8] for i in range(10_000)]
        with echo_engines(transport, client):
            replies = exchange(client, messages)
        assert [as_bytes(r) for r in replies] == messages

    def test_engine_sends_unprompted(self, transport: Transport, client: ClientChannel) -> None:
        with echo_engines(transport, client):
            client.send([echo.emit(2000, 100)], 0)
            for _ in range(2000):
                assert as_bytes(recv_ok(client)) == [b"\x01" * 100]
            assert client.recv(timeout=0.05) is None

    def test_two_engines_routing(self, transport: Transport) -> None:
        client = transport.create_client(2)
        try:
            with echo_engines(transport, client, n=2, tag=True):
                messages = [
                    [b"\x00", b"to %d round %d" % (i, r)] for r in range(50) for i in (0, 1)
                ]
                replies = exchange(client, messages, [0, 1] * 50)
                got: dict[int, list] = {0: [], 1: []}
                for reply in replies:
                    tag, *rest = as_bytes(reply)
                    got[int(tag)].append(rest)
                for i in (0, 1):
                    assert got[i] == [[b"\x00", b"to %d round %d" % (i, r)] for r in range(50)]
            with pytest.raises(ValueError):
                client.send([b"x"], 2)
        finally:
            client.close()

    def test_recv_timeout(self, transport: Transport, client: ClientChannel) -> None:
        with echo_engines(transport, client):
            start = time.monotonic()
            assert client.recv(timeout=0.2) is None
            assert client.recv(timeout=0) is None
            assert time.monotonic() - start < 5.0

    def test_empty_message_refused(self, transport: Transport, client: ClientChannel) -> None:
        """At once, even before any engine connected (refusing must not wait for one)."""
        outcome = _in_thread(lambda: client.send([], 0), DEATH_NOTICE)
        assert outcome == "TransportError" or outcome.startswith("ValueError"), outcome

    # ------------------------------------------------------------------ failure and shutdown

    def test_engine_death_noticed(self, transport: Transport, client: ClientChannel) -> None:
        with echo_engines(transport, client) as (engine,):
            client.send([b"\x00", b"before"], 0)
            assert as_bytes(recv_ok(client)) == [b"\x00", b"before"]
            if transport.multiprocess:
                engine.kill()
            else:
                client.send([echo.DIE], 0)
                assert engine.join(5.0)
            start = time.monotonic()
            try:
                msg = client.recv(timeout=DEATH_NOTICE)
            except TransportError:
                pass
            else:
                assert msg is None, f"a dead engine sent {msg!r}"
                assert not self.detects_peer_death, "recv returned None: expected TransportError"
            assert time.monotonic() - start < DEATH_NOTICE + 2.0
            # send neither hangs nor pretends the message is deliverable forever
            outcome = _in_thread(lambda: client.send([b"\x00", b"after"], 0), DEATH_NOTICE + 5.0)
            assert outcome in ("None", "TransportError"), outcome
            with contextlib.suppress(TransportError):
                client.recv(timeout=0.1)  # raises again, or None: never hangs

    def test_close_wakes_blocked_recv(self, transport: Transport) -> None:
        client = transport.create_client(1)
        outcome: list[str] = []
        thread = threading.Thread(
            target=lambda: outcome.append(_outcome(lambda: client.recv(timeout=None)))
        )
        thread.start()
        time.sleep(0.2)
        client.close()
        thread.join(10.0)
        assert not thread.is_alive(), "close() did not wake a recv blocked in another thread"
        assert outcome == ["TransportError"]
        client.close()  # idempotent
        with pytest.raises(TransportError):
            client.send([b"x"], 0)
        with pytest.raises(TransportError):
            client.recv(timeout=0)

    def test_engine_end_in_thread_sees_client_close(self, transport: Transport) -> None:
        """The engine end (here on a thread of this process) stops waiting when the client closes."""
        client = transport.create_client(1)
        results: list[Any] = []

        def engine_side() -> None:
            chan = transport.connect_engine(client.address, 0)
            try:
                chan.send([b"hello"])
                results.append(as_bytes(chan.recv(timeout=RECV_TIMEOUT) or []))
                results.append(_outcome(lambda: chan.recv(timeout=DEATH_NOTICE)))
            finally:
                chan.close()

        thread = threading.Thread(target=engine_side, daemon=True)
        thread.start()
        try:
            assert as_bytes(recv_ok(client)) == [b"hello"]
            client.send([b"\x00", b"one"], 0)
            deadline = time.monotonic() + RECV_TIMEOUT
            while not results and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            client.close()
        thread.join(DEATH_NOTICE + 5.0)
        assert not thread.is_alive(), "the engine end hung after the client closed"
        assert results[0] == [b"\x00", b"one"]
        assert results[1] in ("TransportError", "None")

    def test_no_leaked_descriptors(self, transport: Transport) -> None:
        def cycle() -> None:
            client = transport.create_client(1)
            thread_result: list[Any] = []

            def engine_side() -> None:
                chan = transport.connect_engine(client.address, 0)
                chan.send([b"\x00" * 200_000])  # a large frame: zero-copy paths too
                thread_result.append(chan.recv(timeout=RECV_TIMEOUT))
                chan.close()

            thread = threading.Thread(target=engine_side, daemon=True)
            thread.start()
            try:
                assert len(bytes(recv_ok(client)[0])) == 200_000
                client.send([b"bye"], 0)
                thread.join(RECV_TIMEOUT)
            finally:
                client.close()
            assert thread_result and as_bytes(thread_result[0]) == [b"bye"]

        cycle()  # libraries may open lasting descriptors on first use
        gc.collect()
        before = open_fds()
        cycle()
        gc.collect()
        assert open_fds() == before, "a client/engine cycle leaked file descriptors"

    def test_frontend_death_noticed_by_engine(self, transport: Transport) -> None:
        if not transport.multiprocess:
            pytest.skip("the frontend and engine share a process")
        ctx = multiprocessing.get_context("spawn")
        addresses = ctx.Queue()
        frontend = ctx.Process(target=_frontend_main, args=(transport, addresses), daemon=True)
        frontend.start()
        frontend_pid = frontend.pid
        try:
            address = addresses.get(timeout=RECV_TIMEOUT)
            chan = transport.connect_engine(address, 0)
            try:
                chan.send([b"hello"])
                assert as_bytes(chan.recv(timeout=RECV_TIMEOUT) or []) == [b"ok"]
                os.kill(frontend.pid, signal.SIGKILL)
                frontend.join(10.0)
                start = time.monotonic()
                outcome = _outcome(lambda: chan.recv(timeout=DEATH_NOTICE))
                assert outcome == "TransportError" or (
                    outcome == "None" and not self.detects_peer_death
                ), outcome
                assert time.monotonic() - start < DEATH_NOTICE + 2.0
            finally:
                chan.close()
        finally:
            if frontend.is_alive():
                frontend.kill()
            frontend.join(10.0)
            frontend.close()
            addresses.close()
            addresses.join_thread()
        assert leftover_files(frontend_pid) == [], "files of the killed frontend were left behind"


def _frontend_main(transport: Any, addresses: Any) -> None:
    """A frontend in a child process: answers the engine's hello, then waits to be killed."""
    client = transport.create_client(1)
    addresses.put(client.address)
    if client.recv(timeout=RECV_TIMEOUT) is not None:
        client.send([b"ok"], 0)
    time.sleep(60)


def _outcome(fn: Any) -> str:
    try:
        result = fn()
    except TransportError:
        return "TransportError"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "None" if result is None else "ok"


def _in_thread(fn: Any, timeout: float) -> str:
    """Run ``fn`` on a thread; its outcome, or 'hung' after ``timeout`` seconds."""
    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.append(_outcome(fn)), daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else "hung"


__all__ = ["TransportConformance", "echo_engines", "exchange", "leftover_files"]
