"""The executor conformance suite for ``ray`` (TP=2 ranks as actors on the local 2-node cluster).

Starting actors costs seconds on 2 cores, so the suite shares one executor between
its tests (each sizes the KV cache again; request ids differ between tests). The
failure test gets an executor of its own (PP=2: a stage actor is killed); the
idempotent-shutdown test, the last to run, shuts the shared one down.
"""

from __future__ import annotations

from typing import Any

import pytest

from baton.errors import ExecutorError
from baton.testing.conformance.executor import ExecutorConformance
from tests.plugins.ray.conftest import assert_nothing_left, ray

OVERRIDES: dict[str, Any] = {"executor": "ray", "tensor_parallel_size": 2}
#: Tests that break their executor: each gets one of its own.
DESTRUCTIVE = {"test_failure_callback_and_health"}


def build(config: Any) -> Any:
    from baton.plugins.registry import get_registry

    entry = get_registry().get("executor", config.executor.backend)
    return entry.create(
        config, config.plugin_settings("executor", entry.name, entry.settings_model)
    )


def suite_config() -> Any:
    from baton.testing.tiny_model import tiny_model

    return (
        ExecutorConformance()
        .engine_config()
        .replace(
            model=str(tiny_model("llama")), kv_cache_memory="64MiB", num_threads=1, **OVERRIDES
        )
    )


@pytest.fixture(scope="module")
def shared(ray_cluster):
    ex = build(suite_config())
    yield ex
    ex.shutdown()
    assert_nothing_left(ex)


# before the suite: its last test shuts the shared executor down
def test_unknown_rpc_method_is_refused_and_the_executor_stays_healthy(shared):
    with pytest.raises(ExecutorError, match="no method 'no_such_method'"):
        shared.collective_rpc("no_such_method")
    shared.check_health()
    assert len(shared.collective_rpc("check_health")) == shared.world_size


def test_every_rank_sleeps_and_wakes_up(shared):
    from baton.protocol import KVCacheConfig

    shared.initialize_kv_cache(KVCacheConfig(num_blocks=16, block_size=16))
    awake = [
        (m.rank, m.kv_cache_bytes, m.weights_bytes) for m in shared.collective_rpc("memory_usage")
    ]
    assert [a[0] for a in awake] == [0, 1] and all(a[1] > 0 and a[2] > 0 for a in awake)
    for level in (1, 2):
        shared.sleep(level)
        asleep = shared.collective_rpc("memory_usage")
        assert [m.kv_cache_bytes for m in asleep] == [0, 0]
        kept = [a[2] for a in awake] if level == 1 else [0, 0]
        assert [m.weights_bytes for m in asleep] == kept
        shared.wake_up()
        back = [
            (m.rank, m.kv_cache_bytes, m.weights_bytes)
            for m in shared.collective_rpc("memory_usage")
        ]
        assert back == awake


class TestRayConformance(ExecutorConformance):
    rpc_method = "check_health"

    def engine_config(self):
        return suite_config()

    @pytest.fixture
    def executor(self, request, shared, config):
        if request.node.originalname in DESTRUCTIVE:
            ex = build(config.replace(tensor_parallel_size=1, pipeline_parallel_size=2))
            yield ex
            ex.shutdown()
            assert_nothing_left(ex)
            return
        yield shared

    def inject_failure(self, executor) -> bool:
        ray.kill(executor.actors[0])  # stage 0: stage 1, the driver, waits for it
        return True
