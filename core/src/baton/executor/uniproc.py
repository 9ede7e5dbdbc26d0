"""The default executor: one Worker in the engine process, on CPU or one CUDA device.

Steps run on one dedicated thread, so ``execute_model(non_block=True)`` returns
a Future at once and the engine core computes grammar bitmasks while the
forward runs. The first failure marks the executor dead, runs the failure
callbacks once and makes every later call raise ExecutorError.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from baton.config import BatonConfig
from baton.errors import BatonError, ExecutorError
from baton.hookspecs import hookimpl
from baton.protocol import (
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    ModelInfo,
    ModelRunnerOutput,
    SchedulerOutput,
)

log = logging.getLogger(__name__)


class UniprocExecutor:
    """Implements ``baton.interfaces.Executor`` with one in-process Worker."""

    max_concurrent_batches = 1

    def __init__(self, config: BatonConfig, settings: Any = None) -> None:
        from baton.worker.worker import Worker

        if config.executor.tensor_parallel_size != 1 or config.executor.pipeline_parallel_size != 1:
            raise ExecutorError(
                "executor 'uniproc' runs one worker: tensor_parallel_size and pipeline_parallel_size must be 1 "
                "(use executor.backend = 'cuda-tp' or 'pipeline')"
            )
        self.config = config
        self._callbacks: list[Callable[[BaseException], None]] = []
        self._failure: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-uniproc")
        self.worker = Worker(config)
        try:
            # on the step thread: torch's thread settings and inference state are per thread
            self._call(self._init_worker)
        except BaseException:
            self.shutdown()
            raise
        self.model_info: ModelInfo = self.worker.get_model_info()
        self.model_capabilities: tuple[bool, bool, str] = self.worker.get_model_capabilities()

    def _init_worker(self) -> None:
        self.worker.init_device()
        self.worker.load_model()

    # ------------------------------------------------------------------ plumbing

    def _submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        if self._closed:
            raise ExecutorError("the uniproc executor is shut down")
        if self._failure is not None:
            raise ExecutorError(
                f"the uniproc executor failed earlier: {self._failure!r}"
            ) from self._failure
        return self._thread.submit(self._guarded, fn, *args, **kwargs)

    def _guarded(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            self._fail(e)
            if isinstance(e, BatonError):
                raise
            raise ExecutorError(f"model execution failed: {type(e).__name__}: {e}") from e

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
            callbacks = list(self._callbacks)
        log.error("uniproc executor failed: %r", error)
        for cb in callbacks:
            try:
                cb(error)
            except Exception:
                log.exception("executor failure callback %r raised", cb)

    def _call(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        future = self._submit(fn, *args, **kwargs)
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise ExecutorError(
                f"{getattr(fn, '__name__', fn)} did not finish within {timeout} s"
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

        return [self._call(fn, *args, timeout=timeout, **(kwargs or {}))]

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        with self._lock:
            failed = self._failure
            if failed is None:
                self._callbacks.append(callback)
        if failed is not None:  # registered after the failure: it still learns of it
            callback(failed)

    def check_health(self) -> None:
        if self._failure is not None:
            raise ExecutorError(f"the uniproc executor failed: {self._failure!r}")
        if self._closed:
            raise ExecutorError("the uniproc executor is shut down")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._thread.shutdown(wait=True, cancel_futures=True)
        self.worker.shutdown()


def create_uniproc_executor(config: BatonConfig, settings: Any = None) -> UniprocExecutor:
    return UniprocExecutor(config, settings)


@hookimpl
def register_executors(register: Any) -> None:
    register("uniproc", create_uniproc_executor)
