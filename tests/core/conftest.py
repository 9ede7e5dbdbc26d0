"""Fixtures shared by baton-core's tests."""

from __future__ import annotations

import pytest
import torch

from baton.kernels import loader


@pytest.fixture(scope="session")
def cpu_kernel_ops() -> None:
    """baton's C++ kernels loaded as torch.ops.baton; skipped only where there is no C++ compiler."""
    if loader.compiler() is None:
        pytest.skip("no C++ compiler: the C++ kernels cannot be built here")
    torch.ops.load_library(str(loader.build()))  # a failed build is a failure, not a skip
