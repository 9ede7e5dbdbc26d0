"""zmq specifics: socket files, routing before an engine connects, settings."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from baton.errors import TransportError
from baton_zmq.plugin import ZmqSettings
from baton_zmq.transport import ZmqTransport

pytestmark = pytest.mark.timeout(60)


def test_ipc_files_removed_once_every_engine_connected():
    transport = ZmqTransport(ZmqSettings(protocol="ipc"))
    client = transport.create_client(1)
    folder = os.path.dirname(client.address.input.removeprefix("ipc://"))
    assert os.stat(folder).st_mode & 0o777 == 0o700  # nobody else may connect
    engine = transport.connect_engine(client.address, 0)
    try:
        engine.send([b"hi"])
        assert client.recv(timeout=10) == [
            b"hi"
        ]  # the engine's hello came first: out socket unlinked
        client.send([b"\x00", b"x"], 0)  # routing hello read: in socket unlinked, folder gone
        assert engine.recv(timeout=10) == [b"\x00", b"x"]
        assert not os.path.exists(folder)
    finally:
        engine.close()
        client.close()


def test_send_to_an_engine_that_never_connects_times_out():
    transport = ZmqTransport(ZmqSettings(connect_timeout=0.3))
    client = transport.create_client(1)
    try:
        with pytest.raises(TransportError, match="did not connect"):
            client.send([b"x"], 0)
    finally:
        client.close()


def test_tcp_binds_loopback_free_ports():
    client = ZmqTransport(ZmqSettings(protocol="tcp")).create_client(1)
    try:
        assert client.address.input.startswith("tcp://127.0.0.1:")
        assert client.address.input != client.address.output
    finally:
        client.close()


def test_settings_validated():
    with pytest.raises(ValidationError):
        ZmqSettings(protocol="udp")
    with pytest.raises(ValidationError):
        ZmqSettings(hwm=-1)
