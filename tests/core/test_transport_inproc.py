"""The built-in inproc transport passes the transport conformance suite."""

import pytest

from baton.testing.conformance.transport import TransportConformance
from baton.transport.inproc import InprocTransport


class TestInprocConformance(TransportConformance):
    name = "inproc"

    @pytest.fixture
    def transport(self):
        return InprocTransport()


def test_engine_must_share_the_process():
    from baton.errors import TransportError

    with pytest.raises(TransportError, match="one process"):
        InprocTransport().connect_engine("inproc-nowhere", 0)


def test_frames_pass_by_reference():
    transport = InprocTransport()
    client = transport.create_client(1)
    engine = transport.connect_engine(client.address, 0)
    try:
        big = bytearray(1 << 20)
        client.send([b"\x00", big], 0)
        got = engine.recv(timeout=1)
        assert got[1] is big  # no copy in-process
    finally:
        engine.close()
        client.close()


def test_a_dropped_client_leaves_no_table_entry():
    import gc

    from baton.transport import inproc

    client = InprocTransport().create_client(1)
    address = client.address
    assert address in inproc._links
    del client
    gc.collect()
    assert address not in inproc._links
