"""baton-plugin-zmq passes the transport conformance suite, over ipc:// and tcp://."""

import pytest

from baton.testing.conformance.transport import TransportConformance
from baton_zmq.plugin import ZmqSettings, create_transport


class TestZmqIpcConformance(TransportConformance):
    name = "zmq"

    @pytest.fixture
    def transport(self):
        return create_transport(None, ZmqSettings(protocol="ipc"))


class TestZmqTcpConformance(TransportConformance):
    @pytest.fixture
    def transport(self):
        return create_transport(None, ZmqSettings(protocol="tcp"))
