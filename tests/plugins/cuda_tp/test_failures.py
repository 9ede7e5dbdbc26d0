"""A worker killed or hung: the executor fails fast, the engine reports EngineDeadError, nothing is left."""

from __future__ import annotations

import pytest

from baton.config import BatonConfig
from baton.testing.tiny_model import tiny_model
from baton_cuda_tp.executor import TensorParallelExecutor
from baton_cuda_tp.plugin import CudaTPSettings
from tests.plugins.parallel_common import (
    check_hang_is_detected,
    check_stopped_worker_is_detected,
    sigkill_worker_is_engine_dead,
)


def _executor(**settings) -> TensorParallelExecutor:
    """Two workers of the tiny model on the CPU, one thread each."""
    cfg = BatonConfig.load(
        model=str(tiny_model("llama")),
        executor="cuda-tp",
        tensor_parallel_size=2,
        device="cpu",
        num_threads=1,
        kv_cache_memory="16MiB",
    )
    return TensorParallelExecutor(cfg, CudaTPSettings(**settings))


@pytest.mark.parametrize("transport", ["inproc", "shm"])  # engine in our process / in its own
def test_sigkill_of_a_worker_is_engine_dead_within_5_s(transport, no_leaks):
    sigkill_worker_is_engine_dead(
        str(tiny_model("llama")), transport, executor="cuda-tp", tensor_parallel_size=2
    )


def test_a_hung_worker_fails_the_executor_after_step_timeout(no_leaks):
    ex = _executor(step_timeout=2.0)
    try:
        check_hang_is_detected(ex)
    finally:
        ex.shutdown()


def test_a_stopped_worker_is_detected_by_its_heartbeat_within_5_s(no_leaks):
    ex = _executor()  # default step_timeout: 120 s
    try:
        check_stopped_worker_is_detected(ex)
    finally:
        ex.shutdown()
