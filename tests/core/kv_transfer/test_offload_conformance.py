"""The KV-connector conformance suite run against ``offload``: RAM only, RAM and disk, disk
only (every load in the background)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from baton.testing.conformance import KVConnectorConformance


class TestOffloadRam(KVConnectorConformance):
    name = "offload"
    settings: dict[str, Any] = {"cpu_memory": "64MiB"}


class _WithDisk(KVConnectorConformance):
    name = "offload"
    tier: dict[str, Any] = {}

    @pytest.fixture(autouse=True)
    def _disk_path(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        # a fresh directory per test: what one test's engine wrote is not another's hit
        path: Path = tmp_path_factory.mktemp("offload-disk")
        self.settings = {**self.tier, "disk_path": str(path)}


class TestOffloadRamAndDisk(_WithDisk):
    tier = {"cpu_memory": "64MiB", "disk_memory": "256MiB"}


class TestOffloadDiskOnly(_WithDisk):
    tier = {"cpu_memory": 0, "disk_memory": "256MiB", "disk_write_behind": False}
