"""The deterministic fake executor: its tokens, failure injection, futures, and the contract it checks."""

from __future__ import annotations

import threading

import pytest

from baton.errors import ExecutorError
from baton.interfaces import Executor
from baton.plugins.registry import Plugins
from baton.protocol import CachedRequestData, KVCacheConfig, NewRequestData, SchedulerOutput
from baton.sampling_params import SamplingParams
from baton.testing import FakeExecutor, FakeExecutorSettings, register_fake_executor
from baton.testing.sched_harness import SchedulerDriver

from .sched_helpers import make_config, make_request, make_scheduler


def _new(rid, prompt, blocks, computed=0):
    return NewRequestData(
        req_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(),
        block_ids=blocks,
        num_computed_tokens=computed,
    )


def test_is_an_executor_and_reports_its_memory():
    ex = FakeExecutor(num_blocks=100, block_size=16)
    assert isinstance(ex, Executor)
    (spec,) = ex.get_kv_cache_specs()
    assert ex.determine_available_memory()[0] // spec.page_size_bytes == 100
    assert ex.collective_rpc("determine_available_memory") == [ex.determine_available_memory()]
    assert ex.collective_rpc(lambda self, x: x + 1, args=(1,)) == [2]


def test_tokens_are_a_pure_function_of_the_sequence():
    ex = FakeExecutor(vocab_size=50)
    assert ex.next_token([3, 4], 1) == ex.next_token([3, 4], 1) == 1 + (31 * 4 + 2) % 49
    assert ex.next_token([3, 4], 1) != 0  # never the EOS id by accident
    fixed = FakeExecutor(token_ids=[7, 8])
    assert [fixed.next_token([1] * (5 + i), 5) for i in range(3)] == [7, 8, 7]
    eos = FakeExecutor(eos_after=2, eos_token_id=9)
    assert eos.next_token([1, 1, 1, 1], 2) == 9


def test_contract_violations_fail_loudly():
    ex = FakeExecutor(num_blocks=8, block_size=4)
    bad = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["ghost"], new_token_ids=[[]], new_block_ids=[[]], num_computed_tokens=[0]
        ),
        num_scheduled_tokens={"ghost": 1},
        total_num_scheduled_tokens=1,
    )
    with pytest.raises(AssertionError, match="unknown"):
        ex.execute_model(bad)
    ex.execute_model(
        SchedulerOutput(
            scheduled_new_reqs=[_new("a", [1, 2, 3], [1])],
            num_scheduled_tokens={"a": 3},
            total_num_scheduled_tokens=3,
        )
    )
    # another request writing into a's block
    with pytest.raises(AssertionError, match="writes block 1"):
        ex.execute_model(
            SchedulerOutput(
                scheduled_new_reqs=[_new("b", [5, 6], [1])],
                num_scheduled_tokens={"b": 2},
                total_num_scheduled_tokens=2,
            )
        )
    ex2 = FakeExecutor(num_blocks=8, block_size=4)
    ex2.execute_model(
        SchedulerOutput(
            scheduled_new_reqs=[_new("a", [1, 2, 3, 4, 5], [1, 2])],
            num_scheduled_tokens={"a": 5},
            total_num_scheduled_tokens=5,
        )
    )
    # a 'prefix hit' on a block that holds other tokens
    with pytest.raises(AssertionError, match="KV at position 0"):
        ex2.execute_model(
            SchedulerOutput(
                scheduled_new_reqs=[_new("c", [9, 9, 9, 9, 9], [1, 3], computed=4)],
                num_scheduled_tokens={"c": 1},
                total_num_scheduled_tokens=1,
            )
        )


def test_failure_injection_raise():
    s = make_scheduler()
    d = SchedulerDriver(s, fail_at_step=2)
    d.add(make_request("a", 10))
    d.step()
    d.step()
    with pytest.raises(ExecutorError, match="step 2"):
        d.step()
    d.executor.check_health()  # "raise" leaves it alive


def test_failure_injection_die_calls_back_and_stays_dead():
    ex = FakeExecutor(fail_at_step=0, fail_mode="die", max_concurrent_batches=2)
    called = threading.Event()
    seen = []
    ex.register_failure_callback(lambda e: (seen.append(e), called.set()))
    fut = ex.execute_model(SchedulerOutput(), non_block=True)
    with pytest.raises(ExecutorError):
        fut.result(timeout=5)
    assert called.wait(5) and isinstance(seen[0], ExecutorError)
    with pytest.raises(ExecutorError):
        ex.check_health()
    with pytest.raises(ExecutorError, match="failed earlier"):
        ex.execute_model(SchedulerOutput())
    ex.shutdown()


def test_latency_is_simulated_or_slept():
    ex = FakeExecutor(
        prefill_s_per_token=0.001,
        decode_s_per_token=0.01,
        latency_s=0.5,
        simulate_time=True,
        block_size=4,
        num_blocks=8,
    )
    ex.execute_model(
        SchedulerOutput(
            scheduled_new_reqs=[_new("a", [1, 2, 3], [1])],
            num_scheduled_tokens={"a": 3},
            total_num_scheduled_tokens=3,
        )
    )
    assert ex.simulated_time == pytest.approx(0.5 + 0.003)


def test_registered_only_when_asked_for():
    plugins = Plugins()
    plugins.load_entry_points(environ={"BATON_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert "fake" not in plugins.registry.names("executor")
    register_fake_executor(plugins)
    register_fake_executor(plugins)  # idempotent
    entry = plugins.registry.get("executor", "fake")
    assert entry.distribution == "baton-core" and entry.settings_model is FakeExecutorSettings
    cfg = make_config()
    ex = entry.create(cfg, FakeExecutorSettings(num_blocks=33))
    assert ex.determine_available_memory()[0] // ex.get_kv_cache_specs()[0].page_size_bytes == 33
    ex.initialize_kv_cache(KVCacheConfig(num_blocks=20, block_size=16))
    assert ex.num_blocks == 20
