"""GroupExecutor: the ``Executor`` methods of an executor whose ranks answer calls.

``MultiprocExecutor`` (worker processes of a ``WorkerGroup``) and the ``ray`` executor (Ray
actors) differ only in how a call reaches the ranks and how they are watched; the steps, the
samples, ``collective_rpc`` and the calls built on it (the KV cache, sleep, ``parallel_stats``)
are the same. A subclass sets the attributes below and implements ``_call`` (send a call,
a Future of its answers) and ``_book`` (the ``CallBook`` that settles them); it may override
``_step_payload`` (how a step's frames travel: the ray executor puts a large step in Ray's
object store once).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from baton.errors import BatonError, ExecutorError
from baton.executor.calls import CallBook
from baton.executor.rank import StepCodec, parallel_stats
from baton.executor.wire import Kind
from baton.interfaces import RunnerFactory
from baton.protocol import (
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    ModelRunnerOutput,
    SchedulerOutput,
)


class CallTimeouts(Protocol):
    """What GroupExecutor reads of an executor's settings (MultiprocSettings, RaySettings)."""

    #: Seconds a start-up call (KV cache, sleep, wake up) may take.
    startup_timeout: float
    #: Seconds after which an unanswered step fails the executor.
    step_timeout: float


class GroupExecutor(ABC):
    """``baton.interfaces.Executor``'s calls over ranks that answer them (see the module
    docstring). The driver rank (the last stage's first) alone answers steps and samples."""

    #: The executor's registered name (messages).
    name: str
    settings: CallTimeouts
    #: The rank that answers steps and samples.
    driver: int
    runner: RunnerFactory
    #: Seconds each step's broadcast took here (encode the SchedulerOutput, send it).
    broadcast_s: deque[float]
    #: Encodes steps (under _encode_lock) and decodes the driver's answers.
    _codec: StepCodec
    _encode_lock: threading.Lock

    @abstractmethod
    def _call(
        self,
        kind: Kind,
        payload: Any,
        *,
        to: list[int] | None = None,
        reply_from: int | None = None,
        decode: Callable[[list[Any]], Any] = StepCodec.decode_rpc,
        fail_after: float | None = None,
        chained: bool = False,
    ) -> Future[Any]:
        """Send ``payload`` to the ranks ``to`` (default all): a Future of their answers in
        rank order, or of ``reply_from``'s alone (``WorkerGroup.call``'s arguments)."""

    @abstractmethod
    def _book(self) -> CallBook:
        """The call book settling this executor's calls (ExecutorError if it never started)."""

    def _step_payload(self, frames: list[Any]) -> Any:
        """What a step's encoded frames travel as (default: the frames)."""
        return frames

    # ------------------------------------------------------------------ steps

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput | None] | None:
        t0 = time.perf_counter()
        with self._encode_lock:
            frames = self._codec.encode_step(scheduler_output)
        future = self._call(
            Kind.EXECUTE,
            self._step_payload(frames),
            reply_from=self.driver,
            decode=self._codec.decode_output,
            fail_after=self.settings.step_timeout,
            chained=True,
        )
        if scheduler_output.total_num_scheduled_tokens:
            self.broadcast_s.append(time.perf_counter() - t0)
        return future if non_block else future.result()

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        with self._encode_lock:
            payload = (
                self._codec.encode_grammar(grammar_output) if grammar_output is not None else []
            )
        future = self._call(
            Kind.SAMPLE,
            payload,
            to=[self.driver],
            reply_from=self.driver,
            decode=self._codec.decode_output,
            fail_after=self.settings.step_timeout,
        )
        return future if non_block else future.result()

    # ------------------------------------------------------------------ calls on every rank

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        frames = StepCodec.encode_rpc(method, args, kwargs)  # checks the method first
        future = self._call(Kind.RPC, frames)
        return self._book().wait(  # type: ignore[no-any-return]
            future, timeout, f"collective_rpc {getattr(method, '__name__', method)!r}"
        )

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        return self.collective_rpc("get_kv_cache_spec", timeout=self.settings.startup_timeout)

    def determine_available_memory(self) -> list[int]:
        return self.collective_rpc(
            "determine_available_memory", timeout=self.settings.startup_timeout
        )

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        self._rpc_or_fail("initialize_kv_cache", config)

    def _rpc_or_fail(self, method: str, *args: Any) -> list[Any]:
        """``collective_rpc`` of a call whose failure leaves the ranks' state unknown (the KV
        cache, sleep): its error fails the executor, as a step's does."""
        try:
            return self.collective_rpc(method, args, timeout=self.settings.startup_timeout)
        except BatonError as e:
            self._book().fail(e)
            raise

    def sleep(self, level: int) -> None:
        """Every rank frees its KV cache (level 1) and its weights too (level 2)."""
        timeout = self.settings.startup_timeout
        if not all(self.collective_rpc("can_sleep", timeout=timeout)):
            raise ExecutorError(
                f"executor {self.name!r}: its runner ({self.runner!r}) has no sleep()/wake_up() "
                "(baton.interfaces.Sleepable): it cannot free its memory; use "
                "baton.runner.StockRunner or implement them"
            )
        self._rpc_or_fail("sleep", level)

    def wake_up(self) -> None:
        """Every rank loads its weights (its shard) and allocates its KV cache again."""
        self._rpc_or_fail("wake_up")

    def parallel_stats(self, timeline: bool = False) -> list[dict[str, Any]]:
        """Each rank's per-step timings: broadcast delivery, all-reduce, gather, send/recv, step
        (and with ``timeline`` when each step ran)."""
        return self.collective_rpc(parallel_stats, kwargs={"timeline": timeline}, timeout=30)

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """``callback(error)`` runs once on the executor's first failure (at once if it failed)."""
        self._book().latch.register(callback)
