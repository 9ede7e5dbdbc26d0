"""Fixtures shared by baton-core's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from baton.kernels import loader
from baton.plugins.registry import get_plugins


@pytest.fixture(scope="session")
def cpu_kernel_ops() -> None:
    """baton's C++ kernels loaded as torch.ops.baton; skipped only where there is no C++ compiler."""
    if loader.compiler() is None:
        pytest.skip("no C++ compiler: the C++ kernels cannot be built here")
    torch.ops.load_library(str(loader.build()))  # a failed build is a failure, not a skip


@pytest.fixture
def global_plugin() -> Iterator:
    """Register plugin objects in the process-wide plugin manager for one test."""
    names: list[str] = []

    def add(plugin: object, name: str) -> None:
        get_plugins().register(plugin, name, "hook-test-dist", "1.2.3")
        names.append(name)

    yield add
    for name in names:
        get_plugins().unregister(name)
