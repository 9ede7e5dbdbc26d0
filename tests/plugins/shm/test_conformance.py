"""baton-plugin-shm passes the transport conformance suite, with default and with tiny rings."""

import pytest

from baton.testing.conformance.transport import TransportConformance
from baton_shm.plugin import ShmSettings, create_transport


class TestShmConformance(TransportConformance):
    name = "shm"

    @pytest.fixture
    def transport(self):
        return create_transport(None, ShmSettings())


class TestShmTinyRingsConformance(TransportConformance):
    """Every message of the suite larger than 512 bytes spans slots; 16 MiB ones lap the ring many times."""

    @pytest.fixture
    def transport(self):
        return create_transport(None, ShmSettings(slot_size=512, slot_count=8, send_timeout=10))
