"""The default executor: one Worker in the engine process, on CPU or one CUDA device.

Steps run on one dedicated thread, so ``execute_model(non_block=True)`` returns
a Future at once and the engine core computes grammar bitmasks while the
forward runs. The first failure marks the executor dead, runs the failure
callbacks once and makes every later call raise ExecutorError (its
``FailureLatch``); a ``collective_rpc`` target that raises fails that call alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from baton.config import BatonConfig
from baton.errors import BatonError, ExecutorError, worker_error
from baton.executor.latch import FailureLatch
from baton.plugins.hookspecs import hookimpl
from baton.protocol import (
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    ModelCapabilities,
    ModelInfo,
    ModelRunnerOutput,
    SchedulerOutput,
)

log = logging.getLogger(__name__)


class UniprocExecutor:
    """Implements ``baton.interfaces.Executor`` with one in-process Worker."""

    max_concurrent_batches = 1

    def __init__(self, config: BatonConfig, settings: Any = None) -> None:
        # torch loads when an engine starts, not when the plugins load (this module is an entry point)
        from baton.worker.worker import Worker

        if config.executor.tensor_parallel_size != 1 or config.executor.pipeline_parallel_size != 1:
            raise ExecutorError(
                "executor 'uniproc' runs one worker: tensor_parallel_size and pipeline_parallel_size must be 1 "
                "(use executor.backend = 'cuda-tp' or 'pipeline')"
            )
        self.config = config
        self._latch = FailureLatch("uniproc")
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-uniproc")
        self.worker = Worker(config)
        try:
            # torch, as above
            from baton.parallel.expert import expert_parallel_runner, expert_parallel_size

            # this engine's experts only (issue 18)
            if expert_parallel_size(config.executor, config.model) > 1:
                self.worker.runner_cls = expert_parallel_runner
            # on the step thread: torch's thread settings and inference state are per thread
            self._call(self._init_worker)
        except BaseException:
            self.shutdown()
            raise
        self.model_info: ModelInfo = self.worker.get_model_info()
        self.model_capabilities: ModelCapabilities | None = self.worker.get_model_capabilities()

    def _init_worker(self) -> None:
        self.worker.init_device()
        self.worker.load_model()

    # ------------------------------------------------------------------ plumbing

    def _submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        self._latch.check()
        return self._thread.submit(self._guarded, fn, *args, **kwargs)

    @staticmethod
    def _contained(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A collective_rpc target: its exception fails the call, not the executor."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise worker_error(0, f"{type(e).__name__}: {e}") from e

    def _guarded(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            self._latch.fail(e)
            if isinstance(e, BatonError):
                raise
            raise ExecutorError(f"model execution failed: {type(e).__name__}: {e}") from e

    def _call(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        return self._result(self._submit(fn, *args, **kwargs), timeout, fn)

    @staticmethod
    def _result(future: Future[Any], timeout: float | None, what: Any) -> Any:
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise ExecutorError(
                f"{getattr(what, '__name__', what)} did not finish within {timeout} s"
            ) from None

    # ------------------------------------------------------------------ Executor

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        return [self._call(self.worker.get_kv_cache_spec)]

    def determine_available_memory(self) -> list[int]:
        return [self._call(self.worker.determine_available_memory)]

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        self._call(self.worker.initialize_kv_cache, config)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput | None] | None:
        future = self._submit(self.worker.execute_model, scheduler_output)
        return future if non_block else future.result()

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        future = self._submit(self.worker.sample_tokens, grammar_output)
        return future if non_block else future.result()

    def execute_dummy_batch(self) -> None:
        """A forward of one token that no request owns (written to the null KV block): an
        expert-parallel engine with nothing to run keeps its collectives in step with the
        others'."""
        self._call(self._dummy_batch)

    def _dummy_batch(self) -> None:
        runner = self.worker.model_runner
        dummy = getattr(runner, "execute_dummy_batch", None)
        if not callable(dummy):
            raise ExecutorError(
                f"runner {type(runner).__name__} has no execute_dummy_batch(): it cannot run in "
                "an expert-parallel group; use baton's stock runner"
            )
        dummy()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        if isinstance(method, str):
            fn = getattr(self.worker, method, None)
            if fn is None or not callable(fn):
                raise ExecutorError(f"the worker has no method {method!r}")
        else:

            def fn(*a: Any, **k: Any) -> Any:
                return method(self.worker, *a, **k)

        self._latch.check()
        future = self._thread.submit(self._contained, fn, *args, **(kwargs or {}))
        return [self._result(future, timeout, method)]

    def sleep(self, level: int) -> None:
        """Free the KV cache (level 1) and the weights too (level 2): ``Worker.sleep``."""
        if not self.worker.can_sleep():
            runner = type(self.worker.model_runner).__name__
            raise ExecutorError(
                f"runner {runner} has no sleep()/wake_up() (baton.interfaces.Sleepable): it "
                "cannot free its memory; use baton.runner.StockRunner or implement them"
            )
        self._call(self.worker.sleep, level)

    def wake_up(self) -> None:
        """Load the weights and allocate the KV cache again: ``Worker.wake_up``."""
        self._call(self.worker.wake_up)

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        self._latch.register(callback)

    def check_health(self) -> None:
        self._latch.check()

    def shutdown(self) -> None:
        if not self._latch.close():
            return
        self._thread.shutdown(wait=True, cancel_futures=True)
        self.worker.shutdown()


def create_uniproc_executor(config: BatonConfig, settings: Any = None) -> UniprocExecutor:
    return UniprocExecutor(config, settings)


@hookimpl
def register_executors(register: Any) -> None:
    register("uniproc", create_uniproc_executor)
