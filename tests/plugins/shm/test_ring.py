"""shm specifics: messages across slot boundaries and ring wrap-around, files and their cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from pydantic import ValidationError

from baton.errors import TransportError
from baton.testing.leaks import leftover_files
from baton_shm.plugin import ShmSettings
from baton_shm.segment import leftover_files as shm_files
from baton_shm.transport import ShmTransport

pytestmark = pytest.mark.timeout(60)

SLOT = 256
HEADER = 16  # u64 total + u32 frame count + padding, then u64 per frame


@pytest.fixture
def pair():
    """A client and an engine end in this process, on rings of 8 slots of 256 bytes."""
    transport = ShmTransport(ShmSettings(slot_size=SLOT, slot_count=8, send_timeout=5))
    client = transport.create_client(1)
    engine = transport.connect_engine(client.address, 0)
    yield client, engine
    engine.close()
    client.close()
    assert leftover_files(os.getpid()) == []


def _relay(engine, count: int) -> threading.Thread:
    """Echo ``count`` messages on a thread (long messages need a concurrent reader)."""

    def run() -> None:
        for _ in range(count):
            engine.send(engine.recv(timeout=10))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "size",
    [
        0,
        1,
        SLOT - HEADER - 8 - 1,  # one frame: the last byte of the first slot left free
        SLOT - HEADER - 8,  # exactly one slot
        SLOT - HEADER - 8 + 1,  # one byte into the second slot
        2 * SLOT - HEADER - 8,
        8 * SLOT - HEADER - 8,  # exactly the whole ring
        8 * SLOT,  # more than the ring: streamed
        10 * 8 * SLOT + 17,  # laps the ring ten times
    ],
)
def test_one_frame_across_slot_boundaries(pair, size):
    client, engine = pair
    payload = np.random.default_rng(size).bytes(size)
    thread = _relay(engine, 3)
    for _ in range(3):  # three in a row: the start of the next message moves around the ring
        client.send([payload], 0)
        (got,) = client.recv(timeout=10)
        assert bytes(got) == payload
    thread.join(10)


def test_mixed_sizes_wrap_around(pair):
    """Many messages of odd sizes and frame counts; every byte in place, in order."""
    client, engine = pair
    rng = np.random.default_rng(7)
    messages = []
    for i in range(300):
        sizes = rng.choice([0, 1, 5, 100, 230, 257, 700, 3000], size=1 + i % 4)
        messages.append([rng.bytes(int(s)) for s in sizes])
    thread = _relay(engine, len(messages))
    received = []

    def receive() -> None:
        for _ in messages:
            received.append([bytes(f) for f in client.recv(timeout=10)])

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    for m in messages:
        client.send(m, 0)
    receiver.join(30)
    thread.join(10)
    assert received == messages


def test_large_frames_come_back_writable(pair):
    """Big frames arrive as memoryviews over private memory (torch.from_numpy needs no copy)."""
    client, engine = pair
    thread = _relay(engine, 1)
    client.send([b"small", bytes(100_000)], 0)
    small, big = client.recv(timeout=10)
    thread.join(10)
    assert small == b"small" and isinstance(small, bytes)
    assert isinstance(big, memoryview) and not big.readonly and big.nbytes == 100_000


def test_too_many_frames_refused(pair):
    client, _ = pair
    with pytest.raises(TransportError, match="frames"):
        client.send([b"x"] * 100, 0)


def test_full_ring_times_out_with_a_clear_error():
    transport = ShmTransport(ShmSettings(slot_size=SLOT, slot_count=2, send_timeout=0.5))
    client = transport.create_client(1)
    engine = transport.connect_engine(client.address, 0)  # attached, alive, never reads
    try:
        client.send([b"a"], 0)
        client.send([b"b"], 0)
        with pytest.raises(TransportError, match="no progress"):
            client.send([b"c"], 0)
    finally:
        engine.close()
        client.close()


def test_files_unlinked_once_the_engine_attached():
    transport = ShmTransport(ShmSettings(slot_size=SLOT, slot_count=4))
    client = transport.create_client(2)
    try:
        assert len(shm_files(os.getpid())) == 2 * 5  # a segment and four FIFOs per engine
        engine = transport.connect_engine(client.address, 1)
        assert len(shm_files(os.getpid())) == 5  # engine 1's are gone already
        with pytest.raises(TransportError, match="does not exist"):
            transport.connect_engine(client.address, 1)  # taken (and unlinked)
        engine.close()
    finally:
        client.close()
    assert shm_files(os.getpid()) == []  # engine 0 never came: the client removed its files


def test_settings_validated():
    with pytest.raises(ValidationError):
        ShmSettings(slot_size=100)  # not a multiple of 64
    with pytest.raises(ValidationError):
        ShmSettings(slot_count=1)


def test_no_resource_tracker_warnings():
    """A process that uses the transport and exits prints nothing (no leaked-segment warnings)."""
    code = (
        "from baton_shm.transport import ShmTransport\n"
        "t = ShmTransport(); c = t.create_client(1); e = t.connect_engine(c.address, 0)\n"
        "c.send([b'x'], 0); assert e.recv(timeout=5) == [b'x']\n"
        "e.close(); print(os.getpid())\n"  # the client is left to the interpreter's exit
    )
    done = subprocess.run(
        [sys.executable, "-c", "import os\n" + code], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert leftover_files(int(done.stdout)) == []


def _address(frame) -> int:
    return np.frombuffer(frame, np.uint8).__array_interface__["data"][0]


def test_big_frame_buffers_are_reused_only_once_released(pair):
    """A held frame is never overwritten; a dropped one's buffer serves the next message."""
    client, engine = pair
    thread = _relay(engine, 3)
    first = np.random.default_rng(1).bytes(100_000)
    client.send([first], 0)
    (held,) = client.recv(timeout=10)
    client.send([bytes(100_000)], 0)  # same size while `held` is alive
    (second,) = client.recv(timeout=10)
    assert bytes(held) == first, "a frame still held was overwritten"
    assert _address(second) != _address(held)
    address = _address(held)
    del held
    client.send([first[::-1]], 0)
    (third,) = client.recv(timeout=10)
    thread.join(10)
    assert bytes(third) == first[::-1]
    assert _address(third) == address  # the released buffer came back


def test_a_tensor_built_on_a_frame_keeps_its_buffer(pair):
    import torch

    from baton.serial import MsgpackDecoder, MsgpackEncoder

    client, engine = pair
    thread = _relay(engine, 2)
    x = torch.arange(50_000, dtype=torch.float32)
    client.send(MsgpackEncoder().encode((x,)), 0)
    (got,) = MsgpackDecoder().decode(client.recv(timeout=10))  # the frames list is dropped here
    client.send(MsgpackEncoder().encode((-x,)), 0)
    (other,) = MsgpackDecoder().decode(client.recv(timeout=10))
    thread.join(10)
    assert torch.equal(got, x) and torch.equal(other, -x)
