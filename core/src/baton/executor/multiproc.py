"""The multiprocess executor that parallel executor plugins compose (tensor and pipeline parallel).

A plugin builds ``MultiprocExecutor(config, settings, tp_size, pp_size, name=...,
runner=StockRunner(MyHooks), max_concurrent_batches=...)`` in its factory; it
does not subclass it. It starts ``tp_size * pp_size`` worker processes with a
``WorkerGroup`` (baton.executor.group), each building its runner with the
``runner`` factory (``baton.interfaces.RunnerFactory``, pickled to the worker).
The group's channel is a transport plugin's (``executor.<name>.transport``). A
step's SchedulerOutput is encoded once and the same frames are sent to every
worker (the broadcast); only the driver rank answers it. The torch.distributed
rendezvous is a TCPStore the executor binds on 127.0.0.1 at a free port.

The group fails the executor when a worker exits, reports an error, misses its
heartbeats for ``heartbeat_timeout`` seconds (a stopped or frozen process), or
leaves a step unanswered for ``step_timeout`` seconds (stuck in its main
thread): every pending call raises ExecutorError and the failure callbacks run
once. Step results are resolved on the group's completer thread, so a callback
that calls ``sample_tokens`` (the core's batch queue does) never blocks the
reader it waits for. A ``collective_rpc`` target that raises fails that call alone
(the rank answers it with ``Member.reply_call_error``); a failed ``sleep``,
``wake_up`` or ``initialize_kv_cache`` fails the executor.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import deque
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, ClassVar

from baton.config import BatonConfig
from baton.errors import ExecutorError
from baton.executor import wire
from baton.executor.calls import CallBook
from baton.executor.group import WorkerGroup
from baton.executor.group_executor import GroupExecutor
from baton.executor.rank import StepCodec, rank_bootstraps
from baton.executor.wire import Kind
from baton.executor.worker_proc import worker_main
from baton.executor.workers import MultiprocSettings, pick_device, pick_transport
from baton.interfaces import RunnerFactory
from baton.protocol import ModelCapabilities, ModelInfo
from baton.runner import StockRunner

log = logging.getLogger(__name__)


class MultiprocExecutor(GroupExecutor):
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
        self._encode_lock = threading.Lock()
        self._codec = StepCodec()
        self.group: WorkerGroup | None = None
        self._store: Any = None
        self.broadcast_s: deque[float] = deque(maxlen=4096)

        device = pick_device(config, self.world_size, self.name)
        backend = s.backend if s.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
        transport = pick_transport(config, s.transport)
        self.group = WorkerGroup(
            self.name,
            transport,
            self.world_size,
            heartbeat_timeout=s.heartbeat_timeout,
            kind_names={k.value: k.name.lower() for k in Kind},
            hang_hint="executor step_timeout",
        )
        #: Each worker's last heartbeat (baton.executor.heartbeat), watched by the group's reader.
        self.heartbeats = self.group.heartbeats
        try:
            # the rendezvous: bound here, at a free port, before any worker starts
            self._store = dist.TCPStore(
                "127.0.0.1",
                0,
                None,
                True,
                timeout=timedelta(seconds=s.dist_timeout),
                wait_for_workers=False,
            )
            infos: list[wire.WorkerReady] = self.group.start(
                worker_main,
                worker_args(self, backend, device, self._store.port),
                s.startup_timeout,
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

    @property
    def procs(self) -> list[Any]:
        """The worker processes, in rank order."""
        return self.group.procs if self.group is not None else []

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

    # ------------------------------------------------------------------ GroupExecutor

    def _call(self, kind: Kind, payload: Any, **how: Any) -> Future[Any]:
        return self._group().call(kind, payload, **how)  # GroupExecutor._call's keywords

    def _book(self) -> CallBook:
        return self._group().calls

    def check_health(self) -> None:
        self._group().check_health()

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _group(self) -> WorkerGroup:
        if self.group is None:
            raise ExecutorError(f"the {self.name} executor did not start")
        return self.group

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        self._store = None


def worker_args(ex: Any, backend: str, device: str, store_port: int) -> list[Any]:
    """Each rank's RankBootstrap for executor ``ex`` (a MultiprocExecutor), in rank order:
    what ``WorkerGroup.start`` hands to ``baton.executor.worker_proc.worker_main``."""
    return rank_bootstraps(
        ex.config,
        ex.tp_size,
        ex.pp_size,
        runner=ex.runner,
        backend=backend,
        device=device,
        store_port=store_port,
        dist_timeout_s=ex.settings.dist_timeout,
    )
