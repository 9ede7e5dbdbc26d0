"""UniprocExecutor: the Executor contract with a real tiny model, through the plugin registry."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from baton.config import BatonConfig
from baton.errors import ExecutorError
from baton.executor.uniproc import UniprocExecutor
from baton.interfaces import Executor
from baton.plugins.registry import get_registry
from baton.protocol import (
    CachedRequestData,
    KVCacheConfig,
    ModelCapabilities,
    NewRequestData,
    SchedulerOutput,
)
from baton.sampling_params import SamplingParams
from baton.testing.tiny_model import tiny_model


@pytest.fixture
def executor():
    cfg = BatonConfig.load(
        model=str(tiny_model("llama")),
        block_size=4,
        kv_cache_memory="2MiB",
        device="cpu",
        num_threads=2,
    )
    entry = get_registry().get("executor", "uniproc")
    ex = entry.create(cfg, None)
    yield ex
    ex.shutdown()


def step_output(prompt=(5, 6, 7, 8, 9)):
    r = NewRequestData(
        req_id="a",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(temperature=0),
        block_ids=[0, 1],
        num_computed_tokens=0,
    )
    return SchedulerOutput(
        scheduled_new_reqs=[r],
        num_scheduled_tokens={"a": len(prompt)},
        total_num_scheduled_tokens=len(prompt),
    )


def test_lifecycle(executor):
    assert isinstance(executor, Executor)
    assert executor.max_concurrent_batches == 1
    assert executor.model_info.max_model_len == 2048 and executor.model_info.vocab_size == 49152
    assert executor.model_capabilities == ModelCapabilities()
    [spec] = executor.get_kv_cache_specs()
    [mem] = executor.determine_available_memory()
    assert mem == 2 * 2**20
    executor.initialize_kv_cache(
        KVCacheConfig(num_blocks=mem // spec.page_size_bytes, block_size=4)
    )
    fut = executor.execute_model(step_output(), non_block=True)
    assert isinstance(fut, Future)
    out = fut.result(timeout=30)
    assert out.req_ids == ["a"] and len(out.sampled_token_ids[0]) == 1
    blocking = executor.execute_model(
        SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(
                req_ids=["a"],
                new_token_ids=[out.sampled_token_ids[0]],
                new_block_ids=[[]],
                num_computed_tokens=[5],
            ),
            num_scheduled_tokens={"a": 1},
            total_num_scheduled_tokens=1,
        )
    )
    assert len(blocking.sampled_token_ids[0]) == 1


def test_collective_rpc(executor):
    assert executor.collective_rpc("get_kv_cache_spec")[0].num_layers == 3
    names = executor.collective_rpc(
        lambda worker, suffix: threading.current_thread().name + suffix, args=("!",)
    )
    assert names[0].startswith("baton-uniproc") and names[0].endswith("!")
    with pytest.raises(ExecutorError, match="no method"):
        executor.collective_rpc("no_such_method")


def ghost_step() -> SchedulerOutput:
    """A step for a request the worker never saw: it fails the step, and the executor."""
    return SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["ghost"], new_token_ids=[[1]], new_block_ids=[[]], num_computed_tokens=[0]
        ),
        num_scheduled_tokens={"ghost": 1},
        total_num_scheduled_tokens=1,
    )


def test_failure_marks_the_executor_dead_and_calls_back_once(executor):
    executor.initialize_kv_cache(KVCacheConfig(num_blocks=16, block_size=4))
    seen: list[BaseException] = []
    executor.register_failure_callback(seen.append)
    executor.check_health()
    with pytest.raises(ExecutorError, match="ghost"):
        executor.execute_model(ghost_step(), non_block=True).result(timeout=30)
    assert len(seen) == 1 and "ghost" in str(seen[0])
    with pytest.raises(ExecutorError):
        executor.check_health()
    with pytest.raises(ExecutorError, match="failed earlier"):
        executor.execute_model(step_output())
    late: list[BaseException] = []
    executor.register_failure_callback(late.append)
    assert len(late) == 1 and len(seen) == 1


def test_shutdown_is_idempotent(executor):
    executor.shutdown()
    executor.shutdown()
    with pytest.raises(ExecutorError, match="shut down"):
        executor.execute_model(step_output())


def test_parallel_sizes_are_refused():
    cfg = BatonConfig.load(model=str(tiny_model("llama")), tensor_parallel_size=2)
    with pytest.raises(ExecutorError, match="tensor_parallel_size"):
        UniprocExecutor(cfg)
