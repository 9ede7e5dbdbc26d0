"""A worker killed or hung: the executor fails fast, the engine reports EngineDeadError, nothing is left."""

from __future__ import annotations

from typing import Any

import pytest

from tests.plugins.parallel_common import ParallelFailures


class TestCudaTPFailures(ParallelFailures):
    executor = "cuda-tp"
    parallel = {"tensor_parallel_size": 2}

    @pytest.fixture(params=["inproc", "shm"])  # engine in our process / in its own
    def transport(self, request: Any) -> str:
        return str(request.param)
