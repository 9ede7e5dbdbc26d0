"""The multiprocess executor that parallel executor plugins compose (tensor and pipeline parallel).

A plugin builds ``MultiprocExecutor(config, settings, tp_size, pp_size, name=...,
runner=StockRunner(MyHooks), max_concurrent_batches=...)`` in its factory; it
does not subclass it. It starts ``tp_size * pp_size`` worker processes (spawn),
each building its runner with the ``runner`` factory (``baton.interfaces.RunnerFactory``,
pickled to the worker). Executor and workers talk over a transport plugin's channel: the
executor holds the client end (``create_client(num_engines=world_size)``), each
worker the engine end of its index. A step's SchedulerOutput is encoded once
and the same frames are sent to every worker (the broadcast); only the driver
rank answers it. The torch.distributed rendezvous is a TCPStore the executor
binds on 127.0.0.1 at a free port.

One thread reads the workers' answers and watches their processes: a worker
that exits, reports an error, misses its heartbeats for ``heartbeat_timeout``
seconds (a stopped or frozen process), or leaves a step unanswered for
``step_timeout`` seconds (stuck in its main thread) fails the executor: every pending call raises
ExecutorError and the failure callbacks run once. Step results are delivered
on a second thread, so a callback that calls ``sample_tokens`` (the core's batch
queue does) never blocks the reader it waits for.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, ClassVar

from baton.config import BatonConfig
from baton.errors import BatonError, ExecutorError
from baton.executor import wire
from baton.executor.heartbeat import Heartbeats
from baton.executor.latch import FailureLatch
from baton.executor.wire import Kind
from baton.executor.workers import MultiprocSettings, pick_device, pick_transport, spawn_workers
from baton.interfaces import RunnerFactory
from baton.protocol import (
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    ModelCapabilities,
    ModelInfo,
    ModelRunnerOutput,
    SchedulerOutput,
)
from baton.serial import MsgpackDecoder, MsgpackEncoder

log = logging.getLogger(__name__)


class _Call:
    """A message waiting for answers from ``expect`` ranks."""

    __slots__ = ("deadline", "expect", "future", "id", "kind", "results")

    def __init__(self, call_id: int, kind: Kind, expect: set[int], deadline: float | None) -> None:
        self.id = call_id
        self.kind = kind
        self.expect = expect
        self.deadline = deadline
        self.results: dict[int, Any] = {}
        self.future: Future[Any] = Future()


class MultiprocExecutor:
    """Implements ``baton.interfaces.Executor`` with worker processes (see the module docstring).

    ``runner`` makes each worker's runner (default: baton's stock runner);
    ``name`` is the executor's registered name (threads, messages);
    ``max_concurrent_batches`` > 1 lets the core keep that many batches in flight
    (a pipeline). Subclassing with the class attributes ``name`` and ``runner_cls``
    (a "module:Class" string) still works but is deprecated.
    """

    #: Deprecated: pass ``name=`` instead.
    name: ClassVar[str] = "multiproc"
    #: Deprecated: pass ``runner=`` (a RunnerFactory) instead of a "module:Class" string.
    runner_cls: ClassVar[str | None] = None

    def __init__(
        self,
        config: BatonConfig,
        settings: MultiprocSettings | None,
        tp_size: int,
        pp_size: int,
        *,
        name: str | None = None,
        runner: RunnerFactory | None = None,
        max_concurrent_batches: int | None = None,
    ) -> None:
        import torch.distributed as dist

        self.config = config
        self.settings = s = settings or MultiprocSettings()
        self.name = name or type(self).name  # type: ignore[misc]
        self.runner: RunnerFactory = self._runner_factory(runner)
        self.max_concurrent_batches = (
            max_concurrent_batches or getattr(self, "max_concurrent_batches", None) or 1
        )
        if self.max_concurrent_batches < 1:
            raise ExecutorError(
                f"executor {self.name!r}: max_concurrent_batches={max_concurrent_batches}, "
                "must be at least 1"
            )
        self.tp_size, self.pp_size = tp_size, pp_size
        self.world_size = tp_size * pp_size
        self.driver = (pp_size - 1) * tp_size
        self._latch = FailureLatch(self.name)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._encoder = MsgpackEncoder()
        self._out_decoder = MsgpackDecoder(ModelRunnerOutput)
        self._done: queue.SimpleQueue[tuple[Future[Any], Any, BaseException | None] | None] = (
            queue.SimpleQueue()
        )
        self.procs: list[Any] = []
        #: Each worker's last heartbeat (baton.executor.heartbeat), watched by the reader thread.
        self.heartbeats = Heartbeats(self.world_size)
        self.channel: Any = None
        self._store: Any = None
        #: Seconds each step's broadcast took here: encode the SchedulerOutput, send it to every worker.
        self.broadcast_s: deque[float] = deque(maxlen=4096)
        self._reader = threading.Thread(
            target=self._read_loop, name=f"baton-{self.name}-reader", daemon=True
        )
        self._completer = threading.Thread(
            target=self._complete_loop, name=f"baton-{self.name}-done", daemon=True
        )

        device = pick_device(config, self.world_size, self.name)
        backend = s.backend if s.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
        transport = pick_transport(config, s.transport)
        try:
            self.channel = transport.create_client(self.world_size)
            # the rendezvous: bound here, at a free port, before any worker starts
            self._store = dist.TCPStore(
                "127.0.0.1",
                0,
                None,
                True,
                timeout=timedelta(seconds=s.dist_timeout),
                wait_for_workers=False,
            )
            ready = self._new_call(Kind.READY, set(range(self.world_size)), None, call_id=0)
            self._reader.start()
            self._completer.start()
            self.procs = spawn_workers(self, transport, backend, device, self._store.port)
            infos: list[wire.WorkerReady] = self._wait(
                ready, s.startup_timeout, "the workers to start"
            )
        except BaseException:
            self.shutdown()
            raise
        self.model_info: ModelInfo | None = infos[self.driver].model_info
        self.model_capabilities: ModelCapabilities | None = infos[self.driver].capabilities
        log.info(
            "%s: %d workers ready (pids %s, %s, channel %s)",
            self.name,
            self.world_size,
            [i.pid for i in infos],
            backend,
            transport,
        )

    def _runner_factory(self, runner: RunnerFactory | None) -> RunnerFactory:
        legacy = type(self).runner_cls
        if runner is not None:
            if not callable(runner):
                raise ExecutorError(
                    f"executor {self.name!r}: runner={runner!r} is not a runner factory "
                    "(a callable taking (config, device), e.g. baton.runner.StockRunner())"
                )
            return runner
        if legacy is None:
            from baton.runner import StockRunner

            return StockRunner()
        warnings.warn(
            f"{type(self).__qualname__}.runner_cls = {legacy!r} is deprecated: pass "
            "MultiprocExecutor(..., runner=<a RunnerFactory, e.g. baton.runner.StockRunner(hooks)>)",
            DeprecationWarning,
            stacklevel=3,
        )
        import importlib

        module, _, attr = legacy.partition(":")
        return getattr(importlib.import_module(module), attr)

    # ------------------------------------------------------------------ calls

    def _new_call(
        self, kind: Kind, expect: set[int], timeout: float | None, call_id: int | None = None
    ) -> _Call:
        with self._lock:
            self._latch.check()
            call = _Call(
                next(self._ids) if call_id is None else call_id,
                kind,
                expect,
                time.monotonic() + timeout if timeout else None,
            )
            self._calls[call.id] = call
        return call

    def _send(self, kind: Kind, call: _Call, payload: list[Any], ranks: range | list[int]) -> None:
        with self._send_lock:
            frames = [wire.request(kind, call.id, time.monotonic()), *payload]
            try:
                for r in ranks:
                    self.channel.send(frames, r)
            except BatonError as e:
                self._fail(ExecutorError(f"cannot reach a worker: {e}"))
                raise ExecutorError(f"the {self.name} executor cannot reach a worker: {e}") from e

    def _call(
        self, kind: Kind, payload: list[Any], ranks: range | list[int], timeout: float | None
    ) -> _Call:
        call = self._new_call(kind, set(ranks), timeout)
        self._send(kind, call, payload, ranks)
        return call

    def _wait(self, call: _Call, timeout: float | None, what: str) -> Any:
        try:
            return call.future.result(timeout)
        except FutureTimeout:
            with self._lock:
                self._calls.pop(call.id, None)
            raise ExecutorError(
                f"{self.name}: timed out after {timeout} s waiting for {what}"
            ) from None

    # ------------------------------------------------------------------ reader, watchdog, completer

    def _read_loop(self) -> None:
        decode = {Kind.READY: pickle.loads, Kind.RPC: pickle.loads}
        next_check = 0.0
        while not self._latch.closed:
            try:
                frames = self.channel.recv(timeout=0.05)
            except BatonError as e:
                if not self._latch.closed:
                    self._fail(
                        ExecutorError(
                            f"the worker channel failed: {e}; {self._dead_workers() or ''}"
                        )
                    )
                return
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.05
                self._watch(now)
            if frames is None:
                continue
            kind, call_id, rank, ok = wire.REPLY.unpack(bytes(frames[0]))
            if not ok:
                self._fail(ExecutorError(bytes(frames[1]).decode(errors="replace")))
                continue
            with self._lock:
                call = self._calls.get(call_id)
            if call is None:
                continue  # its waiter timed out or the executor failed
            try:
                if kind in decode:
                    value = decode[kind](frames[1])
                else:
                    value = self._out_decoder.decode(frames[1:]) if len(frames) > 1 else None
            except Exception as e:
                self._fail(ExecutorError(f"worker {rank} sent an unreadable answer: {e}"))
                continue
            call.results[rank] = value
            if call.expect.issubset(call.results):
                with self._lock:
                    if self._calls.pop(call_id, None) is None:
                        continue  # failed or timed out meanwhile: settled elsewhere
                if kind in (Kind.EXECUTE, Kind.SAMPLE):
                    self._settle(call, value, None)
                else:
                    self._settle(call, [call.results[r] for r in sorted(call.expect)], None)

    def _settle(self, call: _Call, value: Any, error: BaseException | None) -> None:
        """Resolve a call's future once. Step results go through the completer thread: the core's
        batch queue chains sample_tokens onto them, and that must not block this reader."""
        if call.kind == Kind.EXECUTE:
            self._done.put((call.future, value, error))
        elif error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(value)

    def _complete_loop(self) -> None:
        while (item := self._done.get()) is not None:
            future, value, error = item
            if not future.done():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(value)

    def _dead_workers(self) -> str | None:
        dead = [
            f"worker {r} (pid {p.pid}) exited with code {p.exitcode}"
            for r, p in enumerate(self.procs)
            if p.exitcode is not None
        ]
        return "; ".join(dead) or None

    def _watch(self, now: float) -> None:
        if self._latch.closed or self._latch.failure is not None:
            return
        dead = self._dead_workers()
        if dead:
            self._fail(ExecutorError(dead))
            return
        limit = self.settings.heartbeat_timeout
        silent = self.heartbeats.silent(now, limit)
        if silent:
            rank, quiet = silent[0]
            self._fail(
                ExecutorError(
                    f"worker {rank} (pid {self.procs[rank].pid}) sent no heartbeat for "
                    f"{quiet:.1f} s: it is stopped or frozen (executor heartbeat_timeout={limit})"
                )
            )
            return
        with self._lock:
            late = [c for c in self._calls.values() if c.deadline is not None and now > c.deadline]
        if late:
            self._fail(
                ExecutorError(
                    f"a {late[0].kind.name.lower()} call was not answered within {self.settings.step_timeout} s: "
                    "a worker hangs (executor step_timeout)"
                )
            )

    def _fail(self, error: BaseException) -> None:
        with self._lock:  # latched with the pending calls taken: no call slips in between
            callbacks = self._latch.trip(error)
            if callbacks is None:
                return
            calls, self._calls = list(self._calls.values()), {}
        for c in calls:
            self._settle(c, None, ExecutorError(f"the {self.name} executor failed: {error}"))
        self._latch.notify(error, callbacks)

    # ------------------------------------------------------------------ Executor

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        if isinstance(method, str):
            from baton.worker.worker import Worker

            if not callable(getattr(Worker, method, None)):  # a typo must not fail every worker
                raise ExecutorError(f"the worker has no method {method!r}")
        payload = pickle.dumps(
            (method, tuple(args), kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL
        )
        call = self._call(Kind.RPC, [payload], range(self.world_size), None)
        return self._wait(call, timeout, f"collective_rpc {getattr(method, '__name__', method)!r}")

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        return self.collective_rpc("get_kv_cache_spec", timeout=self.settings.startup_timeout)

    def determine_available_memory(self) -> list[int]:
        return self.collective_rpc(
            "determine_available_memory", timeout=self.settings.startup_timeout
        )

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        self.collective_rpc("initialize_kv_cache", (config,), timeout=self.settings.startup_timeout)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput | None] | None:
        t0 = time.perf_counter()
        with self._send_lock:
            payload = self._encoder.encode(scheduler_output)
        call = self._new_call(Kind.EXECUTE, {self.driver}, self.settings.step_timeout)
        self._send(Kind.EXECUTE, call, payload, range(self.world_size))
        if scheduler_output.total_num_scheduled_tokens:
            self.broadcast_s.append(time.perf_counter() - t0)
        return call.future if non_block else call.future.result()

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        with self._send_lock:
            payload = self._encoder.encode(grammar_output) if grammar_output is not None else []
        call = self._call(Kind.SAMPLE, payload, [self.driver], self.settings.step_timeout)
        return call.future if non_block else call.future.result()

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        self._latch.register(callback)

    def check_health(self) -> None:
        self._watch(time.monotonic())
        self._latch.check()

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def parallel_stats(self, timeline: bool = False) -> list[dict[str, Any]]:
        """Each rank's per-step timings: broadcast delivery, all-reduce, gather, send/recv, step
        (and with ``timeline`` when each step ran)."""
        from baton.worker.worker_proc import parallel_stats

        return self.collective_rpc(parallel_stats, kwargs={"timeline": timeline}, timeout=30)

    def shutdown(self) -> None:
        with self._lock:
            if not self._latch.close():
                return
            healthy = self._latch.failure is None
            calls, self._calls = list(self._calls.values()), {}
        for c in calls:
            self._settle(c, None, ExecutorError(f"the {self.name} executor is shut down"))
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        if alive and self.channel is not None:
            try:
                with self._send_lock:
                    frames = [wire.request(Kind.SHUTDOWN, 0, time.monotonic())]
                    for r in alive:
                        self.channel.send(frames, r)
            except BatonError as e:
                log.debug("%s: shutdown message not delivered: %s", self.name, e)
        deadline = time.monotonic() + (5.0 if healthy else 1.0)
        for p in self.procs:
            p.join(timeout=max(0.05, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                log.warning("%s: worker pid %s did not exit; killing it", self.name, p.pid)
                p.kill()
                p.join(timeout=5)
        self._done.put(None)
        for t in (self._reader, self._completer):
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=2)
        if self.channel is not None:
            self.channel.close()
        self._store = None
