"""A worker killed or hung: the executor fails fast, the engine reports EngineDeadError, nothing is left."""

from __future__ import annotations

import pytest

from baton.testing.tiny_model import tiny_model
from tests.plugins.parallel_common import (
    check_hang_is_detected,
    check_stopped_worker_is_detected,
    sigkill_worker_is_engine_dead,
    tiny_executor,
)


@pytest.mark.parametrize("transport", ["inproc", "shm"])  # engine in our process / in its own
def test_sigkill_of_a_worker_is_engine_dead_within_5_s(transport, no_leaks):
    sigkill_worker_is_engine_dead(
        str(tiny_model("llama")), transport, executor="cuda-tp", tensor_parallel_size=2
    )


def test_a_hung_worker_fails_the_executor_after_step_timeout(no_leaks):
    ex = tiny_executor("cuda-tp", {"step_timeout": 2.0}, tensor_parallel_size=2)
    try:
        check_hang_is_detected(ex)
    finally:
        ex.shutdown()


def test_a_stopped_worker_is_detected_by_its_heartbeat_within_5_s(no_leaks):
    ex = tiny_executor("cuda-tp", tensor_parallel_size=2)  # default step_timeout: 120 s
    try:
        check_stopped_worker_is_detected(ex)
    finally:
        ex.shutdown()
