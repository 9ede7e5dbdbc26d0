"""The KV-connector conformance suite run against ``pd`` (role both: one engine is producer and
consumer; it serves a hand-off, never a prompt merely computed before, so not after a reset)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from baton.testing.conformance import KVConnectorConformance

STORE = Path(tempfile.gettempdir()) / f"baton-pd-conformance-{os.getpid()}"


@pytest.fixture(autouse=True, scope="module")
def _store() -> Iterator[None]:
    yield
    shutil.rmtree(STORE, ignore_errors=True)


class TestPDConnector(KVConnectorConformance):
    name = "pd"
    settings = {"path": str(STORE), "load_timeout": 0.5}
    serves_after_reset = False
