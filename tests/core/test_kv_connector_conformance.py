"""The KV-connector conformance suite run against the reference connector (``memory``,
baton.testing.kv_connector), with synchronous and with asynchronous loads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from baton.testing.conformance import KVConnectorConformance
from baton.testing.kv_connector import register_memory_connector, unregister_memory_connector


@pytest.fixture(autouse=True)
def _memory_connector() -> Iterator[None]:
    register_memory_connector()
    yield
    unregister_memory_connector()  # engines spawned by later tests must see the same plugins


class TestMemoryConnector(KVConnectorConformance):
    name = "memory"


class TestMemoryConnectorAsyncLoads(KVConnectorConformance):
    name = "memory"
    settings = {"async_loads": True}
