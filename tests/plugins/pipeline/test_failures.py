"""A stage killed or hung: the executor fails fast, the engine reports EngineDeadError, nothing is left."""

from __future__ import annotations

from typing import Any

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.testing.tiny_model import tiny_model
from baton_pipeline.executor import create_pipeline_executor
from tests.plugins.parallel_common import ParallelFailures, _children


class TestPipelineFailures(ParallelFailures):
    executor = "pipeline"
    parallel = {"pipeline_parallel_size": 2}

    @pytest.fixture(params=["inproc", "zmq"])
    def transport(self, request: Any) -> str:
        return str(request.param)


def test_more_stages_than_layers_is_refused_before_any_worker_starts():
    cfg = BatonConfig.load(
        model=str(tiny_model("llama")), executor="pipeline", pipeline_parallel_size=4, device="cpu"
    )
    with pytest.raises(
        ConfigError, match="pipeline_parallel_size=4 but the model has only 3 layers"
    ):
        create_pipeline_executor(cfg)
    assert not _children()
