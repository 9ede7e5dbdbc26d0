"""The executor conformance suite against the FakeExecutor and the uniproc executor (tiny random model)."""

from __future__ import annotations

import importlib.util

import pytest

from baton.config import BatonConfig
from baton.errors import ExecutorError
from baton.testing import FakeExecutor
from baton.testing.conformance.executor import ExecutorConformance
from tests.core.test_uniproc_executor import ghost_step


class TestFakeExecutorConformance(ExecutorConformance):
    rpc_method = "check_health"
    worker_memory = False  # no worker: it runs no model

    @pytest.fixture
    def executor(self, config: BatonConfig):
        ex = FakeExecutor(block_size=config.cache.block_size, deep_check=True)
        yield ex
        ex.shutdown()

    def inject_failure(self, executor: FakeExecutor) -> bool:
        executor.settings.fail_at_step = executor.num_steps
        executor.settings.fail_mode = "die"
        with pytest.raises(ExecutorError):
            executor.execute_model(ExecutorConformance.empty_output())
        return True


@pytest.mark.skipif(
    importlib.util.find_spec("baton.executor.uniproc") is None, reason="uniproc not built"
)
class TestUniprocConformance(ExecutorConformance):
    rpc_method = "memory_usage"

    def engine_config(self) -> BatonConfig:
        from baton.testing.tiny_model import tiny_model

        return (
            super()
            .engine_config()
            .replace(model=str(tiny_model("llama")), kv_cache_memory="64MiB", num_threads=1)
        )

    @pytest.fixture
    def executor(self, config: BatonConfig):
        from baton.executor.uniproc import UniprocExecutor

        ex = UniprocExecutor(config)
        yield ex
        ex.shutdown()

    def inject_failure(self, executor) -> bool:
        with pytest.raises(ExecutorError, match="ghost"):
            executor.execute_model(ghost_step())
        return True
