"""A stage killed or hung: the executor fails fast, the engine reports EngineDeadError, nothing is left."""

from __future__ import annotations

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.testing.tiny_model import tiny_model
from baton_pipeline.executor import create_pipeline_executor
from tests.plugins.parallel_common import (
    _children,
    check_hang_is_detected,
    check_stopped_worker_is_detected,
    sigkill_worker_is_engine_dead,
    tiny_executor,
)


@pytest.mark.parametrize("transport", ["inproc", "zmq"])
def test_sigkill_of_a_stage_is_engine_dead_within_5_s(transport, no_leaks):
    sigkill_worker_is_engine_dead(
        str(tiny_model("llama")), transport, executor="pipeline", pipeline_parallel_size=2
    )


def test_a_hung_stage_fails_the_executor_after_step_timeout(no_leaks):
    ex = tiny_executor("pipeline", {"step_timeout": 2.0}, pipeline_parallel_size=2)
    try:
        check_hang_is_detected(ex)
    finally:
        ex.shutdown()


def test_a_stopped_stage_is_detected_by_its_heartbeat_within_5_s(no_leaks):
    ex = tiny_executor("pipeline", pipeline_parallel_size=2)  # default step_timeout: 120 s
    try:
        check_stopped_worker_is_detected(ex)
    finally:
        ex.shutdown()


def test_more_stages_than_layers_is_refused_before_any_worker_starts():
    cfg = BatonConfig.load(
        model=str(tiny_model("llama")), executor="pipeline", pipeline_parallel_size=4, device="cpu"
    )
    with pytest.raises(
        ConfigError, match="pipeline_parallel_size=4 but the model has only 3 layers"
    ):
        create_pipeline_executor(cfg)
    assert not _children()
